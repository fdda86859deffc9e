// `meshtrain plan`: the parallel plan of a config applied, without training (runtime/planner/plan_report.h):
// every parameter's placements and local shape on each rank, every module's layout hooks, and the bytes one step
// communicates per rank, measured beside each parallelism's analytic count. --search: the fastest plans that fit,
// by `meshtrain estimate` (runtime/planner/plan_search.h), one process.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <thread>

#include "runtime/cli/command.h"
#include "runtime/planner/cluster.h"
#include "runtime/planner/plan_report.h"
#include "runtime/planner/plan_search.h"
#include "runtime/train/agree.h"
#include "runtime/train/run.h"

namespace mt {

namespace {

struct PlanArgs {
  bool search = false;
  bool keep_pp = false;  // --keep-pp
  int world = 0;
  std::string cluster;
  int top = 5;
};

void add_plan_options(CLI::App* plan, PlanArgs& a) {
  auto* search_flag =
      plan->add_flag("--search", a.search,
                     "list the fastest plans that fit on --world N ranks of --cluster (pp, tp, cp, dp and recompute)");
  plan->add_flag("--keep-pp", a.keep_pp,
                 "--search: keep parallel.pp, its schedule and training.micro_batch_size as the config sets them")
      ->needs(search_flag);
  plan->add_option("--world", a.world, "--search: the ranks to plan for");
  plan->add_option("--cluster", a.cluster, "--search: the cluster description (configs/clusters/*.yaml)");
  plan->add_option("--top", a.top, "--search: how many plans to show");
}

// --search: every rank searches (so that they agree on errors), rank 0 prints the table.
int run_plan_search(RunContext& ctx, const PlanArgs& args) {
  const Config& cfg = ctx.config;
  std::string table;
  run_agreed(*ctx.env, "plan --search", [&] {
    MT_CHECK(args.world >= 1, "plan", "--search needs --world N (the ranks to plan for), got {}", args.world);
    MT_CHECK(!args.cluster.empty(), "plan", "--search needs --cluster FILE (configs/clusters/*.yaml)");
    MT_CHECK(args.top >= 1, "plan", "--search --top {}: expected the number of plans to show, at least 1", args.top);
    const ClusterSpec cluster = load_cluster(args.cluster);
    // Ranks on one node share its cores: each estimates on its share (every rank searches, to agree on errors).
    PlanSearchOptions opt;
    opt.keep_pp = args.keep_pp;
    opt.threads = std::max(1, int(std::thread::hardware_concurrency()) / std::max(1, ctx.env->local_size()));
    const PlanSearch found = search_plans(cfg, args.world, cluster, opt);
    table = plan_search_table(found, cluster, args.top);
    // Nothing fits: an error (every rank exits non-zero) that says what would make a plan fit.
    MT_CHECK(!found.ranked.empty(), "plan",
             "--search: no plan of model.dim = {}, model.n_layers = {}, "
             "training.seq_len = {} fits on --world {} of {} ({}):\n{}",
             cfg.model.dim, cfg.model.n_layers, cfg.training.seq_len, args.world, cluster.name, args.cluster, table);
  });
  if (ctx.env->rank() == 0) std::fputs(table.c_str(), stdout);
  return 0;
}

int run_plan_command(RunContext& ctx, const PlanArgs& args) {
  if (args.search) return run_plan_search(ctx, args);
  TrainRun run = make_train_run(ctx.config, *ctx.env, false);
  const bool root = ctx.env->rank() == 0;
  if (root) print_plan_layouts(run);
  const MeasuredStep step = measure_plan_step(run);
  if (root) print_plan_bytes(run, step);
  return 0;
}

}  // namespace

Command plan_command() {
  return command_with<PlanArgs>("plan",
                                "print the parallel plan applied: parameter and activation layouts, bytes per step",
                                add_plan_options, run_plan_command);
}

}  // namespace mt
