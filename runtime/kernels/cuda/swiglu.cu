// SwiGLU (ops.h swiglu_forward / swiglu_backward; declared in runtime/kernels/cpu/swiglu.cpp): one thread per
// element, fp32 math.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// out (n) = silu(g) * u; g, u (n).
template <typename T> __global__ void swiglu_fwd_k(T* out, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = ld(g[i]);
  out[i] = to<T>(x / (1.0f + expf(-x)) * ld(u[i]));
}

}  // namespace

template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_forward");
  if (n == 0) return 0;
  MT_LAUNCH(swiglu_fwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(out), dp(gate), dp(up), n);
  return last_error();
}

namespace {

// dg, du (n) from dy (n); du may alias u (each thread reads its u before writing).
template <typename T> __global__ void swiglu_bwd_k(T* dg, T* du, const T* dy, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = ld(g[i]), s = 1.0f / (1.0f + expf(-x)), d = ld(dy[i]), up = ld(u[i]);
  du[i] = to<T>(d * x * s);
  dg[i] = to<T>(d * up * s * (1.0f + x * (1.0f - s)));
}

}  // namespace

template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_backward");
  if (n == 0) return 0;
  MT_LAUNCH(swiglu_bwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(dgate), dp(dup), dp(dout), dp(gate),
            dp(up), n);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                 \
  template int swiglu_forward<T>(T*, const T*, const T*, int64_t, void*); \
  template int swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
