// The training loop (torchtitan's Trainer.train()): `meshtrain train` builds a Trainer and calls train(). The
// constructor builds the run (make_train_run), resumes or initialises it, prints what it is and opens the metrics;
// train() runs the steps (step.h's train_step) with, after each, the non-finite rule, metrics, evaluation and
// samples, the per-step agreement of all ranks (step_control.h: stop signals, time-based checkpoints, the
// asynchronous save's commit, the slow-rank check), checkpoints (checkpointer.h, memory_checkpoint.h) and the trace
// range.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/env.h"
#include "runtime/train/metrics.h"
#include "runtime/train/run.h"
#include "runtime/train/run_report.h"
#include "runtime/train/straggler.h"
#include "runtime/train/trace_file.h"

namespace mt {

class Checkpointer;
class MemoryCheckpointer;
struct StepResult;

class Trainer {
 public:
  // Collective. Errors are the config's, the data's or the checkpoint's, named, on every rank.
  Trainer(const Config& cfg, const MpiEnv& env);
  ~Trainer();
  // Every rank, collectively: the steps from the start step to training.steps. Returns the exit code: 0, or
  // 128 + the signal after a stop signal (checkpointed first).
  int train();
  // Called on every rank once the traced range (profile.steps) is written: `meshtrain train` compares its memory
  // with `meshtrain estimate`'s (a layer above).
  std::function<void(const RunTrace&, MetricsLogger&)> after_trace;

 private:
  struct Loop;
  struct Timed;
  Timed timed_step(int64_t step);
  void count_skipped(const StepResult& r, int64_t step);
  void evaluate_and_sample(int64_t step, bool last);
  int agree_and_checkpoint(int64_t step, const Timed& t, bool last);
  void compare_memory();

  const Config& cfg_;
  const MpiEnv& env_;
  TrainRun run_;
  RunGoodput gp_;
  std::unique_ptr<MetricsLogger> log_;
  std::unique_ptr<Checkpointer> ckpt_;
  std::unique_ptr<MemoryCheckpointer> mem_;  // checkpoint.memory
  std::unique_ptr<StragglerCheck> stragglers_;
  std::unique_ptr<Loop> loop_;
  std::string peak_source_;  // where the MFU's peak came from: device, probed or cached (the set-up record)
  int64_t skipped_ = 0, skipped_in_a_row_ = 0;  // non-finite steps (not applied): in all, and the current run of them
};

}  // namespace mt
