// AdamW (torch.optim.AdamW's semantics), the learning-rate schedule, and the
// global gradient norm and clipping of torch.nn.utils.clip_grad_norm_, over
// parameters that are DTensors (each element counted once).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "parallel/module.h"
#include "runtime/io/config.h"

namespace mt {

class AdamW {
 public:
  AdamW(std::vector<Parameter*> params, const TrainingConfig& t);
  // One update of every parameter's local shard with its (synced) gradient.
  void step(double lr);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  struct State {
    Tensor exp_avg, exp_avg_sq;  // like the parameter's local shard; f32 (f64 for f64 params)
  };
  // State's tensors for a parameter whose master value is `master`: the bytes per element of each (two moments,
  // each like the master value; each its own allocation).
  static std::vector<double> state_element_bytes(DType master) {
    return {double(dtype_size(master)), double(dtype_size(master))};
  }
  std::map<std::string, State>& state() { return state_; }
  const std::vector<Parameter*>& params() const { return params_; }

 private:
  std::vector<Parameter*> params_;
  std::map<std::string, State> state_;
  double beta1_, beta2_, eps_, weight_decay_;
  int64_t step_ = 0;
};

// Learning rate for 0-based step s: linear warmup lr*(s+1)/W for s < W, then
// constant lr, or cosine from lr to lr_min over the remaining steps.
double lr_at(const TrainingConfig& t, int64_t step);

// sqrt(sum of squares) of every gradient over the mesh (collective where a
// gradient is sharded: partial sums are all-reduced over its shard dims). One host read.
double grad_norm(const std::vector<Parameter*>& params);
// The same in pieces, so the step reads it with its loss in one host sync: grad_norm_slots(params) = k groups of
// gradients sharded over the same mesh dims; grad_norm_squares adds each group's sum of squares into
// out[first + group] (f64 on the gradients' device, zeroed by the caller) and all-reduces it over the group's
// shard dims on the device; grad_norm_from takes the root of the k entries read back on the host.
int64_t grad_norm_slots(const std::vector<Parameter*>& params);
void grad_norm_squares(const Tensor& out, int64_t first, const std::vector<Parameter*>& params);
double grad_norm_from(const std::vector<double>& squares, int64_t first, int64_t count);
// clip_grad_norm_: if max_norm > 0 and norm > max_norm, scale by max_norm / (norm + 1e-6).
void clip_grads(const std::vector<Parameter*>& params, double norm, double max_norm);

}  // namespace mt
