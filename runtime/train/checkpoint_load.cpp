// Loading: a checkpoint (weights, optimizer moments, progress) or a Hugging Face directory's weights into a model in
// its layout, each rank reading only its blocks (checkpoint.h); the checksums verified before a resume trusts the
// files; partial saves found. Saving is in checkpoint.cpp.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "comm/world.h"
#include "models/lora.h"
#include "runtime/train/lora_export.h"
#include "runtime/core/log.h"
#include "runtime/io/checksum.h"
#include "runtime/io/safetensors.h"
#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/fused_tensors.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

namespace {

// The names a tensor has in the files: its own, or a stacked parameter's (an MoE layer's experts) one per slice.
std::vector<std::string> file_names(const std::string& name, int64_t dim0) {
  if (!is_stacked_param(name)) return {name};
  std::vector<std::string> out;
  for (int64_t j = 0; j < dim0; ++j) out.push_back(stacked_param_name(name, j));
  return out;
}

// Every name the model's parameters have in the files (and those of the pipeline's other stages; a fused
// parameter's is its fused tensor's, fused_tensors.h). With LoRA, the adapters' (PEFT's names): those of this
// stage's targets and of any linear weight of the other stages.
std::set<std::string> known_names(CausalLM& model) {
  std::set<std::string> known;
  if (has_lora(model)) {
    for (Parameter* q : trainable(model.parameters())) known.insert(file_param_name(*q));
    const std::string suffix = ".weight";
    for (const std::string& n : model.elsewhere())
      if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
        for (const char* f : {".lora_A.weight", ".lora_B.weight"})
          known.insert(peft_name(n.substr(0, n.size() - suffix.size()) + f));
    return known;
  }
  const FileLayout layout(model);
  for (const std::string& n : model.elsewhere()) known.insert(layout.file_name(n));
  for (Parameter* q : model.parameters())
    for (const std::string& n : file_names(q->name, q->value.shape().empty() ? 1 : q->value.shape()[0]))
      known.insert(layout.file_name(n));
  return known;
}

}  // namespace

