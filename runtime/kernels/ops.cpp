// The ops' shared helpers (op.h), and the ops with no per-level CPU kernel: conversion, copies along a dim,
// the attention merge, shard packing (their CUDA launchers are in runtime/kernels/cuda/copies.cu and
// elementwise.cu). The other ops live with their kernels, one family file each (runtime/kernels/cpu/*.cpp).
#include "runtime/kernels/ops.h"

#include <omp.h>

#include <cstring>
#include <limits>

#include <Eigen/Core>

#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/op.h"
#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"

namespace mt::cuda {
// cuda/elementwise.cu: dst <- src converted (f32 <-> bf16, round to nearest even), n elements.
int convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, void* stream);
// cuda/copies.cu: rows rows of width bytes, from src (row pitch spitch bytes) to dst (pitch dpitch).
int copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, void* stream);
// out (B, T, H, hd) f32, lse (B, H, T) f32 merged with part_out (B, T, H, hd) T and part_lse (B, H, T) f32 by
// log-sum-exp (ops.h attention_merge).
template <typename T> int attention_merge(float* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                                          int64_t T_, int64_t H, int64_t hd, void* stream);
// The blocks of a split of a row-major (outer, D, inner) tensor t along D at begin[0] = 0 < ... < begin[n] = D,
// stored one after the other in packed, each contiguous (block j starts at outer * inner * begin[j]):
// packed <- blocks of t, or with unpack t <- blocks of packed. inner in bytes; any n (launches of up to 64 blocks).
int pack_blocks(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes, const int64_t* begin, int n,
                bool unpack, void* stream);
}  // namespace mt::cuda
#endif

namespace mt {

namespace kern {

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

void expect_acc(const char* op, const Tensor& t, DType compute, const char* what) {
  MT_CHECK(t.dtype() == accum_dtype(compute), "kernels", "{}: {} is {}; with {} activations it must be {}", op, what,
           dtype_name(t.dtype()), dtype_name(compute), dtype_name(accum_dtype(compute)));
}

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
void cuda_check(int rc, const char* op) { MT_CHECK(rc == 0, "kernels", "{}: {}", op, cuda::error_string(rc)); }
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

}  // namespace kern

using namespace kern;

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
      op, part_out,
      MT_CUDA_FN(return cuda::attention_merge<T>(out.data<float>(), lse.data<float>(), ptr<T>(part_out),
                                                 part_lse.data<float>(), B, L, H, hd, stream_of(out));),
      [&](auto z, const Tensor& out, const Tensor& lse, const Tensor& part_out, const Tensor& part_lse) {
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
      },
      rw(out), rw(lse), rd(part_out), rd(part_lse));
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
