#include "runtime/cli/command.h"

namespace mt {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {check_command(),    layout_command(), train_command(),
                                             plan_command(),     estimate_command(), generate_command(),
                                             logits_command(),   tokenize_command(), trace_command()};
  return table;
}

}  // namespace mt
