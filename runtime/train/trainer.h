// The training run: mesh, model, optimizer and data built from the config, the
// step (readable top to bottom in train_step), evaluation and sampling; the
// subcommands that drive them are cmd_train.cpp and cmd_generate.cpp.
#pragma once
#include <memory>

#include "attention/sequence_shard.h"
#include "models/llama/llama.h"
#include "parallel/fully_shard.h"
#include "parallel/grad_sync.h"
#include "runtime/io/token_data.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/run_context.h"
#include "runtime/train/optimizer.h"

namespace mt {

struct TrainRun {
  Config config;
  DeviceMesh mesh;
  Device device;
  DType dtype = DType::f32;
  std::unique_ptr<LlamaForCausalLM> model;
  std::unique_ptr<FullyShard> fsdp;  // fully sharded data parallel's units (dp_shard > 1); destroyed before the model
  std::vector<Parameter*> params;
  std::unique_ptr<AdamW> opt;
  size_t create_peak_bytes = 0;  // host bytes held at the peak of creating and laying out the model
  TokenStream train_data, val_data;
  ParallelDims pd;              // what each mesh dim means
  int64_t dp = 1, dp_rank = 0;  // data-parallel size and this rank's index
  int64_t rows = 0;             // sequences of each step's batch on this rank (batch_size / dp)
  int64_t micro = 0;            // sequences per forward/backward
  SequenceShard shard;          // this rank's tokens of each sequence (all of them without cp)
  int64_t start_step = 0;       // > 0 after resuming
  // Gradient sync: buckets overlapped with backward (training.grad_bucket_mb > 0) or one redistribute
  // per parameter (0); destroyed before the model whose hooks point at it.
  std::unique_ptr<GradSync> grad_sync;
};

// Builds everything on every rank; config problems are errors before any
// collective other than building the mesh. with_data = false skips the data (generate).
TrainRun make_train_run(const Config& config, const MpiEnv& env, bool with_data = true);

// This rank's part of rows [r, r + micro) of a batch: its tokens of each sequence (all of them without cp) on
// the run's device, and where their documents start (host; undefined without data.document_separator).
struct MicroBatch {
  Tensor inputs, targets;  // (micro, T_local) i32
  Tensor doc_start;        // (micro, T) i64: whole sequences
};
MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r);

struct StepResult {
  double loss = 0, grad_norm = 0, lr = 0;
  bool skipped = false;  // the loss or grad norm was not finite: the update was not applied
};
StepResult train_step(TrainRun& run, int64_t step);
// Per-token losses (N) of logits (N, V, or V/tp under loss parallel, never gathered); dlogits
// (undefined, or aliasing logits) gets the gradient scaled by grad_scale.
void token_losses(TrainRun& run, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                  const Tensor& targets, double grad_scale);
// Brings every gradient to its parameter's placement (a gradient ends in its parameter's placements) through run.grad_sync:
// buckets, or one redistribute per parameter with grad_bucket_mb 0; both reduce in training.grad_reduce_dtype.
void sync_gradients(TrainRun& run);
// Mean token loss over eval.steps validation batches (collective over dp).
double evaluate(TrainRun& run);
// Continues `prompt` (bytes) by `n` sampled tokens; every rank computes the same text
// (collective under tensor parallel). Contexts are padded to a multiple of pad_multiple.
std::string generate(LlamaForCausalLM& model, const std::string& prompt, int64_t n, double temperature, uint64_t seed,
                     uint64_t stream, int64_t pad_multiple = 1, int64_t document_separator = -1);

// Sequence lengths must be multiples of this: tp under sequence parallel, else 1.
int64_t sequence_pad(const TrainRun& run);

}  // namespace mt
