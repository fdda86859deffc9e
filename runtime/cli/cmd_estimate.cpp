// `meshtrain estimate`: what a run of the config would take on --world N ranks of a cluster (runtime/train/
// estimate.h), computed by one process; `--calibrate` measures this machine into a cluster file instead
// (runtime/planner/cluster.h), on the ranks it is launched with.
#include "runtime/cli/command.h"
#include <CLI/CLI.hpp>
#include <string>

#include <cstdio>
#include <fstream>

#include "runtime/core/error.h"
#include "runtime/train/agree.h"
#include "runtime/planner/cluster.h"
#include "runtime/planner/estimate.h"

namespace mt {

struct EstimateArgs {
  int world = 0;        // --world N
  std::string cluster;  // --cluster FILE (empty: no time)
  std::string json;     // --json FILE
  bool calibrate = false;
  bool rank_floor = false;  // --rank-floor (hidden): an idle rank's memory, for tests/cli/test_estimate_sweep.sh
  bool quick = false;  // --quick: --calibrate with smaller problems and fewer repetitions (tests; figures rough)
  std::string out = "configs/clusters/this_machine.yaml";  // --calibrate's output
  std::string links_from;                                  // --links-from FILE (one rank: links not measured)
};


void add_estimate_options(CLI::App* sub, EstimateArgs& a) {
  sub->add_option("--world", a.world, "the ranks to estimate for (any number: no rank is started)");
  sub->add_option("--cluster", a.cluster, "cluster description (configs/clusters/*.yaml): without it, no time");
  sub->add_option("--json", a.json, "also write the estimate as JSON to this file");
  sub->add_flag("--calibrate", a.calibrate,
                "measure this machine (GEMM, attention, memory and collective rates on the ranks launched) into --out");
  sub->add_option("--out", a.out, "--calibrate's cluster file");
  sub->add_option("--links-from", a.links_from,
                  "--calibrate: take the node and network links from this cluster file instead of measuring them "
                  "(a machine of one device, one rank: no link to measure)");
  sub->add_flag("--rank-floor", a.rank_floor,
                "print {\"rank_floor_mib\": X}: the ranks' most resident memory after MPI init (what --calibrate "
                "writes as rank_floor_mb) and nothing else")
      ->group("");
  sub->add_flag("--quick", a.quick, "--calibrate with small problems and few repetitions (seconds; rough figures, for tests)");
}

int run_estimate_command(const RunContext& ctx, const EstimateArgs& a) {
  if (a.calibrate) {
    CalibrateOptions o;
    o.quick = a.quick;
    o.links_from = a.links_from;
    return run_calibrate(ctx, a.out, o);
  }
  if (a.rank_floor) {
    const double mib = rank_floor_mib();
    if (ctx.env->rank() == 0) std::printf("{\"rank_floor_mib\": %.3f}\n", mib);
    return 0;
  }
  MT_CHECK(!a.quick, "estimate", "--quick is an option of --calibrate (this is not a calibration)");
  // One process computes; on a launch of several ranks the others only agree on the errors.
  Estimate e;
  run_agreed(*ctx.env, "the estimate", [&] {
    MT_CHECK(a.world >= 1, "estimate", "--world N is required (the ranks to estimate for), got {}", a.world);
    if (!a.json.empty()) {  // before the work: an unwritable output is an error, not a lost result
      std::ofstream probe(a.json, std::ios::app);
      MT_CHECK(probe.good(), "estimate", "--json {}: cannot be written", a.json);
    }
    std::optional<ClusterSpec> cluster;
    if (!a.cluster.empty()) cluster = load_cluster(a.cluster);
    e = estimate_run(ctx.config, a.world, cluster);
  });
  if (ctx.env->rank() != 0) return 0;
  std::fputs(estimate_table(e).c_str(), stdout);
  if (!a.json.empty()) {
    std::ofstream out(a.json);
    out << estimate_json(e).dump(2) << "\n";
    MT_CHECK(out.good(), "estimate", "--json {}: writing failed", a.json);
  }
  return 0;
}

Command estimate_command() {
  return command_with<EstimateArgs>("estimate", "memory, bytes and step time per rank of the config on --world N ranks of a --cluster, no ranks needed",
      add_estimate_options, run_estimate_command);
}

}  // namespace mt
