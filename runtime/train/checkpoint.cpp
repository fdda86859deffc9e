#include "runtime/train/checkpoint.h"

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "comm/control.h"
#include "runtime/core/log.h"
#include "runtime/io/safetensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

namespace {

std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

Tensor host_f(const Tensor& t) { return t.device().is_cuda() ? t.to(Device::cpu()) : t; }

// The complete checkpoints in dir (step_XXXXXXXX directories with a meta.json), oldest first.
std::vector<fs::path> complete_checkpoints(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> all;
  if (dir.empty() || !fs::is_directory(dir, ec)) return all;
  const std::regex re("step_[0-9]{8}");
  for (auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && std::regex_match(e.path().filename().string(), re) && fs::exists(e.path() / "meta.json"))
      all.push_back(e.path());
  std::sort(all.begin(), all.end());
  return all;
}

// Test hook: MT_FAULT_CHECKPOINT=<step> kills rank 0 half way through writing that step's checkpoint;
// MT_FAULT_CHECKPOINT=<step>:error makes that write fail with an error instead (a full disk).
bool fault_at(int64_t step, bool error) {
  const char* f = std::getenv("MT_FAULT_CHECKPOINT");
  if (!f || std::atoll(f) != step) return false;
  return error == (std::string(f).find(":error") != std::string::npos);
}

// The index of the first NaN or infinity in a host tensor, or -1 (integer tensors: -1).
int64_t first_nonfinite(const Tensor& t) {
  int64_t bad = -1;
  if (!dtype_is_float(t.dtype())) return bad;
  dispatch_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, bf16>) {
      const T* p = t.data<T>();
      for (int64_t i = 0, n = t.numel(); i < n; ++i) {
        double x;
        if constexpr (std::is_same_v<T, bf16>) x = double(float(p[i]));
        else x = double(p[i]);
        if (!std::isfinite(x)) {
          bad = i;
          return;
        }
      }
    }
  });
  return bad;
}

void require_finite(const std::vector<NamedTensor>& ts, const std::string& what, int64_t step) {
  for (const NamedTensor& nt : ts) {
    int64_t i = first_nonfinite(nt.tensor);
    MT_CHECK(i < 0, "checkpoint",
             "step {}: {} tensor '{}' holds a non-finite value ({} at element {}): the checkpoint is not written, "
             "the previous ones are kept",
             step, what, nt.name, to_f64(nt.tensor.reshape({-1}).slice0(i, i + 1))[0], i);
  }
}

// The Hugging Face LlamaConfig of the model, written beside model.safetensors so that transformers'
// LlamaForCausalLM.from_pretrained(dir) builds exactly this model. RoPE is written both ways: top-level rope_theta
// (transformers 4) and rope_parameters (transformers 5, which prefers it and also accepts the top-level key).
json hf_config(const Config& config, DType weights) {
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

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
  f.flush();
  MT_CHECK(f.good(), "checkpoint", "cannot write {}", p.string());
}

}  // namespace

