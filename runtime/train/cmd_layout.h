// meshtrain layout: where each rank's shard of a tensor lives under a layout,
// the plan to another layout (steps, collectives, bytes), and, run with as
// many ranks as the mesh has, the plan executed and checked on a tensor whose
// elements are their own global index.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/train/run_context.h"

namespace mt {

struct LayoutArgs {
  std::string mesh, shape, from, to, planner = "min-cost", dump, dtype = "f32";
};

void add_layout_options(CLI::App* sub, LayoutArgs& args);
int run_layout_command(const RunContext& ctx, const LayoutArgs& args);

}  // namespace mt
