// Linear layers on Eigen's GEMM (OpenMP-threaded): y = x W^T, dx = dy W, dW += dy^T x;
// and gemm (gemm.h), the same GEMM on strided blocks for code outside the kernels.
// Compiled once per instruction-set level, Eigen included (isa_eigen.h): its GEMM
// kernels are chosen at compile time from the -march (SSE 4 floats wide, AVX2 +
// FMA 8, AVX-512 16).
#include "runtime/kernels/cpu/isa_eigen.h"

#include "runtime/kernels/cpu/cpu_ops.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC, bool accumulate) {
  Eigen::Map<const RowMat<T>> x(inp, N, C);      // (N, C)
  Eigen::Map<const RowMat<T>> w(weight, OC, C);  // (OC, C)
  Eigen::Map<RowMat<T>> y(out, N, OC);           // (N, OC)
  if (accumulate) y.noalias() += x * w.transpose();
  else y.noalias() = x * w.transpose();
}

template <typename T> void matmul_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t N,
                                           int64_t C, int64_t OC, bool accumulate_dinp) {
  Eigen::Map<const RowMat<T>> dy(dout, N, OC);  // (N, OC)
  if (dinp) {
    Eigen::Map<const RowMat<T>> w(weight, OC, C);
    Eigen::Map<RowMat<T>> dx(dinp, N, C);  // (N, C)
    if (accumulate_dinp) dx.noalias() += dy * w;
    else dx.noalias() = dy * w;
  }
  if (dweight) {
    Eigen::Map<const RowMat<T>> x(inp, N, C);
    Eigen::Map<RowMat<T>> dw(dweight, OC, C);  // (OC, C)
    dw.noalias() += dy.transpose() * x;
  }
}

template <typename T> void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  using Stride = Eigen::OuterStride<>;
  using CMap = Eigen::Map<const RowMat<T>, 0, Stride>;
  Eigen::Map<RowMat<T>, 0, Stride> c(C, M, N, Stride(ldc));
  auto run = [&](const auto& a, const auto& b) {
    if (beta == T(0)) {
      c.noalias() = alpha * (a * b);
    } else {
      if (beta != T(1)) c *= beta;
      c.noalias() += alpha * (a * b);
    }
  };
  // op(A) is (M, K): A itself is (M, K), or (K, M) when transposed; likewise op(B) (K, N).
  if (!trans_a && !trans_b) run(CMap(A, M, K, Stride(lda)), CMap(B, K, N, Stride(ldb)));
  else if (!trans_a) run(CMap(A, M, K, Stride(lda)), CMap(B, N, K, Stride(ldb)).transpose());
  else if (!trans_b) run(CMap(A, K, M, Stride(lda)).transpose(), CMap(B, K, N, Stride(ldb)));
  else run(CMap(A, K, M, Stride(lda)).transpose(), CMap(B, N, K, Stride(ldb)).transpose());
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*,
                           int64_t, double, double*, int64_t);
template void matmul_forward<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_forward<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_backward<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                     int64_t, bool);
template void matmul_backward<double>(double*, double*, const double*, const double*, const double*, int64_t, int64_t,
                                      int64_t, bool);

}  // namespace mt::cpu::MT_CPU_ISA
