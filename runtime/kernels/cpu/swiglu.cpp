// SwiGLU: out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Backward: dup = dout * silu(g); dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// The exponential is Eigen's vectorised one (a polynomial over this level's
// vector width, within 1-2 ulp of the C library's), in blocks split over the
// threads: the C library's scalar expf kept the loops scalar (11% of the
// default job's time on 1 thread).
#include "runtime/kernels/cpu/isa_eigen.h"

#include <algorithm>

#include "runtime/kernels/cpu/cpu_ops.h"

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

template void swiglu_forward<float>(float*, const float*, const float*, int64_t);
template void swiglu_forward<double>(double*, const double*, const double*, int64_t);
template void swiglu_backward<float>(float*, float*, const float*, const float*, const float*, int64_t);
template void swiglu_backward<double>(double*, double*, const double*, const double*, const double*, int64_t);

}  // namespace mt::cpu::MT_CPU_ISA
