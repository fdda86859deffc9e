// The model interface: what the trainer, checkpoints, plan, generate, logits and (later) estimate need from a
// model, and the one registration of each family (torchtitan's TrainSpec). Nothing outside models/ names a family:
// the run's model.type (or a Hugging Face config.json's model_type) picks one here.
#pragma once
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "comm/comm_bytes.h"
#include "models/model_config.h"
#include "parallel/fully_shard.h"
#include "parallel/module.h"
#include "parallel/parallel_dims.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/style.h"
#include "runtime/core/allocator.h"

namespace mt {

// The facts of one rank's layout that a stage's activations and FLOPs depend on (`meshtrain estimate` gives them
// to the model: CausalLM::activation_bytes and stage_flops).
struct RankShape {
  int64_t micro = 1;    // B: sequences per forward
  int64_t tokens = 1;   // T: this rank's tokens of each sequence (after cp)
  int64_t seq_len = 1;  // the whole sequence (the keys each query sees)
  int tp = 1;
  bool sequence_parallel = false;  // in effect (tp > 1)
  bool loss_parallel = false;      // in effect (tp > 1)
  int cp_ulysses = 1;
  int ep = 1;                     // expert parallel: an MoE layer's rows travel to their experts' ranks
  double elem = 4, accum = 4;     // bytes of the compute dtype and of its accumulation dtype
  bool widened_bf16 = false;      // bf16 ops run in f32 on widened copies (CPU ranks: runtime/kernels/op.h)
  Device device = Device::cpu();  // whose allocator rounds each tensor
  // resident: alloc gives the 4 KiB pages a tensor's bytes touch, what a process's resident set holds of a block
  // (a granule's tail is never written), instead of the block.
  bool resident = false;
  // A tensor's bytes as the allocator takes them (allocation_bytes: 2 MiB granules above 1 MiB).
  double alloc(double bytes) const {
    if (bytes <= 0) return 0;
    return resident ? std::ceil(bytes / 4096) * 4096 : double(allocation_bytes(device, size_t(bytes)));
  }
};

// One micro-batch's activations on a rank's stage, in allocator bytes, under the recompute policy its modules carry.
struct ActivationBytes {
  int64_t layers_here = 0;         // decoder layers on this stage
  double layers = 0;               // what they keep from forward to backward
  double input = 0;                // the embedding's (first stage)
  double head = 0;                 // the final norm's and the output projection's inputs (last stage)
  double logits = 0;               // the logits (dloss/dlogits in place) and the per-token losses (last stage)
  double recompute_transient = 0;  // the most a recomputed layer makes again inside its backward
  double backward_peak = 0;        // the largest gradients in flight inside a backward, beside what is kept
  double loss = 0;                 // the loss's temporaries beside the logits (last stage)
  double input_forward = 0;        // the embedding's forward temporaries (first stage)
  double deferred = 0;             // zb1p: what waits between a micro-batch's input gradient (B) and its W
  double boundary = 0;             // one stage-boundary tensor (pp's message), unrounded
  int64_t sparse_layers = 0;       // of layers_here, MoE layers (their dispatch: moe_cost.h)
  int64_t sparse_recomputed = 0;   // of them, those whose forward (and its all-to-alls) runs again in backward
  double total() const { return layers + input + head + logits; }
};

// A rank's FLOPs per token of its sequence part on its stage, forward and backward (the PaLM count: 6 a weight,
// attention's QK^T and PV at full cost), and the bytes its memory-bound ops move per token.
struct StageFlops {
  double layer_gemm = 0;             // per decoder layer
  double layer_attention = 0;        // per decoder layer: the attention kernels
  double head = 0;                   // the output projection (the last stage's)
  double recomputed_gemm = 0;        // the forwards recompute repeats (2 a weight), summed over the stage's layers
  int64_t recomputed_attention = 0;  // layers whose recompute repeats the attention kernel (its forward: a third)
  double attention_causal = 0;       // per layer: the causal kernel's forward as calibration counts it
  double traffic_layer = 0;          // bytes the memory-bound ops move per layer in forward (backward: twice)
  double traffic_head = 0;           // the loss's, over the local logits
};

// "model.layers.0.mlp.experts.*.gate_proj.weight" and expert j: "model.layers.0.mlp.experts.3.gate_proj.weight".
// A parameter whose name holds the segment "*" is stacked along dim 0, one slice per expert (checkpoints).
bool is_stacked_param(const std::string& name);
std::string stacked_param_name(const std::string& name, int64_t j);

// The step's router statistics, global (summed over the ranks holding the micro-batches' other tokens).
struct RouterStepStats {
  double aux_loss = 0;                            // the balance loss as it enters the loss (coef and weight included)
  std::vector<std::vector<double>> expert_load;   // (sparse layers, E): rows routed to each expert in the step
  int64_t dropped = 0;                            // rows dropped by the capacity
  double dispatch_s = 0;                          // wall time in the ep all-to-alls (host clock: exact on CPU ranks)
  bool has_bias = false;                          // aux-loss-free balancing is on: bias_min, bias_max hold its range
  double bias_min = 0, bias_max = 0;
  bool any = false;
  // Bounded dropless expert parallel (models/llama/moe.h): the bound factor the step ran with (0: not bounded) and
  // how many times the step was recomputed because rows overflowed it (train_step).
  double dropless_bound = 0;
  int64_t bound_recomputed = 0;
};

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
  const std::vector<std::string>& elsewhere() const { return elsewhere_; }  // as the files name them
  // Whether a module path pattern (style.h's) matches a module another stage holds.
  bool matches_elsewhere(const std::string& pattern) const;
  bool has_output() const { return chunks_.empty() || chunks_.back().last; }  // the logits come out here
  bool has_input() const { return chunks_.empty() || chunks_.front().first; }

