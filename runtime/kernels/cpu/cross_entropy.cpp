// Softmax cross-entropy fused over each row of logits: one pass for the max,
// one for the sum of exponentials, one writing the gradient
// (softmax - onehot) * grad_scale, so the probabilities are never stored.
#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/kernels/cpu/cpu_ops.h"

namespace mt::cpu {

template <typename T>
void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N, int64_t V,
                   double grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;  // (V)
    int32_t tgt = targets[n];
    if (tgt < 0) {  // ignored position
      losses[n] = T(0);
      if (dlogits) std::fill(dlogits + n * V, dlogits + (n + 1) * V, T(0));
      continue;
    }
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(x[v]));
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(double(x[v]) - mx);
    double lse = mx + std::log(se);
    losses[n] = T(lse - double(x[tgt]));
    if (dlogits) {
      T* d = dlogits + n * V;  // may alias x: each element is read before it is written
      for (int64_t v = 0; v < V; ++v) d[v] = T(std::exp(double(x[v]) - lse) * grad_scale);
      d[tgt] -= T(grad_scale);
    }
  }
}

template void cross_entropy<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t, double);
template void cross_entropy<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t, double);

}  // namespace mt::cpu
