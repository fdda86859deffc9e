// Calibration's links (calibrate_internal.h measure_link): every collective kind the runtime issues, timed on groups
// of n ranks on the target's device, fitted to a latency and a bandwidth per kind; on CPU ranks also the wait a call
// adds when its members come from computing (LinkSpec::sync_us).
#include <algorithm>

#include "comm/mesh.h"
#include "runtime/planner/calibrate_internal.h"
#include "runtime/planner/cluster_internal.h"

namespace mt::calibrate_detail {

using cluster_detail::kAsyncKinds;

// The median over the world's ranks of a figure each rank measured (collective).
double median_over_ranks(double x, std::string_view label) { return median(world::all_gather(x, label)); }

namespace {

// The kinds measured: those of data parallel, fully_shard, tp and cp (ring_shift: ring attention's K/V passing).
const std::vector<std::string> kFitKinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_shift"};

// Buffers for kind on n ranks holding `bytes` in all (nccl-tests' size: the all_reduce buffer, the all_gather
// output, the reduce_scatter input), as f32 elements, a multiple of n, on the target's device.
// One collective of a kind on its buffers, issued and waited (calibration's own, as train issues it).
struct CollectiveCall {
  Group& g;
  std::string kind;
  int64_t count, m;  // the whole buffer's f32 elements (a multiple of n), a rank's part of it
  Tensor whole, part, out;
  CollectiveCall(const Target& tg, Group& group, std::string k, int64_t bytes)
      : g(group), kind(std::move(k)), count(std::max<int64_t>(g.size(), bytes / 4 / g.size() * g.size())),
        m(count / g.size()), whole(tg.filled({count}, DType::f32)), part(tg.filled({m}, DType::f32)),
        out(tg.uninit({count}, DType::f32)) {}
  // async: issued non-blocking and waited at once, as the runtime issues gradient buckets, fully_shard's transfers
  // and ring attention's shifts (Open MPI runs its non-blocking collectives by other algorithms). On a device the
  // wait may only order the rank's stream after the collective: the caller's tg.sync() waits for it.
  void run(bool async = false) {
    Work w;
    if (kind == "all_reduce") w = g.all_reduce(whole, ReduceOp::sum, async);
    else if (kind == "all_gather") w = g.all_gather(out, part, async);
    else if (kind == "reduce_scatter") w = g.reduce_scatter(part, whole, ReduceOp::sum, async);
    else if (kind == "all_to_all") w = g.all_to_all(out, whole, async);
    else w = g.ring_shift(out, whole, 1, async);
    w.wait();
  }
};

double time_collective(const Target& tg, Group& g, const std::string& kind, int64_t bytes, int iters, double* sent,
                       bool async = false) {
  const int n = g.size();
  CollectiveCall call(tg, g, kind, bytes);
  auto run = [&] {
    call.run(async);
    tg.sync();
  };
  run();
  std::vector<double> t(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    world::barrier("calibration: collective");
    auto t0 = Clock::now();
    run();
    t[size_t(i)] = seconds_since(t0);
  }
  // An iteration lasts as long as its slowest rank (as meshtrain check times it).
  world::all_reduce(std::span(t), ReduceOp::max, "calibration: collective time");
  const double whole_bytes = double(call.count) * 4;
  *sent = kind == "all_reduce"   ? whole_bytes * 2.0 * (n - 1) / n
          : kind == "ring_shift" ? whole_bytes
                                 : whole_bytes * double(n - 1) / n;
  return median(t);
}

// The wait one collective call adds when its members come from computing, as in a training step (LinkSpec::sync_us):
// with more ranks than cores a member may not be scheduled when the others arrive, and the waiting ranks' polling
// takes cores from the computing ones; collectives timed back to back show none of it. Every rank, in groups of n,
// runs `calls` repetitions of (work; a small collective) and then of the work alone, for each kind in turn, reps
// times; a sample is the difference per call (each loop's time its slowest rank's) less the kind's own time back
// to back (own_s, so that its latency is not counted twice), the wait the median of the samples (the scheduler makes
// single loops differ by milliseconds) and the segment the work alone's time per call. The work is a
// (rows, 256) x (768, 256)^T GEMM: 256 rows are about what a rank computes between two collectives of a
// tensor-parallel decoder layer of a small model, 4096 rows a data-parallel rank's between its few.
struct SyncPoint {
  double segment_s = 0, wait_s = 0;
};
SyncPoint time_sync(const Target& tg, Group& g, const std::vector<std::pair<std::string, double>>& kinds_own_s,
                    int64_t latency_bytes, int64_t rows, int calls, int reps) {
  Tensor inp = tg.filled({rows, 256}), w = tg.filled({768, 256}), out = tg.uninit({rows, 768});
  auto loop = [&](CollectiveCall* call) {
    world::barrier("calibration: sync");
    auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) {
      matmul_forward(out, inp, w);
      if (call) call->run();
    }
    tg.sync();
    return seconds_since(t0);
  };
  std::vector<CollectiveCall> kinds;
  for (auto& [kind, own] : kinds_own_s) kinds.emplace_back(tg, g, kind, latency_bytes);
  std::vector<double> with, without;
  for (int r = 0; r <= reps; ++r)  // the first round warms up
    for (CollectiveCall& call : kinds) {
      const double a = loop(&call), b = loop(nullptr);
      if (r > 0) with.push_back(a), without.push_back(b);
    }
  world::all_reduce(std::span(with), ReduceOp::max, "calibration: sync time");
  world::all_reduce(std::span(without), ReduceOp::max, "calibration: sync time");
  std::vector<double> samples;
  for (size_t i = 0; i < with.size(); ++i)
    samples.push_back((with[i] - without[i]) / calls - kinds_own_s[i % kinds_own_s.size()].second);
  return {median(without) / calls, std::max(0.0, median(samples))};
}

// Groups of n ranks (all of the world's ranks in such groups at once): the latency is the median over the kinds of
// the small message's time per message step; each kind's bandwidth the median over the sizes of the bytes sent
// over the time less the latency; bandwidth_gbs, for the kinds not measured, the kinds' median. The mesh on the
// target's device, the buffers there (on a device with the nccl backend, as training's collectives). sync_us only
// on CPU ranks: ranks with a device each have no such wait (cluster.h), and the estimate adds none for them.

}  // namespace

