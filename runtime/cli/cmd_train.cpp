// `meshtrain train`: the training loop around train_step (trainer.h): resume,
// evaluation, samples, checkpoints, metrics, and a clean stop on SIGTERM,
// SIGUSR1 or SIGINT (checkpoint, then exit 128 + the signal number).
#include "runtime/cli/command.h"
#include "runtime/cli/train_reports.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "comm/control.h"
#include "runtime/core/fault.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/log.h"
#include "runtime/core/stream.h"
#include "runtime/core/trace.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/metrics.h"
#include "runtime/train/straggler.h"
#include "runtime/train/trace_file.h"
#include "runtime/train/trainer.h"

namespace mt {

namespace {

std::atomic<int> g_stop_signal{0};
// The process's start (static initialisation, before main): set-up is counted from here.
const auto g_process_start = std::chrono::steady_clock::now();

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where this process's wall time went (rank 0's clock): set-up and loading before the first step, the steps,
// the time the loop was held by checkpoints, evaluation and samples; the rest is "other" (the stop-signal
// agreement, metrics). A supervisor adds up its attempts' (meshtrain supervise).
struct Goodput {
  double setup_s = 0, load_s = 0, steps_s = 0, checkpoint_s = 0, eval_s = 0;
  nlohmann::json record() const {
    const double wall = seconds_since(g_process_start);
    const double other = std::max(0.0, wall - setup_s - steps_s - checkpoint_s - eval_s);
    return {{"event", "goodput"}, {"scope", "run"},      {"wall_s", wall},       {"productive_s", steps_s},
            {"checkpoint_s", checkpoint_s}, {"eval_s", eval_s}, {"setup_s", setup_s}, {"load_s", load_s},
            {"other_s", other}, {"goodput", wall > 0 ? steps_s / wall : 0}};
  }
  std::string line() const {
    const nlohmann::json r = record();
    const double wall = r["wall_s"].get<double>();
    auto part = [&](const char* k) {
      const double v = r[k].get<double>();
      return fmt::format("{:.1f} s ({:.1f}%)", v, wall > 0 ? 100 * v / wall : 0.0);
    };
    return fmt::format("goodput {:.1f}% of {:.1f} s wall: steps {}, checkpoint stalls {}, evaluation and samples {}, "
                       "set-up and loading {}, other {}",
                       100 * r["goodput"].get<double>(), wall, part("productive_s"), part("checkpoint_s"),
                       part("eval_s"), part("setup_s"), part("other_s"));
  }
};
// A second Ctrl-C does not wait for the step to end: the default action, at once.
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_signal.load() != 0) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
  }
  g_stop_signal = sig;
}

// One line for the terminal: control bytes shown as escapes.
std::string printable(const std::string& s) {  // NOLINT
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n') r += "\\n";
    else if (c == '\t') r += "\\t";
    else if (c < 32 || c == 127) r += fmt::format("\\x{:02x}", c);
    else r.push_back(char(c));
  }
  return r;
}

// What a resumed run may not change silently: the data, the seed, the model and the schedule (training.steps may
// grow: a run is extended by resuming it with more steps). "key: X in the checkpoint, Y now" per difference.
std::vector<std::string> config_changes(const Config& was, const Config& now) {
  std::vector<std::string> d;
  auto cmp = [&](const char* key, const auto& a, const auto& b) {
    if (a != b) d.push_back(fmt::format("{}: {} in the checkpoint, {} now", key, a, b));
  };
  cmp("data.train", was.data.train, now.data.train);
  cmp("training.seed", was.training.seed, now.training.seed);
  const ModelConfig &a = was.model, &b = now.model;
  cmp("model.dim", a.dim, b.dim);
  cmp("model.n_layers", a.n_layers, b.n_layers);
  cmp("model.n_heads", a.n_heads, b.n_heads);
  cmp("model.n_kv_heads", a.n_kv_heads, b.n_kv_heads);
  cmp("model.ffn_dim", a.ffn_dim, b.ffn_dim);
  cmp("model.vocab_size", a.vocab_size, b.vocab_size);
  cmp("model.norm_eps", a.norm_eps, b.norm_eps);
  cmp("model.rope_theta", a.rope_theta, b.rope_theta);
  cmp("model.max_seq_len", a.max_seq_len, b.max_seq_len);
  cmp("model.tie_embeddings", a.tie_embeddings, b.tie_embeddings);
  cmp("training.schedule", was.training.schedule, now.training.schedule);
  cmp("training.lr", was.training.lr, now.training.lr);
  cmp("training.warmup_steps", was.training.warmup_steps, now.training.warmup_steps);
  cmp("training.lr_min", was.training.lr_min, now.training.lr_min);
  return d;
}

