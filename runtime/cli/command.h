// The `meshtrain` commands: one table (commands.cpp), one file per command (cmd_<name>.cpp). main() builds a
// CLI11 subcommand from each row and runs the chosen one inside the run's context; a new command is one file and
// one row.
#pragma once
#include <CLI/CLI.hpp>
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
};

// A command whose options fill an Args value that its run reads: one value, shared by the two closures.
template <typename Args>
Command command_with(std::string name, std::string help, std::function<void(CLI::App*, Args&)> add,
                     std::function<int(RunContext&, const Args&)> run, bool needs_config = true) {
  auto args = std::make_shared<Args>();
  return {std::move(name), std::move(help), needs_config, [args, add](CLI::App& app) { add(&app, *args); },
          [args, run](RunContext& ctx) { return run(ctx, *args); }};
}

// Every command, in the order `meshtrain --help` lists them.
const std::vector<Command>& commands();

// One per file (runtime/cli/cmd_<name>.cpp).
Command check_command();
Command layout_command();
Command train_command();
Command plan_command();
Command estimate_command();
Command generate_command();
Command logits_command();
Command tokenize_command();
Command trace_command();

}  // namespace mt
