// `meshtrain export`: a LoRA run's adapter out of its checkpoint, as PEFT writes one, or folded into its base as a
// Hugging Face model directory. Files only: no ranks, no model built; the adapter's own adapter_config.json says
// its rank, alpha and targets, so any PEFT adapter directory works too.
#pragma once
#include <string>

#include "models/lora.h"

namespace mt {

// The lora section an adapter directory's adapter_config.json describes (r, lora_alpha, target_modules,
// lora_dropout, use_rslora); errors name the file and the key. *base gets base_model_name_or_path if given.
LoraConfig lora_config_from_adapter(const std::string& dir, std::string* base = nullptr);

// lora.init_from's adapter_config.json agrees with `lora` (peft_type LORA, r, lora_alpha, use_rslora,
// target_modules as a set): each difference an error naming the file and both values. A config check (Config::check):
// every rank alone, before any collective.
void check_adapter_config(const std::string& dir, const LoraConfig& lora);

struct ExportReport {
  int64_t tensors = 0, merged = 0;  // tensors written; of them, weights with an adapter folded in
  std::string base;                 // the base directory used (merge)
};

// The adapter alone: out/adapter_config.json and out/adapter_model.safetensors (one file, the stages' files of a
// pipeline-parallel run joined).
ExportReport export_adapter(const std::string& checkpoint, const std::string& out);

// base's Hugging Face directory with W + scale B A folded into every adapted weight (in f64, stored in the base
// tensor's dtype); every other tensor, config.json, the index and the tokenizer files copied. base empty: the
// adapter's base_model_name_or_path. Written into out.tmp and renamed: no half-written directory.
ExportReport export_merged(const std::string& checkpoint, const std::string& base, const std::string& out);

}  // namespace mt
