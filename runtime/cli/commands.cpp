#include "runtime/cli/command.h"

namespace mt {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {check_command(),    layout_command(), train_command(),
                                             plan_command(),     estimate_command(), generate_command(),
                                             logits_command(),   tokenize_command(), supervise_command(),
                                             trace_command()};
  return table;
}

const Command* command_without_mpi(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    for (const Command& c : commands())
      if (c.name == a) return c.needs_mpi ? nullptr : &c;
  }
  return nullptr;
}

}  // namespace mt
