// Linear layers on Eigen's GEMM (OpenMP-threaded): y = x W^T, dx = dy W, dW += dy^T x.
#include <Eigen/Core>

#include "runtime/kernels/cpu/cpu_ops.h"

namespace mt::cpu {

template <typename T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC, bool accumulate) {
  Eigen::Map<const RowMat<T>> x(inp, N, C);      // (N, C)
  Eigen::Map<const RowMat<T>> w(weight, OC, C);  // (OC, C)
  Eigen::Map<RowMat<T>> y(out, N, OC);           // (N, OC)
  if (accumulate) y.noalias() += x * w.transpose();
  else y.noalias() = x * w.transpose();
}

template <typename T>
void matmul_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t N, int64_t C,
                     int64_t OC, bool accumulate_dinp) {
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

template void matmul_forward<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_forward<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_backward<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                     bool);
template void matmul_backward<double>(double*, double*, const double*, const double*, const double*, int64_t, int64_t,
                                      int64_t, bool);

}  // namespace mt::cpu
