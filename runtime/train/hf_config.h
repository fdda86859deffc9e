// The Hugging Face config.json written beside a checkpoint's weights (the model family's keys, models/model.h).
#pragma once
#include <nlohmann/json.hpp>

#include "runtime/core/dtype.h"
#include "runtime/train/run_config.h"

namespace mt {

// The model's config.json, so that transformers' AutoModelForCausalLM.from_pretrained(dir) builds exactly this
// model: the family's keys (model_type, architectures, sizes, RoPE in both spellings), the weights' dtype, and the
// token ids. With model.init_from naming a Hugging Face directory, every key of its config.json that meshtrain does
// not set itself is kept as it was (bos/eos/pad token ids, transformers_version, ...), so the result loads where
// the original did; otherwise bos and eos are data.document_separator (or null). weights: the dtype stored.
nlohmann::json hf_config_json(const Config& config, DType weights);

}  // namespace mt
