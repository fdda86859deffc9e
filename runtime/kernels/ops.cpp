// Shape, dtype and device checks of every op, then dispatch to the backend.
#include "runtime/kernels/ops.h"

#include <omp.h>

#include <Eigen/Core>

#include "runtime/core/stream.h"
#include "runtime/kernels/cpu/cpu_ops.h"
#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"
#endif

namespace mt {

namespace {

void check_float(const char* op, const Tensor& t, const char* what) {
  MT_CHECK(t.defined(), "kernels", "{}: {} is undefined", op, what);
  if (t.device().is_cuda()) {
    MT_CHECK(MT_CUDA, "kernels", "{}: {} is on {} but meshtrain was built without CUDA", op, what, t.device().str());
    MT_CHECK(t.dtype() == DType::f32, "kernels", "{}: {} is {}; the CUDA backend takes f32 (bf16 comes with issue 6)", op,
             what, dtype_name(t.dtype()));
    return;
  }
  MT_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64, "kernels", "{}: {} is {}; the CPU backend takes f32 or f64",
           op, what, dtype_name(t.dtype()));
}

// All operands on the first one's device.
bool on_cuda(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) first = t;
    MT_CHECK(t->device() == first->device(), "kernels", "{}: operands on {} and {}", op, first->device().str(),
             t->device().str());
  }
  return first && first->device().is_cuda();
}

#if MT_CUDA
void* stream_of(const Tensor& t) { return current_stream(t.device().index).handle(); }
float* fp(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }
void cuda_check(int rc, const char* op) {
  MT_CHECK(rc == 0, "kernels", "{}: CUDA or cuBLAS error {}", op, rc);
}
// MT_CUDA_DISPATCH(op, launcher(...), operands...): the CUDA launcher when the operands are on a device.
#define MT_CUDA_DISPATCH(op, call, ...)        \
  if (on_cuda(op, {__VA_ARGS__})) {            \
    cuda_check(cuda::call, op);                \
    return;                                    \
  }
#else
#define MT_CUDA_DISPATCH(op, call, ...) (void)on_cuda(op, {__VA_ARGS__});
#endif

void same_dtype(const char* op, const Tensor& a, const Tensor& b, const char* what) {
  MT_CHECK(a.dtype() == b.dtype(), "kernels", "{}: {} is {} but the other operands are {}", op, what,
           dtype_name(b.dtype()), dtype_name(a.dtype()));
}

void expect_shape(const char* op, const Tensor& t, const Shape& s, const char* what) {
  MT_CHECK(t.shape() == s, "kernels", "{}: {} has shape {}, expected {}", op, what, shape_str(t.shape()), shape_str(s));
}

void check_i32(const char* op, const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::i32 && t.numel() == n, "kernels", "{}: {} must be {} i32 values, got {} {}",
           op, what, n, t.defined() ? dtype_name(t.dtype()) : "none", t.defined() ? shape_str(t.shape()) : "");
}

// Calls f(T{}) with T = float or double by the tensor's dtype.
template <typename F> void by_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::f64) f(double{});
  else f(float{});
}

