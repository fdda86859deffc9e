// Shape, dtype and device checks of every op, then dispatch to the backend.
#include "runtime/kernels/ops.h"

#include <omp.h>

#include <cstring>
#include <limits>

#include <Eigen/Core>

#include "runtime/core/kernel_profile.h"
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
    MT_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, "kernels",
             "{}: {} is {}; the CUDA backend takes f32 or bf16", op, what, dtype_name(t.dtype()));
    return;
  }
  MT_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16, "kernels",
           "{}: {} is {}; the CPU backend takes f32, bf16 or f64", op, what, dtype_name(t.dtype()));
}

// The mixed-precision rule (accum_dtype, runtime/core/dtype.h) for statistics and weight gradients.
void expect_acc(const char* op, const Tensor& t, DType compute, const char* what) {
  MT_CHECK(t.dtype() == accum_dtype(compute), "kernels", "{}: {} is {}; with {} activations it must be {}", op, what,
           dtype_name(t.dtype()), dtype_name(compute), dtype_name(accum_dtype(compute)));
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

template <typename T> T* ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

#if MT_CUDA
void* stream_of(const Tensor& t) { return current_stream(t.device().index).handle(); }
void cuda_check(int rc, const char* op) { MT_CHECK(rc == 0, "kernels", "{}: {}", op, cuda::error_string(rc)); }
// Calls f(T{}) with T = float or bf16 by the tensor's dtype (the CUDA launchers' activation types).
template <typename F> int by_cuda_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::bf16) return f(bf16{});
  return f(float{});
}
#endif

void same_dtype(const char* op, const Tensor& a, const Tensor& b, const char* what) {
  MT_CHECK(a.dtype() == b.dtype(), "kernels", "{}: {} is {} but the other operands are {}", op, what,
           dtype_name(b.dtype()), dtype_name(a.dtype()));
}

void expect_shape(const char* op, const Tensor& t, const Shape& s, const char* what) {
  MT_CHECK(t.shape() == s, "kernels", "{}: {} has shape {}, expected {}", op, what, shape_str(t.shape()), shape_str(s));
}

void check_i32(const char* op, const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::i32 && t.numel() == n, "kernels",
           "{}: {} must be {} i32 values, got {} {}", op, what, n, t.defined() ? dtype_name(t.dtype()) : "none",
           t.defined() ? shape_str(t.shape()) : "");
}

// Calls f(T{}) with T = float or double by the tensor's dtype.
template <typename F> void by_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::f64) f(double{});
  else f(float{});
}

// ---- bf16 on the CPU: the op runs in f32 on widened copies and its outputs are rounded once. ----
// This is the reference the CUDA bf16 kernels are checked against, and what lets the bf16 training
// policy be tested on machines without a GPU; it is not meant to be fast.
bool cpu_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::bf16 && !t.device().is_cuda(); }
Tensor widen(const Tensor& t) {
  if (!cpu_bf16(t)) return t;
  Tensor r = empty(t.shape(), DType::f32);
  convert(r, t);
  return r;
}
void narrow_into(const Tensor& dst, const Tensor& wide) {
  if (cpu_bf16(dst)) convert(dst, wide);
}

// An op's backend, after its checks: CUDA tensors go to the CUDA kernel; bf16 on the CPU runs the f32 kernel on
// widened copies, outputs rounded once; f32/f64 go to the CPU kernel (T by x's dtype: float/bf16, float/double).
// With MT_PROFILE_KERNELS=1 the launch is timed under the op's name (kernel_profile.h), its bytes the operands'.
template <typename CudaFn, typename Bf16Fn, typename CpuFn>
void dispatch(const char* op, const Tensor& x, std::initializer_list<const Tensor*> operands,
              [[maybe_unused]] CudaFn&& cuda_fn, Bf16Fn&& bf16_fn, CpuFn&& cpu_fn) {
  kprof::Scope prof(op, x.device(), 0, kprof::enabled() ? kprof::bytes_of(operands) : 0);
  if (on_cuda(op, operands)) {
#if MT_CUDA
    cuda_check(by_cuda_float(x, cuda_fn), op);
#endif
    return;  // without CUDA, check_float(x) has already refused a device tensor
  }
  if (cpu_bf16(x)) return bf16_fn();
  by_float(x, cpu_fn);
}
// dispatch's cuda_fn: a lambda running the statements with T the activation type; none without CUDA (no cuda::).
#if MT_CUDA
#define MT_CUDA_FN(...)    \
  [&](auto z) {            \
    using T = decltype(z); \
    __VA_ARGS__            \
  }
