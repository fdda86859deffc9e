// RMSNorm (ops.h rmsnorm_forward, add_rmsnorm_forward, rmsnorm_backward; declared in
// runtime/kernels/cpu/rmsnorm.cpp): a warp per row, the sums in f64 across the warp; dweight summed over
// fixed chunks of rows, then the chunks in order (deterministic).

#include <algorithm>

#include "runtime/kernels/cuda/common.cuh"

#ifndef MT_CUDA_EMULATOR
#define MT_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace mt::cuda {

namespace {

// out (N, C), rstd (N) f32, inp (N, C), weight (C); with residual: sum (N, C) = inp + residual first.
// A warp per row, each lane W columns at a time (Pack: one 16-byte load where the launcher found C a multiple of W
// and the rows aligned; W = 1 otherwise); the sum of squares per lane, then across the warp, in double.
template <typename T, int W> __global__ void rmsnorm_fwd_k(T* out, float* rstd, const T* inp, const T* w, int64_t N,
                                                           int64_t C, float eps, T* sum, const T* residual) {
  using P = Pack<T, W>;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const P* x = reinterpret_cast<const P*>(inp + row * C);
  const int64_t np = C / W;
  double ss = 0;
  if (residual) {  // fused residual add: sum = inp + residual, rounded as add() rounds; the norm reads it back
    P* s = reinterpret_cast<P*>(sum + row * C);  // from the cache (each lane re-reads only what it wrote)
    const P* res = reinterpret_cast<const P*>(residual + row * C);
    for (int64_t p = lane; p < np; p += 32) {
      const P a = x[p], b = res[p];
      P v;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        v.v[e] = to<T>(ld(a.v[e]) + ld(b.v[e]));
        ss += double(ld(v.v[e]) * ld(v.v[e]));  // the square in f32: exact for bf16
      }
      s[p] = v;
    }
    x = s;
  } else {
    for (int64_t p = lane; p < np; p += 32) {
      const P a = x[p];
#pragma unroll
      for (int e = 0; e < W; ++e) ss += double(ld(a.v[e]) * ld(a.v[e]));
    }
  }
  ss = warp_sum_d(ss);
  float r = float(1.0 / sqrt(ss / double(C) + double(eps)));
  if (lane == 0) rstd[row] = r;
  // Hugging Face's order: normalise in fp32, round to the activation type, then scale by the weight.
  const P* wp = reinterpret_cast<const P*>(w);
  for (int64_t p = lane; p < np; p += 32) {
    const P a = x[p], b = wp[p];
    P o;
#pragma unroll
    for (int e = 0; e < W; ++e) o.v[e] = to<T>(ld(to<T>(ld(a.v[e]) * r)) * ld(b.v[e]));
    reinterpret_cast<P*>(out + row * C)[p] = o;
  }
}

// The fused-residual and plain forms, W chosen as above.
template <typename T> int rmsnorm_fwd(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                      double eps, T* sum, const T* residual, void* stream) {
  const bool packed = packable(C, kPack<T>, out, inp, weight) && (!sum || packable(C, kPack<T>, sum, residual));
  auto kernel = packed ? rmsnorm_fwd_k<Dev<T>, kPack<T>> : rmsnorm_fwd_k<Dev<T>, 1>;
  MT_LAUNCH(kernel, blocks_for(N * 32), kThreads, 0, st(stream), dp(out), rstd, dp(inp), dp(weight), N, C, float(eps),
            dp(sum), dp(residual));
  return last_error();
}

}  // namespace

template <typename T> int rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                          double eps, void* stream) {
  Range r("rmsnorm_forward");
  if (N == 0) return 0;
  return rmsnorm_fwd(out, rstd, inp, weight, N, C, eps, static_cast<T*>(nullptr), static_cast<const T*>(nullptr),
                     stream);
}