template <typename T> T* ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

}  // namespace

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
  MT_CUDA_DISPATCH(op, matmul_forward(fp(out), fp(inp), fp(weight), N, C, OC, accumulate, stream_of(inp), inp.device().index), &out, &inp, &weight)
  by_float(inp, [&](auto z) {
    using T = decltype(z);
    cpu::matmul_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate);
  });
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight) {
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
    same_dtype(op, dout, dweight, "dweight");
    same_dtype(op, dout, inp, "inp");
    expect_shape(op, dweight, {OC, C}, "dweight");
    expect_shape(op, inp, {N, C}, "inp");
  }
  MT_CUDA_DISPATCH(op, matmul_backward(fp(dinp), fp(dweight), fp(dout), fp(inp), fp(weight), N, C, OC, stream_of(dout),
                                   dout.device().index), &dinp, &dweight, &dout, &inp, &weight)
  by_float(dout, [&](auto z) {
    using T = decltype(z);
    cpu::matmul_backward<T>(ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), N, C, OC);
  });
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, double eps) {
  const char* op = "rmsnorm_forward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (N, C), got {}", op, shape_str(inp.shape()));
  int64_t N = inp.size(0), C = inp.size(1);
  expect_shape(op, out, {N, C}, "out");
  expect_shape(op, rstd, {N}, "rstd");
  expect_shape(op, weight, {C}, "weight");
  for (auto* t : {&out, &rstd, &weight}) same_dtype(op, inp, *t, "an operand");
  MT_CUDA_DISPATCH(op, rmsnorm_forward(fp(out), fp(rstd), fp(inp), fp(weight), N, C, eps, stream_of(inp)), &out, &rstd, &inp, &weight)
  by_float(inp, [&](auto z) {
    using T = decltype(z);
    cpu::rmsnorm_forward<T>(ptr<T>(out), ptr<T>(rstd), ptr<T>(inp), ptr<T>(weight), N, C, eps);
  });
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd) {
  const char* op = "rmsnorm_backward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (N, C), got {}", op, shape_str(inp.shape()));
  int64_t N = inp.size(0), C = inp.size(1);
  expect_shape(op, dinp, {N, C}, "dinp");
  expect_shape(op, dout, {N, C}, "dout");
  expect_shape(op, dweight, {C}, "dweight");
  expect_shape(op, weight, {C}, "weight");
  expect_shape(op, rstd, {N}, "rstd");
  for (auto* t : {&dinp, &dweight, &dout, &weight, &rstd}) same_dtype(op, inp, *t, "an operand");
#if MT_CUDA
  if (on_cuda(op, {&dinp, &dweight, &dout, &inp, &weight, &rstd})) {
    Tensor scratch = empty({cuda::rmsnorm_backward_scratch(N, C)}, DType::f32, inp.device());
    cuda_check(cuda::rmsnorm_backward(fp(dinp), fp(dweight), fp(scratch), fp(dout), fp(inp), fp(weight), fp(rstd), N, C,
                                      stream_of(inp)),
               op);
    return;
  }
#endif
  by_float(inp, [&](auto z) {
    using T = decltype(z);
    cpu::rmsnorm_backward<T>(ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), ptr<T>(rstd),
                             N, C);
  });
}

void rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions, double theta) {
  const char* op = "rope_tables";
  check_float(op, cos, "cos");
  MT_CHECK(!cos.device().is_cuda(), "kernels", "{}: the tables are computed on the host, then copied", op);
  MT_CHECK(positions.dtype() == DType::i64 && positions.dim() == 1 && !positions.device().is_cuda(), "kernels",
           "{}: positions must be (P) i64 on the CPU", op);
  int64_t P = positions.size(0);
  MT_CHECK(cos.dim() == 2 && cos.size(0) == P && cos.size(1) % 2 == 0, "kernels",
           "{}: cos must be (P, hd) with an even hd, got {}", op, shape_str(cos.shape()));
  expect_shape(op, sin, cos.shape(), "sin");
  same_dtype(op, cos, sin, "sin");
  by_float(cos, [&](auto z) {
    using T = decltype(z);
    cpu::rope_tables<T>(ptr<T>(cos), ptr<T>(sin), positions.data<int64_t>(), P, cos.size(1), theta);
  });
}

namespace {
void rope_check(const char* op, const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin) {
  check_float(op, inp, "x");
  MT_CHECK(inp.dim() == 4 && inp.size(3) % 2 == 0, "kernels", "{}: x must be (B, T, H, hd) with an even hd, got {}", op,
           shape_str(inp.shape()));
  expect_shape(op, out, inp.shape(), "out");
  expect_shape(op, cos, {inp.size(1), inp.size(3)}, "cos");
  expect_shape(op, sin, {inp.size(1), inp.size(3)}, "sin");
  for (auto* t : {&out, &cos, &sin}) same_dtype(op, inp, *t, "an operand");
}
}  // namespace

