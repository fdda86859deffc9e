// Blockwise attention on the CPU (FlashAttention's recurrence): for each
// (batch, head, block of queries), key blocks are visited in order keeping a
// running max m, sum l and un-normalised output; key blocks no query of the
// block sees are skipped. Memory is O(block^2) per thread whatever T is.
// Backward (FlashAttention-2): P is recomputed from q, k and lse;
//   D = rowsum(dO * O), dV += P^T dO, dP = dO V^T, dS = P * (dP - D),
//   dQ += scale * dS K, dK += scale * dS^T Q.
// It runs per (batch, kv head) so that no two threads write the same dk/dv rows.
// Compiled once per instruction-set level like the other kernels: the block
// products and the exp run at the machine's vector width.
#include "runtime/kernels/cpu/isa_eigen.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/kernels/cpu/cpu_ops.h"

namespace mt::cpu::MT_CPU_ISA {

namespace {

constexpr int64_t kBlockQ = 64, kBlockK = 64;

template <typename T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T> using Strided = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;
template <typename T> using CStrided = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;

// Query t of row b sees keys [first(b, t), visible(t)): keys at or after its document's start, and with
// causal masking none after it. The range is empty when first >= visible.
int64_t visible(const AttentionDims& d, int64_t t) {
  if (!d.causal) return d.S;
  return std::clamp<int64_t>(d.q_pos0 + t - d.k_pos0 + 1, 0, d.S);
}
int64_t first(const AttentionDims& d, int64_t b, int64_t t) {
  return d.doc_start ? std::clamp<int64_t>(d.doc_start[b * d.T + t] - d.k_pos0, 0, d.S) : 0;
}
// The keys some query of rows [t0, t0 + nq) of row b sees: [lo, hi). Blocks outside are skipped.
struct KeyRange {
  int64_t lo, hi;
};
KeyRange block_range(const AttentionDims& d, int64_t b, int64_t t0, int64_t nq) {
  int64_t lo = d.doc_start ? d.S : 0;
  for (int64_t i = 0; i < nq && d.doc_start; ++i) lo = std::min(lo, first(d, b, t0 + i));
  const int64_t hi = visible(d, t0 + nq - 1);  // the last query sees the most keys
  return {std::min(lo, hi), hi};
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionDims& d) {
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
        Eigen::Array<T, Eigen::Dynamic, 1> m =
            Eigen::Array<T, Eigen::Dynamic, 1>::Constant(nq, neg_inf);                        // (nq) running max
        Eigen::Array<T, Eigen::Dynamic, 1> l = Eigen::Array<T, Eigen::Dynamic, 1>::Zero(nq);  // (nq) running sum
        RowMat<T> S(nq, kBlockK);                             // (nq, nk) scores, then probabilities
        const auto [k_lo, keys] = block_range(d, b, t0, nq);  // key blocks no query of this block sees are skipped
        for (int64_t s0 = k_lo / kBlockK * kBlockK; s0 < keys; s0 += kBlockK) {
          const int64_t nk = std::min(kBlockK, keys - s0);
          CStrided<T> K(k + ((b * d.S + s0) * d.KV + kvh) * d.hd, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
          CStrided<T> V(v + ((b * d.S + s0) * d.KV + kvh) * d.hd, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
          auto Sb = S.leftCols(nk);
          Sb.noalias() = Q * K.transpose();
          // Row by row over the visible prefix: a row of a row-major block is contiguous, so Eigen vectorises
          // the max, exp and sum; masked keys get probability 0 without computing exp(-inf).
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t vis = std::clamp<int64_t>(visible(d, t0 + i) - s0, 0, nk);
            const int64_t lo = std::min(vis, std::clamp<int64_t>(first(d, b, t0 + i) - s0, 0, nk));
            auto row = Sb.row(i);
            row.head(lo).setZero();
            row.tail(nk - vis).setZero();
            if (vis == lo) continue;  // acc, l and m of this row are unchanged
            auto p = row.segment(lo, vis - lo).array();
            p *= scale;
            const T mx = std::max(m[i], p.maxCoeff());
            p = (p - mx).exp();
            const T corr = mx == m[i] ? T(1) : std::exp(m[i] - mx);  // 0 while m is -inf
            l[i] = l[i] * corr + p.sum();
            if (corr != T(1)) acc.row(i) *= corr;
            m[i] = mx;
          }
          acc.noalias() += Sb * V;
        }
        Strided<T> O(out + ((b * d.T + t0) * d.H + h) * d.hd, nq, d.hd, Eigen::OuterStride<>(qs));  // (nq, hd)
        T* L = lse + (b * d.H + h) * d.T + t0;                                                      // (nq)
        for (int64_t i = 0; i < nq; ++i) {
          if (l[i] > T(0)) {
            O.row(i) = acc.row(i) / l[i];
            L[i] = m[i] + std::log(l[i]);
          } else {  // no visible key
            O.row(i).setZero();
            L[i] = neg_inf;
          }
        }
      }
}

template <typename T> void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                                              const T* out, const T* lse, const AttentionDims& d, bool accumulate) {
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
      Eigen::Array<T, Eigen::Dynamic, 1> rowdot(kBlockQ);        // (nq) D_i
      Eigen::Array<int64_t, Eigen::Dynamic, 1> vis_of(kBlockQ);  // (nq) end of the keys of the block each row sees
      Eigen::Array<int64_t, Eigen::Dynamic, 1> lo_of(kBlockQ);   // (nq) and their start (its document's)
      // All query heads of this kv head's group, so that no other thread writes these dk, dv rows.
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
        for (int64_t t0 = 0; t0 < d.T; t0 += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, d.T - t0), off = ((b * d.T + t0) * d.H + h) * d.hd;
          CStrided<T> Q(q + off, nq, d.hd, Eigen::OuterStride<>(qs));            // (nq, hd)
          CStrided<T> dO(dout + off, nq, d.hd, Eigen::OuterStride<>(qs));        // (nq, hd)
          CStrided<T> O(out + off, nq, d.hd, Eigen::OuterStride<>(qs));          // (nq, hd)
          Strided<T> dQ(dq + off, nq, d.hd, Eigen::OuterStride<>(qs));           // (nq, hd)
          const T* L = lse + (b * d.H + h) * d.T + t0;                           // (nq)
          for (int64_t i = 0; i < nq; ++i) rowdot[i] = dO.row(i).dot(O.row(i));  // D_i = dO_i . O_i
          auto dQa = dQacc.topRows(nq);
          dQa.setZero();
          const auto [k_lo, keys] = block_range(d, b, t0, nq);
          for (int64_t s0 = k_lo / kBlockK * kBlockK; s0 < keys; s0 += kBlockK) {
            const int64_t nk = std::min(kBlockK, keys - s0), koff = ((b * d.S + s0) * d.KV + kvh) * d.hd;
            CStrided<T> K(k + koff, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
            CStrided<T> V(v + koff, nk, d.hd, Eigen::OuterStride<>(ks));  // (nk, hd)
            auto Pb = P.topLeftCorner(nq, nk);                            // (nq, nk)
            auto dPb = dP.topLeftCorner(nq, nk);                          // (nq, nk)
            Pb.noalias() = Q * K.transpose();
            // P = exp(S * scale - lse) on the visible prefix of each row, 0 elsewhere (and on rows with lse -inf).
            for (int64_t i = 0; i < nq; ++i) {
              int64_t vis = std::clamp<int64_t>(visible(d, t0 + i) - s0, 0, nk);
              int64_t lo = std::min(vis, std::clamp<int64_t>(first(d, b, t0 + i) - s0, 0, nk));
              if (L[i] == neg_inf) vis = lo = 0;
              vis_of[i] = vis;
              lo_of[i] = lo;
              auto row = Pb.row(i);
              row.segment(lo, vis - lo).array() = (row.segment(lo, vis - lo).array() * scale - L[i]).exp();
              row.head(lo).setZero();
              row.tail(nk - vis).setZero();
            }
            dV.middleRows(s0, nk).noalias() += Pb.transpose() * dO;
            dPb.noalias() = dO * V.transpose();
            for (int64_t i = 0; i < nq; ++i) {  // dS = P * (dP - D), scaled for dQ and dK; 0 where P is
              const int64_t vis = vis_of[i], lo = lo_of[i];
              auto row = dPb.row(i);
              row.segment(lo, vis - lo).array() =
                  Pb.row(i).segment(lo, vis - lo).array() * (row.segment(lo, vis - lo).array() - rowdot[i]) * scale;
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

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, const AttentionDims&);
template void attention_forward<double>(double*, double*, const double*, const double*, const double*,
                                        const AttentionDims&);
template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*, const float*,
                                        const float*, const float*, const AttentionDims&, bool);
template void attention_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, const double*, const AttentionDims&, bool);

}  // namespace mt::cpu::MT_CPU_ISA
