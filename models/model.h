// The model interface: what the trainer, checkpoints, plan, generate, logits and (later) estimate need from a
// model, and the one registration of each family (torchtitan's TrainSpec). Nothing outside models/ names a family:
// the run's model.type (or a Hugging Face config.json's model_type) picks one here.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "models/model_config.h"
#include "parallel/fully_shard.h"
#include "parallel/module.h"
#include "parallel/parallel_dims.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/style.h"

namespace mt {

// The root module (name "") of a causal language model: call(tokens (B, T) i32) gives logits (B, T, V) (V/tp
// under loss parallel), call_backward(dlogits) accumulates every parameter's gradient. Parameters carry their
// Hugging Face names.
class CausalLM : public Module {
 public:
  CausalLM(const std::string& type_name, const ModelConfig& c) : Module("", type_name), config(c) {}
  ModelConfig config;
  // Global positions (T) of the tokens of the next forward (default 0 ... T-1: whole sequences).
  virtual void set_positions(const Tensor& positions) = 0;
  virtual Tensor positions() const = 0;  // undefined before the first forward
  // Where each token of the whole sequences starts its document, (B, T) i64 on the host; undefined: none.
  virtual void set_documents(const Tensor& doc_start) = 0;
  virtual Tensor documents() const = 0;
  // Every attention layer's implementation (attention/attention.h: apply_cp swaps it; generation runs local).
  virtual void set_attention(std::shared_ptr<const Attention> a) = 0;
  virtual const std::shared_ptr<const Attention>& attention() const = 0;
  // The token embedding's weight: the dtype and device the model computes in (vocab-sharded under tp).
  virtual Parameter& embedding_weight() = 0;
  // The output projection's weight (V, C): its rows are the logits' vocabulary (sharded on tp under loss
  // parallel; compute_offset()[0] is this rank's first row). Only on the last pipeline stage.
  virtual Parameter& output_weight() = 0;

  // Pipeline parallel. keep_chunks destroys every module that none of `chunks` (this rank's stages, in stage
  // order) runs, before any parameter is materialized; the names of the parameters destroyed are kept
  // (elsewhere()): loading a whole checkpoint skips them. Tied embeddings are refused (stage 0 and the last
  // stage would share a weight). chunk_forward(k, x): stage 0's x is the tokens (B, T) i32, another's the
  // previous stage's output (B, T, C); the last stage gives the logits. chunk_backward gives the gradient of x
  // (undefined on stage 0).
  virtual void keep_chunks(const std::vector<ModelChunk>& chunks) = 0;
  virtual Tensor chunk_forward(size_t k, const Tensor& x) = 0;
  virtual Tensor chunk_backward(size_t k, const Tensor& dy) = 0;
  const std::vector<ModelChunk>& chunks() const { return chunks_; }  // empty: the whole model
  const std::vector<std::string>& elsewhere() const { return elsewhere_; }
  // Whether a module path pattern (style.h's) matches a module another stage holds.
  bool matches_elsewhere(const std::string& pattern) const;
  bool has_output() const { return chunks_.empty() || chunks_.back().last; }  // the logits come out here
  bool has_input() const { return chunks_.empty() || chunks_.front().first; }

 protected:
  std::vector<ModelChunk> chunks_;
  std::vector<std::string> elsewhere_;          // parameter names
  std::vector<std::string> elsewhere_modules_;  // module names
};

// One family, registered once (models/model.cpp lists them). Every entry is required.
struct ModelFamily {
  std::string type;          // model.type, and Hugging Face's model_type
  std::string architecture;  // Hugging Face's architectures[0] ("LlamaForCausalLM")
  std::unique_ptr<CausalLM> (*build)(const ModelConfig& c, const ParamFactory& f);
  // The family's parallelisms composed (tp, cp, recompute, fully_shard) after checking that the sequence and the
  // heads split; then deferred parameters (ParamFactory::deferred) are materialized in their final layout. The
  // returned state (null without dp_shard) must outlive the model's forward and backward calls.
  std::unique_ptr<FullyShard> (*parallelize)(CausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                             const ParallelConfig& p, int64_t seq_len, DType reduce_dtype);
  // The default tensor-parallel plan (parallel.tp_plan replaces it).
  ParallelPlan (*tp_plan)(bool sequence_parallel, bool loss_parallel);
  // The default plan's bytes per rank in one direction with sequence parallel; act_bytes: one (b, T, d) activation.
  double (*tp_bytes)(const ModelConfig& c, int tp, double act_bytes);
  // Model FLOPs per token (6 N + attention, the PaLM count) and parameter counts.
  double (*flops_per_token)(const ModelConfig& c, int64_t seq_len);
  int64_t (*num_params)(const ModelConfig& c, bool with_embeddings);
  // The family's own rules beyond check_model_config, as config errors naming the key.
  void (*check)(const ModelConfig& c, int64_t seq_len);
  // Hugging Face's config.json: the keys of this architecture (the caller adds dtype and token ids), and the
  // model of such a file (file: for messages). A key meshtrain does not implement is refused, naming it.
  nlohmann::json (*to_hf)(const ModelConfig& c);
  ModelConfig (*from_hf)(const nlohmann::json& j, const std::string& file);
};

// The family of model.type (or a config.json's model_type); an unknown one is an error naming `key` and the
// supported list.
const ModelFamily& model_family(const std::string& type, const std::string& key = "model.type");
std::vector<std::string> model_family_names();
inline const ModelFamily& family_of(const ModelConfig& c) { return model_family(c.type); }

// The model of a Hugging Face config.json file: its model_type picks the family (refused, naming model_type and
// the supported list, when meshtrain has none for it).
ModelConfig model_config_from_hf(const std::string& config_json);

}  // namespace mt