// checkpoint.dir must take files before the first step, not fail at the first checkpoint after hours of training.
// Rank 0 tries; every rank gets its answer, so all stop together with the same message.
void check_checkpoint_dir_writable(const std::string& dir, const MpiEnv& env) {
  if (dir.empty()) return;
  char why[256] = {0};
  if (env.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::filesystem::path probe = std::filesystem::path(dir) / fmt::format(".write_test.{}", ::getpid());
    if (ec) {
      std::snprintf(why, sizeof why, "%s", ec.message().c_str());
    } else {
      FILE* f = std::fopen(probe.c_str(), "w");
      if (!f || std::fputs("ok\n", f) < 0) std::snprintf(why, sizeof why, "%s", std::strerror(errno));
      if (f && std::fclose(f) != 0 && !why[0]) std::snprintf(why, sizeof why, "%s", std::strerror(errno));
      std::filesystem::remove(probe, ec);
    }
    // A run that died while saving left its partial save: nothing reads it, and it can be as large as a checkpoint.
    if (!why[0])
      for (const std::string& p : stale_partial_saves(dir)) {
        uint64_t bytes = 0;
        for (auto& e : std::filesystem::recursive_directory_iterator(p, ec))
          if (e.is_regular_file(ec)) bytes += e.file_size(ec);
        std::filesystem::remove_all(p, ec);
        spdlog::warn("removed {} ({:.1f} MiB), a partial save left by an earlier run that stopped while saving{}", p,
                     double(bytes) / (1 << 20), ec ? fmt::format(" (not all of it: {})", ec.message()) : "");
      }
  }
  control_broadcast(MPI_COMM_WORLD, why, int(sizeof why), MPI_CHAR, 0, "checkpoint.dir check");
  // Every rank has rank 0's answer: one message, printed by rank 0.
  if (why[0])
    throw ReportedError(fmt::format("[checkpoint] checkpoint.dir = {} is not writable: {}", dir, why), 1,
                        env.rank() == 0);
}

