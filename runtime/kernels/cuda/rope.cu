// RoPE, Hugging Face convention (ops.h rope_forward / rope_backward; declared in runtime/kernels/cpu/rope.cpp):
// one kernel for both directions, the backward being the transpose of the rotation.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// out, inp (B, T_, H, hd); cos, sin (T_, hd): a thread per W pairs (j, j + hd/2) .. (j + W - 1, ...) of one position
// and every head, each as one load of W elements (Pack) where the launcher found the rows 16-byte aligned. The
// position's cos and sin are read once for the H heads: read per head, the tables' bytes were twice the
// activation's and held the kernel at about a fifth of the memory bandwidth (issue 50 part 4).
template <typename T, int W> __global__ void rope_k(T* out, const T* inp, const T* cs, const T* sn, int64_t B,
                                                    int64_t T_, int64_t H, int64_t hd, bool backward) {
  using P = Pack<T, W>;
  const int64_t half = hd / 2, per_row = half / W, n = B * T_ * per_row;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t j = (i % per_row) * W, bt = i / per_row, t = bt % T_;
  auto at = [](const T* base, int64_t k) { return *reinterpret_cast<const P*>(base + k); };
  const P c1 = at(cs, t * hd + j), c2 = at(cs, t * hd + j + half), s1 = at(sn, t * hd + j),
          s2 = at(sn, t * hd + j + half);
#pragma unroll 4
  for (int64_t h = 0; h < H; ++h) {
    const int64_t row = (bt * H + h) * hd;
    const P x1 = at(inp, row + j), x2 = at(inp, row + j + half);
    P o1, o2;
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float a = ld(x1.v[e]), b = ld(x2.v[e]);
      if (!backward) {
        o1.v[e] = to<T>(a * ld(c1.v[e]) - b * ld(s1.v[e]));
        o2.v[e] = to<T>(b * ld(c2.v[e]) + a * ld(s2.v[e]));
      } else {
        o1.v[e] = to<T>(a * ld(c1.v[e]) + b * ld(s2.v[e]));
        o2.v[e] = to<T>(b * ld(c2.v[e]) - a * ld(s1.v[e]));
      }
    }
    *reinterpret_cast<P*>(out + row + j) = o1;
    *reinterpret_cast<P*>(out + row + j + half) = o2;
  }
}

}  // namespace

template <typename T> int rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_,
                                       int64_t H, int64_t hd, bool backward, void* stream) {
  Range r(backward ? "rope_backward" : "rope_forward");
  const int64_t half = hd / 2;
  if (B * T_ * H * half == 0) return 0;
  const bool packed = packable(half, kPack<T>, out, inp, cos, sin);
  const int w = packed ? kPack<T> : 1;
  auto kernel = packed ? rope_k<Dev<T>, kPack<T>> : rope_k<Dev<T>, 1>;
  MT_LAUNCH(kernel, blocks_for(B * T_ * (half / w)), kThreads, 0, st(stream), dp(out), dp(inp), dp(cos), dp(sin), B,
            T_, H, hd, backward);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T) \
  template int rope_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, bool, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
