#include "runtime/train/step_executor.h"

#include "models/layers.h"
#include "models/model.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/run.h"

namespace mt {

namespace {

// Every micro-batch through the whole model, one after the other, on this rank.
class LocalLoop final : public StepExecutor {
 public:
  std::vector<Tensor> forward_backward(TrainRun& run, const Batch& batch, double inv_tokens) override {
    const int64_t T_local = run.shard.size();  // T / cp tokens of each sequence on this rank
    std::vector<Tensor> micro_losses;          // read after backward: no host sync inside the micro-batch loop
    run.model->set_loss_scale(inv_tokens);     // the balance loss weighs like the token losses
    for (int64_t r = 0; r < run.rows; r += run.micro) {
      run.grad_sync->arm(r + run.micro >= run.rows);     // the last backward launches the sync
      MicroBatch mb = local_micro_batch(run, batch, r);  // (mb, T_local) x2, this rank's tokens
      run.model->set_documents(mb.doc_start);
      set_lora_dropout_rows(mb.row_ids);
      if (mb.mtp_inputs.defined()) run.model->set_mtp_batch(mb.mtp_inputs, mb.mtp_targets);
      Tensor logits = [&] {
        trace::Span span("forward", "phase");  // the trace's phases
        NvtxRange range("forward");         // Nsight Systems' view of the step (kernel_profile.h)
        return run.model->call(mb.inputs);  // (mb, T_local, V)
      }();
      run.model->forward_done();  // the router statistics' sum starts (MoE), waited for in backward
      Tensor losses = empty({run.micro * T_local}, accum_dtype(logits.dtype()), run.device);  // (mb*T_local)
      {
        trace::Span span("loss", "phase");
        NvtxRange range("loss");
        token_losses(run, losses, as_rows(logits), as_rows(logits), mb.targets.reshape({-1}), inv_tokens);
      }
      micro_losses.push_back(losses);
      for (Tensor& l : run.model->take_extra_losses()) micro_losses.push_back(l);  // multi-token prediction's
      trace::Span span("backward", "phase");
      NvtxRange range("backward");
      run.model->call_backward(logits);  // logits now hold dloss/dlogits
    }
    run.model->set_loss_scale(0);
    return micro_losses;
  }

  void forward_loss(const Tensor& loss_sum, TrainRun& run, const Batch& batch) override {
    for (int64_t r = 0; r < run.rows; r += run.micro) {
      MicroBatch mb = local_micro_batch(run, batch, r);
      run.model->set_documents(mb.doc_start);
      Tensor logits = run.model->call(mb.inputs);                                            // (mb, T_local, V)
      Tensor losses = empty({mb.targets.numel()}, accum_dtype(logits.dtype()), run.device);  // (mb*T_local)
      token_losses(run, losses, Tensor(), as_rows(logits), mb.targets.reshape({-1}), 1.0);
      sum_into(loss_sum, 0, losses);
    }
  }

  Tensor sample_logits(CausalLM& model, const Tensor& ctx) const override {
    return model.call(ctx.to(model.output_weight().value.local.device()));  // (1, T, V or V/tp)
  }
};

}  // namespace

std::unique_ptr<StepExecutor> make_step_executor(TrainRun& run, PipelineState plan) {
  if (run.pd.pp_size() > 1) return make_pipeline_executor(run, std::move(plan));
  return std::make_unique<LocalLoop>();
}

}  // namespace mt
