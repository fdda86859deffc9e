#include "runtime/train/step_control.h"

#include <algorithm>
#include <atomic>
#include <csignal>

#include "comm/world.h"

namespace mt {

namespace {

std::atomic<int> g_stop_signal{0};

// A second Ctrl-C does not wait for the step to end: the default action, at once.
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_signal.load() != 0) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
  }
  g_stop_signal = sig;
}

}  // namespace

void catch_stop_signals() {
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) std::signal(s, on_stop_signal);
}

int stop_signal_received() { return g_stop_signal.load(); }

AgreedControl agree_step_control(const StepControl& mine) {
  const std::vector<StepControl> all = world::all_gather(mine, "stop-signal all_reduce");
  AgreedControl a;
  a.times.reserve(all.size());
  for (const StepControl& c : all) {
    a.stop_signal = std::max(a.stop_signal, int(c.stop_signal));
    a.checkpoint_due = a.checkpoint_due || c.checkpoint_due != 0;
    a.writing = a.writing || c.writing != 0;
    if (c.trace_full && a.trace_full_rank < 0) a.trace_full_rank = int(a.times.size());
    a.times.push_back({c.compute_s, c.wait_s, int(c.pp_coord)});
  }
  return a;
}

}  // namespace mt
