// RMSNorm (ops.h rmsnorm_forward, add_rmsnorm_forward, rmsnorm_backward): the CPU kernels, then the ops;
// the CUDA launchers are in runtime/kernels/cuda/rmsnorm.cu.
// y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps), statistics in f64.
// Backward: with xhat = x * rstd and g = dy * w,
//   dx = rstd * (g - xhat * mean(g * xhat)),  dw += sum_rows dy * xhat.
#include "runtime/kernels/cpu/isa_level.h"

#include <algorithm>
#include <cmath>

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                           double eps, T* sum, const T* residual) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;  // (C)
    T* y = out + n * C;        // (C)
    if (residual) {            // the residual add, fused: the row is still in cache for the norm
      T* s = sum + n * C;
      for (int64_t c = 0; c < C; ++c) s[c] = x[c] + residual[n * C + c];
      x = s;
    }
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * double(x[c]);
    T r = T(1.0 / std::sqrt(ss / double(C) + eps));
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * weight[c];
  }
}

template <typename T> void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                                            const T* rstd, int64_t N, int64_t C, const T* dresidual) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    T* dx = dinp + n * C;
    double r = double(rstd[n]), dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += double(dy[c]) * double(weight[c]) * double(x[c]) * r;
    double mean = dot / double(C);
    const T* dres = dresidual ? dresidual + n * C : nullptr;
    for (int64_t c = 0; c < C; ++c)
      dx[c] = T(r * (double(dy[c]) * double(weight[c]) - double(x[c]) * r * mean) + (dres ? double(dres[c]) : 0.0));
  }
  // dw: columns split across threads, each summed over rows in order (deterministic).
  constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += kCols) {
    int64_t c1 = std::min(C, c0 + kCols);
    double acc[kCols] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      double r = double(rstd[n]);
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += double(dy[c]) * double(x[c]) * r;
    }
    for (int64_t c = c0; c < c1; ++c) dweight[c] += T(acc[c - c0]);
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(rmsnorm_forward)
MT_CPU_EXPORT(rmsnorm_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/rmsnorm.cu: a warp per row, statistics in fp32
// out (N, C), rstd (N) f32, inp (N, C), weight (C).
template <typename T>
int rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C, double eps, void* stream);
// sum (N, C) = a + b rounded to T (sum may alias a or b), then out = rmsnorm(sum): the residual add fused.
template <typename T> int add_rmsnorm_forward(T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                                              int64_t N, int64_t C, double eps, void* stream);
// scratch: rmsnorm_backward_scratch(N, C) floats for deterministic partial sums of dweight (C) f32.
// dresidual (N, C) or null: added to dinp before its one rounding (may alias dinp).
template <typename T> int rmsnorm_backward(T* dinp, float* dweight, float* scratch, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int64_t N, int64_t C, void* stream,
                                           const T* dresidual);
int64_t rmsnorm_backward_scratch(int64_t N, int64_t C);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, double eps) {
  const char* op = "rmsnorm_forward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (N, C), got {}", op, shape_str(inp.shape()));
  int64_t N = inp.size(0), C = inp.size(1);
  expect_shape(op, out, {N, C}, "out");
  expect_shape(op, rstd, {N}, "rstd");
  expect_shape(op, weight, {C}, "weight");
  for (auto* t : {&out, &weight}) same_dtype(op, inp, *t, "an operand");
  expect_acc(op, rstd, inp.dtype(), "rstd");
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::rmsnorm_forward<T>(ptr<T>(out), ptr<float>(rstd), ptr<T>(inp), ptr<T>(weight), N, C, eps,
                                                 stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight) {
        using T = decltype(z);
        MT_CPU_KERNEL(rmsnorm_forward, T)
        (ptr<T>(out), ptr<T>(rstd), ptr<T>(inp), ptr<T>(weight), N, C, eps, nullptr, nullptr);
      },
      wr(out), wr(rstd), rd(inp), rd(weight));
}

