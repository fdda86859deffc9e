// The Llama architecture's families in Hugging Face's config.json, both ways (families.cpp's table names them):
// each model key's name there once (the families' hf_names), the writers, and the readers with transformers'
// defaults and the keys meshtrain refuses, naming the file and the key.
#include "models/llama/families_hf.h"
#include "models/llama/families_hf_reader.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "models/llama/parallelize.h"

using json = nlohmann::json;

namespace mt::llama_hf {

// ---- config.json: the model keys' names there, each once ----

json head_dim_to_hf(const ModelConfig& m) { return m.head_size(); }
json window_to_hf(const ModelConfig& m) { return m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr); }
// RoPE scaling in transformers 4's spelling (null without scaling); rope_parameters (transformers 5) adds
// rope_theta to the same keys.
json rope_scaling_to_hf(const ModelConfig& m) {
  const RopeScalingConfig& r = m.rope_scaling;
  if (r.type == "none") return nullptr;
  if (r.type == "longrope") {
    json s = {{"rope_type", r.type},
              {"short_factor", r.short_factor},
              {"long_factor", r.long_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
    if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
    return s;
  }
  json s = {{"rope_type", r.type}, {"factor", r.factor}};
  if (r.type == "yarn") {  // DeepSeek's keys (and "type", which its own code reads)
    s["type"] = "yarn";
    s["original_max_position_embeddings"] = r.original_max_position_embeddings;
    s["beta_fast"] = r.beta_fast;
    s["beta_slow"] = r.beta_slow;
    s["mscale"] = r.mscale;
    s["mscale_all_dim"] = r.mscale_all_dim;
    if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
  }
  if (r.type == "llama3") {
    s["low_freq_factor"] = r.low_freq_factor;
    s["high_freq_factor"] = r.high_freq_factor;
    s["original_max_position_embeddings"] = r.original_max_position_embeddings;
  }
  return s;
}

// The model keys every family of the architecture stores, then the family's own.
std::vector<HfName> names(std::initializer_list<std::vector<HfName>> own) {
  std::vector<HfName> all = {{"model.type", "model_type"},
                             {"model.dim", "hidden_size"},
                             {"model.ffn_dim", "intermediate_size"},
                             {"model.n_layers", "num_hidden_layers"},
                             {"model.n_heads", "num_attention_heads"},
                             {"model.n_kv_heads", "num_key_value_heads"},
                             {"model.head_dim", "head_dim", head_dim_to_hf},
                             {"model.vocab_size", "vocab_size"},
                             {"model.norm_eps", "rms_norm_eps"},
                             {"model.rope_theta", "rope_theta"},
                             {"model.rope_scaling", "rope_scaling", rope_scaling_to_hf},
                             {"model.max_seq_len", "max_position_embeddings"},
                             {"model.tie_embeddings", "tie_word_embeddings"},
                             {"model.init_std", "initializer_range"}};
  for (const std::vector<HfName>& part : own) all.insert(all.end(), part.begin(), part.end());
  return all;
}
const std::vector<HfName>& kWindow() {
  static const std::vector<HfName> v = {{"model.sliding_window", "sliding_window", window_to_hf}};
  return v;
}
// The router keys every MoE family stores.
const std::vector<HfName>& kRouter() {
  static const std::vector<HfName> v = {{"model.moe.experts_per_token", "num_experts_per_tok"},
                                     {"model.moe.router_aux_loss_coef", "router_aux_loss_coef"},
                                     {"model.moe.output_router_logits", "output_router_logits"}};
  return v;
}
// Mixtral's experts are its MLPs: their width is intermediate_size too (written after model.ffn_dim's).
const std::vector<HfName>& kMixtralMoe() {
  static const std::vector<HfName> v = {{"model.moe.n_experts", "num_local_experts"},
                                         {"model.moe.ffn_dim", "intermediate_size"}};
  return v;
}
const std::vector<HfName>& kQwenMoe() {
  static const std::vector<HfName> v = {{"model.moe.n_experts", "num_experts"},
                                      {"model.moe.ffn_dim", "moe_intermediate_size"},
                                      {"model.moe.norm_topk_prob", "norm_topk_prob"},
                                      {"model.moe.decoder_sparse_step", "decoder_sparse_step"},
                                      {"model.moe.mlp_only_layers", "mlp_only_layers"}};
  return v;
}
const std::vector<HfName>& kSharedExpert() {
  static const std::vector<HfName> v = {{"model.moe.shared_expert_ffn_dim", "shared_expert_intermediate_size"}};
  return v;
}

// The keys every family of the architecture writes: its named model keys, and RoPE both ways (top-level rope_theta
// and rope_scaling for transformers 4, rope_parameters for transformers 5, which prefers it and still reads the
// top-level keys).
json common_to_hf(const ModelFamily& f, const ModelConfig& m) {
  std::map<std::string, json> own;
  config_io::for_each_key(m, "model", [&](const std::string& key, const auto& value) { own[key] = value; });
  json j = {{"architectures", json::array({f.architecture})}};
  for (const HfName& n : f.hf_names) j[n.hf] = n.value ? n.value(m) : own.at(n.key);
  json params = rope_scaling_to_hf(m);
  if (params.is_null()) params = {{"rope_type", "default"}};
  params["rope_theta"] = m.rope_theta;
  j["rope_parameters"] = params;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  return j;
}

json cap_to_hf(double cap) { return cap > 0 ? json(cap) : json(nullptr); }
json attn_softcap_to_hf(const ModelConfig& m) { return cap_to_hf(m.attn_softcap); }
json final_softcap_to_hf(const ModelConfig& m) { return cap_to_hf(m.final_softcap); }

// Gemma 2 and 3: GeGLU's activation under both names, no biases or dropout, each layer's kind (layer_types,
// transformers >= 4.53) beside the keys older versions read. Gemma 3's RoPE in transformers 4's spelling (two
// bases: rope_theta and rope_local_base_freq), without the flat rope_parameters (transformers 5 keys it by layer
// kind).
json gemma_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  j["hidden_act"] = j["hidden_activation"] = "gelu_pytorch_tanh";
  j["attention_bias"] = false;
  json kinds = json::array();
  for (int64_t i = 0; i < m.n_layers; ++i) kinds.push_back(m.sliding_layer(i) ? "sliding_attention" : "full_attention");
  j["layer_types"] = kinds;
  if (m.type == "gemma3_text") j.erase("rope_parameters");
  return j;
}

json llama_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  return j;
}

