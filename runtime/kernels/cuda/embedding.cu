// Embedding on a vocab shard (ops.h embedding_forward / embedding_backward; declared in
// runtime/kernels/cpu/embedding.cpp): the forward gathers rows; the backward scatters in token order after a
// stable sort (deterministic, no atomics).
#include <cub/device/device_radix_sort.cuh>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// out (N, C) = table (V, C) row tok[n] - row_begin, or zeros outside the shard.
template <typename T> __global__ void embedding_fwd_k(T* out, const int32_t* tok, const T* table, int64_t N, int64_t V,
                                                      int64_t C, int64_t row_begin) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  int64_t n = i / C, c = i % C, r = int64_t(tok[n]) - row_begin;
  out[i] = (r >= 0 && r < V) ? table[r * C + c] : to<T>(0.0f);
}

}  // namespace

template <typename T> int embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                            int64_t C, int64_t row_begin, void* stream) {
  Range r("embedding_forward");
  if (N * C == 0) return 0;
  MT_LAUNCH(embedding_fwd_k<Dev<T>>, blocks_for(N * C), kThreads, 0, st(stream), dp(out), tokens, dp(table), N, V_local,
            C, row_begin);
  return last_error();
}

namespace {

__global__ void iota_k(int32_t* idx, const int32_t* tok, int32_t* keys, int64_t N) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) idx[i] = int32_t(i), keys[i] = tok[i];
}
// After a stable sort of (token, position) by token: the block at the first position of each token's
// run sums that token's rows in position order (deterministic), then adds them to its table row.
template <typename T> __global__ void embedding_bwd_k(float* dtable, const T* dout, const int32_t* keys,
                                                      const int32_t* pos, int64_t N, int64_t V, int64_t C,
                                                      int64_t row_begin) {
  int64_t i = blockIdx.x;
  if (i >= N || (i > 0 && keys[i] == keys[i - 1])) return;
  int64_t r = int64_t(keys[i]) - row_begin;
  if (r < 0 || r >= V) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0;
    for (int64_t j = i; j < N && keys[j] == keys[i]; ++j) acc += ld(dout[int64_t(pos[j]) * C + c]);
    dtable[r * C + c] += acc;
  }
}

// Scratch of the embedding backward: sorted keys and positions (4 arrays of N) and CUB's temporary storage.
size_t embedding_sort_temp_bytes(int64_t N) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int32_t*)nullptr, (int32_t*)nullptr, (const int32_t*)nullptr,
                                  (int32_t*)nullptr, int(N));
  return bytes;
}

}  // namespace

int64_t embedding_backward_scratch_bytes(int64_t N) {
  return int64_t(4 * size_t(N) * sizeof(int32_t) + embedding_sort_temp_bytes(N) + 256);
}

template <typename T> int embedding_backward(float* dtable, void* scratch, const T* dout, const int32_t* tokens,
                                             int64_t N, int64_t V_local, int64_t C, int64_t row_begin, void* stream) {
  Range r("embedding_backward");
  if (N * C == 0) return 0;
  auto* keys_in = static_cast<int32_t*>(scratch);  // (N) tokens
  int32_t* pos_in = keys_in + N;                   // (N) positions 0..N-1
  int32_t* keys = pos_in + N;                      // (N) tokens, sorted
  int32_t* pos = keys + N;                         // (N) positions, grouped by token, ascending within a token
  // CUB's temporary storage, 256-byte aligned (the scratch size has the slack).
  void* temp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(pos + N) + 255) & ~uintptr_t(255));
  size_t temp_bytes = embedding_sort_temp_bytes(N);
  MT_LAUNCH(iota_k, blocks_for(N), kThreads, 0, st(stream), pos_in, tokens, keys_in, N);
  // Radix sort is stable: positions stay ascending within each token's run.
  if (int err =
          int(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys, pos_in, pos, int(N), 0, 32, st(stream))))
    return err;
  MT_LAUNCH(embedding_bwd_k<Dev<T>>, unsigned(N), 128, 0, st(stream), dtable, dp(dout), keys, pos, N, V_local, C,
            row_begin);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                                         \
  template int embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t, int64_t, void*);     \
  template int embedding_backward<T>(float*, void*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, \
                                     void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
