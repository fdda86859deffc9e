// What `meshtrain train` reports beside its steps: the kernel profile (MT_PROFILE_KERNELS) and, after a traced
// range, the memory track's peak by part beside `meshtrain estimate`'s.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/env.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/io/config.h"
#include "runtime/train/metrics.h"
#include "runtime/train/trace_file.h"
#include "runtime/train/trainer.h"

namespace mt {

// MT_PROFILE_KERNELS=1: every op's time per step (kernel_profile.h), over the last MT_PROFILE_STEPS steps (by
// default all but the first, a warm-up, when more follow); the steps before run muted, as without profiling. The
// top 10 are printed at the end with the device memory, and recorded in the metrics.
struct StepProfiler {
  const TrainRun& run;
  const MpiEnv& env;
  MetricsLogger& log;
  int64_t first_profiled = 0, profiled_steps = 0;
  double profiled_wall_s = 0;

  StepProfiler(const TrainRun& r, const MpiEnv& e, MetricsLogger& l, int64_t steps) : run(r), env(e), log(l) {
    first_profiled = steps - run.start_step > 1 ? run.start_step + 1 : run.start_step;
    if (const char* v = std::getenv("MT_PROFILE_STEPS"); v && *v)
      first_profiled = std::max(run.start_step, steps - std::max<int64_t>(1, std::atoll(v)));
  }
  void step(int64_t step, double dt) {
    if (!kprof::enabled() || step < first_profiled) return;
    kprof::flush();  // waits for the device: between steps, after the step's own host-sync count
    ++profiled_steps;
    profiled_wall_s += dt;
  }
  void report() {
    if (run.device.is_cuda() && env.rank() == 0) {
      AllocatorStats m = allocator_stats(run.device);
      log.note(fmt::format(
          "device memory on rank 0: peak allocated {:.3f} GiB, reserved {:.3f} GiB ({} cudaMalloc calls)",
          double(m.peak_allocated_bytes) / (1 << 30), double(m.reserved_bytes) / (1 << 30), m.driver_allocs));
      log.record({{"peak_allocated_bytes", m.peak_allocated_bytes}, {"reserved_bytes", m.reserved_bytes}});
    }
    if (!kprof::enabled() || env.rank() != 0) return;
    kprof::flush();
    // The H200's dense bf16 peak and HBM3e bandwidth give the ridge point on a GPU; on the CPU no bandwidth is
    // known, so no bound is estimated.
    const bool gpu = run.device.is_cuda();
    std::string what = fmt::format(
        "MT_PROFILE_KERNELS=1, rank 0, steps {} to {}, {:.3f} ms wall per step; {}", first_profiled + 1,
        first_profiled + profiled_steps, profiled_steps ? 1e3 * profiled_wall_s / double(profiled_steps) : 0.0,
        gpu ? "CUDA events around each launch on its stream (ops overlap only across streams: NCCL's)"
            : "host clock around each op");
    std::string table = kprof::report(10, profiled_steps, gpu ? 989e12 : 0, gpu ? 4.8e12 : 0, what);
    if (!table.empty() && table.back() == '\n') table.pop_back();
    log.note(table);
    nlohmann::json ops = nlohmann::json::array();
    for (const kprof::OpStat& o : kprof::stats())
      ops.push_back({{"op", o.name}, {"calls", o.calls}, {"ms", o.ms}, {"flops", o.flops}, {"bytes", o.bytes}});
    log.record({{"kernel_profile", ops}, {"profiled_steps", profiled_steps}, {"wall_ms", 1e3 * profiled_wall_s}});
  }
};

// After the traced range (issue 40 part 3): rank 0's memory track at its peak, by part, beside `meshtrain
// estimate`'s parts for the same config (its pp stage 0, which rank 0 holds): the estimate's parameters and compute
// copies, gradients, optimizer moments, and the rest (buckets, activations, temporaries) against the track's.
void log_memory_beside_estimate(const Config& cfg, const MpiEnv& env, const RunTrace& tr, MetricsLogger& log);

}  // namespace mt