json mistral_to_hf(const ModelFamily& f, const ModelConfig& m) { return common_to_hf(f, m); }

// Qwen's window: on only with use_sliding_window, over every layer.
json qwen_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  j["use_sliding_window"] = m.sliding_window > 0;
  j["max_window_layers"] = m.n_layers;
  return j;
}

json qwen3_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = qwen_to_hf(f, m);
  j["attention_bias"] = false;
  return j;
}

json mixtral_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  j["router_jitter_noise"] = 0.0;
  return j;
}

// Phi-3's config.json: rope_scaling as Phi-3's own files write it (type, short_factor, long_factor: the three keys
// transformers 4's Phi3Config accepts) with the pre-trained context at the top level; no dropout, no biases.
json phi3_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  const RopeScalingConfig& r = m.rope_scaling;
  j["original_max_position_embeddings"] = r.type == "longrope" ? r.original_max_position_embeddings : m.max_seq_len;
  if (r.type == "longrope") {
    json s = {{"type", "longrope"}, {"short_factor", r.short_factor}, {"long_factor", r.long_factor}};
    if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
    j["rope_scaling"] = s;
  }
  j["resid_pdrop"] = 0.0;
  j["embd_pdrop"] = 0.0;
  j["partial_rotary_factor"] = 1.0;
  return j;
}