void rope_forward(const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin) {
  rope_check("rope_forward", out, inp, cos, sin);
  MT_CUDA_DISPATCH("rope_forward", rope_forward(fp(out), fp(inp), fp(cos), fp(sin), inp.size(0), inp.size(1), inp.size(2), inp.size(3),
                                false, stream_of(inp)), &out, &inp, &cos, &sin)
  by_float(inp, [&](auto z) {
    using T = decltype(z);
    cpu::rope_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(cos), ptr<T>(sin), inp.size(0), inp.size(1), inp.size(2),
                         inp.size(3));
  });
}

void rope_backward(const Tensor& dinp, const Tensor& dout, const Tensor& cos, const Tensor& sin) {
  rope_check("rope_backward", dinp, dout, cos, sin);
  MT_CUDA_DISPATCH("rope_backward", rope_forward(fp(dinp), fp(dout), fp(cos), fp(sin), dout.size(0), dout.size(1), dout.size(2),
                                dout.size(3), true, stream_of(dout)), &dinp, &dout, &cos, &sin)
  by_float(dout, [&](auto z) {
    using T = decltype(z);
    cpu::rope_backward<T>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(cos), ptr<T>(sin), dout.size(0), dout.size(1),
                          dout.size(2), dout.size(3));
  });
}

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_forward";
  check_float(op, gate, "gate");
  expect_shape(op, up, gate.shape(), "up");
  expect_shape(op, out, gate.shape(), "out");
  for (auto* t : {&out, &up}) same_dtype(op, gate, *t, "an operand");
  MT_CUDA_DISPATCH(op, swiglu_forward(fp(out), fp(gate), fp(up), gate.numel(), stream_of(gate)), &out, &gate, &up)
  by_float(gate, [&](auto z) {
    using T = decltype(z);
    cpu::swiglu_forward<T>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), gate.numel());
  });
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_backward";
  check_float(op, gate, "gate");
  for (auto* t : {&dgate, &dup, &dout, &up}) {
    expect_shape(op, *t, gate.shape(), "an operand");
    same_dtype(op, gate, *t, "an operand");
  }
  MT_CUDA_DISPATCH(op, swiglu_backward(fp(dgate), fp(dup), fp(dout), fp(gate), fp(up), gate.numel(), stream_of(gate)), &dgate, &dup, &dout, &gate, &up)
  by_float(gate, [&](auto z) {
    using T = decltype(z);
    cpu::swiglu_backward<T>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up), gate.numel());
  });
}

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t row_begin,
                       int64_t vocab_size) {
  const char* op = "embedding_forward";
  check_float(op, table, "table");
  MT_CHECK(table.dim() == 2, "kernels", "{}: table must be (V, C), got {}", op, shape_str(table.shape()));
  int64_t N = tokens.numel(), V = table.size(0), C = table.size(1);
  check_i32(op, tokens, N, "tokens");
  expect_shape(op, out, {N, C}, "out");
  same_dtype(op, table, out, "out");
  // Device tokens come from the data loader, which checked them against the vocabulary.
  MT_CUDA_DISPATCH(op, embedding_forward(fp(out), tokens.data<int32_t>(), fp(table), N, V, C, row_begin, stream_of(table)), &out, &tokens, &table)
  if (vocab_size > 0) {
    const int32_t* tk = tokens.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      MT_CHECK(tk[n] >= 0 && tk[n] < vocab_size, "kernels", "{}: token {} at position {} is outside the vocabulary [0, {})",
               op, tk[n], n, vocab_size);
  }
  by_float(table, [&](auto z) {
    using T = decltype(z);
    cpu::embedding_forward<T>(ptr<T>(out), tokens.data<int32_t>(), ptr<T>(table), N, V, C, row_begin);
  });
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t row_begin) {
  const char* op = "embedding_backward";
  check_float(op, dtable, "dtable");
  MT_CHECK(dtable.dim() == 2, "kernels", "{}: dtable must be (V, C), got {}", op, shape_str(dtable.shape()));
  int64_t N = tokens.numel(), V = dtable.size(0), C = dtable.size(1);
  check_i32(op, tokens, N, "tokens");
  expect_shape(op, dout, {N, C}, "dout");
  same_dtype(op, dtable, dout, "dout");
  MT_CUDA_DISPATCH(op, embedding_backward(fp(dtable), fp(dout), tokens.data<int32_t>(), N, V, C, row_begin, stream_of(dout)), &dtable, &dout, &tokens)
  by_float(dtable, [&](auto z) {
    using T = decltype(z);
    cpu::embedding_backward<T>(ptr<T>(dtable), ptr<T>(dout), tokens.data<int32_t>(), N, V, C, row_begin);
  });
}

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, double grad_scale) {
  const char* op = "cross_entropy";
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V), got {}", op, shape_str(logits.shape()));
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  expect_shape(op, losses, {N}, "losses");
  same_dtype(op, logits, losses, "losses");
  if (dlogits.defined()) {
    expect_shape(op, dlogits, logits.shape(), "dlogits");
    same_dtype(op, logits, dlogits, "dlogits");
  }
  MT_CUDA_DISPATCH(op, cross_entropy(fp(losses), fp(dlogits), fp(logits), targets.data<int32_t>(), N, V, grad_scale,
                                 stream_of(logits)), &losses, &dlogits, &logits, &targets)
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    MT_CHECK(tg[n] < V, "kernels", "{}: target {} at position {} is >= the vocabulary size {}", op, tg[n], n, V);
  by_float(logits, [&](auto z) {
    using T = decltype(z);
    cpu::cross_entropy<T>(ptr<T>(losses), ptr<T>(dlogits), ptr<T>(logits), tg, N, V, grad_scale);
  });
}

