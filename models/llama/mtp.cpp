// DeepSeek-V3's multi-token prediction module (the paper's section 2.2, depth 1; DeepSeek's tensor names under
// model.layers.{L}): x = eh_proj([enorm(e), hnorm(h)]) with e the embedding of the next token and h the model's
// final normed hidden state at the same position, then decoder layer L on x (causal over the sequence, its own
// latent attention and experts), then shared_head.norm; the model's lm_head gives its logits, whose targets are the
// tokens after next (LlamaForCausalLM::mtp_loss). The embedding and lm_head are the model's own (shared, one
// gradient each): LlamaModel runs them once on the main and the MTP rows stacked.
#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"

namespace mt {

MtpLayer::MtpLayer(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
                   std::shared_ptr<SequenceContext> seq, std::shared_ptr<MoeContext> moe, int64_t index)
    : LlamaDecoderLayer(name, c, v, f, std::move(seq), std::move(moe), index) {
  enorm = add_child(std::make_unique<RMSNorm>(child_name(name, "enorm"), c.dim, c.norm_eps, f));
  hnorm = add_child(std::make_unique<RMSNorm>(child_name(name, "hnorm"), c.dim, c.norm_eps, f));
  eh_proj = add_child(std::make_unique<Linear>(child_name(name, "eh_proj"), 2 * c.dim, c.dim, f));
  shared_head_norm = add_child(std::make_unique<RMSNorm>(child_name(name, "shared_head.norm"), c.dim, c.norm_eps, f));
}

Tensor MtpLayer::forward(const Tensor& eh) {
  const int64_t B = eh.size(0), T = eh.size(1), C = eh.size(2) / 2;
  Tensor e = empty({B, T, C}, eh.dtype(), eh.device()), h = empty({B, T, C}, eh.dtype(), eh.device());
  copy_slice(e, 0, eh, 0, C, 2);
  copy_slice(h, 0, eh, C, C, 2);
  Tensor x = empty({B, T, 2 * C}, eh.dtype(), eh.device());  // (B, T, 2C) [enorm(e), hnorm(h)]
  copy_slice(x, 0, enorm->call(e), 0, C, 2);
  copy_slice(x, C, hnorm->call(h), 0, C, 2);
  return shared_head_norm->call(LlamaDecoderLayer::forward(eh_proj->call(x)));  // (B, T, C)
}

Tensor MtpLayer::backward(const Tensor& dy) {
  Tensor dx = eh_proj->call_backward(LlamaDecoderLayer::backward(shared_head_norm->call_backward(dy)));  // (B, T, 2C)
  const int64_t B = dx.size(0), T = dx.size(1), C = dx.size(2) / 2;
  Tensor de = empty({B, T, C}, dx.dtype(), dx.device()), dh = empty({B, T, C}, dx.dtype(), dx.device());
  copy_slice(de, 0, dx, 0, C, 2);
  copy_slice(dh, 0, dx, C, C, 2);
  Tensor out = empty(dx.shape(), dx.dtype(), dx.device());  // (B, T, 2C) [de, dh]
  copy_slice(out, 0, enorm->call_backward(de), 0, C, 2);
  copy_slice(out, C, hnorm->call_backward(dh), 0, C, 2);
  return out;
}

}  // namespace mt