// LongRoPE's keys (phi3): the factor lists, the pre-trained context, the attention factor, or a factor it is
// derived from (transformers' rule). Returns false for a key that is not one of them.
bool read_longrope_key(const HfReader& r, const std::string& k, const json& v, const std::string& at,
                       RopeScalingConfig& s, std::optional<double>& factor) {
  if (k == "short_factor" || k == "long_factor") {
    MT_CHECK(v.is_array(), "checkpoint", "{}: {} = {}: expected a list of numbers", r.file, at, v.dump());
    std::vector<double>& out = k == "short_factor" ? s.short_factor : s.long_factor;
    for (const json& x : v) out.push_back(r.number(x, at));
  } else if (k == "original_max_position_embeddings") {
    MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 2, "checkpoint", "{}: {} = {}: expected an integer >= 2",
             r.file, at, v.dump());
    s.original_max_position_embeddings = v.get<int64_t>();
  } else if (k == "attention_factor") {
    s.attention_factor = r.number(v, at);
  } else if (k == "factor") {
    factor = r.number(v, at);
  } else {
    return false;
  }
  return true;
}

// RoPE in either spelling: transformers 4 writes top-level rope_theta and rope_scaling (null without scaling;
// "type" before 4.45, then "rope_type"); transformers 5 writes rope_parameters {"rope_type", "rope_theta", and
// the scaling keys}. Both may be present and must then agree.
void read_rope(const HfReader& r, ModelConfig& c) {
  std::optional<double> theta;
  if (r.has("model.rope_theta")) theta = r.number(r.at("model.rope_theta"), "model.rope_theta");
  std::optional<RopeScalingConfig> scaling;
  std::string scaling_from;
  for (const std::string& key : {r.name("model.rope_scaling"), std::string("rope_parameters")}) {
    if (!r.has(key)) continue;
    const json& d = r.j[key];
    if (!d.is_object()) r.unsupported(key, d, "expected an object");
    std::string type = "default";
    for (const char* type_key : {"rope_type", "type"})
      if (d.contains(type_key)) {
        if (!d[type_key].is_string())
          r.unsupported(fmt::format("{}.{}", key, type_key), d[type_key], "expected a string");
        type = d[type_key].get<std::string>();
      }
    const bool longrope = type == "longrope" && r.family.type == "phi3";
    const bool yarn = type == "yarn" && r.family.type.rfind("deepseek", 0) == 0;
    if (type != "default" && type != "linear" && type != "llama3" && !longrope && !yarn)
      r.unsupported(fmt::format("{}.rope_type", key), json(type),
                    "meshtrain implements RoPE scaling \"default\", \"linear\" and \"llama3\" (and \"longrope\" "
                    "for model_type \"phi3\", \"yarn\" for deepseek_v2 and deepseek_v3)");
    RopeScalingConfig s;
    s.type = type == "default" ? "none" : type;
    std::optional<double> longrope_factor;
    for (auto& [k, v] : d.items()) {
      const std::string at = fmt::format("{}.{}", key, k);
      if (k == "rope_type" || k == "type") continue;
      if (longrope && read_longrope_key(r, k, v, at, s, longrope_factor)) continue;
      if (k == "rope_theta") {
        double t = r.number(v, at);
        if (theta && std::abs(*theta - t) > 1e-12 * std::abs(t))
          fail("checkpoint", "{}: {} = {} but {} = {}: which one?", r.file, at, t, r.name("model.rope_theta"), *theta);
        theta = t;
      } else if (k == "factor" && s.type != "none") {
        s.factor = r.number(v, at);
      } else if (k == "low_freq_factor" && s.type == "llama3") {
        s.low_freq_factor = r.number(v, at);
      } else if (k == "high_freq_factor" && s.type == "llama3") {
        s.high_freq_factor = r.number(v, at);
      } else if (yarn && (k == "beta_fast" || k == "beta_slow" || k == "mscale" || k == "mscale_all_dim" ||
                          k == "attention_factor")) {
        if (v.is_null()) continue;  // transformers' default
        MT_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0, "checkpoint",
                 "{}: {} = {}: expected a number >= 0", r.file, at, v.dump());
        (k == "beta_fast"  ? s.beta_fast
         : k == "beta_slow" ? s.beta_slow
         : k == "mscale"    ? s.mscale
         : k == "mscale_all_dim" ? s.mscale_all_dim
                                 : s.attention_factor) = v.get<double>();
      } else if (k == "original_max_position_embeddings" && (s.type == "llama3" || yarn)) {
        MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1, "checkpoint", "{}: {} = {}: expected an integer >= 1",
                 r.file, at, v.dump());
        s.original_max_position_embeddings = v.get<int64_t>();
      } else if (k == "partial_rotary_factor" && v.is_number() && v.get<double>() == 1.0) {
        continue;  // the whole head is rotated: plain RoPE's own behaviour
      } else {
        r.unsupported(at, v, fmt::format("not a key of rope_type \"{}\" that meshtrain implements", type));
      }
    }
    // An explicit longrope factor gives the attention factor by transformers' rule (else max_seq_len / original).
    if (longrope && longrope_factor && s.attention_factor == 0)
      s.attention_factor = *longrope_factor <= 1 ? 1.0
                                                 : std::sqrt(1 + std::log(*longrope_factor) /
                                                                     std::log(double(s.original_max_position_embeddings)));
    if (scaling && !(*scaling == s))
      fail("checkpoint", "{}: {} and {} describe different RoPE scaling: which one?", r.file, scaling_from, key);
    scaling = s;
    scaling_from = key;
  }
  c.rope_theta = theta.value_or(10000.0);
  if (scaling) c.rope_scaling = *scaling;
}