namespace {

// A checkpoint's meta.json, checked against its own checksum (meta_checksum) before any field is used: an edited
// step, optimizer_steps, data position, model state or checksum list is refused naming the file. One written
// before format 4 has none (own_sum false; verify_checkpoint says so).
json read_meta(const std::string& path, bool* own_sum = nullptr) {
  const fs::path p = fs::path(path) / "meta.json";
  std::error_code ec;
  MT_CHECK(fs::exists(p, ec), "checkpoint", "{}: missing (a checkpoint is renamed into place only after it is written)",
           p.string());
  std::ifstream f(p);
  MT_CHECK(f.good(), "checkpoint", "{}: cannot be read", p.string());
  json meta;
  try {
    meta = json::parse(f);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: damaged (not valid JSON: {})", p.string(), e.what());
  }
  MT_CHECK(meta.is_object(), "checkpoint", "{}: damaged (not a JSON object)", p.string());
  const bool has = meta.contains("meta_checksum");
  const bool before_4 = !meta.contains("format_version") ||
                        (meta["format_version"].is_number() && meta["format_version"].get<double>() < 4);
  MT_CHECK(has || before_4, "checkpoint", "{}: checksum missing (format_version {} records one in meta_checksum)",
           p.string(), meta["format_version"].dump());
  if (has) {
    MT_CHECK(meta["meta_checksum"].is_string(), "checkpoint", "{}: damaged (meta_checksum is not a string)",
             p.string());
    const std::string want = meta["meta_checksum"].get<std::string>(), got = meta_checksum(meta);
    MT_CHECK(got == want, "checkpoint",
             "{}: checksum mismatch ({} of its content, {} recorded in it): edited or damaged since the save",
             p.string(), got, want);
  }
  if (own_sum) *own_sum = has;
  return meta;
}

// Where each tensor of a checkpoint or a Hugging Face directory lives: an index's weight_map
// (<prefix>.safetensors.index.json), else <prefix>.safetensors, else (Hugging Face shards without an index) every
// .safetensors file of the directory. Only headers are read until a block is asked for, and blocks with pread:
// nothing is mapped, so a loaded run's resident memory holds its state and none of the files' pages.
class TensorSource {
 public:
  // dir: a directory (prefix names its files) or one .safetensors file.
  TensorSource(const std::string& dir, const std::string& prefix, bool any_safetensors) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      MT_CHECK(fs::exists(dir, ec), "checkpoint", "{}: no such file or directory", dir);
      add_file(dir);
      return;
    }
    const fs::path index = fs::path(dir) / (prefix + ".safetensors.index.json");
    if (fs::exists(index, ec)) {
      json j;
      // JSON keeps the last of two equal keys: a tensor the weight_map lists twice would be read from one file
      // silently, so the parser's callback refuses it.
      std::string top_key;
      std::set<std::string> mapped;
      auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
        if (event != json::parse_event_t::key) return true;
        if (depth == 1) top_key = parsed.get<std::string>();
        else if (depth == 2 && top_key == "weight_map" && !mapped.insert(parsed.get<std::string>()).second)
          fail("checkpoint", "{}: weight_map lists tensor '{}' twice", index.string(), parsed.get<std::string>());
        return true;
      };
      try {
        std::ifstream f(index);
        j = json::parse(f, callback);
      } catch (const json::exception& e) {
        fail("checkpoint", "{}: not valid JSON ({})", index.string(), e.what());
      }
      MT_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "checkpoint", "{}: no weight_map object",
               index.string());
      std::map<std::string, std::vector<std::string>> by_file;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        MT_CHECK(it->is_string(), "checkpoint", "{}: weight_map['{}'] is not a file name", index.string(), it.key());
        by_file[it->get<std::string>()].push_back(it.key());
      }
      for (auto& [file, names] : by_file) {
        const fs::path path = fs::path(dir) / file;
        MT_CHECK(fs::exists(path, ec), "checkpoint", "{}: the index names {} (for tensor '{}'), which is missing",
                 index.string(), path.string(), names.front());
        const size_t k = add_reader(path.string());
        for (auto& name : names) {
          MT_CHECK(readers_[k]->entries().count(name), "checkpoint",
                   "{}: the index puts tensor '{}' in {}, which lacks it", index.string(), name, path.string());
          place(name, k);
        }
      }
      return;
    }
    const fs::path single = fs::path(dir) / (prefix + ".safetensors");
    if (fs::exists(single, ec)) {
      add_file(single.string());
      return;
    }
    if (any_safetensors) {
      std::vector<std::string> files;
      for (auto& e : fs::directory_iterator(dir))
        if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
      std::sort(files.begin(), files.end());
      for (auto& f : files) add_file(f);
    }
    MT_CHECK(!readers_.empty(), "checkpoint", "{}: no {}.safetensors, {}.safetensors.index.json{}", dir, prefix, prefix,
             any_safetensors ? " or other .safetensors file" : "");
  }

  const std::map<std::string, size_t>& tensors() const { return where_; }
  const SafetensorsReader& reader(const std::string& name) const { return *readers_[where_.at(name)]; }

 private:
  size_t add_reader(const std::string& path) {
    readers_.push_back(std::make_unique<SafetensorsReader>(path));
    return readers_.size() - 1;
  }
  void add_file(const std::string& path) {
    const size_t k = add_reader(path);
    for (auto& [name, e] : readers_[k]->entries()) place(name, k);
  }
  void place(const std::string& name, size_t k) {
    auto it = where_.find(name);
    MT_CHECK(it == where_.end() || it->second == k, "checkpoint", "tensor '{}' appears in both {} and {}", name,
             it == where_.end() ? "" : readers_[it->second]->path(), readers_[k]->path());
    where_[name] = k;
  }
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::string, size_t> where_;
};

// A destination: a tensor name in the source and the DTensor (local part allocated) it fills.
struct LoadItem {
  std::string name;
  DTensor dst;
  Parameter* param = nullptr;  // its compute copy is refreshed after
  std::optional<FusedPart> fused = std::nullopt;  // rows of a fused tensor of the files (fused_tensors.h)
};

// Reads each item's local block (this rank's part in its layout) from src. Everything is checked first — presence,
// shape, dtype, finite values in the block this rank reads — so that an error leaves every parameter as it was.
// One file tensor a destination block reads: the whole item, or one slice of a stacked parameter (its dim-0 index
// `slice`, -1: none) into rows of the local block.
struct LoadPart {
  std::string name;
  Shape shape, offset, local_shape;  // the file tensor's; where this rank's block starts in it and its shape
  int64_t dst_row = 0;               // stacked: the local block's dim-0 row it fills
};