template <typename T> int add_rmsnorm_forward(T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                                              int64_t N, int64_t C, double eps, void* stream) {
  Range r("add_rmsnorm_forward");
  if (N == 0) return 0;
  return rmsnorm_fwd(out, rstd, a, weight, N, C, eps, sum, b, stream);
}

namespace {

// One pack p (W columns) of row's input gradient: rstd * (dy w - x rstd mean), plus the residual branch's gradient
// (fused: one rounding). Both backward paths below write dinp through it.
template <typename T, int W>
__device__ inline void rmsnorm_dx_pack(T* dinp, const T* dout, const T* inp, const T* w, const T* dres, int64_t row,
                                       int64_t C, int64_t p, float rf, float mean) {
  using P = Pack<T, W>;
  const P a = reinterpret_cast<const P*>(dout + row * C)[p], b = reinterpret_cast<const P*>(w)[p],
          c = reinterpret_cast<const P*>(inp + row * C)[p];
  P res, o;
  if (dres) res = reinterpret_cast<const P*>(dres + row * C)[p];
#pragma unroll
  for (int e = 0; e < W; ++e) {
    float v = rf * (ld(a.v[e]) * ld(b.v[e]) - ld(c.v[e]) * rf * mean);
    if (dres) v += ld(res.v[e]);
    o.v[e] = to<T>(v);
  }
  reinterpret_cast<P*>(dinp + row * C)[p] = o;
}

// dinp (N, C) from dout (N, C), a warp per row, each lane W columns at a time (Pack: one 16-byte load per operand
// where the launcher found C a multiple of W and the rows aligned; W = 1 otherwise). Products in f32, their sum in
// f64: one conversion to f64 an element (f64 arithmetic and conversions run at a small fraction of f32's rate on a
// GPU, and bound this kernel when every step is f64).
template <typename T, int W> __global__ void rmsnorm_bwd_dx_k(T* dinp, const T* dout, const T* inp, const T* w,
                                                              const float* rstd, int64_t N, int64_t C, const T* dres) {
  using P = Pack<T, W>;
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const P* x = reinterpret_cast<const P*>(inp + row * C);
  const P* dy = reinterpret_cast<const P*>(dout + row * C);
  const P* wp = reinterpret_cast<const P*>(w);
  const int64_t np = C / W;
  double r = rstd[row], dot = 0;
  for (int64_t p = lane; p < np; p += 32) {
    const P a = dy[p], b = wp[p], c = x[p];
#pragma unroll
    for (int e = 0; e < W; ++e) dot += double(ld(a.v[e]) * ld(b.v[e]) * ld(c.v[e]));
  }
  dot = warp_sum_d(dot) * r;
  const float mean = float(dot / double(C)), rf = float(r);
  for (int64_t p = lane; p < np; p += 32) rmsnorm_dx_pack<T, W>(dinp, dout, inp, w, dres, row, C, p, rf, mean);
}

constexpr int64_t kRowChunk = 256;
// scratch[chunk][c] = sum over the chunk's rows of dy * x * rstd (each product in f32, the sum in f64), rows in
// order, a thread per W columns (Pack, as above). The grid's y covers the chunks in strides of gridDim.y (at most
// 65,535: the device's limit on a grid's y), each chunk summed the same way. The path for widths the fused kernel
// below does not take.
template <typename T, int W> __global__ void rmsnorm_bwd_partial_k(float* scratch, const T* dout, const T* inp,
                                                                   const float* rstd, int64_t N, int64_t C) {
  using P = Pack<T, W>;
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= C / W) return;
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    double acc[W] = {};
#pragma unroll 4
    for (int64_t n = chunk * kRowChunk; n < min(N, (chunk + 1) * kRowChunk); ++n) {
      const P a = reinterpret_cast<const P*>(dout + n * C)[p], b = reinterpret_cast<const P*>(inp + n * C)[p];
      const float rs = rstd[n];
#pragma unroll
      for (int e = 0; e < W; ++e) acc[e] += double(ld(a.v[e]) * ld(b.v[e]) * rs);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) scratch[chunk * C + p * W + e] = float(acc[e]);
  }
}
__global__ void rmsnorm_bwd_sum_k(float* dweight, const float* scratch, int64_t chunks, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k) acc += scratch[k * C + c];
  dweight[c] += float(acc);
}

