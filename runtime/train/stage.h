// A run's shape and one stage of it, assembled by the same two functions for `meshtrain train` (make_train_run)
// and `meshtrain estimate` (on simulated meshes): so the estimate is of the run that trains, and what train
// refuses, estimate refuses with the same message.
//   plan_run_shape  what the config and the world size alone fix: what each mesh dim means, the batch's split into
//                   rows and micro-batches, the pipeline's schedule and stage split, the dtypes
//   assemble_stage  a stage's model on its mesh: built deferred, cut to the rank's pipeline chunks, laid out by its
//                   family's parallelisms (tp, cp, recompute, fully_shard), with its gradient sync
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "models/model.h"
#include "parallel/fully_shard.h"
#include "parallel/grad_sync.h"
#include "parallel/parallel_dims.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/run_config.h"

namespace mt {

struct RunShape {
  ParallelDims pd;                  // what each mesh dim means
  int64_t dp = 1;                   // data-parallel size
  int64_t rows = 0;                 // sequences of each step's batch on a rank (batch_size / dp)
  int64_t micro = 0;                // sequences per forward/backward
  PipelineState pipeline;           // the schedule and stage split (parallel.pp > 1); nothing else is set here
  DType dtype = DType::f32;         // training.dtype on the run's device
  DType reduce_dtype = DType::f32;  // the dtype gradients are reduced in
  // The parameters allocated undrawn, their random init left for resume_or_init to draw unless a checkpoint
  // loads every one (make_train_run's init_later: the trainer's, when it may resume).
  bool init_later = false;
  int64_t micro_batches() const { return rows / micro; }
};

// The run's shape on world_size ranks from the config alone, checked before any collective: errors name the keys
// (the batch and the sequence against the mesh, the micro-batches, the pipeline's keys, the heads against tp).
RunShape plan_run_shape(const Config& cfg, int world_size);
// training.dtype on this device (fp64 is refused on CUDA).
DType training_dtype(const Config& c, Device device);

// A stage's model and what its parallelisms keep. Members are destroyed last to first: the gradient sync and
// fully_shard's units before the model whose hooks point at them.
struct Stage {
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<FullyShard> fsdp;     // null without dp_shard
  std::unique_ptr<GradSync> grad_sync;  // buckets (training.grad_bucket_mb > 0), or one redistribute a parameter
};

// The model of cfg on `mesh` (the stage's ranks; a simulated mesh allocates nothing): parameters described,
// only pipeline stage pp_rank's chunks kept (pp > 1), the family's parallelisms applied, then each rank's own
// elements allocated and drawn in their final layout (sharded creation), and the gradient sync made.
Stage assemble_stage(const Config& cfg, const RunShape& shape, const DeviceMesh& mesh, Device device, int pp_rank);

// The bytes of the model state per local parameter element (what `train` allocates for each parameter and
// `estimate` counts): the master value, its gradient, the optimizer's state, and the compute copy under mixed
// precision. Each is its own allocation of that many bytes per element.
struct ParamStateBytes {
  double master = 4, grad = 4, copy = 0;
  std::vector<double> optimizer;  // the optimizer's tensors (AdamW: its two moments)
  double total() const {
    double t = master + grad + copy;
    for (double b : optimizer) t += b;
    return t;
  }
};
ParamStateBytes param_state_bytes(DType dtype);
// The bytes per local element of a frozen parameter (LoRA's base): no gradient, no optimizer state, and no f32 master
// either: materialize holds it in the compute dtype alone (4 B in fp32, 2 B in bf16). The one count `train` logs
// (log_model_state) and `estimate` and `plan --search` use: a change to how the frozen base is held is made here.
ParamStateBytes frozen_param_bytes(DType dtype);

}  // namespace mt