// Step 1, where to start: a checkpoint to resume, else Hugging Face weights, else the random init (already
// there). resume: auto tries the newest complete checkpoint first and falls back to older ones when it cannot be read.
// Returns the seconds spent verifying and loading.
double resume_or_init(const Config& cfg, const MpiEnv& env, TrainRun& run) {
  const auto load_t0 = std::chrono::steady_clock::now();
  std::vector<std::string> candidates;
  const bool resume_auto = cfg.checkpoint.resume == "auto";
  // Every rank looks at the same directory: an error is printed once.
  run_agreed(env, "checkpoint.resume", [&] {
    if (cfg.checkpoint.dir.empty() || cfg.checkpoint.resume == "never") return;
    if (resume_auto) {
      candidates = checkpoints_in(cfg.checkpoint.dir);
      std::reverse(candidates.begin(), candidates.end());  // newest first
    } else {
      candidates.push_back(cfg.checkpoint.resume);
      MT_CHECK(std::filesystem::exists(std::filesystem::path(cfg.checkpoint.resume) / "meta.json"), "checkpoint",
               "checkpoint.resume = {}: not a complete checkpoint (no meta.json)", cfg.checkpoint.resume);
    }
  });
  std::string resume_from;
  for (size_t i = 0; i < candidates.size() && resume_from.empty(); ++i) {
    const std::string& c = candidates[i];
    // Every rank reads the same files and fails the same way: they fall back together.
    auto fall_back = [&](const Error& e) {
      if (!resume_auto || i + 1 == candidates.size()) return false;
      if (env.rank() == 0)
        spdlog::warn("cannot resume from {}, it is damaged: {}; resume: auto falls back to {}", c, e.what(),
                     candidates[i + 1]);
      return true;
    };
    Config was;
    try {
      // The checksums first: a damaged file is named, and resume: auto goes back to an older checkpoint.
      verify_checkpoint(c, env);
      run_agreed(env, "reading the checkpoint's config", [&] { was = checkpoint_config(c); });
    } catch (const Error& e) {
      if (fall_back(e)) continue;
      throw;
    }
    auto changes = config_changes(was, cfg);
    if (!changes.empty()) {
      std::string list = fmt::format("{}", fmt::join(changes, "; "));
      // Every rank compares the same config with the same checkpoint: the refusal is printed once.
      run_agreed(env, "the resume config check", [&] {
        MT_CHECK(cfg.checkpoint.allow_config_change, "checkpoint",
                 "resuming from {} with a different config: {} (set checkpoint.allow_config_change: true to resume "
                 "anyway, or checkpoint.resume: never to start over)",
                 c, list);
      });
      if (env.rank() == 0) spdlog::warn("resuming from {} with a different config: {}", c, list);
    }
    try {
      // Each rank reads its own blocks: errors can differ between ranks, so they are agreed (all fall back together).
      TrainProgress p;
      const size_t before = allocator_stats(Device::cpu()).allocated_bytes;
      reset_peak_allocated(Device::cpu());
      const auto t0 = std::chrono::steady_clock::now();
      run_agreed(env, "loading the checkpoint", [&] { p = load_checkpoint(c, *run.model, run.opt.get()); });
      if (env.rank() == 0)
        spdlog::info(
            "loaded in {:.2f} s; host memory while loading on rank 0: {:.3f} MiB above the model state (one block at "
            "a time)",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            double(allocator_stats(Device::cpu()).peak_allocated_bytes - before) / (1 << 20));
      run.start_step = p.step;
      resume_from = c;
    } catch (const Error& e) {
      if (fall_back(e)) continue;
      throw;
    }
  }
  run.resumed_from = resume_from;
  if (!resume_from.empty()) {
    if (env.rank() == 0) spdlog::info("resumed from {} at step {}", resume_from, run.start_step);
  } else if (!cfg.model.init_from.empty()) {
    run_agreed(env, "loading model.init_from", [&] { load_hf_weights(cfg.model.init_from, *run.model); });
    if (env.rank() == 0) spdlog::info("initialised from {}", cfg.model.init_from);
  }
  return seconds_since(load_t0);
}

