// What every op of runtime/kernels/ops.h shares: argument checks, and dispatch() to the backend. Private to
// runtime/kernels: included by the ops section of each family file (runtime/kernels/cpu/<family>.cpp, its
// baseline pass, MT_CPU_OPS) and by ops.cpp, which defines the non-template helpers.
//
// An op is: its checks ("[kernels] <op>: ..." messages), then
//   dispatch(op, x, MT_CUDA_FN(return cuda::launcher<T>(...);),
//            [&](auto z, const Tensor& a, ...) { cpu kernel of T = decltype(z) on a, ... },
//            wr(out), rd(inp), ...);
// The operand list (rd / wr / rw) says which tensors the op reads and writes. dispatch() checks they share a
// device, times the op under MT_PROFILE_KERNELS (kernel_profile.h, bytes = the operands'), runs the CUDA
// launcher with T = float or bf16 by x's dtype, or the CPU function with T = float or double; bf16 on the
// CPU runs the f32 kernel on widened operands and rounds the written ones once (run_cpu): one mechanism
// for every op, not a block per op.
#pragma once
#include <array>
#include <cstddef>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "runtime/core/error.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/tensor.h"

namespace mt::kern {

void check_float(const char* op, const Tensor& t, const char* what);
// The mixed-precision rule (accum_dtype, runtime/core/dtype.h) for statistics and weight gradients.
void expect_acc(const char* op, const Tensor& t, DType compute, const char* what);
// All defined operands on the first one's device; true when that is a CUDA device.
bool on_cuda(const char* op, std::initializer_list<const Tensor*> ts);
void same_dtype(const char* op, const Tensor& a, const Tensor& b, const char* what);
void expect_shape(const char* op, const Tensor& t, const Shape& s, const char* what);
void check_i32(const char* op, const Tensor& t, int64_t n, const char* what);

template <typename T> T* ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

#if MT_CUDA
void* stream_of(const Tensor& t);  // the current stream of t's device, as the launchers take it
// A launcher's code: 0, else "[kernels] <op>: CUDA error ..." (cuda::error_string).
void cuda_check(int rc, const char* op);
// Calls f(T{}) with T = float or bf16 by the tensor's dtype (the CUDA launchers' activation types).
template <typename F> int by_cuda_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::bf16) return f(bf16{});
  return f(float{});
}
#endif

// Calls f(T{}) with T = float or double by the tensor's dtype.
template <typename F> void by_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::f64) f(double{});
  else f(float{});
}

// ---- bf16 on the CPU: the op runs in f32 on widened copies and its outputs are rounded once. ----
// This is the reference the CUDA bf16 kernels are checked against, and what lets the bf16 training policy be
// tested on machines without a GPU; it is not meant to be fast.
bool cpu_bf16(const Tensor& t);
Tensor widen(const Tensor& t);                            // an f32 copy of a CPU bf16 tensor; others as they are
void narrow_into(const Tensor& dst, const Tensor& wide);  // dst = wide rounded, when dst is CPU bf16

// An operand and what the op does with it. For bf16 on the CPU: read ones are widened, written ones get a fresh
// f32 buffer rounded into them after the kernel, read-and-written ones (accumulated, in place) are widened and
// rounded back. Operands that are not bf16 (f32 statistics and weight gradients, integers, f64) pass as they
// are, so an undefined or optional operand needs no special case.
enum class Use { read, write, update };
struct Operand {
  const Tensor* t;
  Use use;
};
inline Operand rd(const Tensor& t) { return {&t, Use::read}; }
inline Operand wr(const Tensor& t) { return {&t, Use::write}; }
inline Operand rw(const Tensor& t) { return {&t, Use::update}; }

// The CPU backend of an op: fn(T{}, operands...) with T = float or double by x's dtype, the operands as the
// kernel sees them (widened for bf16 x, see above; fn's tensor parameters are in the operand list's order).
template <typename Fn, typename... Ops> void run_cpu(const Tensor& x, Fn&& fn, const Ops&... ops) {
  if (!cpu_bf16(x)) return by_float(x, [&](auto z) { fn(z, *ops.t...); });
  auto wide = [](const Operand& o) {
    if (!cpu_bf16(*o.t)) return *o.t;
    return o.use == Use::write ? empty(o.t->shape(), DType::f32) : widen(*o.t);
  };
  std::array<Tensor, sizeof...(Ops)> w{wide(ops)...};
  std::apply([&](const auto&... t) { fn(float{}, t...); }, w);
  size_t i = 0;
  ((ops.use != Use::read ? narrow_into(*ops.t, w[i]) : void(), ++i), ...);  // in the operand list's order
}

// An op's backend, after its checks: CUDA tensors go to cuda_fn (T = float or bf16 by x's dtype, returning the
// launcher's code); host tensors to run_cpu. With MT_PROFILE_KERNELS=1 the launch is timed under the op's name,
// its bytes the operands'.
template <typename CudaFn, typename CpuFn, typename... Ops>
void dispatch(const char* op, const Tensor& x, [[maybe_unused]] CudaFn&& cuda_fn, CpuFn&& cpu_fn, const Ops&... ops) {
  kprof::Scope prof(op, x.device(), 0, kprof::enabled() ? kprof::bytes_of({ops.t...}) : 0);
  if (on_cuda(op, {ops.t...})) {
#if MT_CUDA
    cuda_check(by_cuda_float(x, cuda_fn), op);
#endif
    return;  // without CUDA, check_float(x) has already refused a device tensor
  }
  run_cpu(x, cpu_fn, ops...);
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

}  // namespace mt::kern