void add_rmsnorm_forward(const Tensor& sum, const Tensor& out, const Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& weight, double eps) {
  const char* op = "add_rmsnorm_forward";
  check_float(op, a, "a");
  MT_CHECK(a.dim() == 2, "kernels", "{}: a must be (N, C), got {}", op, shape_str(a.shape()));
  int64_t N = a.size(0), C = a.size(1);
  for (auto [t, name] : {std::pair{&sum, "sum"}, {&out, "out"}, {&b, "b"}}) expect_shape(op, *t, {N, C}, name);
  expect_shape(op, rstd, {N}, "rstd");
  expect_shape(op, weight, {C}, "weight");
  for (auto* t : {&sum, &out, &b, &weight}) same_dtype(op, a, *t, "an operand");
  expect_acc(op, rstd, a.dtype(), "rstd");
  // bf16 on the CPU is the one exception to the widening rule: the sum is rounded between the add and the norm
  // (the norm reads the rounded sum, as on CUDA), so it runs as the two ops.
  if (cpu_bf16(a)) {
    kprof::Scope prof(op, a.device(), 0, kprof::enabled() ? kprof::bytes_of({&sum, &out, &rstd, &a, &b, &weight}) : 0);
    (void)on_cuda(op, {&sum, &out, &rstd, &a, &b, &weight});
    add(sum, a, b);
    return rmsnorm_forward(out, rstd, sum, weight, eps);
  }
  dispatch(
      op, a,
      MT_CUDA_FN(return cuda::add_rmsnorm_forward<T>(ptr<T>(sum), ptr<T>(out), ptr<float>(rstd), ptr<T>(a), ptr<T>(b),
                                                     ptr<T>(weight), N, C, eps, stream_of(a));),
      [&](auto z, const Tensor& sum, const Tensor& out, const Tensor& rstd, const Tensor& a, const Tensor& b,
          const Tensor& weight) {
        using T = decltype(z);
        MT_CPU_KERNEL(rmsnorm_forward, T)
        (ptr<T>(out), ptr<T>(rstd), ptr<T>(a), ptr<T>(weight), N, C, eps, ptr<T>(sum), ptr<T>(b));
      },
      wr(sum), wr(out), wr(rstd), rd(a), rd(b), rd(weight));
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, const Tensor& dresidual) {
  const char* op = "rmsnorm_backward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (N, C), got {}", op, shape_str(inp.shape()));
  int64_t N = inp.size(0), C = inp.size(1);
  expect_shape(op, dinp, {N, C}, "dinp");
  expect_shape(op, dout, {N, C}, "dout");
  expect_shape(op, dweight, {C}, "dweight");
  expect_shape(op, weight, {C}, "weight");
  expect_shape(op, rstd, {N}, "rstd");
  for (auto* t : {&dinp, &dout, &weight}) same_dtype(op, inp, *t, "an operand");
  expect_acc(op, rstd, inp.dtype(), "rstd");
  expect_acc(op, dweight, inp.dtype(), "dweight");
  if (dresidual.defined()) {
    expect_shape(op, dresidual, {N, C}, "dresidual");
    same_dtype(op, inp, dresidual, "dresidual");
  }
  // bf16 on the CPU: the residual gradient is widened and added in f32, one rounding (as on CUDA).
  dispatch(
      op, inp,
      MT_CUDA_FN(Tensor scratch = empty({cuda::rmsnorm_backward_scratch(N, C)}, DType::f32, inp.device());
                 return cuda::rmsnorm_backward<T>(ptr<T>(dinp), ptr<float>(dweight), ptr<float>(scratch), ptr<T>(dout),
                                                  ptr<T>(inp), ptr<T>(weight), ptr<float>(rstd), N, C, stream_of(inp),
                                                  ptr<T>(dresidual));),
      [&](auto z, const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
          const Tensor& weight, const Tensor& rstd, const Tensor& dresidual) {
        using T = decltype(z);
        MT_CPU_KERNEL(rmsnorm_backward, T)
        (ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), ptr<T>(rstd), N, C,
         ptr<T>(dresidual));
      },
      wr(dinp), rw(dweight), rd(dout), rd(inp), rd(weight), rd(rstd), rd(dresidual));
}

}  // namespace mt
#endif  // MT_CPU_OPS