#else
#define MT_CUDA_FN(...) nullptr
#endif

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
  // Profiled with its FLOPs: 2 N C OC, the operands read once (out twice when accumulating).
  kprof::Scope prof(
      op, inp.device(), 2.0 * double(N) * double(C) * double(OC),
      kprof::enabled() ? kprof::bytes_of({&inp, &weight, &out}) + (accumulate ? double(out.nbytes()) : 0) : 0);
  dispatch(
      op, inp, {&out, &inp, &weight},
      MT_CUDA_FN(return cuda::matmul_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate,
                                                stream_of(inp), inp.device().index);),
      [&] {
        Tensor o = widen(out);
        matmul_forward(o, widen(inp), widen(weight), accumulate);
        narrow_into(out, o);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::matmul_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(weight), N, C, OC, accumulate);
      });
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
  dispatch(
      op, dout, {&dinp, &dweight, &dout, &inp, &weight},
      MT_CUDA_FN(return cuda::matmul_backward<T>(ptr<T>(dinp), ptr<float>(dweight), ptr<T>(dout), ptr<T>(inp),
                                                 ptr<T>(weight), N, C, OC, stream_of(dout), dout.device().index,
                                                 accumulate_dinp);),
      [&] {  // accumulating: the old dinp widened, the sum rounded once (as cuBLASLt's beta = 1)
        Tensor di = dinp.defined() ? (accumulate_dinp ? widen(dinp) : empty(dinp.shape(), DType::f32)) : Tensor();
        matmul_backward(di, dweight, widen(dout), dweight.defined() ? widen(inp) : Tensor(), widen(weight),
                        accumulate_dinp);
        narrow_into(dinp, di);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::matmul_backward<T>(ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), N, C, OC,
                                accumulate_dinp);
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
  for (auto* t : {&out, &weight}) same_dtype(op, inp, *t, "an operand");
  expect_acc(op, rstd, inp.dtype(), "rstd");
  dispatch(
      op, inp, {&out, &rstd, &inp, &weight},
      MT_CUDA_FN(return cuda::rmsnorm_forward<T>(ptr<T>(out), ptr<float>(rstd), ptr<T>(inp), ptr<T>(weight), N, C, eps,
                                                 stream_of(inp));),
      [&] {
        Tensor o = empty(out.shape(), DType::f32);
        rmsnorm_forward(o, rstd, widen(inp), widen(weight), eps);
        narrow_into(out, o);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::rmsnorm_forward<T>(ptr<T>(out), ptr<T>(rstd), ptr<T>(inp), ptr<T>(weight), N, C, eps);
      });
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
  dispatch(
      op, a, {&sum, &out, &rstd, &a, &b, &weight},
      MT_CUDA_FN(return cuda::add_rmsnorm_forward<T>(ptr<T>(sum), ptr<T>(out), ptr<float>(rstd), ptr<T>(a), ptr<T>(b),
                                                     ptr<T>(weight), N, C, eps, stream_of(a));),
      [&] {  // the emulated bf16 path: the add rounds, then the norm of the rounded sum, as on CUDA
        add(sum, a, b);
        rmsnorm_forward(out, rstd, sum, weight, eps);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::rmsnorm_forward<T>(ptr<T>(out), ptr<T>(rstd), ptr<T>(a), ptr<T>(weight), N, C, eps, ptr<T>(sum),
                                ptr<T>(b));
      });
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
  dispatch(
      op, inp, {&dinp, &dweight, &dout, &inp, &weight, &rstd, &dresidual},
      MT_CUDA_FN(Tensor scratch = empty({cuda::rmsnorm_backward_scratch(N, C)}, DType::f32, inp.device());
                 return cuda::rmsnorm_backward<T>(ptr<T>(dinp), ptr<float>(dweight), ptr<float>(scratch), ptr<T>(dout),
                                                  ptr<T>(inp), ptr<T>(weight), ptr<float>(rstd), N, C, stream_of(inp),
                                                  ptr<T>(dresidual));),
      [&] {  // widened, the residual added in f32, one rounding (as on CUDA)
        Tensor di = empty(dinp.shape(), DType::f32);
        rmsnorm_backward(di, dweight, widen(dout), widen(inp), widen(weight), rstd,
                         dresidual.defined() ? widen(dresidual) : Tensor());
        narrow_into(dinp, di);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::rmsnorm_backward<T>(ptr<T>(dinp), ptr<T>(dweight), ptr<T>(dout), ptr<T>(inp), ptr<T>(weight), ptr<T>(rstd),
                                 N, C, ptr<T>(dresidual));
      });
}

