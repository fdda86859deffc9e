// `meshtrain train`: the training loop of runtime/train/trainer.h, with the report that needs the planner (the
// traced memory beside `meshtrain estimate`'s). Slurm sends SIGTERM (or a --signal of the user's choice) before the
// time limit: the run checkpoints and exits with 128 + the signal's number (143 SIGTERM, 138 SIGUSR1, 130 SIGINT),
// the shell's code for "ended by this signal", so a batch script tells "stopped, requeue me" from 0 (done) and 1
// (an error).
#include "runtime/cli/command.h"
#include "runtime/cli/train_reports.h"
#include "runtime/train/step_control.h"
#include "runtime/train/trainer.h"

namespace mt {

namespace {

int run_train_command(RunContext& ctx) {
  catch_stop_signals();  // from the start: a signal during set-up stops the run after its first step
  Trainer trainer(ctx.config, *ctx.env);
  trainer.after_trace = [&](const RunTrace& trace, MetricsLogger& log) {
    log_memory_beside_estimate(ctx.config, *ctx.env, trace, log);
  };
  return trainer.train();
}

}  // namespace

Command train_command() {
  return {"train", "train the model of the config on its data (checkpoints, metrics, samples)", true,
          [](CLI::App&) {}, run_train_command};
}

}  // namespace mt
