// The families built on the Llama architecture, each registered once (models/model.h): llama (Llama 1/2/3.x),
// mistral (Llama's architecture under model_type "mistral") and qwen2 (Qwen2 and Qwen2.5: biases on q, k and v).
// Their Hugging Face config.json keys both ways, transformers 4 and 5 spellings.
#include <cmath>

#include "models/llama/parallelize.h"

using json = nlohmann::json;

namespace mt {

namespace {

LlamaVariant variant_of(const ModelConfig& c) {
  LlamaVariant v;
  v.qkv_bias = c.type == "qwen2" || c.type == "qwen2_moe";
  v.qk_norm = c.type == "qwen3" || c.type == "qwen3_moe";
  if (c.type == "mixtral") v.moe_block = "block_sparse_moe", v.moe_names = {"w1", "w3", "w2"};
  return v;
}

bool is_moe_family(const std::string& type) { return type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe"; }

std::unique_ptr<CausalLM> build(const ModelConfig& c, const ParamFactory& f) {
  return std::make_unique<LlamaForCausalLM>(c, f, variant_of(c));
}

LlamaForCausalLM& as_llama(CausalLM& m) {
  auto* l = dynamic_cast<LlamaForCausalLM*>(&m);
  MT_CHECK(l, "model", "{}: not a model of the Llama architecture", m.type());
  return *l;
}

std::unique_ptr<FullyShard> parallelize(CausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                        const ParallelConfig& p, int64_t seq_len, DType reduce_dtype) {
  return parallelize_llama(as_llama(model), mesh, pd, p, seq_len, reduce_dtype);
}

double flops(const ModelConfig& c, int64_t seq_len) { return llama_flops_per_token(c, seq_len, variant_of(c)); }
int64_t num_params(const ModelConfig& c, bool with_embeddings) {
  return llama_num_params(c, with_embeddings, variant_of(c));
}
int64_t active_params(const ModelConfig& c, bool with_embeddings) {
  return llama_active_params(c, with_embeddings, variant_of(c));
}

// The sparse block's keys, named; a dense family must not set them.
void check_moe(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  if (!is_moe_family(c.type)) {
    if (m.n_experts != 0)
      fail("config",
           "model.moe.n_experts = {}: model.type = {} is dense (the MoE families are mixtral, qwen2_moe, "
           "qwen3_moe)",
           m.n_experts, c.type);
    return;
  }
  require_at_least("model.moe.n_experts", double(m.n_experts), 1, "an expert count");
  require_at_least("model.moe.experts_per_token", double(m.experts_per_token), 1, "a count");
  if (m.experts_per_token > m.n_experts)
    fail("config", "model.moe.experts_per_token = {} exceeds model.moe.n_experts = {}: top-k needs k <= experts",
         m.experts_per_token, m.n_experts);
  require_at_least("model.moe.ffn_dim", double(m.ffn_dim), 1, "a width");
  require_at_least("model.moe.shared_expert_ffn_dim", double(m.shared_expert_ffn_dim), 0, "a width (0: none)");
  if (m.shared_expert_ffn_dim > 0 && c.type != "qwen2_moe")
    fail("config", "model.moe.shared_expert_ffn_dim = {}: model.type = {} has no shared expert (qwen2_moe has)",
         m.shared_expert_ffn_dim, c.type);
  require_at_least("model.moe.decoder_sparse_step", double(m.decoder_sparse_step), 1, "a step");
  for (int l : m.mlp_only_layers)
    if (l < 0 || l >= c.n_layers)
      fail("config", "model.moe.mlp_only_layers: {} is not a layer of model.n_layers = {}", l, c.n_layers);
  require_one_of("model.moe.router_score", m.router_score, {"softmax", "sigmoid"});
  require_at_least("model.moe.router_aux_loss_coef", m.router_aux_loss_coef, 0, "a coefficient");
  require_at_least("model.moe.routed_scaling_factor", m.routed_scaling_factor, 1e-12, "a factor");
  require_at_least("model.moe.bias_update_rate", m.bias_update_rate, 0, "a rate (0: off)");
  require_at_least("model.moe.capacity_factor", m.capacity_factor, 0, "a factor (0: dropless)");
  require_product_fits({{"model.moe.n_experts", m.n_experts}, {"model.dim", c.dim}, {"model.moe.ffn_dim", m.ffn_dim}});
}

void check(const ModelConfig& c, int64_t seq_len) {
  // meshtrain attends to the whole (causal) sequence: a window shorter than it would be a different model.
  if (c.sliding_window > 0 && c.sliding_window < seq_len)
    fail("config",
         "model.sliding_window = {} is shorter than training.seq_len = {}: meshtrain attends to the whole sequence, "
         "so the window must cover it (or be 0: none)",
         c.sliding_window, seq_len);
  if (c.sliding_window > 0 && c.type != "mistral" && c.type != "qwen2" && c.type != "mixtral")
    fail("config", "model.sliding_window = {}: model.type = {} has no sliding window", c.sliding_window, c.type);
  check_moe(c);
}

// The keys every family of the architecture writes. RoPE both ways: top-level rope_theta and rope_scaling
// (transformers 4) and rope_parameters (transformers 5, which prefers it and still reads the top-level keys).
json common_to_hf(const ModelConfig& m, const char* architecture) {
  json j = {{"architectures", json::array({architecture})},
            {"model_type", m.type},
            {"hidden_size", m.dim},
            {"intermediate_size", m.ffn_dim},
            {"num_hidden_layers", m.n_layers},
            {"num_attention_heads", m.n_heads},
            {"num_key_value_heads", m.n_kv_heads},
            {"head_dim", m.head_size()},
            {"vocab_size", m.vocab_size},
            {"rms_norm_eps", m.norm_eps},
            {"rope_theta", m.rope_theta}};
  json params = {{"rope_type", m.rope_scaling.type == "none" ? "default" : m.rope_scaling.type},
                 {"rope_theta", m.rope_theta}};
  const RopeScalingConfig& r = m.rope_scaling;
  if (r.type == "none") {
    j["rope_scaling"] = nullptr;
  } else {
    json s = {{"rope_type", r.type}, {"factor", r.factor}};
    if (r.type == "llama3") {
      s["low_freq_factor"] = r.low_freq_factor;
      s["high_freq_factor"] = r.high_freq_factor;
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
    j["rope_scaling"] = s;
    for (auto& [k, v] : s.items()) params[k] = v;
  }
  j["rope_parameters"] = params;
  j["max_position_embeddings"] = m.max_seq_len;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = m.init_std;
  j["use_cache"] = true;
  return j;
}

json llama_to_hf(const ModelConfig& m) {
  json j = common_to_hf(m, "LlamaForCausalLM");
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  return j;
}

json mistral_to_hf(const ModelConfig& m) {
  json j = common_to_hf(m, "MistralForCausalLM");
  j["sliding_window"] = m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr);
  return j;
}

json qwen2_to_hf(const ModelConfig& m) {
  json j = common_to_hf(m, "Qwen2ForCausalLM");
  j["use_sliding_window"] = m.sliding_window > 0;
  j["sliding_window"] = m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr);
  j["max_window_layers"] = m.n_layers;
  return j;
}

json qwen3_to_hf(const ModelConfig& m) {
  json j = common_to_hf(m, "Qwen3ForCausalLM");
  j["attention_bias"] = false;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = m.n_layers;
  return j;
}

// The router keys every MoE family writes.
void moe_to_hf(const MoeConfig& e, json& j) {
  j["num_experts_per_tok"] = e.experts_per_token;
  j["router_aux_loss_coef"] = e.router_aux_loss_coef;
  j["output_router_logits"] = e.output_router_logits;
}

json mixtral_to_hf(const ModelConfig& m) {
  json j = common_to_hf(m, "MixtralForCausalLM");
  j["intermediate_size"] = m.moe.ffn_dim;  // Mixtral's experts are its MLPs
  j["num_local_experts"] = m.moe.n_experts;
  j["sliding_window"] = m.sliding_window > 0 ? json(m.sliding_window) : json(nullptr);
  j["router_jitter_noise"] = 0.0;
  moe_to_hf(m.moe, j);
  return j;
}

json qwen_moe_to_hf(const ModelConfig& m, const char* architecture) {
  json j = common_to_hf(m, architecture);
  j["num_experts"] = m.moe.n_experts;
  j["moe_intermediate_size"] = m.moe.ffn_dim;
  j["norm_topk_prob"] = m.moe.norm_topk_prob;
  j["decoder_sparse_step"] = m.moe.decoder_sparse_step;
  j["mlp_only_layers"] = m.moe.mlp_only_layers;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = m.n_layers;
  moe_to_hf(m.moe, j);
  return j;
}

json qwen2_moe_to_hf(const ModelConfig& m) {
  json j = qwen_moe_to_hf(m, "Qwen2MoeForCausalLM");
  j["shared_expert_intermediate_size"] = m.moe.shared_expert_ffn_dim;
  return j;
}

json qwen3_moe_to_hf(const ModelConfig& m) {
  json j = qwen_moe_to_hf(m, "Qwen3MoeForCausalLM");
  j["attention_bias"] = false;
  return j;
}

// A reader of one config.json: typed getters whose errors name the file and the key.
struct HfReader {
  const json& j;
  const std::string& file;
  bool has(const std::string& key) const { return j.contains(key) && !j[key].is_null(); }
  [[noreturn]] void unsupported(const std::string& key, const json& v, const std::string& why) const {
    fail("checkpoint", "{}: {} = {}: {}", file, key, v.dump(), why);
  }
  int64_t integer(const std::string& key, std::optional<int64_t> dflt) const {
    if (!has(key)) {
      MT_CHECK(dflt.has_value(), "checkpoint", "{}: no {}: a {} config needs it", file, key,
               j.value("model_type", std::string("llama")));
      return *dflt;
    }
    MT_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() >= 1, "checkpoint",
             "{}: {} = {}: expected an integer >= 1", file, key, j[key].dump());
    return j[key].get<int64_t>();
  }
  double number(const json& v, const std::string& key) const {
    MT_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0, "checkpoint",
             "{}: {} = {}: expected a number > 0", file, key, v.dump());
    return v.get<double>();
  }
  bool boolean(const std::string& key, bool dflt) const {
    if (!has(key)) return dflt;
    MT_CHECK(j[key].is_boolean(), "checkpoint", "{}: {} = {}: expected true or false", file, key, j[key].dump());
    return j[key].get<bool>();
  }
};

