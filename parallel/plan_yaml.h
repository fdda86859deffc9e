// A tensor-parallel plan written in YAML (parallel.tp_plan): each entry's style
// name and PyTorch keyword arguments into a ParallelPlan. The style types
// themselves (parallel/style.h) say which arguments they take; this file only
// parses placements and finds the type by its name.
#pragma once
#include <string>
#include <vector>

#include "parallel/style.h"
#include "runtime/io/config.h"

namespace mt {

// parallel.tp_plan entries as styles; errors name the entry and the key.
ParallelPlan plan_from_config(const std::vector<TpPlanEntryConfig>& entries);
// One placement on the plan's mesh dim in the notation of parse_placements ("S(1)", "R", "P(sum)") or
// with PyTorch's long names ("Shard(-1)", "Replicate", "Partial"); errors name `key`.
Placement parse_plan_placement(const std::string& text, const std::string& key);
// "ColwiseParallel, RowwiseParallel, ... or PrepareModuleInputOutput": the names a plan may use.
std::string style_names();

}  // namespace mt
