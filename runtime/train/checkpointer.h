// When and how `meshtrain train` checkpoints: every checkpoint.interval steps, every interval_s seconds by rank 0's
// clock, or with interval: auto every sqrt(2 x save cost x mtbf_s) seconds (Young/Daly); synchronously, or
// asynchronously (the loop is held only for the snapshot, and the save is committed at the first step boundary
// where every rank's writer is done, or before the next save). The final save and a stop signal's are
// synchronous. The files themselves are checkpoint.h's.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>

#include "comm/env.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/metrics.h"
#include "runtime/train/run.h"
#include "runtime/train/run_report.h"

namespace mt {

class Checkpointer {
 public:
  Checkpointer(const Config& cfg, const MpiEnv& env, TrainRun& run, MetricsLogger& log, RunGoodput& gp);

  bool enabled() const { return !cfg_.checkpoint.dir.empty(); }
  // Rank 0's vote: the time-based interval has passed (interval_s or auto), or auto's first, measuring save.
  bool due_by_time(int64_t steps_done) const;
  bool due_by_steps(int64_t steps_done) const;
  // This rank's writer is still writing (a save is in flight and not written).
  bool writing() const { return pending_ && !pending_->written(); }
  bool in_flight() const { return pending_ != nullptr; }

  // Collective: saves the state after next_step steps.
  void save(int64_t next_step, bool final_save);
  // Collective: completes the save in flight, if any (waiting for this rank's writer). counted: the time goes into
  // the goodput's checkpoint stalls here (else the caller's stall holds it).
  void commit(bool counted = true);

 private:
  // interval: auto. The cost of a save is the time it holds the loop (the stall; for an asynchronous save the
  // snapshot), the period sqrt(2 x cost x MTBF), never shorter than the last write (one save in flight).
  void choose_period(double stall);

  const Config& cfg_;
  const MpiEnv& env_;
  TrainRun& run_;
  MetricsLogger& log_;
  RunGoodput& gp_;
  std::unique_ptr<PendingCheckpoint> pending_;
  std::chrono::steady_clock::time_point last_;
  double period_s_ = 0, cost_s_ = 0, extra_mib_ = 0, last_write_s_ = 0;
};

}  // namespace mt
