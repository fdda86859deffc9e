#include "comm/watchdog.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/group.h"
#include "runtime/core/error.h"

namespace mt {

namespace {
using Clock = std::chrono::steady_clock;

// Tag of the notice a rank that aborts the job sends to every other rank first.
constexpr int kAbortNoticeTag = 7191;
// At a timeout with no better detail, the waiting rank asks the group's other
// ranks where they are; live ones answer from their watchdog thread.
constexpr int kQueryTag = 7192, kReplyTag = 7193, kReplyLen = 1024;
constexpr double kQueryWait_s = 1.0;
// A gap this long between two 100 ms ticks means this process was suspended.
constexpr double kSuspendedGap_s = 1.0;

struct Pending {
  std::string op;
  std::string group;
  Clock::time_point start;
  std::function<bool()> done;
  std::function<std::string()> detail;
  double suspended_s = 0;  // time this process was suspended while the operation waited
  std::vector<int> ranks;  // world ranks of the group; empty: the world
  double grace_s = 0;      // waited beyond the timeout before this rank fires (watchdog_begin's grace_s)
  std::string phase;       // what the thread that began it was doing (WatchdogPhase)
  // An async operation issued and not yet waited for does not block this rank (MPI may well have completed it):
  // it neither times out nor counts as where this rank is until wait() starts (watchdog_async/watchdog_waiting).
  bool waited = true;
};

// The calling thread's phases, innermost last.
thread_local std::vector<std::string> t_phases;

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Pending> pending;
  std::vector<std::function<void()>> abort_hooks;
  uint64_t next_id = 1;
  double timeout_s = 600;
  bool stop = false;
  bool finalizing = false;  // MPI may no longer be called
  bool mpi_up = false;      // MPI_Init has returned
  bool in_mpi = false;      // the watchdog thread is inside an MPI call
  std::thread thread;
};

State& state() {
  static State s;
  return s;
}

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  if (!init) return false;
  MPI_Finalized(&fin);
  if (fin) return false;
  std::lock_guard lock(state().mu);
  return !state().finalizing;
}

std::string rank_str() {
  int r = process_rank();
  return r >= 0 ? fmt::format("rank {} (host {})", r, process_host())
                : fmt::format("pid {} (before MPI_Init)", ::getpid());
}

// Tells every other rank that this one aborts the job, so that a rank resumed
// later blames no one; bounded to 200 ms, as peers may be stopped or dead.
void send_abort_notice() {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  static int notice = 0;
  notice = me;
  std::vector<MPI_Request> reqs;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    MPI_Request q;
    if (MPI_Isend(&notice, 1, MPI_INT, r, kAbortNoticeTag, MPI_COMM_WORLD, &q) == MPI_SUCCESS) reqs.push_back(q);
  }
  auto until = Clock::now() + std::chrono::milliseconds(200);
  int flag = 0;
  while (!flag && Clock::now() < until) {
    MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Ranks whose state a reply or a chain search lists at most (the chain search stops there too).
constexpr size_t kMaxRanks = 64, kMaxQueried = 1024;

// A peer's answer to "where are you": waiting (in which calls, on which world ranks), in no collective, or no
// answer at all (stopped or dead). Sent as text: "W <ranks or *>|<description>" or "N|in no collective".
struct Answer {
  bool answered = false, waiting = false, all = false;  // all: waits on the whole world
  std::vector<int> on;
  std::string text;
};

Answer parse_answer(const char* text) {
  Answer a;
  a.answered = true;
  std::string t(text);
  size_t bar = t.find('|');
  a.text = bar == std::string::npos ? t : t.substr(bar + 1);
  if (t.rfind("W ", 0) != 0 || bar == std::string::npos) return a;
  a.waiting = true;
  std::string list = t.substr(2, bar - 2);
  if (list == "*") a.all = true;
  for (size_t i = 0; i < list.size();) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    if (j > i && list[i] != '*') a.on.push_back(std::atoi(list.substr(i, j - i).c_str()));
    i = j + 1;
  }
  return a;
}

std::string describe_pending(const Pending& p, Clock::time_point now) {
  return fmt::format("in {} on {}{} for {:.1f} s", p.op, p.group, p.phase.empty() ? "" : " while " + p.phase,
                     std::chrono::duration<double>(now - p.start).count());
}

