#include "runtime/train/trace_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/core/error.h"

namespace mt {

std::string trace_rank_path(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / fmt::format("trace_rank{}.json", rank)).string();
}

std::string merge_traces(const std::string& dir, int* ranks) {
  namespace fs = std::filesystem;
  MT_CHECK(fs::is_directory(dir), "trace", "{}: not a directory", dir);
  const std::regex name(R"(trace_rank(\d+)\.json)");
  std::vector<std::pair<int, fs::path>> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string f = e.path().filename().string();
    if (std::regex_match(f, m, name)) files.emplace_back(std::stoi(m[1].str()), e.path());
  }
  MT_CHECK(!files.empty(), "trace", "{}: no trace_rank*.json files (written by a run with profile.steps and profile.dir)",
           dir);
  std::sort(files.begin(), files.end());
  nlohmann::json out = {{"traceEvents", nlohmann::json::array()},
                        {"displayTimeUnit", "ms"},
                        {"metadata", {{"ranks", nlohmann::json::array()}}}};
  for (const auto& [rank, path] : files) {
    std::ifstream in(path);
    nlohmann::json j;
    try {
      in >> j;
    } catch (const std::exception& e) {
      fail("trace", "{}: not JSON ({})", path.string(), e.what());
    }
    MT_CHECK(j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array(), "trace",
             "{}: not a Chrome trace (no traceEvents array)", path.string());
    for (auto& e : j["traceEvents"]) out["traceEvents"].push_back(std::move(e));
    out["metadata"]["ranks"].push_back(j.value("metadata", nlohmann::json::object()));
  }
  const std::string target = (fs::path(dir) / "trace.json").string();
  std::ofstream o(target);
  o << out.dump() << "\n";
  MT_CHECK(o.good(), "trace", "{}: cannot write", target);
  if (ranks) *ranks = int(files.size());
  return target;
}

}  // namespace mt

// ---- RunTrace ----

#include "comm/env.h"
#include "comm/world.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/trace.h"
#include "runtime/train/metrics.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/run_config.h"
#include "runtime/train/run.h"

namespace mt {

RunTrace::RunTrace(const Config& cfg, const MpiEnv& env, const TrainRun& run) : cfg_(cfg), env_(env) {
  const auto& p = cfg.profile;
  if (p.steps.empty()) return;
  first_ = p.steps[0], last_ = p.steps[1];
  char why[256] = {0};
  if (env.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(p.dir, ec);
    if (ec) std::snprintf(why, sizeof why, "%s", ec.message().c_str());
  }
  world::broadcast(std::as_writable_bytes(std::span(why)), 0, "profile.dir check");
  MT_CHECK(!why[0], "config", "profile.dir = {}: cannot create it: {}", p.dir, why);
  const ClockSync c = world::clock_sync();
  trace::set_clock(c.offset_ns, c.zero_ns, c.rtt_ns);
  trace::set_process(env.rank(), env.host());
  trace::name_thread("main");
  // The model state's parts, as the allocator counts them (its rounding): the memory track's fixed series.
  const Device d = run.device;
  int64_t params = 0, grads = 0, opt = 0;
  for (Parameter* q : run.params) {
    params += int64_t(allocation_bytes(d, q->value.local.nbytes()));
    const Tensor copy = compute_copy(*q);
    if (copy.defined()) params += int64_t(allocation_bytes(d, copy.nbytes()));
    grads += int64_t(allocation_bytes(d, q->grad.local.nbytes()));
    const auto& s = run.opt->state().at(q->name);
    opt += int64_t(allocation_bytes(d, s.exp_avg.nbytes()) + allocation_bytes(d, s.exp_avg_sq.nbytes()));
  }
  const int64_t buffers = run.grad_sync ? int64_t(allocation_bytes(d, size_t(run.grad_sync->bucket_buffer_bytes()))) : 0;
  trace::set_memory_parts(params, grads, opt, buffers);
  device_ = d;
  trace::set_memory_device(d.is_cuda() ? d.index : -1);  // a GPU run's track is the device's memory
}

void RunTrace::before_step(int64_t step) {
  if (!enabled() || recording_ || done_ || step + 1 < first_) return;
  before_ = comm_counters();
  trace::clear();
  trace::reset_memory_peak();
  trace::start();
  recording_ = true;
  trace::memory_sample(int64_t(allocator_stats(device_).allocated_bytes));
}

void RunTrace::step_done(int64_t step, int64_t t0_ns, int64_t peak) {
  if (!recording_) return;
  trace::Args a;
  a.step = step + 1;
  a.bytes = peak;
  a.detail = "bytes: the allocator's peak of the step";
  trace::complete("step", "step", t0_ns, trace::now_ns(), std::move(a));
  // On a GPU, each op's run on its stream (the device may still be running the optimizer: those spans end past
  // the host's step span).
  kprof::trace_device_flush();
}

void RunTrace::after_step(int64_t step, MetricsLogger& log) {
  if (recording_ && step + 1 >= last_) finish(log);
}

void RunTrace::finish(MetricsLogger& log) {
  if (!recording_) return;
  trace::stop();
  recording_ = false, done_ = true;
  peak_ = trace::memory_peak();
  // The Group counters of the traced range: what the "comm" spans' bytes must add up to.
  const CommCounters now = comm_counters();
  nlohmann::json counters = nlohmann::json::array();
  for (const auto& [k, c] : now.entries) {
    CommCounters::Count b;
    if (auto it = before_.entries.find(k); it != before_.entries.end()) b = it->second;
    if (c.calls == b.calls) continue;
    counters.push_back({{"tag", std::get<0>(k)}, {"group", std::get<1>(k)}, {"kind", std::get<2>(k)},
                        {"calls", c.calls - b.calls}, {"bytes", c.bytes - b.bytes}});
  }
  const nlohmann::json meta = {{"steps", {first_, last_}},
                               {"comm_counters", counters},
                               {"memory_peak", {{"parameters", peak_.parameters}, {"gradients", peak_.gradients},
                                                {"optimizer", peak_.optimizer}, {"communication buffers", peak_.buffers},
                                                {"fully_shard units", peak_.units},
                                                {"checkpoint snapshot", peak_.snapshot},
                                                {"activations and temporaries", peak_.other},
                                                {"total", peak_.total()}}}};
  const std::string path = trace_rank_path(cfg_.profile.dir, env_.rank());
  const bool ok = trace::write(path, meta.dump());
  const size_t n = trace::event_count();
  trace::clear();
  const int bad = world::all_reduce(ok ? 0 : 1, ReduceOp::max, "trace files written");
  if (bad) {
    if (env_.rank() == 0) log.note(fmt::format("trace: a rank could not write its file in {}", cfg_.profile.dir));
    return;
  }
  if (env_.rank() == 0) {
    int ranks = 0;
    const std::string merged = merge_traces(cfg_.profile.dir, &ranks);
    log.note(fmt::format("trace of steps {} to {}: {} events on rank 0, {} ranks merged into {} (open it in "
                         "https://ui.perfetto.dev or chrome://tracing)",
                         first_, last_, n, ranks, merged));
  }
}

}  // namespace mt
