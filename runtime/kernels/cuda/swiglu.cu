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

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                 \
  template int swiglu_forward<T>(T*, const T*, const T*, int64_t, void*); \
  template int swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
