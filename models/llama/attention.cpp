// Llama self-attention: q/k/v projections, RoPE on q and k, causal grouped-query
// attention through the attention boundary (attention/attention.h), o
// projection. Head counts come from the local projection sizes, so the same code
// runs with heads split across tensor-parallel ranks; the layer knows nothing of
// context parallel.
#include <algorithm>
#include <cmath>

#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

// The scaled frequencies in f64: inv_freq_i = theta^(-2i/hd); linear divides each by factor; llama3 (Llama 3.1's
// rule) keeps those whose wavelength 2 pi / f is below original / high_freq_factor, divides those above
// original / low_freq_factor by factor, and interpolates between by smooth = (original / wavelength - low) /
// (high - low); longrope (Phi-3) divides frequency i by long_factor[i] when the run's sequence (seq_len:
// training.seq_len) exceeds original_max_position_embeddings, else by short_factor[i]; yarn interpolates between
// base / factor and base along a ramp of the dims (DeepSeek's YaRN).
std::vector<double> scaled_inv_freq(const RopeScalingConfig& r, double theta, int64_t hd, int64_t seq_len) {
  std::vector<double> f(size_t(hd / 2));
  const bool longer = seq_len > r.original_max_position_embeddings;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double base = 1.0 / std::pow(theta, double(2 * i) / double(hd));
    double v = base;
    if (r.type == "yarn") {
      // YaRN: frequency i interpolated (divided by factor) below the ramp, kept above it; the ramp runs between
      // the dims at which a frequency turns beta_fast and beta_slow times over the original context.
      auto dim_of = [&](double turns) {
        return double(hd) * std::log(double(r.original_max_position_embeddings) / (turns * 2 * M_PI)) /
               (2 * std::log(theta));
      };
      const double low = std::max(std::floor(dim_of(r.beta_fast)), 0.0);
      double high = std::min(std::ceil(dim_of(r.beta_slow)), double(hd - 1));
      if (low == high) high += 0.001;
      const double keep = 1 - std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
      v = base / r.factor * (1 - keep) + base * keep;
    } else if (r.type == "longrope") {
      v = base / (longer ? r.long_factor : r.short_factor).at(size_t(i));
    } else if (r.type == "linear") {
      v = base / r.factor;
    } else if (r.type == "llama3") {
      const double old_ctx = double(r.original_max_position_embeddings);
      const double wavelen = 2 * M_PI / base;
      if (wavelen > old_ctx / r.low_freq_factor) {
        v = base / r.factor;
      } else if (wavelen >= old_ctx / r.high_freq_factor) {
        const double smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        v = (1 - smooth) * base / r.factor + smooth * base;
      }
    }
    f[size_t(i)] = v;
  }
  return f;
}

// cos, sin (P, hd) f64 of the scaled frequencies, every step in f64 (the reference's precision: one rounding, to
// the model's dtype, by the caller), laid out as rope_tables lays them out ([f0..f_{hd/2-1}] twice); longrope's
// multiplied by its attention factor.
void scaled_tables(const Tensor& c, const Tensor& s, const Tensor& pos, const RopeScalingConfig& r, double theta,
                   int64_t seq_len, int64_t max_positions) {
  const int64_t P = pos.numel(), hd = c.size(1), half = hd / 2;
  const std::vector<double> f = scaled_inv_freq(r, theta, hd, seq_len);
  const double m = r.type == "longrope" ? r.longrope_attention_factor(max_positions)
                   : r.type == "yarn"   ? r.yarn_attention_factor()
                                        : 1.0;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(pos.at<int64_t>(p)) * f[size_t(i)];
      c.at<double>(p * hd + i) = c.at<double>(p * hd + i + half) = m * std::cos(angle);
      s.at<double>(p * hd + i) = s.at<double>(p * hd + i + half) = m * std::sin(angle);
    }
}

}  // namespace

