// Calibration (cluster.h's calibrate_cluster, `meshtrain estimate --calibrate`): this machine measured with the
// runtime's own kernels and collectives, every rank at once, and written as a cluster file: CPU ranks (comm.device
// cpu), or a CUDA device per rank (comm.device cuda). One measuring code for both; what differs (where the tensors
// live and in which dtype, waiting for the device, the peak, the memory, the shapes) is the Target chosen once.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "attention/attention.h"
#include "comm/mesh.h"
#include "comm/world.h"
#include "runtime/core/device.h"
#include "runtime/core/log.h"
#include "runtime/core/stream.h"
#include "runtime/io/config.h"
#include "runtime/kernels/cpu/isa.h"
#include "runtime/kernels/ops.h"
#include "runtime/planner/cluster.h"
#include "runtime/planner/calibrate_internal.h"
#include "runtime/planner/cluster_internal.h"
#include "runtime/train/agree.h"
#include "runtime/train/metrics.h"

namespace mt {

namespace {

using namespace calibrate_detail;

// The node's cores this process may run on.
int available_cores() {
  const int hw = std::max(1, int(std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : hw;
  return allowed > 0 ? std::min(allowed, hw) : hw;
}

// train's default thread count (trainer.cpp's auto_threads): the cores this process may use when bound to fewer
// than the node's, else the node's cores / its ranks.
int default_threads(const MpiEnv& env) {
  const int hw = int(std::thread::hardware_concurrency());
  const int allowed = available_cores();
  if (allowed > 0 && allowed < hw) return allowed;
  return std::max(1, hw / std::max(1, env.local_size()));
}

struct Rate {
  std::string what;
  double flops = 0, seconds = 0;  // per repetition (the median over ranks of each rank's median)
  double rate() const { return seconds > 0 ? flops / seconds : 0; }
};

// A linear layer's forward and backward, out (N, OC) = inp (N, C) @ w (OC, C)^T: 3 GEMMs of 2 N C OC FLOPs.
// In the target's dtype; dw in its accumulation dtype (f32 with bf16), as training's weight gradients.
Rate time_gemm(const Target& tg, int64_t N, int64_t C, int64_t OC, int iters) {
  Tensor inp = tg.filled({N, C}), w = tg.filled({OC, C}), out = tg.uninit({N, OC});
  Tensor dout = tg.filled({N, OC}), dinp = tg.uninit({N, C}), dw = tg.zeroed({OC, C}, accum_dtype(tg.dtype));
  const double s = time_median(tg, iters, "calibration: GEMM", [&] {
    matmul_forward(out, inp, w);
    matmul_backward(dinp, dw, dout, inp, w);
  });
  return {fmt::format("GEMM fwd+bwd N={} C={} OC={}", N, C, OC), 6.0 * double(N) * double(C) * double(OC), s};
}

// A matmul forward alone, out (n, n) = a (n, n) @ b (n, n)^T in dt: the peak's probe on a device.
Rate time_square_gemm(const Target& tg, int64_t n, DType dt, int iters) {
  Tensor a = tg.filled({n, n}, dt), b = tg.filled({n, n}, dt), c = tg.uninit({n, n}, dt);
  const double s = time_median(tg, iters, "calibration: peak GEMM", [&] { matmul_forward(c, a, b); });
  return {fmt::format("{} GEMM forward {}^3", dtype_name(dt), n), 2.0 * double(n) * double(n) * double(n), s};
}

// The model's attention (make_attention: local, as with cp = 1), forward and backward, causal, on (B, T, H, hd) with
// H/2 kv heads (grouped-query, as configs/bench_cpu.yaml); FLOPs as attention_forward_flops counts them. On a device
// in bf16 with hd 64 or 128: the tensor-core kernel training uses (ops.h, local_attention_forward).
Rate time_attention(const Target& tg, int64_t B, int64_t T, int64_t H, int64_t hd, int iters) {
  const int64_t KV = std::max<int64_t>(1, H / 2);
  auto att = make_attention();
  Tensor q = tg.filled({B, T, H, hd}), k = tg.filled({B, T, KV, hd}), v = tg.filled({B, T, KV, hd});
  Tensor dout = tg.filled({B, T, H, hd});
  Tensor dq = tg.uninit({B, T, H, hd}), dk = tg.uninit({B, T, KV, hd}), dv = tg.uninit({B, T, KV, hd});
  AttentionCall call;
  call.causal = true;
  const double s = time_median(tg, iters, "calibration: attention", [&] {
    AttentionSaved saved;
    att->forward(saved, q, k, v, call);
    att->backward(dq, dk, dv, dout, saved, call);
  });
  const double fwd = attention_forward_flops(double(B), double(T), double(T), double(H), double(hd), true);
  return {fmt::format("attention fwd+bwd B={} T={} H={} hd={}", B, T, H, hd), fwd * (1.0 + kAttentionBackwardFactor),
          s};
}

// Elementwise ops over tensors past the caches, the kinds of a training step's (the residual add, the norm, the
// FFN's activation, the optimizer): bytes read + bytes written per second. On CPU ranks the norm and the
// activation are partly compute-bound (exp, rsqrt); the figure is their mix, time-weighted. Activations in the
// target's dtype; the optimizer's state f32, with the bf16 compute copy written where the target computes in bf16
// (as training's step on a device).
struct Bandwidth {
  std::string what;
  double bytes = 0, seconds = 0;
  double gbs() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};
std::vector<Bandwidth> time_elementwise(const Target& tg, int64_t elems, int iters) {
  const int64_t C = 1024, N = std::max<int64_t>(1, elems / C);
  const DType acc = accum_dtype(tg.dtype);
  Tensor a = tg.filled({N, C}), b = tg.filled({N, C}), w = tg.filled({C}), rstd = tg.uninit({N}, acc);
  const double e = double(N * C) * double(dtype_size(tg.dtype)), e32 = double(N * C) * 4;
  std::vector<Bandwidth> r;
  double s = time_median(tg, iters, "calibration: add_", [&] { add_(a, b); });  // read a and b, write a
  r.push_back({"add_ (a += b)", 3 * e, s});
  s = time_median(tg, iters, "calibration: rmsnorm", [&] { rmsnorm_forward(b, rstd, a, w, 1e-5); });  // read a, write b
  r.push_back({"rmsnorm forward", 2 * e + double(N * int64_t(dtype_size(acc))), s});
  Tensor c = tg.filled({N, C}), d = tg.zeroed({N, C}, acc);
  s = time_median(tg, iters, "calibration: swiglu", [&] { swiglu_forward(c, a, b); });  // read a and b, write c
  r.push_back({"swiglu forward", 3 * e, s});
  // read param, grad, moments m and v; write param, m and v (and the bf16 copy). In f32 the activations' tensors
  // serve (param a, grad b, m c, v d); in bf16 the f32 master copy, its gradient and moments are their own.
  const bool f32 = tg.dtype == DType::f32;
  Tensor param = f32 ? a : tg.filled({N, C}, DType::f32), grad = f32 ? b : tg.filled({N, C}, DType::f32);
  Tensor m = f32 ? c : tg.filled({N, C}, DType::f32), lowp = f32 ? Tensor() : a;
  int64_t step = 0;
  s = time_median(tg, iters, "calibration: adamw",
                  [&] { adamw_step(param, grad, m, d, 1e-4, 0.9, 0.95, 1e-8, 0.1, ++step, lowp); });
  r.push_back({f32 ? "adamw step" : "adamw step (+ bf16 copy)", 7 * e32 + (f32 ? 0 : e), s});
  return r;
}

// "256K", "16M": the sizes in messages.
std::string human_bytes(int64_t b) {
  if (b >= (1 << 20) && b % (1 << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= (1 << 10) && b % (1 << 10) == 0) return fmt::format("{}K", b >> 10);
  return fmt::format("{}B", b);
}

// Measured figures to 4 significant digits: the noise is larger than that, and the file stays readable.
double sig4(double x) { return x > 0 ? std::stod(fmt::format("{:.4g}", x)) : x; }
void round_figures(ClusterSpec& c) {
  auto link = [](LinkSpec& l) {
    l.bandwidth_gbs = sig4(l.bandwidth_gbs), l.latency_us = sig4(l.latency_us);
    std::map<double, double> sync;
    for (auto& [ms, us] : l.sync_us) sync[sig4(ms)] = sig4(us);
    l.sync_us = sync;
    for (auto& [k, x] : l.bandwidth_gbs_by_kind) x = sig4(x);
  };
  for (auto& [dt, x] : c.peak_tflops) x = sig4(x);
  link(c.node), link(c.network);
  for (auto& [n, l] : c.node_by_ranks) link(l);
  c.device_memory_gib = sig4(c.device_memory_gib);
  c.gemm_efficiency = std::min(1.0, sig4(c.gemm_efficiency));
  c.attention_efficiency = std::min(1.0, sig4(c.attention_efficiency));
  c.memory_bandwidth_gbs = sig4(c.memory_bandwidth_gbs);
}

// What is measured, by target and --quick. CPU ranks: transformer-like GEMMs of 2048 tokens through dim 256..1024
// projections and a 3x FFN, attention T=256..1024 with 8 heads. A device: shapes of the size a GPU trains at
// (8192 tokens through dim 1024..4096; attention T=2048..8192, 16 or 32 heads, hd 64 and 128, the tensor-core
// kernel's, 16k tokens a call as a training step's batch has: at batch 1 the kernel's grid is too small to fill a
// GPU: the figure was 1.25x below the 1B step's attention rate on an H200), and the peak from bf16 squares of 4096
// and 8192 (f32 on the first). --quick: one small shape of each.
struct Plan {
  std::vector<int64_t> peak_sizes;                 // a device's peak probes (square GEMMs); CPU: cpu_peak_flops'
  std::vector<std::array<int64_t, 3>> gemms;       // N, C, OC
  std::vector<std::array<int64_t, 4>> attentions;  // B, T, H, hd
  int64_t elementwise_elems = 0;
};
Plan make_plan(const Target& tg, const CalibrateOptions& o) {
  Plan p;
  if (!tg.on_device()) {
    p.gemms = o.quick ? std::vector<std::array<int64_t, 3>>{{256, 128, 128}}
                      : std::vector<std::array<int64_t, 3>>{
                            {2048, 256, 256}, {2048, 256, 768}, {2048, 512, 512}, {2048, 1024, 1024}};
    p.attentions = o.quick ? std::vector<std::array<int64_t, 4>>{{1, 128, 8, 32}}
                           : std::vector<std::array<int64_t, 4>>{
                                 {1, 256, 8, 32}, {1, 512, 8, 32}, {1, 1024, 8, 32}, {1, 1024, 8, 64}};
    p.elementwise_elems = o.quick ? (1 << 18) : o.elementwise_elems;
    return p;
  }
  // --quick on a device: small enough for the emulated device of the tests (tests/emu), which runs the kernels on
  // the CPU; hd 64 still takes the tensor-core attention kernel.
  p.peak_sizes = o.quick ? std::vector<int64_t>{128} : std::vector<int64_t>{4096, 8192};
  p.gemms = o.quick ? std::vector<std::array<int64_t, 3>>{{128, 64, 64}}
                    : std::vector<std::array<int64_t, 3>>{
                          {8192, 1024, 1024}, {8192, 1024, 3072}, {8192, 2048, 2048}, {8192, 4096, 4096}};
  p.attentions = o.quick ? std::vector<std::array<int64_t, 4>>{{1, 64, 2, 64}}
                         : std::vector<std::array<int64_t, 4>>{
                               {8, 2048, 16, 64}, {8, 2048, 16, 128}, {4, 4096, 32, 128}, {2, 8192, 32, 128}};
  p.elementwise_elems = o.quick ? (1 << 16) : o.device_elementwise_elems;
  return p;
}

struct Calibration {
  ClusterSpec spec;
  Target target;
  std::string device_desc;  // a device: rank 0's ("cuda:0, NVIDIA H100 80GB HBM3, PCI 0000:3b:00.0")
  int threads = 0, cores = 0;
  double share = 1;  // the cores a rank has when all run: min(threads, cores / ranks); 1 on a device
  // Per rank. CPU: one rank alone / its cores alone x share (f32_peak cpu_peak_flops'). A device: the fastest
  // square GEMM in the dtype (peaks, every rank at once).
  double f32_peak = 0, bf16_peak = 0;
  std::vector<Rate> peaks, gemms, attentions;
  std::vector<Bandwidth> elementwise;
  std::vector<LinkFit> links;
  std::optional<ClusterSpec> links_from;  // --links-from's file: its node and network instead of measured links
  std::string links_from_path;
  std::vector<int64_t> bandwidth_sizes;
};

// cal's peaks (f32_peak, bf16_peak) and the cores they are shared by (cores, share); cal.threads set.
void measure_peaks(Calibration& cal, const MpiEnv& env, const CalibrateOptions& o, const Plan& plan, int iters) {
  const Target& tg = cal.target;
  if (tg.on_device()) {
    // A device per rank: every rank on its own at once, as the other rates (time_median: the slowest rank's time),
    // the largest bf16 GEMMs; f32 (CUDA cores: the runtime's f32 GEMM takes no TF32) on the first size only.
    for (int64_t n : plan.peak_sizes) {
      cal.peaks.push_back(time_square_gemm(tg, n, DType::bf16, iters));
      cal.bf16_peak = std::max(cal.bf16_peak, cal.peaks.back().rate());
    }
    cal.peaks.push_back(time_square_gemm(tg, plan.peak_sizes.front(), DType::f32, iters));
    cal.f32_peak = cal.peaks.back().rate();
    cal.cores = 0, cal.share = 1;
    return;
  }
  const int world = env.size();
  // The peaks: each rank's threads alone (one rank at a time, the others waiting), per core, times the cores a
  // rank has when all run, min(threads, cores / ranks on the node): a rank's peak when all run. Measured alone because a peak
  // measured under contention is whatever the scheduler gave that moment (from a quarter to all of a core with 8
  // ranks on 2 cores, run to run); the contention is in the efficiencies, measured with every rank running.
  double f32_alone = 0, bf16_alone = 0;
  for (int r = 0; r < world; ++r) {
    world::barrier("calibration: peak, one rank at a time");
    if (env.rank() == r) {
      f32_alone = cpu_peak_flops();  // cached for the process: the same figure train's MFU would use
      // cpu_peak_flops' measurement in bf16 (on one rank at a time, as calibrate runs both).
      bf16_alone = gemm_peak_flops(DType::bf16, o.quick ? 256 : 768, o.quick ? 1 : 3);
    }
  }
  cal.cores = available_cores();
  // A rank's cores when all run (rank_share's rule), and alone (its threads, at most the node's cores).
  cal.share = std::min(double(cal.threads), double(cal.cores) / env.local_size());
  const double alone_cores = std::min(cal.threads, cal.cores);
  cal.f32_peak = median_over_ranks(f32_alone, "calibration: f32 peak") / alone_cores * cal.share;
  cal.bf16_peak = median_over_ranks(bf16_alone, "calibration: bf16 peak") / alone_cores * cal.share;
}

template <size_t N> std::string shapes_text(const std::vector<std::array<int64_t, N>>& shapes, const char* fmt_n) {
  std::string r;
  for (auto& a : shapes)
    r += (r.empty() ? "" : ", ") + std::apply([&](auto... x) { return fmt::format(fmt::runtime(fmt_n), x...); }, a);
  return r;
}

std::string devices_text(const Target& tg) {
  return tg.ranks_per_device > 1 ? fmt::format("{} ranks sharing each CUDA device (every figure a rank's share of one)",
                                               tg.ranks_per_device)
                                 : "a CUDA device each";
}

// The source text of a device calibration: what was measured, on which device, how.
std::string device_source(const Calibration& cal, const MpiEnv& env, const Plan& plan, const CalibrateOptions& co,
                          int iters, const std::string& sizes) {
  std::string peaks;
  for (int64_t n : plan.peak_sizes) peaks += (peaks.empty() ? "" : ", ") + std::to_string(n) + "^3";
  const std::string backend = cal.links.empty() ? "-" : cal.links.back().backend;
  return fmt::format(
      "measured by meshtrain estimate --calibrate on {}: {} ranks on one node, {} (rank 0's: {}), comm backend {}. "
      "Every op on device tensors, all ranks at once: timed from a barrier of the ranks to the "
      "device's synchronisation (device_synchronize), an op's time the slowest rank's, the median of {} "
      "repetition(s) after a warm-up. peak_tflops.bf16 = the fastest bf16 rate measured (matmul forward on {} "
      "squares, or a rate below if higher); fp32 = the f32 matmul forward on {}^3 (no TF32); rates are harmonic "
      "means over the shapes (equal FLOPs or bytes of each); gemm = bf16 matmul forward+backward (dweight f32) at "
      "{}; attention = local causal forward+backward in bf16 (half as many kv heads) at {}; memory bandwidth = "
      "add_, rmsnorm and swiglu in bf16 and adamw (f32 state, the bf16 copy written) over {} bf16 tensors; "
      "links = all_reduce, all_gather, reduce_scatter, all_to_all, ring_shift of {} B (latency: the median per "
      "message step) and of {} (bandwidth per kind, and of all_reduce, all_gather, reduce_scatter and ring_shift "
      "issued non-blocking (<kind>_async): the median over the sizes; bandwidth_gbs: the kinds' median), f32 "
      "buffers on the devices, in groups of n ranks (node_by_ranks), node = the world's; no sync_us (a device per "
      "rank waits for no core); network = node (one node: no network measured). device_memory_gib = the device's "
      "total memory (cudaMemGetInfo){}.",
      env.host(), env.size(), devices_text(cal.target), cal.device_desc, backend, iters, peaks, plan.peak_sizes.front(),
      shapes_text(plan.gemms, "N={} C={} OC={}"), shapes_text(plan.attentions, "B={} T={} H={} hd={}"),
      human_bytes(plan.elementwise_elems * 2), co.latency_bytes, sizes,
      cal.target.ranks_per_device > 1 ? fmt::format(" / {} ranks per device", cal.target.ranks_per_device) : "");
}

// cal.spec from cal's measurements (o: the options as given, co: as run, --quick's reductions applied).
void fill_spec(Calibration& cal, const MpiEnv& env, const Config& cfg, const CalibrateOptions& o,
               const CalibrateOptions& co, const Plan& plan, int iters) {
  const int world = env.size();
  const Target& tg = cal.target;
  // The figures: the harmonic mean of the shapes' rates, the rate of a mix with equal FLOPs of each (a
  // time-weighted mean would be the largest shape's alone).
  auto harmonic = [](const std::vector<double>& rates) {
    double inv = 0;
    for (double r : rates) inv += r > 0 ? 1 / r : 0;
    return inv > 0 ? double(rates.size()) / inv : 0;
  };
  auto total = [&](const std::vector<Rate>& rs) {
    std::vector<double> rates;
    for (auto& r : rs) rates.push_back(r.rate());
    return std::array<double, 2>{harmonic(rates), rates.empty() ? 0 : *std::max_element(rates.begin(), rates.end())};
  };
  const auto [gemm_rate, gemm_best] = total(cal.gemms);
  const auto [att_rate, att_best] = total(cal.attentions);
  // The peak in the rates' dtype (CPU: cpu_peak_flops' best-of-7 768^3 f32 GEMM; a device: the bf16 squares') is the
  // fastest of it and the rates, so that peak x efficiency is the measured rate and every efficiency is <= 1.
  const double peak = std::max({tg.on_device() ? cal.bf16_peak : cal.f32_peak, gemm_best, att_best});
  std::string sizes;
  for (int64_t b : co.bandwidth_sizes) sizes += (sizes.empty() ? "" : ", ") + human_bytes(b);
  std::vector<double> elementwise_rates;  // the same mean: equal bytes through each op
  for (auto& b : cal.elementwise) elementwise_rates.push_back(b.gbs());

  ClusterSpec& c = cal.spec;
  c.name = "this_machine";
  c.devices_per_node = env.local_size();
  c.cores_per_node = cal.cores;  // 0 on a device: a device per rank, its figures the rank's (share 1)
  if (tg.on_device()) {
    c.device_memory_gib = double(cuda_device_memory_bytes(tg.device.index)) / tg.ranks_per_device / double(1 << 30);
    c.peak_tflops["bf16"] = peak / 1e12;
    if (cal.f32_peak > 0) c.peak_tflops["fp32"] = cal.f32_peak / 1e12;
  } else {
    const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    c.device_memory_gib = ram / double(env.local_size()) / double(1 << 30);
    // The file's figures are one core's (cores_per_node set): a rank's divided by its share.
    c.peak_tflops["fp32"] = peak / cal.share / 1e12;
    // bf16 on the CPU is f32 arithmetic on widened copies (ops.h): its own peak, its rate relative to f32's assumed
    // the same for every op kind.
    if (cal.bf16_peak > 0)
      c.peak_tflops["bf16"] = cal.bf16_peak * (peak / std::max(cal.f32_peak, 1.0)) / cal.share / 1e12;
  }
  c.gemm_efficiency = std::clamp(gemm_rate / peak, 1e-6, 1.0);
  c.attention_efficiency = std::clamp(att_rate / peak, 1e-6, 1.0);
  c.memory_bandwidth_gbs = harmonic(elementwise_rates) / cal.share;
  if (cal.links_from) {  // node_by_ranks not taken: its group sizes are the other machine's
    c.node = cal.links_from->node;
    c.network = cal.links_from->network;
  } else {
    for (auto& l : cal.links) c.node_by_ranks[l.ranks] = l.link;
    c.node = cal.links.back().link;  // the world's groups: every rank at once
    c.network = c.node;
  }
  if (tg.on_device()) {
    c.source = device_source(cal, env, plan, co, iters, sizes);
  } else {
    c.source = fmt::format(
        "measured by meshtrain estimate --calibrate on {}: {} CPU ranks on one node, {} thread(s) per rank, {} "
        "kernels, comm backend {}. peak_tflops and memory_bandwidth_gbs are one core's (a rank gets rank_share of "
        "them: here {:.3g} of the {} cores each): peak = cpu_peak_flops' 768^3 GEMM on one rank alone, per core, or "
        "the fastest rate measured here if higher; every rate with all ranks running at once, an op's time the "
        "slowest rank's; rates are harmonic means over the shapes (equal FLOPs or "
        "bytes of each); gemm = matmul forward+backward at N=2048, C=256..1024; "
        "attention = local causal forward+backward, T=256..1024, 8 heads, hd 32/64; memory bandwidth = add_, "
        "rmsnorm, swiglu and adamw over {} MiB tensors; links = all_reduce, all_gather, reduce_scatter, all_to_all, "
        "ring_shift of {} B (latency: the median per message step) and of {} (bandwidth per kind, and of all_reduce, "
        "all_gather, reduce_scatter and ring_shift issued non-blocking (<kind>_async): the median over "
        "the sizes; bandwidth_gbs: the kinds' median) in groups of n ranks (node_by_ranks), node = the world's; "
        "sync_us = loops of (a GEMM of 256, 1024 or 4096 rows x 256 x 768, an all_reduce, all_gather or "
        "reduce_scatter of {} B) against the GEMMs alone, all ranks at once: per segment (the GEMM's time), the "
        "median over kinds and rounds of the time per call less the collective's own; network "
        "= node (one node: no network measured). device_memory_gib = RAM / ranks.",
        env.host(), world, cal.threads, cpu_isa_name(cpu_isa()), cfg.comm.backend, cal.share, cal.cores,
        plan.elementwise_elems * 4 >> 20, o.latency_bytes, sizes, o.latency_bytes);
  }
  round_figures(c);
  check_cluster(c);
}

Calibration calibrate(const MpiEnv& env, const Config& cfg, const CalibrateOptions& o) {
  Calibration cal;
  Target& tg = cal.target;
  const int world = env.size();
  // The floor first, before the measurements' buffers: on CPU ranks before anything; on a device once the rank's
  // device is set up (the CUDA backend and its libraries loaded, the context made), as a training rank's is.
  const bool on_device = cfg.comm.device != "cpu";
  double floor_mib = on_device ? 0 : rank_floor_mib();
  run_agreed(env, "the calibration's setup", [&] {
    // The rank's device as train picks it (rank_device: a clear error where CUDA was not built or no device is
    // visible).
    tg.device = rank_device(env, cfg.comm.device);
    MT_CHECK(world >= 2 || !o.links_from.empty(), "cluster",
             "calibration needs at least 2 ranks to measure a link (mpirun -np 2 or more; this job has 1), or "
             "--links-from FILE: a cluster file whose node and network links are taken instead");
    if (!o.links_from.empty()) cal.links_from = load_cluster(o.links_from), cal.links_from_path = o.links_from;
    MT_CHECK(env.local_size() == world, "cluster",
             "calibration measures one node, but the {} ranks are spread over several hosts ({} on {}): run it on "
             "one node",
             world, env.local_size(), env.host());
    MT_CHECK(o.iters >= 1 && o.collective_iters >= 1 && o.sync_calls >= 1 && o.sync_reps >= 1, "cluster",
             "calibration needs at least one repetition");
    MT_CHECK(!o.sync_rows.empty(), "cluster", "calibration needs at least one sync GEMM size");
    cal.threads = cfg.training.threads > 0 ? cfg.training.threads : default_threads(env);
    set_cpu_threads(cal.threads);
    if (tg.on_device()) {
      tg.dtype = DType::bf16;
      const int ndev = std::max(1, cuda_device_count());
      tg.ranks_per_device = (env.local_size() + ndev - 1) / ndev;
      cal.device_desc = fmt::format("{}, {}, {:.4g} GiB, PCI {}", tg.device.str(), cuda_device_name(tg.device.index),
                                    double(cuda_device_memory_bytes(tg.device.index)) / double(1 << 30),
                                    cuda_device_pci_bus_id(tg.device.index));
      Tensor probe = tg.zeroed({1});  // the device's context made now, not inside a measurement
      tg.sync();
    }
  });
  if (on_device) floor_mib = rank_floor_mib();
  const int iters = o.quick ? 1 : o.iters;
  CalibrateOptions co = o;
  if (tg.on_device() && !o.quick) co.bandwidth_sizes = o.device_bandwidth_sizes;
  if (o.quick)
    co.collective_iters = std::min(o.collective_iters, 3), co.bandwidth_sizes = {64 << 10, 1 << 20},
    co.sync_calls = std::min(o.sync_calls, 4), co.sync_reps = 1, co.sync_rows = {64};
  MT_CHECK(!co.bandwidth_sizes.empty(), "cluster", "calibration needs at least one bandwidth size");
  const Plan plan = make_plan(tg, o);

  measure_peaks(cal, env, o, plan, iters);
  for (auto& [N, C, OC] : plan.gemms) cal.gemms.push_back(time_gemm(tg, N, C, OC, iters));
  for (auto& [B, T, H, hd] : plan.attentions) cal.attentions.push_back(time_attention(tg, B, T, H, hd, iters));
  cal.elementwise = time_elementwise(tg, plan.elementwise_elems, iters);

  // Links: groups of every size n dividing the world (all ranks in such groups at once).
  cal.bandwidth_sizes = co.bandwidth_sizes;
  if (!cal.links_from)
    for (int n = 2; n <= world; ++n)
      if (world % n == 0) cal.links.push_back(measure_link(tg, world, n, cfg.comm.backend, co));

  fill_spec(cal, env, cfg, o, co, plan, iters);
  if (cal.links_from)
    cal.spec.source += fmt::format(" The links (node, network) are NOT measured here: taken from {} ({}).",
                                   o.links_from, cal.links_from->name);
  cal.spec.rank_floor_mb = sig4(floor_mib);
  cal.spec.source += tg.on_device() ? " rank_floor_mb = the ranks' most resident host memory (ru_maxrss) after MPI "
                                      "init and the CUDA device's set-up, before any measurement."
                                    : " rank_floor_mb = the ranks' most resident memory (ru_maxrss) after MPI init, "
                                      "before any measurement.";
  return cal;
}

void print_calibration(const Calibration& cal, int world, const std::vector<int64_t>& sizes) {
  const ClusterSpec& c = cal.spec;
  const bool dev = cal.target.on_device();
  // A rank's peak, in the dtype the rates were measured in.
  const double peak = dev ? c.peak_tflops.at("bf16") * 1e12 : c.peak_tflops.at("fp32") * 1e12 * cal.share;
  if (dev) {
    std::printf("calibrated this machine: %d ranks on one node, %s (figures per rank, every rank running at once)\n",
                world, devices_text(cal.target).c_str());
    std::printf("  rank 0's device: %s\n", cal.device_desc.c_str());
    for (auto& r : cal.peaks)
      std::printf("  %-38s  %9.2f GFLOP/s             (%.2f ms)\n", r.what.c_str(), r.rate() / 1e9, r.seconds * 1e3);
    std::printf("  peak used (the largest bf16 rate)       %9.2f GFLOP/s\n", peak / 1e9);
  } else {
    std::printf(
        "calibrated this machine: %d ranks on one node, %d thread(s) per rank (figures per rank, every rank "
        "running at once)\n",
        world, cal.threads);
    std::printf("  a rank's cores when all run: %.3g of %d (min(threads, cores / ranks))\n", cal.share, cal.cores);
    std::printf("  f32 GEMM peak (768^3 alone, x share)    %9.2f GFLOP/s\n", cal.f32_peak / 1e9);
    std::printf("  bf16 GEMM peak (768^3 alone, x share)   %9.2f GFLOP/s\n", cal.bf16_peak / 1e9);
    std::printf("  peak used (the larger of it and rates)  %9.2f GFLOP/s\n", peak / 1e9);
  }
  for (auto* rs : {&cal.gemms, &cal.attentions})
    for (auto& r : *rs)
      std::printf("  %-38s  %9.2f GFLOP/s  %6.1f%% of peak  (%.2f ms)\n", r.what.c_str(), r.rate() / 1e9,
                  100 * r.rate() / peak, r.seconds * 1e3);
  for (auto& b : cal.elementwise)
    std::printf("  %-38s  %9.2f GB/s              (%.2f ms)\n", b.what.c_str(), b.gbs(), b.seconds * 1e3);
  if (dev)
    std::printf(
        "  => gemm_efficiency %.3f, attention_efficiency %.3f, per device: peak_tflops bf16 %.4g, fp32 %.4g, "
        "memory_bandwidth_gbs %.4g, device_memory_gib %.4g\n",
        c.gemm_efficiency, c.attention_efficiency, c.peak_tflops.at("bf16"),
        c.peak_tflops.count("fp32") ? c.peak_tflops.at("fp32") : 0.0, c.memory_bandwidth_gbs, c.device_memory_gib);
  else
    std::printf(
        "  => gemm_efficiency %.3f, attention_efficiency %.3f, per core: peak_tflops fp32 %.4g, "
        "memory_bandwidth_gbs %.4g\n",
        c.gemm_efficiency, c.attention_efficiency, c.peak_tflops.at("fp32"), c.memory_bandwidth_gbs);
  if (cal.links_from) {
    std::printf("\n  links: not measured, taken from %s (%s): node %.4g GB/s, %.4g us; network %.4g GB/s, %.4g us\n",
                cal.links_from_path.c_str(), cal.links_from->name.c_str(), c.node.bandwidth_gbs, c.node.latency_us,
                c.network.bandwidth_gbs, c.network.latency_us);
    return;
  }
  std::printf("\n  links (groups of n ranks, all ranks at once; busbw GB/s at each size, then the fit)\n");
  std::printf("  %5s %-20s %4s", "ranks", "kind", "8B us");
  for (int64_t b : sizes) std::printf(" %8s", human_bytes(b).c_str());
  std::printf(" %8s\n", "fit");
  for (auto& l : cal.links) {
    for (auto& k : l.kinds) {
      const std::string name = k.async ? k.kind + "_async" : k.kind;
      if (k.async) std::printf("  %5d %-20s %4s", l.ranks, name.c_str(), "-");
      else std::printf("  %5d %-20s %4.0f", l.ranks, name.c_str(), k.small_s * 1e6);
      for (auto& [bytes, t] : k.large) std::printf(" %8.3f", bytes / t / 1e9);
      std::printf(" %8.3f\n", l.link.bandwidth_for(k.kind, k.async));
    }
    std::printf("  %5d => latency_us %.3g per message step, bandwidth_gbs %.4g (the kinds' median)\n", l.ranks,
                l.link.latency_us, l.link.bandwidth_gbs);
    if (l.link.sync_us.empty()) continue;  // a device per rank: not measured
    std::printf("  %5d => sync_us (a call's wait when its ranks come from computing, by the work before it):", l.ranks);
    for (auto& [ms, us] : l.link.sync_us) std::printf(" %.3g ms: %.0f us", ms, us);
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace

double rank_floor_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const double mib = double(u.ru_maxrss) / 1024.0;  // KiB on Linux
  return world::all_reduce(mib, ReduceOp::max, "the ranks' floor");
}

ClusterSpec calibrate_cluster(const MpiEnv& env, const Config& cfg, const CalibrateOptions& opts) {
  return calibrate(env, cfg, opts).spec;
}

int run_calibrate(const RunContext& ctx, const std::string& out_path, const CalibrateOptions& opts) {
  const MpiEnv& env = *ctx.env;
  // The output path first: minutes of measuring must not end in "cannot write".
  run_agreed(env, "the calibration's output", [&] {
    MT_CHECK(!out_path.empty(), "cluster", "--calibrate needs --out FILE, the cluster file to write");
    if (env.rank() != 0) return;
    const bool existed = std::filesystem::exists(out_path);
    std::error_code ec;
    const auto parent = std::filesystem::path(out_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream probe(out_path, std::ios::app);
    if (!probe) fail("cluster", "cannot write --out '{}': {}", out_path, std::strerror(errno));
    probe.close();
    if (!existed) std::filesystem::remove(out_path, ec);
  });
  Calibration cal = calibrate(env, ctx.config, opts);
  run_agreed(env, "writing the cluster file", [&] {
    if (env.rank() != 0) return;
    print_calibration(cal, env.size(), cal.bandwidth_sizes);
    const std::string figures =
        cal.target.on_device()
            ? fmt::format(
                  "The figures are one CUDA device's (a device per rank, cores_per_node 0), measured with all {} "
                  "ranks running;",
                  env.size())
            : fmt::format(
                  "peak_tflops and memory_bandwidth_gbs are one core's, measured with all {} ranks running (a "
                  "rank gets rank_share of them);",
                  env.size());
    write_cluster(cal.spec, out_path,
                  fmt::format("This machine, measured by `mpirun -np {} meshtrain{} estimate --calibrate{} --out {}`.\n"
                              "{}\n{} Rerun to refresh them.",
                              env.size(), cal.target.on_device() ? " --set comm.device=cuda" : "",
                              opts.links_from.empty() ? "" : " --links-from " + opts.links_from, out_path, figures,
                              opts.links_from.empty()
                                  ? fmt::format("the links are this {}-rank run's.", env.size())
                                  : fmt::format("the links are NOT measured: taken from {}.", opts.links_from)));
    std::printf("\nwrote %s\n", out_path.c_str());
  });
  return 0;
}

}  // namespace mt