std::vector<LoadPart> load_parts(const LoadItem& it) {
  const std::vector<int>& c = it.dst.mesh.coordinate();
  const Shape off = it.dst.spec.local_offset(c), local = it.dst.spec.local_shape(c);
  if (it.fused) {  // the block's rows of the fused tensor: shifted by the part's first row
    Shape at = off;
    at.at(0) += it.fused->row;
    return {{it.fused->file, it.fused->file_shape, at, local, 0}};
  }
  if (!is_stacked_param(it.name)) return {{it.name, it.dst.shape(), off, local, 0}};
  std::vector<LoadPart> parts;
  const Shape slice(it.dst.shape().begin() + 1, it.dst.shape().end());
  const Shape off1(off.begin() + 1, off.end()), local1(local.begin() + 1, local.end());
  for (int64_t i = 0; i < local[0]; ++i)
    parts.push_back({stacked_param_name(it.name, off[0] + i), slice, off1, local1, i});
  return parts;
}

void load_items(const TensorSource& src, const std::vector<LoadItem>& items) {
  for (const LoadItem& it : items)
    for (const LoadPart& part : load_parts(it)) {
      auto w = src.tensors().find(part.name);
      MT_CHECK(w != src.tensors().end(), "checkpoint", "missing tensor '{}' (shape {})", part.name,
               shape_str(part.shape));
      const SafetensorsReader& r = src.reader(part.name);
      const SafetensorsEntry& e = r.entries().at(part.name);
      MT_CHECK(e.shape == part.shape, "checkpoint", "{}: tensor '{}' has shape {}, the model expects {}", r.path(),
               part.name, shape_str(e.shape), shape_str(part.shape));
      MT_CHECK(e.dt == "F32" || e.dt == "BF16" || e.dt == "F16" || e.dt == "F64", "checkpoint",
               "{}: tensor '{}' has dtype {}: weights and optimizer state must be a float type (F32, BF16, F16, F64)",
               r.path(), part.name, e.dt);
      double v = 0;
      const int64_t bad = r.first_nonfinite(part.name, part.offset, part.local_shape, &v);
      MT_CHECK(bad < 0, "checkpoint",
               "{}: tensor '{}' holds a non-finite value ({} at element {} of this rank's part): refused", r.path(),
               part.name, v, bad);
    }
  for (const LoadItem& it : items) {
    Tensor host = empty(it.dst.local.shape(), it.dst.local.dtype());
    for (const LoadPart& part : load_parts(it)) {
      const int64_t n = shape_numel(part.local_shape);
      Tensor dst = is_stacked_param(it.name) ? host.view(part.dst_row * n, part.local_shape) : host;
      src.reader(part.name).read_block(part.name, part.offset, dst);
    }
    copy_(it.dst.local, it.dst.local.device().is_cuda() ? host.to(it.dst.local.device()) : host);
    if (it.param) refresh_compute_copy(*it.param);
  }
}

}  // namespace

TrainProgress load_checkpoint(const std::string& path, CausalLM& model, AdamW* opt) {
  WatchdogPhase phase(fmt::format("loading the checkpoint {}", path));
  json meta = read_meta(path);
  model.load_extra_state(meta.contains("model_state") ? meta["model_state"] : json(), path + "/meta.json");
  TrainProgress p;
  try {
    p.step = meta.at("step").get<int64_t>();
    p.data_epoch = meta.at("data").at("epoch").get<int64_t>();
    p.data_offset = meta.at("data").at("offset").get<int64_t>();
    p.seed = meta.at("rng").at("seed").get<uint64_t>();
  } catch (const json::exception& e) {
    fail("checkpoint", "{}/meta.json: {}", path, e.what());
  }
  // With LoRA the checkpoint holds the adapters (adapter_model, PEFT's names) and the base is not in it.
  // Without LoRA a frozen parameter is in the model's files too (checkpoint_plan.cpp), without optimizer state.
  auto params = trainable(model.parameters());
  const std::vector<Parameter*> in_files = has_lora(model) ? params : model.parameters();
  std::vector<LoadItem> items;
  const FileLayout layout(model);  // fused tensors (Phi-3's); adapters are never fused
  for (Parameter* q : in_files)
    items.push_back({file_param_name(*q), q->value, q, is_lora_param(*q) ? std::optional<FusedPart>() : layout.part(q->name)});
  TensorSource weights(path, model_files_prefix(model), false);
  const std::set<std::string> names = known_names(model);  // with the other stages'
  const auto copies = model.file_copies();
  for (auto& [name, k] : weights.tensors()) {
    if (copies.count(name)) continue;  // a copy the files keep of a shared parameter (DeepSeek's MTP)
    MT_CHECK(names.count(name) > 0, "checkpoint", "{}: unexpected tensor '{}' (shape {}): not a parameter of this model",
             weights.reader(name).path(), name, shape_str(weights.reader(name).entries().at(name).shape));
  }
  std::optional<TensorSource> moments;
  std::vector<LoadItem> opt_items;
  if (opt) {
    moments.emplace(path, "optimizer", false);
    for (Parameter* q : params) {
      auto& s = opt->state().at(q->name);
      DTensor m = q->value, v = q->value;
      m.local = s.exp_avg, v.local = s.exp_avg_sq;
      opt_items.push_back({q->name + ".exp_avg", m, nullptr});
      opt_items.push_back({q->name + ".exp_avg_sq", v, nullptr});
    }
  }
  // Both checked before either is read (load_items checks all its items before it reads one).
  load_items(weights, items);
  if (opt) {
    load_items(*moments, opt_items);
    opt->set_steps_taken(meta.value("optimizer_steps", p.step));
  }
  return p;
}

