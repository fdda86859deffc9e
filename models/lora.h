// LoRA (Hu et al. 2021, as Hugging Face PEFT defines it): low-rank adapters on a frozen base. A target Linear
// computes y = x W^T + scale * (x A^T) B^T with A (rank, in) and B (out, rank), PEFT's shapes; scale is
// alpha / rank, or alpha / sqrt(rank) with rslora. Every other parameter of the model is frozen (no gradient, no
// optimizer state, no sync). The adapters are parameters of their Linear, named as PEFT names them without its
// "base_model.model." prefix: "model.layers.0.self_attn.q_proj.lora_A.weight".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/module.h"
#include "runtime/io/config.h"

namespace mt {

// The YAML section `lora` (rank 0: off).
struct LoraConfig {
  int64_t rank = 0;
  double alpha = 16;
  double dropout = 0;
  std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  bool rslora = false;
  std::string init_from;
  template <class V> void visit(V& v) {
    v("rank", rank, "the adapters' rank r (0 = no LoRA: full training)", at_least(0, "a rank (0 = off)"));
    v("alpha", alpha, "lora_alpha: the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)",
      positive());
    v("dropout", dropout, "lora_dropout: dropout on the adapters' input in training, a probability in [0, 1)",
      expect([](double p) { return p >= 0 && p < 1; }, "expected a probability in [0, 1)"));
    v("targets", targets,
      "the adapted modules, as Hugging Face names them: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
      "down_proj (default all seven)",
      one_of({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
    v("rslora", rslora, "rank-stabilised LoRA: scale alpha / sqrt(rank) instead of alpha / rank");
    v("init_from", init_from,
      "a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from ('' = PEFT's "
      "initialisation: A Kaiming-uniform, B zero)");
  }
  bool enabled() const { return rank > 0; }
  void check() const;  // targets not empty, not repeated
  double scale() const;
  bool operator==(const LoraConfig&) const = default;
};

// PEFT's tensor name for an adapter parameter: "base_model.model." + name.
std::string peft_name(const std::string& param_name);
// Whether p is an adapter (its name ends in lora_A.weight or lora_B.weight).
bool is_lora_param(const Parameter& p);
// Whether model carries adapters (apply_lora ran on it).
bool has_lora(Module& model);
// The name a parameter has in a checkpoint's model files: PEFT's for an adapter, its own otherwise.
std::string file_param_name(const Parameter& p);
// The prefix of a checkpoint's model files: "adapter_model" (PEFT's) for a model with adapters, else "model".
std::string model_files_prefix(Module& model);

// lora_dropout's mask keys: each element of an adapter's input is kept by a draw keyed by (training.seed, the
// module's name and the step, the token's global index (batch row x seq_len + position) x in_features + the feature),
// so a mesh that splits rows, the sequence or the features draws the same mask as one rank. Set by the trainer for a
// training step (LoraDropoutStep) and each micro-batch's rows (set_lora_dropout_rows); without them (evaluation,
// sampling, generate) there is no dropout.
struct LoraDropoutKeys {
  uint64_t seed = 0;
  int64_t step = 0;
  Tensor row_ids;  // (micro x T_local) i64 on the device: the micro-batch's tokens' global indices, (b, t) order
};
const LoraDropoutKeys* lora_dropout_keys();  // null outside a training step or before a micro-batch's rows
class LoraDropoutStep {
 public:
  LoraDropoutStep(uint64_t seed, int64_t step);
  ~LoraDropoutStep();
  LoraDropoutStep(const LoraDropoutStep&) = delete;
  LoraDropoutStep& operator=(const LoraDropoutStep&) = delete;
};
void set_lora_dropout_rows(const Tensor& row_ids);  // within a LoraDropoutStep; ignored outside one

// Adds an adapter to every Linear whose last name component is a target and freezes every other parameter of
// model (before materialize: the frozen ones never get a gradient buffer). A target the model has no Linear for
// is an error naming lora.targets. Returns the adapted modules' count.
int64_t apply_lora(Module& model, const LoraConfig& lora, const ParamFactory& f);

}  // namespace mt
