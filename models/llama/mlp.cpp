// Llama MLP: down(silu(gate(x)) * up(x)); Gemma's GeGLU: down(gelu_tanh(gate(x)) * up(x)).
#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"

namespace mt {

LlamaMLP::LlamaMLP(const std::string& name, const ModelConfig& c, const ParamFactory& f, bool g)
    : Module(name, "LlamaMLP"), gelu(g) {
  gate_proj = add_child(std::make_unique<Linear>(child_name(name, "gate_proj"), c.dim, c.ffn_dim, f));
  up_proj = add_child(std::make_unique<Linear>(child_name(name, "up_proj"), c.dim, c.ffn_dim, f));
  down_proj = add_child(std::make_unique<Linear>(child_name(name, "down_proj"), c.ffn_dim, c.dim, f));
}

Tensor LlamaMLP::forward(const Tensor& x) {
  gate_ = gate_proj->call(x);                              // (B, T, F)
  up_ = up_proj->call(x);                                  // (B, T, F)
  Tensor h = empty(gate_->shape(), x.dtype(), x.device());  // (B, T, F)
  if (gelu) geglu_forward(h, gate_, up_);
  else swiglu_forward(h, gate_, up_);
  return down_proj->call(h);
}

Tensor LlamaMLP::backward(const Tensor& dy) {
  Tensor dh = down_proj->call_backward(dy);  // (B, T, F)
  Tensor dgate = empty(gate_->shape(), dy.dtype(), dy.device()), dup = empty(up_->shape(), dy.dtype(), dy.device());
  if (gelu) geglu_backward(dgate, dup, dh, gate_, up_);
  else swiglu_backward(dgate, dup, dh, gate_, up_);
  gate_ = Tensor();
  up_ = Tensor();
  Tensor dx = gate_proj->call_backward(dgate);  // (B, T, C), then up's added by its GEMM
  return up_proj->call_backward_into(dup, dx);
}

}  // namespace mt
