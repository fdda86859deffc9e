// meshtrain: one binary, launched with mpirun or srun, one rank per GPU.
//   meshtrain [--config FILE] [--set key=value ...] [--log-level L] <subcommand> ...
// The global options may also follow the subcommand: meshtrain train --config FILE --set k=v.
// Exit codes: 0 done, 1 an error, 2 a command-line error, 128 + N a training run stopped by signal N
// (after its checkpoint; 143 SIGTERM, 138 SIGUSR1, 130 SIGINT).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

#include "comm/watchdog.h"
#include "runtime/core/log.h"
#include "runtime/train/agree.h"
#include "runtime/cli/command.h"
#include "runtime/train/run_context.h"

namespace mt {

namespace {

// What to add to a command-line error: the subcommand or option a typo was probably meant to be.
// Global options are known before the subcommand; after it, its own and the global ones.
std::string command_line_hint(CLI::App& app, int argc, char** argv) {
  std::vector<std::string> subcommands;
  for (const CLI::App* sub : app.get_subcommands({})) subcommands.push_back(sub->get_name());
  auto long_names = [](const CLI::App* a, std::vector<std::string>& out) {
    for (const CLI::Option* o : a->get_options({}))
      for (const std::string& n : o->get_lnames()) out.push_back("--" + n);
  };
  std::vector<std::string> global, all;
  long_names(&app, global);
  all = global;
  for (const CLI::App* sub : app.get_subcommands({})) long_names(sub, all);
  const CLI::App* chosen = nullptr;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;  // what follows is a command of its own (meshtrain supervise -- mpirun ...)
    if (a.rfind("--", 0) == 0 && a.size() > 2) {
      std::string name = a.substr(0, a.find('='));
      if (std::find(all.begin(), all.end(), name) == all.end()) {
        std::vector<std::string> here = global;
        if (chosen) long_names(chosen, here);
        std::string best = nearest_name(name, here);
        return fmt::format("unknown option '{}'{}", name,
                           best.empty() ? "" : fmt::format("; did you mean '{}'?", best));
      }
      // A global option's value is the next argument unless given as --name=value.
      if (!chosen && a.find('=') == std::string::npos && name != "--help") ++i;
    } else if (a == "-c") {
      ++i;
    } else if (!chosen && a.rfind("-", 0) != 0) {
      for (const CLI::App* sub : app.get_subcommands({}))
        if (sub->get_name() == a) chosen = sub;
      if (!chosen) {
        std::string best = nearest_name(a, subcommands);
        return fmt::format("unknown subcommand '{}'{} (subcommands: {})", a,
                           best.empty() ? "" : fmt::format("; did you mean '{}'?", best), fmt::join(subcommands, ", "));
      }
    }
  }
  if (!chosen) return fmt::format("a subcommand is needed: {}", fmt::join(subcommands, ", "));
  return "";
}

// The global options, accepted before or after the subcommand (fallthrough), and one subcommand per row of the
// command table (runtime/cli/commands.cpp), each with the footer that names the global options.
std::vector<std::pair<CLI::App*, const Command*>> add_command_line(CLI::App& app, GlobalOptions& g) {
  app.require_subcommand(1);
  // Subcommands pass the global options on: --config, --set and --log-level work before or after the subcommand.
  app.fallthrough();
  app.add_option("-c,--config", g.config_path, "YAML config file");
  app.add_option("--set", g.overrides, "override a config key: --set comm.timeout_s=30 (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--log-level", g.log_level, "trace, debug, info, warn, error or off");
  std::vector<std::pair<CLI::App*, const Command*>> subs;
  for (const Command& c : commands()) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    c.add_options(*sub);
    subs.push_back({sub, &c});
  }
  for (CLI::App* sub : app.get_subcommands({}))
    sub->footer(
        "Global options, here or before the subcommand: -c,--config FILE, --set KEY=VALUE (repeatable), "
        "--log-level LEVEL (meshtrain --help)");
  return subs;
}

