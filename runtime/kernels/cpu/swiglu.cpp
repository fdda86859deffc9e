// SwiGLU (ops.h swiglu_forward / swiglu_backward): the CPU kernels, then the ops; the CUDA launchers are in
// runtime/kernels/cuda/swiglu.cu. out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Backward: dup = dout * silu(g); dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// The exponential is Eigen's vectorised one (a polynomial over this level's
// vector width, within 1-2 ulp of the C library's), in blocks split over the
// threads: the C library's scalar expf kept the loops scalar (11% of the
// default job's time on 1 thread).
#include "runtime/kernels/cpu/isa_eigen.h"

#include <algorithm>

namespace mt::cpu::MT_CPU_ISA {

namespace {
constexpr int64_t kBlock = 2048;  // elements per block: the temporaries stay on the stack and in L1
template <typename T> using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
}  // namespace

template <typename T> void swiglu_forward(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    Eigen::Map<const Arr<T>> g(gate + b, m), u(up + b, m);
    Eigen::Map<Arr<T>> o(out + b, m);  // may alias gate or up: each coefficient is read before it is written
    o = g / (T(1) + (-g).exp()) * u;
  }
}

template <typename T> void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    alignas(64) T s_buf[kBlock], dg_buf[kBlock];
    Eigen::Map<const Arr<T>> g(gate + b, m), u(up + b, m), dy(dout + b, m);
    Eigen::Map<Arr<T>> s(s_buf, m), dg(dg_buf, m);
    s = T(1) / (T(1) + (-g).exp());
    dg = dy * u * s * (T(1) + g * (T(1) - s));  // before dup is written: dup may alias up
    Eigen::Map<Arr<T>>(dup + b, m) = dy * g * s;
    Eigen::Map<Arr<T>>(dgate + b, m) = dg;
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(swiglu_forward)
MT_CPU_EXPORT(swiglu_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/swiglu.cu: one thread per element, fp32 math
// out, gate, up (n).
template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream);
// dgate, dup (n) overwritten (dup may alias up).
template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_forward";
  check_float(op, gate, "gate");
  expect_shape(op, up, gate.shape(), "up");
  expect_shape(op, out, gate.shape(), "out");
  for (auto* t : {&out, &up}) same_dtype(op, gate, *t, "an operand");
  const int64_t n = gate.numel();
  dispatch(
      op, gate, MT_CUDA_FN(return cuda::swiglu_forward<T>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), n, stream_of(gate));),
      [&](auto z, const Tensor& out, const Tensor& gate, const Tensor& up) {
        using T = decltype(z);
        MT_CPU_KERNEL(swiglu_forward, T)(ptr<T>(out), ptr<T>(gate), ptr<T>(up), n);
      },
      wr(out), rd(gate), rd(up));
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_backward";
  check_float(op, gate, "gate");
  for (auto* t : {&dgate, &dup, &dout, &up}) {
    expect_shape(op, *t, gate.shape(), "an operand");
    same_dtype(op, gate, *t, "an operand");
  }
  const int64_t n = gate.numel();
  dispatch(
      op, gate,
      MT_CUDA_FN(return cuda::swiglu_backward<T>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), n,
                                                 stream_of(gate));),
      [&](auto z, const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
        using T = decltype(z);
        MT_CPU_KERNEL(swiglu_backward, T)(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), n);
      },
      wr(dgate), wr(dup), rd(dout), rd(gate), rd(up));
}

}  // namespace mt
#endif  // MT_CPU_OPS
