#include "runtime/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include "runtime/core/fault.h"
#include "comm/world.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/log.h"
#include "runtime/core/startup.h"
#include "runtime/core/stream.h"
#include "runtime/core/trace.h"
#include "runtime/train/agree.h"
#include "runtime/train/checkpointer.h"
#include "runtime/train/cuda_graph.h"
#include "runtime/train/generate.h"
#include "runtime/train/memory_checkpoint.h"
#include "runtime/train/peak_cache.h"
#include "runtime/train/resume.h"
#include "runtime/train/step.h"
#include "runtime/train/step_control.h"
#include "runtime/train/straggler.h"

namespace mt {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every rank's host name, by world rank (one all-gather of 64 bytes each; for the slow-rank lines).
std::vector<std::string> gather_host_names(const MpiEnv& env) {
  struct Host {
    char name[64];
  } mine = {};
  std::snprintf(mine.name, sizeof mine.name, "%s", env.host().c_str());
  std::vector<std::string> hosts;
  for (const Host& h : world::all_gather(mine, "host names")) hosts.emplace_back(h.name, strnlen(h.name, 63));
  return hosts;
}

// Fewer ranks than checkpoint.writers cannot write that many files: refused rather than quietly fewer.
void check_writers(const Config& cfg, const MpiEnv& env) {
  run_agreed(env, "checkpoint.writers", [&] {
    MT_CHECK(cfg.checkpoint.writers <= env.size(), "config",
             "checkpoint.writers = {} but the job has {} ranks: at most one file pair per rank (0 = every rank)",
             cfg.checkpoint.writers, env.size());
  });
}

}  // namespace

// The loop's state that lives from the first step to the last.
struct Trainer::Loop {
  TextCodec codec;       // samples: the run's tokenizer (data.tokenizer or model.init_from's), else bytes
  StepProfiler profile;  // MT_PROFILE_KERNELS
  RunTrace trace;        // profile.steps: the Chrome trace
  int trace_full_rank = -1;  // agreed after each step: a rank whose trace buffer is full (-1: none)
  bool memory_compared = false;
};

// What one step took on this rank.
struct Trainer::Timed {
  double step_s = 0;  // wall time
  double wait_s = 0;  // of it, waiting in collectives
};

Trainer::Trainer(const Config& cfg, const MpiEnv& env) : cfg_(cfg), env_(env) {
  const auto& t = cfg.training;
  check_writers(cfg, env);
  check_profile_dir(cfg, env);
  // A run that may resume leaves the random init for resume_or_init: drawn only when no checkpoint is loaded.
  run_ = make_train_run(cfg, env, true, !cfg.checkpoint.dir.empty() && cfg.checkpoint.resume != "never");
  check_checkpoint_dir_writable(cfg.checkpoint.dir, env);
  gp_.load_s = resume_or_init(cfg, env, run_);
  startup::mark("load");
  const double flops_per_token = family_of(cfg.model).flops_per_token(cfg.model, t.seq_len);
  // A GPU's: the H200's dense bf16 peak; a CPU's: the GEMM probe's, kept per machine.
  double peak = 989e12;
  peak_source_ = "device";
  if (!run_.device.is_cuda()) {
    const CpuPeak cpu = cpu_peak_for_run(cfg.log.peak_cache, env);
    peak = cpu.flops, peak_source_ = cpu.source;
  }
  startup::mark("peak");
  log_setup(cfg, env, run_, flops_per_token, peak);
  log_ = std::make_unique<MetricsLogger>(env.rank(), env.size(), cfg.log.metrics_file, t.steps, cfg.log.interval,
                                         flops_per_token, peak, run_.device, cfg.log.progress);
  gp_.setup_s = startup::seconds_since_process_start();
  log_->record({{"event", "start"}, {"time", unix_time_s()}, {"pid", int64_t(::getpid())},
                {"start_step", run_.start_step}, {"setup_s", gp_.setup_s}, {"load_s", gp_.load_s},
                {"world", env.size()},
                {"resumed_from", run_.resumed_from.empty() ? nlohmann::json() : nlohmann::json(run_.resumed_from)}});
  startup::mark("report");
}

Trainer::~Trainer() = default;