// A command line that does not parse: --help printed (exit 0), else the error and a hint (exit 2). Every rank
// parses the same arguments, so only rank 0 talks; every rank leaves with the same code.
int command_line_error(CLI::App& app, const CLI::ParseError& e, int rank, int argc, char** argv) {
  const int code = e.get_exit_code() == 0 ? 0 : 2;
  if (rank == 0) {
    if (code == 0) {
      app.exit(e);  // --help
    } else {
      std::string hint = command_line_hint(app, argc, argv);
      std::fprintf(stderr,
                   "meshtrain: %s\n%s%sRun 'meshtrain --help' (or 'meshtrain SUBCOMMAND --help') for usage.\n",
                   e.what(), hint.c_str(), hint.empty() ? "" : "\n");
    }
  }
  return code;
}

// A command outside the job's ranks (meshtrain supervise): no MPI, no config.
int run_without_mpi(const Command& chosen, const GlobalOptions& g) {
  if (chosen.needs_mpi) {  // the pre-scan took an option's value for the command's name
    std::fprintf(stderr, "meshtrain: put the subcommand '%s' before option values that look like one\n",
                 chosen.name.c_str());
    return 2;
  }
  if (!g.log_level.empty()) init_logging(0, g.log_level);
  RunContext ctx;
  ctx.opts = g;
  return chosen.run(ctx);
}

// A command on every rank of the job: --log-level agreed, then the config loaded and agreed on (unless the
// command needs none: rank 0 alone runs it).
int run_on_ranks(const Command& chosen, MpiEnv& env, const GlobalOptions& g) {
  run_agreed(env, "--log-level", [&] {
    if (!g.log_level.empty()) init_logging(env.rank(), g.log_level);
  });
  if (!chosen.needs_config) {
    // Rank 0 alone does the work: the other ranks of a launch wait at the exit barrier for as long as it takes
    // (no collective, so no timeout).
    watchdog_set_timeout(0);
    RunContext ctx;  // no config
    ctx.env = &env;
    ctx.opts = g;
    return env.rank() == 0 ? chosen.run(ctx) : 0;
  }
  RunContext ctx{&env, g, load_and_agree_config(env, g)};
  if (ctx.config.log.level != "" && g.log_level.empty()) init_logging(env.rank(), ctx.config.log.level);
  return chosen.run(ctx);
}

}  // namespace

}  // namespace mt

int main(int argc, char** argv) {
  // A command outside the job's ranks (meshtrain supervise) starts no MPI: it launches the ranks itself.
  const mt::Command* without_mpi = mt::command_without_mpi(argc, argv);
  std::optional<mt::MpiEnv> env_storage;
  if (!without_mpi) {
    mt::watchdog_set_timeout(mt::startup_timeout_s(argc, argv));
    env_storage.emplace(&argc, &argv);
  }
  const int rank = env_storage ? env_storage->rank() : 0;
  mt::init_logging(rank);

  CLI::App app{"meshtrain: train Llama-family models on a device mesh built from MPI ranks"};
  mt::GlobalOptions g;
  const auto subs = mt::add_command_line(app, g);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return mt::command_line_error(app, e, rank, argc, argv);
  }

  try {
    const mt::Command* chosen = nullptr;
    for (auto& [sub, c] : subs)
      if (sub->parsed()) chosen = c;
    if (!env_storage) return mt::run_without_mpi(*chosen, g);
    return mt::run_on_ranks(*chosen, *env_storage, g);
  } catch (const mt::ReportedError& e) {
    // Agreed on by every rank (agree.h): printed where it should be, and no rank is left in a collective.
    if (e.print) spdlog::error("{}", e.what());
    spdlog::default_logger()->flush();
    return e.code;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    spdlog::default_logger()->flush();
    // The other ranks may already wait in a collective: end the whole job now
    // rather than let them hang until the timeout.
    if (env_storage && env_storage->size() > 1)
      mt::abort_job(fmt::format("meshtrain: rank {} failed, aborting the job", rank), 1);
    return 1;
  }
  return 0;
}
