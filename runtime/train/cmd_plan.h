// meshtrain plan: the config's parallel plan applied without training (placements,
// layout hooks, bytes per step, measured and analytic).
#pragma once
#include <string>

#include "runtime/train/run_context.h"

namespace mt {

// --search: the fastest plans that fit, by `meshtrain estimate` (runtime/train/plan_search.h), one process.
struct PlanArgs {
  bool search = false;
  bool keep_pp = false;  // --keep-pp
  int world = 0;
  std::string cluster;
  int top = 5;
};

int run_plan_command(RunContext& ctx, const PlanArgs& args = {});

}  // namespace mt
