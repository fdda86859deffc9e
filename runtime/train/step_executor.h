// How this rank runs the micro-batches of a step: the one interface the trainer, evaluation, sampling, checkpoints
// and the train command call, so none of them branches on pipeline parallel. Chosen once from the config in
// make_train_run (make_step_executor):
//   - the local loop (step_executor.cpp): every micro-batch through the whole model, one after the other;
//   - the pipeline (pipeline.{h,cpp}, parallel.pp > 1): this rank's stages run their actions of the schedule, and
//     the activations and gradients go between neighbouring stages through the pp Group.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace mt {

struct TrainRun;
struct Batch;
struct PipelineState;
class CausalLM;
class Group;
class MetricsLogger;

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;

  // Hooks on the model once it is parallelized (the pipeline's: progress of its transfers between layers).
  virtual void install(CausalLM& model) { (void)model; }

  // The step's forwards and backwards over this rank's micro-batches of `batch` (rows, T): gradients accumulate in
  // the parameters (zeroed by the caller), and the gradient sync is armed so that the last backward that completes
  // them launches its buckets. Returns the per-token losses of each micro-batch, (micro * T_local) each, in
  // micro-batch order, on the ranks that compute a loss (every rank locally; the last stage of a pipeline).
  virtual std::vector<Tensor> forward_backward(TrainRun& run, const Batch& batch, double inv_tokens) = 0;
  // Forward only (evaluation): adds the summed token losses of the batch's micro-batches to loss_sum (1) f64.
  virtual void forward_loss(const Tensor& loss_sum, TrainRun& run, const Batch& batch) = 0;
  // Host figures of a step summed over the stages, on every rank: each stage holds its part (the loss on the last,
  // its own parameters' gradient squares). The local loop holds them whole already.
  virtual std::vector<double> sum_over_stages(const std::vector<double>& v) const { return v; }

  // Sampling, on every rank: the logits (1, T, V or V/tp) of the context `ctx` (1, T) i32 on the host, on the rank
  // that holds the output projection (undefined elsewhere).
  virtual Tensor sample_logits(CausalLM& model, const Tensor& ctx) const = 0;
  // The token sampled from those logits, on every rank (the output's rank's).
  virtual int32_t share_token(int32_t token) const { return token; }

  // Checkpoints: the group over which the stages' indexes are gathered (pp), or null with one stage.
  virtual Group* stage_group() const { return nullptr; }
  // The pipeline's plan (for `meshtrain plan`'s stage table, timeline and bytes), or null.
  virtual const PipelineState* pipeline() const { return nullptr; }
  // One start-up log line saying how the step runs ("": nothing to say).
  virtual std::string describe() const { return ""; }
  // After each step: the executor's own figures of the step into the metrics (collective over the stages).
  virtual void log_step(MetricsLogger& log, int64_t step) {
    (void)log;
    (void)step;
  }
};

// The run's executor: the pipeline for parallel.pp > 1 (which keeps only this rank's stages of run.model: call it
// before any parameter has storage), else the local loop. `plan` is plan_run_shape's.
std::unique_ptr<StepExecutor> make_step_executor(TrainRun& run, PipelineState plan);

}  // namespace mt