// This rank's answer: every pending operation, oldest first, and the union of the ranks they wait on.
std::string my_answer() {
  std::lock_guard lock(state().mu);
  std::vector<const Pending*> ps;
  for (auto& [id, p] : state().pending)
    if (p.waited) ps.push_back(&p);
  if (ps.empty()) return "N|in no collective";
  std::sort(ps.begin(), ps.end(), [](auto* a, auto* b) { return a->start < b->start; });
  auto now = Clock::now();
  bool all = false;
  std::vector<int> on;
  for (auto* p : ps) {
    if (p->ranks.empty()) all = true;
    for (int r : p->ranks)
      if (r != process_rank() && std::find(on.begin(), on.end(), r) == on.end()) on.push_back(r);
  }
  std::string list;
  if (all || on.size() > kMaxRanks) list = "*";
  else
    for (int r : on) list += (list.empty() ? "" : ",") + std::to_string(r);
  std::string text = describe_pending(*ps[0], now);
  for (size_t i = 1; i < ps.size(); ++i) {
    std::string more = fmt::format("; also {}", describe_pending(*ps[i], now));
    if (text.size() + more.size() > size_t(kReplyLen) - 80) {
      text += fmt::format("; and {} more", ps.size() - i);
      break;
    }
    text += more;
  }
  return fmt::format("W {}|{}", list, text);
}

// Answers the "where are you" queries of peers that timed out. Sends are kept until they complete.
void answer_queries() {
  struct Reply {
    MPI_Request req;
    char text[kReplyLen];
  };
  static std::vector<std::unique_ptr<Reply>> replies;
  for (auto it = replies.begin(); it != replies.end();) {
    int done = 0;
    MPI_Test(&(*it)->req, &done, MPI_STATUS_IGNORE);
    it = done ? replies.erase(it) : it + 1;
  }
  for (;;) {
    int flag = 0, dummy = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
    MPI_Recv(&dummy, 1, MPI_INT, st.MPI_SOURCE, kQueryTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    auto r = std::make_unique<Reply>();
    std::snprintf(r->text, kReplyLen, "%s", my_answer().c_str());
    if (MPI_Isend(r->text, kReplyLen, MPI_CHAR, st.MPI_SOURCE, kReplyTag, MPI_COMM_WORLD, &r->req) == MPI_SUCCESS)
      replies.push_back(std::move(r));
  }
}

// A peer aborted the job while this rank was searching: it has printed the report, so this one stays silent.
void leave_if_reported() {
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
  std::this_thread::sleep_for(std::chrono::seconds(3));  // its MPI_Abort ends this process first
  std::_Exit(124);
}

// Asks these ranks where they are and waits up to kQueryWait_s: a rank that does not answer is stopped or dead.
// Unanswered requests are left pending: the job is about to abort.
std::vector<Answer> query(const std::vector<int>& ranks) {
  static int q = 0;
  auto buffers = std::make_shared<std::vector<std::array<char, kReplyLen>>>(ranks.size());
  auto& text = *buffers;
  std::vector<MPI_Request> recvs(ranks.size(), MPI_REQUEST_NULL), sends(ranks.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ranks.size(); ++i) {
    MPI_Irecv(text[i].data(), kReplyLen, MPI_CHAR, ranks[i], kReplyTag, MPI_COMM_WORLD, &recvs[i]);
    MPI_Isend(&q, 1, MPI_INT, ranks[i], kQueryTag, MPI_COMM_WORLD, &sends[i]);
  }
  std::vector<Answer> out(ranks.size());
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kQueryWait_s));
  size_t got = 0;
  while (got < ranks.size() && Clock::now() < until) {
    answer_queries();  // peers timing out at the same moment ask this rank too
    leave_if_reported();
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (out[i].answered) continue;
      int flag = 0;
      MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
      if (!flag) continue;
      text[i][kReplyLen - 1] = '\0';
      out[i] = parse_answer(text[i].data());
      ++got;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // A late answer (a stopped rank resumed) still lands in these buffers: never freed when one is missing.
  if (got < ranks.size()) (void)new std::shared_ptr<std::vector<std::array<char, kReplyLen>>>(buffers);
  return out;
}