// RoPE in either spelling: transformers 4 writes top-level rope_theta and rope_scaling (null without scaling;
// "type" before 4.45, then "rope_type"); transformers 5 writes rope_parameters {"rope_type", "rope_theta", and
// the scaling keys}. Both may be present and must then agree.
void read_rope(const HfReader& r, ModelConfig& c) {
  std::optional<double> theta;
  if (r.has("rope_theta")) theta = r.number(r.j["rope_theta"], "rope_theta");
  std::optional<RopeScalingConfig> scaling;
  std::string scaling_from;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
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
    if (type != "default" && type != "linear" && type != "llama3")
      r.unsupported(fmt::format("{}.rope_type", key), json(type),
                    "meshtrain implements RoPE scaling \"default\", \"linear\" and \"llama3\"");
    RopeScalingConfig s;
    s.type = type == "default" ? "none" : type;
    for (auto& [k, v] : d.items()) {
      const std::string at = fmt::format("{}.{}", key, k);
      if (k == "rope_type" || k == "type") continue;
      if (k == "rope_theta") {
        double t = r.number(v, at);
        if (theta && std::abs(*theta - t) > 1e-12 * std::abs(t))
          fail("checkpoint", "{}: {} = {} but rope_theta = {}: which one?", r.file, at, t, *theta);
        theta = t;
      } else if (k == "factor" && s.type != "none") {
        s.factor = r.number(v, at);
      } else if (k == "low_freq_factor" && s.type == "llama3") {
        s.low_freq_factor = r.number(v, at);
      } else if (k == "high_freq_factor" && s.type == "llama3") {
        s.high_freq_factor = r.number(v, at);
      } else if (k == "original_max_position_embeddings" && s.type == "llama3") {
        MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1, "checkpoint", "{}: {} = {}: expected an integer >= 1",
                 r.file, at, v.dump());
        s.original_max_position_embeddings = v.get<int64_t>();
      } else if (k == "partial_rotary_factor" && v.is_number() && v.get<double>() == 1.0) {
        continue;  // the whole head is rotated: plain RoPE's own behaviour
      } else {
        r.unsupported(at, v, fmt::format("not a key of rope_type \"{}\" that meshtrain implements", type));
      }
    }
    if (scaling && !(*scaling == s))
      fail("checkpoint", "{}: {} and {} describe different RoPE scaling: which one?", r.file, scaling_from, key);
    scaling = s;
    scaling_from = key;
  }
  c.rope_theta = theta.value_or(10000.0);
  if (scaling) c.rope_scaling = *scaling;
}

