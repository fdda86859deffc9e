// The family registry and the model section's rules every family shares.
#include "models/model.h"

#include <algorithm>

#include <climits>
#include <cmath>
#include <fstream>

#include "runtime/io/config.h"

namespace mt {

// Each architecture's families (models/<architecture>/families.cpp).
std::vector<ModelFamily> llama_architecture_families();

namespace {

const std::vector<ModelFamily>& families() {
  static const std::vector<ModelFamily> all = [] {
    std::vector<ModelFamily> v;
    for (auto architecture : {llama_architecture_families})
      for (ModelFamily& f : architecture()) v.push_back(std::move(f));
    return v;
  }();
  return all;
}

std::string joined(const std::vector<std::string>& names) {
  std::string list;
  for (auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return list;
}

}  // namespace

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const ModelFamily& f : families()) names.push_back(f.type);
  return names;
}

const ModelFamily& model_family(const std::string& type, const std::string& key) {
  for (const ModelFamily& f : families())
    if (f.type == type) return f;
  fail("config", "{} = '{}': meshtrain implements {}", key, type, joined(model_family_names()));
}

std::string ModelFamily::hf_key(const std::string& key) const {
  for (const HfName& n : hf_names) {
    const std::string k = n.key;
    if (key == k) return n.hf;
    if (key.size() > k.size() && key.compare(0, k.size(), k) == 0 && key[k.size()] == '.')
      return n.hf + key.substr(k.size());
  }
  return key;
}

void KnownFamily::operator()(const std::string& key, const std::string& type) const { model_family(type, key); }

void ExpertsOfFamily::operator()(const std::string& key, const MoeConfig& moe) const {
  const std::string n_experts = key + ".n_experts";
  if (model_family(type).experts) return require_at_least(n_experts, double(moe.n_experts), 1, "an expert count");
  if (moe.n_experts == 0) return;
  std::vector<std::string> moe_families;
  for (const ModelFamily& f : families())
    if (f.experts) moe_families.push_back(f.type);
  fail("config", "{} = {}: model.type = {} is dense (the MoE families are {})", n_experts, moe.n_experts, type,
       joined(moe_families));
}

double RopeScalingConfig::longrope_attention_factor(int64_t max_positions) const {
  if (attention_factor > 0) return attention_factor;
  const double f = double(max_positions) / double(original_max_position_embeddings);
  if (f <= 1) return 1;
  return std::sqrt(1 + std::log(f) / std::log(double(original_max_position_embeddings)));
}

namespace {
double yarn_mscale(double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; }
}  // namespace

double RopeScalingConfig::yarn_attention_factor() const {
  if (attention_factor > 0) return attention_factor;
  if (mscale > 0 && mscale_all_dim > 0) return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
  return yarn_mscale(factor, 1);
}

double RopeScalingConfig::yarn_softmax_factor() const {
  if (type != "yarn" || mscale_all_dim <= 0) return 1;
  const double m = yarn_mscale(factor, mscale_all_dim);
  return m * m;
}

void RopeScalingConfig::check() const {
  if (type == "yarn") {
    require_at_least("model.rope_scaling.original_max_position_embeddings", double(original_max_position_embeddings),
                     2, "a length");
    if (!(beta_fast > beta_slow))
      fail("config", "model.rope_scaling.beta_fast = {} must exceed model.rope_scaling.beta_slow = {}", beta_fast,
           beta_slow);
  }
  if (type == "longrope") {
    require_at_least("model.rope_scaling.original_max_position_embeddings", double(original_max_position_embeddings),
                     2, "a length");
    if (factor != 1)
      fail("config", "model.rope_scaling.factor = {}: longrope's factor is model.max_seq_len / "
           "original_max_position_embeddings (set model.rope_scaling.attention_factor to scale cos and sin otherwise)",
           factor);
    if (short_factor.empty() || long_factor.empty())
      fail("config", "model.rope_scaling.{}: longrope needs short_factor and long_factor (head_dim / 2 each)",
           short_factor.empty() ? "short_factor" : "long_factor");
    for (const auto* list : {&short_factor, &long_factor})
      for (double f : *list)
        if (!(f > 0) || !std::isfinite(f))
          fail("config", "model.rope_scaling.{} holds {}: expected factors > 0",
               list == &short_factor ? "short_factor" : "long_factor", f);
  }
  if (type != "llama3") return;
  require_at_least("model.rope_scaling.low_freq_factor", low_freq_factor, 1e-9, "a factor");
  require_at_least("model.rope_scaling.original_max_position_embeddings", double(original_max_position_embeddings), 1,
                   "a length");
  if (!(high_freq_factor > low_freq_factor) || !std::isfinite(high_freq_factor))
    fail("config", "model.rope_scaling.high_freq_factor = {} must exceed model.rope_scaling.low_freq_factor = {}",
         high_freq_factor, low_freq_factor);
}

void MoeConfig::check() const {
  if (experts_per_token > n_experts)
    fail("config", "model.moe.experts_per_token = {} exceeds model.moe.n_experts = {}: top-k needs k <= experts",
         experts_per_token, n_experts);
  if (n_experts % n_group != 0)
    fail("config", "model.moe.n_group = {} does not divide model.moe.n_experts = {} into equal groups", n_group,
         n_experts);
  if (topk_group > n_group)
    fail("config", "model.moe.topk_group = {} exceeds model.moe.n_group = {}", topk_group, n_group);
  if (n_group > 1 && experts_per_token > topk_group * (n_experts / n_group))
    fail("config", "model.moe.experts_per_token = {} exceeds the {} experts of model.moe.topk_group = {} groups",
         experts_per_token, topk_group * (n_experts / n_group), topk_group);
  if (n_group > 1 && router_score == "sigmoid" && n_experts / n_group < 2)
    fail("config", "model.moe.n_group = {}: sigmoid routing scores a group by its two best experts; groups of {} "
         "expert", n_group, n_experts / n_group);
}

