#include "runtime/train/run_config.h"
#include "runtime/train/lora_export.h"

#include <filesystem>
#include <functional>

#include <fmt/ranges.h>

#include "models/model.h"
#include "runtime/io/config_reader.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

// With model.init_from naming a Hugging Face directory (a config.json beside the weights), the model is the file's;
// what the YAML gives must agree with it. init_from and init_std stay the YAML's (init_std only matters without
// weights).
void model_from_init(Config& c, const std::set<std::string>& given) {
  const std::string file = init_from_config_json(c.model.init_from);
  if (file.empty()) return;
  ModelConfig theirs = model_config_from_hf(file);
  theirs.init_from = c.model.init_from;
  theirs.init_std = c.model.init_std;
  // How an MoE model is trained, not what it is: the YAML's keys win over the file's (transformers' users set
  // output_router_logits and router_aux_loss_coef per run too).
  MoeConfig& tm = theirs.moe;
  const MoeConfig& om = c.model.moe;
  for (auto [key, set] : std::initializer_list<std::pair<const char*, std::function<void()>>>{
           {"model.moe.output_router_logits", [&] { tm.output_router_logits = om.output_router_logits; }},
           {"model.moe.router_aux_loss_coef", [&] { tm.router_aux_loss_coef = om.router_aux_loss_coef; }},
           {"model.moe.bias_update_rate", [&] { tm.bias_update_rate = om.bias_update_rate; }},
           {"model.moe.capacity_factor", [&] { tm.capacity_factor = om.capacity_factor; }},
           {"model.moe.dropless_bound", [&] { tm.dropless_bound = om.dropless_bound; }}})
    if (given.count(key)) set();
  // Every model key as text, the YAML's and the file's, compared where the YAML gave it.
  auto as_text = [](const ModelConfig& m) {
    std::vector<std::pair<std::string, std::string>> out;
    config_io::for_each_key(m, "model", [&](const std::string& key, const auto& value) {
      out.push_back({key, fmt::format("{}", value)});
    });
    return out;
  };
  const auto ours = as_text(c.model), file_keys = as_text(theirs);
  const ModelFamily& family = family_of(theirs);
  for (size_t i = 0; i < ours.size(); ++i) {
    const std::string& path = ours[i].first;
    if (!given.count(path) || ours[i].second == file_keys[i].second) continue;
    fail("config",
         "{} = {} but model.init_from's {} says {} = {}: leave the key out (the file gives it) or make "
         "them agree",
         path, ours[i].second, file, family.hf_key(path), file_keys[i].second);
  }
  c.model = theirs;
}

// A run's own config file: a model.init_from that does not exist is named before the model keys it would have
// given are checked (a config stored in a checkpoint may name a directory that has gone since).
void complete_run(Config& c, const std::set<std::string>& given) {
  std::error_code ec;
  if (!c.model.init_from.empty() && !fs::exists(c.model.init_from, ec))
    fail("config", "model.init_from = {}: no such file or directory", c.model.init_from);
  model_from_init(c, given);
}

}  // namespace

void Config::check() const {
  const ModelConfig& m = model;
  const TrainingConfig& t = training;
  family_of(m).check(m, t.seq_len);
  // Expert parallel splits the experts evenly.
  if (parallel.ep > 1 && m.moe.n_experts > 0 && m.moe.n_experts % parallel.ep != 0)
    fail("config", "model.moe.n_experts = {} is not divisible by parallel.ep = {}: each ep rank holds n_experts / ep",
         m.moe.n_experts, parallel.ep);
  if (parallel.ep > 1 && m.moe.n_experts == 0)
    fail("config", "parallel.ep = {}: model.type = {} has no experts (model.moe.n_experts = 0)", parallel.ep, m.type);
  // The step's activations: (batch x seq_len) rows of dim, ffn_dim and vocab_size (any mesh holds at most these).
  for (auto [key, size] :
       {std::pair{"model.dim", m.dim}, {"model.ffn_dim", m.ffn_dim}, {"model.vocab_size", m.vocab_size}})
    require_product_fits({{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {key, size}});
  if (t.seq_len > m.max_seq_len)
    fail("config", "training.seq_len = {} exceeds model.max_seq_len = {}", t.seq_len, m.max_seq_len);
  if (!parallel.fsdp.param_dtype.empty() && parallel.fsdp.param_dtype != t.dtype)
    fail("config",
         "parallel.fsdp.param_dtype = {} differs from training.dtype = {}: parameters are gathered in the "
         "dtype the model computes in; set training.dtype instead",
         parallel.fsdp.param_dtype, t.dtype);
  // profile.steps counts global steps and training.steps is the last one of any run of this config, resumed or not.
  const std::vector<int>& ps = profile.steps;
  if (ps.size() == 2 && ps[0] > t.steps)
    fail("config",
         "profile.steps = [{}, {}] starts after training.steps = {}, the last step of this run (and of any resumed "
         "from it): nothing would be traced",
         ps[0], ps[1], t.steps);
  if (lora.enabled() && !lora.init_from.empty()) check_adapter_config(lora.init_from, lora);
  if (!lora.enabled() && !lora.init_from.empty())
    fail("config", "lora.init_from = {} with lora.rank = 0: set lora.rank (it must match the adapter's r) to train it",
         lora.init_from);
  if (data.document_separator != -1 && (data.document_separator < 0 || data.document_separator >= m.vocab_size))
    fail("config", "data.document_separator = {}: expected a token id in [0, model.vocab_size = {}), or -1 (off)",
         data.document_separator, m.vocab_size);
}

std::string init_from_config_json(const std::string& init_from) {
  if (init_from.empty()) return "";
  std::error_code ec;
  fs::path p(init_from);
  fs::path dir = fs::is_directory(p, ec) ? p : p.parent_path();
  fs::path cfg = (dir.empty() ? fs::path(".") : dir) / "config.json";
  return fs::is_regular_file(cfg, ec) ? cfg.string() : "";
}

Config config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides) {
  return config_io::from_node<Config>(config_io::load_yaml_string(yaml), overrides, "", model_from_init);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  // Errors name the file, or the --set that gave the bad value.
  return config_io::from_node<Config>(config_io::load_yaml_file(path), overrides, path, complete_run);
}

std::string config_to_yaml(const Config& c) { return config_io::to_yaml(c); }

uint64_t config_hash(const Config& c) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : config_to_yaml(c)) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace mt
