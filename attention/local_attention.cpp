// Blockwise attention on the CPU (FlashAttention's recurrence): for each
// (batch, head, block of queries), key blocks are visited in order keeping a
// running max m, sum l and un-normalised output; fully masked key blocks are
// skipped. Memory is O(block^2) per thread whatever T is.
// Backward (FlashAttention-2): P is recomputed from q, k and lse;
//   D = rowsum(dO * O), dV += P^T dO, dP = dO V^T, dS = P * (dP - D),
//   dQ += scale * dS K, dK += scale * dS^T Q.
// It runs per (batch, kv head) so that no two threads write the same dk/dv rows.
#include "attention/local_attention.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"
#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"
#if __has_include("runtime/kernels/cuda/flash_attention.h")
#include "runtime/kernels/cuda/flash_attention.h"
#define MT_FLASH_ATTENTION 1
#endif
#endif
#ifndef MT_FLASH_ATTENTION
#define MT_FLASH_ATTENTION 0
#endif

namespace mt {

namespace {

constexpr int64_t kBlockQ = 64, kBlockK = 64;

template <typename T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T> using Strided = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;
template <typename T> using CStrided = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;

struct Dims {
  int64_t B, T, S, H, KV, hd;
  double scale;
  bool causal;
  int64_t q_pos0, k_pos0;
  const int64_t* doc_start = nullptr;  // (B, T) host, or null: no document mask (the CPU kernels)
  const int64_t* doc_start_dev = nullptr;  // the same on the device, for the CUDA kernels
  // Query t of row b sees keys [first(b, t), visible(t)): keys at or after its document's start, and with
  // causal masking none after it. The range is empty when first >= visible.
  int64_t visible(int64_t t) const {
    if (!causal) return S;
    return std::clamp<int64_t>(q_pos0 + t - k_pos0 + 1, 0, S);
  }
  int64_t first(int64_t b, int64_t t) const {
    return doc_start ? std::clamp<int64_t>(doc_start[b * T + t] - k_pos0, 0, S) : 0;
  }
  // The keys some query of rows [t0, t0 + nq) of row b sees: [lo, hi). Blocks outside are skipped.
  std::pair<int64_t, int64_t> block_range(int64_t b, int64_t t0, int64_t nq) const {
    int64_t lo = S;
    for (int64_t i = 0; i < nq && doc_start; ++i) lo = std::min(lo, first(b, t0 + i));
    if (!doc_start) lo = 0;
    const int64_t hi = visible(t0 + nq - 1);  // the last query sees the most keys
    return {std::min(lo, hi), hi};
  }
};

template <typename T>
void forward_impl(T* out, T* lse, const T* q, const T* k, const T* v, const Dims& d) {
  const int64_t n_qb = (d.T + kBlockQ - 1) / kBlockQ, group = d.H / d.KV;
  const T neg_inf = -std::numeric_limits<T>::infinity(), scale = T(d.scale);
  const int64_t qs = d.H * d.hd, ks = d.KV * d.hd;  // row strides of q/out and k/v
#pragma omp parallel for schedule(dynamic) collapse(3)
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t qb = 0; qb < n_qb; ++qb) {
        const int64_t kvh = h / group, t0 = qb * kBlockQ, nq = std::min(kBlockQ, d.T - t0);
        CStrided<T> Q(q + ((b * d.T + t0) * d.H + h) * d.hd, nq, d.hd, Eigen::OuterStride<>(qs));  // (nq, hd)
        RowMat<T> acc = RowMat<T>::Zero(nq, d.hd);  // (nq, hd) un-normalised output
        std::vector<T> m(size_t(nq), neg_inf), l(size_t(nq), T(0));  // (nq) running max and sum
        RowMat<T> S(nq, kBlockK);                                       // (nq, nk) scores, then probabilities
        const auto [k_lo, keys] = d.block_range(b, t0, nq);  // key blocks no query of this block sees are skipped
        for (int64_t s0 = k_lo / kBlockK * kBlockK; s0 < keys; s0 += kBlockK) {
          const int64_t nk = std::min(kBlockK, keys - s0);
          CStrided<T> K(k + ((b * d.S + s0) * d.KV + kvh) * d.hd, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
          CStrided<T> V(v + ((b * d.S + s0) * d.KV + kvh) * d.hd, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
          auto Sb = S.leftCols(nk);
          Sb.noalias() = Q * K.transpose();
          // Row by row over the visible prefix: a row of a row-major block is contiguous, so Eigen vectorises
          // the max, exp and sum; masked keys get probability 0 without computing exp(-inf).
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t vis = std::clamp<int64_t>(d.visible(t0 + i) - s0, 0, nk);
            const int64_t lo = std::min(vis, std::clamp<int64_t>(d.first(b, t0 + i) - s0, 0, nk));
            auto row = Sb.row(i);
            row.head(lo).setZero();
            row.tail(nk - vis).setZero();
            if (vis == lo) continue;  // acc, l and m of this row are unchanged
            auto p = row.segment(lo, vis - lo).array();
            p *= scale;
            const T mx = std::max(m[size_t(i)], p.maxCoeff());
            p = (p - mx).exp();
            const T corr = mx == m[size_t(i)] ? T(1) : std::exp(m[size_t(i)] - mx);  // 0 while m is -inf
            l[size_t(i)] = l[size_t(i)] * corr + p.sum();
            if (corr != T(1)) acc.row(i) *= corr;
            m[size_t(i)] = mx;
          }
          acc.noalias() += Sb * V;
        }
        Strided<T> O(out + ((b * d.T + t0) * d.H + h) * d.hd, nq, d.hd, Eigen::OuterStride<>(qs));  // (nq, hd)
        T* L = lse + (b * d.H + h) * d.T + t0;  // (nq)
        for (int64_t i = 0; i < nq; ++i) {
          if (l[size_t(i)] > T(0)) {
            O.row(i) = acc.row(i) / l[size_t(i)];
            L[i] = m[size_t(i)] + std::log(l[size_t(i)]);
          } else {  // no visible key
            O.row(i).setZero();
            L[i] = neg_inf;
          }
        }
      }
}

template <typename T>
void backward_impl(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse,
                   const Dims& d, bool accumulate) {
  const int64_t group = d.H / d.KV;
  const T neg_inf = -std::numeric_limits<T>::infinity(), scale = T(d.scale);
  const int64_t qs = d.H * d.hd, ks = d.KV * d.hd;
#pragma omp parallel for schedule(dynamic) collapse(2)
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t kvh = 0; kvh < d.KV; ++kvh) {
      Strided<T> dK(dk + (b * d.S * d.KV + kvh) * d.hd, d.S, d.hd, Eigen::OuterStride<>(ks));  // (S, hd)
      Strided<T> dV(dv + (b * d.S * d.KV + kvh) * d.hd, d.S, d.hd, Eigen::OuterStride<>(ks));  // (S, hd)
      if (!accumulate) {
        dK.setZero();
        dV.setZero();
      }
      RowMat<T> P(kBlockQ, kBlockK), dP(kBlockQ, kBlockK), dQacc(kBlockQ, d.hd);
      std::vector<T> rowdot(static_cast<size_t>(kBlockQ));         // (nq) D_i
      std::vector<int64_t> vis_of(static_cast<size_t>(kBlockQ));  // (nq) end of the keys of the block each row sees
      std::vector<int64_t> lo_of(static_cast<size_t>(kBlockQ));   // (nq) and their start (its document's)
      // All query heads of this kv head's group, so that no other thread writes these dk, dv rows.
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        for (int64_t t0 = 0; t0 < d.T; t0 += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, d.T - t0), off = ((b * d.T + t0) * d.H + h) * d.hd;
          CStrided<T> Q(q + off, nq, d.hd, Eigen::OuterStride<>(qs));      // (nq, hd)
          CStrided<T> dO(dout + off, nq, d.hd, Eigen::OuterStride<>(qs));  // (nq, hd)
          CStrided<T> O(out + off, nq, d.hd, Eigen::OuterStride<>(qs));    // (nq, hd)
          Strided<T> dQ(dq + off, nq, d.hd, Eigen::OuterStride<>(qs));     // (nq, hd)
          const T* L = lse + (b * d.H + h) * d.T + t0;                     // (nq)
          for (int64_t i = 0; i < nq; ++i) rowdot[size_t(i)] = dO.row(i).dot(O.row(i));  // D_i = dO_i . O_i
          auto dQa = dQacc.topRows(nq);
          dQa.setZero();
          const auto [k_lo, keys] = d.block_range(b, t0, nq);
          for (int64_t s0 = k_lo / kBlockK * kBlockK; s0 < keys; s0 += kBlockK) {
            const int64_t nk = std::min(kBlockK, keys - s0), koff = ((b * d.S + s0) * d.KV + kvh) * d.hd;
            CStrided<T> K(k + koff, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
            CStrided<T> V(v + koff, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
            auto Pb = P.topLeftCorner(nq, nk);    // (nq, nk)
            auto dPb = dP.topLeftCorner(nq, nk);  // (nq, nk)
            Pb.noalias() = Q * K.transpose();
            // P = exp(S * scale - lse) on the visible prefix of each row, 0 elsewhere (and on rows with lse -inf).
            for (int64_t i = 0; i < nq; ++i) {
              int64_t vis = std::clamp<int64_t>(d.visible(t0 + i) - s0, 0, nk);
              int64_t lo = std::min(vis, std::clamp<int64_t>(d.first(b, t0 + i) - s0, 0, nk));
              if (L[i] == neg_inf) vis = lo = 0;
              vis_of[size_t(i)] = vis;
              lo_of[size_t(i)] = lo;
              auto row = Pb.row(i);
              row.segment(lo, vis - lo).array() = (row.segment(lo, vis - lo).array() * scale - L[i]).exp();
              row.head(lo).setZero();
              row.tail(nk - vis).setZero();
            }
            dV.middleRows(s0, nk).noalias() += Pb.transpose() * dO;
            dPb.noalias() = dO * V.transpose();
            for (int64_t i = 0; i < nq; ++i) {  // dS = P * (dP - D), scaled for dQ and dK; 0 where P is
              const int64_t vis = vis_of[size_t(i)], lo = lo_of[size_t(i)];
              auto row = dPb.row(i);
              row.segment(lo, vis - lo).array() =
                  Pb.row(i).segment(lo, vis - lo).array() * (row.segment(lo, vis - lo).array() - rowdot[size_t(i)]) * scale;
              row.head(lo).setZero();
              row.tail(nk - vis).setZero();
            }
            dQa.noalias() += dPb * K;
            dK.middleRows(s0, nk).noalias() += dPb.transpose() * Q;
          }
          dQ = dQa;
        }
    }
}

Dims check(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
           const AttentionOptions& opt) {
  MT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention", "{}: q, k, v must be 4-D (B, T, H, hd), got {} {} {}",
           op, shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), opt.scale, opt.causal, opt.q_pos0, opt.k_pos0};
  if (d.scale == 0) d.scale = 1.0 / std::sqrt(double(d.hd));
  MT_CHECK(k.size(0) == d.B && k.size(3) == d.hd && v.shape() == k.shape(), "attention",
           "{}: k {} and v {} do not match q {}", op, shape_str(k.shape()), shape_str(v.shape()), shape_str(q.shape()));
  MT_CHECK(d.KV > 0 && d.H % d.KV == 0, "attention", "{}: {} query heads are not a multiple of {} kv heads", op, d.H, d.KV);
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
    MT_CHECK(t->device() == q.device(), "attention", "{}: operands on {} and {}", op, q.device().str(), t->device().str());
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

}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& opt) {
  Dims d = check("attention_forward", out, lse, q, k, v, opt);
#if MT_FLASH_ATTENTION
  if (use_flash(q, d)) {
    int rc = cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                           d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0, d.k_pos0,
                                           d.doc_start_dev, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_forward: CUDA error {}", rc);
    return;
  }
#endif
#if MT_CUDA
  if (q.device().is_cuda() && q.dtype() == DType::f32) {
    int rc = cuda::attention_forward(out.data<float>(), lse.data<float>(), q.data<float>(), k.data<float>(),
                                     v.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0, d.k_pos0,
                                     d.doc_start_dev, current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_forward: CUDA error {}", rc);
    return;
  }
#endif
  if (q.dtype() == DType::bf16) {
    Tensor o = empty(out.shape(), DType::f32, q.device());
    attention_forward(o, lse, widen(q), widen(k), widen(v), opt);
    return convert(out, o);
  }
  if (q.dtype() == DType::f64)
    forward_impl<double>(out.data<double>(), lse.data<double>(), q.data<double>(), k.data<double>(), v.data<double>(), d);
  else
    forward_impl<float>(out.data<float>(), lse.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(), d);
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const AttentionOptions& opt, bool accumulate) {
  const char* op = "attention_backward";
  Dims d = check(op, out, lse, q, k, v, opt);
  MT_CHECK(dq.shape() == q.shape() && dout.shape() == q.shape() && dk.shape() == k.shape() && dv.shape() == k.shape(),
           "attention", "{}: gradient shapes dq {} dk {} dv {} dout {} do not match q {} k {}", op, shape_str(dq.shape()),
           shape_str(dk.shape()), shape_str(dv.shape()), shape_str(dout.shape()), shape_str(q.shape()),
           shape_str(k.shape()));
  for (const Tensor* t : {&dq, &dk, &dv, &dout})
    MT_CHECK(t->dtype() == q.dtype() && t->device() == q.device(), "attention", "{}: gradients must be {} on {}", op,
             dtype_name(q.dtype()), q.device().str());
#if MT_FLASH_ATTENTION
  if (use_flash(q, d)) {
    Tensor scratch = empty({int64_t(cuda::flash_attention_backward_scratch_bytes(d.B, d.T, d.S, d.H, d.KV, d.hd) + 1) / 2},
                           DType::u16, q.device());  // bytes, as u16 elements
    int rc = cuda::flash_attention_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), scratch.data_ptr(),
                                            dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                            lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal,
                                            d.q_pos0, d.k_pos0, d.doc_start_dev, accumulate,
                                            current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_backward: CUDA error {}", rc);
    return;
  }
#endif
#if MT_CUDA
  if (q.device().is_cuda() && q.dtype() == DType::f32) {
    Tensor rowdot = empty({d.B * d.H * d.T}, DType::f32, q.device());
    int rc = cuda::attention_backward(dq.data<float>(), dk.data<float>(), dv.data<float>(), rowdot.data<float>(),
                                      dout.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
                                      out.data<float>(), lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale,
                                      d.causal, d.q_pos0, d.k_pos0, d.doc_start_dev, accumulate,
                                      current_stream(q.device().index).handle());
    MT_CHECK(rc == 0, "attention", "attention_backward: CUDA error {}", rc);
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
    backward_impl<double>(dq.data<double>(), dk.data<double>(), dv.data<double>(), dout.data<double>(), q.data<double>(),
                          k.data<double>(), v.data<double>(), out.data<double>(), lse.data<double>(), d, accumulate);
  else
    backward_impl<float>(dq.data<float>(), dk.data<float>(), dv.data<float>(), dout.data<float>(), q.data<float>(),
                         k.data<float>(), v.data<float>(), out.data<float>(), lse.data<float>(), d, accumulate);
}

}  // namespace mt
