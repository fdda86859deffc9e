// Element-wise ops and deterministic reductions (ops.h add, add_, scale_, sum, sum_squares and their batched
// and on-device forms, bias_add_forward / _backward): the CPU kernels, then the ops; the CUDA launchers are in
// runtime/kernels/cuda/elementwise.cu.
#include "runtime/kernels/cpu/isa_level.h"

#include <algorithm>
#include <memory>
#include <type_traits>

#include "runtime/core/philox.h"

namespace mt::cpu::MT_CPU_ISA {

// Rows [0, n) split into the same chunks whatever the thread count, so that reductions over chunks (summed in
// order) give the same bits on any machine.
constexpr int64_t kReduceChunk = 4096;

template <typename T> void add(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void dropout_rows(T* out, const T* inp, const int64_t* row_ids, int64_t N, int64_t C, uint64_t seed, uint64_t stream,
                  int64_t col_offset, int64_t cols_global, double p) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;  // f64 runs stay f64 (gradient checks)
  const A keep_scale = A(1.0 / (1.0 - p));
  const float pf = float(p);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t base = uint64_t(row_ids[n]) * uint64_t(cols_global) + uint64_t(col_offset);
    for (int64_t c = 0; c < C; ++c) {
      const bool keep = philox::uniform(seed, stream, base + uint64_t(c)) >= pf;
      out[n * C + c] = keep ? T(A(inp[n * C + c]) * keep_scale) : T(0);
    }
  }
}

template <typename T> void scale(T* t, double s, int64_t n) {
  const T f = T(s);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) t[i] *= f;
}

namespace {
// Partial sums over fixed chunks, added in chunk order: the same bits for any thread count.
template <typename T, typename F> double chunked_sum(const T* t, int64_t n, F f) {
  int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  // Not std::vector: no out-of-line std instances in a per-level file (isa_level.h).
  std::unique_ptr<double[]> part(new double[size_t(std::max<int64_t>(chunks, 1))]());
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    for (int64_t i = c * kReduceChunk, e = std::min(n, (c + 1) * kReduceChunk); i < e; ++i) s += f(double(t[i]));
    part[size_t(c)] = s;
  }
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += part[size_t(c)];
  return total;
}
}  // namespace

template <typename T> double sum_squares(const T* t, int64_t n) {
  return chunked_sum(t, n, [](double x) { return x * x; });
}
template <typename T> double sum(const T* t, int64_t n) {
  return chunked_sum(t, n, [](double x) { return x; });
}

// out (N, C) = inp (N, C) + bias (C) on every row; out may alias inp (each element is read before it is written).
template <typename T> void bias_add_forward(T* out, const T* inp, const T* bias, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = inp[n * C + c] + bias[c];
}

