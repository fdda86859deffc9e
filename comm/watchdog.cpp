#include "comm/watchdog.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/group.h"
#include "runtime/core/error.h"

namespace mt {

namespace {
using Clock = std::chrono::steady_clock;

struct Pending {
  std::string op;
  std::string group;
  Clock::time_point start;
  std::function<bool()> done;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Pending> pending;
  std::vector<std::function<void()>> abort_hooks;
  uint64_t next_id = 1;
  double timeout_s = 600;
  bool stop = false;
  std::thread thread;
};

State& state() {
  static State s;
  return s;
}

[[noreturn]] void fire(const Pending& p, double limit) {
  auto& s = state();
  std::string msg = fmt::format(
      "[comm] timeout: {} on {} did not finish within {:g} s (comm.timeout_s) on rank {} (host {}); a peer is "
      "missing, dead or stuck; aborting the job",
      p.op, p.group, limit, process_rank(), process_host());
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
  MPI_Abort(MPI_COMM_WORLD, 124);
  std::_Exit(124);
}

void loop() {
  auto& s = state();
  std::unique_lock lock(s.mu);
  while (!s.stop) {
    s.cv.wait_for(lock, std::chrono::milliseconds(100));
    if (s.stop) break;
    auto now = Clock::now();
    for (auto it = s.pending.begin(); it != s.pending.end();) {
      if (it->second.done && it->second.done()) {
        it = s.pending.erase(it);
        continue;
      }
      double waited = std::chrono::duration<double>(now - it->second.start).count();
      if (s.timeout_s > 0 && waited > s.timeout_s) {
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

uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  uint64_t id = s.next_id++;
  s.pending.emplace(id, Pending{std::move(op), std::move(where), Clock::now(), std::move(done)});
  return id;
}

uint64_t watchdog_begin(std::string op, const Group& group, std::function<bool()> done) {
  return watchdog_begin(std::move(op), group.describe(), std::move(done));
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

}  // namespace mt
