// What `meshtrain plan` prints of a built run (make_train_run without data): the plan's layouts, then the bytes
// one step communicates per rank, counted by the runtime on a real forward and backward of a random batch and set
// beside the analytic count each parallelism declares next to its code (tp with sequence parallel, cp, expert
// parallel, fully_shard, the gradient buckets, the pipeline's sends). The counted figures compared are those of
// each parallelism's own tag, so a collective another part of the step adds cannot hide a difference. Printing is
// on stdout, and is the caller's to do on one rank.
#pragma once
#include "comm/comm_counters.h"
#include "models/model.h"
#include "runtime/train/run.h"

namespace mt {

// The model (and its experts over ep), the mesh and what each dim means, cp's split of the sequence, every
// parameter's placements and local shape on each tp rank, fully_shard's units and decisions, every module's layout
// hooks; under pipeline parallel the stages, the bubble and each rank's timeline. No communication.
void print_plan_layouts(const TrainRun& run);

// What one step sent from this rank, by phase, and the routing it took (an MoE model).
struct MeasuredStep {
  CommCounters forward;   // under pipeline parallel: the whole schedule, forward and backward
  CommCounters backward;  // empty under pipeline parallel
  CommCounters sync;      // the gradient sync after it
  RouterStepStats router;
};

// One micro-batch's forward and backward of a random batch (a fixed seed: the same tokens on every rank), or
// under pipeline parallel the schedule over a whole random batch, then the gradient sync; each phase counted.
// Collective over the run's ranks; it leaves gradients in the parameters.
MeasuredStep measure_plan_step(TrainRun& run);

// The counted bytes of each phase and collective (with a "bytes[phase] tag= group= kind= calls= bytes=" line per
// entry, for scripts), each parallelism's measured figure beside its analytic one ("equal" / "DIFFERENT"), and
// MoE's routing (a "moe_load[layer]" line per sparse layer).
void print_plan_bytes(const TrainRun& run, const MeasuredStep& step);

}  // namespace mt