std::string rank_list(const std::vector<int>& r) {
  std::string s;
  for (size_t i = 0; i < r.size() && i < 16; ++i) s += (i ? "," : "") + std::to_string(r[i]);
  if (r.size() > 16) s += fmt::format(" and {} more", r.size() - 16);
  return fmt::format("world rank{} {}", r.size() > 1 ? "s" : "", s);
}

// At a timeout: follows the chain of waiting ranks from this operation's peers (each waiting peer says on which
// ranks it waits) to the ranks that are not waiting, the culprits: those that do not answer (stopped or dead),
// else those in no collective. The healthy ranks between are named only as the path. found: a culprit was found.
std::string find_culprit(const Pending& p, bool* found) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  auto everyone = [&] {
    std::vector<int> v;
    for (int r = 0; r < n; ++r) v.push_back(r);
    return v;
  };
  std::vector<int> frontier = p.ranks.empty() ? everyone() : p.ranks;
  {
    // This rank's other pending operations (a receive beside an async collective) wait on their ranks too.
    std::lock_guard lock(state().mu);
    for (auto& [id, q] : state().pending)
      if (q.waited)
        for (int r : q.ranks.empty() ? everyone() : q.ranks)
        if (std::find(frontier.begin(), frontier.end(), r) == frontier.end()) frontier.push_back(r);
  }
  frontier.erase(std::remove(frontier.begin(), frontier.end(), me), frontier.end());
  *found = false;
  if (frontier.empty()) return "a peer is missing, dead or stuck";
  const std::vector<int> direct = frontier;
  std::map<int, Answer> known;
  std::map<int, int> via;  // rank -> the waiting rank that led to it (-1: a peer of this operation)
  for (int r : frontier) via[r] = -1;
  for (int level = 0; !frontier.empty() && level < 8 && known.size() < kMaxQueried; ++level) {
    std::vector<Answer> a = query(frontier);
    // A healthy rank between two calls soon waits again: ask the ones in no collective twice more.
    for (int again = 0; again < 2; ++again) {
      std::vector<size_t> idle;
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i].answered && !a[i].waiting) idle.push_back(i);
      if (idle.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      std::vector<int> ask;
      for (size_t i : idle) ask.push_back(frontier[i]);
      std::vector<Answer> b = query(ask);
      for (size_t k = 0; k < idle.size(); ++k)
        if (b[k].answered) a[idle[k]] = b[k];
    }
    std::vector<int> next;
    for (size_t i = 0; i < frontier.size(); ++i) {
      known[frontier[i]] = a[i];
      if (!a[i].waiting) continue;
      for (int r : a[i].all ? everyone() : a[i].on)
        if (r != me && r >= 0 && r < n && !via.count(r) && known.size() + next.size() < kMaxQueried) {
          via[r] = frontier[i];
          next.push_back(r);
        }
    }
    frontier = std::move(next);
  }
  std::vector<int> silent, idle;
  for (auto& [r, a] : known)
    if (!a.answered) silent.push_back(r);
    else if (!a.waiting) idle.push_back(r);
  auto path = [&](int culprit) {
    std::vector<int> chain;
    for (int r = via[culprit]; r >= 0; r = via[r]) chain.push_back(r);
    std::reverse(chain.begin(), chain.end());
    std::string s;
    for (int r : chain)
      s += fmt::format("{}world rank {} ({})", s.empty() ? "" : ", which waits on ", r, known[r].text);
    return s;
  };
  auto name = [&](const std::vector<int>& culprits, const std::string& what) {
    std::vector<int> near, far;
    for (int r : culprits) (via[r] < 0 ? near : far).push_back(r);
    std::string s;
    if (!near.empty()) s = fmt::format("{} did not arrive and {}", rank_list(near), what);
    if (!far.empty())
      s += fmt::format("{}{} {}; this rank waits on {} through {}", s.empty() ? "" : "; ", rank_list(far), what,
                       far.size() > 1 ? "them" : "it", path(far[0]));
    return s;
  };
  int same = 0;
  std::string same_prefix = fmt::format("in {} on {}", p.op, p.group);
  for (int r : direct)
    if (known.count(r) && known[r].text.rfind(same_prefix, 0) == 0) ++same;
  std::string tail = direct.size() > 1 ? fmt::format(" ({} of {} peers wait in it too)", same, direct.size()) : "";
  if (!silent.empty()) {
    *found = true;
    return name(silent, fmt::format("did not answer within {:g} s (stopped or dead)", kQueryWait_s)) + tail;
  }
  if (!idle.empty()) {
    *found = true;
    std::string s = name(idle, "is in no collective (busy, or stuck outside communication)");
    return s + tail;
  }
  // Everyone reached waits: on each other, in the same call (a peer stuck inside it) or in different ones.
  std::string calls;
  int shown = 0;
  bool differ = false;
  for (auto& [r, a] : known) {
    if (a.text.rfind(same_prefix, 0) != 0) differ = true;
    if (shown++ < 8) calls += fmt::format("; world rank {} is {}", r, a.text);
  }
  if (differ)
    return "every rank reached waits on another, in different calls (the ranks took different paths)" + calls;
  return "every peer answered from inside this call (a peer stuck inside it?)" + tail;
}