void SequenceContext::set_positions(const Tensor& pos, int64_t head_dim, DType dtype, Device device) {
  if (positions.defined() && cos.defined() && cos.size(1) == head_dim && cos.dtype() == dtype &&
      positions.shape() == pos.shape() && equal(positions, pos))
    return;  // same positions as the last forward: keep the tables
  positions = pos.clone();
  Tensor c = empty({pos.numel(), head_dim}, dtype), s = empty({pos.numel(), head_dim}, dtype);  // (T, hd)
  if (local_theta > 0) {  // Gemma 3's sliding layers: plain RoPE of their own base
    Tensor cl = empty({pos.numel(), head_dim}, dtype), sl = empty({pos.numel(), head_dim}, dtype);  // (T, hd)
    rope_tables(cl, sl, positions, local_theta);
    cos_local = cl.to(device);
    sin_local = sl.to(device);
  }
  if (rope_scaling.type == "none") {
    rope_tables(c, s, positions, theta);
  } else {
    Tensor c64 = empty(c.shape(), DType::f64), s64 = empty(s.shape(), DType::f64);
    scaled_tables(c64, s64, positions, rope_scaling, theta, seq_len, max_positions);
    convert(c, c64);
    convert(s, s64);
  }
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

LlamaAttention::LlamaAttention(const std::string& name, const ModelConfig& c, const LlamaVariant& variant,
                               const ParamFactory& f, std::shared_ptr<SequenceContext> seq, int64_t index)
    : Module(name, "LlamaAttention"), head_dim(c.head_size()), seq_(std::move(seq)) {
  if (variant.gemma) {
    sliding = c.sliding_layer(index);
    window = sliding ? c.sliding_window : 0;
    scale = 1.0 / std::sqrt(c.query_pre_attn_scalar > 0 ? c.query_pre_attn_scalar : double(head_dim));
    softcap = c.attn_softcap;
  }
  if (c.mla.enabled()) {  // DeepSeek's latent attention: its own projections, in Hugging Face's order
    mla = c.mla;
    const int64_t H = c.n_heads, dqk = mla.qk_head_dim();
    head_dim = dqk;
    scale = 1.0 / std::sqrt(double(dqk)) * c.rope_scaling.yarn_softmax_factor();
    q_proj = k_proj = v_proj = nullptr;
    if (mla.q_lora_rank > 0) {
      q_a_proj = add_child(std::make_unique<Linear>(child_name(name, "q_a_proj"), c.dim, mla.q_lora_rank, f));
      q_a_layernorm =
          add_child(std::make_unique<RMSNorm>(child_name(name, "q_a_layernorm"), mla.q_lora_rank, c.norm_eps, f));
      q_b_proj = add_child(std::make_unique<Linear>(child_name(name, "q_b_proj"), mla.q_lora_rank, H * dqk, f));
    } else {
      q_proj = add_child(std::make_unique<Linear>(child_name(name, "q_proj"), c.dim, H * dqk, f));
    }
    kv_a_proj_with_mqa = add_child(std::make_unique<Linear>(child_name(name, "kv_a_proj_with_mqa"), c.dim,
                                                            mla.kv_lora_rank + mla.qk_rope_head_dim, f));
    kv_a_layernorm =
        add_child(std::make_unique<RMSNorm>(child_name(name, "kv_a_layernorm"), mla.kv_lora_rank, c.norm_eps, f));
    kv_b_proj = add_child(std::make_unique<Linear>(child_name(name, "kv_b_proj"), mla.kv_lora_rank,
                                                   H * (mla.qk_nope_head_dim + mla.v_head_dim), f));
    o_proj = add_child(std::make_unique<Linear>(child_name(name, "o_proj"), H * mla.v_head_dim, c.dim, f));
    return;
  }
  const bool b = variant.qkv_bias;
  q_proj = add_child(std::make_unique<Linear>(child_name(name, "q_proj"), c.dim, c.n_heads * head_dim, f, nullptr, b));
  k_proj =
      add_child(std::make_unique<Linear>(child_name(name, "k_proj"), c.dim, c.n_kv_heads * head_dim, f, nullptr, b));
  v_proj =
      add_child(std::make_unique<Linear>(child_name(name, "v_proj"), c.dim, c.n_kv_heads * head_dim, f, nullptr, b));
  o_proj = add_child(std::make_unique<Linear>(child_name(name, "o_proj"), c.n_heads * head_dim, c.dim, f));
  if (variant.qk_norm) {
    q_norm = add_child(std::make_unique<RMSNorm>(child_name(name, "q_norm"), head_dim, c.norm_eps, f, variant.gemma));
    k_norm = add_child(std::make_unique<RMSNorm>(child_name(name, "k_norm"), head_dim, c.norm_eps, f, variant.gemma));
  }
}

AttentionCall LlamaAttention::attention_call() const {
  AttentionCall c = seq_->attention_call();
  c.scale = scale, c.window = window, c.softcap = softcap;
  return c;
}

Tensor LlamaAttention::forward(const Tensor& x) {
  if (mla.enabled()) return mla_forward(x);
  int64_t B = x.size(0), T = x.size(1), hd = head_dim;
  Tensor q = q_proj->call(x), k = k_proj->call(x), v = v_proj->call(x);  // (B, T, H*hd), (B, T, KV*hd) x2
  q = q.reshape({B, T, -1, hd});                                         // (B, T, H, hd)
  k = k.reshape({B, T, -1, hd});                                         // (B, T, KV, hd)
  v = v.reshape({B, T, -1, hd});
  MT_CHECK(seq_->cos.defined() && seq_->cos.size(0) == T, "model", "{}: RoPE tables for {} positions, input has T = {}",
           name(), seq_->cos.defined() ? seq_->cos.size(0) : 0, T);
  if (q_norm) q = q_norm->call(q), k = k_norm->call(k);  // over each head's hd
  const Tensor& cos = local_rope() ? seq_->cos_local : seq_->cos;
  const Tensor& sin = local_rope() ? seq_->sin_local : seq_->sin;
  rope_forward(q, q, cos, sin);
  rope_forward(k, k, cos, sin);
  int64_t H = q.size(2);
  kv_heads_ = k.size(2);
  const AttentionCall call = attention_call();
  if (recomputing() && keep_attention_output) {
    // Selective recompute: the first forward's attention output and log-sum-exp were kept; the kernel's
    // result would be the same bits, so it (and its cp communication over the sequence) is not run again.
    MT_CHECK(out_->defined() && saved_->out.defined() && saved_->lse.defined() && out_->shape() == (Shape{B, T, H, hd}),
             "model", "{}: recompute without the attention output kept by the first forward", name());
    attention->resave_inputs(*saved_, q, k, v, call);
  } else {
    out_ = attention->forward(*saved_, q, k, v, call);  // (B, T, H, hd)
  }
  return o_proj->call(out_->reshape({B, T, H * hd}));
}

void LlamaAttention::drop_saved() {
  saved_->q = saved_->k = saved_->v = Tensor();
  if (!keep_attention_output) {
    saved_->clear();
    out_ = Tensor();
  }
}

Tensor LlamaAttention::backward(const Tensor& dy) {
  if (mla.enabled()) return mla_backward(dy);
  // dy may be sequence-sharded (o_proj's output layout); out_ has the attention's (this rank's) sequence.
  int64_t B = out_->size(0), T = out_->size(1), KV = kv_heads_;
  Tensor dout = o_proj->call_backward(dy).reshape(out_->shape());  // (B, T, H, hd)
  Tensor dq = empty(out_->shape(), dy.dtype(), dy.device());        // (B, T, H, hd)
  Tensor dk = empty({B, T, KV, head_dim}, dy.dtype(), dy.device());  // (B, T, KV, hd)
  Tensor dv = empty(dk.shape(), dy.dtype(), dy.device());
  attention->backward(dq, dk, dv, dout, *saved_, attention_call());
  const Tensor& cos = local_rope() ? seq_->cos_local : seq_->cos;
  const Tensor& sin = local_rope() ? seq_->sin_local : seq_->sin;
  rope_backward(dq, dq, cos, sin);
  rope_backward(dk, dk, cos, sin);
  if (q_norm) dq = q_norm->call_backward(dq), dk = k_norm->call_backward(dk);
  saved_->clear();
  out_ = Tensor();
  Tensor dx = q_proj->call_backward(dq.reshape({B, T, -1}));  // (B, T, C), then k's and v's added by their GEMMs
  k_proj->call_backward_into(dk.reshape({B, T, -1}), dx);
  v_proj->call_backward_into(dv.reshape({B, T, -1}), dx);
  return dx;
}

}  // namespace mt
