// Local attention: checks, then the kernels' local attention ops (runtime/kernels/ops.h), which pick the
// kernel for the device and dtype: the flash kernel (CUDA bf16), the fp32 CUDA kernel, or the CPU's
// blockwise kernel (runtime/kernels/cpu/attention.cpp, at the machine's vector width); bf16 on the CPU
// runs the f32 kernel on widened copies.
#include "attention/local_attention.h"

#include <cmath>

#include "runtime/core/error.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

struct Dims {
  int64_t B, T, S, H, KV, hd;  // q (B, T, H, hd), k and v (B, S, KV, hd)
  double scale;                // applied to q . k
};

Dims check(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
           const AttentionOptions& opt) {
  MT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention",
           "{}: q, k, v must be 4-D (B, T, H, hd), got {} {} {}", op, shape_str(q.shape()), shape_str(k.shape()),
           shape_str(v.shape()));
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), opt.scale};
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
  }
  return d;
}

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& opt) {
  Dims d = check("attention_forward", out, lse, q, k, v, opt);
  local_attention_forward(out, lse, q, k, v, d.scale, opt.causal, opt.q_pos0, opt.k_pos0, opt.doc_start, opt.window,
                          opt.softcap);
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
  local_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, d.scale, opt.causal, opt.q_pos0, opt.k_pos0,
                           opt.doc_start, accumulate, opt.window, opt.softcap);
}

}  // namespace mt