[[noreturn]] void fire(const Pending& p, double limit) {
  auto& s = state();
  // The culprit first: a rank that is itself waiting is never the one named.
  std::string why;
  bool found = false;
  if (mpi_usable()) why = find_culprit(p, &found);
  if (!found && p.detail) why = p.detail();
  if (why.empty()) why = "a peer is missing, dead or stuck";
  {
    std::lock_guard lock(s.mu);
    auto now = Clock::now();
    int more = 0;
    for (auto& [id, q] : s.pending)
      if (q.waited && (q.start != p.start || q.op != p.op))
        if (more++ < 4) why += fmt::format("; this rank is also {}", describe_pending(q, now));
  }
  if (p.suspended_s > 0)
    why += fmt::format(" (this rank was itself suspended for {:.1f} s while it waited; that time is not counted)",
                       p.suspended_s);
  std::string msg = fmt::format(
      "[comm] timeout: {} on {}{} did not finish within {:g} s (comm.timeout_s) on {}; {}; "
      "aborting the job",
      p.op, p.group, p.phase.empty() ? "" : " while " + p.phase, limit, rank_str(), why);
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard lock(s.mu);
    hooks = s.abort_hooks;
  }
  for (auto& h : hooks) h();
  // If MPI_Abort itself cannot reach the runtime, exit anyway.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(124);
  }).detach();
  // Before MPI_Init or during MPI_Finalize there is no MPI to abort through.
  if (!mpi_usable()) std::_Exit(124);
  send_abort_notice();
  MPI_Abort(MPI_COMM_WORLD, 124);
  std::_Exit(124);
}

// After a suspension: if a peer aborted the job meanwhile, say that this rank
// was the late one and leave, rather than time out later blaming the peers.
void check_abort_notice(double suspended_s) {
  if (!mpi_usable()) return;
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
  int who = -1;
  MPI_Recv(&who, 1, MPI_INT, st.MPI_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  std::fprintf(stderr,
               "[comm] %s was suspended for %.1f s (SIGSTOP or a paused machine); meanwhile rank %d aborted the job "
               "after a timeout: this rank was the late one, not its peers\n",
               rank_str().c_str(), suspended_s, who);
  std::fflush(stderr);
  std::_Exit(124);
}

void loop() {
  auto& s = state();
  std::unique_lock lock(s.mu);
  auto last = Clock::now(), probe_until = last;
  double suspended_s = 0;
  while (!s.stop) {
    s.cv.wait_for(lock, std::chrono::milliseconds(100));
    if (s.stop) break;
    auto now = Clock::now();
    // A long gap between ticks: this process did not run (stopped, or the
    // machine paused it). Peers did not make it wait then.
    double gap = std::chrono::duration<double>(now - last).count();
    last = now;
    if (gap > kSuspendedGap_s) {
      for (auto& [id, p] : s.pending) {
        auto shift =
            std::min(now - p.start, std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap)));
        p.start += shift;
        p.suspended_s += std::chrono::duration<double>(shift).count();
      }
      suspended_s = gap;
      probe_until = now + std::chrono::seconds(3);
    }
    if (!s.finalizing && s.mpi_up) {
      s.in_mpi = true;
      lock.unlock();
      if (now < probe_until) check_abort_notice(suspended_s);
      answer_queries();
      lock.lock();
      s.in_mpi = false;
      s.cv.notify_all();
      if (s.stop) break;
    }
    for (auto it = s.pending.begin(); it != s.pending.end();) {
      if (it->second.done && it->second.done()) {
        it = s.pending.erase(it);
        continue;
      }
      double waited = std::chrono::duration<double>(now - it->second.start).count();
      if (s.timeout_s > 0 && it->second.waited && waited > s.timeout_s + it->second.grace_s) {
        Pending p = it->second;
        double limit = s.timeout_s;
        lock.unlock();
        fire(p, limit);
      }
      ++it;
    }
  }
}
}  // namespace

