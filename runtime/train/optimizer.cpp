#include "runtime/train/optimizer.h"

#include <cmath>
#include <numbers>

#include "runtime/kernels/ops.h"

namespace mt {

AdamW::AdamW(std::vector<Parameter*> params, const TrainingConfig& t)
    : params_(std::move(params)), beta1_(t.beta1), beta2_(t.beta2), eps_(t.eps), weight_decay_(t.weight_decay) {
  for (Parameter* p : params_) {
    const Tensor& w = p->value.local;
    DType sd = w.dtype() == DType::f64 ? DType::f64 : DType::f32;  // optimizer state is never below f32
    state_[p->name] = State{zeros(w.shape(), sd, w.device()), zeros(w.shape(), sd, w.device())};
  }
}

void AdamW::step(double lr) {
  ++step_;
  for (Parameter* p : params_) {
    State& s = state_.at(p->name);
    adamw_step(p->value.local, p->grad.local, s.exp_avg, s.exp_avg_sq, lr, beta1_, beta2_, eps_,
               p->weight_decay ? weight_decay_ : 0.0, step_, p->compute);  // master updated, bf16 copy rewritten
  }
}

double lr_at(const TrainingConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  if (t.schedule == "constant") return t.lr;
  double progress = double(step - t.warmup_steps) / double(std::max<int64_t>(1, t.steps - t.warmup_steps));
  progress = std::min(1.0, progress);
  return t.lr_min + 0.5 * (t.lr - t.lr_min) * (1.0 + std::cos(std::numbers::pi * progress));
}

double grad_norm(const std::vector<Parameter*>& params) {
  // Partial sums grouped by the mesh dims that shard the gradient: a replicated
  // element is counted once, a sharded one is summed over its shards.
  std::map<std::string, double> by_dims;
  const DeviceMesh* mesh = nullptr;
  std::vector<Tensor> grads;
  for (Parameter* p : params) grads.push_back(p->grad.local);
  const std::vector<double> squares = sum_squares_each(grads);  // one host sync on a GPU
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter* p = params[i];
    const DTensor& g = p->grad;
    mesh = &g.mesh;
    std::string dims;
    for (size_t d = 0; d < g.placements().size(); ++d) {
      MT_CHECK(!g.placements()[d].is_partial(), "optim",
               "grad_norm: gradient of {} is still Partial on mesh dim {}: sync gradients first", p->name,
               g.mesh.dims()[d].name);
      if (g.placements()[d].is_shard()) dims += (dims.empty() ? "" : ",") + g.mesh.dims()[d].name;
    }
    by_dims[dims] += squares[i];
  }
  double total = 0;
  for (auto& [dims, local] : by_dims) {
    double v = local;
    if (!dims.empty() && mesh) {
      Tensor t = from_values({v}, {1}, DType::f64);
      mesh->group(dims).all_reduce(t, ReduceOp::sum);
      v = t.at<double>(0);
    }
    total += v;
  }
  return std::sqrt(total);
}

void clip_grads(const std::vector<Parameter*>& params, double norm, double max_norm) {
  if (max_norm <= 0) return;
  double coef = max_norm / (norm + 1e-6);
  if (coef >= 1) return;
  for (Parameter* p : params) scale_(p->grad.local, coef);
}

}  // namespace mt