// The memory that does not depend on the batch (what peak memory is compared against), allocated against the
// count the layouts give: printed by rank 0.
void log_model_state(const MpiEnv& env, const TrainRun& run) {
  size_t state = 0;
  for (Parameter* p : run.params) {
    const Tensor copy = compute_copy(*p);  // mixed precision's bf16 copy, if any
    state += p->value.local.nbytes() + p->grad.local.nbytes() + (copy.defined() ? copy.nbytes() : 0);
    const auto& s = run.opt->state().at(p->name);
    state += s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
  }
  // The expected count from the layouts alone: the local shape each parameter's spec gives rank 0 (the first,
  // largest chunk of every sharded dim; with fully_shard 1/dp_shard of each sharded parameter's tp part).
  const double per_element = run.dtype == DType::bf16 ? 18 : double(4 * dtype_size(run.dtype));
  const std::vector<int> rank0(size_t(run.mesh.ndim()), 0);
  double elements = 0;
  for (Parameter* p : run.params) elements += double(shape_numel(p->value.spec.local_shape(rank0)));
  const double expected = elements * per_element;
  if (env.rank() == 0) {
    spdlog::info(
        "model state on rank 0: {:.3f} MiB ({} B per parameter element: {}weights, gradient, AdamW m and v); "
        "expected {:.3f} MiB = {} B x {:.0f} elements{}: {}",
        double(state) / (1 << 20), per_element, run.dtype == DType::bf16 ? "bf16 copy, f32 master " : "",
        expected / (1 << 20), per_element, elements,
        run.fsdp ? " (the rank's shards and the replicated small parameters)" : "",
        double(state) == expected ? "equal" : "DIFFERENT");
    if (run.fsdp) spdlog::info("fully_shard over dp_shard = {}: {}", run.pd.dp_shard(), run.fsdp->describe());
    spdlog::info("host memory at the peak of creating the model on rank 0: {:.3f} MiB (sharded creation: each rank "
                 "allocates only its part, in its final layout)",
                 double(run.create_peak_bytes) / (1 << 20));
  }
}

// Step 2, what the run is: the model, the mesh, the data, the memory its state takes.
void log_setup(const Config& cfg, const MpiEnv& env, const TrainRun& run, double flops_per_token, double peak) {
  const auto& t = cfg.training;
  if (env.rank() == 0) {
    spdlog::info(
        "model: {} {} parameters ({} without embeddings), {:.2f} MFLOP/token; mesh {}; batch {} x {} tokens, "
        "{} rows per dp rank, micro-batch {}; {} threads per rank, CPU GEMM peak {:.1f} GFLOP/s",
        cfg.model.type, family_of(cfg.model).num_params(cfg.model, true), family_of(cfg.model).num_params(cfg.model, false),
        flops_per_token / 1e6,
        mesh_str(run.world_mesh.dims()) + " (" + run.pd.describe() + ")", t.batch_size, t.seq_len, run.rows, run.micro,
        cpu_threads(), peak / 1e9);
    spdlog::info("data: {} train tokens in {} shard(s), {} steps per epoch", run.train_data.size(),
                 run.train_data.shards().size(), steps_per_epoch(run.train_data, t.batch_size, t.seq_len));
    if (const TokenStream& d = run.train_data; d.masked()) {
      const int64_t kept = d.trained(1, d.size());
      spdlog::info(
          "data: loss masks on {} of {} shard(s): {} of {} targets trained ({:.1f}%){}; the loss is their mean over "
          "each global batch",
          d.masked_shards(), d.shards().size(), kept, d.size() - 1, 100.0 * double(kept) / double(std::max<int64_t>(1, d.size() - 1)),
          d.packed_len() > 0 ? fmt::format(", packed in rows of {} tokens", d.packed_len()) : std::string());
    }
  }
  if (env.rank() == 0 && run.grad_sync) spdlog::info("gradient sync: {}", run.grad_sync->describe());
  if (const std::string how = run.executor->describe(); env.rank() == 0 && !how.empty()) spdlog::info("{}", how);
  log_model_state(env, run);
  if (env.rank() == 0 && run.dtype == DType::bf16)
    spdlog::info(
        "mixed precision: bf16 compute{}, f32 master weights, gradients, optimizer state, statistics and loss; "
        "gradients reduced in {}",
        run.device.is_cuda() ? "" : " (emulated in f32 on the CPU: a check, not fast)", t.grad_reduce_dtype);
  if (env.rank() == 0)
    spdlog::info("memory after setup: {:.0f} MiB resident (model, optimizer state, data, MPI)",
                 peak_memory_bytes(Device::cpu()) / (1 << 20));
}

