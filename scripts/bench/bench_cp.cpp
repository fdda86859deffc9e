// Context parallel on CPU ranks: load balance and overlap of ring attention.
// Run under mpirun with N ranks (the cp group is the world):
//   bench_cp [--cp N] [--B 1] [--T 4096] [--H 8] [--KV 4] [--hd 64] [--iters 5] [--threads 1]
// 1. Load balance (on 1 rank, for --cp N; no communication): for head_tail and none, each cp rank's attention
//    work (the (query, key) scores its queries see, over its ring steps) and the time of its per-step
//    kernels forward + backward; prints max/mean of both (1.0 is perfect balance).
// 2. Overlap (on more than 1 rank, one core each so that no rank waits for a core): ring attention forward + backward end to end, against the same kernels alone
//    and the same transfers alone (blocking ring shifts, or the all-gathers and reduce-scatter); the
//    hidden share of the transfers is (compute + transfers - total) / transfers. The slowest rank counts.
// One JSON line per figure on rank 0.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attention/ring_attention.h"
#include "comm/env.h"
#include "comm/mesh.h"
#include "runtime/kernels/ops.h"
#include "tests/test_util.h"

using namespace mt;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Sizes {
  int64_t B = 1, T = 4096, H = 8, KV = 4, hd = 64, iters = 5;
};

// Scores a causal query chunk at q0 sees of a key chunk at k0 (both c long): full, triangular or none.
double visible_scores(int64_t q0, int64_t k0, int64_t c) {
  if (k0 > q0 + c - 1) return 0;
  if (k0 == q0) return double(c) * double(c + 1) / 2;
  return double(c) * double(c);
}

