// Softmax cross-entropy fused over each row of logits: one pass for the max,
// one for the sum of exponentials, one writing the gradient
// (softmax - onehot) * grad_scale, so the probabilities are never stored.
#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                         int64_t V, double grad_scale) {
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

// Vocab-parallel pieces: each rank holds columns [vocab_begin, vocab_begin + V) of every row.
template <typename T> void vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[n * V + v]));
    row_max[n] = mx;
  }
}

template <typename T> void vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                              const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                              int64_t vocab_begin) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(double(x[v]) - row_max[n]);
    sumexp[n] = se;
    int64_t t = int64_t(targets[n]) - vocab_begin;
    target_logit[n] = (targets[n] >= 0 && t >= 0 && t < V) ? double(x[t]) : 0.0;
  }
}

template <typename T> void vocab_shard_loss(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                                            const double* row_max, const double* sumexp, const double* target_logit,
                                            int64_t N, int64_t V, int64_t vocab_begin, double grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const bool ignored = targets[n] < 0;
    const double lse = row_max[n] + std::log(sumexp[n]);
    losses[n] = ignored ? T(0) : T(lse - target_logit[n]);
    if (!dlogits) continue;
    const T* x = logits + n * V;
    T* d = dlogits + n * V;
    for (int64_t v = 0; v < V; ++v) d[v] = ignored ? T(0) : T(std::exp(double(x[v]) - lse) * grad_scale);
    int64_t t = int64_t(targets[n]) - vocab_begin;
    if (!ignored && t >= 0 && t < V) d[t] -= T(grad_scale);
  }
}

#define MT_VOCAB_SHARD(T)                                                                                          \
  template void vocab_shard_max<T>(double*, const T*, int64_t, int64_t);                                           \
  template void vocab_shard_sumexp<T>(double*, double*, const T*, const int32_t*, const double*, int64_t, int64_t, \
                                      int64_t);                                                                    \
  template void vocab_shard_loss<T>(T*, T*, const T*, const int32_t*, const double*, const double*, const double*, \
                                    int64_t, int64_t, int64_t, double);
MT_VOCAB_SHARD(float)
MT_VOCAB_SHARD(double)
#undef MT_VOCAB_SHARD

template void cross_entropy<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t, double);
template void cross_entropy<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t, double);

}  // namespace mt::cpu::MT_CPU_ISA
