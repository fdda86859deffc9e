// Pipeline parallel's runtime (parallel.pp > 1), the run's StepExecutor (step_executor.h) under pipeline parallel:
// this rank runs its stages' model chunks (CausalLM::keep_chunks)
// and, each step, its list of the schedule's actions (parallel/pipeline_schedule.h) in order: forwards and
// backwards of micro-batches, and the activations and gradients between neighbouring stages sent and received
// through the pp Group, non-blocking (a receive is posted when the schedule says, waited for by the action that
// needs it), tagged "pp" in the counters and watched: a stuck transfer names the stage, the micro-batch and the
// peer. The schedule fixes every message's shape, so none is negotiated.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/group.h"
#include "parallel/parallel_dims.h"
#include "parallel/pipeline_schedule.h"
#include "runtime/core/tensor.h"
#include "runtime/train/run_config.h"
#include "runtime/train/step_executor.h"

namespace mt {

struct TrainRun;
struct Batch;

inline constexpr const char* kPpTag = "pp";  // the counters' tag of the stage-to-stage transfers

// What one step of the schedule took on this rank, from its own timers.
struct PpStepTimes {
  double step_s = 0;     // the actions from the first to the last send's completion
  double compute_s = 0;  // forwards, backwards and deferred weight gradients
  double wait_s = 0;     // blocked on a receive (or, at the end, on the sends)
  // The bubble: time this rank was not computing over the time it computed ((step - compute) / compute, the
  // schedules' textbook ratio).
  double bubble() const { return compute_s > 0 ? (step_s - compute_s) / compute_s : 0; }
  int peak_in_flight = 0;  // micro-batches whose forward ran and whose backward has not (activations held)
  // The allocator's high-water mark over the step above what was allocated when it began: the activations held
  // for backward (and the step's temporaries), the figure 1F1B lowers against GPipe.
  double peak_bytes = 0;
};

struct PipelineState {
  PpSchedule schedule;
  // This rank's actions as the executor issues them, [0] a training step's, [1] an evaluation's: the schedule's
  // list, or on NCCL, where that list's batches would wait on each other (pp_batches_deadlock), its lockstep
  // re-placement (pp_lockstep_lists: the same computes in the same order, the transfers moved).
  std::vector<PpAction> issue[2];
  std::vector<int> split;  // decoder layers of each stage
  int rank = 0;            // this rank's pp coordinate
  Group* group = nullptr;  // the pp group: the same place in every stage's mesh
  Shape act_shape;         // (micro, T_local [/ tp under sequence parallel], dim): one stage boundary's tensor
  DType act_dtype = DType::f32;
  Device act_device = Device::cpu();
  int64_t seq_split = 1;   // tp under sequence parallel: the boundary's sequence is split over it
  PpStepTimes last;        // the last step's
  // Set by the executor while a step runs: tests the transfers in flight, which is what advances them on MPI
  // transports that move a message only while its ranks are inside MPI (shared memory without single-copy).
  // Called after each decoder layer's forward and backward (hooks installed by the executor's install).
  std::function<void()> progress;
  // A generated sample's boundary tensor for a context of T tokens (1, T / seq_split, dim).
  Shape sample_shape(int64_t T) const { return {1, T / seq_split, act_shape[2]}; }
};

// Every pp rank's figures of the last step, gathered on every rank (collective over the pp group).
std::vector<PpStepTimes> gather_pp_times(const PipelineState& pp);

// Checks the pipeline keys before any collective (the schedule, the micro-batches, the split) and returns the
// split and schedule: errors name parallel.pp, parallel.pp_schedule, parallel.pp_virtual, parallel.pp_layers,
// training.micro_batch_size and model.n_layers.
PipelineState plan_pipeline(const Config& cfg, const ParallelDims& pd, int64_t micro, int64_t micro_batches);

// The pipeline executor of `run` from plan_pipeline's `plan`: this rank's pp coordinate, group and boundary
// messages (run.model holds only this rank's stages: assemble_stage). Its forward_backward
// runs this rank's actions of the schedule (gradients accumulate in the parameters; with fully_shard and
// reshard_after_forward false, each unit is gathered and reduce-scattered once in the step: FullyShard::hold);
// forward_loss the schedule's forwards only; sample_logits each stage in turn.
std::unique_ptr<StepExecutor> make_pipeline_executor(TrainRun& run, PipelineState plan);

}  // namespace mt
