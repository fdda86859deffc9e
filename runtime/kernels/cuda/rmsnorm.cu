// RMSNorm (ops.h rmsnorm_forward, add_rmsnorm_forward, rmsnorm_backward; declared in
// runtime/kernels/cpu/rmsnorm.cpp): a warp per row, the sums in f64 across the warp; dweight summed over
// fixed chunks of rows, then the chunks in order (deterministic).

#include <algorithm>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// out (N, C), rstd (N) f32, inp (N, C), weight (C); with residual: sum (N, C) = inp + residual first.
// A warp per row; the sum of squares in fp32 per lane, then across the warp in double.
template <typename T> __global__ void rmsnorm_fwd_k(T* out, float* rstd, const T* inp, const T* w, int64_t N, int64_t C,
                                                    float eps, T* sum, const T* residual) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  double ss = 0;
  if (residual) {          // fused residual add: sum = inp + residual, rounded as add() rounds; the norm reads it back
    T* s = sum + row * C;  // from the cache (each lane re-reads only what it wrote)
    for (int64_t c = lane; c < C; c += 32) {
      const T v = to<T>(ld(x[c]) + ld(residual[row * C + c]));
      s[c] = v;
      ss += double(ld(v)) * ld(v);
    }
    x = s;
  } else {
    for (int64_t c = lane; c < C; c += 32) ss += double(ld(x[c])) * ld(x[c]);
  }
  ss = warp_sum_d(ss);
  float r = float(1.0 / sqrt(ss / double(C) + double(eps)));
  if (lane == 0) rstd[row] = r;
  // Hugging Face's order: normalise in fp32, round to the activation type, then scale by the weight.
  for (int64_t c = lane; c < C; c += 32) out[row * C + c] = to<T>(ld(to<T>(ld(x[c]) * r)) * ld(w[c]));
}

}  // namespace

template <typename T> int rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                          double eps, void* stream) {
  Range r("rmsnorm_forward");
  if (N == 0) return 0;
  MT_LAUNCH(rmsnorm_fwd_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), dp(out), rstd, dp(inp), dp(weight), N,
            C, float(eps), dp(static_cast<T*>(nullptr)), dp(static_cast<const T*>(nullptr)));
  return last_error();
}

template <typename T> int add_rmsnorm_forward(T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                                              int64_t N, int64_t C, double eps, void* stream) {
  Range r("add_rmsnorm_forward");
  if (N == 0) return 0;
  MT_LAUNCH(rmsnorm_fwd_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), dp(out), rstd, dp(a), dp(weight), N, C,
            float(eps), dp(sum), dp(b));
  return last_error();
}

namespace {

// dinp (N, C) from dout (N, C); dweight (C) f32 += the sum over rows of dout * inp * rstd.
template <typename T> __global__ void rmsnorm_bwd_dx_k(T* dinp, const T* dout, const T* inp, const T* w,
                                                       const float* rstd, int64_t N, int64_t C, const T* dres) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  double r = rstd[row], dot = 0;
  for (int64_t c = lane; c < C; c += 32) dot += double(ld(dy[c])) * ld(w[c]) * ld(x[c]) * r;
  dot = warp_sum_d(dot);
  double mean = dot / double(C);
  for (int64_t c = lane; c < C; c += 32) {
    double v = r * (double(ld(dy[c])) * ld(w[c]) - double(ld(x[c])) * r * mean);
    if (dres) v += ld(dres[row * C + c]);  // the residual branch's gradient, fused: one rounding
    dinp[row * C + c] = to<T>(float(v));
  }
}

constexpr int64_t kRowChunk = 256;
// scratch[chunk][c] = sum over the chunk's rows of dy * x * rstd, rows in order. The grid's y covers the chunks
// in strides of gridDim.y (at most 65,535: the device's limit on a grid's y), each chunk summed the same way.
template <typename T> __global__ void rmsnorm_bwd_partial_k(float* scratch, const T* dout, const T* inp,
                                                            const float* rstd, int64_t N, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    double acc = 0;
    for (int64_t n = chunk * kRowChunk; n < min(N, (chunk + 1) * kRowChunk); ++n)
      acc += double(ld(dout[n * C + c])) * ld(inp[n * C + c]) * rstd[n];
    scratch[chunk * C + c] = float(acc);
  }
}
__global__ void rmsnorm_bwd_sum_k(float* dweight, const float* scratch, int64_t chunks, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k) acc += scratch[k * C + c];
  dweight[c] += float(acc);
}

}  // namespace

int64_t rmsnorm_backward_scratch(int64_t N, int64_t C) { return ((N + kRowChunk - 1) / kRowChunk) * C; }

template <typename T> int rmsnorm_backward(T* dinp, float* dweight, float* scratch, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int64_t N, int64_t C, void* stream,
                                           const T* dresidual) {
  Range r("rmsnorm_backward");
  if (N == 0 || C == 0) return 0;
  MT_LAUNCH(rmsnorm_bwd_dx_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), dp(dinp), dp(dout), dp(inp),
            dp(weight), rstd, N, C, dp(dresidual));
  int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  MT_LAUNCH(rmsnorm_bwd_partial_k<Dev<T>>, dim3(unsigned(blocks_for(C)), unsigned(std::min<int64_t>(chunks, 65535))),
            kThreads, 0, st(stream),
            scratch, dp(dout), dp(inp), rstd, N, C);
  MT_LAUNCH(rmsnorm_bwd_sum_k, blocks_for(C), kThreads, 0, st(stream), dweight, scratch, chunks, C);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                                             \
  template int rmsnorm_forward<T>(T*, float*, const T*, const T*, int64_t, int64_t, double, void*);                   \
  template int add_rmsnorm_forward<T>(T*, T*, float*, const T*, const T*, const T*, int64_t, int64_t, double, void*); \
  template int rmsnorm_backward<T>(T*, float*, float*, const T*, const T*, const T*, const float*, int64_t, int64_t,  \
                                   void*, const T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
