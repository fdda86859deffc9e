// RoPE in the Hugging Face convention: out = x * cos + rotate_half(x) * sin with
// rotate_half([x1, x2]) = [-x2, x1]; cos/sin hold the frequencies twice along hd.
#include <cmath>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void rope_tables(T* cos, T* sin, const int64_t* positions, int64_t P, int64_t hd, double theta) {
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      // In T's precision, as Hugging Face computes inv_freq and the angles in the model's float type.
      T inv_freq = T(1) / T(std::pow(T(theta), T(2 * i) / T(hd)));
      T angle = T(positions[p]) * inv_freq;
      T c = T(std::cos(double(angle))), s = T(std::sin(double(angle)));
      cos[p * hd + i] = cos[p * hd + i + half] = c;
      sin[p * hd + i] = sin[p * hd + i + half] = s;
    }
}

template <typename T>
void rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const T* c = cos + (bt % T_) * hd;  // (hd)
    const T* s = sin + (bt % T_) * hd;
    for (int64_t h = 0; h < H; ++h) {
      const T* x = inp + (bt * H + h) * hd;  // (hd)
      T* y = out + (bt * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        T x1 = x[i], x2 = x[i + half];  // read both before writing: out may alias inp
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

template <typename T>
void rope_backward(T* dinp, const T* dout, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const T* c = cos + (bt % T_) * hd;
    const T* s = sin + (bt % T_) * hd;
    for (int64_t h = 0; h < H; ++h) {
      const T* dy = dout + (bt * H + h) * hd;
      T* dx = dinp + (bt * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        T d1 = dy[i], d2 = dy[i + half];
        dx[i] = d1 * c[i] + d2 * s[i + half];
        dx[i + half] = d2 * c[i + half] - d1 * s[i];
      }
    }
  }
}

template void rope_tables<float>(float*, float*, const int64_t*, int64_t, int64_t, double);
template void rope_tables<double>(double*, double*, const int64_t*, int64_t, int64_t, double);
template void rope_forward<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t);
template void rope_forward<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                                   int64_t);
template void rope_backward<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                   int64_t);
template void rope_backward<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                                    int64_t);

}  // namespace mt::cpu::MT_CPU_ISA
