#include "runtime/train/hf_config.h"

#include <fstream>

#include "models/model.h"

using json = nlohmann::json;

namespace mt {

json hf_config_json(const Config& config, DType weights) {
  const ModelConfig& m = config.model;
  json j = family_of(m).to_hf(m);
  const char* dtype = weights == DType::bf16 ? "bfloat16" : weights == DType::f64 ? "float64" : "float32";
  j["torch_dtype"] = dtype;  // transformers 4
  j["dtype"] = dtype;        // transformers 5
  const std::string original = init_from_config_json(m.init_from);
  if (!original.empty()) {
    std::ifstream f(original);
    json o = json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (o.is_object())
      for (auto& [k, v] : o.items())
        if (!j.contains(k)) j[k] = v;
    return j;
  }
  // The document separator starts every document (data.document_separator), as GPT-2's <|endoftext|> does.
  const int64_t sep = config.data.document_separator;
  j["bos_token_id"] = sep >= 0 ? json(sep) : json(nullptr);
  j["eos_token_id"] = sep >= 0 ? json(sep) : json(nullptr);
  j["pad_token_id"] = nullptr;
  return j;
}

}  // namespace mt