// The fused backward: dinp and the weight gradient's partial sums in one pass over dout and inp (the two-kernel
// path above reads both twice: 6 tensor passes where 4 are needed; issue 50 part 4). A block of kThreads (8 warps)
// owns kFusedRows consecutive rows, each warp kFusedRows / 8 of them, one row at a time as rmsnorm_bwd_dx_k does;
// lane l holds columns (l + 32 i) * W .. + W - 1 for i < NP (NP = C / (32 W), a template argument so that the sums
// stay in registers: the launcher's kFusedPacks), and sums dy * x * rstd of its warp's rows in f32 registers. The warps then add their sums into shared
// memory one after another (warp 0 first: a fixed order), and the block writes one row of scratch (blocks, C).
constexpr int kFusedRows = 64;
template <typename T, int W, int NP> __global__ void rmsnorm_bwd_fused_k(T* dinp, float* scratch, const T* dout, const T* inp,
                                                                 const T* w, const float* rstd, int64_t N, int64_t C,
                                                                 const T* dres) {
  using P = Pack<T, W>;
  MT_DYNAMIC_SMEM(smem);
  float* block_sum = reinterpret_cast<float*>(smem);  // (C) the block's partial of the weight gradient
  const int warp = int(threadIdx.x / 32), lane = int(threadIdx.x % 32), warps = int(blockDim.x / 32);
  const int rows_per_warp = kFusedRows / warps;
  const P* wp = reinterpret_cast<const P*>(w);
  float acc[NP][W];
#pragma unroll
  for (int i = 0; i < NP; ++i)
#pragma unroll
    for (int e = 0; e < W; ++e) acc[i][e] = 0.f;
  const int64_t first = int64_t(blockIdx.x) * kFusedRows + int64_t(warp) * rows_per_warp;
  for (int64_t row = first; row < min(N, first + rows_per_warp); ++row) {
    const P* x = reinterpret_cast<const P*>(inp + row * C);
    const P* dy = reinterpret_cast<const P*>(dout + row * C);
    const float rf = rstd[row];
    double dot = 0;
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      const int64_t p = lane + 32 * i;
      const P a = dy[p], b = wp[p], c = x[p];
#pragma unroll
      for (int e = 0; e < W; ++e) {
        dot += double(ld(a.v[e]) * ld(b.v[e]) * ld(c.v[e]));
        acc[i][e] += ld(a.v[e]) * ld(c.v[e]) * rf;
      }
    }
    dot = warp_sum_d(dot) * double(rf);
    const float mean = float(dot / double(C));
#pragma unroll
    for (int i = 0; i < NP; ++i)  // the row again: just read, from the cache
      rmsnorm_dx_pack<T, W>(dinp, dout, inp, w, dres, row, C, lane + 32 * i, rf, mean);
  }
  for (int turn = 0; turn < warps; ++turn) {  // the warps' sums into shared memory, warp 0 first
    if (warp == turn) {
#pragma unroll
      for (int i = 0; i < NP; ++i) {
#pragma unroll
        for (int e = 0; e < W; ++e) {
          float& s = block_sum[(lane + 32 * i) * W + e];
          s = turn == 0 ? acc[i][e] : s + acc[i][e];
        }
      }
    }
    __syncthreads();
  }
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) scratch[int64_t(blockIdx.x) * C + c] = block_sum[c];
}

