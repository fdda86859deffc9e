// Mixture of experts (model.moe): the collectives of a stage's sparse layers on one rank in a step, for `estimate`
// and `plan` (models/moe_cost.cpp), and the tags models/llama/moe.cpp counts them under: the rows' all-to-all-v
// (there and back), the counts' all-to-all, and the balance loss's statistics' all-reduce.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm_bytes.h"
#include "models/model_config.h"

namespace mt {

inline constexpr const char* kMoeDispatchTag = "moe.dispatch";
inline constexpr const char* kMoeCountsTag = "moe.counts";
inline constexpr const char* kMoeStatsTag = "moe.stats";

struct MoeStage {
  int ep = 1;                     // the experts' ranks
  int loss_ranks = 1;             // the ranks holding the micro-batch's other tokens (the statistics' all-reduce)
  int64_t micro_batches = 1;      // forwards and backwards in the step
  int64_t sparse_layers = 0;      // MoE layers on the stage
  int64_t sparse_recomputed = 0;  // of them, recomputed (their forward's exchanges again in backward)
  int64_t micro = 1, tokens = 1;  // B, and the tokens of each sequence a sparse block sees (whole per tp rank)
  double elem = 4;                // bytes of an activation element
};
// One sparse layer's exchange in one micro-batch on one rank under uniform routing: M = B T k rows leave for the
// experts (capacity_factor caps them; under ep with a capacity or model.moe.dropless_bound, E blocks of cap rows
// whatever the routing, padding included), (ep-1)/ep of them to other ranks, C elements each; each all-to-all-v
// (rows there, outputs back; the same two in backward) sends rows_out x C x elem bytes; the counts: E i32.
struct MoeLayerBytes {
  double rows = 0;      // M: rows routed from this rank's tokens (kept after the capacity)
  double rows_out = 0;  // M (ep-1)/ep: of them, to other ranks
  double exchange = 0;  // bytes of one all-to-all-v: rows_out x C x elem
  double counts = 0;    // bytes of the counts' all-to-all: E x 4 x (ep-1)/ep
};
MoeLayerBytes moe_layer_bytes(const ModelConfig& c, int ep, int64_t micro, int64_t tokens, double elem);
// Per step: forward 2 exchanges + the counts, backward 2 exchanges (+ the forward's again when recomputed), per
// sparse layer and micro-batch; the statistics (n_sparse E + E + 2 f64) once a micro-batch over the loss ranks.
std::vector<CommBytes> moe_step_bytes(const ModelConfig& c, const MoeStage& s);
// The MoE layers of the model (0: dense).
int64_t moe_sparse_layers(const ModelConfig& c);

}  // namespace mt
