// What `meshtrain train` reports beside its steps: the run's set-up (model, mesh, data, the model state against
// the layouts' count), where the process's wall time went (the run's goodput), and the kernel profile
// (MT_PROFILE_KERNELS).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/env.h"
#include "runtime/train/metrics.h"
#include "runtime/train/run.h"

namespace mt {

// Where this process's wall time went (rank 0's clock): set-up and loading before the first step, the steps, the
// time the loop was held by checkpoints, evaluation and samples; the rest is "other" (the per-step agreement,
// metrics). A supervisor adds up its attempts' (runtime/supervise).
struct RunGoodput {
  double setup_s = 0, load_s = 0, steps_s = 0, checkpoint_s = 0, eval_s = 0;
  nlohmann::json record() const;  // {"event": "goodput", "scope": "run", ...}
  std::string line() const;
};

// The launch's set-up, from the process's start to the first step done, by part (runtime/core/startup.h's marks:
// exec and loading, MPI start-up, the config, the mesh and its groups, the model, the checkpoint load or init, the
// CPU GEMM peak, the set-up report, the first step): one line for the log, and the metrics record
// {"event": "setup", "time", "start_step", "total_s", "parts": [{"part", "s"}, ...] in order, "peak"} whose parts
// add up to total_s. peak: where the MFU's peak came from ("probed", "cached", "device").
struct SetupTimeline {
  nlohmann::json record;
  std::string line;
};
SetupTimeline setup_timeline(int64_t start_step, const std::string& peak);

// What the run is, printed by rank 0 once it is built and loaded: the model, the mesh, the data, the gradient
// sync, the executor, the model state against the count its layouts give, mixed precision, resident memory.
void log_setup(const Config& cfg, const MpiEnv& env, const TrainRun& run, double flops_per_token, double peak);

// One line for the terminal: control bytes shown as escapes.
std::string printable(const std::string& s);

// MT_PROFILE_KERNELS=1: every op's time per step (kernel_profile.h), over the last MT_PROFILE_STEPS steps (by
// default all but the first, a warm-up, when more follow); the steps before run muted, as without profiling. The
// top 10 are printed at the end with the device memory, and recorded in the metrics.
struct StepProfiler {
  const TrainRun& run;
  const MpiEnv& env;
  MetricsLogger& log;
  int64_t first_profiled = 0, profiled_steps = 0;
  double profiled_wall_s = 0;

  StepProfiler(const TrainRun& r, const MpiEnv& e, MetricsLogger& l, int64_t steps);
  void step(int64_t step, double dt);
  void report();
};

}  // namespace mt
