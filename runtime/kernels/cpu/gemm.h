// A general GEMM on the CPU kernels of this process's instruction-set level
// (isa.h): Eigen compiled for SSE, AVX2 + FMA or AVX-512, picked at start-up.
// For code outside runtime/kernels whose own Eigen products would otherwise
// run at the build's baseline (x86-64-v2: 4-wide SSE), e.g. attention's blocks.
// Row-major with leading dimensions (row strides), as cblas_?gemm(CblasRowMajor):
//   C (M x N) = alpha * op(A) * op(B) + beta * C,  op(A) (M x K), op(B) (K x N),
// op(X) = X, or X^T when trans_x (then A is stored K x M, B N x K).
// beta == 0 writes C without reading it. Threaded with OpenMP like the other
// kernels; called inside a parallel region it runs on the calling thread.
#pragma once
#include <cstdint>

namespace mt::cpu {

template <typename T> void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

}  // namespace mt::cpu