// dweight (C) += the sum of scratch's rows (rows, C) in order, in f64: a block per 32 columns, its 8 warps' lanes
// each summing every 8th row (row group g: rows g, g + 8, ...), then the 8 groups in order.
__global__ void rmsnorm_bwd_sum_rows_k(float* dweight, const float* scratch, int64_t rows, int64_t C) {
  __shared__ double part[8][32];
  const int lane = int(threadIdx.x % 32), g = int(threadIdx.x / 32);
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  double acc = 0;
  if (c < C)
#pragma unroll 8
    for (int64_t r = g; r < rows; r += 8) acc += scratch[r * C + c];
  part[g][lane] = acc;
  __syncthreads();
  if (g == 0 && c < C) {
    double total = 0;
    for (int k = 0; k < 8; ++k) total += part[k][lane];
    dweight[c] += float(total);
  }
}

// The fused kernel's instances: lanes of NP packs (bf16: C 256, 512, 1,024, 1,536, 2,048, 3,072, 4,096; f32
// half of those), the block's shared memory (C floats) within the default 48 KiB. Null: the two-kernel path.
template <typename T> auto rmsnorm_fused_kernel(int64_t C) {
  constexpr int W = kPack<T>;
  using K = decltype(&rmsnorm_bwd_fused_k<Dev<T>, W, 1>);
  if (C % (32 * W) != 0) return K(nullptr);
  switch (C / (32 * W)) {
    case 1: return &rmsnorm_bwd_fused_k<Dev<T>, W, 1>;
    case 2: return &rmsnorm_bwd_fused_k<Dev<T>, W, 2>;
    case 4: return &rmsnorm_bwd_fused_k<Dev<T>, W, 4>;
    case 6: return &rmsnorm_bwd_fused_k<Dev<T>, W, 6>;
    case 8: return &rmsnorm_bwd_fused_k<Dev<T>, W, 8>;
    case 12: return &rmsnorm_bwd_fused_k<Dev<T>, W, 12>;
    case 16: return &rmsnorm_bwd_fused_k<Dev<T>, W, 16>;
    default: return K(nullptr);
  }
}

}  // namespace

int64_t rmsnorm_backward_scratch(int64_t N, int64_t C) {
  // The larger of the two paths' needs: the launcher picks one by the pointers' alignment.
  return std::max((N + kRowChunk - 1) / kRowChunk, (N + kFusedRows - 1) / kFusedRows) * C;
}

template <typename T> int rmsnorm_backward(T* dinp, float* dweight, float* scratch, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int64_t N, int64_t C, void* stream,
                                           const T* dresidual) {
  Range r("rmsnorm_backward");
  if (N == 0 || C == 0) return 0;
  const bool packed =
      packable(C, kPack<T>, dinp, dout, inp, weight) && (!dresidual || packable(C, kPack<T>, dresidual));
  const int64_t w = packed ? kPack<T> : 1;
  if (auto fused = packed ? rmsnorm_fused_kernel<T>(C) : nullptr) {
    const int64_t blocks = (N + kFusedRows - 1) / kFusedRows;
    MT_LAUNCH(fused, unsigned(blocks), kThreads, size_t(C) * sizeof(float), st(stream), dp(dinp), scratch, dp(dout), dp(inp), dp(weight), rstd, N, C, dp(dresidual));
    MT_LAUNCH(rmsnorm_bwd_sum_rows_k, unsigned((C + 31) / 32), kThreads, 0, st(stream), dweight, scratch, blocks, C);
    return last_error();
  }
  auto dx = packed ? rmsnorm_bwd_dx_k<Dev<T>, kPack<T>> : rmsnorm_bwd_dx_k<Dev<T>, 1>;
  MT_LAUNCH(dx, blocks_for(N * 32), kThreads, 0, st(stream), dp(dinp), dp(dout), dp(inp), dp(weight), rstd, N, C,
            dp(dresidual));
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  auto partial = packed ? rmsnorm_bwd_partial_k<Dev<T>, kPack<T>> : rmsnorm_bwd_partial_k<Dev<T>, 1>;
  MT_LAUNCH(partial, dim3(unsigned(blocks_for(C / w)), unsigned(std::min<int64_t>(chunks, 65535))), kThreads, 0,
            st(stream), scratch, dp(dout), dp(inp), rstd, N, C);
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