// dbias (C) += the column sums of dout (N, C): columns split across threads, each summed over the rows in order
// in f64 (the same bits whatever the thread count, as rmsnorm's dweight).
template <typename T> void bias_add_backward(T* dbias, const T* dout, int64_t N, int64_t C) {
  constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += kCols) {
    const int64_t c1 = std::min(C, c0 + kCols);
    double acc[kCols] = {};
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += double(dout[n * C + c]);
    for (int64_t c = c0; c < c1; ++c) dbias[c] += T(acc[c - c0]);
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(add)
MT_CPU_EXPORT(scale)
MT_CPU_EXPORT(dropout_rows)
MT_CPU_EXPORT(sum_squares)
MT_CPU_EXPORT(sum)
MT_CPU_EXPORT(bias_add_forward)
MT_CPU_EXPORT(bias_add_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include <vector>

#include "runtime/core/stream.h"
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"  // sum_partials_in_order
namespace mt::cuda {  // cuda/elementwise.cu
template <typename T> int add(T* out, const T* a, const T* b, int64_t n, void* stream);
template <typename T> int scale(T* t, double s, int64_t n, void* stream);
template <typename T>
int dropout_rows(T* out, const T* inp, const int64_t* row_ids, int64_t N, int64_t C, uint64_t seed, uint64_t stream,
                 int64_t col_offset, int64_t cols_global, double p, void* cuda_stream);
// partials: reduce_partials_count(n) doubles; the caller sums them in sum_partials_in_order's order.
int64_t reduce_partials_count(int64_t n);
template <typename T> int reduce_sum(double* partials, const T* t, int64_t n, bool squares, void* stream);
// out[0] += the sum of partials[0 .. n-1] in sum_partials_in_order's order: the same bits as the host summing
// reduce_sum's partials, without reading them on the host.
int sum_partials_into(double* out, const double* partials, int64_t n, void* stream);
// out (N, C) = inp (N, C) + bias (C) (may alias); dbias (C) f32 += column sums of dout (N, C), fixed order.
template <typename T> int bias_add_forward(T* out, const T* inp, const T* bias, int64_t N, int64_t C, void* stream);
template <typename T> int bias_add_backward(float* dbias, const T* dout, int64_t N, int64_t C, void* stream);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

void add_(const Tensor& dst, const Tensor& src) { add(dst, dst, src); }

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* op = "add";
  check_float(op, a, "a");
  expect_shape(op, b, a.shape(), "b");
  expect_shape(op, out, a.shape(), "out");
  for (auto* t : {&out, &b}) same_dtype(op, a, *t, "an operand");
  const int64_t n = a.numel();
  dispatch(
      op, a, MT_CUDA_FN(return cuda::add<T>(ptr<T>(out), ptr<T>(a), ptr<T>(b), n, stream_of(a));),
      [&](auto z, const Tensor& out, const Tensor& a, const Tensor& b) {
        using T = decltype(z);
        MT_CPU_KERNEL(add, T)(ptr<T>(out), ptr<T>(a), ptr<T>(b), n);
      },
      wr(out), rd(a), rd(b));
}

void scale_(const Tensor& t, double s) {
  check_float("scale_", t, "t");
  const int64_t n = t.numel();
  dispatch(
      "scale_", t, MT_CUDA_FN(return cuda::scale<T>(ptr<T>(t), s, n, stream_of(t));),
      [&](auto z, const Tensor& t) {
        using T = decltype(z);
        MT_CPU_KERNEL(scale, T)(ptr<T>(t), s, n);
      },
      rw(t));
}

void dropout_rows(const Tensor& out, const Tensor& inp, const Tensor& row_ids, uint64_t seed, uint64_t stream,
                  int64_t col_offset, int64_t cols_global, double p) {
  const char* op = "dropout_rows";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, op, "inp must be (N, C), got {}", shape_str(inp.shape()));
  expect_shape(op, out, inp.shape(), "out");
  same_dtype(op, inp, out, "out");
  const int64_t N = inp.size(0), C = inp.size(1);
  MT_CHECK(row_ids.dtype() == DType::i64 && row_ids.shape() == (Shape{N}), op, "row_ids must be ({}) i64, got {} {}", N,
           shape_str(row_ids.shape()), dtype_name(row_ids.dtype()));
  MT_CHECK(p >= 0 && p < 1, op, "p = {}: expected a probability in [0, 1)", p);
  MT_CHECK(col_offset >= 0 && col_offset + C <= cols_global, op, "columns [{}, {}) outside the {} global ones",
           col_offset, col_offset + C, cols_global);
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::dropout_rows<T>(ptr<T>(out), ptr<T>(inp), row_ids.data<int64_t>(), N, C, seed, stream,
                                              col_offset, cols_global, p, stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& row_ids) {
        using T = decltype(z);
        MT_CPU_KERNEL(dropout_rows, T)(ptr<T>(out), ptr<T>(inp), row_ids.data<int64_t>(), N, C, seed, stream,
                                       col_offset, cols_global, p);
      },
      wr(out), rd(inp), rd(row_ids));
}