json adapter_config_json(const Config& config) {
  const LoraConfig& l = config.lora;
  json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["r"] = l.rank;
  if (l.alpha == std::floor(l.alpha)) j["lora_alpha"] = int64_t(l.alpha);  // PEFT writes an int
  else j["lora_alpha"] = l.alpha;
  j["target_modules"] = l.targets;
  j["lora_dropout"] = l.dropout;
  j["use_rslora"] = l.rslora;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  j["inference_mode"] = true;
  j["base_model_name_or_path"] = config.model.init_from;
  return j;
}

void load_lora_adapter(const std::string& dir, CausalLM& model, const LoraConfig& lora) {
  check_adapter_config(dir, lora);
  TensorSource src(dir, "adapter_model", true);
  std::set<std::string> names = known_names(model);
  for (auto& [name, k] : src.tensors())
    MT_CHECK(names.count(name) > 0, "checkpoint", "{}: unexpected tensor '{}' (shape {}): not an adapter of this model",
             src.reader(name).path(), name, shape_str(src.reader(name).entries().at(name).shape));
  std::vector<LoadItem> items;
  for (Parameter* q : trainable(model.parameters())) items.push_back({file_param_name(*q), q->value, q});
  load_items(src, items);
}

void load_checkpoint_weights(const std::string& path, const Config& cfg, CausalLM& model) {
  if (cfg.lora.enabled() && !cfg.model.init_from.empty()) load_hf_weights(cfg.model.init_from, model);
  load_checkpoint(path, model, nullptr);
}

Config checkpoint_config(const std::string& path) {
  json meta = read_meta(path);
  MT_CHECK(meta.contains("config") && meta["config"].is_string(), "checkpoint", "{}/meta.json: no config", path);
  return config_from_yaml_string(meta["config"].get<std::string>());
}

