// What the trace recorder (runtime/core/trace.h) costs per event, timed alone: an op span, a collective span with
// its args, a memory sample, and a host allocation and free (the allocator's hooks: one memory sample each while
// tracing) with tracing off and on; then the recorder's time for one step of a given event mix (default: a rank of
// the 4-rank pp 2 x tp 2 run of configs/bench_cpu.yaml: 716 memory samples, 315 ops, 84 collectives, 30 others)
// against a step time. Each figure is the fastest of ROUNDS rounds of ITERS calls (on a shared machine the least
// disturbed); between rounds the events are cleared, as a trace range's end does.
//   bench_trace_events [--iters 20000] [--rounds 7] [--memory 716] [--ops 315] [--comm 84] [--other 30]
//                      [--step-ms 400]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/core/allocator.h"
#include "runtime/core/trace.h"

using namespace mt;

namespace {

template <typename F> double ns_per_call(int64_t iters, int rounds, F&& f) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    trace::clear();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) f(i);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ns / double(iters));
  }
  trace::clear();
  return best;
}

double arg(int argc, char** argv, const char* name, double fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atof(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const auto iters = int64_t(arg(argc, argv, "--iters", 20000));
  const int rounds = int(arg(argc, argv, "--rounds", 7));
  const double n_memory = arg(argc, argv, "--memory", 716), n_ops = arg(argc, argv, "--ops", 315),
               n_comm = arg(argc, argv, "--comm", 84), n_other = arg(argc, argv, "--other", 30),
               step_ms = arg(argc, argv, "--step-ms", 400);
  trace::set_process(0, "bench");
  trace::set_memory_parts(1 << 20, 1 << 20, 2 << 20, 0);
  const Device cpu = Device::cpu();
  std::vector<void*> keep(64);
  auto alloc_free = [&](int64_t i) {  // a reused block of the allocator's cache, as in a step
    void*& p = keep[size_t(i % 64)];
    if (p) device_free(cpu, p, 4096);
    p = device_alloc(cpu, 4096);
  };
  const double alloc_off = ns_per_call(iters, rounds, alloc_free);
  trace::start();
  const double op = ns_per_call(iters, rounds, [](int64_t) { trace::Span s("matmul_forward", "op"); });
  const double comm = ns_per_call(iters, rounds, [](int64_t i) {
    trace::Args a;
    a.tag = "tp", a.group = "tp0", a.kind = "all_reduce", a.bytes = 4096 + i % 7;
    trace::complete("all_reduce", "comm", trace::now_ns(), trace::now_ns(), std::move(a));
  });
  const double sample = ns_per_call(iters, rounds, [](int64_t i) { trace::memory_sample(int64_t(1 << 24) + i); });
  const double alloc_on = ns_per_call(iters, rounds, alloc_free);
  trace::stop();
  for (void* p : keep)
    if (p) device_free(cpu, p, 4096);
  const double step_us = (n_memory * sample + n_ops * op + (n_comm + n_other) * comm) * 1e-3;
  std::printf("{\"op_span_ns\": %.1f, \"comm_span_ns\": %.1f, \"memory_sample_ns\": %.1f, \"alloc_free_off_ns\": %.1f, "
              "\"alloc_free_on_ns\": %.1f, \"step_events\": %.0f, \"recorder_us_per_step\": %.1f, "
              "\"of_step\": %.6f}\n",
              op, comm, sample, alloc_off, alloc_on, n_memory + n_ops + n_comm + n_other, step_us,
              step_us * 1e-3 / step_ms);
  return 0;
}