void ModelConfig::check() const {
  if (head_dim == 0 && dim % n_heads != 0)
    fail("config", "model.dim = {} must be divisible by model.n_heads = {} (or give model.head_dim)", dim, n_heads);
  if (n_heads % n_kv_heads != 0)
    fail("config", "model.n_heads = {} must be divisible by model.n_kv_heads = {}", n_heads, n_kv_heads);
  if (head_size() % 2 != 0)
    fail("config", "model.{} = {}: RoPE needs an even head dim", head_dim ? "head_dim" : "dim / model.n_heads",
         head_size());
  const int64_t qd = n_heads * head_size();  // the attention's width (dim unless head_dim says otherwise)
  require_product_fits({{"model.dim", dim}, {"model.vocab_size", vocab_size}});
  require_product_fits({{"model.dim", dim}, {"model.n_heads x head_dim", qd}});
  require_product_fits({{"model.dim", dim}, {"model.ffn_dim", ffn_dim}});
  require_product_fits({{"model.n_layers", n_layers}, {"model.dim", dim}, {"model.n_heads x head_dim", qd}});
  require_product_fits({{"model.n_layers", n_layers}, {"model.dim", dim}, {"model.ffn_dim", ffn_dim}});
  require_product_fits({{"model.max_seq_len", max_seq_len}, {"model.dim", dim}});
  if (rope_scaling.type == "longrope")
    for (const auto* list : {&rope_scaling.short_factor, &rope_scaling.long_factor})
      if (int64_t(list->size()) != head_size() / 2)
        fail("config", "model.rope_scaling.{} has {} values: longrope needs head_dim / 2 = {}",
             list == &rope_scaling.short_factor ? "short_factor" : "long_factor", list->size(), head_size() / 2);
  if (mla.enabled()) {
    if (mla.qk_rope_head_dim < 2 || mla.qk_rope_head_dim % 2 != 0)
      fail("config", "model.mla.qk_rope_head_dim = {}: RoPE needs an even width >= 2", mla.qk_rope_head_dim);
    if (mla.v_head_dim < 1) fail("config", "model.mla.v_head_dim = {}: expected a width >= 1", mla.v_head_dim);
    if (head_size() != mla.qk_rope_head_dim)
      fail("config", "model.head_dim = {}: latent attention's RoPE width is model.mla.qk_rope_head_dim = {} (set "
           "head_dim to it, as DeepSeek's config.json does)", head_size(), mla.qk_rope_head_dim);
    if (n_kv_heads != n_heads)
      fail("config", "model.n_kv_heads = {}: latent attention gives every head its keys and values (n_heads = {})",
           n_kv_heads, n_heads);
  }
  if (!moe.enabled()) return;
  for (int l : moe.mlp_only_layers)
    if (l < 0 || l >= n_layers)
      fail("config", "model.moe.mlp_only_layers: {} is not a layer of model.n_layers = {}", l, n_layers);
  require_product_fits(
      {{"model.moe.n_experts", moe.n_experts}, {"model.dim", dim}, {"model.moe.ffn_dim", moe.ffn_dim}});
}

ModelConfig model_config_from_hf(const std::string& config_json) {
  std::ifstream f(config_json);
  MT_CHECK(f.good(), "checkpoint", "cannot read {}", config_json);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint", "{}: not valid JSON ({})", config_json, e.what());
  }
  MT_CHECK(j.is_object(), "checkpoint", "{}: expected a JSON object (a Hugging Face model config)", config_json);
  // transformers' PretrainedConfig has no default model_type for a causal LM: a file without one was written for
  // Llama by older tools (and by meshtrain before it wrote the key).
  std::string type = "llama";
  if (j.contains("model_type") && !j["model_type"].is_null()) {
    MT_CHECK(j["model_type"].is_string(), "checkpoint", "{}: model_type = {}: expected a string", config_json,
             j["model_type"].dump());
    type = j["model_type"].get<std::string>();
  }
  const ModelFamily& family = model_family(type, config_json + ": model_type");
  // The architecture must be the family's causal LM (a classifier's or another family's weights are not this model).
  if (j.contains("architectures") && !j["architectures"].is_null()) {
    const auto& a = j["architectures"];
    MT_CHECK(a.is_array() && !a.empty() && a[0].is_string(), "checkpoint",
             "{}: architectures = {}: expected a list of class names such as [\"{}\"]", config_json, a.dump(),
             family.architecture);
    for (const auto& name : a)
      MT_CHECK(name == family.architecture, "checkpoint",
               "{}: architectures = {} but model_type \"{}\" is {}: meshtrain reads only that architecture",
               config_json, a.dump(), type, family.architecture);
  }
  ModelConfig c = family.from_hf(j, config_json);
  c.type = family.type;
  return c;
}

bool is_stacked_param(const std::string& name) { return name.find(".*.") != std::string::npos; }

std::string stacked_param_name(const std::string& name, int64_t j) {
  const size_t at = name.find(".*.");
  MT_CHECK(at != std::string::npos, "model", "{}: not a stacked parameter", name);
  return name.substr(0, at + 1) + std::to_string(j) + name.substr(at + 2);
}

bool CausalLM::matches_elsewhere(const std::string& pattern) const {
  // A pattern without glob characters names one module: a lookup (the names are kept sorted).
  if (!has_glob(pattern))
    return std::binary_search(elsewhere_modules_.begin(), elsewhere_modules_.end(), pattern);
  for (const std::string& n : elsewhere_modules_)
    if (pattern_matches(pattern, n)) return true;
  return false;
}

}  // namespace mt