// Not through dispatch: the tables are made on the host only (no CUDA kernel), then copied.
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
  if (cpu_bf16(cos)) {  // computed in f32 and rounded, as Hugging Face does for a bf16 model
    Tensor c = empty(cos.shape(), DType::f32), s = empty(sin.shape(), DType::f32);
    rope_tables(c, s, positions, theta);
    narrow_into(cos, c);
    return narrow_into(sin, s);
  }
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
  dispatch(
      "rope_forward", inp, {&out, &inp, &cos, &sin},
      MT_CUDA_FN(return cuda::rope_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(cos), ptr<T>(sin), inp.size(0),
                                              inp.size(1), inp.size(2), inp.size(3), false, stream_of(inp));),
      [&] {
        Tensor o = empty(out.shape(), DType::f32);
        rope_forward(o, widen(inp), widen(cos), widen(sin));
        narrow_into(out, o);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::rope_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(cos), ptr<T>(sin), inp.size(0), inp.size(1), inp.size(2),
                             inp.size(3));
      });
}

void rope_backward(const Tensor& dinp, const Tensor& dout, const Tensor& cos, const Tensor& sin) {
  rope_check("rope_backward", dinp, dout, cos, sin);
  dispatch(
      "rope_backward", dout, {&dinp, &dout, &cos, &sin},
      MT_CUDA_FN(return cuda::rope_forward<T>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(cos), ptr<T>(sin), dout.size(0),
                                              dout.size(1), dout.size(2), dout.size(3), true, stream_of(dout));),
      [&] {
        Tensor d = empty(dinp.shape(), DType::f32);
        rope_backward(d, widen(dout), widen(cos), widen(sin));
        narrow_into(dinp, d);
      },
      [&](auto z) {
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
  dispatch(
      op, gate, {&out, &gate, &up},
      MT_CUDA_FN(return cuda::swiglu_forward<T>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), gate.numel(), stream_of(gate));),
      [&] {
        Tensor o = empty(out.shape(), DType::f32);
        swiglu_forward(o, widen(gate), widen(up));
        narrow_into(out, o);
      },
      [&](auto z) {
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
  dispatch(
      op, gate, {&dgate, &dup, &dout, &gate, &up},
      MT_CUDA_FN(return cuda::swiglu_backward<T>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate), ptr<T>(up),
                                                 gate.numel(), stream_of(gate));),
      [&] {
        Tensor dg = empty(dgate.shape(), DType::f32), du = empty(dup.shape(), DType::f32);
        swiglu_backward(dg, du, widen(dout), widen(gate), widen(up));
        narrow_into(dgate, dg);
        narrow_into(dup, du);
      },
      [&](auto z) {
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
  // Host tokens only: device tokens come from the data loader, which checked them against the vocabulary.
  auto check_tokens = [&] {
    if (vocab_size <= 0) return;
    const int32_t* tk = tokens.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      MT_CHECK(tk[n] >= 0 && tk[n] < vocab_size, "kernels",
               "{}: token {} at position {} is outside the vocabulary [0, {})", op, tk[n], n, vocab_size);
  };
  dispatch(
      op, table, {&out, &tokens, &table},
      MT_CUDA_FN(return cuda::embedding_forward<T>(ptr<T>(out), tokens.data<int32_t>(), ptr<T>(table), N, V, C,
                                                   row_begin, stream_of(table));),
      [&] {  // a gather: copying the rows is exact, so the f32 path gives the same bits
        check_tokens();
        Tensor o = empty(out.shape(), DType::f32);
        embedding_forward(o, tokens, widen(table), row_begin);
        narrow_into(out, o);
      },
      [&](auto z) {
        using T = decltype(z);
        check_tokens();
        cpu::embedding_forward<T>(ptr<T>(out), tokens.data<int32_t>(), ptr<T>(table), N, V, C, row_begin);
      });
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t row_begin) {
  const char* op = "embedding_backward";
  check_float(op, dout, "dout");
  check_float(op, dtable, "dtable");
  MT_CHECK(dtable.dim() == 2, "kernels", "{}: dtable must be (V, C), got {}", op, shape_str(dtable.shape()));
  int64_t N = tokens.numel(), V = dtable.size(0), C = dtable.size(1);
  check_i32(op, tokens, N, "tokens");
  expect_shape(op, dout, {N, C}, "dout");
  expect_acc(op, dtable, dout.dtype(), "dtable");
  // Dispatched by dout; the CPU kernel's T is dtable's too (f32 or f64 dout: dtable has its dtype).
  dispatch(
      op, dout, {&dtable, &dout, &tokens},
      MT_CUDA_FN(Tensor scratch = empty({(cuda::embedding_backward_scratch_bytes(N) + 1) / 2}, DType::u16,
                                        dout.device());  // bytes
                 return cuda::embedding_backward<T>(ptr<float>(dtable), scratch.data_ptr(), ptr<T>(dout),
                                                    tokens.data<int32_t>(), N, V, C, row_begin, stream_of(dout));),
      [&] { embedding_backward(dtable, widen(dout), tokens, row_begin); },
      [&](auto z) {
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
  expect_acc(op, losses, logits.dtype(), "losses");
  if (dlogits.defined()) {
    expect_shape(op, dlogits, logits.shape(), "dlogits");
    same_dtype(op, logits, dlogits, "dlogits");
  }
  auto check_targets = [&] {  // host targets only
    const int32_t* tg = targets.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      MT_CHECK(tg[n] < V, "kernels", "{}: target {} at position {} is >= the vocabulary size {}", op, tg[n], n, V);
  };
  dispatch(
      op, logits, {&losses, &dlogits, &logits, &targets},
      MT_CUDA_FN(return cuda::cross_entropy<T>(ptr<float>(losses), ptr<T>(dlogits), ptr<T>(logits),
                                               targets.data<int32_t>(), N, V, grad_scale, stream_of(logits));),
      [&] {  // softmax and loss in f32 on the widened logits
        check_targets();
        Tensor wide = widen(logits);
        Tensor d = dlogits.defined() ? empty(dlogits.shape(), DType::f32) : Tensor();
        cross_entropy_forward_backward(losses, d, wide, targets, grad_scale);
        narrow_into(dlogits, d);
      },
      [&](auto z) {
        using T = decltype(z);
        check_targets();
        cpu::cross_entropy<T>(ptr<T>(losses), ptr<T>(dlogits), ptr<T>(logits), targets.data<int32_t>(), N, V,
                              grad_scale);
      });
}

namespace {
void check_f64_rows(const char* op, const Tensor& t, const Tensor& logits, int64_t N, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::f64 && t.shape() == Shape{N} && t.device() == logits.device(), "kernels",
           "{}: {} must be ({}) f64 on the logits' device ({})", op, what, N, logits.device().str());
}
}  // namespace

void vocab_shard_max(const Tensor& row_max, const Tensor& logits) {
  const char* op = "vocab_shard_max";
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_f64_rows(op, row_max, logits, N, "row_max");
  dispatch(
      op, logits, {&row_max, &logits},
      MT_CUDA_FN(return cuda::vocab_shard_max<T>(ptr<double>(row_max), ptr<T>(logits), N, V, stream_of(logits));),
      [&] { vocab_shard_max(row_max, widen(logits)); },
      [&](auto z) {
        using T = decltype(z);
        cpu::vocab_shard_max<T>(row_max.data<double>(), ptr<T>(logits), N, V);
      });
}

void vocab_shard_sumexp(const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                        const Tensor& row_max, int64_t vocab_begin) {
  const char* op = "vocab_shard_sumexp";
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, logits, N, "statistics");
  dispatch(
      op, logits, {&sumexp, &target_logit, &logits, &targets, &row_max},
      MT_CUDA_FN(return cuda::vocab_shard_sumexp<T>(ptr<double>(sumexp), ptr<double>(target_logit), ptr<T>(logits),
                                                    targets.data<int32_t>(), ptr<double>(row_max), N, V, vocab_begin,
                                                    stream_of(logits));),
      [&] { vocab_shard_sumexp(sumexp, target_logit, widen(logits), targets, row_max, vocab_begin); },
      [&](auto z) {
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
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  expect_shape(op, losses, {N}, "losses");
  expect_acc(op, losses, logits.dtype(), "losses");
  if (dlogits.defined()) {
    expect_shape(op, dlogits, logits.shape(), "dlogits");
    same_dtype(op, logits, dlogits, "dlogits");
  }
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, logits, N, "statistics");
  dispatch(
      op, logits, {&losses, &dlogits, &logits, &targets, &row_max, &sumexp, &target_logit},
      MT_CUDA_FN(return cuda::vocab_shard_loss<T>(ptr<float>(losses), ptr<T>(dlogits), ptr<T>(logits),
                                                  targets.data<int32_t>(), ptr<double>(row_max), ptr<double>(sumexp),
                                                  ptr<double>(target_logit), N, V, vocab_begin, grad_scale,
                                                  stream_of(logits));),
      [&] {
        Tensor d = dlogits.defined() ? empty(dlogits.shape(), DType::f32) : Tensor();
        vocab_shard_loss(losses, d, widen(logits), targets, row_max, sumexp, target_logit, vocab_begin, grad_scale);
        narrow_into(dlogits, d);
      },
      [&](auto z) {
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
  dispatch(
      op, a, {&out, &a, &b},
      MT_CUDA_FN(return cuda::add<T>(ptr<T>(out), ptr<T>(a), ptr<T>(b), a.numel(), stream_of(a));),
      [&] {
        Tensor o = empty(out.shape(), DType::f32);
        add(o, widen(a), widen(b));
        narrow_into(out, o);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::add<T>(ptr<T>(out), ptr<T>(a), ptr<T>(b), a.numel());
      });
}

void scale_(const Tensor& t, double s) {
  check_float("scale_", t, "t");
  dispatch(
      "scale_", t, {&t}, MT_CUDA_FN(return cuda::scale<T>(ptr<T>(t), s, t.numel(), stream_of(t));),
      [&] {
        Tensor w = widen(t);
        scale_(w, s);
        narrow_into(t, w);
      },
      [&](auto z) {
        using T = decltype(z);
        cpu::scale<T>(ptr<T>(t), s, t.numel());
      });
}

void convert(const Tensor& dst, const Tensor& src) {
  const char* op = "convert";
  check_float(op, dst, "dst");
  check_float(op, src, "src");
  MT_CHECK(dst.numel() == src.numel(), "kernels", "{}: dst {} and src {} differ in size", op, shape_str(dst.shape()),
           shape_str(src.shape()));
  if (dst.dtype() == src.dtype()) return copy_(dst.reshape(src.shape()), src);
  kprof::Scope prof(op, src.device(), 0, kprof::enabled() ? kprof::bytes_of({&dst, &src}) : 0);
#if MT_CUDA
  if (on_cuda(op, {&dst, &src})) {
    cuda_check(cuda::convert(dst.data_ptr(), dst.dtype(), src.data_ptr(), src.dtype(), src.numel(), stream_of(src)),
               op);
    return;
  }
#else
  (void)on_cuda(op, {&dst, &src});
#endif
  // Through f32 or f64 registers; bf16 rounds to nearest even as CUDA's __float2bfloat16_rn does.
  auto run = [&](auto d, auto s) {
    using D = decltype(d);
    using S = decltype(s);
    D* out = dst.data<D>();
    const S* in = src.data<S>();
    const int64_t n = src.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<S, bf16>) {
        out[i] = D(bf16::to_float(in[i].bits));
      } else if constexpr (std::is_same_v<D, bf16>) {
        out[i] = bf16(float(in[i]));
      } else {
        out[i] = D(in[i]);
      }
    }
  };
  auto by_src = [&](auto d) {
    switch (src.dtype()) {
      case DType::bf16:
        return run(d, bf16{});
      case DType::f32:
        return run(d, float{});
      default:
        return run(d, double{});
    }
  };
  switch (dst.dtype()) {
    case DType::bf16:
      return by_src(bf16{});
    case DType::f32:
      return by_src(float{});
    default:
      return by_src(double{});
  }
}

#if MT_CUDA
namespace {
// Fixed-size chunks reduced on the device, their partials summed on the host in order.
double cuda_sum(const Tensor& t, bool squares, const char* op) {
  int64_t n = cuda::reduce_partials_count(t.numel());
  if (n == 0) return 0;
  kprof::Scope prof(op, t.device(), 0, double(t.nbytes()));
  Tensor partials = empty({n}, DType::f64, t.device());
  cuda_check(by_cuda_float(t,
                           [&](auto z) {
                             using T = decltype(z);
                             return cuda::reduce_sum<T>(partials.data<double>(), ptr<T>(t), t.numel(), squares,
                                                        stream_of(t));
                           }),
             op);
  double total = 0;
  for (double p : to_f64(partials)) total += p;
  return total;
}
}  // namespace
#endif

namespace {
// sum or sum of squares of a host tensor in f64, in the kernels' fixed order (no host-sync count: the callers count).
double host_sum(const Tensor& t, bool squares) {
  const Tensor w = widen(t);
  double r = 0;
  by_float(w, [&](auto z) {
    using T = decltype(z);
    r = squares ? cpu::sum_squares<T>(ptr<T>(w), w.numel()) : cpu::sum<T>(ptr<T>(w), w.numel());
  });
  return r;
}
}  // namespace

double sum_squares(const Tensor& t) {
  check_float("sum_squares", t, "t");
#if MT_CUDA
  if (t.device().is_cuda()) return cuda_sum(t, true, "sum_squares");  // its copy to the host counts the sync
#endif
  note_host_sync();  // the host reads a result: on a device, the synchronising copy
  return host_sum(t, true);
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& ts) {
  std::vector<double> out(ts.size(), 0.0);
  bool counted = false;  // one host read for the whole call, on either backend
#if MT_CUDA
  // Every device tensor's chunk partials into one buffer, copied to the host once, summed in order.
  std::vector<int64_t> first(ts.size(), -1), count(ts.size(), 0);
  int64_t total = 0;
  Device dev;
  for (size_t i = 0; i < ts.size(); ++i) {
    check_float("sum_squares_each", ts[i], "a tensor");
    if (!ts[i].device().is_cuda()) continue;
    dev = ts[i].device();
    first[i] = total;
    count[i] = cuda::reduce_partials_count(ts[i].numel());
    total += count[i];
  }
  if (total > 0) {
    Tensor partials = empty({total}, DType::f64, dev);
    for (size_t i = 0; i < ts.size(); ++i) {
      if (first[i] < 0 || count[i] == 0) continue;
      MT_CHECK(ts[i].device() == dev, "kernels", "sum_squares_each: tensors on {} and {}", dev.str(),
               ts[i].device().str());
      const Tensor& t = ts[i];
      cuda_check(by_cuda_float(t,
                               [&](auto z) {
                                 using T = decltype(z);
                                 return cuda::reduce_sum<T>(partials.data<double>() + first[i], ptr<T>(t), t.numel(),
                                                            true, stream_of(t));
                               }),
                 "sum_squares_each");
    }
    std::vector<double> host = to_f64(partials);  // counts the sync
    counted = true;
    for (size_t i = 0; i < ts.size(); ++i)
      for (int64_t j = 0; j < count[i]; ++j) out[i] += host[size_t(first[i] + j)];
  }
#endif
  for (size_t i = 0; i < ts.size(); ++i) {
    check_float("sum_squares_each", ts[i], "a tensor");
    if (ts[i].device().is_cuda()) continue;
    if (!counted) note_host_sync();
    counted = true;
    out[i] = host_sum(ts[i], true);
  }
  return out;
}

double sum(const Tensor& t) {
  check_float("sum", t, "t");
#if MT_CUDA
  if (t.device().is_cuda()) return cuda_sum(t, false, "sum");
#endif
  note_host_sync();
  return host_sum(t, false);
}

namespace {
void check_sum_out(const char* op, const Tensor& out, int64_t slot, const Tensor& t) {
  MT_CHECK(out.defined() && out.dtype() == DType::f64 && out.dim() == 1, "kernels",
           "{}: out must be a 1-d f64 tensor, got {}", op, out.defined() ? out.str(0) : "undefined");
  MT_CHECK(slot >= 0 && slot < out.numel(), "kernels", "{}: slot {} outside out's {} entries", op, slot, out.numel());
  MT_CHECK(out.device() == t.device(), "kernels", "{}: out on {}, tensor on {}", op, out.device().str(),
           t.device().str());
}
#if MT_CUDA
// reduce_sum's chunk partials, then one thread adds them in order into out[slot]: cuda_sum's bits, on the device.
void cuda_sum_into(const Tensor& out, int64_t slot, const Tensor& t, bool squares, const char* op) {
  int64_t n = cuda::reduce_partials_count(t.numel());
  if (n == 0) return;
  kprof::Scope prof(op, t.device(), 0, double(t.nbytes()));
  Tensor partials = empty({n}, DType::f64, t.device());
  cuda_check(by_cuda_float(t,
                           [&](auto z) {
                             using T = decltype(z);
                             return cuda::reduce_sum<T>(partials.data<double>(), ptr<T>(t), t.numel(), squares,
                                                        stream_of(t));
                           }),
             op);
  cuda_check(cuda::sum_partials_into(out.data<double>() + slot, partials.data<double>(), n, stream_of(t)), op);
}
#endif
void sum_into_one(const Tensor& out, int64_t slot, const Tensor& t, bool squares, const char* op) {
  check_float(op, t, "t");
  check_sum_out(op, out, slot, t);
#if MT_CUDA
  if (t.device().is_cuda()) return cuda_sum_into(out, slot, t, squares, op);
#endif
  out.data<double>()[slot] += host_sum(t, squares);
}
}  // namespace

void sum_into(const Tensor& out, int64_t slot, const Tensor& t) { sum_into_one(out, slot, t, false, "sum_into"); }

void sum_squares_into(const Tensor& out, const std::vector<int64_t>& slots, const std::vector<Tensor>& ts) {
  MT_CHECK(slots.size() == ts.size(), "kernels", "sum_squares_into: {} slots for {} tensors", slots.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) sum_into_one(out, slots[i], ts[i], true, "sum_squares_into");
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, const Tensor& param_lowp) {
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
  // Profiled with the bytes it moves: param, m and v read and written, grad read, the bf16 copy written.
  kprof::Scope prof(op, param.device(), 0,
                    kprof::enabled() ? kprof::bytes_of({&param, &grad, &m, &v, &param_lowp}) +
                                           double(param.nbytes() + m.nbytes() + v.nbytes())
                                     : 0);
#if MT_CUDA
  if (on_cuda(op, {&param, &grad, &m, &v, &param_lowp})) {
    cuda_check(cuda::adamw(ptr<float>(param), ptr<bf16>(param_lowp), ptr<float>(grad), ptr<float>(m), ptr<float>(v),
                           param.numel(), lr, beta1, beta2, eps, weight_decay, step, stream_of(param)),
               op);
    return;
  }
#else
  (void)on_cuda(op, {&param, &grad, &m, &v, &param_lowp});
#endif
  by_float(param, [&](auto z) {
    using T = decltype(z);
    cpu::adamw<T, T>(ptr<T>(param), ptr<T>(grad), ptr<T>(m), ptr<T>(v), param.numel(), lr, beta1, beta2, eps,
                     weight_decay, step);
  });
  if (param_lowp.defined()) convert(param_lowp, param);
}

void copy_slice(const Tensor& dst, int64_t dst_begin, const Tensor& src, int64_t src_begin, int64_t n, int dim) {
  const char* op = "copy_slice";
  MT_CHECK(dst.defined() && src.defined() && dst.dtype() == src.dtype() && dst.dim() == src.dim() && dim >= 0 &&
               dim < dst.dim(),
           "kernels", "{}: dst {} {} and src {} {} along dim {}", op, dst.defined() ? shape_str(dst.shape()) : "none",
           dst.defined() ? dtype_name(dst.dtype()) : "", src.defined() ? shape_str(src.shape()) : "none",
           src.defined() ? dtype_name(src.dtype()) : "", dim);
  for (int d = 0; d < dst.dim(); ++d)
    MT_CHECK(d == dim || dst.size(d) == src.size(d), "kernels", "{}: dst {} and src {} differ outside dim {}", op,
             shape_str(dst.shape()), shape_str(src.shape()), dim);
  MT_CHECK(
      n >= 0 && dst_begin >= 0 && src_begin >= 0 && dst_begin + n <= dst.size(dim) && src_begin + n <= src.size(dim),
      "kernels", "{}: {} rows from {} of src {} to {} of dst {} along dim {}", op, n, src_begin, shape_str(src.shape()),
      dst_begin, shape_str(dst.shape()), dim);
  int64_t rows = 1, inner = int64_t(dtype_size(dst.dtype()));
  for (int d = 0; d < dim; ++d) rows *= dst.size(d);
  for (int d = dim + 1; d < dst.dim(); ++d) inner *= dst.size(d);
  // Bytes: each of `rows` rows copies n * inner from a row of pitch src.size(dim) * inner.
  const size_t width = size_t(n * inner), dpitch = size_t(dst.size(dim) * inner),
               spitch = size_t(src.size(dim) * inner);
  auto* d0 = static_cast<char*>(dst.data_ptr()) + dst_begin * inner;
  auto* s0 = static_cast<const char*>(src.data_ptr()) + src_begin * inner;
  if (width == 0 || rows == 0) return;
  kprof::Scope prof(op, src.device(), 0, 2.0 * double(width) * double(rows));
  if (on_cuda(op, {&dst, &src})) {
#if MT_CUDA
    cuda_check(cuda::copy_2d(d0, dpitch, s0, spitch, width, size_t(rows), stream_of(dst)), op);
#endif
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d0 + size_t(r) * dpitch, s0 + size_t(r) * spitch, width);
}

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out, const Tensor& part_lse) {
  const char* op = "attention_merge";
  check_float(op, part_out, "part_out");
  MT_CHECK(part_out.dim() == 4, "kernels", "{}: part_out must be (B, T, H, hd), got {}", op,
           shape_str(part_out.shape()));
  const int64_t B = part_out.size(0), L = part_out.size(1), H = part_out.size(2), hd = part_out.size(3);
  expect_shape(op, out, part_out.shape(), "out");
  expect_shape(op, lse, {B, H, L}, "lse");
  expect_shape(op, part_lse, {B, H, L}, "part_lse");
  expect_acc(op, out, part_out.dtype(), "out");
  expect_acc(op, lse, part_out.dtype(), "lse");
  expect_acc(op, part_lse, part_out.dtype(), "part_lse");
  // Dispatched by part_out; the CPU loop's F is out's too (f32 or f64 part_out: out has its dtype).
  dispatch(
      op, part_out, {&out, &lse, &part_out, &part_lse},
      MT_CUDA_FN(return cuda::attention_merge<T>(out.data<float>(), lse.data<float>(), ptr<T>(part_out),
                                                 part_lse.data<float>(), B, L, H, hd, stream_of(out));),
      [&] { attention_merge(out, lse, widen(part_out), part_lse); },
      [&](auto z) {
        using F = decltype(z);
        F* o = out.data<F>();
        F* l = lse.data<F>();
        const F* po = part_out.data<F>();
        const F* pl = part_lse.data<F>();
        const F neg_inf = -std::numeric_limits<F>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < L; ++t) {
              const int64_t li = (b * H + h) * L + t;
              const F a = l[li], p = pl[li];
              if (p == neg_inf) continue;  // the part saw no key: nothing changes
              F* orow = o + ((b * L + t) * H + h) * hd;
              const F* prow = po + ((b * L + t) * H + h) * hd;
              if (a == neg_inf) {  // nothing so far: take the part
                for (int64_t i = 0; i < hd; ++i) orow[i] = prow[i];
                l[li] = p;
                continue;
              }
              const F m = std::max(a, p), merged = m + std::log(std::exp(a - m) + std::exp(p - m));
              const F wa = std::exp(a - merged), wp = std::exp(p - merged);
              for (int64_t i = 0; i < hd; ++i) orow[i] = wa * orow[i] + wp * prow[i];
              l[li] = merged;
            }
      });
}

