// What the CUDA kernel files (runtime/kernels/cuda/<family>.cu) share: the host <-> device element types,
// loads and stores through fp32 registers (ld / to), warp reductions, launch sizes and the NVTX range each
// launcher opens. Each file's kernels sit next to their launchers; the launchers are declared beside the op
// that calls them (runtime/kernels/cpu/<family>.cpp) and return a cudaError_t (0 = success) or, for the GEMMs,
// kCublasErrorBase + a cublasStatus_t (cuda_ops.h). Deterministic throughout: no floating-point atomics,
// reductions in a fixed order, so that a rerun gives the same bits (exact resume). Kernels are launched with
// MT_LAUNCH (launch.cuh), never <<<>>>: the emulated build (tests/emu) runs them on the CPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdint>

#include "runtime/core/dtype.h"
#include "runtime/kernels/cuda/cuda_ops.h"
#include "runtime/kernels/cuda/launch.cuh"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
inline int blocks_for(int64_t n, int threads = kThreads) { return int((n + threads - 1) / threads); }
inline cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
inline int last_error() { return int(cudaGetLastError()); }

// The device type of a host element type.
template <typename T> struct DevType { using type = T; };
template <> struct DevType<bf16> { using type = __nv_bfloat16; };
template <typename T> using Dev = typename DevType<T>::type;
template <typename T> Dev<T>* dp(T* p) { return reinterpret_cast<Dev<T>*>(p); }
template <typename T> const Dev<T>* dp(const T* p) { return reinterpret_cast<const Dev<T>*>(p); }

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T to(float x);
template <> __device__ __forceinline__ float to<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Memory-bound kernels move 16 bytes a load (a 2-byte load a thread reaches about a quarter of the bandwidth).
// W elements of T in 16 bytes or fewer, moved as one load or store when W * sizeof(T) == 16.
template <typename T, int W> struct alignas(W * sizeof(T)) Pack { T v[W]; };
template <typename T> constexpr int kPack = 16 / int(sizeof(T));
// Packs of kPack<T> elements where n divides and every pointer is 16-byte aligned, else single elements.
template <typename... P> bool packable(int64_t n, int w, const P*... p) {
  return n % w == 0 && ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

// out = f(a, b) element-wise, computed in f32 (F: a functor with a __device__ float operator()(float, float) const),
// W elements a thread.
template <typename T, int W, typename F> __global__ void map2_k(T* out, const T* a, const T* b, int64_t n_packs, F f) {
  using P = Pack<T, W>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_packs) return;
  const P x = reinterpret_cast<const P*>(a)[i], y = reinterpret_cast<const P*>(b)[i];
  P o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.v[e] = to<T>(f(ld(x.v[e]), ld(y.v[e])));
  reinterpret_cast<P*>(out)[i] = o;
}

// An NVTX range over a launcher, so that Nsight Systems shows the op by name.
struct Range {
  explicit Range(const char* name) { nvtxRangePushA(name); }
  ~Range() { nvtxRangePop(); }
};

__device__ inline double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// The sum of every thread's s over a block of kBlock threads: each warp's butterfly (warp_sum_d), then thread 0 adds
// the warps' in order (a fixed order: the same bits on every run; cuda_ops.h sum_partials_in_order repeats it on
// the host). The result is thread 0's.
template <int kBlock> __device__ double block_sum_d(double s) {
  __shared__ double warp_part[kBlock / 32];
  s = warp_sum_d(s);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = s;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kBlock / 32; ++w) total += warp_part[w];
  return total;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline double warp_max_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Launches map2_k over n elements of the host type T: 16-byte packs where n divides and every pointer is aligned,
// else one element a thread (the same arithmetic per element: the same bits).
template <typename T, typename F> int map2(T* out, const T* a, const T* b, int64_t n, F f, void* stream) {
  const bool packed = packable(n, kPack<T>, out, a, b);
  const int64_t w = packed ? kPack<T> : 1;
  auto kernel = packed ? map2_k<Dev<T>, kPack<T>, F> : map2_k<Dev<T>, 1, F>;
  MT_LAUNCH(kernel, blocks_for(n / w), kThreads, 0, st(stream), dp(out), dp(a), dp(b), n / w, f);
  return last_error();
}

}  // namespace

}  // namespace mt::cuda
