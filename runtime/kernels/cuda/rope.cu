// RoPE, Hugging Face convention (ops.h rope_forward / rope_backward; declared in runtime/kernels/cpu/rope.cpp):
// one kernel for both directions, the backward being the transpose of the rotation.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// out, inp (B, T_, H, hd); cos, sin (T_, hd): one thread per pair (j, j + hd/2).
template <typename T> __global__ void rope_k(T* out, const T* inp, const T* cs, const T* sn, int64_t B, int64_t T_,
                                             int64_t H, int64_t hd, bool backward) {
  int64_t half = hd / 2, n = B * T_ * H * half;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t j = i % half, bth = i / half, t = (bth / H) % T_;
  const T* c = cs + t * hd;
  const T* s = sn + t * hd;
  float x1 = ld(inp[bth * hd + j]), x2 = ld(inp[bth * hd + j + half]);
  if (!backward) {
    out[bth * hd + j] = to<T>(x1 * ld(c[j]) - x2 * ld(s[j]));
    out[bth * hd + j + half] = to<T>(x2 * ld(c[j + half]) + x1 * ld(s[j + half]));
  } else {
    out[bth * hd + j] = to<T>(x1 * ld(c[j]) + x2 * ld(s[j + half]));
    out[bth * hd + j + half] = to<T>(x2 * ld(c[j + half]) - x1 * ld(s[j]));
  }
}

}  // namespace

template <typename T> int rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_,
                                       int64_t H, int64_t hd, bool backward, void* stream) {
  Range r(backward ? "rope_backward" : "rope_forward");
  int64_t n = B * T_ * H * (hd / 2);
  if (n == 0) return 0;
  MT_LAUNCH(rope_k<Dev<T>>, blocks_for(n), kThreads, 0, st(stream), dp(out), dp(inp), dp(cos), dp(sin), B, T_, H, hd,
            backward);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T) \
  template int rope_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, bool, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
