// AdamW in torch.optim.AdamW's order of operations (single-tensor path):
//   p *= 1 - lr*wd;  m += (1-b1)(g - m);  v = b2 v + (1-b2) g^2;
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#include <cmath>

#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa_level.h"

namespace mt::cpu::MT_CPU_ISA {

template <typename T, typename S> void adamw(T* param, const T* grad, S* m, S* v, int64_t n, double lr, double beta1,
                                             double beta2, double eps, double weight_decay, int64_t step) {
  const S decay = S(1.0 - lr * weight_decay);
  const S b1 = S(beta1), b2 = S(beta2);
  const S step_size = S(lr / (1.0 - std::pow(beta1, double(step))));
  const S bc2_sqrt = S(std::sqrt(1.0 - std::pow(beta2, double(step))));
  const S e = S(eps);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    S p = S(param[i]) * decay, g = S(grad[i]);
    S mi = m[i] + (S(1) - b1) * (g - m[i]);
    S vi = v[i] * b2 + (S(1) - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    param[i] = T(p - step_size * mi / (std::sqrt(vi) / bc2_sqrt + e));
  }
}

template void adamw<float, float>(float*, const float*, float*, float*, int64_t, double, double, double, double, double,
                                  int64_t);
template void adamw<double, double>(double*, const double*, double*, double*, int64_t, double, double, double, double,
                                    double, int64_t);

}  // namespace mt::cpu::MT_CPU_ISA
