// Embedding lookup for a (possibly vocab-sharded) table: rows outside this
// shard give zeros, so the shards' outputs sum to the full lookup.
#include <algorithm>
#include <cstring>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                             int64_t C, int64_t row_begin) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    int64_t r = int64_t(tokens[n]) - row_begin;
    T* y = out + n * C;  // (C)
    if (r >= 0 && r < V_local) std::memcpy(y, table + r * C, size_t(C) * sizeof(T));
    else std::fill(y, y + C, T(0));
  }
}

template <typename T> void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N,
                                              int64_t V_local, int64_t C, int64_t row_begin) {
  // Columns split across threads; each thread visits the tokens in order: deterministic, no atomics.
  constexpr int64_t kCols = 32;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += kCols) {
    int64_t c1 = std::min(C, c0 + kCols);
    for (int64_t n = 0; n < N; ++n) {
      int64_t r = int64_t(tokens[n]) - row_begin;
      if (r < 0 || r >= V_local) continue;
      const T* dy = dout + n * C;
      T* dw = dtable + r * C;
      for (int64_t c = c0; c < c1; ++c) dw[c] += dy[c];
    }
  }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t, int64_t);
template void embedding_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t, int64_t, int64_t);
template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t);
template void embedding_backward<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t, int64_t);

}  // namespace mt::cpu::MT_CPU_ISA