ModelConfig common_from_hf(const HfReader& r, bool swiglu) {
  // What the Llama architecture is not: refused rather than silently trained or evaluated as something else.
  if (swiglu && r.has("hidden_act") && r.j["hidden_act"] != "silu")
    r.unsupported("hidden_act", r.j["hidden_act"], "meshtrain's MLP is SwiGLU (hidden_act \"silu\")");
  if (r.boolean("mlp_bias", false)) r.unsupported("mlp_bias", r.j["mlp_bias"], "meshtrain's MLP has no biases");
  ModelConfig c;
  c.dim = r.integer("model.dim", std::nullopt);
  c.n_layers = r.integer("model.n_layers", std::nullopt);
  c.n_heads = r.integer("model.n_heads", std::nullopt);
  c.n_kv_heads = r.integer("model.n_kv_heads", c.n_heads);
  c.ffn_dim = r.integer("model.ffn_dim", std::nullopt);
  c.vocab_size = r.integer("model.vocab_size", std::nullopt);
  c.max_seq_len = r.integer("model.max_seq_len", 2048);  // transformers' defaults from here on
  c.norm_eps = r.has("model.norm_eps") ? r.number(r.at("model.norm_eps"), "model.norm_eps") : 1e-6;
  c.tie_embeddings = r.boolean("model.tie_embeddings", false);
  if (r.has("model.init_std") && r.at("model.init_std").is_number()) c.init_std = r.at("model.init_std").get<double>();
  read_rope(r, c);
  MT_CHECK(c.n_heads % c.n_kv_heads == 0, "checkpoint", "{}: {} = {} is not a multiple of {} = {}", r.file,
           r.name("model.n_heads"), c.n_heads, r.name("model.n_kv_heads"), c.n_kv_heads);
  // head_dim: written by newer files (and needed when it is not hidden_size / num_attention_heads, as in Mistral
  // Nemo); kept 0 when it is that quotient so that the YAML's model keys compare as they are written.
  if (r.has("model.head_dim")) {
    int64_t hd = r.integer("model.head_dim", std::nullopt);
    if (!(c.dim % c.n_heads == 0 && hd == c.dim / c.n_heads)) c.head_dim = hd;
  } else {
    MT_CHECK(c.dim % c.n_heads == 0, "checkpoint", "{}: {} = {} is not a multiple of {} = {} and there is no {}",
             r.file, r.name("model.dim"), c.dim, r.name("model.n_heads"), c.n_heads, r.name("model.head_dim"));
  }
  MT_CHECK(c.head_size() % 2 == 0, "checkpoint", "{}: head dim {}: RoPE needs an even head dim", r.file, c.head_size());
  MT_CHECK(c.vocab_size >= 1 && c.vocab_size <= INT32_MAX, "checkpoint",
           "{}: {} = {}: expected 1 ... {} (token ids are int32)", r.file, r.name("model.vocab_size"), c.vocab_size,
           INT32_MAX);
  return c;
}

