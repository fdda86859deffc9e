// Tensors a family's Hugging Face files hold fused (ModelFamily::fused_weights: Phi-3's self_attn.qkv_proj.weight
// is q_proj, k_proj and v_proj concatenated along dim 0; mlp.gate_up_proj.weight is gate_proj and up_proj): the
// parameters stay separate (so tensor parallel splits heads and the MLP as for Llama) and the files name the fused
// tensor. Loading reads each parameter's block as rows of its fused tensor (checkpoint_load.cpp); saving gathers
// the parts whole on the writer and joins them (checkpoint.cpp). Optimizer moments keep the parameters' names.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"

namespace mt {

// Where a parameter lies in its fused file tensor.
struct FusedPart {
  std::string file;  // the file tensor's name ("model.layers.0.self_attn.qkv_proj.weight")
  Shape file_shape;  // its shape: the parts' concatenated along dim 0
  int64_t row = 0;   // the first row of this parameter in it
};

// A model's file layout: which of its parameters its family's files hold fused.
class FileLayout {
 public:
  explicit FileLayout(CausalLM& model);
  // The files' name of a parameter: its fused tensor's, else its own (names of other pipeline stages too).
  std::string file_name(const std::string& param) const;
  // Its place in a fused tensor; nullopt: stored under its own name.
  std::optional<FusedPart> part(const std::string& param) const;
  // The values of the parts of the fused tensor whose first part is `param`, in file order; empty for any other
  // parameter (a fused tensor is saved once, at its first part).
  std::vector<DTensor> parts_led_by(const std::string& param) const;

 private:
  const ModelFamily* family_;
  std::map<std::string, std::vector<Parameter*>> groups_;  // file name -> its parts, in order
};

// Whole tensors (host) joined along dim 0, in order; the shape of parameters so joined.
Tensor join_rows(const std::vector<Tensor>& parts);
Shape joined_shape(const std::vector<DTensor>& parts);

}  // namespace mt
