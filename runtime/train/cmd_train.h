// meshtrain train: trains the config's model on its data, on the mesh the config
// and the ranks give; returns the exit code (128 + N when stopped by signal N).
#pragma once
#include "runtime/train/run_context.h"

namespace mt {

int run_train_command(RunContext& ctx);

}  // namespace mt
