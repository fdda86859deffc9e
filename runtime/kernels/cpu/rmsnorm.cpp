// RMSNorm: y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps), statistics in f64.
// Backward: with xhat = x * rstd and g = dy * w,
//   dx = rstd * (g - xhat * mean(g * xhat)),  dw += sum_rows dy * xhat.
#include <algorithm>
#include <cmath>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                           double eps, T* sum, const T* residual) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;  // (C)
    T* y = out + n * C;        // (C)
    if (residual) {            // the residual add, fused: the row is still in cache for the norm
      T* s = sum + n * C;
      for (int64_t c = 0; c < C; ++c) s[c] = x[c] + residual[n * C + c];
      x = s;
    }
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * double(x[c]);
    T r = T(1.0 / std::sqrt(ss / double(C) + eps));
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
  }
}

template <typename T> void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                                            const T* rstd, int64_t N, int64_t C, const T* dresidual) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    T* dx = dinp + n * C;
    double r = double(rstd[n]), dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += double(dy[c]) * double(weight[c]) * double(x[c]) * r;
    double mean = dot / double(C);
    const T* dres = dresidual ? dresidual + n * C : nullptr;
    for (int64_t c = 0; c < C; ++c)
      dx[c] = T(r * (double(dy[c]) * double(weight[c]) - double(x[c]) * r * mean) + (dres ? double(dres[c]) : 0.0));
  }
  // dw: columns split across threads, each summed over rows in order (deterministic).
  constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += kCols) {
    int64_t c1 = std::min(C, c0 + kCols);
    double acc[kCols] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      double r = double(rstd[n]);
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += double(dy[c]) * double(x[c]) * r;
    }
    for (int64_t c = c0; c < c1; ++c) dweight[c] += T(acc[c - c0]);
  }
}

template void rmsnorm_forward<float>(float*, float*, const float*, const float*, int64_t, int64_t, double, float*,
                                     const float*);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, int64_t, int64_t, double, double*,
                                      const double*);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*, const float*, int64_t,
                                      int64_t, const float*);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*, const double*, const double*,
                                       int64_t, int64_t, const double*);

}  // namespace mt::cpu::MT_CPU_ISA