ModelConfig common_from_hf(const HfReader& r) {
  // What the Llama architecture is not: refused rather than silently trained or evaluated as something else.
  if (r.has("hidden_act") && r.j["hidden_act"] != "silu")
    r.unsupported("hidden_act", r.j["hidden_act"], "meshtrain's MLP is SwiGLU (hidden_act \"silu\")");
  if (r.boolean("mlp_bias", false)) r.unsupported("mlp_bias", r.j["mlp_bias"], "meshtrain's MLP has no biases");
  ModelConfig c;
  c.dim = r.integer("hidden_size", std::nullopt);
  c.n_layers = r.integer("num_hidden_layers", std::nullopt);
  c.n_heads = r.integer("num_attention_heads", std::nullopt);
  c.n_kv_heads = r.integer("num_key_value_heads", c.n_heads);
  c.ffn_dim = r.integer("intermediate_size", std::nullopt);
  c.vocab_size = r.integer("vocab_size", std::nullopt);
  c.max_seq_len = r.integer("max_position_embeddings", 2048);  // transformers' defaults from here on
  c.norm_eps = r.has("rms_norm_eps") ? r.number(r.j["rms_norm_eps"], "rms_norm_eps") : 1e-6;
  c.tie_embeddings = r.boolean("tie_word_embeddings", false);
  if (r.has("initializer_range") && r.j["initializer_range"].is_number())
    c.init_std = r.j["initializer_range"].get<double>();
  read_rope(r, c);
  MT_CHECK(c.n_heads % c.n_kv_heads == 0, "checkpoint",
           "{}: num_attention_heads = {} is not a multiple of num_key_value_heads = {}", r.file, c.n_heads,
           c.n_kv_heads);
  // head_dim: written by newer files (and needed when it is not hidden_size / num_attention_heads, as in Mistral
  // Nemo); kept 0 when it is that quotient so that the YAML's model keys compare as they are written.
  if (r.has("head_dim")) {
    int64_t hd = r.integer("head_dim", std::nullopt);
    if (!(c.dim % c.n_heads == 0 && hd == c.dim / c.n_heads)) c.head_dim = hd;
  } else {
    MT_CHECK(c.dim % c.n_heads == 0, "checkpoint",
             "{}: hidden_size = {} is not a multiple of num_attention_heads = {} and there is no head_dim", r.file,
             c.dim, c.n_heads);
  }
  MT_CHECK(c.head_size() % 2 == 0, "checkpoint", "{}: head dim {}: RoPE needs an even head dim", r.file, c.head_size());
  MT_CHECK(c.vocab_size >= 1 && c.vocab_size <= INT32_MAX, "checkpoint",
           "{}: vocab_size = {}: expected 1 ... {} (token ids are int32)", r.file, c.vocab_size, INT32_MAX);
  return c;
}

