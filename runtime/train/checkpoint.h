// Checkpoints: a directory per step, dir/step_00000100/, in Hugging Face's sharded layout:
//   model-0000k-of-0000N.safetensors + model.safetensors.index.json   parameters, whole, under their Hugging Face
//                          names (one model.safetensors, no index, when one rank writes)
//   optimizer-0000k-of-0000N.safetensors + optimizer.safetensors.index.json   AdamW's exp_avg / exp_avg_sq per
//                          parameter ("<name>.exp_avg"), the same way
//   config.json            the Hugging Face config of the model's family (hf_config.h), so that transformers'
//                          AutoModelForCausalLM.from_pretrained(dir) loads the directory as it is
//   tokenizer files        those of the run's tokenizer directory (tokenizer.json, tokenizer_config.json, ...),
//                          copied, so that the directory is a whole Hugging Face model
//   meta.json              step, data position, RNG, config, mesh, the model's own state (an MoE router's bias), every
//                          other file's checksum and one of its own (meta_checksum); written last
// Every rank writes (checkpoint.writers): each tensor goes to one file, each file has one writer, the bytes balanced
// over the writers; a tensor sharded over several ranks is sent to its writer one shard at a time, so a writer
// holds at most one whole tensor beyond its own state. Written into step_XXXXXXXX.tmp, each file synced, agreed by
// every rank, then renamed by rank 0: a crash mid-write leaves the previous checkpoint intact and the .tmp is
// ignored (and removed by the next run, stale_partial_saves). meta.json records every file's checksum (XXH3-64,
// checksum.h) and its own (meta_checksum); verify_checkpoint checks them before a resume trusts the files, and every
// read of meta.json checks its own.
// Asynchronous saves (checkpoint.async): begin_checkpoint gathers each writer's tensors into host memory (the only
// stall), a thread writes and syncs them, rank 0's thread completes the directory once every writer reported done,
// and commit() agrees on the outcome at a later step boundary; at most one in flight. Tensors are stored whole, so a run may resume on another mesh; a rank reads only its block of each
// (the files mapped). A tied lm_head is not stored (it is
// model.embed_tokens.weight), as transformers saves tied models and expects to find them.
#pragma once
#include <memory>
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

// A save begun and not yet committed. Its files are written by the time written() is true on every rank.
class PendingCheckpoint {
 public:
  struct State;
  explicit PendingCheckpoint(std::unique_ptr<State> s);
  ~PendingCheckpoint();  // waits for the writer thread; an uncommitted save's .tmp stays for the next run to remove
  int64_t step() const;
  uint64_t snapshot_bytes() const;  // host memory the snapshot holds on this rank (0 for a synchronous save)
  bool written() const;             // this rank's files are written and synced, or failed (commit() will say)
  double write_s() const;           // this rank's time writing and syncing its files
  // Asynchronous saves, rank 0: the unix time its thread renamed the directory into place, as soon as every rank's
  // writer was done (0: not completed in the background), and the last writer's end.
  double renamed_time() const;
  double last_done_time() const;
  // Collective: waits for this rank's writer, agrees on errors; synchronous: writes the indexes, config.json, the
  // tokenizer and meta.json with every file's checksum, renames, rotates. Asynchronous: rank 0's thread did that as
  // soon as every rank's writer reported done (a file per rank in the temporary directory), so the save is on disk
  // before this step boundary; this only agrees on the outcome. Returns the directory.
  std::string commit();

 private:
  std::unique_ptr<State> s_;
};
// Collective: steps 1 and 2 of a save (the checks, the temporary directory, the gathers); with async the files are
// written by a thread, else before it returns. save_checkpoint is begin_checkpoint(..., false)->commit().
std::unique_ptr<PendingCheckpoint> begin_checkpoint(const std::string& dir, const TrainProgress& progress,
                                                    CausalLM& model, AdamW& opt, const Config& config,
                                                    const DeviceMesh& mesh, const MpiEnv& env, Group* stages,
                                                    bool async);
// Collective: meta.json is checked against its own checksum on every rank, every file it lists is hashed by one
// rank and compared with its recorded checksum, and a safetensors or index file it does not list (one the loader
// could read) is refused; a missing, damaged, truncated or foreign file fails on every rank with one message naming
// it and what ("checksum mismatch", "missing"; ReportedError, printed by rank 0). A checkpoint written before
// meta.json had a checksum of its own (format 3), or any (format 2), is accepted with a one-line warning saying what
// is not verified: refusing it would restart from scratch a run that was merely upgraded.
void verify_checkpoint(const std::string& path, const MpiEnv& env);
// meta.json's checksum of itself (meta_checksum): XXH3-64 of its canonical text, the compact JSON of every other key
// with keys sorted as parsing the file gives it (a checksum cannot cover its own bytes; the file stays readable).
std::string meta_checksum(nlohmann::json meta);
// Partial saves (step_XXXXXXXX.tmp) left in dir by a run that died while saving.
std::vector<std::string> stale_partial_saves(const std::string& dir);
// Every committed checkpoint directory (step_XXXXXXXX) in dir, oldest first, with or without its meta.json: a
// directory is renamed into place only after its meta.json is written, so one without it is a damaged checkpoint
// (verify_checkpoint says "missing"), not a partial one.
std::vector<std::string> checkpoints_in(const std::string& dir);
// The newest complete checkpoint (step_XXXXXXXX with meta.json) in dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& dir);
// Loads parameters and optimizer state: each rank reads its block of every tensor (not communicating: callers agree
// on errors). Everything is checked (files, index, names, shapes, dtypes, finite values) before a parameter changes.
TrainProgress load_checkpoint(const std::string& path, CausalLM& model, AdamW* opt);
// The config stored in a checkpoint's meta.json (for `meshtrain generate`), meta.json checked against its own
// checksum.
Config checkpoint_config(const std::string& path);

// LoRA (models/lora.h): PEFT's adapter_config.json for the run's lora section (r, lora_alpha, target_modules,
// lora_dropout, use_rslora, base_model_name_or_path = model.init_from).
nlohmann::json adapter_config_json(const Config& config);
// Loads a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) into model's adapters: the
// config must agree with `lora` (r, lora_alpha, use_rslora, target_modules) and every adapter tensor be present with
// its shape; each a clear error naming the file and the key or tensor. Each rank reads its blocks.
void load_lora_adapter(const std::string& dir, CausalLM& model, const LoraConfig& lora);

// A checkpoint's weights for inference (generate, logits), no optimizer: with LoRA (cfg.lora, the checkpoint's
// config) the frozen base first (model.init_from; without one the seed's init the model was built with) and then
// the checkpoint's adapters.
void load_checkpoint_weights(const std::string& path, const Config& cfg, CausalLM& model);

// Loads a Hugging Face safetensors file or directory (model.safetensors.index.json, else model.safetensors,
// else every .safetensors file of the directory; each rank reads its blocks; optionally config.json, read by the
// family of its model_type, whose model must be this one). Every parameter must be present with its shape; a missing, extra or mis-shaped tensor is an error
// naming it. f32, bf16 and f16. With LoRA the adapters are not in the file (load_lora_adapter).
void load_hf_weights(const std::string& path, CausalLM& model);

}  // namespace mt
