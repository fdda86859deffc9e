// DeepSeek's multi-head latent attention (DeepSeek-V2/V3; model.mla), LlamaAttention's forward and backward when
// model.mla.kv_lora_rank > 0:
//   q = q_b_proj(q_a_layernorm(q_a_proj x)) (or q_proj x)              (B, T, H, dn + dr)
//   [c, k_pe] = kv_a_proj_with_mqa x                                   (B, T, R + dr): the latent, one RoPE key
//   [k_nope, v] = kv_b_proj(kv_a_layernorm c)                          (B, T, H, dn + dv)
//   q_pe, k_pe rotated (RoPE on the last dr of q; k_pe shared by every head), k = [k_nope, k_pe]
//   out = attention(q, k, v) (B, T, H, dv) -> o_proj.
// The attention boundary takes one head width for q, k and v: v is padded with zeros to dn + dr and the output's
// first dv kept, so every path (the CPU and CUDA kernels, cuDNN, ring, all-gather and Ulysses) runs latent attention
// as it is (the zeros cost (dn + dr - dv) / (dn + dr) more in P V and in the ring's value bytes).
// DeepSeek's files rotate adjacent pairs of the RoPE part (x_2j, x_2j+1): the part is de-interleaved (evens, then
// odds) before the half-split RoPE, which gives the same q . k (model.mla.rope_interleave).
#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

// out (..., d) = [x_0, x_2, ..., x_1, x_3, ...] of x (..., d): the adjacent pairs' members split into halves.
void deinterleave(const Tensor& out, const Tensor& x) {
  const int64_t d = x.size(-1), n = x.numel() / d, h = d / 2;
  Tensor packed = empty({x.numel()}, x.dtype(), x.device());  // [evens (n, h), odds (n, h)]
  pack_blocks(packed, x.reshape({n * h, 2}), 1, {1, 1});
  copy_slice(out.reshape({n, d}), 0, packed.view(0, {n, h}), 0, h, 1);
  copy_slice(out.reshape({n, d}), h, packed.view(n * h, {n, h}), 0, h, 1);
}

// deinterleave's inverse.
void interleave(const Tensor& out, const Tensor& x) {
  const int64_t d = x.size(-1), n = x.numel() / d, h = d / 2;
  Tensor packed = empty({x.numel()}, x.dtype(), x.device());
  copy_slice(packed.view(0, {n, h}), 0, x.reshape({n, d}), 0, h, 1);
  copy_slice(packed.view(n * h, {n, h}), 0, x.reshape({n, d}), h, h, 1);
  unpack_blocks(out.reshape({n * h, 2}), packed, 1, {1, 1});
}

// The RoPE part (B, T, h, dr) rotated in place, de-interleaved first when the files rotate adjacent pairs.
void rope_part_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  if (interleaved) {
    Tensor t = empty(x.shape(), x.dtype(), x.device());
    deinterleave(t, x);
    rope_forward(x, t, cos, sin);
  } else {
    rope_forward(x, x, cos, sin);
  }
}

void rope_part_backward(const Tensor& dx, const Tensor& cos, const Tensor& sin, bool interleaved) {
  rope_backward(dx, dx, cos, sin);
  if (interleaved) {
    Tensor t = dx.clone();
    interleave(dx, t);
  }
}

}  // namespace