ModelConfig llama_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  // Llama's attention_bias puts a bias on o_proj too, which a row-wise split would add once per rank.
  if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", j["attention_bias"],
                  "meshtrain's Llama has no attention biases (Qwen2's q/k/v biases are model_type \"qwen2\")");
  if (r.has("pretraining_tp") && j["pretraining_tp"] != json(1))
    r.unsupported("pretraining_tp", j["pretraining_tp"], "only 1 (the weights as one matrix) is implemented");
  return common_from_hf(r);
}

// A window key: null is none; a missing key is the family's default (MistralConfig's 4096).
int64_t window_from_hf(const HfReader& r, const char* key, int64_t missing) {
  if (!r.j.contains(key)) return missing;
  if (r.j[key].is_null()) return 0;
  return r.integer(key, std::nullopt);
}

ModelConfig mistral_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  ModelConfig c = common_from_hf(r);
  c.sliding_window = window_from_hf(r, "sliding_window", 4096);
  return c;
}

ModelConfig qwen2_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  ModelConfig c = common_from_hf(r);
  // Qwen2 files carry a sliding_window that only use_sliding_window turns on.
  if (r.boolean("use_sliding_window", false)) c.sliding_window = window_from_hf(r, "sliding_window", 4096);
  return c;
}

ModelConfig qwen3_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", j["attention_bias"], "meshtrain's Qwen3 has no attention biases");
  if (r.boolean("use_sliding_window", false))
    r.unsupported("use_sliding_window", j["use_sliding_window"], "meshtrain attends to the whole sequence");
  return common_from_hf(r);
}

// The router keys: transformers' defaults where absent.
void moe_from_hf(const HfReader& r, MoeConfig& e, double aux_coef_default) {
  e.experts_per_token = r.integer("num_experts_per_tok", 2);
  e.router_aux_loss_coef = aux_coef_default;
  if (r.has("router_aux_loss_coef")) {
    MT_CHECK(r.j["router_aux_loss_coef"].is_number() && r.j["router_aux_loss_coef"].get<double>() >= 0, "checkpoint",
             "{}: router_aux_loss_coef = {}: expected a number >= 0", r.file, r.j["router_aux_loss_coef"].dump());
    e.router_aux_loss_coef = r.j["router_aux_loss_coef"].get<double>();
  }
  e.output_router_logits = r.boolean("output_router_logits", false);
}

