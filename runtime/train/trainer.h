// The training run: mesh, model, optimizer and data built from the config, the
// step (readable top to bottom in train_step), evaluation and sampling; the
// subcommands that drive them are cmd_train.cpp and cmd_generate.cpp.
#pragma once
#include <memory>

#include "attention/sequence_shard.h"
#include "models/model.h"
#include "parallel/fully_shard.h"
#include "parallel/grad_sync.h"
#include "runtime/io/token_data.h"
#include "runtime/io/tokenizer.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/run_context.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/step_executor.h"

namespace mt {

struct TrainRun {
  Config config;
  DeviceMesh mesh;        // the model's: the stage's ranks under pipeline parallel, else the world
  DeviceMesh world_mesh;  // every rank (pp outermost); the same as mesh without pipeline parallel
  Device device;
  DType dtype = DType::f32;
  std::unique_ptr<CausalLM> model;  // the family of model.type (models/model.h)
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
  std::string resumed_from;     // the checkpoint resumed, if any
  // How the step's micro-batches run (step_executor.h): the local loop, or pipeline parallel's schedule
  // (parallel.pp > 1). Chosen once, in make_train_run.
  std::unique_ptr<StepExecutor> executor;
  // Gradient sync: buckets overlapped with backward (training.grad_bucket_mb > 0) or one redistribute
  // per parameter (0); destroyed before the model whose hooks point at it.
  std::unique_ptr<GradSync> grad_sync;
};

// Builds everything on every rank; config problems are errors before any
// collective other than building the mesh. with_data = false skips the data (generate).
TrainRun make_train_run(const Config& config, const MpiEnv& env, bool with_data = true);
// The run's shape from run.config alone on world_size ranks, checked before any collective (make_train_run's
// first step, and `meshtrain estimate`'s): run.pd, run.dp, run.rows, run.micro, and the pipeline's schedule and
// stage split. Errors name the keys.
PipelineState plan_run_shape(TrainRun& run, int world_size);
// training.dtype on this device (fp64 is refused on CUDA).
DType training_dtype(const Config& c, Device device);

// This rank's part of rows [r, r + micro) of a batch: its tokens of each sequence (all of them without cp) on
// the run's device, and where their documents start (host; undefined without data.document_separator).
struct MicroBatch {
  Tensor inputs, targets;  // (micro, T_local) i32
  Tensor doc_start;        // (micro, T) i64: whole sequences
};
MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r);

struct StepResult {
  double loss = 0, grad_norm = 0, lr = 0;
  RouterStepStats router;  // an MoE model's routing in the step (global); the balance loss is part of loss
  bool skipped = false;  // the loss or grad norm was not finite: the update was not applied
  int64_t trained_tokens = 0;  // the global batch's trained targets (all of them without a loss mask; 0: no update)
};
StepResult train_step(TrainRun& run, int64_t step);
// Per-token losses (N) of logits (N, V, or V/tp under loss parallel, never gathered); dlogits
// (undefined, or aliasing logits) gets the gradient scaled by grad_scale.
void token_losses(TrainRun& run, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                  const Tensor& targets, double grad_scale);
// Brings every gradient to its parameter's placement (a gradient ends in its parameter's placements) through run.grad_sync:
// buckets, or one redistribute per parameter with grad_bucket_mb 0; both reduce in training.grad_reduce_dtype.
void sync_gradients(TrainRun& run);
// Mean loss of the trained targets over eval.steps validation batches (collective over dp; NaN when the masks
// keep none).
double evaluate(TrainRun& run);
// Continues `prompt` (token ids) by up to `n` sampled tokens, stopping after stop_id (-1: never); every rank
// computes the same tokens (collective under tensor parallel). Contexts are padded to a multiple of pad_multiple.
// The executor runs each context (StepExecutor::sample_logits: through the stages in turn under pipeline
// parallel) and gives every rank the sampled token.
std::vector<int32_t> generate(CausalLM& model, const StepExecutor& executor, std::vector<int32_t> prompt, int64_t n,
                              double temperature, uint64_t seed, uint64_t stream, int64_t pad_multiple = 1,
                              int64_t document_separator = -1, int32_t stop_id = -1);

// How text becomes token ids and back for prompts and samples: the model's tokenizer, or bytes (each byte one
// token id, modulo the vocabulary) when there is none.
struct TextCodec {
  std::shared_ptr<const Tokenizer> tokenizer;  // null: bytes
  std::string file;  // where the tokenizer was read (empty: bytes)
  int64_t vocab_size = 256;
  std::vector<int32_t> encode(const std::string& text) const;
  // Ids the tokenizer does not have (a model's vocabulary padded past its tokenizer's) decode as U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t eos_id() const { return tokenizer ? tokenizer->eos_id() : -1; }
  std::string describe() const;
};
// The tokenizer of a run: `path` when given (a tokenizer.json, tokenizer.model or a directory holding one), else
// data.tokenizer, else model.init_from's directory's, else `fallback_dir`'s (a checkpoint's) when it holds one;
// bytes otherwise. A tokenizer with more ids than model.vocab_size is an error naming both.
TextCodec text_codec(const Config& cfg, const std::string& path = "", const std::string& fallback_dir = "");
// The tokenizer file of a directory ('' = none): tokenizer.json, else tokenizer.model.
std::string tokenizer_file_in(const std::string& dir);

// Sequence lengths must be multiples of this: tp under sequence parallel, else 1.
int64_t sequence_pad(const TrainRun& run);

}  // namespace mt