namespace {
void check_f64_rows(const char* op, const Tensor& t, int64_t N, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::f64 && t.shape() == Shape{N} && !t.device().is_cuda(), "kernels",
           "{}: {} must be ({}) f64 on the CPU", op, what, N);
}
}  // namespace

void vocab_shard_max(const Tensor& row_max, const Tensor& logits) {
  const char* op = "vocab_shard_max";
  check_float(op, logits, "logits");
  MT_CHECK(!logits.device().is_cuda(), "kernels", "{}: loss parallel on CUDA tensors comes with the CUDA step (issue 6)", op);
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_f64_rows(op, row_max, N, "row_max");
  by_float(logits, [&](auto z) {
    using T = decltype(z);
    cpu::vocab_shard_max<T>(row_max.data<double>(), ptr<T>(logits), N, V);
  });
}

void vocab_shard_sumexp(const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                        const Tensor& row_max, int64_t vocab_begin) {
  const char* op = "vocab_shard_sumexp";
  check_float(op, logits, "logits");
  MT_CHECK(!logits.device().is_cuda(), "kernels", "{}: loss parallel on CUDA tensors comes with the CUDA step (issue 6)", op);
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, N, "statistics");
  by_float(logits, [&](auto z) {
    using T = decltype(z);
    cpu::vocab_shard_sumexp<T>(sumexp.data<double>(), target_logit.data<double>(), ptr<T>(logits),
                               targets.data<int32_t>(), row_max.data<double>(), N, V, vocab_begin);
  });
}

void vocab_shard_loss(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                      const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, int64_t vocab_begin,
                      double grad_scale) {
  const char* op = "vocab_shard_loss";
  check_float(op, logits, "logits");
  MT_CHECK(!logits.device().is_cuda(), "kernels", "{}: loss parallel on CUDA tensors comes with the CUDA step (issue 6)", op);
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  expect_shape(op, losses, {N}, "losses");
  same_dtype(op, logits, losses, "losses");
  if (dlogits.defined()) {
    expect_shape(op, dlogits, logits.shape(), "dlogits");
    same_dtype(op, logits, dlogits, "dlogits");
  }
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, N, "statistics");
  by_float(logits, [&](auto z) {
    using T = decltype(z);
    cpu::vocab_shard_loss<T>(ptr<T>(losses), ptr<T>(dlogits), ptr<T>(logits), targets.data<int32_t>(),
                             row_max.data<double>(), sumexp.data<double>(), target_logit.data<double>(), N, V,
                             vocab_begin, grad_scale);
  });
}