ModelConfig llama_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  // Llama's attention_bias puts a bias on o_proj too, which a row-wise split would add once per rank.
  if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", j["attention_bias"],
                  "meshtrain's Llama has no attention biases (Qwen2's q/k/v biases are model_type \"qwen2\")");
  if (r.has("pretraining_tp") && j["pretraining_tp"] != json(1))
    r.unsupported("pretraining_tp", j["pretraining_tp"], "only 1 (the weights as one matrix) is implemented");
  return common_from_hf(r);
}

// The window: null is none; a missing key is the family's default (MistralConfig's 4096).
int64_t window_from_hf(const HfReader& r, int64_t missing) {
  if (!r.j.contains(r.name("model.sliding_window"))) return missing;
  if (r.at("model.sliding_window").is_null()) return 0;
  return r.integer("model.sliding_window", std::nullopt);
}

ModelConfig mistral_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  ModelConfig c = common_from_hf(r);
  c.sliding_window = window_from_hf(r, 4096);
  return c;
}

ModelConfig qwen2_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  ModelConfig c = common_from_hf(r);
  // Qwen2 files carry a sliding_window that only use_sliding_window turns on.
  if (r.boolean("use_sliding_window", false)) c.sliding_window = window_from_hf(r, 4096);
  return c;
}

// Qwen3's attention has no biases (Qwen2's q/k/v biases are model_type "qwen2").
void refuse_attention_bias(const HfReader& r, const char* model) {
  if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", r.j["attention_bias"],
                  fmt::format("meshtrain's {} has no attention biases", model));
}

ModelConfig qwen3_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  refuse_attention_bias(r, "Qwen3");
  if (r.boolean("use_sliding_window", false))
    r.unsupported("use_sliding_window", j["use_sliding_window"], "meshtrain attends to the whole sequence");
  return common_from_hf(r);
}

// The router keys: transformers' defaults where absent.
void moe_from_hf(const HfReader& r, MoeConfig& e, double aux_coef_default) {
  e.experts_per_token = r.integer("model.moe.experts_per_token", 2);
  e.router_aux_loss_coef = aux_coef_default;
  if (r.has("model.moe.router_aux_loss_coef")) {
    const json& v = r.at("model.moe.router_aux_loss_coef");
    MT_CHECK(v.is_number() && v.get<double>() >= 0, "checkpoint", "{}: {} = {}: expected a number >= 0", r.file,
             r.name("model.moe.router_aux_loss_coef"), v.dump());
    e.router_aux_loss_coef = v.get<double>();
  }
  e.output_router_logits = r.boolean("model.moe.output_router_logits", false);
}

ModelConfig mixtral_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  ModelConfig c = common_from_hf(r);
  c.sliding_window = window_from_hf(r, 0);
  if (r.has("router_jitter_noise") && !(j["router_jitter_noise"].is_number() && j["router_jitter_noise"] == 0))
    r.unsupported("router_jitter_noise", j["router_jitter_noise"], "meshtrain's router adds no noise (0 only)");
  c.moe.n_experts = r.integer("model.moe.n_experts", 8);
  c.moe.ffn_dim = c.ffn_dim;  // the same intermediate_size
  c.moe.norm_topk_prob = true;
  moe_from_hf(r, c.moe, 0.001);
  return c;
}