// Checkpoints: when (every checkpoint.interval steps, every interval_s seconds by rank 0's clock, or with interval:
// auto every sqrt(2 x save cost x mtbf_s) seconds, Young/Daly) and how (synchronous, or asynchronous: the loop is
// held only for the snapshot, and the save is committed at the first step boundary where every rank's writer is
// done, or before the next save). The final save and a stop signal's are synchronous.
class Checkpointer {
 public:
  Checkpointer(const Config& cfg, const MpiEnv& env, TrainRun& run, MetricsLogger& log, Goodput& gp)
      : cfg_(cfg), env_(env), run_(run), log_(log), gp_(gp), last_(std::chrono::steady_clock::now()),
        period_s_(cfg.checkpoint.interval_s) {}
  ~Checkpointer() = default;

  bool enabled() const { return !cfg_.checkpoint.dir.empty(); }
  // Rank 0's vote: the time-based interval has passed (interval_s or auto), or auto's first, measuring save.
  bool due_by_time(int64_t steps_done) const {
    if (!enabled() || env_.rank() != 0) return false;
    if (cfg_.checkpoint.interval.automatic && period_s_ <= 0) return steps_done >= 2;
    return period_s_ > 0 && seconds_since(last_) >= period_s_;
  }
  bool due_by_steps(int64_t steps_done) const {
    const int64_t n = cfg_.checkpoint.interval.steps;
    return enabled() && !cfg_.checkpoint.interval.automatic && n > 0 && steps_done % n == 0;
  }
  // This rank's writer is still writing (a save is in flight and not written).
  bool writing() const { return pending_ && !pending_->written(); }
  bool in_flight() const { return pending_ != nullptr; }

