// Llama's tensor-parallel plan (torchtitan's) and the function that applies
// the plan of a run (the default or parallel.tp_plan) to the model.
#pragma once
#include "models/llama/llama.h"
#include "parallel/style.h"

namespace mt {

// embed_tokens Rowwise to Shard(1); norms SequenceParallel; attention and MLP inputs
// PrepareModuleInput Shard(1) -> Replicate; q/k/v and gate/up Colwise; o and down
// Rowwise to Shard(1); lm_head Colwise from Shard(1), to Shard(-1) under loss parallel.
// Without sequence parallel the activations between blocks stay Replicate.
ParallelPlan llama_tp_plan(bool sequence_parallel, bool loss_parallel);
// parallel.tp_plan entries as styles; errors name the entry and the key.
ParallelPlan plan_from_config(const std::vector<TpPlanEntryConfig>& entries);
// "Shard(1)", "S(-1)", "Replicate", "R", "Partial", "P"
Placement parse_tp_placement(const std::string& text, const std::string& key);

// Checks what the plan needs of the sizes (heads divisible by tp, the sequence by tp
// under sequence parallel), then parallelizes the model over the mesh's "tp" dim.
void parallelize_llama(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelConfig& p, int64_t seq_len);

}  // namespace mt
