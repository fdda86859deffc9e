// meshtrain plan: the config's parallel plan applied without training (placements,
// layout hooks, bytes per step, measured and analytic).
#pragma once
#include "runtime/train/run_context.h"

namespace mt {

int run_plan_command(RunContext& ctx);

}  // namespace mt
