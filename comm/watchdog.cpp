// The watchdog's registry and its thread: operations register while they are in flight, the thread looks at them
// every 100 ms, discounts the time this process was suspended, answers peers that ask where it is, and fires at a
// timeout: names the culprit (watchdog_culprit.cpp), runs the abort hooks, tells the peers and aborts the job.
#include "comm/watchdog.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/group.h"
#include "comm/watchdog_internal.h"
#include "runtime/core/error.h"

namespace mt {

namespace watchdog_detail {
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

std::string describe_pending(const Pending& p, Clock::time_point now) {
  return fmt::format("in {} on {}{} for {:.1f} s", p.op, p.group, p.phase.empty() ? "" : " while " + p.phase,
                     std::chrono::duration<double>(now - p.start).count());
}
}  // namespace watchdog_detail

using namespace watchdog_detail;

namespace {
// A gap this long between two 100 ms ticks means this process was suspended.
constexpr double kSuspendedGap_s = 1.0;

// The calling thread's phases, innermost last.
thread_local std::vector<std::string> t_phases;

[[noreturn]] void fire(const Pending& p, double limit) {
  auto& s = state();
  // The culprit first: a rank that is itself waiting is never the one named.
  std::string why;
  bool found = false;
  if (!p.silent_why.empty()) why = p.silent_why, found = true;  // search_early's: a rank that did not answer
  else if (mpi_usable()) why = find_culprit(p, &found);
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
  // How long it waited by now, culprit search included: what the detection took (tests/cli/test_hang.sh bounds it).
  const double waited_s = std::chrono::duration<double>(Clock::now() - p.start).count();
  std::string msg = fmt::format(
      "[comm] timeout: {} on {}{} did not finish within {:g} s (comm.timeout_s) on {}; {}; "
      "aborting the job after {:.1f} s",
      p.op, p.group, p.phase.empty() ? "" : " while " + p.phase, limit, rank_str(), why, waited_s);
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

// The culprit search for an operation about to time out, begun kQueryWait_s (at most half the limit) before it: a
// stopped rank's silence holds the search kQueryWait_s, which then ends with the timeout instead of after it. Only a
// rank that did not answer is kept for fire(); any other finding may change meanwhile and is searched again then.
// Called with the lock held, returns with it held; the registry may have changed meanwhile.
void search_early(std::unique_lock<std::mutex>& lock, uint64_t id) {
  auto& s = state();
  s.pending.at(id).searched = true;
  const Pending p = s.pending.at(id);
  s.in_mpi = true;
  lock.unlock();
  bool found = false, silent = false;
  std::string why = find_culprit(p, &found, &silent);
  lock.lock();
  s.in_mpi = false;
  s.cv.notify_all();
  if (auto it = s.pending.find(id); it != s.pending.end() && silent) it->second.silent_why = std::move(why);
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
      const double limit = s.timeout_s + it->second.grace_s;
      if (s.timeout_s > 0 && it->second.waited && waited > limit) {
        Pending p = it->second;
        double timeout = s.timeout_s;
        lock.unlock();
        fire(p, timeout);
      }
      if (s.timeout_s > 0 && it->second.waited && !it->second.searched && s.mpi_up && !s.finalizing &&
          waited > limit - std::min(kQueryWait_s, limit / 2)) {
        search_early(lock, it->first);
        last = Clock::now();  // the search's time is not a suspension of this process
        break;                // the registry may have changed: the next tick goes on
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
