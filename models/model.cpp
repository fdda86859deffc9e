// The family registry and the checks every family's config shares.
#include "models/model.h"

#include <algorithm>

#include <climits>
#include <cmath>
#include <fstream>

#include "runtime/io/config.h"

namespace mt {

// Each family's one registration (models/<architecture>/families.cpp).
const ModelFamily& llama_family();
const ModelFamily& mistral_family();
const ModelFamily& qwen2_family();
const ModelFamily& qwen3_family();
const ModelFamily& mixtral_family();
const ModelFamily& qwen2_moe_family();
const ModelFamily& qwen3_moe_family();

namespace {

const std::vector<const ModelFamily*>& families() {
  static const std::vector<const ModelFamily*> all = {&llama_family(),   &mistral_family(),   &qwen2_family(),
                                                       &qwen3_family(),   &mixtral_family(),   &qwen2_moe_family(),
                                                       &qwen3_moe_family()};
  return all;
}

}  // namespace

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const ModelFamily* f : families()) names.push_back(f->type);
  return names;
}

const ModelFamily& model_family(const std::string& type, const std::string& key) {
  for (const ModelFamily* f : families())
    if (f->type == type) return *f;
  std::string list;
  for (auto& n : model_family_names()) list += (list.empty() ? "" : ", ") + n;
  fail("config", "{} = '{}': meshtrain implements {}", key, type, list);
}

void check_model_config(const ModelConfig& m, int64_t seq_len) {
  const ModelFamily& family = model_family(m.type);
  require_at_least("model.dim", double(m.dim), 1, "a width");
  require_at_least("model.n_layers", double(m.n_layers), 1, "a layer count");
  require_at_least("model.n_heads", double(m.n_heads), 1, "a head count");
  require_at_least("model.n_kv_heads", double(m.n_kv_heads), 1, "a head count");
  require_at_least("model.head_dim", double(m.head_dim), 0, "a width (0: dim / n_heads)");
  require_at_least("model.ffn_dim", double(m.ffn_dim), 1, "a width");
  require_at_least("model.max_seq_len", double(m.max_seq_len), 1, "a length");
  if (m.vocab_size < 1 || m.vocab_size > INT32_MAX)
    fail("config", "model.vocab_size = {}: expected 1 ... {} (token ids are int32)", m.vocab_size, INT32_MAX);
  if (m.head_dim == 0 && m.dim % m.n_heads != 0)
    fail("config", "model.dim = {} must be divisible by model.n_heads = {} (or give model.head_dim)", m.dim, m.n_heads);
  if (m.n_heads % m.n_kv_heads != 0)
    fail("config", "model.n_heads = {} must be divisible by model.n_kv_heads = {}", m.n_heads, m.n_kv_heads);
  if (m.head_size() % 2 != 0)
    fail("config", "model.{} = {}: RoPE needs an even head dim", m.head_dim ? "head_dim" : "dim / model.n_heads",
         m.head_size());
  if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps)) fail("config", "model.norm_eps = {}: expected > 0", m.norm_eps);
  if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta))
    fail("config", "model.rope_theta = {}: expected > 0", m.rope_theta);
  const RopeScalingConfig& r = m.rope_scaling;
  require_one_of("model.rope_scaling.type", r.type, {"none", "linear", "llama3"});
  if (r.type != "none") require_at_least("model.rope_scaling.factor", r.factor, 1, "a factor");
  if (r.type == "llama3") {
    require_at_least("model.rope_scaling.low_freq_factor", r.low_freq_factor, 1e-9, "a factor");
    require_at_least("model.rope_scaling.original_max_position_embeddings",
                     double(r.original_max_position_embeddings), 1, "a length");
    if (!(r.high_freq_factor > r.low_freq_factor) || !std::isfinite(r.high_freq_factor))
      fail("config", "model.rope_scaling.high_freq_factor = {} must exceed model.rope_scaling.low_freq_factor = {}",
           r.high_freq_factor, r.low_freq_factor);
  }
  require_at_least("model.sliding_window", double(m.sliding_window), 0, "a window (0: none)");
  require_at_least("model.init_std", m.init_std, 0, "a standard deviation");
  const int64_t qd = m.n_heads * m.head_size();  // the attention's width (dim unless head_dim says otherwise)
  require_product_fits({{"model.dim", m.dim}, {"model.vocab_size", m.vocab_size}});
  require_product_fits({{"model.dim", m.dim}, {"model.n_heads x head_dim", qd}});
  require_product_fits({{"model.dim", m.dim}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits({{"model.n_layers", m.n_layers}, {"model.dim", m.dim}, {"model.n_heads x head_dim", qd}});
  require_product_fits({{"model.n_layers", m.n_layers}, {"model.dim", m.dim}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits({{"model.max_seq_len", m.max_seq_len}, {"model.dim", m.dim}});
  family.check(m, seq_len);
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