void watchdog_set_timeout(double seconds) {
  std::lock_guard lock(state().mu);
  state().timeout_s = seconds;
}

double watchdog_timeout() {
  std::lock_guard lock(state().mu);
  return state().timeout_s;
}

void watchdog_add_abort_hook(std::function<void()> hook) {
  std::lock_guard lock(state().mu);
  state().abort_hooks.push_back(std::move(hook));
}

namespace {
// Registers the operation with its ranks in one critical section: the watchdog's thread erases an entry whose
// done() already holds (an async device operation can finish at once), so nothing may look the id up afterwards.
uint64_t begin_pending(std::string op, std::string where, std::function<bool()> done,
                       std::function<std::string()> detail, double grace_s, std::vector<int> ranks) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  uint64_t id = s.next_id++;
  std::string phase;
  for (auto& ph : t_phases) phase += (phase.empty() ? "" : ", ") + ph;
  s.pending.emplace(id, Pending{std::move(op), std::move(where), Clock::now(), std::move(done), std::move(detail), 0.0,
                                std::move(ranks), grace_s, std::move(phase)});
  return id;
}
}  // namespace

uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done,
                        std::function<std::string()> detail, double grace_s) {
  return begin_pending(std::move(op), std::move(where), std::move(done), std::move(detail), grace_s, {});
}

uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done) {
  return watchdog_begin(std::move(op), std::move(where), std::move(done), {});
}

uint64_t watchdog_begin(std::string op, const Group& group, std::function<bool()> done) {
  return begin_pending(std::move(op), group.describe(), std::move(done), {}, 0, group.world_ranks());
}

void watchdog_set_ranks(uint64_t id, std::vector<int> world_ranks) {
  std::lock_guard lock(state().mu);
  if (auto it = state().pending.find(id); it != state().pending.end()) it->second.ranks = std::move(world_ranks);
}

void watchdog_async(uint64_t id) {
  std::lock_guard lock(state().mu);
  if (auto it = state().pending.find(id); it != state().pending.end()) it->second.waited = false;
}

void watchdog_waiting(uint64_t id) {
  std::lock_guard lock(state().mu);
  // Timed from here: until now the rank was not waiting for it (a receive posted a step ahead is no hang).
  if (auto it = state().pending.find(id); it != state().pending.end() && !it->second.waited)
    it->second.waited = true, it->second.start = Clock::now(), it->second.suspended_s = 0;
}

WatchdogPhase::WatchdogPhase(std::string text) { t_phases.push_back(std::move(text)); }
WatchdogPhase::~WatchdogPhase() { t_phases.pop_back(); }

void watchdog_end(uint64_t id) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  s.pending.erase(id);
}

void watchdog_start() {
  auto& s = state();
  std::lock_guard lock(s.mu);
  if (s.thread.joinable()) return;
  s.stop = false;
  s.thread = std::thread(loop);
}

void watchdog_stop() {
  auto& s = state();
  {
    std::lock_guard lock(s.mu);
    if (!s.thread.joinable()) return;
    s.stop = true;
  }
  s.cv.notify_all();
  s.thread.join();
}

void watchdog_mpi_ready() {
  std::lock_guard lock(state().mu);
  state().mpi_up = true;
}

void watchdog_mpi_finalizing() {
  auto& s = state();
  std::unique_lock lock(s.mu);
  s.finalizing = true;
  s.cv.wait(lock, [&] { return !s.in_mpi; });  // MPI_Finalize must not overlap the thread's probes
}

}  // namespace mt