int Trainer::train() {
  ckpt_ = std::make_unique<Checkpointer>(cfg_, env_, run_, *log_, gp_);
  mem_ = std::make_unique<MemoryCheckpointer>(cfg_, env_, run_);
  TextCodec codec;
  if (cfg_.sample.interval > 0 && cfg_.sample.tokens > 0)
    run_agreed(env_, "the tokenizer (for samples)", [&] { codec = text_codec(cfg_); });
  loop_.reset(new Loop{std::move(codec), StepProfiler(run_, env_, *log_, cfg_.training.steps),
                       RunTrace(cfg_, env_, run_, *log_)});
  // The memory report (rank 0's `meshtrain estimate`) runs at the range's end, before the ranks agree that it is
  // written and merged: the others wait for it there, not in the next collective.
  loop_->trace.after_range = [this] { compare_memory(); };
  // The slow-rank check: every rank's compute and wait times travel with the per-step agreement.
  trace::g_timing = cfg_.profile.straggler_threshold > 0;
  stragglers_ = std::make_unique<StragglerCheck>(cfg_.profile.straggler_threshold, cfg_.profile.straggler_steps,
                                                 gather_host_names(env_));
  int stop = 0;
  for (int64_t step = run_.start_step; step < cfg_.training.steps; ++step) {
    const Timed t = timed_step(step);
    if (step == run_.start_step) {  // the set-up, printed and recorded once, now that its end is known
      startup::mark("first_step");
      const SetupTimeline setup = setup_timeline(run_.start_step, peak_source_);
      log_->note(setup.line);
      log_->record(setup.record);
    }
    const bool last = step + 1 == cfg_.training.steps;
    evaluate_and_sample(step, last);
    stop = agree_and_checkpoint(step, t, last);
    if (stop) {
      log_->note(fmt::format(
          "signal {} ({}) received: stopped after step {}{}; exit code {}", stop, strsignal(stop), step + 1,
          cfg_.checkpoint.dir.empty() ? " (no checkpoint.dir: nothing saved)" : " with a checkpoint", 128 + stop));
      loop_->profile.report();
      loop_->trace.finish(*log_);
      break;
    }
    loop_->trace.after_step(step, loop_->trace_full_rank, *log_);
  }
  if (!stop) {
    loop_->trace.finish(*log_);
    loop_->profile.report();
  }
  // The run ended with its checkpoint on disk: nothing is left in shared memory.
  mem_->finish();
  log_->record(gp_.record());
  log_->note(gp_.line());
  return stop ? 128 + stop : 0;
}

// Steps 1-2 of a loop iteration: the step itself (train_step), timed, profiled and traced, and its metrics.
Trainer::Timed Trainer::timed_step(int64_t step) {
  Loop& l = *loop_;
  if (kprof::enabled() && step == l.profile.first_profiled) kprof::reset();  // drops what set-up recorded
  l.trace.before_step(step);
  reset_peak_allocated(run_.device);  // the step's own high-water mark (the model state included)
  const int64_t trace_t0 = trace::now_ns(), wait0 = trace::wait_ns();
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t syncs_before = host_sync_count();
  const StepResult r = [&] {
    std::optional<kprof::Mute> before_profiled;  // steps before the profiled ones are not timed
    if (kprof::enabled() && step < l.profile.first_profiled) before_profiled.emplace();
    return run_.graphs ? graph_train_step(run_, *run_.graphs, step) : train_step(run_, step);
  }();
  Timed t{seconds_since(t0), 1e-9 * double(trace::wait_ns() - wait0)};
  l.trace.step_done(step, trace_t0, int64_t(allocator_stats(run_.device).peak_allocated_bytes));
  gp_.steps_s += t.step_s;
  // The step's device work is enqueued without waiting but for the one read of loss and grad norm (see
  // train_step); eval, samples and checkpoints come after the step and are not counted.
  spdlog::debug("step {}: host syncs this step: {}", step + 1, host_sync_count() - syncs_before);
  l.profile.step(step, t.step_s);
  count_skipped(r, step);
  const auto& c = cfg_.training;
  const AllocatorStats mem = allocator_stats(run_.device);
  log_->step({step, r.loss, r.lr, r.grad_norm, t.step_s, c.batch_size * c.seq_len, r.trained_tokens, skipped_,
              double(mem.peak_requested_bytes), double(mem.peak_allocated_bytes), &r.router});
  run_.executor->log_step(*log_, step);  // the executor's own figures (the pipeline's timers and bubble)
  return t;
}