  // Collective: saves the state after next_step steps.
  void save(int64_t next_step, bool final_save) {
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

  // Collective: completes the save in flight, if any (waiting for this rank's writer). counted: the time goes into
  // the goodput's checkpoint stalls here (else the caller's stall holds it).
  void commit(bool counted = true) {
    if (!pending_) return;
    trace::Span span("checkpoint commit", "checkpoint");
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t step = pending_->step();
    const bool async = pending_->snapshot_bytes() > 0 || !pending_->written();
    std::unique_ptr<PendingCheckpoint> p = std::move(pending_);
    const std::string dir = p->commit();
    last_write_s_ = p->write_s();
    log_.record({{"event", "checkpoint_committed"}, {"step", step}, {"write_s", p->write_s()},
                 {"time", unix_time_s()}});
    log_.note(fmt::format("checkpoint step {} -> {} (files written and synced in {:.2f} s{}; host memory during the "
                          "save: {:.3f} MiB above the state on this rank)",
                          step, dir, p->write_s(), async ? " behind training" : "",
                          extra_mib_));
    if (counted) gp_.checkpoint_s += seconds_since(t0);  // waiting on a slow writer holds the loop too
  }

 private:
  // interval: auto. The cost of a save is the time it holds the loop (the stall; for an asynchronous save the
  // snapshot), the period sqrt(2 x cost x MTBF), never shorter than the last write (one save in flight).
  void choose_period(double stall) {
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

  const Config& cfg_;
  const MpiEnv& env_;
  TrainRun& run_;
  MetricsLogger& log_;
  Goodput& gp_;
  std::unique_ptr<PendingCheckpoint> pending_;
  std::chrono::steady_clock::time_point last_;
  double period_s_ = 0, cost_s_ = 0, extra_mib_ = 0, last_write_s_ = 0;
};

// Step 3, the loop: steps, the non-finite rule, evaluation, samples, the stop signal and checkpoints. Returns the exit
// code (128 + the signal after a stop).
// Every rank's host name, by world rank (one all-gather of 64 bytes each; for the slow-rank lines).
std::vector<std::string> gather_host_names(const MpiEnv& env) {
  std::vector<std::string> hosts(size_t(env.size()));
  char mine[64] = {0};
  std::snprintf(mine, sizeof mine, "%s", env.host().c_str());
  std::vector<char> all(64 * size_t(env.size()));
  control_all_gather(MPI_COMM_WORLD, all.data(), mine, 64, MPI_CHAR, "host names");
  for (int r = 0; r < env.size(); ++r)
    hosts[size_t(r)] = std::string(all.data() + 64 * r, strnlen(all.data() + 64 * r, 63));
  return hosts;
}

// A step whose update was not applied: counted (in all, and in a row), an error when training.nonfinite or
// training.max_nonfinite_steps says stop, else a warning; a step with no trained target is a warning.
void count_skipped_step(const TrainingConfig& t, const MpiEnv& env, const StepResult& r, int64_t step, int64_t& skipped,
                        int64_t& skipped_in_a_row) {
  if (r.skipped) {
    ++skipped, ++skipped_in_a_row;
    MT_CHECK(t.nonfinite == "skip", "train",
             "step {}: the loss is {} and the grad norm {}: not finite, the update was not applied and the run "
             "stops (training.nonfinite = stop; lower training.lr, or nonfinite: skip to go on)",
             step + 1, r.loss, r.grad_norm);
    MT_CHECK(skipped_in_a_row < t.max_nonfinite_steps, "train",
             "step {}: the loss is {} and the grad norm {}: {} non-finite steps in a row "
             "(training.max_nonfinite_steps = {}), none applied: the run stops (lower training.lr?)",
             step + 1, r.loss, r.grad_norm, skipped_in_a_row, t.max_nonfinite_steps);
    if (env.rank() == 0)
      spdlog::warn(
          "step {}: the loss is {} and the grad norm {}: not finite, the update is skipped ({} in a row, "
          "{} in all)",
          step + 1, r.loss, r.grad_norm, skipped_in_a_row, skipped);
  } else {
    skipped_in_a_row = 0;
    if (r.trained_tokens == 0 && env.rank() == 0)
      spdlog::warn(
          "step {}: the loss masks keep no target of the global batch: nothing to train on, the update "
          "is skipped",
          step + 1);
  }
}

// Evaluation and samples after a step, when their intervals (or the last step) say so; neither is profiled.
void evaluate_and_sample(const Config& cfg, TrainRun& run, MetricsLogger& log, Goodput& gp, const TextCodec& codec,
                         int64_t step, bool last) {
  const auto& t = cfg.training;
  if (cfg.eval.interval > 0 && run.val_data.size() > 0 && ((step + 1) % cfg.eval.interval == 0 || last)) {
    fault_stop_point("evaluation");
    kprof::Mute not_profiled;
    trace::Span span("evaluation", "eval");
    const auto e0 = std::chrono::steady_clock::now();
    const double val = evaluate(run);
    gp.eval_s += seconds_since(e0);
    log.eval(step, val, seconds_since(e0));
  }
  if (cfg.sample.interval > 0 && cfg.sample.tokens > 0 && ((step + 1) % cfg.sample.interval == 0 || last)) {
    fault_stop_point("sampling");
    kprof::Mute not_profiled;
    trace::Span span("sample", "eval");
    const auto s0 = std::chrono::steady_clock::now();
    std::vector<int32_t> prompt = codec.encode(cfg.sample.prompt);
    if (codec.tokenizer && codec.tokenizer->bos_id() >= 0) prompt.insert(prompt.begin(), codec.tokenizer->bos_id());
    std::vector<int32_t> ids =
        generate(*run.model, *run.executor, prompt, cfg.sample.tokens, cfg.sample.temperature, uint64_t(t.seed),
                 uint64_t(step), sequence_pad(run), cfg.data.document_separator, codec.eos_id());
    log.sample(step, printable(cfg.sample.prompt + codec.decode(ids)));
    gp.eval_s += seconds_since(s0);
  }
}

int train_loop(const Config& cfg, const MpiEnv& env, TrainRun& run, MetricsLogger& log, Goodput& gp) {
  const auto& t = cfg.training;
  Checkpointer ckpt(cfg, env, run, log, gp);
  // Samples are encoded and decoded with the run's tokenizer (data.tokenizer or model.init_from's), else bytes.
  TextCodec codec;
  if (cfg.sample.interval > 0 && cfg.sample.tokens > 0)
    run_agreed(env, "the tokenizer (for samples)", [&] { codec = text_codec(cfg); });
  StepProfiler profile(run, env, log, t.steps);
  const int64_t first_profiled = profile.first_profiled;
  RunTrace trace_range(cfg, env, run);  // profile.steps: the Chrome trace (issue 40)
  // The slow-rank check (issue 40): every rank's compute and wait times travel with the per-step control collective.
  trace::g_timing = cfg.profile.straggler_threshold > 0;
  const std::vector<std::string> hosts = gather_host_names(env);
  bool memory_compared = false;
  StragglerCheck stragglers(cfg.profile.straggler_threshold, cfg.profile.straggler_steps, hosts);
  const int pp_coord = run.world_mesh.has_dim("pp") ? run.world_mesh.coordinate(run.world_mesh.dim_index("pp")) : 0;
  int64_t skipped = 0, skipped_in_a_row = 0;  // non-finite steps (not applied): in all, and the current run of them
  for (int64_t step = run.start_step; step < t.steps; ++step) {
    if (kprof::enabled() && step == first_profiled) kprof::reset();  // drops what set-up recorded
    trace_range.before_step(step);
    reset_peak_allocated(run.device);  // the step's own high-water mark (the model state included)
    const int64_t trace_t0 = trace::now_ns(), wait0 = trace::wait_ns();
    auto t0 = std::chrono::steady_clock::now();
    const int64_t syncs_before = host_sync_count();
    StepResult r = [&] {
      std::optional<kprof::Mute> before_profiled;  // steps before the profiled ones are not timed
      if (kprof::enabled() && step < first_profiled) before_profiled.emplace();
      return train_step(run, step);
    }();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double wait_s = 1e-9 * double(trace::wait_ns() - wait0);
    trace_range.step_done(step, trace_t0, int64_t(allocator_stats(run.device).peak_allocated_bytes));
    gp.steps_s += dt;
    // The step's device work is enqueued without waiting but for the one read of loss and grad norm (see
    // train_step); eval, samples and checkpoints come after the step and are not counted.
    spdlog::debug("step {}: host syncs this step: {}", step + 1, host_sync_count() - syncs_before);
    profile.step(step, dt);
    count_skipped_step(t, env, r, step, skipped, skipped_in_a_row);
    const AllocatorStats mem = allocator_stats(run.device);
    log.step({step, r.loss, r.lr, r.grad_norm, dt, t.batch_size * t.seq_len, r.trained_tokens, skipped,
              double(mem.peak_requested_bytes), double(mem.peak_allocated_bytes), &r.router});
    run.executor->log_step(log, step);  // the executor's own figures (the pipeline's timers and bubble)
    bool last = step + 1 == t.steps;
    evaluate_and_sample(cfg, run, log, gp, codec, step, last);
    // One small all-reduce per step carries what every rank must decide alike: a stop signal on any rank stops every
    // rank at the same step boundary; rank 0's clock says when a time-based checkpoint is due; an asynchronous save
    // is committed once no rank is still writing it.
    // It is an all-gather: each rank's compute and wait times of the step ride along for the slow-rank check, and
    // the flags are reduced (max) from the gathered values.
    constexpr int kN = 6;
    const double mine[kN] = {double(g_stop_signal.load()), ckpt.due_by_time(step + 1) ? 1.0 : 0.0,
                             ckpt.writing() ? 1.0 : 0.0, std::max(0.0, dt - wait_s), wait_s, double(pp_coord)};
    std::vector<double> gathered(size_t(kN * env.size()));
    control_all_gather(MPI_COMM_WORLD, gathered.data(), mine, kN, MPI_DOUBLE, "stop-signal all_reduce");
    int flags[3] = {0, 0, 0};
    std::vector<RankStepTimes> times(size_t(env.size()));
    for (int r = 0; r < env.size(); ++r) {
      const double* g = gathered.data() + kN * r;
      for (int k = 0; k < 3; ++k) flags[k] = std::max(flags[k], int(g[k]));
      times[size_t(r)] = {g[3], g[4], int(g[5])};
    }
    if (cfg.profile.straggler_threshold > 0) {
      nlohmann::json spread;
      const std::string named = stragglers.step(step, times, spread);
      log.record(spread);
      if (!named.empty() && env.rank() == 0) spdlog::warn("{}", named);
    }
    const int stop = flags[0];
    if (ckpt.in_flight() && !flags[2]) ckpt.commit();
    if (ckpt.due_by_steps(step + 1) || flags[1] || last || stop) ckpt.save(step + 1, last || stop);
    if (stop) {
      log.note(fmt::format(
          "signal {} ({}) received: stopped after step {}{}; exit code {}", stop, strsignal(stop), step + 1,
          cfg.checkpoint.dir.empty() ? " (no checkpoint.dir: nothing saved)" : " with a checkpoint", 128 + stop));
      profile.report();
      trace_range.finish(log);
      return 128 + stop;
    }
    trace_range.after_step(step, log);
    if (trace_range.finished() && !memory_compared) log_memory_beside_estimate(cfg, env, trace_range, log), memory_compared = true;
  }
  trace_range.finish(log);
  if (trace_range.finished() && !memory_compared) log_memory_beside_estimate(cfg, env, trace_range, log);
  profile.report();
  return 0;
}

}  // namespace

int run_train_command(RunContext& ctx) {
  // Slurm sends SIGTERM (or a --signal of the user's choice) before the time limit: checkpoint and stop.
  // The run then exits with 128 + the signal's number (143 SIGTERM, 138 SIGUSR1, 130 SIGINT), the shell's code
  // for "ended by this signal", after the checkpoint: a batch script tells "stopped, requeue me" from 0 (done)
  // and 1 (an error). Caught from the start: a signal during setup stops the run after its first step.
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  const Config& cfg = ctx.config;
  const MpiEnv& env = *ctx.env;
  // Fewer ranks than checkpoint.writers cannot write that many files: refused rather than quietly fewer.
  run_agreed(env, "checkpoint.writers", [&] {
    MT_CHECK(cfg.checkpoint.writers <= env.size(), "config",
             "checkpoint.writers = {} but the job has {} ranks: at most one file pair per rank (0 = every rank)",
             cfg.checkpoint.writers, env.size());
  });
  TrainRun run = make_train_run(cfg, env);
  const auto& t = cfg.training;
  check_checkpoint_dir_writable(cfg.checkpoint.dir, env);
  Goodput gp;
  gp.load_s = resume_or_init(cfg, env, run);
  const double flops_per_token = family_of(cfg.model).flops_per_token(cfg.model, t.seq_len);
  const double peak = run.device.is_cuda() ? 989e12 : cpu_peak_flops();
  log_setup(cfg, env, run, flops_per_token, peak);
  MetricsLogger log(env.rank(), env.size(), cfg.log.metrics_file, t.steps, cfg.log.interval, flops_per_token, peak,
                    run.device, cfg.log.progress);
  gp.setup_s = seconds_since(g_process_start);
  log.record({{"event", "start"}, {"time", unix_time_s()}, {"pid", int64_t(::getpid())}, {"start_step", run.start_step},
              {"setup_s", gp.setup_s}, {"load_s", gp.load_s}, {"world", env.size()},
              {"resumed_from", run.resumed_from.empty() ? nlohmann::json() : nlohmann::json(run.resumed_from)}});
  const int rc = train_loop(cfg, env, run, log, gp);
  log.record(gp.record());
  log.note(gp.line());
  return rc;
}

Command train_command() {
  return {"train", "train the model of the config on its data (checkpoints, metrics, samples)", true,
          [](CLI::App&) {}, run_train_command};
}

}  // namespace mt
