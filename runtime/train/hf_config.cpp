// The Hugging Face LlamaConfig schema (config.json), both ways: written beside a checkpoint's weights, read
// from a Hugging Face model directory or a checkpoint.
#include "runtime/train/hf_config.h"

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

// The Hugging Face LlamaConfig of the model, written beside model.safetensors so that transformers'
// LlamaForCausalLM.from_pretrained(dir) builds exactly this model. RoPE is written both ways: top-level rope_theta
// (transformers 4) and rope_parameters (transformers 5, which prefers it and also accepts the top-level key).
json hf_config_json(const Config& config, DType weights) {
  const ModelConfig& m = config.model;
  const char* dtype = weights == DType::bf16 ? "bfloat16" : weights == DType::f64 ? "float64" : "float32";
  const int64_t sep = config.data.document_separator;
  json j;
  j["architectures"] = json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["hidden_size"] = m.dim;
  j["intermediate_size"] = m.ffn_dim;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  j["head_dim"] = m.dim / m.n_heads;
  j["vocab_size"] = m.vocab_size;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
  j["max_position_embeddings"] = m.max_seq_len;
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["initializer_range"] = m.init_std;
  // The document separator starts every document (data.document_separator), as GPT-2's <|endoftext|> does.
  j["bos_token_id"] = sep >= 0 ? json(sep) : json(nullptr);
  j["eos_token_id"] = sep >= 0 ? json(sep) : json(nullptr);
  j["pad_token_id"] = nullptr;
  j["use_cache"] = true;
  j["torch_dtype"] = dtype;  // transformers 4
  j["dtype"] = dtype;        // transformers 5
  return j;
}

namespace {

json read_json(const fs::path& p) {
  std::ifstream f(p);
  MT_CHECK(f.good(), "checkpoint", "cannot read {}", p.string());
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: not valid JSON ({})", p.string(), e.what());
  }
}

// A value of config.json as the JSON text it was written as (1e-05, "silu", {"rope_type": "llama3", ...}).
std::string json_text(const json& v) { return v.dump(); }

}  // namespace

ModelConfig hf_model_config(const std::string& config_json) {
  const std::string file = config_json;
  json j = read_json(config_json);
  MT_CHECK(j.is_object(), "checkpoint", "{}: expected a JSON object (a Hugging Face LlamaConfig)", file);
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto integer = [&](const char* key, std::optional<int64_t> dflt) -> int64_t {
    if (!has(key)) {
      MT_CHECK(dflt.has_value(), "checkpoint", "{}: no {}: a Llama config needs it", file, key);
      return *dflt;
    }
    MT_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() >= 1, "checkpoint",
             "{}: {} = {}: expected an integer >= 1", file, key, json_text(j[key]));
    return j[key].get<int64_t>();
  };
  auto number = [&](const json& v, const std::string& key) {
    MT_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0, "checkpoint",
             "{}: {} = {}: expected a number > 0", file, key, json_text(v));
    return v.get<double>();
  };
  auto boolean = [&](const char* key, bool dflt) {
    if (!has(key)) return dflt;
    MT_CHECK(j[key].is_boolean(), "checkpoint", "{}: {} = {}: expected true or false", file, key, json_text(j[key]));
    return j[key].get<bool>();
  };
  auto unsupported = [&](const std::string& key, const json& v, const std::string& why) {
    fail("checkpoint", "{}: {} = {}: {}", file, key, json_text(v), why);
  };

  // What meshtrain's Llama is not: each is refused rather than silently trained or evaluated as something else.
  if (has("model_type") && j["model_type"] != "llama")
    unsupported("model_type", j["model_type"], "meshtrain implements Llama (model_type \"llama\")");
  if (has("hidden_act") && j["hidden_act"] != "silu")
    unsupported("hidden_act", j["hidden_act"], "meshtrain's MLP is SwiGLU (hidden_act \"silu\")");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (boolean(key, false)) unsupported(key, j[key], "meshtrain's linear layers have no bias");
  // RoPE: transformers 4 writes top-level rope_theta and rope_scaling (null without scaling); transformers 5
  // writes rope_parameters {"rope_type": "default", "rope_theta": ...} and still reads the top-level keys.
  std::optional<double> theta;
  if (has("rope_theta")) theta = number(j["rope_theta"], "rope_theta");
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!has(key)) continue;
    const json& d = j[key];
    if (!d.is_object()) unsupported(key, d, "expected an object");
    for (const char* type_key : {"rope_type", "type"})  // "type": the name before transformers 4.45
      if (d.contains(type_key) && d[type_key] != "default")
        unsupported(fmt::format("{}.{}", key, type_key), d[type_key],
                    "meshtrain implements plain RoPE (rope_type \"default\"), not RoPE scaling");
    for (auto& [k, v] : d.items()) {
      if (k == "rope_type" || k == "type") continue;
      if (k != "rope_theta") unsupported(fmt::format("{}.{}", key, k), v, "meshtrain implements plain RoPE only");
      double t = number(v, fmt::format("{}.rope_theta", key));
      if (theta && std::abs(*theta - t) > 1e-12 * std::abs(t))
        fail("checkpoint", "{}: {}.rope_theta = {} but rope_theta = {}: which one?", file, key, t, *theta);
      theta = t;
    }
  }

  ModelConfig c;
  c.dim = integer("hidden_size", std::nullopt);
  c.n_layers = integer("num_hidden_layers", std::nullopt);
  c.n_heads = integer("num_attention_heads", std::nullopt);
  c.n_kv_heads = integer("num_key_value_heads", c.n_heads);
  c.ffn_dim = integer("intermediate_size", std::nullopt);
  c.vocab_size = integer("vocab_size", std::nullopt);
  c.max_seq_len = integer("max_position_embeddings", 2048);  // transformers' defaults from here on
  c.norm_eps = has("rms_norm_eps") ? number(j["rms_norm_eps"], "rms_norm_eps") : 1e-6;
  c.rope_theta = theta.value_or(10000.0);
  c.tie_embeddings = boolean("tie_word_embeddings", false);
  if (has("initializer_range") && j["initializer_range"].is_number()) c.init_std = j["initializer_range"].get<double>();
  MT_CHECK(c.dim % c.n_heads == 0, "checkpoint", "{}: hidden_size = {} is not a multiple of num_attention_heads = {}",
           file, c.dim, c.n_heads);
  MT_CHECK(c.n_heads % c.n_kv_heads == 0, "checkpoint",
           "{}: num_attention_heads = {} is not a multiple of num_key_value_heads = {}", file, c.n_heads, c.n_kv_heads);
  if (has("head_dim") && j["head_dim"] != json(c.dim / c.n_heads))
    unsupported("head_dim", j["head_dim"],
                fmt::format("meshtrain's head dim is hidden_size / num_attention_heads = {}", c.dim / c.n_heads));
  MT_CHECK((c.dim / c.n_heads) % 2 == 0, "checkpoint", "{}: head dim {}: RoPE needs an even head dim", file,
           c.dim / c.n_heads);
  MT_CHECK(c.vocab_size >= 1 && c.vocab_size <= INT32_MAX, "checkpoint",
           "{}: vocab_size = {}: expected 1 ... {} (token ids are int32)", file, c.vocab_size, INT32_MAX);
  return c;
}

}  // namespace mt
