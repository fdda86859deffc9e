// What the Llama architecture's config.json readers share (families_hf.cpp, families_hf_deepseek.cpp): the reader
// whose errors name the file and the key, and the keys every family of the architecture writes and reads.
#pragma once
#include <cmath>
#include <optional>
#include <string>

#include "models/llama/families_hf.h"

namespace mt::llama_hf {

using json = nlohmann::json;

// A reader of one config.json: typed getters whose errors name the file and the key. A model key ("model.dim") is
// read under the family's name for it (ModelFamily::hf_names); any other key is the file's own name.
struct HfReader {
  const ModelFamily& family;
  const json& j;
  const std::string& file;
  std::string name(const std::string& key) const {
    if (key.rfind("model.", 0) != 0) return key;
    const std::string hf = family.hf_key(key);
    MT_CHECK(hf != key, "model", "{} stores no {} in its config.json", family.type, key);
    return hf;
  }
  const json& at(const std::string& key) const { return j[name(key)]; }
  bool has(const std::string& key) const { return j.contains(name(key)) && !at(key).is_null(); }
  [[noreturn]] void unsupported(const std::string& key, const json& v, const std::string& why) const {
    fail("checkpoint", "{}: {} = {}: {}", file, name(key), v.dump(), why);
  }
  int64_t integer(const std::string& key, std::optional<int64_t> dflt) const {
    if (!has(key)) {
      MT_CHECK(dflt.has_value(), "checkpoint", "{}: no {}: a {} config needs it", file, name(key),
               j.value("model_type", std::string("llama")));
      return *dflt;
    }
    MT_CHECK(at(key).is_number_integer() && at(key).get<int64_t>() >= 1, "checkpoint",
             "{}: {} = {}: expected an integer >= 1", file, name(key), at(key).dump());
    return at(key).get<int64_t>();
  }
  double number(const json& v, const std::string& key) const {
    MT_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0, "checkpoint",
             "{}: {} = {}: expected a number > 0", file, name(key), v.dump());
    return v.get<double>();
  }
  bool boolean(const std::string& key, bool dflt) const {
    if (!has(key)) return dflt;
    MT_CHECK(at(key).is_boolean(), "checkpoint", "{}: {} = {}: expected true or false", file, name(key),
             at(key).dump());
    return at(key).get<bool>();
  }
};

// The keys every family of the architecture writes (its named model keys, RoPE both ways) and reads.
nlohmann::json common_to_hf(const ModelFamily& f, const ModelConfig& m);
ModelConfig common_from_hf(const HfReader& r, bool swiglu = true);
// attention_bias true refused, naming the model.
void refuse_attention_bias(const HfReader& r, const char* model);

}  // namespace mt::llama_hf