std::string save_checkpoint(const std::string& dir, const TrainProgress& progress, LlamaForCausalLM& model, AdamW& opt,
                            const Config& config, const DeviceMesh& mesh, int64_t keep) {
  auto params = model.parameters();
  std::vector<NamedTensor> weights, opt_state;
  // Collective: every rank takes part in gathering; only rank 0 keeps the results.
  for (Parameter* p : params) {
    weights.push_back({p->name, host_f(full_tensor(p->value))});
    auto& s = opt.state().at(p->name);
    DTensor m = p->value, v = p->value;
    m.local = s.exp_avg, v.local = s.exp_avg_sq;
    opt_state.push_back({p->name + ".exp_avg", host_f(full_tensor(m))});
    opt_state.push_back({p->name + ".exp_avg_sq", host_f(full_tensor(v))});
  }
  fs::path final_dir = fs::path(dir) / step_dir_name(progress.step);
  if (mesh.world_rank() == 0) {
    // Only finite tensors are saved: a NaN model never replaces (or, through rotation, deletes) a good checkpoint.
    require_finite(weights, "parameter", progress.step);
    require_finite(opt_state, "optimizer", progress.step);
    fs::path tmp = fs::path(dir) / (step_dir_name(progress.step) + ".tmp");
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    MT_CHECK(!ec, "checkpoint", "cannot create {}: {}", tmp.string(), ec.message());
    try {  // a failed write removes its temporary directory
      write_safetensors((tmp / "model.safetensors").string(), weights, {{"format", "pt"}});
      if (fault_at(progress.step, true))
        fail("checkpoint", "MT_FAULT_CHECKPOINT={}:error: writing {} fails", progress.step, tmp.string());
      if (fault_at(progress.step, false)) {
        spdlog::error("[checkpoint] MT_FAULT_CHECKPOINT={}: rank 0 dies while writing {}", progress.step, tmp.string());
        spdlog::default_logger()->flush();
        std::_Exit(9);
      }
      write_safetensors((tmp / "optimizer.safetensors").string(), opt_state,
                        {{"step", std::to_string(opt.steps_taken())}});
      write_text(tmp / "config.json", hf_config(config, weights.front().tensor.dtype()).dump(2) + "\n");
      fsync_path(tmp / "config.json");
      json meta;
      meta["format_version"] = 1;
      meta["step"] = progress.step;
      meta["optimizer_steps"] = opt.steps_taken();
      meta["data"] = {{"epoch", progress.data_epoch}, {"offset", progress.data_offset}, {"next_step", progress.step}};
      meta["rng"] = {{"seed", progress.seed},
                     {"generator", "philox4x32-10 keyed by (seed, stream name, index): no hidden state"}};
      json mesh_json = json::array();
      for (auto& d : mesh.dims()) mesh_json.push_back({{"name", d.name}, {"size", d.size}});
      meta["mesh"] = mesh_json;
      meta["config"] = config_to_yaml(config);
      meta["model"] = {{"dim", config.model.dim},         {"n_layers", config.model.n_layers},
                       {"n_heads", config.model.n_heads}, {"n_kv_heads", config.model.n_kv_heads},
                       {"ffn_dim", config.model.ffn_dim}, {"vocab_size", config.model.vocab_size}};
      write_text(tmp / "meta.json", meta.dump(2) + "\n");
      fsync_path(tmp / "meta.json");
      fsync_path(tmp);
      fs::remove_all(final_dir, ec);
      fs::rename(tmp, final_dir, ec);
      MT_CHECK(!ec, "checkpoint", "cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
    } catch (...) {
      std::error_code ec2;
      fs::remove_all(tmp, ec2);
      throw;
    }
    fsync_path(dir);
    // Keep the newest `keep` complete checkpoints.
    if (keep > 0) {
      std::vector<fs::path> all = complete_checkpoints(dir);
      for (size_t i = 0; i + size_t(keep) < all.size(); ++i) fs::remove_all(all[i], ec);
    }
  }
  // Nobody resumes or reads before the rename.
  control_barrier(MPI_COMM_WORLD, fmt::format("checkpoint barrier (step {})", progress.step));
  return final_dir.string();
}

std::vector<std::string> checkpoints_in(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& p : complete_checkpoints(dir)) out.push_back(p.string());
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::vector<fs::path> all = complete_checkpoints(dir);
  if (all.empty()) return std::nullopt;
  return all.back().string();
}

namespace {

json read_meta(const std::string& path) {
  fs::path p = fs::path(path) / "meta.json";
  std::ifstream f(p);
  MT_CHECK(f.good(), "checkpoint", "{}: no meta.json (an incomplete checkpoint?)", path);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: meta.json is not valid JSON ({})", p.string(), e.what());
  }
}

// Sets a parameter's local shard from a full host tensor (converted to its dtype).
void assign_full(const DTensor& dst, const Tensor& full_any, const std::string& file, const std::string& name) {
  MT_CHECK(full_any.shape() == dst.shape(), "checkpoint", "{}: tensor '{}' has shape {}, the model expects {}", file,
           name, shape_str(full_any.shape()), shape_str(dst.shape()));
  MT_CHECK(dtype_is_float(full_any.dtype()), "checkpoint",
           "{}: tensor '{}' has dtype {}: weights and optimizer state must be a float type (F32, BF16, F16, F64)", file,
           name, dtype_name(full_any.dtype()));
  int64_t bad = first_nonfinite(full_any);
  MT_CHECK(bad < 0, "checkpoint", "{}: tensor '{}' holds a non-finite value ({} at element {}): refused", file, name,
           to_f64(full_any.reshape({-1}).slice0(bad, bad + 1))[0], bad);
  Tensor full = full_any;
  if (full.dtype() != dst.local.dtype()) {
    auto v = to_f64(full);
    full = from_values(v, full.shape(), dst.local.dtype());
  }
  DTensor d = distribute_tensor(full, dst.mesh, dst.placements(), std::nullopt, dst.spec.shard_order);
  copy_(dst.local, d.local);
}

}  // namespace

TrainProgress load_checkpoint(const std::string& path, LlamaForCausalLM& model, AdamW* opt) {
  json meta = read_meta(path);
  TrainProgress p;
  try {
    p.step = meta.at("step").get<int64_t>();
    p.data_epoch = meta.at("data").at("epoch").get<int64_t>();
    p.data_offset = meta.at("data").at("offset").get<int64_t>();
    p.seed = meta.at("rng").at("seed").get<uint64_t>();
  } catch (const json::exception& e) {
    fail("checkpoint", "{}/meta.json: {}", path, e.what());
  }
  std::string model_file = (fs::path(path) / "model.safetensors").string();
  auto weights = read_safetensors(model_file);
  auto params = model.parameters();
  for (Parameter* q : params) {
    auto it = weights.tensors.find(q->name);
    MT_CHECK(it != weights.tensors.end(), "checkpoint", "{}: missing tensor '{}'", model_file, q->name);
    assign_full(q->value, it->second, model_file, q->name);
    refresh_compute_copy(*q);
  }
  for (auto& [name, t] : weights.tensors) {
    bool known = std::any_of(params.begin(), params.end(), [&](Parameter* q) { return q->name == name; });
    MT_CHECK(known, "checkpoint", "{}: unexpected tensor '{}' (shape {}): not a parameter of this model", model_file,
             name, shape_str(t.shape()));
  }
  if (opt) {
    std::string opt_file = (fs::path(path) / "optimizer.safetensors").string();
    auto st = read_safetensors(opt_file);
    for (Parameter* q : params) {
      auto& s = opt->state().at(q->name);
      for (auto [suffix, dst] : {std::pair{".exp_avg", &s.exp_avg}, {".exp_avg_sq", &s.exp_avg_sq}}) {
        auto it = st.tensors.find(q->name + suffix);
        MT_CHECK(it != st.tensors.end(), "checkpoint", "{}: missing tensor '{}'", opt_file, q->name + suffix);
        DTensor d = q->value;
        d.local = *dst;
        assign_full(d, it->second, opt_file, q->name + suffix);
      }
    }
    opt->set_steps_taken(meta.value("optimizer_steps", p.step));
  }
  return p;
}