void add_(const Tensor& dst, const Tensor& src) { add(dst, dst, src); }

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* op = "add";
  check_float(op, a, "a");
  expect_shape(op, b, a.shape(), "b");
  expect_shape(op, out, a.shape(), "out");
  for (auto* t : {&out, &b}) same_dtype(op, a, *t, "an operand");
  MT_CUDA_DISPATCH(op, add(fp(out), fp(a), fp(b), a.numel(), stream_of(a)), &out, &a, &b)
  by_float(a, [&](auto z) {
    using T = decltype(z);
    cpu::add<T>(ptr<T>(out), ptr<T>(a), ptr<T>(b), a.numel());
  });
}

void scale_(const Tensor& t, double s) {
  check_float("scale_", t, "t");
  MT_CUDA_DISPATCH("scale_", scale(fp(t), s, t.numel(), stream_of(t)), &t)
  by_float(t, [&](auto z) {
    using T = decltype(z);
    cpu::scale<T>(ptr<T>(t), s, t.numel());
  });
}

#if MT_CUDA
namespace {
// Fixed-size chunks reduced on the device, their partials summed on the host in order.
double cuda_sum(const Tensor& t, bool squares, const char* op) {
  int64_t n = cuda::reduce_partials_count(t.numel());
  if (n == 0) return 0;
  Tensor partials = empty({n}, DType::f64, t.device());
  cuda_check(cuda::reduce_sum(partials.data<double>(), fp(t), t.numel(), squares, stream_of(t)), op);
  double total = 0;
  for (double p : to_f64(partials)) total += p;
  return total;
}
}  // namespace
#endif

double sum_squares(const Tensor& t) {
  check_float("sum_squares", t, "t");
#if MT_CUDA
  if (t.device().is_cuda()) return cuda_sum(t, true, "sum_squares");
#endif
  double r = 0;
  by_float(t, [&](auto z) {
    using T = decltype(z);
    r = cpu::sum_squares<T>(ptr<T>(t), t.numel());
  });
  return r;
}

double sum(const Tensor& t) {
  check_float("sum", t, "t");
#if MT_CUDA
  if (t.device().is_cuda()) return cuda_sum(t, false, "sum");
#endif
  double r = 0;
  by_float(t, [&](auto z) {
    using T = decltype(z);
    r = cpu::sum<T>(ptr<T>(t), t.numel());
  });
  return r;
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step) {
  const char* op = "adamw_step";
  check_float(op, param, "param");
  MT_CHECK(step >= 1, "kernels", "{}: step is 1-based, got {}", op, step);
  for (auto* t : {&grad, &m, &v}) expect_shape(op, *t, param.shape(), "grad/m/v");
  same_dtype(op, param, grad, "grad");
  same_dtype(op, m, v, "v");
  MT_CHECK(m.dtype() == param.dtype(), "kernels", "{}: optimizer state is {} but the parameter is {}", op,
           dtype_name(m.dtype()), dtype_name(param.dtype()));
  MT_CUDA_DISPATCH(op, adamw(fp(param), fp(grad), fp(m), fp(v), param.numel(), lr, beta1, beta2, eps, weight_decay, step,
                         stream_of(param)), &param, &grad, &m, &v)
  by_float(param, [&](auto z) {
    using T = decltype(z);
    cpu::adamw<T, T>(ptr<T>(param), ptr<T>(grad), ptr<T>(m), ptr<T>(v), param.numel(), lr, beta1, beta2, eps,
                     weight_decay, step);
  });
}

void set_cpu_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  Eigen::setNbThreads(n);
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace mt