Tensor LlamaAttention::mla_forward(const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), dn = mla.qk_nope_head_dim, dr = mla.qk_rope_head_dim,
                dv = mla.v_head_dim, dqk = dn + dr, R = mla.kv_lora_rank;
  MT_CHECK(seq_->cos.defined() && seq_->cos.size(0) == T && seq_->cos.size(1) == dr, "model",
           "{}: RoPE tables ({} positions) for T = {} and the RoPE width {}", name(),
           seq_->cos.defined() ? seq_->cos.size(0) : 0, T, dr);
  Tensor q = q_proj ? q_proj->call(x) : q_b_proj->call(q_a_layernorm->call(q_a_proj->call(x)));  // (B, T, H*dqk)
  q = q.reshape({B, T, -1, dqk});                                                                 // (B, T, H, dqk)
  const int64_t H = q.size(2);
  Tensor ckv = kv_a_proj_with_mqa->call(x);  // (B, T, R + dr)
  Tensor c = empty({B, T, R}, x.dtype(), x.device());
  copy_slice(c, 0, ckv, 0, R, 2);
  Tensor kpe = empty({B, T, 1, dr}, x.dtype(), x.device());  // one RoPE key for every head
  copy_slice(kpe.reshape({B, T, dr}), 0, ckv, R, dr, 2);
  Tensor kv = kv_b_proj->call(kv_a_layernorm->call(c)).reshape({B, T, H, dn + dv});  // (B, T, H, dn + dv)
  // RoPE on the last dr of each query head and on the shared key.
  Tensor qpe = empty({B, T, H, dr}, x.dtype(), x.device());
  copy_slice(qpe, 0, q, dn, dr, 3);
  rope_part_forward(qpe, seq_->cos, seq_->sin, mla.rope_interleave);
  rope_part_forward(kpe, seq_->cos, seq_->sin, mla.rope_interleave);
  copy_slice(q, dn, qpe, 0, dr, 3);
  Tensor k = empty({B, T, H, dqk}, x.dtype(), x.device());  // [k_nope, k_pe] per head
  copy_slice(k, 0, kv, 0, dn, 3);
  for (int64_t h = 0; h < H; ++h) copy_slice(k.reshape({B * T, H * dqk}), h * dqk + dn, kpe.reshape({B * T, dr}), 0, dr, 1);
  Tensor v = zeros({B, T, H, dqk}, x.dtype(), x.device());  // the values, zero-padded to the head width
  copy_slice(v, 0, kv, dn, dv, 3);
  kv_heads_ = H;
  const AttentionCall call = attention_call();
  if (recomputing() && keep_attention_output) {
    MT_CHECK(out_->defined() && saved_->out.defined() && saved_->lse.defined() &&
                 out_->shape() == (Shape{B, T, H, dqk}),
             "model", "{}: recompute without the attention output kept by the first forward", name());
    attention->resave_inputs(*saved_, q, k, v, call);
  } else {
    out_ = attention->forward(*saved_, q, k, v, call);  // (B, T, H, dqk): the last dqk - dv zero
  }
  Tensor o = empty({B, T, H, dv}, x.dtype(), x.device());
  copy_slice(o, 0, *out_, 0, dv, 3);
  return o_proj->call(o.reshape({B, T, H * dv}));
}

Tensor LlamaAttention::mla_backward(const Tensor& dy) {
  const int64_t B = out_->size(0), T = out_->size(1), H = kv_heads_, dn = mla.qk_nope_head_dim,
                dr = mla.qk_rope_head_dim, dv = mla.v_head_dim, dqk = dn + dr, R = mla.kv_lora_rank;
  const DType dt = dy.dtype();
  const Device dev = dy.device();
  Tensor dout = o_proj->call_backward(dy).reshape({B, T, H, dv});
  Tensor doutp = zeros({B, T, H, dqk}, dt, dev);  // (B, T, H, dqk): the padding's gradient 0
  copy_slice(doutp, 0, dout, 0, dv, 3);
  Tensor dq = empty({B, T, H, dqk}, dt, dev), dk = empty({B, T, H, dqk}, dt, dev), dvp = empty({B, T, H, dqk}, dt, dev);
  attention->backward(dq, dk, dvp, doutp, *saved_, attention_call());
  saved_->clear();
  out_ = Tensor();
  // The queries: back through RoPE, then the projections.
  Tensor dqpe = empty({B, T, H, dr}, dt, dev);
  copy_slice(dqpe, 0, dq, dn, dr, 3);
  rope_part_backward(dqpe, seq_->cos, seq_->sin, mla.rope_interleave);
  copy_slice(dq, dn, dqpe, 0, dr, 3);
  Tensor dqr = dq.reshape({B, T, H * dqk});
  Tensor dx = q_proj ? q_proj->call_backward(dqr)
                     : q_a_proj->call_backward(q_a_layernorm->call_backward(q_b_proj->call_backward(dqr)));  // (B, T, C)
  // The keys and values: [dk_nope, dv] through kv_b_proj; the shared key's gradient summed over the heads.
  Tensor dkv = empty({B, T, H, dn + dv}, dt, dev);
  copy_slice(dkv, 0, dk, 0, dn, 3);
  copy_slice(dkv, dn, dvp, 0, dv, 3);
  Tensor dc = kv_a_layernorm->call_backward(kv_b_proj->call_backward(dkv.reshape({B, T, H * (dn + dv)})));  // (B, T, R)
  Tensor dkpe = zeros({B * T, dr}, dt, dev), part = empty({B * T, dr}, dt, dev);
  for (int64_t h = 0; h < H; ++h) {
    copy_slice(part, 0, dk.reshape({B * T, H * dqk}), h * dqk + dn, dr, 1);
    add_(dkpe, part);
  }
  rope_part_backward(dkpe.reshape({B, T, 1, dr}), seq_->cos, seq_->sin, mla.rope_interleave);
  Tensor dckv = empty({B, T, R + dr}, dt, dev);
  copy_slice(dckv, 0, dc, 0, R, 2);
  copy_slice(dckv, R, dkpe.reshape({B, T, dr}), 0, dr, 2);
  kv_a_proj_with_mqa->call_backward_into(dckv, dx);
  return dx;
}

}  // namespace mt
