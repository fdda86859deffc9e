// Softmax cross-entropy and its vocab-parallel pieces (ops.h cross_entropy_forward_backward, vocab_shard_*;
// declared in runtime/kernels/cpu/cross_entropy.cpp): a warp per row of logits (N, V).

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// Online max and sum of exponentials of a row, per lane then merged across the warp; each lane W logits at a time
// (Pack: one 16-byte load where the launcher found V a multiple of W and the rows aligned; W = 1 otherwise).
template <typename T, int W> __device__ void row_stats(const T* x, int64_t V, int lane, float* mx_out, double* se_out) {
  using P = Pack<T, W>;
  float m = -INFINITY;
  double s = 0;
  for (int64_t p = lane; p < V / W; p += 32) {
    const P xp = reinterpret_cast<const P*>(x)[p];
    float pm = m;
#pragma unroll
    for (int e = 0; e < W; ++e) pm = fmaxf(pm, ld(xp.v[e]));
    if (pm > m) {
      s = m == -INFINITY ? 0.0 : s * exp(double(m) - pm);
      m = pm;
    }
#pragma unroll
    for (int e = 0; e < W; ++e) s += double(__expf(ld(xp.v[e]) - m));
  }
  float M = warp_max(m);
  s = m == -INFINITY ? 0.0 : s * exp(double(m) - M);
  *mx_out = M;
  *se_out = warp_sum_d(s);
}

// A warp per row: one read for the statistics, one pass writing the gradient over the logits' buffer; W logits a
// lane at a time, as row_stats.
template <typename T, int W> __global__ void cross_entropy_k(float* losses, T* dlogits, const T* logits,
                                                             const int32_t* targets, int64_t N, int64_t V,
                                                             float scale) {
  using P = Pack<T, W>;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = logits + row * V;
  int32_t t = targets[row];
  if (t < 0) {
    if (lane == 0) losses[row] = 0.0f;
    if (dlogits)
      for (int64_t v = lane; v < V; v += 32) dlogits[row * V + v] = to<T>(0.0f);
    return;
  }
  float mx;
  double se;
  row_stats<T, W>(x, V, lane, &mx, &se);
  double lse = mx + log(se);
  float xt = ld(x[t]);
  __syncwarp();  // every lane has read x[t] before the gradient overwrites it
  if (lane == 0) losses[row] = float(lse - xt);
  if (dlogits) {
    for (int64_t p = lane; p < V / W; p += 32) {
      const P xp = reinterpret_cast<const P*>(x)[p];  // each lane reads its pack, then overwrites it
      P g;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        // The exponent in f64 (logits near lse lose nothing), the exponential in f32 (relative error ~1e-7, below
        // the gradient's rounding): f64's exp is a long software sequence, one per logit of an (N, V) pass.
        const float pr = expf(float(double(ld(xp.v[e])) - lse)) * scale;
        g.v[e] = to<T>(p * W + e == t ? pr - scale : pr);
      }
      reinterpret_cast<P*>(dlogits + row * V)[p] = g;
    }
  }
}

}  // namespace

template <typename T> int cross_entropy(float* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                        int64_t V, double grad_scale, void* stream) {
  Range r("cross_entropy");
  if (N == 0) return 0;
  const bool packed = packable(V, kPack<T>, logits) && (!dlogits || packable(V, kPack<T>, dlogits));
  auto kernel = packed ? cross_entropy_k<Dev<T>, kPack<T>> : cross_entropy_k<Dev<T>, 1>;
  MT_LAUNCH(kernel, blocks_for(N * 32), kThreads, 0, st(stream), losses, dp(dlogits), dp(logits), targets, N, V,
            float(grad_scale));
  return last_error();
}

namespace {

// Vocab-parallel: the statistics (N) f64 between the tensor-parallel all-reduces.
template <typename T> __global__ void vocab_max_k(double* row_max, const T* logits, int64_t N, int64_t V) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  double m = -INFINITY;
  for (int64_t v = lane; v < V; v += 32) m = fmax(m, double(ld(logits[row * V + v])));
  m = warp_max_d(m);
  if (lane == 0) row_max[row] = m;
}
template <typename T> __global__ void vocab_sumexp_k(double* sumexp, double* target_logit, const T* logits,
                                                     const int32_t* targets, const double* row_max, int64_t N,
                                                     int64_t V, int64_t vocab_begin) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  double m = row_max[row], s = 0;
  for (int64_t v = lane; v < V; v += 32) s += exp(double(ld(logits[row * V + v])) - m);
  s = warp_sum_d(s);
  if (lane == 0) {
    int64_t t = int64_t(targets[row]) - vocab_begin;
    sumexp[row] = s;
    target_logit[row] = (targets[row] >= 0 && t >= 0 && t < V) ? double(ld(logits[row * V + t])) : 0.0;
  }
}
template <typename T> __global__ void vocab_loss_k(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                                                   const double* row_max, const double* sumexp,
                                                   const double* target_logit, int64_t N, int64_t V,
                                                   int64_t vocab_begin, float scale) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  bool ignored = targets[row] < 0;
  double lse = log(sumexp[row]) + row_max[row];
  if (lane == 0) losses[row] = ignored ? 0.0f : float(lse - target_logit[row]);
  if (!dlogits) return;
  int64_t t = int64_t(targets[row]) - vocab_begin;
  for (int64_t v = lane; v < V; v += 32) {
    float p = ignored ? 0.0f : expf(float(double(ld(logits[row * V + v])) - lse)) * scale;  // as cross_entropy_k
    dlogits[row * V + v] = to<T>(!ignored && v == t ? p - scale : p);
  }
}

}  // namespace

template <typename T> int vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V, void* stream) {
  Range r("vocab_shard_max");
  if (N == 0) return 0;
  MT_LAUNCH(vocab_max_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), row_max, dp(logits), N, V);
  return last_error();
}
template <typename T> int vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                             const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                             int64_t vocab_begin, void* stream) {
  Range r("vocab_shard_sumexp");
  if (N == 0) return 0;
  MT_LAUNCH(vocab_sumexp_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), sumexp, target_logit, dp(logits),
            targets, row_max, N, V, vocab_begin);
  return last_error();
}
template <typename T> int vocab_shard_loss(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                                           const double* row_max, const double* sumexp, const double* target_logit,
                                           int64_t N, int64_t V, int64_t vocab_begin, double grad_scale, void* stream) {
  Range r("vocab_shard_loss");
  if (N == 0) return 0;
  MT_LAUNCH(vocab_loss_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), losses, dp(dlogits), dp(logits), targets,
            row_max, sumexp, target_logit, N, V, vocab_begin, float(grad_scale));
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                                             \
  template int cross_entropy<T>(float*, T*, const T*, const int32_t*, int64_t, int64_t, double, void*);               \
  template int vocab_shard_max<T>(double*, const T*, int64_t, int64_t, void*);                                        \
  template int vocab_shard_sumexp<T>(double*, double*, const T*, const int32_t*, const double*, int64_t, int64_t,     \
                                     int64_t, void*);                                                                 \
  template int vocab_shard_loss<T>(float*, T*, const T*, const int32_t*, const double*, const double*, const double*, \
                                   int64_t, int64_t, int64_t, double, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
