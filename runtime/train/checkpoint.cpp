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
#include "runtime/train/hf_config.h"

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
      write_text(tmp / "config.json", hf_config_json(config, weights.front().tensor.dtype()).dump(2) + "\n");
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
