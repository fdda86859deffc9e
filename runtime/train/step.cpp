#include "runtime/train/step.h"

#include <cmath>

#include "runtime/core/fault.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/trace.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

double sum_of(const std::vector<double>& v, int64_t first, int64_t count) {
  double s = 0;
  for (int64_t k = 0; k < count; ++k) s += v[size_t(first + k)];
  return s;
}

}  // namespace

void sync_gradients(TrainRun& run) {
  // Each gradient is Partial over the data-parallel dims (and, for sequence-parallel norm weights,
  // over tp: grad_partial_dims); redistributing it to its parameter's placement all-reduces (or
  // reduce-scatters) it. GradSync does that in buckets, or one parameter at a time (grad_bucket_mb: 0).
  run.grad_sync->finish();
}

StepResult train_step(TrainRun& run, int64_t step) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  // 1. This rank's rows of the global batch for this step.
  Batch batch = [&] {
    trace::Span span("data", "data");
    return get_batch(run.train_data, step, B, T, run.dp_rank * run.rows, run.rows);  // (rows, T) x2
  }();
  fault_slow_rank();  // MT_FAULT_SLOW_RANK: the slow-rank drill's injected delay
  // 2. Forward and backward per micro-batch, by the run's executor (the local loop, or this rank's actions of the
  //    pipeline's schedule); gradients accumulate in the parameters' grad buffers and the last backward launches
  //    the gradient sync. The loss is the sum of token losses over the global count of trained targets (every
  //    target, or the ones the loss mask keeps: each rank counts the whole batch's alone), so every mesh and every
  //    micro-batch size gives the same number.
  LoraDropoutStep dropout_keys(uint64_t(t.seed), step);  // LoRA dropout's masks in this step's forwards
  const int64_t trained = trained_targets(run.train_data, step, B, T);
  const double inv_tokens = trained > 0 ? 1.0 / double(trained) : 0.0;
  const int64_t norm_groups = grad_norm_slots(run.trainable);
  StepResult res;
  res.trained_tokens = trained;
  std::vector<double> sums;
  // Bounded dropless expert parallel (MoE, models/llama/moe.h): an attempt whose rows overflowed the bound is not
  // applied; the model raises the bound and the step runs again on the same batch (every rank decides alike: the
  // statistics are summed). Any other model makes one attempt.
  for (int64_t redone = 0;; ++redone) {
    zero_grads(run.trainable);
    // (micro * T_local) each, read after backward: no host sync inside the micro-batch loop
    const std::vector<Tensor> micro_losses = [&] {
      trace::Span span("forward and backward", "phase");
      return run.executor->forward_backward(run, batch, inv_tokens);
    }();
    trace::Span phase("grad sync, loss and norm", "phase");  // the step's phases in the trace
    // 3. Gradient sync, the one rule (see sync_gradients): waits for the buckets backward launched.
    NvtxRange range("grad sync, loss and norm");
    sync_gradients(run);
    // 4. The step's loss over the whole batch (every token's loss is on exactly one rank of dp x cp) and the
    //    gradient norm's squares, summed and all-reduced on the device: stats (1 + k) f64 holds the loss sum,
    //    then one entry per group of gradients sharded alike.
    //    An MoE model's router statistics (summed on the device over the ranks holding the other tokens) follow,
    //    so that the same read brings them (no host sync of their own).
    const Tensor router = run.model->pending_router_stats();  // (n) f64 or undefined
    const int64_t n_router = router.defined() ? router.numel() : 0;
    Tensor stats = zeros({1 + norm_groups + n_router}, DType::f64, run.device);
    for (const Tensor& l : micro_losses) sum_into(stats, 0, l);
    run.mesh.group(run.pd.loss_group()).all_reduce(stats.view(0, {1}), ReduceOp::sum);
    grad_norm_squares(stats, 1, run.trainable);
    if (n_router > 0) copy_slice(stats, 1 + norm_groups, router, 0, n_router, 0);
    // 5. Clip by the global norm and update. The host reads loss and norm here, the step's one host sync: the
    //    non-finite rule and the clip scale decide on the host. A non-finite loss or norm skips the update: both
    //    are all-reduced, so every rank decides the same with no extra communication, and a NaN never reaches
    //    the weights.
    //    Under pipeline parallel each stage holds its part of both: the executor sums them over the stages.
    const std::vector<double> host = to_f64(stats);
    sums = run.executor->sum_over_stages({host[0], sum_of(host, 1, norm_groups)});
    const std::vector<double> router_values(host.begin() + 1 + norm_groups, host.end());
    res.router = run.model->take_router_stats(&router_values);  // the same on every rank: its statistics were summed
    if (!run.model->redo_overflowed_step(step, res.router)) {
      res.router.bound_recomputed = redone;
      break;
    }
  }
  res.loss = sums[0] * inv_tokens + res.router.aux_loss;
  res.grad_norm = std::sqrt(sums[1]);
  res.lr = lr_at(t, step);
  res.skipped = !std::isfinite(res.loss) || !std::isfinite(res.grad_norm);
  if (res.skipped) return res;
  if (trained == 0) return res;  // every target masked: nothing to learn from, no update (weight decay included)
  trace::Span phase("optimizer", "phase");
  NvtxRange range("optimizer");
  clip_grads(run.trainable, res.grad_norm, t.grad_clip);
  run.opt->step(res.lr);
  run.model->after_step();
  return res;
}

double evaluate(TrainRun& run) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  Tensor loss_sum = zeros({1}, DType::f64, run.device);  // (1) summed on the device, read once
  int64_t trained = 0;  // the trained targets of every evaluated batch, all ranks (counted here alone)
  for (int64_t i = 0; i < run.config.eval.steps; ++i) trained += trained_targets(run.val_data, i, B, T);
  for (int64_t i = 0; i < run.config.eval.steps; ++i) {
    Batch batch = get_batch(run.val_data, i, B, T, run.dp_rank * run.rows, run.rows);
    run.executor->forward_loss(loss_sum, run, batch);
  }
  run.mesh.group(run.pd.loss_group()).all_reduce(loss_sum, ReduceOp::sum);
  // Under pipeline parallel only the last stage has losses.
  const double total = run.executor->sum_over_stages({to_f64(loss_sum)[0]})[0];
  return trained > 0 ? total / double(trained) : std::nan("");
}

}  // namespace mt
