// Local attention: checks, then the kernel for the device and dtype: the flash
// kernel (CUDA bf16), the fp32 CUDA kernel, or the CPU's blockwise kernel
// (runtime/kernels/cpu/attention.cpp, at the machine's vector width); bf16 on
// the CPU runs the f32 kernel on widened copies.
#include "attention/local_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "runtime/core/error.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/ops.h"
#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"
#include "runtime/kernels/cuda/flash_attention.h"
#define MT_FLASH_ATTENTION 1
#else
#define MT_FLASH_ATTENTION 0
#endif

namespace mt {

namespace {

// The CPU kernel's sizes and host document starts, and the document starts on the device for the CUDA kernels.
struct Dims : cpu::AttentionDims {
  const int64_t* doc_start_dev = nullptr;
};

Dims check(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
           const AttentionOptions& opt) {
  MT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention",
           "{}: q, k, v must be 4-D (B, T, H, hd), got {} {} {}", op, shape_str(q.shape()), shape_str(k.shape()),
           shape_str(v.shape()));
  Dims d{{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), opt.scale, opt.causal, opt.q_pos0,
          opt.k_pos0, nullptr}};
  if (d.scale == 0) d.scale = 1.0 / std::sqrt(double(d.hd));
  MT_CHECK(k.size(0) == d.B && k.size(3) == d.hd && v.shape() == k.shape(), "attention",
           "{}: k {} and v {} do not match q {}", op, shape_str(k.shape()), shape_str(v.shape()), shape_str(q.shape()));
  MT_CHECK(d.KV > 0 && d.H % d.KV == 0, "attention", "{}: {} query heads are not a multiple of {} kv heads", op, d.H,
           d.KV);
  MT_CHECK(out.shape() == q.shape(), "attention", "{}: out has shape {}, expected {}", op, shape_str(out.shape()),
           shape_str(q.shape()));
  MT_CHECK(lse.shape() == (Shape{d.B, d.H, d.T}), "attention", "{}: lse has shape {}, expected {}", op,
           shape_str(lse.shape()), shape_str({d.B, d.H, d.T}));
  for (const Tensor* t : {&out, &k, &v}) {
    MT_CHECK(t->dtype() == q.dtype(), "attention", "{}: operands mix {} and {}", op, dtype_name(q.dtype()),
             dtype_name(t->dtype()));
  }
  // The log-sum-exp is a softmax statistic: f32 when the activations are bf16.
  const DType lse_dtype = accum_dtype(q.dtype());
  MT_CHECK(lse.dtype() == lse_dtype, "attention", "{}: lse is {}; with {} q it must be {}", op, dtype_name(lse.dtype()),
           dtype_name(q.dtype()), dtype_name(lse_dtype));
  if (q.device().is_cuda()) {
    MT_CHECK(MT_CUDA, "attention", "{}: CUDA tensors in a build without CUDA", op);
    MT_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, "attention", "{}: CUDA takes f32 or bf16, got {}", op,
             dtype_name(q.dtype()));
    MT_CHECK(d.hd <= 256, "attention", "{}: head dim {} > 256", op, d.hd);
  } else {
    MT_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::f64 || q.dtype() == DType::bf16, "attention",
             "{}: the CPU backend takes f32, bf16 or f64, got {}", op, dtype_name(q.dtype()));
  }
  for (const Tensor* t : {&out, &lse, &k, &v})
    MT_CHECK(t->device() == q.device(), "attention", "{}: operands on {} and {}", op, q.device().str(),
             t->device().str());
  if (opt.doc_start.defined()) {
    MT_CHECK(opt.doc_start.shape() == (Shape{d.B, d.T}) && opt.doc_start.dtype() == DType::i64 &&
                 opt.doc_start.device() == q.device(),
             "attention", "{}: doc_start must be (B, T) = {} i64 on {}, got {} {} on {}", op, shape_str({d.B, d.T}),
             q.device().str(), shape_str(opt.doc_start.shape()), dtype_name(opt.doc_start.dtype()),
             opt.doc_start.device().str());
    (q.device().is_cuda() ? d.doc_start_dev : d.doc_start) = opt.doc_start.data<int64_t>();
  }
  return d;
}

// bf16 through the f32 kernels on widened copies, outputs rounded once: the CPU's bf16 path (the
// reference for the CUDA kernel), and on CUDA the fallback for head dims the tensor-core kernel does
// not take, or for everything when MT_REFERENCE_ATTENTION=1 (to rule the fast kernel out).
Tensor widen(const Tensor& t) {
  if (t.dtype() != DType::bf16) return t;
  Tensor r = empty(t.shape(), DType::f32, t.device());
  convert(r, t);
  return r;
}
[[maybe_unused]] bool use_flash(const Tensor& q, const Dims& d) {
  static const bool reference = [] {
    const char* e = std::getenv("MT_REFERENCE_ATTENTION");
    return e && std::string(e) == "1";
  }();
  return MT_FLASH_ATTENTION && q.device().is_cuda() && q.dtype() == DType::bf16 && (d.hd == 64 || d.hd == 128) &&
         !reference;
}