LinkFit measure_link(const Target& tg, int world, int n, const std::string& backend, const CalibrateOptions& o) {
  MeshOptions mo;
  mo.device = tg.device;
  mo.backend = backend;
  std::vector<MeshDim> dims;
  if (world / n > 1) dims.push_back({"calibrate_groups", world / n});
  dims.push_back({"calibrate_ranks", n});
  DeviceMesh mesh = DeviceMesh::create(dims, mo);
  Group& g = mesh.group("calibrate_ranks");
  LinkFit fit;
  fit.ranks = n;
  fit.backend = mesh.backend();
  std::vector<double> per_step;
  for (const std::string& kind : kFitKinds) {
    CollectiveTime ct;
    ct.kind = kind;
    double unused = 0;
    ct.small_s = time_collective(tg, g, kind, o.latency_bytes, o.collective_iters, &unused);
    for (int64_t size : o.bandwidth_sizes) {
      double sent = 0;
      const double t = time_collective(tg, g, kind, size, o.collective_iters, &sent);
      ct.large.push_back({sent, t});
    }
    per_step.push_back(ct.small_s / collective_steps(kind, n));
    fit.kinds.push_back(ct);
  }
  // The kinds the runtime also issues non-blocking, at the bandwidth sizes (the latency is the blocking ones').
  for (const std::string& kind : kAsyncKinds) {
    CollectiveTime ct;
    ct.kind = kind;
    ct.async = true;
    for (int64_t size : o.bandwidth_sizes) {
      double sent = 0;
      const double t = time_collective(tg, g, kind, size, o.collective_iters, &sent, true);
      ct.large.push_back({sent, t});
    }
    fit.kinds.push_back(ct);
  }
  // Medians, not least squares: with more ranks than cores a rank's reply waits for the scheduler, and one kind's
  // or one size's time can be several times the others'.
  const double alpha = median(per_step);
  std::vector<double> bws;
  for (auto& ct : fit.kinds) {
    std::vector<double> rates;  // bytes / (time - steps x latency) at each size
    for (auto& [bytes, t] : ct.large)
      // At least a quarter of the time: where the latency is most of it, the size says little of the bandwidth.
      rates.push_back(bytes / std::max(t - collective_steps(ct.kind, n) * alpha, 0.25 * t));
    const double bw = median(rates) / 1e9;
    fit.link.bandwidth_gbs_by_kind[ct.async ? ct.kind + "_async" : ct.kind] = bw;
    if (!ct.async) bws.push_back(bw);
  }
  fit.link.bandwidth_gbs = median(bws);
  fit.link.latency_us = alpha * 1e6;
  if (tg.on_device()) return fit;
  // sync_us over the kinds a training step calls most (tp and fully_shard's, data parallel's).
  std::vector<std::pair<std::string, double>> own;
  for (auto& ct : fit.kinds)
    if (!ct.async && (ct.kind == "all_reduce" || ct.kind == "all_gather" || ct.kind == "reduce_scatter"))
      own.push_back({ct.kind, ct.small_s});
  for (int64_t rows : o.sync_rows) {
    const int calls = std::max<int>(4, int(o.sync_calls * o.sync_rows.front() / rows));
    const SyncPoint p = time_sync(tg, g, own, o.latency_bytes, rows, calls, o.sync_reps);
    fit.link.sync_us[p.segment_s * 1e3] = p.wait_s * 1e6;
  }
  return fit;
}

}  // namespace mt::calibrate_detail
