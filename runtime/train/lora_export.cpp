#include "runtime/train/lora_export.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/core/error.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/ops.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace mt {

namespace {

json read_json(const fs::path& p) {
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(p, ec), "export", "{}: missing", p.string());
  try {
    std::ifstream in(p);
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("export", "{}: not JSON: {}", p.string(), e.what());
  }
}

// Every tensor of the safetensors files named prefix*.safetensors in dir, by name, with the reader holding it.
struct Files {
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, const SafetensorsReader*> where;
};
Files open_files(const fs::path& dir, const std::string& prefix) {
  Files f;
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0 && e.path().extension() == ".safetensors") paths.push_back(e.path());
  }
  std::sort(paths.begin(), paths.end());
  MT_CHECK(!paths.empty(), "export", "{}: no {}*.safetensors", dir.string(), prefix);
  for (const fs::path& p : paths) {
    f.readers.push_back(std::make_unique<SafetensorsReader>(p.string()));
    for (auto& [name, e] : f.readers.back()->entries()) {
      MT_CHECK(!f.where.count(name), "export", "{}: tensor '{}' is also in {}", p.string(), name, f.where[name]->path());
      f.where[name] = f.readers.back().get();
    }
  }
  return f;
}

Tensor read_whole(const SafetensorsReader& r, const std::string& name, DType dtype) {
  const SafetensorsEntry& e = r.entries().at(name);
  Tensor t = empty(e.shape, dtype);
  r.read_block(name, Shape(e.shape.size(), 0), t);
  return t;
}

const std::string kPeftPrefix = "base_model.model.";

}  // namespace

LoraConfig lora_config_from_adapter(const std::string& dir, std::string* base) {
  const fs::path p = fs::path(dir) / "adapter_config.json";
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(p, ec), "export", "{}: no adapter_config.json in it (not a PEFT adapter directory)", dir);
  const json j = read_json(p);
  LoraConfig l;
  try {
    MT_CHECK(j.at("peft_type") == "LORA", "export", "{}: peft_type = {}: only LORA adapters", p.string(),
             j.at("peft_type").dump());
    l.rank = j.at("r").get<int64_t>();
    l.alpha = j.at("lora_alpha").get<double>();
    l.targets = j.at("target_modules").get<std::vector<std::string>>();
    l.dropout = j.value("lora_dropout", 0.0);
    l.rslora = j.value("use_rslora", false);
    if (base && j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
      *base = j["base_model_name_or_path"].get<std::string>();
  } catch (const json::exception& e) {
    fail("export", "{}: {}", p.string(), e.what());
  }
  MT_CHECK(l.rank > 0 && l.alpha > 0, "export", "{}: r = {}, lora_alpha = {}: expected both > 0", p.string(), l.rank,
           l.alpha);
  return l;
}

void check_adapter_config(const std::string& dir, const LoraConfig& lora) {
  std::error_code ec;
  MT_CHECK(fs::is_directory(dir, ec), "config", "lora.init_from = {}: not a directory (a PEFT adapter directory holds "
           "adapter_config.json and adapter_model.safetensors)", dir);
  const fs::path cfg = fs::path(dir) / "adapter_config.json";
  MT_CHECK(fs::is_regular_file(cfg, ec), "config", "lora.init_from = {}: no adapter_config.json in it (not a PEFT "
           "adapter directory)", dir);
  json j;
  try {
    std::ifstream in(cfg);
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: not JSON: {}", cfg.string(), e.what());
  }
  auto field = [&](const char* k) -> const json& {
    MT_CHECK(j.contains(k), "checkpoint", "{}: no '{}'", cfg.string(), k);
    return j.at(k);
  };
  MT_CHECK(field("peft_type") == "LORA", "checkpoint", "{}: peft_type = {}: only LORA adapters are read", cfg.string(),
           field("peft_type").dump());
  MT_CHECK(field("r").is_number_integer() && field("r").get<int64_t>() == lora.rank, "checkpoint",
           "{}: r = {} but lora.rank = {}", cfg.string(), field("r").dump(), lora.rank);
  MT_CHECK(field("lora_alpha").is_number() && field("lora_alpha").get<double>() == lora.alpha, "checkpoint",
           "{}: lora_alpha = {} but lora.alpha = {}", cfg.string(), field("lora_alpha").dump(), lora.alpha);
  MT_CHECK(j.value("use_rslora", false) == lora.rslora, "checkpoint", "{}: use_rslora = {} but lora.rslora = {}",
           cfg.string(), j.value("use_rslora", false), lora.rslora);
  MT_CHECK(!j.value("fan_in_fan_out", false), "checkpoint", "{}: fan_in_fan_out = true (GPT-2's Conv1D layout) is not "
           "a Llama adapter", cfg.string());
  const json& tm = field("target_modules");
  MT_CHECK(tm.is_array(), "checkpoint", "{}: target_modules = {}: expected a list of module names", cfg.string(),
           tm.dump());
  std::set<std::string> theirs, ours(lora.targets.begin(), lora.targets.end());
  for (const json& t : tm) theirs.insert(t.get<std::string>());
  MT_CHECK(theirs == ours, "checkpoint", "{}: target_modules = {} but lora.targets = [{}]", cfg.string(), tm.dump(),
           fmt::format("{}", fmt::join(lora.targets, ", ")));
}

