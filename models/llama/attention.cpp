// Llama self-attention: q/k/v projections, RoPE on q and k, causal grouped-query
// attention through the attention boundary (attention/attention.h), o
// projection. Head counts come from the local projection sizes, so the same code
// runs with heads split across tensor-parallel ranks; the layer knows nothing of
// context parallel.
#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"

namespace mt {

void SequenceContext::set_positions(const Tensor& pos, int64_t head_dim, DType dtype, Device device) {
  if (positions.defined() && cos.defined() && cos.size(1) == head_dim && cos.dtype() == dtype &&
      positions.shape() == pos.shape() && equal(positions, pos))
    return;  // same positions as the last forward: keep the tables
  positions = pos.clone();
  Tensor c = empty({pos.numel(), head_dim}, dtype), s = empty({pos.numel(), head_dim}, dtype);  // (T, hd)
  rope_tables(c, s, positions, theta);
  cos = c.to(device);
  sin = s.to(device);
}

void SequenceContext::set_documents(const Tensor& d) {
  doc_start = d;
  ++batch;
}

AttentionCall SequenceContext::attention_call() const {
  AttentionCall c;
  c.causal = true;
  c.doc_start = doc_start;
  c.batch = batch;
  return c;
}

LlamaAttention::LlamaAttention(const std::string& name, const ModelConfig& c, const ParamFactory& f,
                               std::shared_ptr<SequenceContext> seq)
    : Module(name, "LlamaAttention"), head_dim(c.dim / c.n_heads), seq_(std::move(seq)) {
  q_proj = add_child(std::make_unique<Linear>(child_name(name, "q_proj"), c.dim, c.n_heads * head_dim, f));
  k_proj = add_child(std::make_unique<Linear>(child_name(name, "k_proj"), c.dim, c.n_kv_heads * head_dim, f));
  v_proj = add_child(std::make_unique<Linear>(child_name(name, "v_proj"), c.dim, c.n_kv_heads * head_dim, f));
  o_proj = add_child(std::make_unique<Linear>(child_name(name, "o_proj"), c.n_heads * head_dim, c.dim, f));
}

Tensor LlamaAttention::forward(const Tensor& x) {
  int64_t B = x.size(0), T = x.size(1), hd = head_dim;
  Tensor q = q_proj->call(x), k = k_proj->call(x), v = v_proj->call(x);  // (B, T, H*hd), (B, T, KV*hd) x2
  q = q.reshape({B, T, -1, hd});                                         // (B, T, H, hd)
  k = k.reshape({B, T, -1, hd});                                         // (B, T, KV, hd)
  v = v.reshape({B, T, -1, hd});
  MT_CHECK(seq_->cos.defined() && seq_->cos.size(0) == T, "model", "{}: RoPE tables for {} positions, input has T = {}",
           name(), seq_->cos.defined() ? seq_->cos.size(0) : 0, T);
  rope_forward(q, q, seq_->cos, seq_->sin);
  rope_forward(k, k, seq_->cos, seq_->sin);
  int64_t H = q.size(2);
  kv_heads_ = k.size(2);
  const AttentionCall call = seq_->attention_call();
  if (recomputing() && keep_attention_output) {
    // Selective recompute: the first forward's attention output and log-sum-exp were kept; the kernel's
    // result would be the same bits, so it (and its cp communication over the sequence) is not run again.
    MT_CHECK(out_.defined() && saved_.out.defined() && saved_.lse.defined() && out_.shape() == (Shape{B, T, H, hd}),
             "model", "{}: recompute without the attention output kept by the first forward", name());
    attention->resave_inputs(saved_, q, k, v, call);
  } else {
    out_ = attention->forward(saved_, q, k, v, call);  // (B, T, H, hd)
  }
  return o_proj->call(out_.reshape({B, T, H * hd}));
}

void LlamaAttention::drop_saved() {
  saved_.q = saved_.k = saved_.v = Tensor();
  if (!keep_attention_output) {
    saved_.clear();
    out_ = Tensor();
  }
}

Tensor LlamaAttention::backward(const Tensor& dy) {
  // dy may be sequence-sharded (o_proj's output layout); out_ has the attention's (this rank's) sequence.
  int64_t B = out_.size(0), T = out_.size(1), KV = kv_heads_;
  Tensor dout = o_proj->call_backward(dy).reshape(out_.shape());  // (B, T, H, hd)
  Tensor dq = empty(out_.shape(), dy.dtype(), dy.device());        // (B, T, H, hd)
  Tensor dk = empty({B, T, KV, head_dim}, dy.dtype(), dy.device());  // (B, T, KV, hd)
  Tensor dv = empty(dk.shape(), dy.dtype(), dy.device());
  attention->backward(dq, dk, dv, dout, saved_, seq_->attention_call());
  rope_backward(dq, dq, seq_->cos, seq_->sin);
  rope_backward(dk, dk, seq_->cos, seq_->sin);
  saved_.clear();
  out_ = Tensor();
  Tensor dx = q_proj->call_backward(dq.reshape({B, T, -1}));  // (B, T, C), then k's and v's added by their GEMMs
  k_proj->call_backward_into(dk.reshape({B, T, -1}), dx);
  v_proj->call_backward_into(dv.reshape({B, T, -1}), dx);
  return dx;
}

}  // namespace mt
