// Activation recompute by module-path pattern (torchtitan's activation checkpointing, without autograd):
// a recomputed module keeps only its input in forward, releases what its subtree saved for backward
// (Module::drop_saved), and runs its forward again inside backward (Module::call / call_backward).
// Kernels are deterministic and the second forward sees the same input, parameters and sequence context,
// so losses and gradients are bit-identical to no recompute.
//
// What may be recomputed and what a `keep` entry means are the model's business: the model passes a
// RecomputePolicy (models/llama/parallelize.cpp has Llama's).
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "parallel/module.h"

namespace mt {

// parallel.recompute in the config.
struct RecomputeOptions {
  std::vector<std::string> patterns;  // module paths ('*' one segment, '**' any number); empty: off
  int every = 1;                      // every N-th matched module in forward order (1: all of them)
  std::vector<std::string> keep;      // what a recomputed module keeps besides its input (policy's names)
};

struct RecomputePolicy {
  // Module types recompute may be set on: those their parents call through Module::call (a fused variant,
  // such as RMSNorm::call_add, bypasses the recompute machinery).
  std::vector<std::string> types;
  // A keep entry (parallel.recompute.keep: "attention"): which modules of a recomputed subtree it concerns,
  // and what it sets on them. An entry that concerns no module of any recomputed subtree is an error.
  struct Keep {
    std::function<bool(const Module&)> applies;
    std::function<void(Module&)> apply;
  };
  std::map<std::string, Keep> keep;
};

// Marks the matched modules (Module::recompute) and applies the keep entries to their subtrees. Checked
// before anything changes: every pattern must match some module (errors name the pattern), every matched
// module must be of a policy type (errors name the pattern, the module and its type), every >= 1, keep
// entries known to the policy and each applying to some module, and no recomputed module inside another
// (it would run forward three times). Patterns match in the tree's depth-first order, which is forward
// order for a model whose children run in the order they were added; every = N takes the N-th, 2N-th, ...
// of the matched modules (torchtitan's selective layer checkpointing). Returns the modules marked.
std::vector<Module*> apply_recompute(Module& root, const RecomputeOptions& options, const RecomputePolicy& policy);

}  // namespace mt
