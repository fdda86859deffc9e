// meshtrain check: the cluster self-check (comm/self_check.h) on every mesh dim and on the flattened groups, on
// the mesh of --mesh or of the config's parallel dims: every collective verified against values computed without
// communication and timed, beside the bare MPI call on the same buffers.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "comm/self_check.h"
#include "comm/world.h"
#include "parallel/parallel_dims.h"
#include "runtime/cli/command.h"
#include "runtime/train/agree.h"

namespace mt {

struct CheckArgs {
  std::string mesh;  // "dp_shard=2,cp=2,tp=2"; empty: from the config
  std::string sizes = "1K:64M";
  int iters = 20;
  int warmup = 3;
  std::string device;            // cpu | cuda; empty: comm.device
  std::string backend;           // auto | mpi | nccl; empty: comm.backend
  std::vector<std::string> ops;  // empty: all
  bool compare_mpi = true;       // time bare MPI beside ours (host buffers)
  std::string json;              // write the results as JSON lines here (rank 0)
};

namespace {

// The mesh and the check's options from the command line (--mesh, else the config's parallel dims): the same on
// every rank, so an error in them is printed once.
struct CheckPlan {
  std::vector<MeshDim> dims;
  std::vector<MeshGroupName> groups;  // the training mesh's named groups (none with --mesh)
  SelfCheckOptions opt;
};
CheckPlan check_plan(const MpiEnv& env, const Config& cfg, const CheckArgs& args) {
  CheckPlan plan;
  run_agreed(env, "the check options", [&] {
    const std::vector<std::string>& known = self_check_ops();
    for (auto& op : args.ops)
      MT_CHECK(std::find(known.begin(), known.end(), op) != known.end(), "check",
               "unknown op '{}' in --ops (expected some of all_reduce, all_gather, reduce_scatter, all_to_all, "
               "broadcast, ring_shift, barrier)",
               op);
    plan.opt.sizes = parse_size_range(args.sizes);
    if (!args.mesh.empty()) {
      plan.dims = parse_mesh_spec(args.mesh, env.size());
    } else {
      // The training mesh's dims of size > 1 and its named groups (dp, cp, dp_cp, loss).
      const ParallelDims pd = ParallelDims::from_config(cfg.parallel, env.size());
      for (const MeshDim& d : pd.mesh_dims())
        if (d.size > 1) plan.dims.push_back(d);
      if (plan.dims.empty()) plan.dims.push_back({dim::dp_replicate, 1});
      plan.groups = pd.group_names();
    }
  });
  plan.opt.ops = args.ops.empty() ? self_check_ops() : args.ops;
  plan.opt.iters = args.iters, plan.opt.warmup = args.warmup, plan.opt.compare_mpi = args.compare_mpi;
  return plan;
}

void add_check_options(CLI::App* sub, CheckArgs& a) {
  sub->add_option("--mesh", a.mesh, "mesh dims, e.g. dp_shard=2,cp=2,tp=2 (one size may be -1); default: config");
  sub->add_option("--sizes", a.sizes, "buffer sizes MIN:MAX (x2 steps) or one size, e.g. 1K:64M")
      ->capture_default_str();
  sub->add_option("--iters", a.iters, "timed repetitions per size (median reported)")
      ->check(whole_number(1))
      ->capture_default_str();
  sub->add_option("--warmup", a.warmup, "untimed repetitions first")->check(whole_number(0))->capture_default_str();
  sub->add_option("--device", a.device, "cpu or cuda (default: comm.device)");
  sub->add_option("--backend", a.backend, "auto, mpi or nccl (default: comm.backend)");
  sub->add_option("--ops", a.ops, "collectives to run (default: all)")->delimiter(',');
  sub->add_flag("!--no-compare-mpi", a.compare_mpi, "do not time the bare MPI calls beside ours");
  sub->add_option("--json", a.json, "also write one JSON object per result line to this file");
}

int run_check_command(const RunContext& ctx, const CheckArgs& args) {
  const MpiEnv& env = *ctx.env;
  const Config& cfg = ctx.config;
  CheckPlan plan = check_plan(env, cfg, args);
  MeshOptions mo;
  mo.device = rank_device(env, args.device.empty() ? cfg.comm.device : args.device);
  mo.backend = args.backend.empty() ? cfg.comm.backend : args.backend;
  mo.group_names = plan.groups;
  DeviceMesh mesh = DeviceMesh::create(plan.dims, mo);
  std::string table = mesh.table();
  if (env.rank() == 0) std::printf("%s\n", table.c_str());
  std::vector<Group*> groups = self_check_groups(mesh, plan.groups);
  std::ofstream json;
  if (env.rank() == 0 && !args.json.empty()) {
    json.open(args.json);
    MT_CHECK(json.good(), "check", "cannot write --json file '{}'", args.json);
    plan.opt.json = &json;
  }
  const int64_t failures = run_self_check(groups, mo.device, plan.opt);
  const int64_t total = world::all_reduce(failures, ReduceOp::sum, "check failure count");
  if (env.rank() == 0)
    std::printf("\ncheck %s: %lld wrong result(s) over %zu group(s)\n", total ? "FAILED" : "passed", (long long)total,
                groups.size());
  return total ? 1 : 0;
}

}  // namespace

Command check_command() {
  return command_with<CheckArgs>("check", "self-check: run and verify every collective on every mesh dim, timed",
                                 add_check_options, run_check_command);
}

}  // namespace mt