// Rank r's attention kernels over its ring steps, without communication (K/V of every step are stand-ins
// of the right shape): the per-pair forward, merge and backward that ring attention runs. Returns seconds.
double rank_compute(const Sizes& z, CpLoadBalance lb, int n, int r, double* work) {
  SequenceShard mine = sequence_shard(lb, z.T, n, r);
  const int64_t c = mine.chunk_len;
  Tensor q = test::randn({z.B, c, z.H, z.hd}, 1, DType::f32), k = test::randn({z.B, c, z.KV, z.hd}, 2, DType::f32),
         v = test::randn({z.B, c, z.KV, z.hd}, 3, DType::f32), dout = test::randn({z.B, c, z.H, z.hd}, 4, DType::f32);
  Tensor out = empty(q.shape(), DType::f32), lse = empty({z.B, z.H, c}, DType::f32);
  Tensor acc = zeros(q.shape(), DType::f32), acc_lse = empty(lse.shape(), DType::f32);
  Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
  for (int64_t i = 0; i < acc_lse.numel(); ++i) acc_lse.at<float>(i) = 0;
  *work = 0;
  auto t0 = Clock::now();
  for (int s = 0; s < n; ++s) {
    SequenceShard theirs = sequence_shard(lb, z.T, n, ((r - s) % n + n) % n);
    for (int64_t q0 : mine.chunk_pos)
      for (int64_t k0 : theirs.chunk_pos) {
        double w = visible_scores(q0, k0, c);
        if (w == 0) continue;
        *work += w;
        AttentionOptions o{true, 0, q0, k0, Tensor()};
        attention_forward(out, lse, q, k, v, o);
        attention_merge(acc, acc_lse, out, lse);
        attention_backward(dq, dk, dv, dout, q, k, v, acc, acc_lse, o, /*accumulate=*/true);
      }
  }
  return seconds_since(t0);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnv env(&argc, &argv);
  Sizes z;
  int threads = 1, cp_balance = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i], val = argv[i + 1];
    if (key == "--B") z.B = std::stoll(val);
    else if (key == "--T") z.T = std::stoll(val);
    else if (key == "--H") z.H = std::stoll(val);
    else if (key == "--KV") z.KV = std::stoll(val);
    else if (key == "--hd") z.hd = std::stoll(val);
    else if (key == "--iters") z.iters = std::stoll(val);
    else if (key == "--threads") threads = std::stoi(val);
    else if (key == "--cp") cp_balance = std::stoi(val);
    else {
      if (env.rank() == 0) std::fprintf(stderr, "bench_cp: unknown option %s\n", key.c_str());
      return 2;
    }
  }
  set_cpu_threads(threads);
  const int n = env.size();
  try {
    // 1. Load balance, on one rank (other ranks would spin in MPI and take its cores).
    if (n == 1) {
      const int n = cp_balance;
      for (CpLoadBalance lb : {CpLoadBalance::head_tail, CpLoadBalance::none}) {
        std::vector<double> work(static_cast<size_t>(n), 0.0), time(static_cast<size_t>(n), 0.0);
        for (int r = 0; r < n; ++r) {
          std::vector<double> ts;
          for (int64_t it = 0; it < z.iters; ++it) ts.push_back(rank_compute(z, lb, n, r, &work[size_t(r)]));
          time[size_t(r)] = median(ts);
        }
        auto ratio = [](const std::vector<double>& x) {
          double mx = *std::max_element(x.begin(), x.end()), mean = 0;
          for (double e : x) mean += e / double(x.size());
          return mx / mean;
        };
        std::string per_rank;
        for (int r = 0; r < n; ++r) per_rank += fmt::format("{}{:.4f}", r ? "," : "", time[size_t(r)]);
        std::printf(
            "{\"bench\": \"cp_load_balance\", \"cp\": %d, \"load_balance\": \"%s\", \"T\": %lld, "
            "\"work_max_over_mean\": %.3f, \"time_max_over_mean\": %.3f, \"rank_seconds\": [%s]}\n",
            n, cp_load_balance_name(lb).c_str(), (long long)z.T, ratio(work), ratio(time), per_rank.c_str());
        std::fflush(stdout);
      }
    }
    if (n == 1) return 0;
    // 2. Overlap, every rank.
    DeviceMesh mesh = DeviceMesh::create({{"cp", n}});
    Group& g = mesh.group("cp");
    const CpLoadBalance lb = CpLoadBalance::head_tail;
    const int64_t Tl = sequence_shard(lb, z.T, n, env.rank()).size();
    Tensor q = test::randn({z.B, Tl, z.H, z.hd}, 10 + uint64_t(env.rank()), DType::f32),
           k = test::randn({z.B, Tl, z.KV, z.hd}, 20 + uint64_t(env.rank()), DType::f32),
           v = test::randn({z.B, Tl, z.KV, z.hd}, 30 + uint64_t(env.rank()), DType::f32),
           dout = test::randn({z.B, Tl, z.H, z.hd}, 40 + uint64_t(env.rank()), DType::f32);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({z.B, z.H, Tl}, DType::f32);
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
    double work = 0;
    std::vector<double> computes;
    for (int64_t it = 0; it < z.iters; ++it) computes.push_back(rank_compute(z, lb, n, env.rank(), &work));
    const double compute = median(computes);
    for (CpMethod method : {CpMethod::ring, CpMethod::all_gather}) {
      RingAttentionOptions o;
      o.group = &g, o.method = method, o.load_balance = lb, o.seq_len = z.T;
      std::vector<double> totals, comms;
      Tensor kv = empty({2 * k.numel()}, DType::f32), kv2 = empty(kv.shape(), DType::f32);
      Tensor all = empty({int64_t(n) * kv.numel()}, DType::f32);
      for (int64_t it = 0; it <= z.iters; ++it) {  // the first round warms up
        g.barrier();
        auto t0 = Clock::now();
        ring_attention_forward(out, lse, q, k, v, o);
        ring_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
        double total = seconds_since(t0);
        g.barrier();
        t0 = Clock::now();
        if (method == CpMethod::ring) {  // forward n-1 K/V shifts; backward n-1 K/V and n dK/dV shifts
          for (int s = 0; s < 3 * n - 2; ++s) g.ring_shift(kv2, kv);
        } else {  // all-gather of K/V forward and backward, reduce-scatter of dK/dV
          g.all_gather(all, kv);
          g.all_gather(all, kv);
          g.reduce_scatter(kv2, all, ReduceOp::sum);
        }
        double comm = seconds_since(t0);
        if (it > 0) totals.push_back(total), comms.push_back(comm);
      }
      // The slowest rank's figures.
      Tensor figs = from_values({median(totals), compute, median(comms)}, {3}, DType::f64);
      g.all_reduce(figs, ReduceOp::max);
      const double fig[3] = {figs.at<double>(0), figs.at<double>(1), figs.at<double>(2)};
      if (env.rank() == 0) {
        // Hidden share, clamped to [0, 1]: a total below the compute alone is noise, not negative transfers.
        double hidden = fig[2] > 0 ? std::clamp((fig[1] + fig[2] - fig[0]) / fig[2], 0.0, 1.0) : 1.0;
        std::printf(
            "{\"bench\": \"cp_overlap\", \"cp\": %d, \"method\": \"%s\", \"T\": %lld, \"KV\": %lld, "
            "\"hd\": %lld, \"total_s\": %.4f, \"compute_s\": %.4f, \"transfers_s\": %.4f, \"sum_s\": %.4f, "
            "\"total_over_sum\": %.3f, \"hidden_share\": %.2f}\n",
            n, cp_method_name(method).c_str(), (long long)z.T, (long long)z.KV, (long long)z.hd, fig[0], fig[1], fig[2],
            fig[1] + fig[2], fig[0] / (fig[1] + fig[2]), hidden);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 0;
}
