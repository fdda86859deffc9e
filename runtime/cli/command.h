// The `meshtrain` commands: one table (commands.cpp), one file per command (cmd_<name>.cpp). main() builds a
// CLI11 subcommand from each row and runs the chosen one inside the run's context; a new command is one file and
// one row.
#pragma once
#include <CLI/CLI.hpp>
#include <climits>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/train/run_context.h"

namespace mt {

struct Command {
  std::string name;  // the subcommand: meshtrain NAME
  std::string help;  // one line for `meshtrain --help`
  // false: runs on rank 0 alone without reading a config (the other ranks of a launch only wait at the exit;
  // ctx.config is empty) -- tokenize.
  bool needs_config = true;
  // Adds the command's own options to its subcommand; their values live in state the closures share.
  std::function<void(CLI::App&)> add_options;
  std::function<int(RunContext&)> run;  // the exit code
  // false: MPI is not initialised at all (ctx.env is null, no config): a process outside the job's ranks, such as
  // `meshtrain supervise`, which starts the launcher (mpirun, srun) itself.
  bool needs_mpi = true;
};

// A command whose options fill an Args value that its run reads: one value, shared by the two closures.
template <typename Args>
Command command_with(std::string name, std::string help, std::function<void(CLI::App*, Args&)> add,
                     std::function<int(RunContext&, const Args&)> run, bool needs_config = true,
                     bool needs_mpi = true) {
  auto args = std::make_shared<Args>();
  return {std::move(name), std::move(help), needs_config, [args, add](CLI::App& app) { add(&app, *args); },
          [args, run](RunContext& ctx) { return run(ctx, *args); }, needs_mpi};
}

// The checks of number options (CLI::Option::check), each error a command-line error (exit 2) that says what is
// wanted: "--max-restarts: must be an integer, got 'abc'", "--max-restarts: must be at least 0, got -1".
// A whole number in [min, max] (written back in decimal: CLI11 alone would read 010 as octal).
CLI::Validator whole_number(long long min, long long max = INT_MAX);
// A finite number at least min (seconds, rates).
CLI::Validator number_at_least(double min);

// Every command, in the order `meshtrain --help` lists them.
const std::vector<Command>& commands();
// The command named on this command line if it runs without MPI (needs_mpi false), else null: the first argument
// that names a command, before any "--".
const Command* command_without_mpi(int argc, char** argv);

// One per file (runtime/cli/cmd_<name>.cpp).
Command check_command();
Command layout_command();
Command train_command();
Command plan_command();
Command estimate_command();
Command generate_command();
Command logits_command();
Command export_command();
Command tokenize_command();
Command supervise_command();
Command trace_command();

}  // namespace mt
