// Copies along a dim, the attention merge and shard packing (ops.h copy_slice, attention_merge, pack_blocks,
// unpack_blocks; declared in runtime/kernels/ops.cpp).
#include <climits>

#include <algorithm>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

int copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, void* stream) {
  Range r("copy_2d");
  if (width == 0 || rows == 0) return 0;
  // One contiguous range (a slice along dim 0, or whole rows): a plain copy. cudaMemcpy2DAsync refuses pitches
  // above the device's maximum (2^31 - 1 bytes), which a slice of a tensor of 2 GiB or more has.
  if (rows == 1 || (width == dpitch && width == spitch))
    return int(cudaMemcpyAsync(dst, src, width * rows, cudaMemcpyDeviceToDevice, st(stream)));
  constexpr size_t kMaxPitch = size_t(INT_MAX);
  if (dpitch > kMaxPitch || spitch > kMaxPitch) {  // few rows then (each is over 2 GiB): one copy per row
    for (size_t row = 0; row < rows; ++row)
      if (int err =
              int(cudaMemcpyAsync(static_cast<char*>(dst) + row * dpitch, static_cast<const char*>(src) + row * spitch,
                                  width, cudaMemcpyDeviceToDevice, st(stream))))
        return err;
    return 0;
  }
  return int(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, st(stream)));
}

namespace {

// One thread per (b, t, h) row: the weights of the two sides, then the row's hd values.
template <typename T> __global__ void attention_merge_k(float* out, float* lse, const T* part_out,
                                                        const float* part_lse, int64_t B, int64_t T_, int64_t H,
                                                        int64_t hd) {
  int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (b, t, h) in out's order
  if (row >= B * T_ * H) return;
  int64_t h = row % H, t = (row / H) % T_, b = row / (H * T_);
  int64_t li = (b * H + h) * T_ + t;
  float a = lse[li], p = part_lse[li];
  if (p == -INFINITY) return;
  float* o = out + row * hd;
  const T* po = part_out + row * hd;
  if (a == -INFINITY) {
    for (int64_t i = 0; i < hd; ++i) o[i] = ld(po[i]);
    lse[li] = p;
    return;
  }
  float m = fmaxf(a, p), merged = m + logf(expf(a - m) + expf(p - m));
  float wa = expf(a - merged), wp = expf(p - merged);
  for (int64_t i = 0; i < hd; ++i) o[i] = wa * o[i] + wp * ld(po[i]);
  lse[li] = merged;
}

}  // namespace

template <typename T> int attention_merge(float* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                                          int64_t T_, int64_t H, int64_t hd, void* stream) {
  Range r("attention_merge");
  if (B * T_ * H == 0) return 0;
  MT_LAUNCH(attention_merge_k<Dev<T>>, blocks_for(B * T_ * H, 128), 128, 0, st(stream), out, lse, dp(part_out),
            part_lse, B, T_, H, hd);
  return last_error();
}

namespace {

// Block j of the pack: blockIdx.y; its rows of len * inner units copied by a grid-stride loop over x.
constexpr int kMaxPackBlocks = 64;
struct PackBlocks {
  int64_t begin[kMaxPackBlocks + 1];  // along D, relative to the tensor's row
  int n;
};
template <typename U>
__global__ void pack_blocks_k(U* packed, U* t, int64_t D, int64_t inner, int64_t outer, PackBlocks b, bool unpack) {
  const int j = int(blockIdx.y);
  const int64_t len = b.begin[j + 1] - b.begin[j], width = len * inner, count = outer * width;
  U* block = packed + outer * inner * b.begin[j];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    U* x = t + r * D * inner + b.begin[j] * inner + c;
    if (unpack) *x = block[i];
    else block[i] = *x;
  }
}
template <typename U> int launch_pack(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes,
                                      const int64_t* begin, int n, bool unpack, void* stream) {
  const int64_t inner = int64_t(inner_bytes / sizeof(U));
  for (int j0 = 0; j0 < n; j0 += kMaxPackBlocks) {
    PackBlocks b{};
    b.n = std::min(kMaxPackBlocks, n - j0);
    int64_t widest = 0;
    for (int j = 0; j <= b.n; ++j) b.begin[j] = begin[j0 + j];
    for (int j = 0; j < b.n; ++j) widest = std::max(widest, outer * (b.begin[j + 1] - b.begin[j]) * inner);
    if (widest == 0) continue;
    const unsigned gx = unsigned(std::min<int64_t>(blocks_for(widest), 1024));
    MT_LAUNCH(pack_blocks_k<U>, dim3(gx, unsigned(b.n)), kThreads, 0, st(stream), static_cast<U*>(packed),
              static_cast<U*>(t), D, inner, outer, b, unpack);
  }
  return last_error();
}

}  // namespace

int pack_blocks(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes, const int64_t* begin, int n,
                bool unpack, void* stream) {
  Range r(unpack ? "unpack_blocks" : "pack_blocks");
  if (outer * D == 0 || inner_bytes == 0 || n == 0) return 0;
  // The widest unit that divides the rows and the two base addresses.
  const uintptr_t a = reinterpret_cast<uintptr_t>(packed) | reinterpret_cast<uintptr_t>(t) | uintptr_t(inner_bytes);
  if (a % 16 == 0) return launch_pack<uint4>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 8 == 0) return launch_pack<uint2>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 4 == 0) return launch_pack<uint32_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 2 == 0) return launch_pack<uint16_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  return launch_pack<uint8_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T) \
  template int attention_merge<T>(float*, float*, const T*, const float*, int64_t, int64_t, int64_t, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