#if MT_CUDA
namespace {
// reduce_sum's partials of fixed-size chunks (n of them, f64) on the device; undefined when t is empty.
Tensor cuda_partials(const Tensor& t, bool squares, const char* op) {
  const int64_t n = cuda::reduce_partials_count(t.numel());
  if (n == 0) return Tensor();
  Tensor partials = empty({n}, DType::f64, t.device());
  cuda_check(by_cuda_float(t,
                           [&](auto z) {
                             using T = decltype(z);
                             return cuda::reduce_sum<T>(partials.data<double>(), ptr<T>(t), t.numel(), squares,
                                                        stream_of(t));
                           }),
             op);
  return partials;
}
// Fixed-size chunks reduced on the device, their partials summed on the host in sum_partials_into's order.
double cuda_sum(const Tensor& t, bool squares, const char* op) {
  kprof::Scope prof(op, t.device(), 0, double(t.nbytes()));
  Tensor partials = cuda_partials(t, squares, op);
  if (!partials.defined()) return 0;
  const std::vector<double> host = to_f64(partials);
  return cuda::sum_partials_in_order(host.data(), int64_t(host.size()));
}
}  // namespace
#endif

namespace {
// sum or sum of squares of a host tensor in f64, in the kernels' fixed order (no host-sync count: the callers count).
double host_sum(const Tensor& t, bool squares) {
  double r = 0;
  run_cpu(
      t,
      [&](auto z, const Tensor& t) {
        using T = decltype(z);
        r = squares ? MT_CPU_KERNEL(sum_squares, T)(ptr<T>(t), t.numel()) : MT_CPU_KERNEL(sum, T)(ptr<T>(t), t.numel());
      },
      rd(t));
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
  // Every device tensor's chunk partials into one buffer, copied to the host once, each tensor's summed in
  // sum_partials_into's order.
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
      if (count[i] > 0) out[i] += cuda::sum_partials_in_order(host.data() + first[i], count[i]);
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
// reduce_sum's chunk partials, then summed into out[slot] on the device: cuda_sum's bits (sum_partials_in_order).
void cuda_sum_into(const Tensor& out, int64_t slot, const Tensor& t, bool squares, const char* op) {
  kprof::Scope prof(op, t.device(), 0, double(t.nbytes()));
  Tensor partials = cuda_partials(t, squares, op);
  if (!partials.defined()) return;
  cuda_check(cuda::sum_partials_into(out.data<double>() + slot, partials.data<double>(), partials.numel(), stream_of(t)),
             op);
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

void bias_add_forward(const Tensor& out, const Tensor& inp, const Tensor& bias) {
  const char* op = "bias_add_forward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (N, C), got {}", op, shape_str(inp.shape()));
  const int64_t N = inp.size(0), C = inp.size(1);
  expect_shape(op, out, {N, C}, "out");
  expect_shape(op, bias, {C}, "bias");
  for (auto* t : {&out, &bias}) same_dtype(op, inp, *t, "an operand");
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::bias_add_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(bias), N, C, stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& bias) {
        using T = decltype(z);
        MT_CPU_KERNEL(bias_add_forward, T)(ptr<T>(out), ptr<T>(inp), ptr<T>(bias), N, C);
      },
      wr(out), rd(inp), rd(bias));
}

void bias_add_backward(const Tensor& dbias, const Tensor& dout) {
  const char* op = "bias_add_backward";
  check_float(op, dout, "dout");
  MT_CHECK(dout.dim() == 2, "kernels", "{}: dout must be (N, C), got {}", op, shape_str(dout.shape()));
  const int64_t N = dout.size(0), C = dout.size(1);
  expect_shape(op, dbias, {C}, "dbias");
  expect_acc(op, dbias, dout.dtype(), "dbias");
  // Dispatched by dout; the CPU kernel's T is dbias's too (f32 or f64 dout: dbias has its dtype).
  dispatch(
      op, dout, MT_CUDA_FN(return cuda::bias_add_backward<T>(ptr<float>(dbias), ptr<T>(dout), N, C, stream_of(dout));),
      [&](auto z, const Tensor& dbias, const Tensor& dout) {
        using T = decltype(z);
        MT_CPU_KERNEL(bias_add_backward, T)(ptr<T>(dbias), ptr<T>(dout), N, C);
      },
      rw(dbias), rd(dout));
}

}  // namespace mt
#endif  // MT_CPU_OPS
