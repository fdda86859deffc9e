// The redistribution planner: a path of single-mesh-dim transitions from one
// layout to another. States are (placements, shard order); the six kinds of
// step (StepKind) each change one mesh dim's placement. Unlike DTensor's fixed
// weights, a step costs the bytes each rank sends in it (from the logical
// shape at that step) divided by the link bandwidth of its mesh dim, plus a
// fixed latency per collective; local steps cost nothing.
#pragma once
#include <string>
#include <vector>

#include "parallel/placement.h"

namespace mt {

enum class StepKind {
  all_gather,      // S(a) -> R
  all_reduce,      // P -> R
  reduce_scatter,  // P -> S(a)
  all_to_all,      // S(a) -> S(b)
  local_chunk,     // R -> S(a): keep this rank's chunk
  local_partial,   // R -> P: sum divides by the mesh dim size, avg/max/min keep the value
};
std::string_view step_kind_name(StepKind k);

struct PlanStep {
  int mesh_dim = 0;
  StepKind kind = StepKind::local_chunk;
  Placement from, to;
  int64_t bytes_per_rank = 0;  // sent by each rank (the largest shard's rank)
  double cost_s = 0;
  DTensorSpec after;  // the layout once this step is done
};

struct Plan {
  DTensorSpec src, dst;
  std::vector<PlanStep> steps;
  double cost_s = 0;
  int64_t bytes_per_rank = 0;
  std::string planner;  // "min-cost" or "greedy"
  // "S(0)[0]S(0)[1] -> S(0)[0]R -> RR" and, with details, a line per step.
  std::string chain() const;
  std::string str() const;
};

// Link bandwidth per mesh dim in GB/s; empty gives the defaults: the innermost
// dim 100 GB/s (NVLink-class), each dim further out 4x slower (node-to-node).
std::vector<double> link_bandwidths(int mesh_ndim, const std::vector<double>& link_gbps);
inline constexpr double kCollectiveLatencyS = 5e-6;

// min_cost_every_dim: min-cost with every mesh dim searched, size-1 dims left in place included (for the tests that
// check the pruning against it).
enum class Planner { min_cost, greedy, min_cost_every_dim };
Planner planner_from_name(const std::string& name);  // "min-cost" | "greedy"; throws "[redistribute] ..."

// Cached by (mesh, source spec, target spec, element size, bandwidths, planner).
// Throws "[redistribute] ..." for P(x) -> P(y) on one mesh dim, or specs that
// do not describe the same tensor on the same mesh. Greedy falls back to
// min-cost when its fixed phases cannot reach the target's shard order.
const Plan& plan_redistribute(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes = 4,
                              const std::vector<double>& link_gbps = {}, Planner planner = Planner::min_cost);
Plan plan_redistribute_uncached(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes = 4,
                                const std::vector<double>& link_gbps = {}, Planner planner = Planner::min_cost);
void clear_plan_cache();
size_t plan_cache_size();

// Every step the planner may take from `state` toward `target` (exposed for
// the brute-force check in the tests); none on the mesh dims `still` marks (empty: every dim moves).
std::vector<PlanStep> next_steps(const DTensorSpec& state, const DTensorSpec& target, size_t elem_bytes,
                                 const std::vector<double>& gbps, const std::vector<bool>& still = {});
// Whether two specs are the same layout (placements and shard order).
bool same_layout(const DTensorSpec& a, const DTensorSpec& b);

}  // namespace mt
