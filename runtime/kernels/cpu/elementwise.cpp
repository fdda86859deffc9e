// Element-wise ops and deterministic reductions.
#include <algorithm>
#include <memory>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void add(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T> void scale(T* t, double s, int64_t n) {
  const T f = T(s);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) t[i] *= f;
}

namespace {
// Partial sums over fixed chunks, added in chunk order: the same bits for any thread count.
template <typename T, typename F> double chunked_sum(const T* t, int64_t n, F f) {
  int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  // Not std::vector: no out-of-line std instances in a per-level file (isa_level.h).
  std::unique_ptr<double[]> part(new double[size_t(std::max<int64_t>(chunks, 1))]());
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    for (int64_t i = c * kReduceChunk, e = std::min(n, (c + 1) * kReduceChunk); i < e; ++i) s += f(double(t[i]));
    part[size_t(c)] = s;
  }
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += part[size_t(c)];
  return total;
}
}  // namespace

template <typename T> double sum_squares(const T* t, int64_t n) {
  return chunked_sum(t, n, [](double x) { return x * x; });
}
template <typename T> double sum(const T* t, int64_t n) {
  return chunked_sum(t, n, [](double x) { return x; });
}

template void add<float>(float*, const float*, const float*, int64_t);
template void add<double>(double*, const double*, const double*, int64_t);
template void scale<float>(float*, double, int64_t);
template void scale<double>(double*, double, int64_t);
template double sum_squares<float>(const float*, int64_t);
template double sum_squares<double>(const double*, int64_t);
template double sum<float>(const float*, int64_t);
template double sum<double>(const double*, int64_t);

}  // namespace mt::cpu::MT_CPU_ISA
