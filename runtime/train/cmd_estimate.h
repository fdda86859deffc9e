// `meshtrain estimate`: what a run of the config would take on --world N ranks of a cluster (runtime/train/
// estimate.h), computed by one process; `--calibrate` measures this machine into a cluster file instead
// (runtime/train/cluster.h), on the ranks it is launched with.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "runtime/train/run_context.h"

namespace mt {

struct EstimateArgs {
  int world = 0;        // --world N
  std::string cluster;  // --cluster FILE (empty: no time)
  std::string json;     // --json FILE
  bool calibrate = false;
  bool quick = false;  // --quick: --calibrate with smaller problems and fewer repetitions (tests; figures rough)
  std::string out = "configs/clusters/this_machine.yaml";  // --calibrate's output
};

void add_estimate_options(CLI::App* sub, EstimateArgs& args);
int run_estimate_command(const RunContext& ctx, const EstimateArgs& args);

}  // namespace mt
