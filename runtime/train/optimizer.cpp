#include "runtime/train/optimizer.h"

#include <cmath>
#include <numbers>

#include "runtime/kernels/ops.h"

namespace mt {

AdamW::AdamW(std::vector<Parameter*> params, const TrainingConfig& t)
    : params_(std::move(params)), beta1_(t.beta1), beta2_(t.beta2), eps_(t.eps), weight_decay_(t.weight_decay) {
  for (Parameter* p : params_) {
    MT_CHECK(!p->frozen, "optim", "AdamW: {} is frozen (it has no gradient): pass the trainable parameters", p->name);
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
               p->weight_decay ? weight_decay_ : 0.0, step_, compute_copy(*p));  // master updated, bf16 copy rewritten
  }
}

double lr_at(const TrainingConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  if (t.schedule == "constant") return t.lr;
  double progress = double(step - t.warmup_steps) / double(std::max<int64_t>(1, t.steps - t.warmup_steps));
  progress = std::min(1.0, progress);
  return t.lr_min + 0.5 * (t.lr - t.lr_min) * (1.0 + std::cos(std::numbers::pi * progress));
}

namespace {
// The mesh dims that shard each gradient ("" when replicated), by parameter; Partial is refused.
std::string shard_dims(const Parameter& p) {
  const DTensor& g = p.grad;
  std::string dims;
  for (size_t d = 0; d < g.placements().size(); ++d) {
    MT_CHECK(!g.placements()[d].is_partial(), "optim",
             "grad_norm: gradient of {} is still Partial on mesh dim {}: sync gradients first", p.name,
             g.mesh.dims()[d].name);
    if (g.placements()[d].is_shard()) dims += (dims.empty() ? "" : ",") + g.mesh.dims()[d].name;
  }
  return dims;
}
// The groups of gradients sharded over the same dims, in a fixed order (the map's), and each parameter's group.
std::map<std::string, int64_t> norm_groups(const std::vector<Parameter*>& params, std::vector<int64_t>* of_param) {
  std::map<std::string, int64_t> groups;
  std::vector<std::string> dims;
  for (Parameter* p : params) groups.emplace(dims.emplace_back(shard_dims(*p)), 0);
  int64_t k = 0;
  for (auto& [name, slot] : groups) slot = k++;
  if (of_param)
    for (const std::string& d : dims) of_param->push_back(groups.at(d));
  return groups;
}
}  // namespace

int64_t grad_norm_slots(const std::vector<Parameter*>& params) { return int64_t(norm_groups(params, nullptr).size()); }

void grad_norm_squares(const Tensor& out, int64_t first, const std::vector<Parameter*>& params) {
  // Partial sums grouped by the mesh dims that shard the gradient: a replicated element is counted once, a
  // sharded one is summed over its shards (the all-reduce over those dims).
  std::vector<int64_t> slot;
  auto groups = norm_groups(params, &slot);
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    grads.push_back(params[i]->grad.local);
    slot[i] += first;
  }
  sum_squares_into(out, slot, grads);
  if (params.empty()) return;
  const DeviceMesh& mesh = params.front()->grad.mesh;
  for (auto& [dims, k] : groups)
    if (!dims.empty()) mesh.group(dims).all_reduce(out.view(first + k, {1}), ReduceOp::sum);
}

double grad_norm_from(const std::vector<double>& squares, int64_t first, int64_t count) {
  double total = 0;
  for (int64_t k = 0; k < count; ++k) total += squares[size_t(first + k)];
  return std::sqrt(total);
}

double grad_norm(const std::vector<Parameter*>& params) {
  const int64_t k = grad_norm_slots(params);
  if (params.empty()) return 0;
  const Tensor& g0 = params.front()->grad.local;
  Tensor squares = zeros({k}, DType::f64, g0.device());  // (k) one per group of shard dims
  grad_norm_squares(squares, 0, params);
  return grad_norm_from(to_f64(squares), 0, k);  // one host sync
}

void clip_grads(const std::vector<Parameter*>& params, double norm, double max_norm) {
  if (max_norm <= 0) return;
  double coef = max_norm / (norm + 1e-6);
  if (coef >= 1) return;
  for (Parameter* p : params) scale_(p->grad.local, coef);
}

}  // namespace mt
