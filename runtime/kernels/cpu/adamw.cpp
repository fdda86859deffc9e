// AdamW (ops.h adamw_step): the CPU kernel, then the op; the CUDA launcher is in runtime/kernels/cuda/adamw.cu.
// AdamW in torch.optim.AdamW's order of operations (single-tensor path):
//   p *= 1 - lr*wd;  m += (1-b1)(g - m);  v = b2 v + (1-b2) g^2;
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#include "runtime/kernels/cpu/isa_level.h"

#include <cmath>

namespace mt::cpu::MT_CPU_ISA {

// The state has the parameter's type (f32 or f64 master weights).
template <typename T> void adamw(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, int64_t step) {
  using S = T;
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

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(adamw)

#if MT_CPU_OPS  // the op, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/adamw.cu: fp32 master weights; param_lowp (may be null) gets them rounded to bf16
int adamw(float* param, bf16* param_lowp, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
          double beta2, double eps, double weight_decay, int64_t step, void* stream, const float* hyper);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, const Tensor& param_lowp,
                const Tensor& hyper) {
  const char* op = "adamw_step";
  check_float(op, param, "param");
  MT_CHECK(param.dtype() != DType::bf16, "kernels", "{}: the parameter updated is the f32 master copy, got bf16", op);
  MT_CHECK(step >= 1, "kernels", "{}: step is 1-based, got {}", op, step);
  for (auto* t : {&grad, &m, &v}) expect_shape(op, *t, param.shape(), "grad/m/v");
  same_dtype(op, param, grad, "grad");
  same_dtype(op, m, v, "v");
  MT_CHECK(m.dtype() == param.dtype(), "kernels", "{}: optimizer state is {} but the parameter is {}", op,
           dtype_name(m.dtype()), dtype_name(param.dtype()));
  if (param_lowp.defined()) {
    MT_CHECK(param_lowp.dtype() == DType::bf16 && param_lowp.numel() == param.numel(), "kernels",
             "{}: the compute copy must be bf16 of {} elements", op, param.numel());
  }
  if (hyper.defined()) {
    MT_CHECK(hyper.dtype() == DType::f32 && hyper.numel() == 4 && param.device().is_cuda(), "kernels",
             "{}: hyper is 4 f32 values on the CUDA device of the parameter (a CUDA graph's step), got {} {} on {}", op,
             hyper.numel(), dtype_name(hyper.dtype()), hyper.device().str());
  }
  // Profiled with the bytes it moves: param, m and v read and written, grad read, the bf16 copy written.
  kprof::Scope prof(op, param.device(), 0,
                    kprof::enabled() ? kprof::bytes_of({&param, &grad, &m, &v, &param_lowp}) +
                                           double(param.nbytes() + m.nbytes() + v.nbytes())
                                     : 0);
#if MT_CUDA
  if (on_cuda(op, {&param, &grad, &m, &v, &param_lowp, &hyper})) {
    cuda_check(cuda::adamw(ptr<float>(param), ptr<bf16>(param_lowp), ptr<float>(grad), ptr<float>(m), ptr<float>(v),
                           param.numel(), lr, beta1, beta2, eps, weight_decay, step, stream_of(param), ptr<float>(hyper)),
               op);
    return;
  }
#else
  (void)on_cuda(op, {&param, &grad, &m, &v, &param_lowp, &hyper});
#endif
  by_float(param, [&](auto z) {
    using T = decltype(z);
    MT_CPU_KERNEL(adamw, T)
    (ptr<T>(param), ptr<T>(grad), ptr<T>(m), ptr<T>(v), param.numel(), lr, beta1, beta2, eps, weight_decay, step);
  });
  if (param_lowp.defined()) convert(param_lowp, param);
}

}  // namespace mt
#endif  // MT_CPU_OPS
