// RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w, statistics over the last dim (Gemma's: * (1 + w)).
#include "models/layers.h"
#include "runtime/kernels/ops.h"

namespace mt {

RMSNorm::RMSNorm(const std::string& name, int64_t dim, double e, const ParamFactory& f, bool offset)
    : Module(name, "RMSNorm"), eps(e), unit_offset(offset) {
  weight = add_parameter(f.make(child_name(name, "weight"), {dim}, offset ? "zeros" : "ones"));
  weight->weight_decay = false;
}

Tensor RMSNorm::scale() const {
  const Tensor& w = weight->compute_local();
  if (!unit_offset) return w;
  if (!ones_.defined() || ones_.shape() != w.shape() || ones_.dtype() != w.dtype() || ones_.device() != w.device())
    ones_ = from_values(std::vector<double>(size_t(w.numel()), 1.0), w.shape(), w.dtype()).to(w.device());
  Tensor s = empty(w.shape(), w.dtype(), w.device());  // (dim) 1 + w, rounded once to w's dtype
  add(s, w, ones_);
  return s;
}

Tensor RMSNorm::forward(const Tensor& x) {
  Tensor y = empty(x.shape(), x.dtype(), x.device());                             // (B, T, C)
  Tensor rstd = empty({as_rows(x).size(0)}, accum_dtype(x.dtype()), x.device());  // (B*T)
  rmsnorm_forward(as_rows(y), rstd, as_rows(x), scale(), eps);
  saved_x_ = x;
  saved_rstd_ = rstd;
  return y;
}

std::pair<Tensor, Tensor> RMSNorm::call_add(const Tensor& x, const Tensor& residual) {
  if (!input_hooks.empty()) {
    add_(x, residual);
    return {x, call(x)};
  }
  Tensor y = call_around([&] {
    Tensor out = empty(x.shape(), x.dtype(), x.device());                           // (B, T, C)
    Tensor rstd = empty({as_rows(x).size(0)}, accum_dtype(x.dtype()), x.device());  // (B*T)
    add_rmsnorm_forward(as_rows(x), as_rows(out), rstd, as_rows(x), as_rows(residual), scale(), eps);
    saved_x_ = x;
    saved_rstd_ = rstd;
    return out;
  });
  return {x, y};
}

Tensor RMSNorm::weight_grad() const {
  if (!weight->frozen) return weight->grad_local();
  // Frozen (LoRA's base): the op writes its weight gradient somewhere; a scratch (C) it then drops.
  const Tensor& w = weight->compute_local();
  return zeros(w.shape(), accum_dtype(w.dtype()), w.device());
}

Tensor RMSNorm::call_backward_add(const Tensor& dy, const Tensor& dresidual) {
  if (!input_hooks.empty()) {
    Tensor dx = call_backward(dy);
    add_(dx, dresidual);
    return dx;
  }
  return call_backward_around(dy, [&](const Tensor& g) {
    Tensor dx = empty(saved_x_->shape(), g.dtype(), g.device());  // (B, T, C)
    rmsnorm_backward(as_rows(dx), weight_grad(), as_rows(g), as_rows(saved_x_), scale(), saved_rstd_,
                     as_rows(dresidual));
    saved_x_ = Tensor();
    saved_rstd_ = Tensor();
    return dx;
  });
}

Tensor RMSNorm::backward(const Tensor& dy) {
  Tensor dx = empty(saved_x_->shape(), dy.dtype(), dy.device());  // (B, T, C)
  rmsnorm_backward(as_rows(dx), weight_grad(), as_rows(dy), as_rows(saved_x_), scale(), saved_rstd_);
  saved_x_ = Tensor();
  saved_rstd_ = Tensor();
  return dx;
}

}  // namespace mt
