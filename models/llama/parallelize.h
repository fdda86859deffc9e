// Llama's tensor-parallel plan (torchtitan's) and the function that applies
// the plan of a run (the default or parallel.tp_plan) to the model.
#pragma once
#include "models/llama/llama.h"
#include "parallel/fully_shard.h"
#include "parallel/parallel_dims.h"
#include "parallel/recompute.h"
#include "parallel/style.h"

namespace mt {

// embed_tokens Rowwise to Shard(1); norms SequenceParallel; attention and MLP inputs
// PrepareModuleInput Shard(1) -> Replicate; q/k/v and gate/up Colwise; o and down
// Rowwise to Shard(1); lm_head Colwise from Shard(1), to Shard(-1) under loss parallel.
// Without sequence parallel the activations between blocks stay Replicate.
ParallelPlan llama_tp_plan(bool sequence_parallel, bool loss_parallel);
// The default plan's collectives on one rank in a step (style.cpp's hooks on the stage's modules), each moving
// (tp-1)/tp of a (b, T, d) activation. With sequence parallel, Megatron's count: around each layer's attention and
// MLP an all-gather in (a reduce-scatter of its gradient back) and a reduce-scatter out (an all-gather back), plus
// the embedding's reduce-scatter and lm_head's all-gather; without, all-reduces after o_proj, down_proj and the
// embedding in forward and of the input gradients of q, k, v, gate, up and lm_head in backward. Without loss
// parallel the logits are all-gathered too.
std::vector<CommBytes> llama_tp_step_bytes(const ModelConfig& c, const TpStage& s);

// The default plan for this model: Llama's, with Qwen3's q/k norms, and an MoE model's dense MLP entries named per
// dense layer.
ParallelPlan llama_variant_tp_plan(const LlamaForCausalLM& model, bool sequence_parallel, bool loss_parallel);
// Mixture of experts: the balance loss's statistics summed over the loss group; under expert parallel each rank
// keeps its experts (Shard(0) of the stacked weights over ep, gradients not summed over ep) and rows go to them
// by all-to-all; under tensor parallel the sparse blocks run replicated (gathered in, sliced out under sequence
// parallel). A dense model with parallel.ep > 1 is refused.
void apply_moe(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd);
// Tensor (and sequence) parallel over the mesh's tp dim: heads must divide by tp; the plan is
// parallel.tp_plan (read by parallel/plan_yaml.h) or the model's default.
void apply_tp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd, const ParallelConfig& p);
// Context parallel: every attention layer's implementation is swapped (attention/attention.h) for ring or
// all_gather over cp_ring, Ulysses over cp_ulysses, or both (2-D); the trainer feeds each rank its tokens and
// their positions (cp_shard).
void apply_cp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd, int64_t seq_len);
// Activation recompute (parallel.recompute): the matched blocks (decoder layers, their self_attn or mlp, or the
// whole model.model) keep only their input in forward and run forward again inside backward; keep: [attention]
// makes the attention layers inside them keep their output and log-sum-exp, so the attention kernel (and with
// cp its communication) is not repeated. Returns the recomputed modules.
std::vector<Module*> apply_recompute_llama(LlamaForCausalLM& model, const RecomputeConfig& c);
// Fully sharded data parallel over dp_shard (parallel.fsdp; null when dp_shard is 1): the returned state must
// outlive the model's forward and backward calls.
std::unique_ptr<FullyShard> apply_fsdp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                       const FsdpConfig& c, DType reduce_dtype);
// The model's parallelisms composed (tp, cp, recompute, fsdp), after checking that seq_len splits over cp and tp
// and the heads over tp and cp_ulysses; then deferred parameters (ParamFactory::deferred) are materialized in
// their final layout.
std::unique_ptr<FullyShard> parallelize_llama(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                              const ParallelConfig& p, int64_t seq_len,
                                              DType reduce_dtype = DType::f32);

}  // namespace mt