ModelConfig mixtral_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  ModelConfig c = common_from_hf(r);
  c.sliding_window = window_from_hf(r, "sliding_window", 0);
  if (r.has("router_jitter_noise") && !(j["router_jitter_noise"].is_number() && j["router_jitter_noise"] == 0))
    r.unsupported("router_jitter_noise", j["router_jitter_noise"], "meshtrain's router adds no noise (0 only)");
  c.moe.n_experts = r.integer("num_local_experts", 8);
  c.moe.ffn_dim = c.ffn_dim;
  c.moe.norm_topk_prob = true;
  moe_from_hf(r, c.moe, 0.001);
  return c;
}

ModelConfig qwen_moe_from_hf(const HfReader& r, ModelConfig c) {
  if (r.boolean("use_sliding_window", false))
    r.unsupported("use_sliding_window", r.j["use_sliding_window"], "meshtrain attends to the whole sequence");
  c.moe.n_experts = r.integer("num_experts", 60);
  c.moe.ffn_dim = r.integer("moe_intermediate_size", 1408);
  c.moe.norm_topk_prob = r.boolean("norm_topk_prob", false);
  c.moe.decoder_sparse_step = r.integer("decoder_sparse_step", 1);
  if (r.has("mlp_only_layers")) {
    MT_CHECK(r.j["mlp_only_layers"].is_array(), "checkpoint", "{}: mlp_only_layers = {}: expected a list of layers",
             r.file, r.j["mlp_only_layers"].dump());
    for (const json& l : r.j["mlp_only_layers"]) {
      MT_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < c.n_layers, "checkpoint",
               "{}: mlp_only_layers holds {}: not a layer of num_hidden_layers = {}", r.file, l.dump(), c.n_layers);
      c.moe.mlp_only_layers.push_back(l.get<int>());
    }
  }
  moe_from_hf(r, c.moe, 0.001);
  return c;
}

ModelConfig qwen2_moe_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  ModelConfig c = qwen_moe_from_hf(r, common_from_hf(r));
  c.moe.shared_expert_ffn_dim =
      r.has("shared_expert_intermediate_size") ? r.integer("shared_expert_intermediate_size", std::nullopt) : 5632;
  return c;
}

ModelConfig qwen3_moe_from_hf(const json& j, const std::string& file) {
  HfReader r{j, file};
  if (r.boolean("attention_bias", false))
    r.unsupported("attention_bias", j["attention_bias"], "meshtrain's Qwen3-MoE has no attention biases");
  return qwen_moe_from_hf(r, common_from_hf(r));
}

ParallelPlan tp_plan(bool sp, bool lp) { return llama_tp_plan(sp, lp); }

}  // namespace

const ModelFamily& llama_family() {
  static const ModelFamily f{
      "llama", "LlamaForCausalLM", "model.layers.*", build, parallelize, tp_plan,      llama_tp_step_bytes,
      flops,   num_params,         active_params,    check, llama_to_hf, llama_from_hf};
  return f;
}

const ModelFamily& mistral_family() {
  static const ModelFamily f{
      "mistral", "MistralForCausalLM", "model.layers.*", build, parallelize,   tp_plan,        llama_tp_step_bytes,
      flops,     num_params,           active_params,    check, mistral_to_hf, mistral_from_hf};
  return f;
}

#define MT_FAMILY(fn, type, arch, to_hf, from_hf)                                                                     \
  const ModelFamily& fn() {                                                                                           \
    static const ModelFamily f{type,  arch,       "model.layers.*", build, parallelize, tp_plan, llama_tp_step_bytes, \
                               flops, num_params, active_params,    check, to_hf,       from_hf};                     \
    return f;                                                                                                         \
  }
MT_FAMILY(qwen3_family, "qwen3", "Qwen3ForCausalLM", qwen3_to_hf, qwen3_from_hf)
MT_FAMILY(mixtral_family, "mixtral", "MixtralForCausalLM", mixtral_to_hf, mixtral_from_hf)
MT_FAMILY(qwen2_moe_family, "qwen2_moe", "Qwen2MoeForCausalLM", qwen2_moe_to_hf, qwen2_moe_from_hf)
MT_FAMILY(qwen3_moe_family, "qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_to_hf, qwen3_moe_from_hf)
#undef MT_FAMILY

const ModelFamily& qwen2_family() {
  static const ModelFamily f{
      "qwen2", "Qwen2ForCausalLM", "model.layers.*", build, parallelize, tp_plan,      llama_tp_step_bytes,
      flops,   num_params,         active_params,    check, qwen2_to_hf, qwen2_from_hf};
  return f;
}

}  // namespace mt
