// Embedding lookup for a (possibly vocab-sharded) table: rows outside this
// shard give zeros, so the shards' outputs sum to the full lookup.
#include "runtime/kernels/cpu/isa_level.h"

#include <algorithm>
#include <cstring>

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

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(embedding_forward)
MT_CPU_EXPORT(embedding_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/embedding.cu: forward gathers rows; backward scatters in token order (no atomics)
template <typename T> int embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                            int64_t C, int64_t row_begin, void* stream);
// scratch: embedding_backward_scratch_bytes(N) bytes (a stable sort of the positions by token).
template <typename T> int embedding_backward(float* dtable, void* scratch, const T* dout, const int32_t* tokens,
                                             int64_t N, int64_t V_local, int64_t C, int64_t row_begin, void* stream);
int64_t embedding_backward_scratch_bytes(int64_t N);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t row_begin,
                       int64_t vocab_size) {
  const char* op = "embedding_forward";
  check_float(op, table, "table");
  MT_CHECK(table.dim() == 2, "kernels", "{}: table must be (V, C), got {}", op, shape_str(table.shape()));
  int64_t N = tokens.numel(), V = table.size(0), C = table.size(1);
  check_i32(op, tokens, N, "tokens");
  expect_shape(op, out, {N, C}, "out");
  same_dtype(op, table, out, "out");
  // Host tokens only: device tokens come from the data loader, which checked them against the vocabulary.
  auto check_tokens = [&] {
    if (vocab_size <= 0) return;
    const int32_t* tk = tokens.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      MT_CHECK(tk[n] >= 0 && tk[n] < vocab_size, "kernels",
               "{}: token {} at position {} is outside the vocabulary [0, {})", op, tk[n], n, vocab_size);
  };
  // bf16 on the CPU: a gather, so the f32 path gives the same bits.
  dispatch(
      op, table,
      MT_CUDA_FN(return cuda::embedding_forward<T>(ptr<T>(out), tokens.data<int32_t>(), ptr<T>(table), N, V, C,
                                                   row_begin, stream_of(table));),
      [&](auto z, const Tensor& out, const Tensor& tokens, const Tensor& table) {
        using T = decltype(z);
        check_tokens();
        MT_CPU_KERNEL(embedding_forward, T)(ptr<T>(out), tokens.data<int32_t>(), ptr<T>(table), N, V, C, row_begin);
      },
      wr(out), rd(tokens), rd(table));
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t row_begin) {
  const char* op = "embedding_backward";
  check_float(op, dout, "dout");
  check_float(op, dtable, "dtable");
  MT_CHECK(dtable.dim() == 2, "kernels", "{}: dtable must be (V, C), got {}", op, shape_str(dtable.shape()));
  int64_t N = tokens.numel(), V = dtable.size(0), C = dtable.size(1);
  check_i32(op, tokens, N, "tokens");
  expect_shape(op, dout, {N, C}, "dout");
  expect_acc(op, dtable, dout.dtype(), "dtable");
  // Dispatched by dout; the CPU kernel's T is dtable's too (f32 or f64 dout: dtable has its dtype).
  dispatch(
      op, dout,
      MT_CUDA_FN(Tensor scratch = empty({(cuda::embedding_backward_scratch_bytes(N) + 1) / 2}, DType::u16,
                                        dout.device());  // bytes
                 return cuda::embedding_backward<T>(ptr<float>(dtable), scratch.data_ptr(), ptr<T>(dout),
                                                    tokens.data<int32_t>(), N, V, C, row_begin, stream_of(dout));),
      [&](auto z, const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
        using T = decltype(z);
        MT_CPU_KERNEL(embedding_backward, T)(ptr<T>(dtable), ptr<T>(dout), tokens.data<int32_t>(), N, V, C, row_begin);
      },
      rw(dtable), rd(dout), rd(tokens));
}

}  // namespace mt
#endif  // MT_CPU_OPS
