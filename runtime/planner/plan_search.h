// `meshtrain plan --search --world N --cluster c.yaml`: the plans of the config's model and batch on N
// ranks that fit in a rank's memory, fastest first by `meshtrain estimate`'s step time. A plan: dp_replicate x
// dp_shard x cp x tp (tp inside a node), the cp method, sequence parallel on or off, the recompute policy (none,
// full, selective: attention kept) and fully_shard's reshard_after_forward, under each pipeline: pp = 1 or a
// stage count dividing the world with 1f1b and interleaved_1f1b (2 chunks a rank), the micro-batch the config's
// where it leaves pp micro-batches, else the largest that does (`--keep-pp`: pp as the config says).
// Each candidate is the config with those keys set, estimated by estimate_run: a plan train would refuse (heads or
// the sequence that do not split, a batch that does not divide) is left out, counted by its reason.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "runtime/planner/estimate.h"

namespace mt {

struct PlanCandidate {
  std::string label;                  // "dp_shard=4 x tp=2 (sequence parallel), recompute full"
  std::vector<std::string> overrides;  // the --set arguments that make it ("parallel.tp=2", ...)
  Estimate estimate;
  double peak_bytes = 0;  // the largest stage's
  bool fits = false;
};

struct PlanSearch {
  std::vector<PlanCandidate> ranked;  // the plans that fit, fastest first
  int64_t tried = 0, too_large = 0;
  int64_t pruned = 0;  // of too_large: known from a plan of the same mesh that needs less memory, not estimated
  int threads = 1;     // the threads that estimated
  std::map<std::string, int64_t> refused;  // train's refusal (first words) -> plans
  double smallest_peak = 0;                // when nothing fits: the least memory any plan needs
  std::vector<std::string> advice;         // when nothing fits: what would make a plan fit
};

struct PlanSearchOptions {
  bool keep_pp = false;  // parallel.pp, its schedule and the micro-batch size as the config sets them
  bool prune = true;     // skip the plans a smaller plan of the same mesh shows too large (false: estimate all)
  int threads = 0;       // estimating at once; 0: the machine's hardware threads
};
PlanSearch search_plans(const Config& cfg, int world, const ClusterSpec& cluster, const PlanSearchOptions& opt = {});
// The top `top` plans with why (memory headroom, exposed communication, the largest cost), or what would make one fit.
std::string plan_search_table(const PlanSearch& s, const ClusterSpec& cluster, int top);

}  // namespace mt
