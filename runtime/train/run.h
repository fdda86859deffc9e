// The training run of one rank: its shape and stage (stage.h, assembled as `estimate` assembles them), and what
// training adds: the meshes, the device, the optimizer, the data, the step executor. Built by make_train_run for
// `meshtrain train` (runtime/train/trainer.h), `generate`, `logits` and `plan`; the step is step.h.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "attention/sequence_shard.h"
#include "comm/env.h"
#include "runtime/io/token_data.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/stage.h"
#include "runtime/train/step_executor.h"

namespace mt {

// RunShape: pd, dp, rows, micro, dtype, reduce_dtype (and the pipeline plan the executor took). Stage: model,
// fsdp, grad_sync, destroyed after the members below (the executor and the optimizer point into the model).
struct MicroBatch;
struct StepGraphs;  // cuda_graph.h

struct TrainRun : RunShape, Stage {
  Config config;
  DeviceMesh mesh;        // the model's: the stage's ranks under pipeline parallel, else the world
  DeviceMesh world_mesh;  // every rank (pp outermost); the same as mesh without pipeline parallel
  Device device;
  std::vector<Parameter*> params;     // every parameter of the stage
  std::vector<Parameter*> trainable;  // those not frozen (all of them, without LoRA): gradients, norm, AdamW
  std::unique_ptr<AdamW> opt;
  size_t create_peak_bytes = 0;  // host bytes held at the peak of creating and laying out the model
  TokenStream train_data, val_data;
  int64_t dp_rank = 0;       // this rank's data-parallel index
  SequenceShard shard;       // this rank's tokens of each sequence (all of them without cp)
  int64_t start_step = 0;    // > 0 after resuming
  std::string resumed_from;  // the checkpoint resumed, if any
  // How the step's micro-batches run (step_executor.h): the local loop, or pipeline parallel's schedule
  // (parallel.pp > 1). Chosen once, in make_train_run.
  std::unique_ptr<StepExecutor> executor;
  // training.cuda_graph (cuda_graph.h): the step's graphs, when the run can step through them; null otherwise.
  std::shared_ptr<StepGraphs> graphs;
  // While a step's graph is captured: the graph's input tensors, which local_micro_batch returns (by index).
  const std::vector<MicroBatch>* capture_micro = nullptr;
};

// Builds everything on every rank; config problems are errors before any collective other than agreeing on the
// ranks' memory and building the mesh. with_data = false skips the data (generate, logits, plan). init_later: the
// parameters are allocated without their random init, which the caller must then draw or load (resume_or_init).
TrainRun make_train_run(const Config& config, const MpiEnv& env, bool with_data = true, bool init_later = false);

// This rank's part of rows [r, r + micro) of a batch: its tokens of each sequence (all of them without cp) on
// the run's device, and where their documents start (host; undefined without data.document_separator).
struct MicroBatch {
  Tensor inputs, targets;  // (micro, T_local) i32
  Tensor doc_start;        // (micro, T) i64: whole sequences
  Tensor row_ids;          // (micro * T_local) i64 on the device: each token's global index (lora.dropout > 0)
  // Multi-token prediction (a model that wants_mtp): each position's next token and the token after next (-1: none:
  // the sequence's last position, or masked), from the whole sequences, then this rank's part; (micro, T_local) i32.
  Tensor mtp_inputs, mtp_targets;
};
MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r);

// Per-token losses (N) of logits (N, V, or V/tp under loss parallel, never gathered); dlogits
// (undefined, or aliasing logits) gets the gradient scaled by grad_scale.
void token_losses(TrainRun& run, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                  const Tensor& targets, double grad_scale);

// Sequence lengths must be multiples of this: tp under sequence parallel, else 1.
int64_t sequence_pad(const TrainRun& run);

}  // namespace mt
