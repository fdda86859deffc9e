#include "runtime/train/resume.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <vector>

#include "comm/world.h"
#include "runtime/core/allocator.h"
#include "runtime/core/log.h"
#include "runtime/train/agree.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/memory_checkpoint.h"

namespace mt {

namespace {

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

std::string fs_name(const std::string& path) { return std::filesystem::path(path).filename().string(); }

}  // namespace

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
  world::broadcast(std::as_writable_bytes(std::span(why)), 0, "checkpoint.dir check");
  // Every rank has rank 0's answer: one message, printed by rank 0.
  if (why[0])
    throw ReportedError(fmt::format("[checkpoint] checkpoint.dir = {} is not writable: {}", dir, why), 1,
                        env.rank() == 0);
}

// Step 1, where to start: a checkpoint to resume, else Hugging Face weights, else the random init (already
// there). resume: auto tries the newest complete checkpoint first and falls back to older ones when it cannot be read.
// Returns the seconds spent verifying and loading.
namespace {

// The checkpoint directories resume may load, newest first (resume: auto), or the one named. Collective (agreed).
std::vector<std::string> resume_candidates(const Config& cfg, const MpiEnv& env) {
  std::vector<std::string> candidates;
  // Every rank looks at the same directory: an error is printed once.
  run_agreed(env, "checkpoint.resume", [&] {
    if (cfg.checkpoint.dir.empty() || cfg.checkpoint.resume == "never") return;
    if (cfg.checkpoint.resume == "auto") {
      // Every committed directory, one whose meta.json has gone too: verify_checkpoint names it and it is skipped.
      candidates = checkpoints_in(cfg.checkpoint.dir);
      std::reverse(candidates.begin(), candidates.end());  // newest first
    } else {
      candidates.push_back(cfg.checkpoint.resume);
      MT_CHECK(std::filesystem::exists(std::filesystem::path(cfg.checkpoint.resume) / "meta.json"), "checkpoint",
               "checkpoint.resume = {}: not a complete checkpoint (no meta.json)", cfg.checkpoint.resume);
    }
  });
  return candidates;
}

}  // namespace

double resume_or_init(const Config& cfg, const MpiEnv& env, TrainRun& run) {
  const auto load_t0 = std::chrono::steady_clock::now();
  const bool resume_auto = cfg.checkpoint.resume == "auto";
  const std::vector<std::string> candidates = resume_candidates(cfg, env);
  std::string resume_from;
  // In-memory checkpoints first (checkpoint.memory), when every rank has one no older than the newest disk one.
  int64_t disk_step = -1;
  if (resume_auto && !candidates.empty())
    disk_step = std::atoll(fs_name(candidates.front()).c_str() + 5);  // step_XXXXXXXX
  if (resume_from_memory(cfg, env, run, disk_step)) resume_from = fmt::format("memory (step {})", run.start_step);
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
      // The checksums first (meta.json's own, then every file's): a damaged or missing file is named, and resume:
      // auto goes back to an older checkpoint (the save of the skipped one's step replaces it, saying so).
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
  // make_train_run's init_later: the checkpoint loaded every parameter (load_checkpoint refuses one it lacks), or
  // the random init is drawn now, the same bits as at creation.
  // With LoRA a checkpoint holds the adapters only: the frozen base is drawn (the same bits as at creation) or
  // loaded from model.init_from again.
  const bool lora = cfg.lora.enabled();
  for (Parameter* p : run.params) {
    if (resume_from.empty() || (lora && p->frozen)) draw_init(*p);
    else forget_init(*p);
  }
  if (!resume_from.empty() && env.rank() == 0)
    spdlog::info("resumed from {} at step {}{}", resume_from, run.start_step,
                 lora ? " (the adapters; the frozen base from its init)"
                 : run.init_later ? " (no random init drawn: the checkpoint loaded every parameter)" : "");
  if (!cfg.model.init_from.empty() && (resume_from.empty() || lora)) {
    run_agreed(env, "loading model.init_from", [&] { load_hf_weights(cfg.model.init_from, *run.model); });
    if (env.rank() == 0) spdlog::info("{} from {}", lora ? "the frozen base loaded" : "initialised", cfg.model.init_from);
  }
  if (lora && resume_from.empty() && !cfg.lora.init_from.empty()) {
    run_agreed(env, "loading lora.init_from", [&] { load_lora_adapter(cfg.lora.init_from, *run.model, cfg.lora); });
    if (env.rank() == 0) spdlog::info("adapters loaded from {}", cfg.lora.init_from);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - load_t0).count();
}

}  // namespace mt
