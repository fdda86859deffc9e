// SwiGLU: out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Backward: dup = dout * silu(g); dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
#include <cmath>

#include "runtime/kernels/cpu/cpu_ops.h"

namespace mt::cpu {

template <typename T> void swiglu_forward(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T g = gate[i];
    out[i] = g / (T(1) + std::exp(-g)) * up[i];
  }
}

template <typename T> void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T g = gate[i], s = T(1) / (T(1) + std::exp(-g)), dy = dout[i];
    T u = up[i];  // read before writing: dup may alias up
    dup[i] = dy * g * s;
    dgate[i] = dy * u * s * (T(1) + g * (T(1) - s));
  }
}

template void swiglu_forward<float>(float*, const float*, const float*, int64_t);
template void swiglu_forward<double>(double*, const double*, const double*, int64_t);
template void swiglu_backward<float>(float*, float*, const float*, const float*, const float*, int64_t);
template void swiglu_backward<double>(double*, double*, const double*, const double*, const double*, int64_t);

}  // namespace mt::cpu