  // What this rank's modules keep for backward in one micro-batch and make in their backwards, and their FLOPs,
  // under the layouts and recompute flags the parallelisms set (`meshtrain estimate`; written next to the
  // family's tensors).
  virtual ActivationBytes activation_bytes(const RankShape& s) const = 0;
  virtual StageFlops stage_flops(const RankShape& s) const = 0;

  // Training losses beside the token losses (the MoE balance loss; nothing for a dense model). set_loss_scale:
  // the loss of a token in the next forwards (1 / the step's tokens), 0 for forwards without backward.
  // take_router_stats: the step's router statistics (global), including the balance loss as it enters the loss,
  // cleared. after_step: state the optimizer does not update (the aux-loss-free selection bias).
  virtual void set_loss_scale(double /*inv_tokens*/) {}
  // Multi-token prediction (DeepSeek-V3, model.mtp_layers): wants_mtp says the model has it; set_mtp_batch gives
  // the next training forward its input tokens (the next tokens) and targets (the tokens after next; -1: none),
  // (B, T) i32 on the model's device each; take_extra_losses: the weighted per-token losses of the training forwards
  // since the last call (summed into the step's loss like the token losses), cleared.
  virtual bool wants_mtp() const { return false; }
  virtual void set_mtp_batch(const Tensor& /*inputs*/, const Tensor& /*targets*/) {}
  virtual std::vector<Tensor> take_extra_losses() { return {}; }
  // Tensors a family's files hold as copies of a shared parameter (DeepSeek-V3's MTP module keeps
  // model.layers.{L}.embed_tokens.weight and shared_head.head.weight): file name -> the parameter's name. Written
  // with the parameter's values, skipped when read.
  virtual std::map<std::string, std::string> file_copies() const { return {}; }
  // After this rank's forward of a training micro-batch (the local executor calls it in the micro-batch's slot):
  // the router statistics' sum over the loss group starts.
  virtual void forward_done() {}
  // Under pipeline parallel an MoE model's statistics pool the sparse layers of every stage, so they travel with
  // the micro-batch in the pipeline's messages (runtime/train/pipeline.cpp; MoeContext::chunk_flow and chunk_total
  // say how), called in the micro-batch's slot: router_stats_numel, one message's f64 numbers (0: none, a dense
  // model); router_stats_forward after a chunk's forward: what its activation's message carries on (undefined on
  // the last stage, which starts the sum); router_stats_backward before a chunk's backward: the micro-batch's sum
  // (`in` arrived with the gradient; undefined on the last stage), for the gradient's message.
  virtual int64_t router_stats_numel() const { return 0; }
  virtual Tensor router_stats_forward(const Tensor& /*in*/, bool /*last*/) { return Tensor(); }
  virtual Tensor router_stats_backward(const Tensor& /*in*/) { return Tensor(); }
  // pending_router_stats: the step's router statistics still on the device (f64, undefined: none), for the step's
  // one host read; take_router_stats(values): their host copy (null: the model reads them itself, one host sync).
  virtual Tensor pending_router_stats() { return Tensor(); }
  virtual RouterStepStats take_router_stats(const std::vector<double>* /*values*/ = nullptr) { return {}; }
  virtual void after_step() {}
  // Bounded dropless expert parallel (models/llama/moe.h): after the step's read, whether the step must run again on
  // the same batch because rows overflowed the fixed blocks (r.dropped > 0 where the model promised dropless); when
  // true the bound was raised (and logged) and the step's gradients and statistics are not to be applied. r is
  // summed over the ranks, so every rank answers alike. step: the step's index (0-based).
  virtual bool redo_overflowed_step(int64_t /*step*/, const RouterStepStats& /*r*/) { return false; }
  // State beside the parameters that checkpoints keep (meta.json's model_state; null: none), the same on every
  // rank; load_extra_state takes it back (null: none saved) and names `file` in its errors.
  virtual nlohmann::json extra_state() const { return nullptr; }
  virtual void load_extra_state(const nlohmann::json& /*state*/, const std::string& /*file*/) {}

