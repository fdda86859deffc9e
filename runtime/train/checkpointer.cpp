#include "runtime/train/checkpointer.h"

#include <algorithm>
#include <cmath>

#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/trace.h"
#include "runtime/core/fault.h"

namespace mt {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Checkpointer::Checkpointer(const Config& cfg, const MpiEnv& env, TrainRun& run, MetricsLogger& log, RunGoodput& gp)
    : cfg_(cfg), env_(env), run_(run), log_(log), gp_(gp), last_(std::chrono::steady_clock::now()),
      period_s_(cfg.checkpoint.interval_s) {}

bool Checkpointer::due_by_time(int64_t steps_done) const {
  if (!enabled() || env_.rank() != 0) return false;
  if (cfg_.checkpoint.interval.automatic && period_s_ <= 0) return steps_done >= 2;
  return period_s_ > 0 && seconds_since(last_) >= period_s_;
}

bool Checkpointer::due_by_steps(int64_t steps_done) const {
  const int64_t n = cfg_.checkpoint.interval.steps;
  return enabled() && !cfg_.checkpoint.interval.automatic && n > 0 && steps_done % n == 0;
}

void Checkpointer::save(int64_t next_step, bool final_save) {
  if (!enabled()) return;
  kprof::Mute not_profiled;
  trace::Span span("checkpoint save", "checkpoint");
  fault_stop_point("checkpoint");
  const auto t0 = std::chrono::steady_clock::now();
  commit(false);  // at most one save in flight: the previous one is completed first (inside this stall)
  const auto& t = cfg_.training;
  Batch pos = get_batch(run_.train_data, next_step, t.batch_size, t.seq_len, 0, 0);
  TrainProgress p{next_step, pos.epoch, pos.offset, uint64_t(t.seed)};
  const size_t before = allocator_stats(Device::cpu()).allocated_bytes;
  reset_peak_allocated(Device::cpu());
  const bool async = cfg_.checkpoint.async && !final_save;
  pending_ = begin_checkpoint(cfg_.checkpoint.dir, p, *run_.model, *run_.opt, cfg_, run_.mesh, env_,
                              run_.executor->stage_group(), async);
  extra_mib_ = double(allocator_stats(Device::cpu()).peak_allocated_bytes - before) / (1 << 20);
  if (!async) commit(false);
  const double stall = seconds_since(t0);
  gp_.checkpoint_s += stall;
  last_ = std::chrono::steady_clock::now();
  log_.record({{"event", "checkpoint"}, {"step", next_step}, {"mode", async ? "async" : "sync"},
               {"stall_s", stall}, {"snapshot_bytes", pending_ ? pending_->snapshot_bytes() : 0}});
  if (async)
    log_.note(fmt::format("checkpoint step {}: snapshot taken in {:.2f} s ({:.1f} MiB of host memory on this rank); "
                          "written in the background",
                          next_step, stall, double(pending_->snapshot_bytes()) / (1 << 20)));
  choose_period(stall);
}

void Checkpointer::commit(bool counted) {
  if (!pending_) return;
  trace::Span span("checkpoint commit", "checkpoint");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t step = pending_->step();
  const bool async = pending_->snapshot_bytes() > 0 || !pending_->written();
  std::unique_ptr<PendingCheckpoint> p = std::move(pending_);
  const std::string dir = p->commit();
  last_write_s_ = p->write_s();
  const double now = unix_time_s(), renamed = p->renamed_time();
  nlohmann::json rec = {{"event", "checkpoint_committed"}, {"step", step}, {"write_s", p->write_s()}, {"time", now}};
  std::string when;
  if (renamed > 0) {  // rank 0 completed it in the background: when, against the last writer and this boundary
    rec["renamed_time"] = renamed, rec["commit_lag_s"] = renamed - p->last_done_time();
    rec["before_boundary_s"] = now - renamed;
    when = fmt::format("; on disk {:.3f} s after the last writer finished, {:.2f} s before this step boundary",
                       renamed - p->last_done_time(), now - renamed);
  }
  log_.record(rec);
  log_.note(fmt::format("checkpoint step {} -> {} (files written and synced in {:.2f} s{}; host memory during the "
                        "save: {:.3f} MiB above the state on this rank{})",
                        step, dir, p->write_s(), async ? " behind training" : "", extra_mib_, when));
  if (counted) gp_.checkpoint_s += seconds_since(t0);  // waiting on a slow writer holds the loop too
}

void Checkpointer::choose_period(double stall) {
  if (!cfg_.checkpoint.interval.automatic || env_.rank() != 0) return;
  cost_s_ = cost_s_ <= 0 ? stall : 0.5 * cost_s_ + 0.5 * stall;
  const double mtbf = cfg_.checkpoint.mtbf_s;
  const double young = std::sqrt(2 * cost_s_ * mtbf);
  const double period = std::max({young, last_write_s_, 1e-3});
  const bool first = period_s_ <= 0;
  const bool changed = first || std::abs(period - period_s_) > 0.2 * period_s_;
  period_s_ = period;
  if (changed)
    log_.note(fmt::format(
        "checkpoint.interval auto: a save holds training {:.3f} s, mtbf_s {:.0f}: a checkpoint every {:.1f} s "
        "(sqrt(2 x {:.3f} x {:.0f}), Young/Daly); expected loss per failure {:.1f} s (half an interval and a "
        "save) = {:.2f}% of the MTBF, checkpoint overhead {:.2f}%",
        cost_s_, mtbf, period, cost_s_, mtbf, period / 2 + cost_s_, 100 * (period / 2 + cost_s_) / mtbf,
        100 * cost_s_ / period));
}

}  // namespace mt
