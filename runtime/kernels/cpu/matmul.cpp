// Linear layers (ops.h matmul_forward / matmul_backward): the CPU kernels on Eigen's GEMM (OpenMP-threaded),
// y = x W^T, dx = dy W, dW += dy^T x, then the ops (checks, dispatch); the CUDA launchers are in
// runtime/kernels/cuda/matmul.cu (cuBLASLt).
// Compiled once per instruction-set level, Eigen included (isa_eigen.h): its GEMM
// kernels are chosen at compile time from the -march (SSE 4 floats wide, AVX2 +
// FMA 8, AVX-512 16).
#include "runtime/kernels/cpu/isa_eigen.h"

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

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(matmul_forward)
MT_CPU_EXPORT(matmul_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/matmul.cu: cuBLASLt, fp32 accumulate; the algorithm cached per shape
// out (N, OC) = inp (N, C) @ weight (OC, C)^T, or += if accumulate.
template <typename T> int matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC,
                                         bool accumulate, void* stream, int device);
// dinp (N, C) = (or += with accumulate_dinp) dout (N, OC) @ weight (OC, C) (if dinp);
// dweight (OC, C) f32 += dout^T @ inp (if dweight).
template <typename T> int matmul_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight,
                                          int64_t N, int64_t C, int64_t OC, void* stream, int device,
                                          bool accumulate_dinp);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, bool accumulate) {
  const char* op = "matmul_forward";
  check_float(op, inp, "inp");
  check_float(op, weight, "weight");
  check_float(op, out, "out");
  same_dtype(op, inp, weight, "weight");
  same_dtype(op, inp, out, "out");
  MT_CHECK(inp.dim() == 2 && weight.dim() == 2 && inp.size(1) == weight.size(1), "kernels",
           "{}: inp {} @ weight {}^T: inner sizes differ", op, shape_str(inp.shape()), shape_str(weight.shape()));
  int64_t N = inp.size(0), C = inp.size(1), OC = weight.size(0);
  expect_shape(op, out, {N, OC}, "out");
  // Profiled with its FLOPs: 2 N C OC, the operands read once (out twice when accumulating).
  kprof::Scope prof(
      op, inp.device(), 2.0 * double(N) * double(C) * double(OC),
      kprof::enabled() ? kprof::bytes_of({&inp, &weight, &out}) + (accumulate ? double(out.nbytes()) : 0) : 0);
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::matmul_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate,
                                                stream_of(inp), inp.device().index);),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& weight) {
        using T = decltype(z);
        MT_CPU_KERNEL(matmul_forward, T)(ptr<T>(out), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate);
      },
      accumulate ? rw(out) : wr(out), rd(inp), rd(weight));
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp) {
  const char* op = "matmul_backward";
  check_float(op, dout, "dout");
  check_float(op, weight, "weight");
  MT_CHECK(dout.dim() == 2 && weight.dim() == 2 && dout.size(1) == weight.size(0), "kernels",
           "{}: dout {} does not match weight {}", op, shape_str(dout.shape()), shape_str(weight.shape()));
  same_dtype(op, dout, weight, "weight");
  int64_t N = dout.size(0), OC = weight.size(0), C = weight.size(1);
  if (dinp.defined()) {
    check_float(op, dinp, "dinp");
    same_dtype(op, dout, dinp, "dinp");
    expect_shape(op, dinp, {N, C}, "dinp");
  }
  if (dweight.defined()) {
    check_float(op, dweight, "dweight");
    check_float(op, inp, "inp");
    expect_acc(op, dweight, dout.dtype(), "dweight");
    same_dtype(op, dout, inp, "inp");
    expect_shape(op, dweight, {OC, C}, "dweight");
    expect_shape(op, inp, {N, C}, "inp");
  }
  // Profiled with its FLOPs: 2 N C OC per product computed; dweight (f32, beta = 1) read and written.
  kprof::Scope prof(
      op, dout.device(),
      2.0 * double(N) * double(C) * double(OC) * ((dinp.defined() ? 1 : 0) + (dweight.defined() ? 1 : 0)),
      kprof::enabled()
          ? double(dout.nbytes()) +
                (dinp.defined() ? double(weight.nbytes() + dinp.nbytes() * (accumulate_dinp ? 2 : 1)) : 0) +
                (dweight.defined() ? double(inp.nbytes() + 2 * dweight.nbytes()) : 0)
          : 0);
  // bf16 on the CPU: accumulating, the old dinp is widened and the sum rounded once (as cuBLASLt's beta = 1);
  // inp is widened only when dweight needs it.
  dispatch(
      op, dout,
      MT_CUDA_FN(return cuda::matmul_backward<T>(ptr<T>(dinp), ptr<float>(dweight), ptr<T>(dout), ptr<T>(inp),
                                                 ptr<T>(weight), N, C, OC, stream_of(dout), dout.device().index,
                                                 accumulate_dinp);),
      [&](auto z, const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
          const Tensor& weight) {
        using T = decltype(z);
        MT_CPU_KERNEL(matmul_backward, T)
        (ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate_dinp);
      },
      accumulate_dinp ? rw(dinp) : wr(dinp), rw(dweight), rd(dout), rd(dweight.defined() ? inp : Tensor()), rd(weight));
}

}  // namespace mt
#endif  // MT_CPU_OPS
