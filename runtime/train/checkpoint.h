// Checkpoints: a directory per step, dir/step_00000100/, in Hugging Face's sharded layout:
//   model-0000k-of-0000N.safetensors + model.safetensors.index.json   parameters, whole, under their Hugging Face
//                          names (one model.safetensors, no index, when one rank writes)
//   optimizer-0000k-of-0000N.safetensors + optimizer.safetensors.index.json   AdamW's exp_avg / exp_avg_sq per
//                          parameter ("<name>.exp_avg"), the same way
//   config.json            the Hugging Face config of the model's family (hf_config.h), so that transformers'
//                          AutoModelForCausalLM.from_pretrained(dir) loads the directory as it is
//   tokenizer files        those of the run's tokenizer directory (tokenizer.json, tokenizer_config.json, ...),
//                          copied, so that the directory is a whole Hugging Face model
//   meta.json              step, data position, RNG, config, mesh; written last
// Every rank writes (checkpoint.writers): each tensor goes to one file, each file has one writer, the bytes balanced
// over the writers; a tensor sharded over several ranks is sent to its writer one shard at a time, so a writer
// holds at most one whole tensor beyond its own state. Written into step_XXXXXXXX.tmp, each file synced, agreed by
// every rank, then renamed by rank 0: a crash mid-write leaves the previous checkpoint intact and the .tmp is
// ignored. Tensors are stored whole, so a run may resume on another mesh; a rank reads only its block of each
// (the files mapped). A tied lm_head is not stored (it is
// model.embed_tokens.weight), as transformers saves tied models and expects to find them.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "comm/env.h"
#include "comm/watchdog.h"  // WatchdogPhase: a rank stuck in a save or load is reported as part of it
#include "models/model.h"
#include "runtime/train/hf_config.h"
#include "runtime/train/optimizer.h"

namespace mt {

struct TrainProgress {
  int64_t step = 0;        // optimizer steps done; training continues at this step
  int64_t data_epoch = 0;  // where the next batch comes from (informational: the position is a function of step)
  int64_t data_offset = 0;
  uint64_t seed = 0;
};

// Collective. Every rank checks its own shards for non-finite values first (refused on every rank, naming the
// tensor); config.checkpoint.keep and .writers apply. Returns the directory.
// With several stages (`stages`: the group joining them, StepExecutor::stage_group; null for one) `mesh` is the
// stage's and its ranks write the stage's tensors; the files are numbered stage after stage and the index covers
// every stage: the same tensors as with one stage.
std::string save_checkpoint(const std::string& dir, const TrainProgress& progress, CausalLM& model, AdamW& opt,
                            const Config& config, const DeviceMesh& mesh, const MpiEnv& env, Group* stages = nullptr);
// The complete checkpoints (step_XXXXXXXX with meta.json) in dir, oldest first.
std::vector<std::string> checkpoints_in(const std::string& dir);
// The newest complete checkpoint (step_XXXXXXXX with meta.json) in dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& dir);
// Loads parameters and optimizer state: each rank reads its block of every tensor (not communicating: callers agree
// on errors). Everything is checked (files, index, names, shapes, dtypes, finite values) before a parameter changes.
TrainProgress load_checkpoint(const std::string& path, CausalLM& model, AdamW* opt);
// The config stored in a checkpoint's meta.json (for `meshtrain generate`).
Config checkpoint_config(const std::string& path);

// Loads a Hugging Face safetensors file or directory (model.safetensors.index.json, else model.safetensors,
// else every .safetensors file of the directory; each rank reads its blocks; optionally config.json, read by the
// family of its model_type, whose model must be this one). Every parameter must be present with its shape; a missing, extra or mis-shaped tensor is an error
// naming it. f32, bf16 and f16.
void load_hf_weights(const std::string& path, CausalLM& model);

}  // namespace mt