// The forward's FLOPs for the profiler: 4 hd per visible (query, key) pair and head (QK^T and PV), the pairs
// counted by the causal rule with the position offsets (document masks not counted: an upper bound then).
double forward_flops(const Dims& d) {
  double pairs = double(d.T) * double(d.S);
  if (d.causal) {
    pairs = 0;
    for (int64_t t = 0; t < d.T; ++t)
      pairs += double(std::clamp<int64_t>(d.q_pos0 + t - d.k_pos0 + 1, 0, d.S));  // keys at positions <= the query's
  }
  return 4.0 * double(d.B) * double(d.H) * double(d.hd) * pairs;
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& opt) {
  Dims d = check("attention_forward", out, lse, q, k, v, opt);
  kprof::Scope prof("attention_forward", q.device(), kprof::enabled() ? forward_flops(d) : 0,
                    kprof::enabled() ? kprof::bytes_of({&out, &lse, &q, &k, &v}) : 0);
#if MT_FLASH_ATTENTION
  if (use_flash(q, d)) {
    int rc = cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                           d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0, d.k_pos0,
                                           d.doc_start_dev, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_forward: {}", cuda::error_string(rc));
    return;
  }
#endif
#if MT_CUDA
  if (q.device().is_cuda() && q.dtype() == DType::f32) {
    int rc = cuda::attention_forward(out.data<float>(), lse.data<float>(), q.data<float>(), k.data<float>(),
                                     v.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0,
                                     d.k_pos0, d.doc_start_dev, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_forward: {}", cuda::error_string(rc));
    return;
  }
#endif
  if (q.dtype() == DType::bf16) {
    Tensor o = empty(out.shape(), DType::f32, q.device());
    attention_forward(o, lse, widen(q), widen(k), widen(v), opt);
    return convert(out, o);
  }
  if (q.dtype() == DType::f64)
    cpu::attention_forward<double>(out.data<double>(), lse.data<double>(), q.data<double>(), k.data<double>(),
                                   v.data<double>(), d);
  else
    cpu::attention_forward<float>(out.data<float>(), lse.data<float>(), q.data<float>(), k.data<float>(),
                                  v.data<float>(), d);
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const AttentionOptions& opt, bool accumulate) {
  const char* op = "attention_backward";
  Dims d = check(op, out, lse, q, k, v, opt);
  MT_CHECK(dq.shape() == q.shape() && dout.shape() == q.shape() && dk.shape() == k.shape() && dv.shape() == k.shape(),
           "attention", "{}: gradient shapes dq {} dk {} dv {} dout {} do not match q {} k {}", op,
           shape_str(dq.shape()), shape_str(dk.shape()), shape_str(dv.shape()), shape_str(dout.shape()),
           shape_str(q.shape()), shape_str(k.shape()));
  for (const Tensor* t : {&dq, &dk, &dv, &dout})
    MT_CHECK(t->dtype() == q.dtype() && t->device() == q.device(), "attention", "{}: gradients must be {} on {}", op,
             dtype_name(q.dtype()), q.device().str());
  // Backward: 2.5x the forward's FLOPs (FlashAttention-2's count: the scores recomputed, four more products).
  kprof::Scope prof(op, q.device(), kprof::enabled() ? 2.5 * forward_flops(d) : 0,
                    kprof::enabled() ? kprof::bytes_of({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse}) : 0);
#if MT_FLASH_ATTENTION
  if (use_flash(q, d)) {
    Tensor scratch =
        empty({int64_t(cuda::flash_attention_backward_scratch_bytes(d.B, d.T, d.S, d.H, d.KV, d.hd) + 1) / 2},
              DType::u16, q.device());  // bytes, as u16 elements
    int rc = cuda::flash_attention_backward(
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), scratch.data_ptr(), dout.data_ptr(), q.data_ptr(), k.data_ptr(),
        v.data_ptr(), out.data_ptr(), lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0,
        d.k_pos0, d.doc_start_dev, accumulate, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_backward: {}", cuda::error_string(rc));
    return;
  }
#endif
#if MT_CUDA
  if (q.device().is_cuda() && q.dtype() == DType::f32) {
    Tensor rowdot = empty({d.B * d.H * d.T}, DType::f32, q.device());
    int rc = cuda::attention_backward(
        dq.data<float>(), dk.data<float>(), dv.data<float>(), rowdot.data<float>(), dout.data<float>(), q.data<float>(),
        k.data<float>(), v.data<float>(), out.data<float>(), lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale,
        d.causal, d.q_pos0, d.k_pos0, d.doc_start_dev, accumulate, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_backward: {}", cuda::error_string(rc));
    return;
  }
#endif
  if (q.dtype() == DType::bf16) {
    Tensor dq32 = empty(dq.shape(), DType::f32, q.device()), dk32 = widen(dk), dv32 = widen(dv);
    attention_backward(dq32, dk32, dv32, widen(dout), widen(q), widen(k), widen(v), widen(out), lse, opt, accumulate);
    convert(dq, dq32);
    convert(dk, dk32);
    return convert(dv, dv32);
  }
  if (q.dtype() == DType::f64)
    cpu::attention_backward<double>(dq.data<double>(), dk.data<double>(), dv.data<double>(), dout.data<double>(),
                                    q.data<double>(), k.data<double>(), v.data<double>(), out.data<double>(),
                                    lse.data<double>(), d, accumulate);
  else
    cpu::attention_backward<float>(dq.data<float>(), dk.data<float>(), dv.data<float>(), dout.data<float>(),
                                   q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                                   lse.data<float>(), d, accumulate);
}

}  // namespace mt
