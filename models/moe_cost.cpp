// The collectives of a mixture-of-experts model's sparse layers (moe_cost.h: moe_step_bytes), next to the counters'
// convention (comm/comm_counters.h): an all-to-all-v counts the bytes a rank sends to the other ranks (exact
// dropless: uniform routing's share here), an all-to-all (n-1)/n of its input (fixed blocks: exact), an all-reduce
// 2 (n-1)/n of its buffer. models/llama/moe.cpp issues them: per sparse layer and micro-batch, in forward the counts (E i32) and the rows there and back, in backward the
// gradients there and back; once a micro-batch the balance loss's statistics over the loss group.
#include <algorithm>
#include <cmath>

#include "models/moe_cost.h"
#include "parallel/parallel_dims.h"

namespace mt {

int64_t moe_sparse_layers(const ModelConfig& c) {
  int64_t n = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) n += c.moe.sparse_layer(i);
  return n;
}

MoeLayerBytes moe_layer_bytes(const ModelConfig& c, int ep, int64_t micro, int64_t tokens, double elem) {
  const MoeConfig& m = c.moe;
  MoeLayerBytes b;
  if (!m.enabled()) return b;
  const double N = double(micro) * double(tokens), K = double(m.experts_per_token), E = double(m.n_experts);
  b.rows = N * K;
  // A capacity keeps at most ceil(factor N K / E) rows an expert (of this rank's tokens, models/llama/moe.cpp).
  if (m.capacity_factor > 0) b.rows = std::min(b.rows, E * std::max(1.0, std::ceil(m.capacity_factor * N * K / E)));
  if (ep <= 1) return b;
  // Expert parallel in fixed blocks, E of cap rows whatever the routing (padding included: the all-to-all's input):
  // with a capacity, and dropless with a bound (model.moe.dropless_bound > 0: cap from its starting factor, at
  // most N; a step that overflows it runs again, which the estimate does not count).
  if (m.capacity_factor > 0) b.rows = E * std::max(1.0, std::ceil(m.capacity_factor * N * K / E));
  else if (m.dropless_bound > 0)
    b.rows = E * std::min(std::max(N, 1.0), std::max(1.0, std::ceil(m.dropless_bound * N * K / E)));
  const double f = double(ep - 1) / double(ep);
  b.rows_out = b.rows * f;
  b.exchange = b.rows_out * double(c.dim) * elem;
  b.counts = E * 4 * f;  // i32 counts (moe_route's)
  return b;
}

std::vector<CommBytes> moe_step_bytes(const ModelConfig& c, const MoeStage& s) {
  std::vector<CommBytes> out;
  if (!c.moe.enabled()) return out;
  const int64_t m = s.micro_batches, L = s.sparse_layers, R = s.sparse_recomputed;
  if (s.ep > 1 && L > 0) {
    const MoeLayerBytes b = moe_layer_bytes(c, s.ep, s.micro, s.tokens, s.elem);
    // Forward: rows there and outputs back; backward: gradients there and back, and a recomputed layer's
    // forward again.
    const int64_t exchanges = m * (4 * L + 2 * R), counts = m * (L + R);
    out.push_back({kMoeCountsTag, dim::ep, "all_to_all", double(counts) * b.counts, counts, false});
    out.push_back({kMoeDispatchTag, dim::ep, "all_to_all", double(exchanges) * b.exchange, exchanges, false});
  }
  if (s.loss_ranks > 1) {
    // (n_sparse E counts, E prob sums, rows, dropped) f64, the whole model's sparse layers; a stage without sparse
    // layers (pp) sums its zeros too.
    const double n = double(s.loss_ranks);
    const double buf = double(moe_sparse_layers(c) * c.moe.n_experts + c.moe.n_experts + 2) * 8;
    // Issued non-blocking after the forward (MoeContext::start_sum), waited for in the backward.
    out.push_back({kMoeStatsTag, dim::loss, "all_reduce", double(m) * 2 * buf * (n - 1) / n, m, true});
  }
  return out;
}

}  // namespace mt