// A step whose update was not applied: counted (in all, and in a row), an error when training.nonfinite or
// training.max_nonfinite_steps says stop, else a warning; a step with no trained target is a warning.
void Trainer::count_skipped(const StepResult& r, int64_t step) {
  const auto& t = cfg_.training;
  if (!r.skipped) {
    skipped_in_a_row_ = 0;
    if (r.trained_tokens == 0 && env_.rank() == 0)
      spdlog::warn(
          "step {}: the loss masks keep no target of the global batch: nothing to train on, the update "
          "is skipped",
          step + 1);
    return;
  }
  ++skipped_, ++skipped_in_a_row_;
  MT_CHECK(t.nonfinite == "skip", "train",
           "step {}: the loss is {} and the grad norm {}: not finite, the update was not applied and the run "
           "stops (training.nonfinite = stop; lower training.lr, or nonfinite: skip to go on)",
           step + 1, r.loss, r.grad_norm);
  MT_CHECK(skipped_in_a_row_ < t.max_nonfinite_steps, "train",
           "step {}: the loss is {} and the grad norm {}: {} non-finite steps in a row "
           "(training.max_nonfinite_steps = {}), none applied: the run stops (lower training.lr?)",
           step + 1, r.loss, r.grad_norm, skipped_in_a_row_, t.max_nonfinite_steps);
  if (env_.rank() == 0)
    spdlog::warn(
        "step {}: the loss is {} and the grad norm {}: not finite, the update is skipped ({} in a row, "
        "{} in all)",
        step + 1, r.loss, r.grad_norm, skipped_in_a_row_, skipped_);
}

// Step 3: evaluation and samples, when their intervals (or the last step) say so; neither is profiled.
void Trainer::evaluate_and_sample(int64_t step, bool last) {
  if (cfg_.eval.interval > 0 && run_.val_data.size() > 0 && ((step + 1) % cfg_.eval.interval == 0 || last)) {
    fault_stop_point("evaluation");
    kprof::Mute not_profiled;
    trace::Span span("evaluation", "eval");
    const auto e0 = std::chrono::steady_clock::now();
    const double val = evaluate(run_);
    gp_.eval_s += seconds_since(e0);
    log_->eval(step, val, seconds_since(e0));
  }
  const SampleConfig& s = cfg_.sample;
  if (s.interval > 0 && s.tokens > 0 && ((step + 1) % s.interval == 0 || last)) {
    fault_stop_point("sampling");
    kprof::Mute not_profiled;
    trace::Span span("sample", "eval");
    const auto s0 = std::chrono::steady_clock::now();
    const TextCodec& codec = loop_->codec;
    std::vector<int32_t> prompt = codec.encode(s.prompt);
    if (codec.tokenizer && codec.tokenizer->bos_id() >= 0) prompt.insert(prompt.begin(), codec.tokenizer->bos_id());
    std::vector<int32_t> ids = generate(*run_.model, *run_.executor, prompt, s.tokens, s.temperature,
                                        uint64_t(cfg_.training.seed), uint64_t(step), sequence_pad(run_),
                                        cfg_.data.document_separator, codec.eos_id());
    log_->sample(step, printable(s.prompt + codec.decode(ids)));
    gp_.eval_s += seconds_since(s0);
  }
}

// Step 4: what every rank decides alike (step_control.h), then the checkpoint it calls for. Returns the stop
// signal (0: go on).
int Trainer::agree_and_checkpoint(int64_t step, const Timed& t, bool last) {
  mem_->poll(false);  // the peer's in-memory copy, published once it has arrived
  StepControl mine;
  mine.stop_signal = stop_signal_received();
  mine.checkpoint_due = ckpt_->due_by_time(step + 1);
  mine.writing = ckpt_->writing();
  mine.pp_coord = run_.pd.pp_rank(run_.world_mesh);
  mine.trace_full = loop_->trace.full();
  mine.compute_s = std::max(0.0, t.step_s - t.wait_s);
  mine.wait_s = t.wait_s;
  const AgreedControl agreed = agree_step_control(mine);
  if (cfg_.profile.straggler_threshold > 0) {
    nlohmann::json spread;
    const std::string named = stragglers_->step(step, agreed.times, spread);
    log_->record(spread);
    if (!named.empty() && env_.rank() == 0) spdlog::warn("{}", named);
  }
  const int stop = agreed.stop_signal;
  loop_->trace_full_rank = agreed.trace_full_rank;
  if (ckpt_->in_flight() && !agreed.writing) ckpt_->commit();
  if (ckpt_->due_by_steps(step + 1) || agreed.checkpoint_due || last || stop) ckpt_->save(step + 1, last || stop);
  else if (mem_->due(step + 1)) {  // not where the disk has this step
    const double stall = mem_->save(step + 1, t.step_s);
    gp_.checkpoint_s += stall;
    // The supervisor's goodput counts it as an in-memory save (memory_save_s), not a disk one.
    log_->record({{"event", "checkpoint"}, {"step", step + 1}, {"mode", "memory"}, {"stall_s", stall}});
  }
  return stop;
}

// After the traced range: its memory beside `meshtrain estimate`'s, once.
void Trainer::compare_memory() {
  Loop& l = *loop_;
  if (!l.trace.finished() || l.memory_compared) return;
  l.memory_compared = true;
  if (after_trace) after_trace(l.trace, *log_);
}

}  // namespace mt