ModelConfig qwen_moe_from_hf(const HfReader& r, ModelConfig c) {
  if (r.boolean("use_sliding_window", false))
    r.unsupported("use_sliding_window", r.j["use_sliding_window"], "meshtrain attends to the whole sequence");
  c.moe.n_experts = r.integer("model.moe.n_experts", 60);
  c.moe.ffn_dim = r.integer("model.moe.ffn_dim", 1408);
  c.moe.norm_topk_prob = r.boolean("model.moe.norm_topk_prob", false);
  c.moe.decoder_sparse_step = r.integer("model.moe.decoder_sparse_step", 1);
  if (r.has("model.moe.mlp_only_layers")) {
    const std::string key = r.name("model.moe.mlp_only_layers");
    MT_CHECK(r.at(key).is_array(), "checkpoint", "{}: {} = {}: expected a list of layers", r.file, key,
             r.at(key).dump());
    for (const json& l : r.at(key)) {
      MT_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < c.n_layers, "checkpoint",
               "{}: {} holds {}: not a layer of {} = {}", r.file, key, l.dump(), r.name("model.n_layers"), c.n_layers);
      c.moe.mlp_only_layers.push_back(l.get<int>());
    }
  }
  moe_from_hf(r, c.moe, 0.001);
  return c;
}

ModelConfig qwen2_moe_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  ModelConfig c = qwen_moe_from_hf(r, common_from_hf(r));
  c.moe.shared_expert_ffn_dim = r.integer("model.moe.shared_expert_ffn_dim", 5632);
  return c;
}

ModelConfig qwen3_moe_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  refuse_attention_bias(r, "Qwen3-MoE");
  return qwen_moe_from_hf(r, common_from_hf(r));
}

// Phi-3's files keep LongRoPE's pre-trained context at the top level (Phi3Config's default 4096) and older ones
// name the type "su" or "yarn" (transformers reads both as longrope): a copy with each longrope object complete, so
// that rope_scaling and rope_parameters read alike.
json phi3_rope_completed(const json& file_json, const std::string& file) {
  json j = file_json;
  int64_t original = 4096;
  if (j.contains("original_max_position_embeddings") && !j["original_max_position_embeddings"].is_null()) {
    const json& v = j["original_max_position_embeddings"];
    MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 2, "checkpoint",
             "{}: original_max_position_embeddings = {}: expected an integer >= 2", file, v.dump());
    original = v.get<int64_t>();
  }
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(key) || !j[key].is_object()) continue;
    json& d = j[key];
    bool longrope = false;
    for (const char* type_key : {"rope_type", "type"})
      if (d.contains(type_key) && d[type_key].is_string()) {
        const std::string t = d[type_key].get<std::string>();
        if (t == "su" || t == "yarn") d[type_key] = "longrope";
        longrope = longrope || d[type_key] == "longrope";
      }
    if (longrope && !d.contains("original_max_position_embeddings")) d["original_max_position_embeddings"] = original;
  }
  return j;
}

ModelConfig phi3_from_hf(const ModelFamily& f, const json& file_json, const std::string& file) {
  const json j = phi3_rope_completed(file_json, file);
  HfReader r{f, j, file};
  refuse_attention_bias(r, "Phi-3");
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
    if (r.has(key) && !(j[key].is_number() && j[key].get<double>() == 0))
      r.unsupported(key, j[key], "meshtrain has no dropout (0 only)");
  if (r.has("partial_rotary_factor") && !(j["partial_rotary_factor"].is_number() && j["partial_rotary_factor"] == 1.0))
    r.unsupported("partial_rotary_factor", j["partial_rotary_factor"], "meshtrain rotates the whole head (1 only)");
  ModelConfig c = common_from_hf(r);
  if (!r.has("model.norm_eps")) c.norm_eps = 1e-5;  // Phi3Config's default
  c.sliding_window = window_from_hf(r, 0);          // Phi3Config's default: none
  const RopeScalingConfig& s = c.rope_scaling;
  if (s.type == "longrope") {
    const std::string key = r.has("model.rope_scaling") ? r.name("model.rope_scaling") : "rope_parameters";
    for (const auto* list : {&s.short_factor, &s.long_factor})
      MT_CHECK(int64_t(list->size()) == c.head_size() / 2, "checkpoint",
               "{}: {}.{} has {} values: LongRoPE needs one per frequency, head_dim / 2 = {}", file, key,
               list == &s.short_factor ? "short_factor" : "long_factor", list->size(), c.head_size() / 2);
  }
  return c;
}