ExportReport export_adapter(const std::string& checkpoint, const std::string& out) {
  lora_config_from_adapter(checkpoint);  // a clear error for a directory that is not an adapter
  Files ad = open_files(checkpoint, "adapter_model");
  std::vector<NamedTensor> ts;
  for (auto& [name, r] : ad.where) ts.push_back({name, read_whole(*r, name, r->entries().at(name).dtype)});
  const fs::path tmp = out + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_safetensors((tmp / "adapter_model.safetensors").string(), ts, {{"format", "pt"}});
  fs::copy_file(fs::path(checkpoint) / "adapter_config.json", tmp / "adapter_config.json");
  fs::remove_all(out);
  fs::rename(tmp, out);
  return {int64_t(ts.size()), 0, ""};
}

ExportReport export_merged(const std::string& checkpoint, const std::string& base_dir, const std::string& out) {
  ExportReport rep;
  const LoraConfig l = lora_config_from_adapter(checkpoint, &rep.base);
  if (!base_dir.empty()) rep.base = base_dir;
  std::error_code ec;
  MT_CHECK(!rep.base.empty(), "export",
           "{}: the adapter names no base (base_model_name_or_path is empty: the run trained on a random base): give "
           "--base DIR, a Hugging Face directory",
           checkpoint);
  MT_CHECK(fs::is_directory(rep.base, ec) && fs::is_regular_file(fs::path(rep.base) / "config.json", ec), "export",
           "--base {}: not a Hugging Face model directory (config.json and *.safetensors)", rep.base);
  Files ad = open_files(checkpoint, "adapter_model");
  // Each adapted weight's factors: module -> (A, B) names, every adapter tensor accounted for.
  std::map<std::string, std::pair<std::string, std::string>> pairs;
  for (auto& [name, r] : ad.where) {
    MT_CHECK(name.rfind(kPeftPrefix, 0) == 0, "export", "{}: tensor '{}' is not named as PEFT names adapters", r->path(),
             name);
    const std::string rest = name.substr(kPeftPrefix.size());
    for (const char* f : {".lora_A.weight", ".lora_B.weight"}) {
      const std::string suf = f;
      if (rest.size() > suf.size() && rest.compare(rest.size() - suf.size(), suf.size(), suf) == 0) {
        auto& pr = pairs[rest.substr(0, rest.size() - suf.size()) + ".weight"];
        (suf[6] == 'A' ? pr.first : pr.second) = name;
      }
    }
  }
  const double scale = l.scale();
  const fs::path tmp = out + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  std::set<std::string> done;
  for (const auto& e : fs::directory_iterator(rep.base)) {
    const fs::path& p = e.path();
    if (p.extension() != ".safetensors") {  // config.json, the index, the tokenizer files: as they are
      if (fs::is_regular_file(p)) fs::copy_file(p, tmp / p.filename());
      continue;
    }
    SafetensorsReader r(p.string());
    std::vector<NamedTensor> ts;
    for (auto& [name, entry] : r.entries()) {
      Tensor w = read_whole(r, name, entry.dtype);
      auto it = pairs.find(name);
      if (it != pairs.end()) {
        const auto& [an, bn] = it->second;
        MT_CHECK(!an.empty() && !bn.empty(), "export", "{}: the adapter of {} lacks its {} factor", checkpoint, name,
                 an.empty() ? "lora_A" : "lora_B");
        Tensor a = read_whole(*ad.where.at(an), an, DType::f64);  // (r, in)
        Tensor b = read_whole(*ad.where.at(bn), bn, DType::f64);  // (out, r)
        MT_CHECK(entry.shape.size() == 2 && a.size(1) == entry.shape[1] && b.size(0) == entry.shape[0] &&
                     a.size(0) == b.size(1) && a.size(0) == l.rank,
                 "export", "{}: {} {} and {} {} do not fit {} {} of the base {} (r = {})", checkpoint, an,
                 shape_str(a.shape()), bn, shape_str(b.shape()), name, shape_str(entry.shape), rep.base, l.rank);
        // W + scale B A in f64: (out, r) @ (r, in), as B @ (A^T)^T.
        Tensor at = empty({a.size(1), a.size(0)}, DType::f64);  // (in, r)
        for (int64_t i = 0; i < a.size(0); ++i)
          for (int64_t j = 0; j < a.size(1); ++j) at.data<double>()[j * a.size(0) + i] = a.data<double>()[i * a.size(1) + j];
        Tensor delta = empty(entry.shape, DType::f64);  // (out, in)
        matmul_forward(delta, b, at);
        scale_(delta, scale);
        Tensor w64 = empty(entry.shape, DType::f64);
        convert(w64, w);
        add_(w64, delta);
        convert(w, w64);  // rounded once, to the base's dtype
        ++rep.merged;
        done.insert(name);
      }
      ts.push_back({name, w});
    }
    write_safetensors((tmp / p.filename()).string(), ts, r.metadata());
    rep.tensors += int64_t(ts.size());
  }
  for (auto& [name, pr] : pairs)
    MT_CHECK(done.count(name), "export", "{}: the adapter has {} for {}, which the base {} does not hold", checkpoint,
             pr.first.empty() ? pr.second : pr.first, name, rep.base);
  fs::remove_all(out);
  fs::rename(tmp, out);
  return rep;
}

}  // namespace mt
