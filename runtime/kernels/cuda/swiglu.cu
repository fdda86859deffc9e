// SwiGLU (ops.h swiglu_forward / swiglu_backward; declared in runtime/kernels/cpu/swiglu.cpp), fp32 math. Memory
// bound: a thread takes one 16-byte pack of each operand (8 bf16 or 4 floats) where every pointer is 16-byte aligned
// and n a multiple of the pack, else one element (the same arithmetic per element either way: the same bits). One
// element a thread reached 1.3 TB/s forward on an H200 (28% of its 4.8), 2-byte loads the bound.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// silu(g) * u.
struct SiluMulF {
  __device__ float operator()(float g, float u) const { return g / (1.0f + expf(-g)) * u; }
};

}  // namespace

template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_forward");
  if (n == 0) return 0;
  return map2(out, gate, up, n, SiluMulF{}, stream);
}

namespace {

// dg, du (n) from dy (n); W elements a thread; du may alias u (each thread reads its u before writing).
template <typename T, int W>
__global__ void swiglu_bwd_k(T* dg, T* du, const T* dy, const T* g, const T* u, int64_t n_packs) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_packs) return;
  using P = Pack<T, W>;
  const P gp = reinterpret_cast<const P*>(g)[i], up = reinterpret_cast<const P*>(u)[i],
          dyp = reinterpret_cast<const P*>(dy)[i];
  P dgp, dup;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    const float x = ld(gp.v[e]), s = 1.0f / (1.0f + expf(-x)), d = ld(dyp.v[e]), uv = ld(up.v[e]);
    dup.v[e] = to<T>(d * x * s);
    dgp.v[e] = to<T>(d * uv * s * (1.0f + x * (1.0f - s)));
  }
  reinterpret_cast<P*>(du)[i] = dup;
  reinterpret_cast<P*>(dg)[i] = dgp;
}

}  // namespace

template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_backward");
  if (n == 0) return 0;
  const bool packed = packable(n, kPack<T>, dgate, dup, dout, gate, up);
  const int w = packed ? kPack<T> : 1;
  auto kernel = packed ? swiglu_bwd_k<Dev<T>, kPack<T>> : swiglu_bwd_k<Dev<T>, 1>;
  MT_LAUNCH(kernel, blocks_for(n / w), kThreads, 0, st(stream), dp(dgate), dp(dup), dp(dout), dp(gate), dp(up), n / w);
  return last_error();
}

// GeGLU (gelu with PyTorch's tanh approximation) and the tanh soft-cap, one element a thread, fp32 math.
namespace {

__device__ inline float gelu_tanh_inner(float x) { return tanhf(0.7978845608f * (x + 0.044715f * x * x * x)); }

template <typename T> __global__ void geglu_fwd_k(T* o, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = ld(g[i]);
  o[i] = to<T>(0.5f * x * (1.0f + gelu_tanh_inner(x)) * ld(u[i]));
}

template <typename T> __global__ void geglu_bwd_k(T* dg, T* du, const T* dy, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = ld(g[i]), t = gelu_tanh_inner(x), d = ld(dy[i]), uv = ld(u[i]);
  const float dgelu = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
  du[i] = to<T>(d * 0.5f * x * (1.0f + t));  // u read above: du may alias u
  dg[i] = to<T>(d * uv * dgelu);
}

template <typename T> __global__ void softcap_fwd_k(T* o, const T* x, float cap, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) o[i] = to<T>(cap * tanhf(ld(x[i]) / cap));
}

template <typename T> __global__ void softcap_bwd_k(T* dx, const T* dy, const T* y, float cap, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float r = ld(y[i]) / cap;
  dx[i] = to<T>(ld(dy[i]) * (1.0f - r * r));
}

}  // namespace

template <typename T> int geglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("geglu_forward");
  if (n == 0) return 0;
  MT_LAUNCH(geglu_fwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(out), dp(gate), dp(up), n);
  return last_error();
}

template <typename T>
int geglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("geglu_backward");
  if (n == 0) return 0;
  MT_LAUNCH(geglu_bwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(dgate), dp(dup), dp(dout), dp(gate), dp(up),
            n);
  return last_error();
}

template <typename T> int softcap_forward(T* out, const T* inp, double cap, int64_t n, void* stream) {
  Range r("softcap_forward");
  if (n == 0) return 0;
  MT_LAUNCH(softcap_fwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(out), dp(inp), float(cap), n);
  return last_error();
}

template <typename T> int softcap_backward(T* dinp, const T* dout, const T* out, double cap, int64_t n, void* stream) {
  Range r("softcap_backward");
  if (n == 0) return 0;
  MT_LAUNCH(softcap_bwd_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(dinp), dp(dout), dp(out), float(cap), n);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                 \
  template int swiglu_forward<T>(T*, const T*, const T*, int64_t, void*);                 \
  template int swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, void*);  \
  template int geglu_forward<T>(T*, const T*, const T*, int64_t, void*);                  \
  template int geglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, void*);   \
  template int softcap_forward<T>(T*, const T*, double, int64_t, void*);                  \
  template int softcap_backward<T>(T*, const T*, const T*, double, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
