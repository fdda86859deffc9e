// SwiGLU (ops.h swiglu_forward / swiglu_backward), GeGLU with the tanh GELU (geglu_*) and the tanh soft-cap
// (softcap_*): the CPU kernels, then the ops; the CUDA launchers are in runtime/kernels/cuda/swiglu.cu.
// out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Backward: dup = dout * silu(g); dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// GeGLU: out = gelu(g) * up, gelu(g) = g/2 (1 + tanh(k (g + a g^3))), k = sqrt(2/pi), a = 0.044715 (PyTorch's
// approximate="tanh"); gelu'(g) = (1 + t)/2 + g/2 (1 - t^2) k (1 + 3 a g^2).
// Soft-cap: out = cap tanh(x / cap); dx = dout (1 - (out / cap)^2).
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

constexpr double kGeluK = 0.7978845608028654, kGeluA = 0.044715;  // sqrt(2/pi), the cubic's coefficient

template <typename T> void geglu_forward(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    Eigen::Map<const Arr<T>> g(gate + b, m), u(up + b, m);
    Eigen::Map<Arr<T>> o(out + b, m);  // may alias gate or up
    o = T(0.5) * g * (T(1) + (T(kGeluK) * (g + T(kGeluA) * g.cube())).tanh()) * u;
  }
}

template <typename T> void geglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    alignas(64) T t_buf[kBlock], dg_buf[kBlock];
    Eigen::Map<const Arr<T>> g(gate + b, m), u(up + b, m), dy(dout + b, m);
    Eigen::Map<Arr<T>> t(t_buf, m), dg(dg_buf, m);
    t = (T(kGeluK) * (g + T(kGeluA) * g.cube())).tanh();
    dg = dy * u *
         (T(0.5) * (T(1) + t) + T(0.5) * g * (T(1) - t.square()) * T(kGeluK) * (T(1) + T(3 * kGeluA) * g.square()));
    Eigen::Map<Arr<T>>(dup + b, m) = dy * T(0.5) * g * (T(1) + t);  // after dg: dup may alias up
    Eigen::Map<Arr<T>>(dgate + b, m) = dg;
  }
}

template <typename T> void softcap_forward(T* out, const T* inp, double cap, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    Eigen::Map<Arr<T>>(out + b, m) = T(cap) * (Eigen::Map<const Arr<T>>(inp + b, m) / T(cap)).tanh();
  }
}

template <typename T> void softcap_backward(T* dinp, const T* dout, const T* out, double cap, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    Eigen::Map<Arr<T>>(dinp + b, m) =
        Eigen::Map<const Arr<T>>(dout + b, m) * (T(1) - (Eigen::Map<const Arr<T>>(out + b, m) / T(cap)).square());
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(swiglu_forward)
MT_CPU_EXPORT(swiglu_backward)
MT_CPU_EXPORT(geglu_forward)
MT_CPU_EXPORT(geglu_backward)
MT_CPU_EXPORT(softcap_forward)
MT_CPU_EXPORT(softcap_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include <cmath>

#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/swiglu.cu: one thread per element, fp32 math
// out, gate, up (n).
template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream);
// dgate, dup (n) overwritten (dup may alias up).
template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream);
template <typename T> int geglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream);
template <typename T>
int geglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream);
// out, inp (n) (may alias); dinp, dout, out (n) (dinp may alias dout).
template <typename T> int softcap_forward(T* out, const T* inp, double cap, int64_t n, void* stream);
template <typename T> int softcap_backward(T* dinp, const T* dout, const T* out, double cap, int64_t n, void* stream);
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

void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const char* op = "geglu_forward";
  check_float(op, gate, "gate");
  expect_shape(op, up, gate.shape(), "up");
  expect_shape(op, out, gate.shape(), "out");
  for (auto* t : {&out, &up}) same_dtype(op, gate, *t, "an operand");
  const int64_t n = gate.numel();
  dispatch(
      op, gate, MT_CUDA_FN(return cuda::geglu_forward<T>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), n, stream_of(gate));),
      [&](auto z, const Tensor& out, const Tensor& gate, const Tensor& up) {
        using T = decltype(z);
        MT_CPU_KERNEL(geglu_forward, T)(ptr<T>(out), ptr<T>(gate), ptr<T>(up), n);
      },
      wr(out), rd(gate), rd(up));
}

void geglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const char* op = "geglu_backward";
  check_float(op, gate, "gate");
  for (auto* t : {&dgate, &dup, &dout, &up}) {
    expect_shape(op, *t, gate.shape(), "an operand");
    same_dtype(op, gate, *t, "an operand");
  }
  const int64_t n = gate.numel();
  dispatch(
      op, gate,
      MT_CUDA_FN(return cuda::geglu_backward<T>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), n,
                                                stream_of(gate));),
      [&](auto z, const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
        using T = decltype(z);
        MT_CPU_KERNEL(geglu_backward, T)(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), n);
      },
      wr(dgate), wr(dup), rd(dout), rd(gate), rd(up));
}

void softcap_forward(const Tensor& out, const Tensor& inp, double cap) {
  const char* op = "softcap_forward";
  check_float(op, inp, "inp");
  expect_shape(op, out, inp.shape(), "out");
  same_dtype(op, inp, out, "out");
  MT_CHECK(cap > 0 && std::isfinite(cap), "kernels", "{}: cap {} must be > 0", op, cap);
  const int64_t n = inp.numel();
  dispatch(
      op, inp, MT_CUDA_FN(return cuda::softcap_forward<T>(ptr<T>(out), ptr<T>(inp), cap, n, stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp) {
        using T = decltype(z);
        MT_CPU_KERNEL(softcap_forward, T)(ptr<T>(out), ptr<T>(inp), cap, n);
      },
      wr(out), rd(inp));
}

void softcap_backward(const Tensor& dinp, const Tensor& dout, const Tensor& out, double cap) {
  const char* op = "softcap_backward";
  check_float(op, out, "out");
  for (auto* t : {&dinp, &dout}) {
    expect_shape(op, *t, out.shape(), "an operand");
    same_dtype(op, out, *t, "an operand");
  }
  MT_CHECK(cap > 0 && std::isfinite(cap), "kernels", "{}: cap {} must be > 0", op, cap);
  const int64_t n = out.numel();
  dispatch(
      op, out,
      MT_CUDA_FN(return cuda::softcap_backward<T>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(out), cap, n, stream_of(out));),
      [&](auto z, const Tensor& dinp, const Tensor& dout, const Tensor& out) {
        using T = decltype(z);
        MT_CPU_KERNEL(softcap_backward, T)(ptr<T>(dinp), ptr<T>(dout), ptr<T>(out), cap, n);
      },
      wr(dinp), rd(dout), rd(out));
}

}  // namespace mt
#endif  // MT_CPU_OPS
