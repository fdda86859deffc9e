#include "runtime/train/run_report.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/log.h"
#include "runtime/core/startup.h"
#include "runtime/kernels/ops.h"

namespace mt {

nlohmann::json RunGoodput::record() const {
  const double wall = startup::seconds_since_process_start();
  const double other = std::max(0.0, wall - setup_s - steps_s - checkpoint_s - eval_s);
  return {{"event", "goodput"}, {"scope", "run"},      {"wall_s", wall},       {"productive_s", steps_s},
          {"checkpoint_s", checkpoint_s}, {"eval_s", eval_s}, {"setup_s", setup_s}, {"load_s", load_s},
          {"other_s", other}, {"goodput", wall > 0 ? steps_s / wall : 0}};
}

std::string RunGoodput::line() const {
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

SetupTimeline setup_timeline(int64_t start_step, const std::string& peak) {
  const std::map<std::string, std::string> labels = {
      {"exec", "exec and loading"}, {"mpi", "MPI start-up"}, {"config", "config"}, {"mesh", "mesh and groups"},
      {"model", "model built"},     {"load", start_step > 0 ? "checkpoint loaded" : "init"},
      {"peak", "GEMM peak"},        {"report", "set-up report"}, {"first_step", "first step"}};
  nlohmann::json parts = nlohmann::json::array();
  std::vector<std::string> shown;
  double before = 0;
  for (const auto& [part, end] : startup::marks()) {
    parts.push_back({{"part", part}, {"s", end - before}});
    const auto label = labels.find(part);
    shown.push_back(fmt::format("{} {:.2f}{}", label == labels.end() ? part : label->second, end - before,
                                part == "peak" ? " (" + peak + ")" : ""));
    before = end;
  }
  SetupTimeline t;
  t.record = {{"event", "setup"}, {"time", unix_time_s()}, {"start_step", start_step}, {"total_s", before},
              {"parts", parts},   {"peak", peak}};
  t.line = fmt::format("set-up {:.2f} s from the process's start to the first step done: {} (s)", before,
                       fmt::join(shown, ", "));
  return t;
}

std::string printable(const std::string& s) {
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n') r += "\\n";
    else if (c == '\t') r += "\\t";
    else if (c < 32 || c == 127) r += fmt::format("\\x{:02x}", c);
    else r.push_back(char(c));
  }
  return r;
}

namespace {

// The memory that does not depend on the batch (what peak memory is compared against), allocated against the
// count the layouts give: printed by rank 0.
void log_model_state(const MpiEnv& env, const TrainRun& run) {
  size_t state = 0;
  for (Parameter* p : run.params) {
    const Tensor copy = compute_copy(*p);  // mixed precision's bf16 copy, if any
    state += p->value.local.nbytes() + (copy.defined() ? copy.nbytes() : 0);
    if (p->frozen) continue;  // LoRA's base: no gradient, no optimizer state
    const AdamW::State& s = run.opt->state().at(p->name);
    state += p->grad.local.nbytes() + s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
  }
  // The expected count from the layouts alone: the local shape each parameter's spec gives rank 0 (the first,
  // largest chunk of every sharded dim; with fully_shard 1/dp_shard of each sharded parameter's tp part).
  const ParamStateBytes bytes = param_state_bytes(run.dtype);
  const double per_element = bytes.total(), per_frozen = frozen_param_bytes(run.dtype).total();
  const std::vector<int> rank0(size_t(run.mesh.ndim()), 0);
  double elements = 0, frozen = 0;
  for (Parameter* p : run.params)
    (p->frozen ? frozen : elements) += double(shape_numel(p->value.spec.local_shape(rank0)));
  const double expected = elements * per_element + frozen * per_frozen;
  if (env.rank() == 0) {
    spdlog::info(
        "model state on rank 0: {:.3f} MiB ({} B per parameter element: {}weights, gradient, AdamW m and v); "
        "expected {:.3f} MiB = {} B x {:.0f} elements{}{}: {}",
        double(state) / (1 << 20), per_element, run.dtype == DType::bf16 ? "bf16 copy, f32 master " : "",
        expected / (1 << 20), per_element, elements,
        frozen > 0 ? fmt::format(" + {} B x {:.0f} frozen elements (weights only)", per_frozen, frozen) : "",
        run.fsdp ? " (the rank's shards and the replicated small parameters)" : "",
        double(state) == expected ? "equal" : "DIFFERENT");
    if (run.fsdp) spdlog::info("fully_shard over dp_shard = {}: {}", run.pd.dp_shard(), run.fsdp->describe());
    spdlog::info("host memory at the peak of creating the model on rank 0: {:.3f} MiB (sharded creation: each rank "
                 "allocates only its part, in its final layout)",
                 double(run.create_peak_bytes) / (1 << 20));
  }
}

}  // namespace

// Step 2 of a run, what it is: the model, the mesh, the data, the memory its state takes.
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
  if (cfg.lora.enabled()) {
    // Whole-model counts (the stages' summed under pipeline parallel: a collective over them).
    double counts[2] = {0, 0};  // trainable, all
    for (Parameter* p : run.params) {
      const double n = double(shape_numel(p->value.spec.global_shape));
      counts[0] += p->frozen ? 0 : n;
      counts[1] += n;
    }
    const std::vector<double> sum = run.executor->sum_over_stages({counts[0], counts[1]});
    if (env.rank() == 0)
      spdlog::info("LoRA rank {} (scale {:g}) on {}: {:.0f} trainable parameters of {:.0f} ({:.3f}%), the base frozen",
                   cfg.lora.rank, cfg.lora.scale(), fmt::join(cfg.lora.targets, ","), sum[0], sum[1],
                   100.0 * sum[0] / std::max(1.0, sum[1]));
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

StepProfiler::StepProfiler(const TrainRun& r, const MpiEnv& e, MetricsLogger& l, int64_t steps)
    : run(r), env(e), log(l) {
  first_profiled = steps - run.start_step > 1 ? run.start_step + 1 : run.start_step;
  if (const char* v = std::getenv("MT_PROFILE_STEPS"); v && *v)
    first_profiled = std::max(run.start_step, steps - std::max<int64_t>(1, std::atoll(v)));
}

void StepProfiler::step(int64_t step, double dt) {
  if (!kprof::enabled() || step < first_profiled) return;
  kprof::flush();  // waits for the device: between steps, after the step's own host-sync count
  ++profiled_steps;
  profiled_wall_s += dt;
}

void StepProfiler::report() {
  if (run.device.is_cuda() && env.rank() == 0) {
    AllocatorStats m = allocator_stats(run.device);
    log.note(fmt::format(
        "device memory on rank 0: peak allocated {:.3f} GiB, reserved {:.3f} GiB ({} cudaMalloc calls)",
        double(m.peak_allocated_bytes) / (1 << 30), double(m.reserved_bytes) / (1 << 30), m.driver_allocs));
    log.record({{"peak_allocated_bytes", m.peak_allocated_bytes}, {"reserved_bytes", m.reserved_bytes}});
  }
  if (!kprof::enabled() || env.rank() != 0) return;
  kprof::flush();
  // The H200's dense bf16 peak and HBM3e bandwidth give the ridge point on a GPU; on the CPU no bandwidth is
  // known, so no bound is estimated.
  const bool gpu = run.device.is_cuda();
  std::string what = fmt::format(
      "MT_PROFILE_KERNELS=1, rank 0, steps {} to {}, {:.3f} ms wall per step; {}", first_profiled + 1,
      first_profiled + profiled_steps, profiled_steps ? 1e3 * profiled_wall_s / double(profiled_steps) : 0.0,
      gpu ? "CUDA events around each launch on its stream (ops overlap only across streams: NCCL's)"
          : "host clock around each op");
  std::string table = kprof::report(10, profiled_steps, gpu ? 989e12 : 0, gpu ? 4.8e12 : 0, what);
  if (!table.empty() && table.back() == '\n') table.pop_back();
  log.note(table);
  nlohmann::json ops = nlohmann::json::array();
  for (const kprof::OpStat& o : kprof::stats())
    ops.push_back({{"op", o.name}, {"calls", o.calls}, {"ms", o.ms}, {"flops", o.flops}, {"bytes", o.bytes}});
  log.record({{"kernel_profile", ops}, {"profiled_steps", profiled_steps}, {"wall_ms", 1e3 * profiled_wall_s}});
}

}  // namespace mt