Config checkpoint_config(const std::string& path) {
  json meta = read_meta(path);
  MT_CHECK(meta.contains("config") && meta["config"].is_string(), "checkpoint", "{}/meta.json: no config", path);
  return config_from_yaml_string(meta["config"].get<std::string>());
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
  MT_CHECK(c.vocab_size <= 65536, "checkpoint", "{}: vocab_size = {}: meshtrain takes at most 65536 (uint16 tokens)",
           file, c.vocab_size);
  return c;
}

void load_hf_weights(const std::string& path, LlamaForCausalLM& model) {
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    // model.safetensors when there is one (a meshtrain checkpoint also holds optimizer.safetensors), else the shards.
    if (fs::exists(fs::path(path) / "model.safetensors")) {
      files.push_back((fs::path(path) / "model.safetensors").string());
    } else {
      for (auto& e : fs::directory_iterator(path))
        if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    MT_CHECK(!files.empty(), "checkpoint", "model.init_from = {}: no .safetensors file in the directory", path);
    fs::path cfg = fs::path(path) / "config.json";
    if (fs::exists(cfg)) {
      // The config.json's model, with transformers' defaults for what it leaves out, must be this one.
      const ModelConfig theirs = hf_model_config(cfg.string()), &c = model.config;
      auto expect = [&](const char* hf_key, const char* our_key, double t, double ours) {
        MT_CHECK(std::abs(t - ours) <= 1e-12 * std::max(1.0, std::abs(ours)), "checkpoint",
                 "{}: {} = {} but model.{} = {}", cfg.string(), hf_key, t, our_key, ours);
      };
      expect("hidden_size", "dim", double(theirs.dim), double(c.dim));
      expect("num_hidden_layers", "n_layers", double(theirs.n_layers), double(c.n_layers));
      expect("num_attention_heads", "n_heads", double(theirs.n_heads), double(c.n_heads));
      expect("num_key_value_heads", "n_kv_heads", double(theirs.n_kv_heads), double(c.n_kv_heads));
      expect("intermediate_size", "ffn_dim", double(theirs.ffn_dim), double(c.ffn_dim));
      expect("vocab_size", "vocab_size", double(theirs.vocab_size), double(c.vocab_size));
      expect("rms_norm_eps", "norm_eps", theirs.norm_eps, c.norm_eps);
      expect("rope_theta", "rope_theta", theirs.rope_theta, c.rope_theta);
      MT_CHECK(theirs.tie_embeddings == c.tie_embeddings, "checkpoint",
               "{}: tie_word_embeddings = {} but model.tie_embeddings = {}", cfg.string(), theirs.tie_embeddings,
               c.tie_embeddings);
    }
  } else {
    MT_CHECK(fs::exists(path, ec), "checkpoint", "model.init_from = {}: no such file or directory", path);
    files.push_back(path);
  }
  std::map<std::string, std::pair<Tensor, std::string>> all;  // name -> (tensor, file)
  for (auto& f : files) {
    auto st = read_safetensors(f);
    for (auto& [name, t] : st.tensors) {
      MT_CHECK(!all.count(name), "checkpoint", "tensor '{}' appears in both {} and {}", name, all[name].second, f);
      all[name] = {t, f};
    }
  }
  auto params = model.parameters();
  for (Parameter* q : params) {
    auto it = all.find(q->name);
    MT_CHECK(it != all.end(), "checkpoint", "{}: missing tensor '{}' (shape {})", path, q->name,
             shape_str(q->value.shape()));
    assign_full(q->value, it->second.first, it->second.second, q->name);
    refresh_compute_copy(*q);
  }
  for (auto& [name, tf] : all) {
    bool known = std::any_of(params.begin(), params.end(), [&](Parameter* q) { return q->name == name; });
    // Hugging Face files of tied models may still carry lm_head.weight; rotary caches are buffers, not parameters.
    if (!known && name == "lm_head.weight" && model.config.tie_embeddings) continue;
    if (!known && name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    MT_CHECK(known, "checkpoint", "{}: unexpected tensor '{}' (shape {}): not a parameter of this model", tf.second,
             name, shape_str(tf.first.shape()));
  }
}

}  // namespace mt
