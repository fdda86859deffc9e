// meshtrain: one binary, launched with mpirun or srun, one rank per GPU.
//   meshtrain [--config FILE] [--set key=value ...] [--log-level L] <subcommand> ...
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "comm/watchdog.h"
#include "runtime/core/log.h"
#include "runtime/train/cli.h"
#include "runtime/train/cmd_check.h"
#include "runtime/train/cmd_layout.h"
#include "runtime/train/trainer.h"

namespace mt {

Config load_and_agree_config(const MpiEnv& env, const GlobalOptions& opts) {
  Config c = load_config(opts.config_path, opts.overrides);
  watchdog_set_timeout(c.comm.timeout_s);
  // First collective of the run: every rank must have read the same config.
  uint64_t h = config_hash(c);
  std::vector<uint64_t> all(size_t(env.size()));
  MT_MPI_CHECK(MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD));
  std::string differ;
  for (int r = 0; r < env.size(); ++r)
    if (all[size_t(r)] != all[0]) differ += (differ.empty() ? "" : ",") + std::to_string(r);
  MT_CHECK(differ.empty(), "config",
           "ranks {} read a different config than rank 0 (hash {:016x} vs {:016x}): is the file the same on every "
           "node, and are the --set overrides the same on every rank?",
           differ, all[0], h);
  return c;
}

Device rank_device(const MpiEnv& env, const std::string& device_name) {
  if (device_name == "cpu") return Device::cpu();
  MT_CHECK(env.cuda_device() >= 0, "config",
           "comm.device = {} but {} (rank {} on {})", device_name,
           cuda_built() ? "no CUDA device is visible" : "meshtrain was built without CUDA", env.rank(), env.host());
  return Device::cuda(env.cuda_device());
}

}  // namespace mt

int main(int argc, char** argv) {
  mt::MpiEnv env(&argc, &argv);
  mt::init_logging(env.rank());

  CLI::App app{"meshtrain: train Llama-family models on a device mesh built from MPI ranks"};
  app.require_subcommand(1);
  mt::GlobalOptions g;
  app.add_option("-c,--config", g.config_path, "YAML config file");
  app.add_option("--set", g.overrides, "override a config key: --set comm.timeout_s=30 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--log-level", g.log_level, "trace, debug, info, warn, error or off");

  mt::CheckArgs check_args;
  auto* check = app.add_subcommand("check", "self-check: run and verify every collective on every mesh dim, timed");
  mt::add_check_options(check, check_args);
  mt::LayoutArgs layout_args;
  auto* layout = app.add_subcommand("layout", "print the local shards of a layout and the plan between two layouts");
  mt::add_layout_options(layout, layout_args);
  auto* train = app.add_subcommand("train", "train the model of the config on its data (checkpoints, metrics, samples)");
  mt::GenerateArgs generate_args;
  auto* plan = app.add_subcommand("plan", "print the parallel plan applied: parameter and activation layouts, bytes per step");
  auto* generate = app.add_subcommand("generate", "sample a continuation of a prompt from a checkpoint");
  mt::add_generate_options(generate, generate_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same arguments, so only rank 0 needs to talk.
    int code = env.rank() == 0 ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : 2);
    return code;
  }

  try {
    if (!g.log_level.empty()) mt::init_logging(env.rank(), g.log_level);
    mt::RunContext ctx{&env, g, mt::load_and_agree_config(env, g)};
    if (ctx.config.log.level != "" && g.log_level.empty()) mt::init_logging(env.rank(), ctx.config.log.level);
    if (*check) return mt::run_check_command(ctx, check_args);
    if (*layout) return mt::run_layout_command(ctx, layout_args);
    if (*train) return mt::run_train_command(ctx);
    if (*plan) return mt::run_plan_command(ctx);
    if (*generate) return mt::run_generate_command(ctx, generate_args);
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    spdlog::default_logger()->flush();
    // The other ranks may already wait in a collective: end the whole job now
    // rather than let them hang until the timeout.
    if (env.size() > 1) mt::abort_job(fmt::format("meshtrain: rank {} failed, aborting the job", env.rank()), 1);
    return 1;
  }
  return 0;
}
