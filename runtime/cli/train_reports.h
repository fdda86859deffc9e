// What `meshtrain train` reports that needs the planner: after a traced range, the memory track's peak by part
// beside `meshtrain estimate`'s.
#pragma once
#include "comm/env.h"
#include "runtime/train/metrics.h"
#include "runtime/train/run_config.h"
#include "runtime/train/trace_file.h"

namespace mt {

// Rank 0's memory track at its peak, by part, beside `meshtrain estimate`'s parts for the same config (its pp
// stage 0, which rank 0 holds): the estimate's parameters and compute copies, gradients, optimizer moments, and the
// rest (buckets, activations, temporaries) against the track's.
void log_memory_beside_estimate(const Config& cfg, const MpiEnv& env, const RunTrace& tr, MetricsLogger& log);

}  // namespace mt
