// The model section of a run's config (model: in the YAML): which family (models/model.h) and its sizes.
// It lives with the models, not with the YAML reader: the reader only parses the keys visit() lists; what they
// must satisfy is here, each key's constraints beside it and the rules across keys in check() (the family's own
// rules: ModelFamily::check). With model.init_from naming a Hugging Face directory the family's config.json
// reader fills it (models/model.h: model_config_from_hf) and the YAML's keys must agree with it.
#pragma once
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/io/config.h"

namespace mt {

// RoPE frequency scaling (Hugging Face's rope_scaling / rope_parameters). none: plain RoPE; linear: every
// frequency divided by factor (positions / factor); llama3: Llama 3.1's rule, frequencies whose wavelength is
// below original_max_position_embeddings / high_freq_factor unchanged, above .../low_freq_factor divided by
// factor, and interpolated between; longrope (Phi-3's LongRoPE): frequency i divided by long_factor[i] when the
// run's sequence (training.seq_len) exceeds original_max_position_embeddings, else by short_factor[i], and cos and
// sin multiplied by attention_factor (0: sqrt(1 + ln(f) / ln(original)) with f = max_seq_len / original, 1 when
// f <= 1: transformers' rule for Phi-3, whose factor is that ratio).
struct RopeScalingConfig {
  std::string type = "none";
  double factor = 1;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
  std::vector<double> short_factor, long_factor;  // longrope: head_dim / 2 each
  double attention_factor = 0;                    // longrope, yarn: 0 = derived (longrope_attention_factor, yarn_...)
  double beta_fast = 32, beta_slow = 1;           // yarn: the rotation counts that bound the interpolation ramp
  double mscale = 1, mscale_all_dim = 0;          // yarn (DeepSeek): cos/sin and the attention scale corrections
  template <class V> void visit(V& v) {
    v("type", type, "none | linear | llama3 | longrope | yarn (Hugging Face's rope_type; default: none)",
      one_of({"none", "linear", "llama3", "longrope", "yarn"}));
    v("factor", factor, "linear and llama3: the context extension factor (longrope: max_seq_len / original)",
      at_least(1, "a factor"));
    v("low_freq_factor", low_freq_factor, "llama3: wavelengths above original / low_freq_factor are scaled");
    v("high_freq_factor", high_freq_factor, "llama3: wavelengths below original / high_freq_factor are kept");
    v("original_max_position_embeddings", original_max_position_embeddings,
      "llama3 and longrope: the context the model was pre-trained with");
    v("short_factor", short_factor,
      "longrope: head_dim / 2 divisors of the frequencies, used when training.seq_len <= original");
    v("long_factor", long_factor, "longrope: head_dim / 2 divisors of the frequencies, used above original");
    v("attention_factor", attention_factor,
      "longrope: cos and sin are multiplied by it (0: sqrt(1 + ln(f) / ln(original)), f = max_seq_len / original); "
      "yarn: likewise (0: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))",
      at_least(0, "a factor (0: derived)"));
    v("beta_fast", beta_fast, "yarn: frequencies rotating more than beta_fast times over the original context keep "
      "their value", at_least(1e-9, "a count"));
    v("beta_slow", beta_slow, "yarn: frequencies rotating fewer than beta_slow times are divided by factor",
      at_least(1e-9, "a count"));
    v("mscale", mscale, "yarn (DeepSeek): cos and sin are multiplied by yarn_mscale(factor, mscale) / "
      "yarn_mscale(factor, mscale_all_dim), yarn_mscale(s, m) = 0.1 m ln(s) + 1", at_least(0, "a scale"));
    v("mscale_all_dim", mscale_all_dim,
      "yarn (DeepSeek): the attention scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2 (0: not)",
      at_least(0, "a scale (0: none)"));
  }
  // yarn: the factor cos and sin are multiplied by; the attention scale's factor (1 unless mscale_all_dim).
  double yarn_attention_factor() const;
  double yarn_softmax_factor() const;
  // longrope: the factor cos and sin are multiplied by, for a model of max_positions (model.max_seq_len).
  double longrope_attention_factor(int64_t max_positions) const;
  bool enabled() const { return type != "none"; }
  void check() const;  // llama3's and longrope's keys (the factor lists' length: ModelConfig::check)
  bool operator==(const RopeScalingConfig&) const = default;
};

// Mixture of experts (mixtral, qwen2_moe, qwen3_moe; models/llama/moe.h): n_experts 0 is a dense model. The keys
// are Hugging Face's, renamed as the other model keys are; the defaults are transformers'.
struct MoeConfig {
  int64_t n_experts = 0;              // num_local_experts (mixtral) / num_experts (qwen)
  int64_t experts_per_token = 2;      // num_experts_per_tok: top-k
  int64_t ffn_dim = 0;                // each expert's hidden width (moe_intermediate_size; mixtral: intermediate_size)
  int64_t shared_expert_ffn_dim = 0;  // qwen2_moe: shared_expert_intermediate_size (0: no shared expert)
  bool norm_topk_prob = true;         // the top-k weights renormalised to sum 1 (mixtral always)
  int64_t decoder_sparse_step = 1;    // layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
  std::vector<int> mlp_only_layers;   // layers kept dense (qwen)
  double router_aux_loss_coef = 0.001;  // the balance loss's weight
  bool output_router_logits = false;    // Hugging Face's switch: the balance loss is added to the training loss
  std::string router_score = "softmax";  // softmax | sigmoid (DeepSeek-V3's scores)
  double routed_scaling_factor = 1.0;    // the routed experts' output scale (DeepSeek-V3: 2.5)
  double bias_update_rate = 0;  // aux-loss-free balancing: after each step bias += rate * sign(mean load - load); 0 off
  double capacity_factor = 0;   // 0: dropless; else each expert takes at most ceil(factor * N * K / E) rows a forward
  // Dropless expert parallel without a host read per layer: a training forward sends fixed blocks of
  // ceil(f N K / E) rows per expert (f starts here), and a step whose rows overflow them runs again with f x 1.5.
  // 0: the exact sizes, read on the host once per sparse layer. 0 or >= 1 (below 1 a balanced routing overflows).
  double dropless_bound = 1.25;
  // DeepSeek's group-limited routing: the experts in n_group consecutive groups, a token's top-k taken from the
  // topk_group groups of the highest group score (sigmoid scores: the sum of a group's two highest score + bias,
  // DeepSeek-V3; softmax: a group's highest score, DeepSeek-V2). 1 and 1: no groups.
  int64_t n_group = 1, topk_group = 1;
  // n_experts: whether the family has experts decides it (ModelConfig's ExpertsOfFamily); the other keys are
  // checked only when it has (enabled()).
  template <class V> void visit(V& v) {
    v("n_experts", n_experts, "routed experts per MoE layer (0: a dense model)");
    v("experts_per_token", experts_per_token, "experts each token is routed to (top-k)", at_least(1, "a count"));
    v("ffn_dim", ffn_dim, "each expert's hidden width", at_least(1, "a width"));
    v("shared_expert_ffn_dim", shared_expert_ffn_dim,
      "qwen2_moe: the shared expert's hidden width (0: none); its output is scaled by sigmoid(shared_expert_gate)",
      at_least(0, "a width (0: none)"));
    v("norm_topk_prob", norm_topk_prob, "renormalise the top-k routing weights to sum to 1");
    v("decoder_sparse_step", decoder_sparse_step, "qwen: layer i is an MoE layer when (i + 1) % step == 0",
      at_least(1, "a step"));
    v("mlp_only_layers", mlp_only_layers, "qwen: layers that keep a dense MLP");
    v("router_aux_loss_coef", router_aux_loss_coef, "the balance loss's coefficient", at_least(0, "a coefficient"));
    v("output_router_logits", output_router_logits,
      "add the balance loss (transformers' load_balancing_loss_func) to the training loss");
    v("router_score", router_score, "softmax | sigmoid: how router logits become scores",
      one_of({"softmax", "sigmoid"}));
    v("routed_scaling_factor", routed_scaling_factor, "the routed experts' weights are multiplied by it",
      at_least(1e-12, "a factor"));
    v("bias_update_rate", bias_update_rate,
      "aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only, updated "
      "after each step by rate * sign(mean load - load) (0: off)",
      at_least(0, "a rate (0: off)"));
    v("capacity_factor", capacity_factor,
      "0: dropless; > 0: each expert takes at most ceil(factor x tokens x k / experts) tokens per forward, the "
      "rest dropped (counted in the metrics)",
      at_least(0, "a factor (0: dropless)"));
    v("dropless_bound", dropless_bound,
      "dropless expert parallel (ep > 1, capacity_factor 0): a training forward sends each peer fixed blocks of "
      "ceil(bound x tokens x k / experts) rows per expert, no host read per layer; a step whose rows exceed them "
      "is recomputed with the bound x 1.5. 0: the exact sizes, read on the host once per sparse layer",
      expect([](double x) { return x == 0 || (x >= 1 && std::isfinite(x)); },
             "expected 0 (the exact sizes, read per sparse layer) or a factor >= 1 (below 1 a balanced routing "
             "already overflows the bound)"));
    v("n_group", n_group, "deepseek: the experts fall in n_group groups of consecutive experts (1: no groups)",
      at_least(1, "a group count"));
    v("topk_group", topk_group, "deepseek: a token's experts come from its topk_group best groups",
      at_least(1, "a group count"));
  }
  bool enabled() const { return n_experts > 0; }
  void check() const;  // top-k needs k <= experts
  // Whether decoder layer i has the sparse block (Hugging Face's rule; mixtral's step 1 and no dense layers).
  bool sparse_layer(int64_t i) const;
  bool operator==(const MoeConfig&) const = default;
};

// model.type: a family meshtrain implements ("model.type = 'x': meshtrain implements llama, ...").
struct KnownFamily {
  void operator()(const std::string& key, const std::string& type) const;
};
// model.moe under model.type: an MoE family needs model.moe.n_experts >= 1, a dense one 0.
struct ExpertsOfFamily {
  const std::string& type;
  void operator()(const std::string& key, const MoeConfig& moe) const;
};

// Multi-head latent attention (DeepSeek-V2/V3; models/llama/mla.cpp): kv_lora_rank 0 is none. Queries
// q_b_proj(norm(q_a_proj x)) (or q_proj x when q_lora_rank is 0), keys and values from the latent
// kv_b_proj(norm(c)) with c and one RoPE key shared by the heads from kv_a_proj_with_mqa x; each head's query and
// key are qk_nope_head_dim + qk_rope_head_dim wide (RoPE on the last qk_rope_head_dim, which is model.head_dim),
// its value v_head_dim.
struct MlaConfig {
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;  // RoPE rotates the pairs (2j, 2j+1) of the RoPE part (DeepSeek's), else halves
  template <class V> void visit(V& v) {
    v("q_lora_rank", q_lora_rank, "the queries' latent width (0: a plain q_proj)", at_least(0, "a width (0: none)"));
    v("kv_lora_rank", kv_lora_rank, "the keys' and values' latent width (0: no latent attention)",
      at_least(0, "a width (0: none)"));
    v("qk_nope_head_dim", qk_nope_head_dim, "each head's query and key width without RoPE",
      at_least(0, "a width"));
    v("qk_rope_head_dim", qk_rope_head_dim, "each head's query and key width with RoPE (even)",
      at_least(0, "a width"));
    v("v_head_dim", v_head_dim, "each head's value width", at_least(0, "a width"));
    v("rope_interleave", rope_interleave, "RoPE rotates adjacent pairs (DeepSeek's files) rather than halves");
  }
  bool enabled() const { return kv_lora_rank > 0; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool operator==(const MlaConfig&) const = default;
};

struct ModelConfig {
  std::string type = "llama";  // the family (models/model.h), also Hugging Face's model_type
  int64_t dim = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 8;
  int64_t n_kv_heads = 4;
  int64_t head_dim = 0;  // 0: dim / n_heads
  int64_t ffn_dim = 768;
  int64_t vocab_size = 256;
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  RopeScalingConfig rope_scaling;
  int64_t max_seq_len = 256;
  bool tie_embeddings = false;
  int64_t sliding_window = 0;  // mistral: 0 = none; otherwise it must cover training.seq_len. gemma: the local layers'
  // Gemma 2 and 3 (gemma2, gemma3_text): the attention's scale is query_pre_attn_scalar^-1/2 (0: head_dim), logits
  // soft-capped (0: none), and layer i is a sliding-window layer unless (i + 1) % sliding_window_pattern == 0, with
  // RoPE base rope_local_theta (0: rope_theta).
  double query_pre_attn_scalar = 0;
  double attn_softcap = 0, final_softcap = 0;
  int64_t sliding_window_pattern = 0;
  double rope_local_theta = 0;
  double init_std = 0.02;
  std::string init_from;
  MoeConfig moe;
  MlaConfig mla;
  // DeepSeek-V3's multi-token prediction (models/llama/mtp.cpp): mtp_layers modules after the decoder layers, each
  // predicting one token further; their loss enters the training objective times mtp_loss_weight.
  int64_t mtp_layers = 0;
  double mtp_loss_weight = 0.3;
  template <class V> void visit(V& v) {
    v("type", type,
      "the model family: llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe | qwen3_moe | phi3 | gemma2 | "
      "gemma3_text | deepseek_v2 | deepseek_v3 (Hugging Face's model_type)",
      KnownFamily{});
    v("dim", dim, "model width d", at_least(1, "a width"));
    v("n_layers", n_layers, "decoder layers", at_least(1, "a layer count"));
    v("n_heads", n_heads, "query heads", at_least(1, "a head count"));
    v("n_kv_heads", n_kv_heads, "key/value heads (n_heads divisible by it)", at_least(1, "a head count"));
    v("head_dim", head_dim, "width of one head (0: dim / n_heads)", at_least(0, "a width (0: dim / n_heads)"));
    v("ffn_dim", ffn_dim, "MLP hidden width", at_least(1, "a width"));
    v("vocab_size", vocab_size, "vocabulary size (256: bytes)",
      expect([](int64_t n) { return n >= 1 && n <= INT32_MAX; },
             fmt::format("expected 1 ... {} (token ids are int32)", INT32_MAX)));
    v("norm_eps", norm_eps, "RMSNorm epsilon", positive());
    v("rope_theta", rope_theta, "RoPE base", positive());
    v("rope_scaling", rope_scaling, "RoPE frequency scaling (Llama 3.1+: llama3; Phi-3: longrope)");
    v("max_seq_len", max_seq_len, "longest sequence (positions) the model is used with", at_least(1, "a length"));
    v("tie_embeddings", tie_embeddings, "lm_head shares model.embed_tokens.weight");
    v("sliding_window", sliding_window,
      "mistral, qwen2, mixtral, phi3: the attention window (0: none), which must be at least training.seq_len "
      "(meshtrain attends to the whole sequence there); gemma2, gemma3_text: the sliding layers' window (>= 1), "
      "any length",
      at_least(0, "a window (0: none)"));
    v("query_pre_attn_scalar", query_pre_attn_scalar,
      "gemma2, gemma3_text: attention scores are scaled by query_pre_attn_scalar^-1/2 (0: head_dim's)",
      at_least(0, "a scalar (0: head_dim)"));
    v("attn_softcap", attn_softcap,
      "gemma2: attention scores s become attn_softcap * tanh(s / attn_softcap) before the softmax "
      "(attn_logit_softcapping; 0: none)",
      at_least(0, "a cap (0: none)"));
    v("final_softcap", final_softcap,
      "gemma2: logits z become final_softcap * tanh(z / final_softcap) (final_logit_softcapping; 0: none)",
      at_least(0, "a cap (0: none)"));
    v("sliding_window_pattern", sliding_window_pattern,
      "gemma2 (2), gemma3_text (6): layer i attends within model.sliding_window unless (i + 1) % pattern == 0 "
      "(0: every layer global)",
      at_least(0, "a period (0: none)"));
    v("rope_local_theta", rope_local_theta,
      "gemma3_text: the RoPE base of the sliding layers (rope_local_base_freq; 0: model.rope_theta), which have no "
      "rope_scaling",
      at_least(0, "a base (0: model.rope_theta)"));
    v("init_std", init_std, "std of the normal init of matrices (norm weights start at 1, biases at 0)",
      at_least(0, "a standard deviation"));
    v("init_from", init_from,
      "a Hugging Face model directory (config.json + safetensors) or safetensors file to start from: its "
      "config.json gives the model keys ('' = random init)");
    v("moe", moe, "mixture of experts (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)",
      ExpertsOfFamily{type});
    v("mla", mla, "multi-head latent attention (deepseek_v2, deepseek_v3)");
    v("mtp_layers", mtp_layers,
      "deepseek_v3: multi-token prediction modules (num_nextn_predict_layers; 0 or 1): the module predicts the token "
      "after next from the model's last hidden state and the next token's embedding, sharing the embedding and "
      "lm_head",
      expect([](int64_t n) { return n == 0 || n == 1; }, "expected 0 or 1 (one prediction depth is implemented)"));
    v("mtp_loss_weight", mtp_loss_weight,
      "the multi-token prediction loss's weight in the training objective (DeepSeek-V3: 0.3, later 0.1)",
      at_least(0, "a weight"));
  }
  // The rules across the model's keys every family shares: heads split the width, products that must fit in
  // 64 bits, the MoE layers. The family's own are ModelFamily::check (models/model.h).
  void check() const;
  int64_t head_size() const { return head_dim > 0 ? head_dim : dim / n_heads; }
  // The width of a head as the attention kernels see it: head_size(), or latent attention's query-key width (its
  // values padded to it: models/llama/mla.cpp).
  int64_t attention_head_dim() const { return mla.enabled() ? mla.qk_head_dim() : head_size(); }
  // Gemma: whether layer i attends within sliding_window (Hugging Face's layer_types "sliding_attention").
  bool sliding_layer(int64_t i) const { return sliding_window_pattern > 0 && (i + 1) % sliding_window_pattern != 0; }
};

}  // namespace mt
