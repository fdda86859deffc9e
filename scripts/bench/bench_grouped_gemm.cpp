// The CPU grouped GEMM (ops.h grouped_matmul_forward / _backward: one Eigen GEMM per group on row views)
// against one dense GEMM of the same FLOPs: an MoE layer's first projection, M = N K routed rows split over E
// experts, each (M_g, C) @ (F, C)^T, against (M, C) @ (F, C)^T. Balanced routing (M / E rows each) and an
// imbalanced one (group g gets a share growing with g, one group empty). Prints GFLOP/s and grouped / dense.
//   bench_grouped_gemm [--E 8] [--K 2] [--N 2048] [--C 512] [--F 1408] [--threads 2] [--iters 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "runtime/kernels/ops.h"
#include "tests/test_util.h"

using namespace mt;

namespace {

// The best of iters timed calls after one warm-up, in seconds (the best: the machine is shared).
double best_s(int64_t iters, const std::function<void()>& f) {
  f();
  double best = 1e30;
  for (int64_t i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// M rows over E groups: balanced, or group g's share proportional to g (group 0 empty).
std::vector<int64_t> counts_for(int64_t M, int64_t E, bool balanced) {
  std::vector<int64_t> c(static_cast<size_t>(E));
  int64_t total = 0, weight = E * (E - 1) / 2;
  for (int64_t g = 0; g < E; ++g) total += c[size_t(g)] = balanced ? M / E : M * g / weight;
  c[size_t(E - 1)] += M - total;  // the remainder to the last group
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t E = 8, K = 2, N = 2048, C = 512, F = 1408, threads = 2, iters = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::stoll(argv[i + 1]);
    if (k == "--E") E = v;
    else if (k == "--K") K = v;
    else if (k == "--N") N = v;
    else if (k == "--C") C = v;
    else if (k == "--F") F = v;
    else if (k == "--threads") threads = v;
    else if (k == "--iters") iters = v;
    else {
      std::fprintf(stderr, "bench_grouped_gemm: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  set_cpu_threads(int(threads));
  const int64_t M = N * K;
  const double fwd_flop = 2.0 * double(M) * double(C) * double(F);
  Tensor x = test::randn({M, C}, 1, DType::f32), dy = test::randn({M, F}, 2, DType::f32);
  Tensor wg = test::randn({E, F, C}, 3, DType::f32, 0.05), w = wg.view(0, {F, C});
  Tensor y = empty({M, F}, DType::f32), dx = empty({M, C}, DType::f32), dwg = zeros({E, F, C}, DType::f32);
  std::printf("M=%lld (N=%lld K=%lld) E=%lld C=%lld F=%lld f32 threads=%lld\n", (long long)M, (long long)N,
              (long long)K, (long long)E, (long long)C, (long long)F, (long long)threads);
  // Dense: the same FLOPs in one GEMM (forward), and dinp + dweight (backward).
  const double dense_f = best_s(iters, [&] { matmul_forward(y, x, w); });
  const double dense_b = best_s(iters, [&] { matmul_backward(dx, dwg.view(0, {F, C}), dy, x, w); });
  std::printf("%-12s forward %7.2f GFLOP/s   backward %7.2f GFLOP/s\n", "dense", fwd_flop / dense_f * 1e-9,
              2 * fwd_flop / dense_b * 1e-9);
  for (bool balanced : {true, false}) {
    const auto counts = counts_for(M, E, balanced);
    const double gf = best_s(iters, [&] { grouped_matmul_forward(y, x, wg, counts); });
    const double gb = best_s(iters, [&] { grouped_matmul_backward(dx, dwg, dy, x, wg, counts); });
    std::printf("%-12s forward %7.2f GFLOP/s (%5.1f%% of dense)   backward %7.2f GFLOP/s (%5.1f%% of dense)\n",
                balanced ? "balanced" : "imbalanced", fwd_flop / gf * 1e-9, 100 * dense_f / gf,
                2 * fwd_flop / gb * 1e-9, 100 * dense_b / gb);
  }
  return 0;
}