void load_hf_weights(const std::string& path, CausalLM& model) {
  std::error_code ec;
  MT_CHECK(fs::exists(path, ec), "checkpoint", "model.init_from = {}: no such file or directory", path);
  if (fs::is_directory(path, ec)) {
    fs::path cfg = fs::path(path) / "config.json";
    if (fs::exists(cfg)) {
      // The config.json's model, with transformers' defaults for what it leaves out, must be this one: compared
      // as the family writes it (every key that shapes the computation).
      ModelConfig theirs = model_config_from_hf(cfg.string());
      const ModelConfig& c = model.config;
      MT_CHECK(theirs.type == c.type, "checkpoint", "{}: model_type = {} but model.type = {}", cfg.string(),
               theirs.type, c.type);
      theirs.init_std = c.init_std;
      // How an MoE model is trained may differ from the file's (run_config.cpp lets the YAML set it).
      theirs.moe.output_router_logits = c.moe.output_router_logits;
      theirs.moe.router_aux_loss_coef = c.moe.router_aux_loss_coef;
      theirs.moe.bias_update_rate = c.moe.bias_update_rate;
      theirs.moe.capacity_factor = c.moe.capacity_factor;
      theirs.moe.dropless_bound = c.moe.dropless_bound;
      const nlohmann::json t = family_of(c).to_hf(theirs), o = family_of(c).to_hf(c);
      for (auto& [k, v] : o.items())
        MT_CHECK(t.contains(k) && t[k] == v, "checkpoint", "{}: {} = {} but this model has {}", cfg.string(), k,
                 t.contains(k) ? t[k].dump() : "(absent)", v.dump());
    }
  }
  // model.safetensors.index.json, else model.safetensors (a meshtrain checkpoint also holds optimizer files), else
  // every .safetensors file of the directory; or the one file named.
  TensorSource src(path, "model", true);
  std::vector<Parameter*> params;  // the base's: with LoRA the adapters come from lora.init_from or their init
  for (Parameter* q : model.parameters())
    if (!is_lora_param(*q)) params.push_back(q);
  const FileLayout layout(model);  // a fused parameter's name is its fused tensor's (fused_tensors.h)
  std::set<std::string> names;     // with the other stages'
  for (const std::string& n : model.elsewhere()) names.insert(layout.file_name(n));
  for (Parameter* q : params)
    for (const std::string& n : file_names(q->name, q->value.shape().empty() ? 1 : q->value.shape()[0]))
      names.insert(layout.file_name(n));
  for (auto& [name, k] : src.tensors()) {
    bool known = names.count(name) > 0;
    // Hugging Face files of tied models may still carry lm_head.weight; rotary caches are buffers, not parameters.
    if (!known && name == "lm_head.weight" && model.config.tie_embeddings) continue;
    if (!known && name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    if (!known && model.file_copies().count(name)) continue;  // DeepSeek's copies of the shared embedding and head
    MT_CHECK(known, "checkpoint", "{}: unexpected tensor '{}' (shape {}): not a parameter of this model",
             src.reader(name).path(), name, shape_str(src.reader(name).entries().at(name).shape));
  }
  std::vector<LoadItem> items;
  for (Parameter* q : params) items.push_back({q->name, q->value, q, layout.part(q->name)});
  load_items(src, items);
}

namespace {

// The files of a checkpoint that meta.json lists, those assigned to this rank (file k to rank k mod world) hashed and
// compared; and (rank 0) no safetensors or index file the loader could read that the save did not write.
void verify_files(const std::string& path, const json& sums, const MpiEnv& env) {
  int k = 0;
  for (auto it = sums.begin(); it != sums.end(); ++it, ++k) {
    if (k % env.size() != env.rank()) continue;
    const std::string file = (fs::path(path) / it.key()).string();
    MT_CHECK(it->is_string(), "checkpoint", "{}/meta.json: checksums['{}'] is not a string", path, it.key());
    std::error_code ec;
    MT_CHECK(fs::is_regular_file(file, ec), "checkpoint", "{}: missing (meta.json lists it)", file);
    const std::string got = file_checksum(file);
    MT_CHECK(got == it->get<std::string>(), "checkpoint",
             "{}: checksum mismatch ({} of its content, {} recorded in meta.json): the file is damaged, truncated or "
             "from another save",
             file, got, it->get<std::string>());
  }
  if (env.rank() != 0) return;
  std::vector<std::string> unlisted;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    const bool readable = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
    if (readable && !sums.contains(name)) unlisted.push_back((fs::path(path) / name).string());
  }
  std::sort(unlisted.begin(), unlisted.end());
  MT_CHECK(unlisted.empty(), "checkpoint",
           "{}: not recorded in meta.json, which lists every file the save wrote: a file the loader could read, put "
           "there since",
           unlisted.empty() ? "" : unlisted.front());
}

}  // namespace

// meta.json is read and checked against its own checksum by every rank; each file it lists is read whole by one
// rank and hashed; the first error (lowest rank) is every rank's.
void verify_checkpoint(const std::string& path, const MpiEnv& env) {
  std::string mine;
  try {
    bool own_sum = false;
    const json meta = read_meta(path, &own_sum);
    const bool sums = meta.contains("checksums") && meta["checksums"].is_object();
    if (sums) verify_files(path, meta["checksums"], env);
    // One line for a checkpoint of an older format: what it does not let a resume verify.
    if (env.rank() == 0 && !sums)
      spdlog::warn("{}: no checksums in meta.json (format 2, written before format 3): neither meta.json nor the "
                   "files are verified",
                   path);
    else if (env.rank() == 0 && !own_sum)
      spdlog::warn("{}/meta.json has no checksum of its own (format 3, written before format 4): its step, "
                   "optimizer_steps, data position and model state are not verified (the other files are)",
                   path);
  } catch (const std::exception& e) {
    mine = e.what();
  }
  // The ranks' messages, in rank order: every rank fails with the first, printed by rank 0.
  constexpr int kLen = 1024;
  std::vector<char> buf(kLen, 0);
  std::snprintf(buf.data(), kLen, "%s", mine.c_str());
  const std::vector<char> all =
      env.size() > 1 ? world::all_gather(std::span<const char>(buf), "verifying the checkpoint's checksums") : buf;
  for (int r = 0; r < env.size(); ++r)
    if (all[size_t(r) * kLen] != 0) throw ReportedError(std::string(&all[size_t(r) * kLen]), 1, env.rank() == 0);
}

std::vector<std::string> stale_partial_saves(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return out;
  const std::regex re("step_[0-9]{8}\\.tmp");
  for (auto& e : fs::directory_iterator(dir, ec))
    if (std::regex_match(e.path().filename().string(), re)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace mt
