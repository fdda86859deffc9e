// FP8 casts (ops.h fp8_cast; declared in runtime/kernels/cpu/fp8.cpp; the FP8 GEMM is in matmul.cu). The amax, the
// scale and its inverse stay on the device: no host read. Tensorwise: each block's amax into a partial, one block
// reduces the partials into the scale; rowwise: one block a row (q), one thread a column (qt). Then one thread an
// element writes its code in q and/or qt, with runtime/core/fp8.h's encode (the CPU's, so the codes are the same).
// Max is exact whatever the order: the result does not depend on the launch sizes. qt is written with a stride
// (a tiled transpose through shared memory would coalesce it; not done yet, docs/design/fp8.md).
#include <algorithm>

#include "runtime/core/fp8.h"
#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kAmaxBlocks = 1024;  // tensorwise stage 1: at most this many partials

__device__ float block_max(float m) {
  __shared__ float warp_part[kThreads / 32];
  m = warp_max(m);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = m;
  __syncthreads();
  float r = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) r = fmaxf(r, warp_part[w]);
  return r;  // thread 0's
}

// Stage 1: partial[b] = amax over block b's grid-stride share of x (n elements).
template <typename T> __global__ void amax_partial_k(float* partial, const T* x, int64_t n) {
  float m = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(ld(x[i])));
  m = block_max(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

// Stage 2 (one block): the scale from the partials' max; the inverse into q_inv and qt_inv (either may be null).
__global__ void amax_scale_k(float* scale, float* q_inv, float* qt_inv, const float* partial, int n, int fmt,
                             bool pow2) {
  float m = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, partial[i]);
  m = block_max(m);
  if (threadIdx.x == 0) {
    const float s = fp8::scale_from_amax(m, Fp8Format(fmt), pow2);
    scale[0] = s;
    if (q_inv) q_inv[0] = 1.0f / s;
    if (qt_inv) qt_inv[0] = 1.0f / s;
  }
}

// Rowwise, one block a row of x (R, K): scale[r], inv[r].
template <typename T> __global__ void row_scale_k(float* scale, float* inv, const T* x, int64_t K, int fmt, bool pow2) {
  const T* row = x + int64_t(blockIdx.x) * K;
  float m = 0;
  for (int64_t c = threadIdx.x; c < K; c += blockDim.x) m = fmaxf(m, fabsf(ld(row[c])));
  m = block_max(m);
  if (threadIdx.x == 0) {
    const float s = fp8::scale_from_amax(m, Fp8Format(fmt), pow2);
    scale[blockIdx.x] = s;
    inv[blockIdx.x] = 1.0f / s;
  }
}

// Rowwise, one thread a column of x (R, K): scale[c], inv[c] (neighbouring threads read neighbouring columns).
template <typename T>
__global__ void col_scale_k(float* scale, float* inv, const T* x, int64_t R, int64_t K, int fmt, bool pow2) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= K) return;
  float m = 0;
  for (int64_t r = 0; r < R; ++r) m = fmaxf(m, fabsf(ld(x[r * K + c])));
  const float s = fp8::scale_from_amax(m, Fp8Format(fmt), pow2);
  scale[c] = s;
  inv[c] = 1.0f / s;
}

// One thread an element of x (R, K): q[r, c] with row_scale[rowwise ? r : 0], qt[c, r] with col_scale[rowwise ? c : 0].
template <typename T>
__global__ void cast_k(uint8_t* q, uint8_t* qt, const float* row_scale, const float* col_scale, const T* x, int64_t R,
                       int64_t K, int fmt, bool rowwise) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R * K) return;
  const int64_t r = i / K, c = i % K;
  const float v = ld(x[i]);
  if (q) q[i] = fp8::quantize(v, row_scale[rowwise ? r : 0], Fp8Format(fmt));
  if (qt) qt[c * R + r] = fp8::quantize(v, col_scale[rowwise ? c : 0], Fp8Format(fmt));
}

}  // namespace

int64_t fp8_cast_scratch(int64_t R, int64_t K, bool rowwise) { return rowwise ? R + K : kAmaxBlocks + 1; }

template <typename T> int fp8_cast(uint8_t* q, float* q_inv, uint8_t* qt, float* qt_inv, float* scratch, const T* x,
                                   int64_t R, int64_t K, int fmt, bool rowwise, bool pow2, void* stream) {
  Range r("fp8_cast");
  const int64_t n = R * K;
  if (n == 0) return 0;
  float *row_scale = scratch, *col_scale = scratch;
  if (!rowwise) {  // scratch: kAmaxBlocks partials, then the scale
    const int blocks = int(std::min<int64_t>(kAmaxBlocks, blocks_for(n)));
    row_scale = col_scale = scratch + kAmaxBlocks;
    MT_LAUNCH(amax_partial_k<Dev<T>>, blocks, kThreads, 0, st(stream), scratch, dp(x), n);
    MT_LAUNCH(amax_scale_k, 1, kThreads, 0, st(stream), row_scale, q_inv, qt_inv, static_cast<const float*>(scratch),
              blocks, fmt, pow2);
  } else {  // scratch: R row scales, then K column scales
    col_scale = scratch + R;
    if (q) MT_LAUNCH(row_scale_k<Dev<T>>, int(R), kThreads, 0, st(stream), row_scale, q_inv, dp(x), K, fmt, pow2);
    if (qt)
      MT_LAUNCH(col_scale_k<Dev<T>>, blocks_for(K), kThreads, 0, st(stream), col_scale, qt_inv, dp(x), R, K, fmt,
                pow2);
  }
  if (int err = last_error()) return err;
  MT_LAUNCH(cast_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), q, qt, static_cast<const float*>(row_scale),
            static_cast<const float*>(col_scale), dp(x), R, K, fmt, rowwise);
  return last_error();
}

template int fp8_cast<float>(uint8_t*, float*, uint8_t*, float*, float*, const float*, int64_t, int64_t, int, bool,
                             bool, void*);
template int fp8_cast<bf16>(uint8_t*, float*, uint8_t*, float*, float*, const bf16*, int64_t, int64_t, int, bool,
                            bool, void*);

}  // namespace mt::cuda