// A soft-cap: null is none.
double cap_from_hf(const HfReader& r, const std::string& key, double missing) {
  if (!r.j.contains(r.name(key))) return missing;
  if (r.at(key).is_null()) return 0;
  return r.number(r.at(key), key);
}

// Gemma 2 (gemma2) and Gemma 3's text model (gemma3_text): transformers' defaults where a key is absent.
ModelConfig gemma_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  const bool g3 = f.type == "gemma3_text";
  for (const char* key : {"hidden_activation", "hidden_act"})
    if (r.has(key) && j[key] != "gelu_pytorch_tanh")
      r.unsupported(key, j[key], "meshtrain's Gemma MLP is GeGLU with the tanh GELU (\"gelu_pytorch_tanh\")");
  refuse_attention_bias(r, g3 ? "Gemma 3" : "Gemma 2");
  if (r.has("attention_dropout") && !(j["attention_dropout"].is_number() && j["attention_dropout"] == 0))
    r.unsupported("attention_dropout", j["attention_dropout"], "meshtrain has no dropout (0 only)");
  ModelConfig c = common_from_hf(r, /*swiglu=*/false);
  c.type = f.type;
  if (!j.contains("max_position_embeddings")) c.max_seq_len = g3 ? 131072 : 8192;
  if (!j.contains("tie_word_embeddings")) c.tie_embeddings = true;
  if (g3 && !r.has("model.rope_theta") &&
      !(j.contains("rope_parameters") && j["rope_parameters"].is_object() &&
        j["rope_parameters"].contains("rope_theta")))
    c.rope_theta = 1e6;
  c.query_pre_attn_scalar = r.has("model.query_pre_attn_scalar")
                                ? r.number(r.at("model.query_pre_attn_scalar"), "model.query_pre_attn_scalar")
                                : 256;
  c.attn_softcap = cap_from_hf(r, "model.attn_softcap", g3 ? 0 : 50.0);
  c.final_softcap = cap_from_hf(r, "model.final_softcap", g3 ? 0 : 30.0);
  c.sliding_window = window_from_hf(r, 4096);
  if (c.sliding_window == 0)
    fail("checkpoint", "{}: sliding_window = null: {} needs the window of its sliding layers (an integer >= 1)", file,
         f.type);
  c.sliding_window_pattern = g3 ? r.integer("model.sliding_window_pattern", 6) : 2;
  if (g3)
    c.rope_local_theta =
        r.has("model.rope_local_theta") ? r.number(r.at("model.rope_local_theta"), "model.rope_local_theta") : 10000;
  // layer_types (transformers >= 4.53) must say what the pattern says: meshtrain's layers follow the pattern.
  if (r.has("layer_types")) {
    const json& t = j["layer_types"];
    MT_CHECK(t.is_array() && int64_t(t.size()) == c.n_layers, "checkpoint",
             "{}: layer_types = {}: expected one entry per layer ({} = {})", file, t.dump(), r.name("model.n_layers"),
             c.n_layers);
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const char* want = c.sliding_layer(i) ? "sliding_attention" : "full_attention";
      if (t[size_t(i)] != want)
        r.unsupported("layer_types", t,
                      fmt::format("layer {} is {} where {} ({}) gives \"{}\": meshtrain implements only that "
                                  "pattern",
                                  i, t[size_t(i)].dump(), g3 ? "sliding_window_pattern" : "Gemma 2's alternation",
                                  c.sliding_window_pattern, want));
    }
  }
  return c;
}

const std::vector<HfName>& kGemma() {
  static const std::vector<HfName> v = {{"model.query_pre_attn_scalar", "query_pre_attn_scalar"},
                                    {"model.attn_softcap", "attn_logit_softcapping", attn_softcap_to_hf},
                                    {"model.final_softcap", "final_logit_softcapping", final_softcap_to_hf}};
  return v;
}
const std::vector<HfName>& kGemma3() {
  static const std::vector<HfName> v = {{"model.sliding_window_pattern", "sliding_window_pattern"},
                                     {"model.rope_local_theta", "rope_local_base_freq"}};
  return v;
}

}  // namespace mt::llama_hf
