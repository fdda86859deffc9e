#include "comm/watchdog.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
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
constexpr int kQueryTag = 7192, kReplyTag = 7193, kReplyLen = 160;
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
};

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

// Answers the "where are you" queries of peers that timed out: this rank's
// oldest pending operation. Sends are kept until they complete.
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
    std::string where = "in no collective";
    {
      std::lock_guard lock(state().mu);
      const Pending* oldest = nullptr;
      for (auto& [id, p] : state().pending)
        if (!oldest || p.start < oldest->start) oldest = &p;
      if (oldest)
        where = fmt::format("in {} on {} for {:.1f} s", oldest->op, oldest->group,
                            std::chrono::duration<double>(Clock::now() - oldest->start).count());
    }
    std::snprintf(r->text, kReplyLen, "%s", where.c_str());
    if (MPI_Isend(r->text, kReplyLen, MPI_CHAR, st.MPI_SOURCE, kReplyTag, MPI_COMM_WORLD, &r->req) == MPI_SUCCESS)
      replies.push_back(std::move(r));
  }
}

// Asks the other ranks of the group where they are and waits up to
// kQueryWait_s: a rank that does not answer is stopped or dead.
std::string ask_peers(const std::vector<int>& group, const std::string& op, const std::string& where) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<int> peers;
  if (group.empty())
    for (int r = 0; r < n; ++r) peers.push_back(r);
  else peers = group;
  peers.erase(std::remove(peers.begin(), peers.end(), me), peers.end());
  if (peers.empty()) return "a peer is missing, dead or stuck";
  static int query = 0;
  std::vector<std::array<char, kReplyLen>> text(peers.size());
  std::vector<MPI_Request> recvs(peers.size(), MPI_REQUEST_NULL), sends(peers.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < peers.size(); ++i) {
    MPI_Irecv(text[i].data(), kReplyLen, MPI_CHAR, peers[i], kReplyTag, MPI_COMM_WORLD, &recvs[i]);
    MPI_Isend(&query, 1, MPI_INT, peers[i], kQueryTag, MPI_COMM_WORLD, &sends[i]);
  }
  std::vector<char> answered(peers.size(), 0);
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kQueryWait_s));
  size_t got = 0;
  while (got < peers.size() && Clock::now() < until) {
    answer_queries();  // peers timing out at the same moment ask this rank too
    for (size_t i = 0; i < peers.size(); ++i) {
      if (answered[i]) continue;
      int flag = 0;
      MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
      if (flag) answered[i] = 1, ++got;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Unanswered requests are left pending: the job is about to abort.
  // Peers waiting in the same call are fine; the others are named.
  std::string same = fmt::format("in {} on {} ", op, where), missing, elsewhere;
  int waiting = 0, shown = 0;
  for (size_t i = 0; i < peers.size(); ++i) {
    text[i][kReplyLen - 1] = '\0';
    if (!answered[i]) {
      missing += (missing.empty() ? "" : ",") + std::to_string(peers[i]);
    } else if (std::string(text[i].data()).rfind(same, 0) == 0) {
      ++waiting;
    } else if (shown++ < 8) {
      elsewhere += fmt::format("{}world rank {} did not arrive: it is {}", elsewhere.empty() ? "" : "; ", peers[i],
                               text[i].data());
    }
  }
  std::string r;
  if (!missing.empty())
    r = fmt::format("world rank{} {} did not arrive and did not answer within {:g} s (stopped or dead)",
                    missing.find(',') == std::string::npos ? "" : "s", missing, kQueryWait_s);
  if (!elsewhere.empty()) r += (r.empty() ? "" : "; ") + elsewhere;
  if (r.empty()) r = "every peer answered from inside this call (a peer stuck inside it?)";
  return r + fmt::format(" ({} of {} peers wait in it too)", waiting, peers.size());
}

[[noreturn]] void fire(const Pending& p, double limit) {
  auto& s = state();
  std::string why = p.detail       ? p.detail()
                    : mpi_usable() ? ask_peers(p.ranks, p.op, p.group)
                                   : "a peer is missing, dead or stuck";
  if (p.suspended_s > 0)
    why += fmt::format(" (this rank was itself suspended for {:.1f} s while it waited; that time is not counted)",
                       p.suspended_s);
  std::string msg = fmt::format(
      "[comm] timeout: {} on {} did not finish within {:g} s (comm.timeout_s) on {}; {}; "
      "aborting the job",
      p.op, p.group, limit, rank_str(), why);
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
      if (s.timeout_s > 0 && waited > s.timeout_s + it->second.grace_s) {
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

uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done,
                        std::function<std::string()> detail, double grace_s) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  uint64_t id = s.next_id++;
  s.pending.emplace(id, Pending{std::move(op), std::move(where), Clock::now(), std::move(done), std::move(detail),
                                0.0, {}, grace_s});
  return id;
}

uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done) {
  return watchdog_begin(std::move(op), std::move(where), std::move(done), {});
}

uint64_t watchdog_begin(std::string op, const Group& group, std::function<bool()> done) {
  uint64_t id = watchdog_begin(std::move(op), group.describe(), std::move(done));
  std::lock_guard lock(state().mu);
  state().pending.at(id).ranks = group.world_ranks();
  return id;
}

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

void fault_stop_point(std::string_view label) {
  static const char* spec = std::getenv("MT_FAULT_STOP_AT");
  static bool fired = false;
  if (!spec || !*spec || fired) return;
  std::string_view v(spec);
  size_t colon = v.rfind(':');
  if (colon == std::string_view::npos) return;
  std::string_view point = v.substr(0, colon);
  int rank = std::atoi(std::string(v.substr(colon + 1)).c_str());
  // Before MPI_Init this process knows its rank only from the launcher.
  int me = process_rank();
  if (me < 0)
    for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"})
      if (const char* v = std::getenv(var); v && *v) {
        me = std::atoi(v);
        break;
      }
  if (rank != me || label.substr(0, point.size()) != point) return;
  fired = true;
  std::fprintf(stderr, "[fault] MT_FAULT_STOP_AT=%s: rank %d (pid %d) stops itself at '%.*s'\n", spec, rank,
               int(::getpid()), int(label.size()), label.data());
  std::fflush(stderr);
  std::raise(SIGSTOP);
}

}  // namespace mt
