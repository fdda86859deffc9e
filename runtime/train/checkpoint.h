// Checkpoints: a directory per step, dir/step_00000100/, holding
//   model.safetensors      full parameters under their Hugging Face names
//   optimizer.safetensors  AdamW's exp_avg / exp_avg_sq per parameter ("<name>.exp_avg")
//   config.json            the Hugging Face LlamaConfig of the model (hidden_size, ..., rope_theta and
//                          rope_parameters, tie_word_embeddings, hidden_act silu, no biases), so that
//                          transformers' LlamaForCausalLM.from_pretrained(dir) loads the directory as it is
//   meta.json              step, data position, RNG, config, mesh; written last
// Written by rank 0 into step_XXXXXXXX.tmp, flushed, then renamed: a crash
// mid-write leaves the previous checkpoint intact and the .tmp is ignored.
// Tensors are stored whole, so a run may resume on another mesh. A tied lm_head is not stored (it is
// model.embed_tokens.weight), as transformers saves tied models and expects to find them.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "models/llama/llama.h"
#include "runtime/train/hf_config.h"
#include "runtime/train/optimizer.h"

namespace mt {

struct TrainProgress {
  int64_t step = 0;        // optimizer steps done; training continues at this step
  int64_t data_epoch = 0;  // where the next batch comes from (informational: the position is a function of step)
  int64_t data_offset = 0;
  uint64_t seed = 0;
};

// Collective (full tensors are gathered); rank 0 writes. Returns the directory.
std::string save_checkpoint(const std::string& dir, const TrainProgress& progress, LlamaForCausalLM& model, AdamW& opt,
                            const Config& config, const DeviceMesh& mesh, int64_t keep);
// The complete checkpoints (step_XXXXXXXX with meta.json) in dir, oldest first.
std::vector<std::string> checkpoints_in(const std::string& dir);
// The newest complete checkpoint (step_XXXXXXXX with meta.json) in dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& dir);
// Loads parameters and optimizer state (every rank reads the files); returns the progress.
TrainProgress load_checkpoint(const std::string& path, LlamaForCausalLM& model, AdamW* opt);
// The config stored in a checkpoint's meta.json (for `meshtrain generate`).
Config checkpoint_config(const std::string& path);

// Loads a Hugging Face Llama safetensors file or directory (model.safetensors, else
// model-0000x-of-0000y.safetensors shards; optionally config.json, read by hf_model_config, whose model must be
// this one). Every parameter must be present with its shape; a missing, extra or mis-shaped tensor is an error
// naming it. f32, bf16 and f16.
void load_hf_weights(const std::string& path, LlamaForCausalLM& model);

}  // namespace mt