 protected:
  std::vector<ModelChunk> chunks_;
  std::vector<std::string> elsewhere_;          // parameter names
  std::vector<std::string> elsewhere_modules_;  // module names
};

// A stage's tensor-parallel facts: the default plan's collectives depend on nothing else.
struct TpStage {
  int tp = 1;
  bool sequence_parallel = false, loss_parallel = false;  // in effect
  int64_t micro_batches = 1;                              // forwards and backwards in the step
  int64_t layers = 0;                                     // decoder layers on the stage
  int64_t sparse_layers = 0;                              // of them, MoE layers (their sparse block replicated)
  bool first = true, last = true;                         // the stage holds the embedding; the output projection
  int64_t micro = 1, tokens = 1;                          // B, and this rank's tokens of each sequence
  double elem = 4;                                        // bytes of an activation element
};

// One model key in Hugging Face's config.json: its name there ("model.dim", "hidden_size"; a section's keys are
// the section's name and theirs: "model.rope_scaling.factor", "rope_scaling.factor"), and its value there when
// that is not the key's own (head_dim: the head size; sliding_window: null for none).
struct HfName {
  const char* key;
  const char* hf;
  nlohmann::json (*value)(const ModelConfig& c) = nullptr;
};

// A tensor of a family's Hugging Face files that is several of its parameters concatenated along dim 0 (Phi-3's
// self_attn.qkv_proj.weight: q_proj, k_proj, v_proj): names relative to the module holding them. Split on load,
// joined on save (runtime/train/fused_tensors.h), so the parameters stay separate and tp splits each.
struct FusedWeight {
  const char* file;
  std::vector<const char*> parts;
};

// One family, registered once: a designated initialiser in its architecture's file (models/llama/families.cpp:
// {.type = "llama", .architecture = ...}), whose list of families the registry (models/model.cpp) asks for once.
// Every function is required.
struct ModelFamily {
  std::string type;          // model.type, and Hugging Face's model_type
  std::string architecture;  // Hugging Face's architectures[0] ("LlamaForCausalLM")
  bool experts = false;      // a mixture of experts: model.moe.n_experts >= 1 (a dense family's is 0)
  std::string layers;        // the decoder layers' module pattern (style.h's): what whole-layer recompute matches
  std::unique_ptr<CausalLM> (*build)(const ModelConfig& c, const ParamFactory& f);
  // The family's parallelisms composed (tp, cp, recompute, fully_shard) after checking that the sequence and the
  // heads split; then deferred parameters (ParamFactory::deferred) are materialized in their final layout. The
  // returned state (null without dp_shard) must outlive the model's forward and backward calls.
  std::unique_ptr<FullyShard> (*parallelize)(CausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                             const ParallelConfig& p, int64_t seq_len, DType reduce_dtype);
  // The default tensor-parallel plan (parallel.tp_plan replaces it).
  ParallelPlan (*tp_plan)(bool sequence_parallel, bool loss_parallel);
  // The default plan's collectives on one rank in a step of a stage (comm_bytes.h), for `estimate` and `plan`.
  std::vector<CommBytes> (*tp_step_bytes)(const ModelConfig& c, const TpStage& s);
  // Model FLOPs per token (6 N + attention, the PaLM count) and parameter counts.
  double (*flops_per_token)(const ModelConfig& c, int64_t seq_len);
  int64_t (*num_params)(const ModelConfig& c, bool with_embeddings);
  // The parameters a token runs through (an MoE layer's k experts, not all): num_params for a dense model.
  int64_t (*active_params)(const ModelConfig& c, bool with_embeddings);
  // The family's own rules beyond the model section's (model_config.h), as config errors naming the key.
  // seq_len: training.seq_len.
  void (*check)(const ModelConfig& c, int64_t seq_len);
  // Hugging Face's config.json: the model keys the architecture stores there, each named once (write_hf writes
  // them, read_hf reads them by these names, hf_key names them in messages); write_hf gives the whole file's
  // keys of this architecture (the caller adds dtype and token ids), read_hf the model of such a file (file: for
  // messages), refusing a key meshtrain does not implement, naming it.
  std::vector<HfName> hf_names;
  nlohmann::json (*write_hf)(const ModelFamily& f, const ModelConfig& c);
  ModelConfig (*read_hf)(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
  // The tensors its files hold fused (empty: every parameter is a tensor of its own name).
  std::vector<FusedWeight> fused_weights;

  nlohmann::json to_hf(const ModelConfig& c) const { return write_hf(*this, c); }
  ModelConfig from_hf(const nlohmann::json& j, const std::string& file) const { return read_hf(*this, j, file); }
  // The config.json name of a model key ("model.dim" -> "hidden_size"); the key itself when the file has none.
  std::string hf_key(const std::string& key) const;
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
