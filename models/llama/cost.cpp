// What the Llama architecture's tensors cost on one rank (CausalLM::activation_bytes and stage_flops, read by
// `meshtrain estimate`): the activations each module of this file's neighbours (attention.cpp, mlp.cpp,
// llama.cpp) keeps for backward, in the layouts the parallelisms give them, and the FLOPs of their GEMMs and
// attention kernels.
#include <algorithm>

#include "models/llama/llama.h"
#include "models/moe_cost.h"

namespace mt {

namespace {

// One micro-batch's sizes on a rank after the parallelisms' splits.
struct Dims {
  double B = 1, T = 1, Tsp = 1, C = 1, H = 1, KV = 1, hd = 1, F = 1, Vl = 1;  // Vl: the logits' local vocabulary
  double e = 4, a = 4;  // bytes of the compute dtype and of its accumulation dtype
  // MoE layers (models/llama/moe.h), which run whole on every tp rank: N = B T tokens, M = N k rows routed (after
  // the capacity), R the rows the local experts take (M on average under ep: balanced routing), E experts, k, an
  // expert's width Fe and the shared expert's Fs.
  double N = 1, M = 0, R = 0, E = 0, K = 0, Fe = 0, Fs = 0;
  bool ep = false;
  // Latent attention (mla.cpp): hd is the query-key width dn + dr, which the kernel also gives v (zero-padded from
  // dv), and KV = H; the latents' widths ql (0: q_proj) and Rk, which every tp rank computes whole.
  bool mla = false;
  double dn = 0, dr = 0, dv = 0, ql = 0, Rk = 0;
};
Dims dims_of(const ModelConfig& c, const RankShape& s) {
  Dims d;
  d.e = s.elem, d.a = s.accum;
  d.B = double(s.micro);
  d.T = double(s.tokens);
  d.Tsp = s.sequence_parallel ? d.T / s.tp : d.T;  // the residual stream between blocks
  d.C = double(c.dim);
  d.H = double(c.n_heads / s.tp);
  d.KV = double(c.n_kv_heads / s.tp);
  d.hd = double(c.head_size());
  d.F = double(c.ffn_dim / s.tp);
  d.Vl = double(s.loss_parallel ? c.vocab_size / s.tp : c.vocab_size);
  if (c.mla.enabled()) {
    d.mla = true;
    d.hd = double(c.mla.qk_head_dim());
    d.dn = double(c.mla.qk_nope_head_dim), d.dr = double(c.mla.qk_rope_head_dim), d.dv = double(c.mla.v_head_dim);
    d.ql = double(c.mla.q_lora_rank), d.Rk = double(c.mla.kv_lora_rank);
  }
  if (c.moe.enabled()) {
    d.N = d.B * d.T;
    d.M = moe_layer_bytes(c, s.ep, s.micro, s.tokens, s.elem).rows;  // ep in fixed blocks: E x cap, padding included
    d.R = d.M;
    d.E = double(c.moe.n_experts), d.K = double(c.moe.experts_per_token);
    d.Fe = double(c.moe.ffn_dim), d.Fs = double(c.moe.shared_expert_ffn_dim);
    d.ep = s.ep > 1;
  }
  return d;
}

// What one decoder layer keeps for backward, tensor by tensor, with the recompute flags the policy set on it.
struct LayerSaved {
  double total = 0;  // held from its forward to its backward
  double whole = 0;  // the same without recompute (what a recomputed layer holds again inside its backward)
};
LayerSaved layer_saved(const Dims& d, const RankShape& s, const LlamaDecoderLayer* l) {
  auto A = [&](double b) { return s.alloc(b); };
  // input_layernorm and post_attention_layernorm each keep their input (the residual stream, sequence-sharded
  // under sequence parallel) and rstd (B*T_sp, accumulation dtype).
  // Gemma's four (after attention, before and after the MLP) keep theirs alike.
  const double n_norms = l->pre_feedforward_layernorm ? 4 : 2;
  const double norms = n_norms * A(d.e * d.B * d.Tsp * d.C) + n_norms * A(d.a * d.B * d.Tsp);
  // The attention: its input after the hooks (whole sequence per tp rank: q/k/v_proj's saved input), q, k, v
  // (AttentionSaved, RoPE applied in place), the output (o_proj's input; Ulysses keeps it in both layouts) and
  // the log-sum-exp (B, H, T).
  const double attn_in = A(d.e * d.B * d.T * d.C);
  const double qkv = A(d.e * d.B * d.T * d.H * d.hd) + 2 * A(d.e * d.B * d.T * d.KV * d.hd);
  const double out = A(d.e * d.B * d.T * d.H * d.hd) * (s.cp_ulysses > 1 ? 2 : 1), lse = A(d.a * d.B * d.H * d.T);
  // Latent attention (mla.cpp) also keeps, on every tp rank whole: q_a_layernorm's input and rstd and q_b_proj's
  // input (the q latent, normed), kv_a_layernorm's input (the kv latent, copied out of kv_a_proj_with_mqa's output)
  // and rstd, kv_b_proj's input; and o_proj's input, the output's first dv of each head (B, T, H, dv), beside the
  // padded output (out). q, k and the padded v are qkv's three (B, T, H, dn + dr).
  double latents = 0;
  if (d.mla) {
    latents = A(d.e * d.B * d.T * d.Rk) * 2 + A(d.a * d.B * d.T) + A(d.e * d.B * d.T * d.H * d.dv);
    if (d.ql > 0) latents += A(d.e * d.B * d.T * d.ql) * 2 + A(d.a * d.B * d.T);
  }
  // The MLP: its input after the hooks, gate and up (B, T, F), and the SwiGLU output (down_proj's input).
  const double mlp_in = A(d.e * d.B * d.T * d.C);
  double mlp = 3 * A(d.e * d.B * d.T * d.F);
  if (l->moe_block) {
    // A sparse block (moe.cpp): the router's input (mlp_in, the block's input, which the shared expert and its
    // gate save too), probs (N, E) and the top-k weights (N, K) in the accumulation dtype, the experts' indices and
    // slots (N, K) i32, the experts' input, gate and up ((R, C), (R, F), (R, F): the rows here), the experts'
    // output h (M, C); the shared expert: gate, up, SwiGLU output (N, Fs), its output (N, C), its gate (N, 1).
    mlp = A(d.a * d.N * d.E) + A(d.a * d.N * d.K) + 2 * A(4 * d.N * d.K) + A(d.e * d.R * d.C) +
          2 * A(d.e * d.R * d.Fe) + A(d.e * d.M * d.C);
    if (d.Fs > 0) mlp += 3 * A(d.e * d.N * d.Fs) + A(d.e * d.N * d.C) + A(d.a * d.N);
  }
  LayerSaved r;
  r.whole = norms + attn_in + latents + qkv + out + lse + mlp_in + mlp;
  const bool keep = l->self_attn->keep_attention_output;
  if (l->recompute) {
    // Only the layer's input (the residual stream), and with keep: [attention] its output and lse.
    r.total = A(d.e * d.B * d.Tsp * d.C) + (keep ? out + lse : 0);
    return r;
  }
  r.total = norms;
  r.total += l->self_attn->recompute ? attn_in + (keep ? out + lse : 0) : attn_in + latents + qkv + out + lse;
  r.total += l->mlp->recompute ? mlp_in : mlp_in + mlp;
  return r;
}

}  // namespace

ActivationBytes LlamaForCausalLM::activation_bytes(const RankShape& s) const {
  const Dims d = dims_of(config, s);
  auto A = [&](double b) { return s.alloc(b); };
  ActivationBytes r;
  std::vector<const LlamaDecoderLayer*> layers(model->layers.begin(), model->layers.end());
  if (model->mtp) layers.push_back(model->mtp);  // the MTP module's decoder layer saves what a layer saves
  for (const LlamaDecoderLayer* l : layers) {
    if (!l) continue;
    const LayerSaved saved = layer_saved(d, s, l);
    r.layers += saved.total;
    if (l->recompute || l->self_attn->recompute || l->mlp->recompute)
      r.recompute_transient = std::max(r.recompute_transient, saved.whole - saved.total);
    ++r.layers_here;
    if (l->moe_block) ++r.sparse_layers, r.sparse_recomputed += l->recompute || l->mlp->recompute;
  }
  const int64_t dense_here = r.layers_here - r.sparse_layers;
  const bool last = has_output();
  if (has_input()) r.input = A(4 * d.B * d.T);  // the embedding keeps its token ids
  // bf16 on CPU ranks: the embedding's forward widens its table (V/tp rows) and writes an f32 output.
  if (has_input() && s.widened_bf16)
    r.input_forward = A(4 * double(config.vocab_size / s.tp) * d.C) + A(4 * d.B * d.T * d.C);
  if (last) {
    // The final norm's input and rstd, lm_head's input (whole sequence per tp rank), released by their
    // backwards; the logits (B, T, V/tp), which become dloss/dlogits in place, and the per-token losses, held
    // through the whole backward.
    r.head = A(d.e * d.B * d.Tsp * d.C) + A(d.a * d.B * d.Tsp) + A(d.e * d.B * d.T * d.C);
    r.logits = A(d.e * d.B * d.T * d.Vl) + A(d.a * d.B * d.T);
    if (final_softcap > 0) r.logits += A(d.e * d.B * d.T * d.Vl);  // the soft-capped logits' copy (its backward)
    if (model->mtp) {
      // Multi-token prediction: lm_head's input and the logits over 2B rows (main and MTP), and the module's own
      // saved inputs: enorm's and hnorm's (C each), eh_proj's (2C) and shared_head.norm's (C), with three rstds.
      // (Approximate: on the tiny test model the estimate's peak is above the measured one; not calibrated.)
      r.head += A(d.e * d.B * d.T * d.C) + A(d.e * d.B * d.Tsp * 5 * d.C) + 3 * A(d.a * d.B * d.Tsp);
      r.logits = 2 * r.logits;
    }
  }
  // zb1p's DeferWeightGrads, between a micro-batch's B and its W: each linear's input and output gradient (per
  // layer 4 C + (2 H + 2 KV) hd + 3 F of the (B, T) tokens), and lm_head's input and dlogits.
  // Latent attention's linears: x (shared by q_a_proj and kv_a_proj_with_mqa, or q_proj), q_a_proj's output
  // gradient and q_b_proj's input (ql each), q_b_proj's or q_proj's output gradient (H dqk), kv_a_proj_with_mqa's
  // (R + dr), kv_b_proj's input (R) and output gradient (H (dn + dv)), o_proj's input (H dv) and output gradient.
  const double attn_deferred =
      d.mla ? 2 * A(d.e * d.B * d.T * d.C) + (d.ql > 0 ? 2 * A(d.e * d.B * d.T * d.ql) : 0) +
                  A(d.e * d.B * d.T * d.H * d.hd) + A(d.e * d.B * d.T * (d.Rk + d.dr)) + A(d.e * d.B * d.T * d.Rk) +
                  A(d.e * d.B * d.T * d.H * (d.dn + d.dv)) + A(d.e * d.B * d.T * d.H * d.dv)
            : 2 * A(d.e * d.B * d.T * d.C) + 2 * A(d.e * d.B * d.T * d.H * d.hd) +
                  2 * A(d.e * d.B * d.T * d.KV * d.hd);
  r.deferred = (attn_deferred + 2 * A(d.e * d.B * d.T * d.C) + 3 * A(d.e * d.B * d.T * d.F)) * double(dense_here) +
               // A sparse layer: the attention's as above, the router's input and dlogits (the experts' grouped
               // GEMMs compute their weight gradients at once).
               (r.sparse_layers > 0
                    ? (attn_deferred + 2 * A(d.e * d.B * d.T * d.C) + A(d.e * d.N * d.E)) * double(r.sparse_layers)
                    : 0) +
               (last ? A(d.e * d.B * d.T * d.C) + A(d.e * d.B * d.T * d.Vl) : 0);
  // The largest gradients in flight: lm_head's backward (every saved tensor still held, its input gradient
  // made), or the last layer's MLP or attention backward (the head's saved tensors released by then: dh, dgate,
  // dup or dq, dk, dv beside the incoming residual gradient). bf16 on CPU ranks runs each op in f32 on widened
  // copies (runtime/kernels/op.h): SwiGLU's backward then also holds f32 copies of dh, gate and up and f32
  // buffers for dgate and dup.
  const double residual_grad = A(d.e * d.B * d.Tsp * d.C);
  double head_grads = last ? A(d.e * d.B * d.T * d.C) + (s.sequence_parallel ? residual_grad : 0) : 0;
  if (last && s.widened_bf16) {
    // lm_head's matmul backward in f32: dlogits (its local vocabulary), the input and the weight widened, and
    // an f32 buffer for the input gradient; the weight is a vocabulary-sized matrix, so this is the step's
    // peak whenever the vocabulary dominates. The loss widens the logits and writes dlogits in f32 too.
    const double Vtp = double(config.vocab_size / s.tp);
    head_grads += A(4 * d.B * d.T * Vtp) + 2 * A(4 * d.B * d.T * d.C) + A(4 * Vtp * d.C);
    r.loss = 2 * A(4 * d.B * d.T * d.Vl);
  }
  const double widened = s.widened_bf16 ? 5 * A(4 * d.B * d.T * d.F) : 0;
  const double mlp_grads = 3 * A(d.e * d.B * d.T * d.F) + residual_grad - r.head + widened;
  // Latent attention: o_proj's input gradient (B, T, H, dv) beside its padded copy and dq, dk, dv (dqk each).
  const double attn_grads = 2 * A(d.e * d.B * d.T * d.H * d.hd) + 2 * A(d.e * d.B * d.T * d.KV * d.hd) +
                            (d.mla ? A(d.e * d.B * d.T * d.H * d.dv) : 0) + residual_grad - r.head;
  r.backward_peak = std::max({head_grads, r.sparse_layers == 0 || dense_here > 0 ? mlp_grads : 0.0, attn_grads, 0.0});
  if (r.sparse_layers > 0) {
    // A sparse block's backward (moe.cpp): dh (M, C) and dw (N, K) held through it; under ep the gradients that
    // arrived and their expert-major copy (R, C) each; inside the experts' backward SwiGLU's input recomputed, its
    // gradient, dgate and dup (R, F) and dx twice (R, C) (widened bf16: f32 copies as the dense MLP's).
    const double outer = A(d.e * d.M * d.C) + A(d.a * d.N * d.K) + (d.ep ? 2 * A(d.e * d.R * d.C) : 0);
    const double experts = 4 * A(d.e * d.R * d.Fe) + 2 * A(d.e * d.R * d.C) +
                           (s.widened_bf16 ? 5 * A(4 * d.R * d.Fe) : 0);
    double moe_grads = outer + experts + residual_grad - r.head;
    if (d.Fs > 0) {
      // The shared expert's backward after the routed part: dh, dw, dxp (M, C), dx, the router's dlogits (N, E),
      // ds (N, C), and the dense MLP's gradients (N, Fs) x 3.
      const double shared = A(d.e * d.M * d.C) + A(d.a * d.N * d.K) + A(d.e * d.M * d.C) + A(d.e * d.N * d.C) +
                            A(d.e * d.N * d.E) + A(d.e * d.N * d.C) + 3 * A(d.e * d.N * d.Fs) +
                            (s.widened_bf16 ? 5 * A(4 * d.N * d.Fs) : 0);
      moe_grads = std::max(moe_grads, shared + residual_grad - r.head);
    }
    r.backward_peak = std::max(r.backward_peak, moe_grads);
  }
  r.boundary = d.B * d.Tsp * d.C * d.e;  // (B, T_sp, C): the residual stream leaving a stage
  return r;
}

StageFlops LlamaForCausalLM::stage_flops(const RankShape& s) const {
  const Dims d = dims_of(config, s);
  // The decoder layers' and lm_head's split below counts the model without multi-token prediction; the MTP
  // module (its layer, norms, eh_proj and lm_head again) runs on the last stage beside the head.
  ModelConfig mc = config;
  mc.mtp_layers = 0;
  const int tp = s.tp;
  StageFlops f;
  // The PaLM count (llama_flops_per_token) split into a layer's GEMMs and attention kernels, and lm_head.
  f.head = 6.0 * double(mc.vocab_size) * d.C / (tp > 1 ? tp : 1);
  if (config.mtp_layers > 0 && has_output())
    f.head += (llama_flops_per_token(config, s.seq_len, variant) - llama_flops_per_token(mc, s.seq_len, variant)) /
              (tp > 1 ? tp : 1);
  const double total = llama_flops_per_token(mc, s.seq_len, variant);
  // Sliding-window layers see fewer keys (llama_attention_keys): the stage's layers averaged.
  double keys = 0;
  int64_t here = 0;
  for (size_t i = 0; i < model->layers.size(); ++i)
    if (model->layers[i]) keys += llama_attention_keys(mc, s.seq_len, int64_t(i)), ++here;
  keys = here > 0 ? keys / double(here) : double(s.seq_len);
  // The kernels' work: latent attention's P V at the padded width dqk (llama_attention_flops_per_key's executed
  // count), which the model's FLOPs (llama_flops_per_token, MFU) count at dv.
  f.layer_attention = llama_attention_flops_per_key(mc, true) * keys / tp;
  const double all_keys = [&] {
    double k = 0;
    for (int64_t i = 0; i < mc.n_layers; ++i) k += llama_attention_keys(mc, s.seq_len, i);
    return k;
  }();
  // Latent attention's q_a_proj and kv_a_proj_with_mqa (and norms) run whole on every tp rank: not divided.
  const LlamaAttentionParams ap = llama_attention_params(mc, variant);
  const double replicated = 6.0 * double(ap.tp_replicated) * (1.0 - 1.0 / tp);
  f.layer_gemm =
      (total - 6.0 * double(mc.vocab_size) * d.C - llama_attention_flops_per_key(mc, false) * all_keys) /
          double(mc.n_layers) / tp +
      replicated;
  // Recompute runs forwards again (2 FLOPs a weight and token): a recomputed layer or attention repeats q, k, v
  // and o and, unless keep: [attention] kept the output, the attention kernel; a recomputed MLP gate, up and down.
  const double proj_fwd =
      d.mla ? 2.0 * (double(ap.all - ap.tp_replicated) / tp + double(ap.tp_replicated))
            : 2.0 * double(mc.dim) * double(2 * mc.n_heads + 2 * mc.n_kv_heads) * double(mc.head_size()) / tp;
  const double mlp_fwd = 2.0 * 3.0 * double(mc.dim) * double(mc.ffn_dim) / tp;
  for (const LlamaDecoderLayer* l : model->layers) {
    if (!l) continue;
    const bool attn_again = l->recompute || l->self_attn->recompute, mlp_again = l->recompute || l->mlp->recompute;
    f.recomputed_gemm += (attn_again ? proj_fwd : 0) + (mlp_again ? mlp_fwd : 0);
    f.recomputed_attention += attn_again && !l->self_attn->keep_attention_output;
  }
  // Causal attention's forward as the calibration counts it: 4 T S H hd / 2 for T tokens.
  f.attention_causal = 0.5 * 4.0 * double(s.seq_len) * d.H * d.hd;
  // Norms, residual adds, RoPE and SwiGLU: about 6 C + 2 (H + 2 KV) hd + 4 F elements read or written per token
  // in forward; the loss reads, exponentiates and writes the local logits. Latent attention: the latents' norms
  // and copies (2 ql + 4 R), RoPE on the copied-out q_pe and k_pe, k's assembly, v's zero fill and copy, the
  // output's slice: about H (8 dr + 2 dn + dqk + 4 dv).
  const double attn_traffic = d.mla ? 2 * d.ql + 4 * d.Rk + d.H * (8 * d.dr + 2 * d.dn + d.hd + 4 * d.dv)
                                    : 2 * (d.H + 2 * d.KV) * d.hd;
  f.traffic_layer = d.e * (6 * d.C * (d.Tsp / d.T) + attn_traffic + 4 * d.F);
  f.traffic_head = d.e * d.Vl;
  if (!mc.moe.enabled()) return f;
  // An MoE model: the stage's layers one by one, averaged. A sparse block runs whole on every tp rank (apply_moe:
  // not split), through the router, k experts and the shared expert of each token: its FLOPs are not divided by
  // tp. What is not an MLP (attention's projections, norms, the final norm) splits as in the dense count.
  int64_t n = 0;
  double mlp_all = 0;
  for (int64_t i = 0; i < mc.n_layers; ++i) mlp_all += double(llama_mlp_params(mc, i, true, variant));
  const double rest = (double(llama_active_params(mc, false, variant)) - double(mc.vocab_size) * d.C - mlp_all) /
                      double(mc.n_layers);
  double gemm = 0, recomputed = 0, traffic = 0;
  for (size_t i = 0; i < model->layers.size(); ++i) {
    const LlamaDecoderLayer* l = model->layers[i];
    if (!l) continue;
    ++n;
    const double mlp = double(llama_mlp_params(mc, int64_t(i), true, variant));
    const bool sparse = l->moe_block != nullptr;
    gemm += 6.0 * rest / tp + replicated + 6.0 * mlp / (sparse ? 1 : tp);
    const bool attn_again = l->recompute || l->self_attn->recompute, mlp_again = l->recompute || l->mlp->recompute;
    recomputed += (attn_again ? proj_fwd : 0) + (mlp_again ? 2.0 * mlp / (sparse ? 1 : tp) : 0);
    // A sparse layer's memory-bound ops per token: SwiGLU over k rows (4 k Fe), dispatch and combine (2 k C each:
    // read and written; under ep the rows' reorder by local expert twice more), the router's probs and top-k
    // (accumulation dtype), the shared expert's SwiGLU and its gated add.
    const double moe = sparse ? d.e * (4 * d.K * d.Fe + 4 * d.K * d.C + (d.ep ? 4 * d.K * d.C : 0) +
                                       (d.Fs > 0 ? 4 * d.Fs + 2 * d.C : 0)) +
                                    d.a * 2 * d.E
                              : d.e * 4 * d.F;
    traffic += d.e * (6 * d.C * (d.Tsp / d.T) + attn_traffic) + moe;
  }
  if (n > 0) {
    f.layer_gemm = gemm / double(n);  // the attention kernels are layer_attention, as in the dense count
    f.traffic_layer = traffic / double(n);
  }
  f.recomputed_gemm = recomputed;
  return f;
}

// ---- Parameters and the model's FLOPs per token

LlamaAttentionParams llama_attention_params(const ModelConfig& c, const LlamaVariant& v) {
  const int64_t d = c.dim, H = c.n_heads;
  LlamaAttentionParams p;
  if (c.mla.enabled()) {
    // Latent attention (mla.cpp): q_a_proj (q_lora, C), q_a_layernorm, q_b_proj (H dqk, q_lora) or q_proj (H dqk, C);
    // kv_a_proj_with_mqa (R + dr, C), kv_a_layernorm (R), kv_b_proj (H (dn + dv), R); o_proj (C, H dv). No biases.
    const MlaConfig& m = c.mla;
    const int64_t dqk = m.qk_head_dim(), ql = m.q_lora_rank, R = m.kv_lora_rank;
    p.tp_replicated = d * (R + m.qk_rope_head_dim) + R + (ql > 0 ? d * ql + ql : 0);
    p.all = p.tp_replicated + (ql > 0 ? ql : d) * H * dqk + R * H * (m.qk_nope_head_dim + m.v_head_dim) +
            H * m.v_head_dim * d;
    return p;
  }
  const int64_t hd = c.head_size();
  p.all = d * H * hd * 2 + d * c.n_kv_heads * hd * 2;
  if (v.qkv_bias) p.all += (H + 2 * c.n_kv_heads) * hd;
  if (v.qk_norm) p.all += 2 * hd;
  return p;
}

int64_t llama_mlp_params(const ModelConfig& c, int64_t layer, bool active, const LlamaVariant& v) {
  const int64_t d = c.dim;
  if (!c.moe.sparse_layer(layer)) return 3 * d * c.ffn_dim;
  const MoeConfig& m = c.moe;
  int64_t n = d * m.n_experts + (active ? m.experts_per_token : m.n_experts) * 3 * d * m.ffn_dim;
  if (m.shared_expert_ffn_dim > 0) n += 3 * d * m.shared_expert_ffn_dim + (v.moe_names.shared_gate ? d : 0);
  if (v.moe_names.score_bias) n += m.n_experts;  // gate.e_score_correction_bias: frozen, but the model's
  return n;
}

namespace {
int64_t llama_params(const ModelConfig& c, bool with_embeddings, const LlamaVariant& v, bool active) {
  const int64_t d = c.dim;
  int64_t n = c.n_layers * (llama_attention_params(c, v).all + (v.gemma ? 4 : 2) * d) + d;  // Gemma: four norms
  for (int64_t l = 0; l < c.n_layers; ++l) n += llama_mlp_params(c, l, active, v);
  // Multi-token prediction (mtp.cpp): per module a decoder layer of the next index, enorm, hnorm, eh_proj (C, 2C)
  // and shared_head.norm; the embedding and lm_head are the model's.
  for (int64_t j = 0; j < c.mtp_layers; ++j)
    n += llama_attention_params(c, v).all + 5 * d + 2 * d * d + llama_mlp_params(c, c.n_layers + j, active, v);
  if (with_embeddings) n += c.vocab_size * d * (c.tie_embeddings ? 1 : 2);
  else n += c.vocab_size * d;  // the lm_head matmul counts even when tied (torchtitan's convention)
  return n;
}
}  // namespace

int64_t llama_num_params(const ModelConfig& c, bool with_embeddings, const LlamaVariant& v) {
  return llama_params(c, with_embeddings, v, /*active=*/false);
}

int64_t llama_active_params(const ModelConfig& c, bool with_embeddings, const LlamaVariant& v) {
  return llama_params(c, with_embeddings, v, /*active=*/true);
}

double llama_attention_keys(const ModelConfig& c, int64_t seq_len, int64_t layer) {
  const double T = double(seq_len), W = double(c.sliding_window);
  if (!c.sliding_layer(layer) || c.sliding_window <= 0 || W >= T) return T;
  // Causal pairs within the window over causal pairs: (W T - W (W - 1) / 2) / (T (T + 1) / 2), times T.
  return T * (W * T - W * (W - 1) / 2) / (T * (T + 1) / 2);
}

double llama_attention_flops_per_key(const ModelConfig& c, bool executed) {
  if (!c.mla.enabled()) return 12.0 * double(c.n_heads * c.head_size());
  // Latent attention's kernel takes v zero-padded to the query-key width: P V runs at dqk, the model's is dv.
  const double dqk = double(c.mla.qk_head_dim());
  return 6.0 * double(c.n_heads) * (dqk + (executed ? dqk : double(c.mla.v_head_dim)));
}

double llama_flops_per_token(const ModelConfig& c, int64_t seq_len, const LlamaVariant& v) {
  // The parameters a token runs through (the k experts of an MoE layer, not all); QK^T and PV are n_heads x
  // head_dim wide (dim unless head_dim says otherwise; latent attention's widths: llama_attention_flops_per_key),
  // over the keys each layer's queries see.
  double keys = 0;
  for (int64_t i = 0; i < c.n_layers + c.mtp_layers; ++i) keys += llama_attention_keys(c, seq_len, i);
  // Multi-token prediction runs lm_head once more per token and module (its parameters are counted once).
  const double mtp_head = 6.0 * double(c.mtp_layers) * double(c.vocab_size) * double(c.dim);
  return 6.0 * double(llama_active_params(c, false, v)) + mtp_head + llama_attention_flops_per_key(c, false) * keys;
}

}  // namespace mt
