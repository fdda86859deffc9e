// The parts of a save that decide and move, shared by checkpoint.cpp (the files) and memory_checkpoint.cpp: the
// tensors of a checkpoint (parameters' f32 masters, AdamW's moments), which rank writes each into which file, the
// gathers bringing a tensor whole to its writer, and the tokenizer files that travel with the weights. Internal to
// runtime/train.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/model.h"
#include "runtime/train/fused_tensors.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/run_config.h"

namespace mt {

// One tensor of a checkpoint: its name and the DTensor whose local part this rank holds (a parameter's f32
// master value, or an AdamW moment laid out like it).
struct CkptTensor {
  std::string name;
  DTensor t;
  bool model = true;  // model file (else optimizer file)
  // A stacked parameter's (an MoE layer's experts) slice along dim 0, written as its own tensor by a rank that
  // holds it: -1, the whole of t.
  int64_t slice = -1;
  // A tensor the family's files hold fused (fused_tensors.h): its parameters, joined along dim 0 (t: the first).
  std::vector<DTensor> parts;
  Shape shape() const {
    if (!parts.empty()) return joined_shape(parts);
    return slice < 0 ? t.shape() : Shape(t.shape().begin() + 1, t.shape().end());
  }
};

// Which rank writes each tensor and into which file: one model and one optimizer file per writer that has such
// tensors, numbered in rank order (under pipeline parallel stage by stage: each stage's numbers follow the previous
// stages', which one all-gather over the stages tells).
struct FilePlan {
  std::vector<int> writer;             // per tensor: its writer's rank in the model's ranks
  std::map<int, int> model_k, opt_k;   // writer -> file index
  int n_model = 0, n_opt = 0;          // files of the whole checkpoint
  std::string model_prefix = "model";  // "adapter_model" with LoRA (PEFT's file)
};

inline Tensor host_f(const Tensor& t) { return t.device().is_cuda() ? t.to(Device::cpu()) : t; }

// The run's tokenizer files (data.tokenizer, else model.init_from's directory's).
std::vector<std::filesystem::path> tokenizer_files(const Config& config);
// Every trainable parameter (with LoRA the adapters, under PEFT's names: the frozen base is not saved), then (opt)
// its exp_avg and exp_avg_sq; a stacked parameter one entry per slice.
std::vector<CkptTensor> checkpoint_tensors(CausalLM& model, AdamW* opt);
uint64_t tensor_bytes(const CkptTensor& c);
// Collective over the stages when `stages` (one all-gather); the same answer on every rank.
FilePlan plan_files(const std::vector<CkptTensor>& ts, int n_world, const Config& config, const DeviceMesh& mesh,
                    Group* stages);
// Collective over world: t whole on `writer` (host), undefined elsewhere; slice: a stacked parameter's dim-0 row.
Tensor gather_to_writer(const DTensor& t, int writer, Group& world, int64_t slice = -1);
// A fused tensor whole on its writer: its parts gathered one by one and joined (undefined elsewhere).
Tensor gather_joined(const std::vector<DTensor>& parts, int writer, Group& world);
// The concatenation of every member's JSON array, in rank order (collective over g).
nlohmann::json gather_json_array(Group& g, const nlohmann::json& mine, Device device);
// "prefix.safetensors" for one file, else "prefix-0000k-of-0000n.safetensors".
std::string shard_file(const std::string& prefix, int k, int n);

}  // namespace mt