namespace {
// pack_blocks and unpack_blocks: the tensor as (outer, D, inner bytes) with D = the split dim.
void pack_or_unpack(const char* op, const Tensor& packed, const Tensor& t, int dim, const std::vector<int64_t>& lens,
                    bool unpack) {
  MT_CHECK(packed.defined() && t.defined() && packed.dtype() == t.dtype() && packed.numel() == t.numel(), "kernels",
           "{}: packed {} {} and tensor {} {} must have one dtype and as many elements", op,
           packed.defined() ? shape_str(packed.shape()) : "none", packed.defined() ? dtype_name(packed.dtype()) : "",
           t.defined() ? shape_str(t.shape()) : "none", t.defined() ? dtype_name(t.dtype()) : "");
  MT_CHECK(dim >= 0 && dim < t.dim(), "kernels", "{}: dim {} of a tensor of shape {}", op, dim, shape_str(t.shape()));
  std::vector<int64_t> begin(lens.size() + 1, 0);
  for (size_t j = 0; j < lens.size(); ++j) {
    MT_CHECK(lens[j] >= 0, "kernels", "{}: block {} has length {}", op, j, lens[j]);
    begin[j + 1] = begin[j] + lens[j];
  }
  MT_CHECK(begin.back() == t.size(dim), "kernels", "{}: blocks of {} elements along dim {} of shape {} (expected {})",
           op, begin.back(), dim, shape_str(t.shape()), t.size(dim));
  int64_t outer = 1, inner = int64_t(dtype_size(t.dtype()));
  for (int d = 0; d < dim; ++d) outer *= t.size(d);
  for (int d = dim + 1; d < t.dim(); ++d) inner *= t.size(d);
  const int64_t D = t.size(dim);
  kprof::Scope prof(op, t.device(), 0, 2.0 * double(t.nbytes()));
  if (on_cuda(op, {&packed, &t})) {
#if MT_CUDA
    cuda_check(cuda::pack_blocks(packed.data_ptr(), t.data_ptr(), outer, D, size_t(inner), begin.data(),
                                 int(lens.size()), unpack, stream_of(t)),
               op);
#endif
    return;
  }
  auto* p = static_cast<char*>(packed.data_ptr());
  auto* x = static_cast<char*>(t.data_ptr());
  for (size_t j = 0; j < lens.size(); ++j) {
    const size_t width = size_t(lens[j] * inner);
    char* block = p + outer * inner * begin[j];
    for (int64_t r = 0; r < outer && width > 0; ++r) {
      char* row = x + (r * D + begin[j]) * inner;
      if (unpack) std::memcpy(row, block + size_t(r) * width, width);
      else std::memcpy(block + size_t(r) * width, row, width);
    }
  }
}
}  // namespace

void pack_blocks(const Tensor& packed, const Tensor& src, int dim, const std::vector<int64_t>& lens) {
  pack_or_unpack("pack_blocks", packed, src, dim, lens, false);
}
void unpack_blocks(const Tensor& dst, const Tensor& packed, int dim, const std::vector<int64_t>& lens) {
  pack_or_unpack("unpack_blocks", packed, dst, dim, lens, true);
}

void set_cpu_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  Eigen::setNbThreads(n);
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace mt
