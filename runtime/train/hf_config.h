// The Hugging Face LlamaConfig schema (config.json), both ways.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/core/dtype.h"
#include "runtime/core/error.h"
#include "runtime/io/config.h"

namespace mt {

// The Hugging Face LlamaConfig of the model, written beside model.safetensors so that transformers'
// LlamaForCausalLM.from_pretrained(dir) builds exactly this model. weights: the dtype the weights are stored in.
nlohmann::json hf_config_json(const Config& config, DType weights);

// The model of a Hugging Face LlamaConfig file (config.json): hidden_size -> dim, num_hidden_layers -> n_layers,
// num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, rms_norm_eps, rope_theta (top-level,
// transformers 4, or rope_parameters.rope_theta, transformers 5), max_position_embeddings -> max_seq_len,
// tie_word_embeddings, with transformers' defaults for the optional keys. What meshtrain's Llama does not compute
// is an error naming the key and the file: RoPE scaling (a rope_scaling or rope_parameters whose rope_type is not
// "default", or any key there but rope_theta), attention_bias or mlp_bias true, hidden_act other than silu, a
// head_dim other than hidden_size / num_attention_heads, a model_type other than llama.
ModelConfig hf_model_config(const std::string& config_json);

}  // namespace mt
