// What calibrate.cpp (the rates of compute and memory, the file) and calibrate_links.cpp (the links) share: where
// the measurements run (Target, chosen once), the timing rule, and a link's fit. Private to runtime/planner.
#pragma once
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/world.h"
#include "runtime/core/device.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"
#include "runtime/planner/cluster.h"

namespace mt::calibrate_detail {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// The median over the world's ranks of a figure each rank measured (collective).
double median_over_ranks(double x, std::string_view label);

// Where the measurements run, chosen once (calibrate's setup). CPU ranks: host tensors in f32, the CPU kernels'
// fast path (bf16 there is f32 arithmetic on widened copies, ops.h). comm.device cuda: each rank's own CUDA device
// (rank_device's, as train picks it), the ops in bf16 as training runs them on a GPU (weight gradients, statistics
// and the optimizer's master copy f32, the mixed-precision rule), the collectives on device buffers through the
// mesh's backend (nccl with a device per rank, as in training).
struct Target {
  Device device = Device::cpu();
  DType dtype = DType::f32;  // the ops' activations and weights
  int ranks_per_device = 1;  // on a device: the node's ranks sharing one (local ranks / visible devices, rounded up)
  bool on_device() const { return device.is_cuda(); }
  // Device work is asynchronous: a time read before the device is done would be the launches'. CPU ops return
  // done.
  void sync() const {
    if (device.is_cuda()) device_synchronize();
  }
  // Values in [-0.5, 0.5) (no denormals, NaNs or overflow to slow or break the kernels), in dt (default: the
  // target's dtype), on the target's device.
  Tensor filled(const Shape& s, std::optional<DType> dt = {}) const {
    Tensor t = empty(s, DType::f32);
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = float((i * 7919) % 1000) * 1e-3f - 0.5f;
    if (const DType want = dt.value_or(dtype); want != DType::f32) {
      Tensor c = empty(s, want);
      convert(c, t);
      t = c;
    }
    return t.to(device);
  }
  Tensor uninit(const Shape& s, std::optional<DType> dt = {}) const { return empty(s, dt.value_or(dtype), device); }
  Tensor zeroed(const Shape& s, std::optional<DType> dt = {}) const { return zeros(s, dt.value_or(dtype), device); }
};

// fn's time with every rank running it at once, as in training: each repetition starts on all ranks together (a
// barrier) and lasts until the slowest rank is done (on a device, until its work is done: tg.sync()); the median
// over iters repetitions after one warm-up. The slowest rank, not each rank's own time: with more ranks than cores,
// an op shorter than the scheduler's time slice can run undisturbed on one rank while the others wait for a core,
// and its own time would promise a rate that all ranks together never reach.
template <class F> double time_median(const Target& tg, int iters, std::string_view label, F&& fn) {
  fn();
  tg.sync();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    world::barrier(label);
    auto t0 = Clock::now();
    fn();
    tg.sync();
    t.push_back(seconds_since(t0));
  }
  world::all_reduce(std::span(t), ReduceOp::max, label);
  return median(t);
}

// One collective kind's measurement on groups of n ranks.
struct CollectiveTime {
  std::string kind;
  bool async = false;  // issued non-blocking and waited (bandwidth_gbs_by_kind's "<kind>_async")
  double small_s = 0;  // the small message: median over iterations of the slowest rank's time
  // Per bandwidth size: what one rank sends (comm_counters.h) and the time, as small_s.
  std::vector<std::pair<double, double>> large;
};

struct LinkFit {
  int ranks = 0;
  std::string backend;  // the mesh's, resolved (auto: nccl with a device per rank, else mpi)
  LinkSpec link;
  std::vector<CollectiveTime> kinds;
};

// Groups of n ranks, all of the world's ranks in such groups at once: latency, bandwidth by kind and (CPU ranks)
// the sync wait (calibrate_links.cpp).
LinkFit measure_link(const Target& tg, int world, int n, const std::string& backend, const CalibrateOptions& o);

}  // namespace mt::calibrate_detail
