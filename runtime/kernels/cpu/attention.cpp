// Local attention (ops.h local_attention_forward / _backward): the CPU kernels, then the ops, which pick the
// kernel: on CUDA the bf16 tensor-core kernel (cuda/flash_attention.cu) or the fp32 reference
// (cuda/attention.cu), on the CPU these.
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

#include "runtime/kernels/cpu/attention_dims.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mt::cpu::MT_CPU_ISA {

namespace {

constexpr int64_t kBlockQ = 64, kBlockK = 64;

template <typename T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T> using Strided = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;
template <typename T> using CStrided = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;

// Query t of row b sees keys [first(b, t), visible(t)): keys at or after its document's start and inside its
// window, and with causal masking none after it. The range is empty when first >= visible.
int64_t visible(const AttentionDims& d, int64_t t) {
  if (!d.causal) return d.S;
  return std::clamp<int64_t>(d.q_pos0 + t - d.k_pos0 + 1, 0, d.S);
}
int64_t first(const AttentionDims& d, int64_t b, int64_t t) {
  int64_t lo = d.doc_start ? std::clamp<int64_t>(d.doc_start[b * d.T + t] - d.k_pos0, 0, d.S) : 0;
  // The window: keys at positions > p - window (transformers' q_idx - kv_idx < sliding_window).
  if (d.window > 0) lo = std::max(lo, std::clamp<int64_t>(d.q_pos0 + t - d.window + 1 - d.k_pos0, 0, d.S));
  return lo;
}
// The keys some query of rows [t0, t0 + nq) of row b sees: [lo, hi). Blocks outside are skipped.
struct KeyRange {
  int64_t lo, hi;
};
KeyRange block_range(const AttentionDims& d, int64_t b, int64_t t0, int64_t nq) {
  const bool bounded = d.doc_start || d.window > 0;
  int64_t lo = bounded ? d.S : 0;
  for (int64_t i = 0; i < nq && bounded; ++i) lo = std::min(lo, first(d, b, t0 + i));
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
            if (d.softcap > 0) p = T(d.softcap) * (p / T(d.softcap)).tanh();  // Gemma 2's soft-capping
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
      RowMat<T> Th(d.softcap > 0 ? kBlockQ : 0, d.softcap > 0 ? kBlockK : 0);  // (nq, nk) tanh(s / softcap)
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
              if (d.softcap > 0) {  // c = softcap tanh(s / softcap), dc/ds = 1 - tanh^2 (kept for dS)
                auto th = Th.row(i).segment(lo, vis - lo).array();
                th = (row.segment(lo, vis - lo).array() * (scale / T(d.softcap))).tanh();
                row.segment(lo, vis - lo).array() = (th * T(d.softcap) - L[i]).exp();
              } else {
                row.segment(lo, vis - lo).array() = (row.segment(lo, vis - lo).array() * scale - L[i]).exp();
              }
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
              if (d.softcap > 0)
                row.segment(lo, vis - lo).array() *= T(1) - Th.row(i).segment(lo, vis - lo).array().square();
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

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(attention_forward)
MT_CPU_EXPORT(attention_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "runtime/core/log.h"
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"
#include "runtime/kernels/cuda/cudnn_attention.h"
#include "runtime/kernels/cuda/flash_attention.h"

namespace mt::cuda {  // cuda/attention.cu: fp32, one thread per row (the correctness reference for fp32 runs)
// doc_start: (B, T) i64 on the device, or null: no document mask.
int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, const int64_t* doc_start, int64_t window, double softcap, void* stream);
// scratch: B*H*T floats (the row dots of dout and out).
int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, const int64_t* doc_start, int64_t window, double softcap, bool accumulate,
                       void* stream);
}  // namespace mt::cuda
#define MT_FLASH_ATTENTION 1
#else
#define MT_FLASH_ATTENTION 0
#endif

namespace mt {
using namespace kern;

namespace {

// The sizes and masks of a call; doc_start on the operands' device (the CPU kernel reads host ones).
cpu::AttentionDims attention_dims(const char* op, const Tensor& q, const Tensor& k, const Tensor& out,
                                  const Tensor& lse, double scale, bool causal, int64_t q_pos0, int64_t k_pos0,
                                  const Tensor& doc_start, int64_t window, double softcap) {
  check_float(op, q, "q");
  MT_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == q.size(0) && k.size(3) == q.size(3), "kernels",
           "{}: q {} and k {} must be (B, T, H, hd) and (B, S, KV, hd)", op, shape_str(q.shape()),
           shape_str(k.shape()));
  cpu::AttentionDims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), scale,
                       causal,    q_pos0,    k_pos0,    nullptr,   window,    softcap};
  MT_CHECK(window >= 0 && softcap >= 0 && std::isfinite(softcap), "kernels",
           "{}: window {} and softcap {} must be >= 0 (0: none)", op, window, softcap);
  MT_CHECK(d.KV > 0 && d.H % d.KV == 0, "kernels", "{}: {} query heads are not a multiple of {} kv heads", op, d.H,
           d.KV);
  expect_shape(op, out, q.shape(), "out");
  expect_shape(op, lse, {d.B, d.H, d.T}, "lse");
  expect_acc(op, lse, q.dtype(), "lse");
  if (doc_start.defined()) {
    MT_CHECK(doc_start.shape() == (Shape{d.B, d.T}) && doc_start.dtype() == DType::i64, "kernels",
             "{}: doc_start must be (B, T) = {} i64", op, shape_str({d.B, d.T}));
    d.doc_start = doc_start.data<int64_t>();
  }
  return d;
}

// bf16 on CUDA runs the tensor-core kernel for head dims 64 and 128, unless MT_REFERENCE_ATTENTION=1 (to rule
// the fast kernel out); otherwise the fp32 kernels on widened copies.
[[maybe_unused]] bool use_flash(const Tensor& q, int64_t hd) {
  static const bool reference = [] {
    const char* e = std::getenv("MT_REFERENCE_ATTENTION");
    return e && std::string(e) == "1";
  }();
  const bool bf16_cuda = MT_FLASH_ATTENTION && q.device().is_cuda() && q.dtype() == DType::bf16 && !reference;
  if (bf16_cuda && hd != 64 && hd != 128) {  // once per process: every layer and step would say it again
    static std::once_flag warned;
    std::call_once(warned, [hd] {
      MT_LOG_WARN(
          "attention: head dim {} has no tensor-core kernel (64 and 128 have): bf16 attention runs the fp32 reference "
          "kernel on widened copies, which is much slower",
          hd);
    });
  }
  return bf16_cuda && (hd == 64 || hd == 128);
}

// ---- The bf16 CUDA kernel choice: cuDNN or the flash kernel (ops.h, set_attention_kernel) ----
// The flash kernel until a run sets the configured choice (set_up_run): tests and commands that do not train keep
// the own kernel unless they ask.
std::atomic<int> g_kernel{int(AttentionKernel::flash)};
std::atomic<bool> g_deterministic{false};

// Says once per distinct reason why a call ran the own kernel under attention.kernel: auto.
[[maybe_unused]] void fallback_once(const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard lock(mu);
  if (said.insert(why).second)
    MT_LOG_INFO("attention: the own kernel (flash; other head dims the fp32 one) for this call ({})", why);
}

// Why cuDNN cannot take a call ("" when it may): what the graph in cuda/cudnn_attention.cpp cannot express.
[[maybe_unused]] std::string cudnn_cannot(const cpu::AttentionDims& d, const Tensor& q) {
  if (q.dtype() != DType::bf16) return "cuDNN's attention here takes bf16 activations";
  if (d.doc_start && (!d.causal || d.q_pos0 != d.k_pos0))
    return "packed documents in a block off the diagonal (a ring's, or all-gathered keys): queries whose document "
           "starts after the block's keys see no key there";
  if (d.causal && d.q_pos0 < d.k_pos0)
    return "a query block placed before its key block (queries that see no key): cuDNN's causal mask needs "
           "q_pos0 >= k_pos0";
  return "";
}

// Whether this bf16 CUDA call goes to cuDNN. attention.kernel = cudnn and impossible: an error naming the key.
[[maybe_unused]] bool use_cudnn(const cpu::AttentionDims& d, const Tensor& q, const char* op) {
  const auto k = AttentionKernel(g_kernel.load());
  if (k == AttentionKernel::flash || !q.device().is_cuda()) return false;
  const std::string why = cudnn_cannot(d, q);
  if (why.empty()) return true;
  MT_CHECK(k != AttentionKernel::cudnn, "config", "attention.kernel = cudnn: {} cannot run on cuDNN: {}", op, why);
  fallback_once(why);
  return false;
}

// cuDNN's return: 0 done; declined (auto: the flash kernel, said once; cudnn: an error); else an error.
[[maybe_unused]] bool cudnn_done(int rc, const char* op) {
  if (rc == 0) return true;
  const std::string why = cuda::cudnn_error_string(rc);
  MT_CHECK(rc == cuda::kCudnnDeclined && AttentionKernel(g_kernel.load()) != AttentionKernel::cudnn,
           rc == cuda::kCudnnDeclined ? "config" : "attention", "{}{}: cuDNN: {}",
           rc == cuda::kCudnnDeclined ? "attention.kernel = cudnn: " : "", op, why);
  fallback_once("cuDNN: " + why);
  return false;
}

// An f32 copy of a device bf16 tensor (the CUDA fallback above); others as they are.
[[maybe_unused]] Tensor widen_on_device(const Tensor& t) {
  if (t.dtype() != DType::bf16) return t;
  Tensor r = empty(t.shape(), DType::f32, t.device());
  convert(r, t);
  return r;
}

// The sliding window and the soft-capping on CUDA: the fp32 kernel has them (bf16 on widened copies); cuDNN's graph
// and the flash kernel do not yet, so such a call skips them, said once.
[[maybe_unused]] bool cuda_masks(const cpu::AttentionDims& d) {
  if (d.window == 0 && d.softcap == 0) return false;
  static std::once_flag said;
  std::call_once(said, [&] {
    MT_LOG_INFO("attention: a sliding window ({}) or soft-capped scores ({}) run the fp32 CUDA kernel (bf16 on "
                "widened copies): cuDNN's and the flash kernel do not implement them yet",
                d.window, d.softcap);
  });
  return true;
}

// The forward's FLOPs for the profiler: 4 hd per visible (query, key) pair and head (QK^T and PV), the pairs
// counted by the causal rule and the window with the position offsets (document masks not counted: an upper
// bound then).
double forward_flops(const cpu::AttentionDims& d) {
  double pairs = double(d.T) * double(d.S);
  if (d.causal) {
    pairs = 0;
    for (int64_t t = 0; t < d.T; ++t)
      pairs += double(std::clamp<int64_t>(d.q_pos0 + t - d.k_pos0 + 1, 0, d.S) -  // keys at positions <= the query's
                      (d.window > 0 ? std::clamp<int64_t>(d.q_pos0 + t - d.window + 1 - d.k_pos0, 0, d.S) : 0));
  }
  return 4.0 * double(d.B) * double(d.H) * double(d.hd) * pairs;
}

}  // namespace

void set_attention_kernel(AttentionKernelChoice choice) {
  g_kernel.store(int(choice.kernel));
  g_deterministic.store(choice.deterministic);
}

AttentionKernelChoice attention_kernel() { return {AttentionKernel(g_kernel.load()), g_deterministic.load()}; }

AttentionKernel parse_attention_kernel(const std::string& word) {
  if (word == "auto") return AttentionKernel::automatic;
  if (word == "cudnn") return AttentionKernel::cudnn;
  MT_CHECK(word == "flash", "config", "attention.kernel = '{}': expected one of 'auto', 'cudnn', 'flash'", word);
  return AttentionKernel::flash;
}

void check_attention_kernel(const Device& device, int64_t head_dim, bool cp_documents) {
  const auto k = AttentionKernel(g_kernel.load());
  if (k == AttentionKernel::flash || (!device.is_cuda() && k == AttentionKernel::automatic)) return;
  MT_CHECK(device.is_cuda(), "config", "attention.kernel = cudnn: the run's device is {} (cuDNN runs on CUDA devices)",
           device.str());
#if MT_CUDA
  bool ok = false;
  const std::string what = cuda::cudnn_load(&ok);
  if (k == AttentionKernel::cudnn) {
    MT_CHECK(ok, "config", "attention.kernel = cudnn: cuDNN cannot be loaded: {} (set $CUDNN_PATH to its folder, or "
             "attention.kernel: auto to run the flash kernel)", what);
    MT_CHECK(!cp_documents, "config",
             "attention.kernel = cudnn: packed documents (data.document_separator) with context parallel "
             "(parallel.cp > 1): the blocks off the diagonal have queries that see no key, which cuDNN's mask cannot "
             "express; use attention.kernel: auto (the flash kernel for those blocks) or flash");
  }
  // auto without a loadable cuDNN is the flash kernel from here on: attention_kernel() then says what runs.
  if (!ok) g_kernel.store(int(AttentionKernel::flash));
  static std::once_flag said;
  std::call_once(said, [&] {
    if (ok)
      MT_LOG_INFO("attention: bf16 attention runs cuDNN's fused attention, {} (head dim {}; attention.kernel = {}{})",
                  what, head_dim, k == AttentionKernel::cudnn ? "cudnn" : "auto",
                  g_deterministic.load() ? ", deterministic" : "");
    else
      MT_LOG_INFO("attention: bf16 attention runs the flash kernel: {}", what);
  });
#else
  (void)head_dim, (void)cp_documents;
  MT_CHECK(false, "config", "attention.kernel = cudnn: a build without CUDA");
#endif
}

void local_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const Tensor& doc_start,
                             int64_t window, double softcap) {
  const char* op = "attention_forward";
  const cpu::AttentionDims d =
      attention_dims(op, q, k, out, lse, scale, causal, q_pos0, k_pos0, doc_start, window, softcap);
  kprof::Scope prof(op, q.device(), kprof::enabled() ? forward_flops(d) : 0,
                    kprof::enabled() ? kprof::bytes_of({&out, &lse, &q, &k, &v}) : 0);
  if (on_cuda(op, {&out, &lse, &q, &k, &v, &doc_start})) {
#if MT_CUDA
    const bool masks = cuda_masks(d);
    void* stream = stream_of(q);
    if (!masks && use_cudnn(d, q, op) &&
        cudnn_done(cuda::cudnn_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(),
                                                 v.data_ptr(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal,
                                                 d.q_pos0, d.k_pos0, d.doc_start, stream),
                   op))
      return;
    if (!masks && use_flash(q, d.hd)) {
      int rc = cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(),
                                             v.data_ptr(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0,
                                             d.k_pos0, d.doc_start, stream);
      MT_CHECK(rc == 0, "attention", "attention_forward: {}", cuda::error_string(rc));
      return;
    }
    if (q.dtype() == DType::bf16) {  // through the fp32 kernel on widened copies, the output rounded once
      Tensor o = empty(out.shape(), DType::f32, q.device());
      local_attention_forward(o, lse, widen_on_device(q), widen_on_device(k), widen_on_device(v), scale, causal, q_pos0,
                              k_pos0, doc_start, window, softcap);
      return convert(out, o);
    }
    int rc = cuda::attention_forward(out.data<float>(), lse.data<float>(), q.data<float>(), k.data<float>(),
                                     v.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal, d.q_pos0,
                                     d.k_pos0, d.doc_start, d.window, d.softcap, stream);
    MT_CHECK(rc == 0, "attention", "attention_forward: {}", cuda::error_string(rc));
#endif
    return;
  }
  run_cpu(
      q,
      [&](auto z, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v) {
        using T = decltype(z);
        MT_CPU_KERNEL(attention_forward, T)(ptr<T>(out), ptr<T>(lse), ptr<T>(q), ptr<T>(k), ptr<T>(v), d);
      },
      wr(out), wr(lse), rd(q), rd(k), rd(v));
}

void local_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                              bool causal, int64_t q_pos0, int64_t k_pos0, const Tensor& doc_start, bool accumulate,
                              int64_t window, double softcap) {
  const char* op = "attention_backward";
  const cpu::AttentionDims d =
      attention_dims(op, q, k, out, lse, scale, causal, q_pos0, k_pos0, doc_start, window, softcap);
  for (auto [t, like, name] :
       {std::tuple{&dq, &q, "dq"}, {&dout, &q, "dout"}, {&dk, &k, "dk"}, {&dv, &k, "dv"}, {&v, &k, "v"}}) {
    expect_shape(op, *t, like->shape(), name);
    same_dtype(op, q, *t, name);
  }
  // Backward: 2.5x the forward's FLOPs (FlashAttention-2's count: the scores recomputed, four more products).
  kprof::Scope prof(op, q.device(), kprof::enabled() ? 2.5 * forward_flops(d) : 0,
                    kprof::enabled() ? kprof::bytes_of({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse}) : 0);
  if (on_cuda(op, {&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, &doc_start})) {
#if MT_CUDA
    const bool masks = cuda_masks(d);
    void* stream = stream_of(q);
    if (!masks && use_cudnn(d, q, op) &&
        cudnn_done(cuda::cudnn_attention_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dout.data_ptr(),
                                                  q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                  lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale,
                                                  d.causal, d.q_pos0, d.k_pos0, d.doc_start, accumulate,
                                                  g_deterministic.load(), stream),
                   op))
      return;
    if (!masks && use_flash(q, d.hd)) {
      Tensor scratch =
          empty({int64_t(cuda::flash_attention_backward_scratch_bytes(d.B, d.T, d.S, d.H, d.KV, d.hd) + 1) / 2},
                DType::u16, q.device());  // bytes, as u16 elements
      int rc = cuda::flash_attention_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), scratch.data_ptr(),
                                              dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                              lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale, d.causal,
                                              d.q_pos0, d.k_pos0, d.doc_start, accumulate, stream);
      MT_CHECK(rc == 0, "attention", "attention_backward: {}", cuda::error_string(rc));
      return;
    }
    if (q.dtype() == DType::bf16) {  // through the fp32 kernels on widened copies, each gradient rounded once
      Tensor dq32 = empty(dq.shape(), DType::f32, q.device()), dk32 = widen_on_device(dk), dv32 = widen_on_device(dv);
      local_attention_backward(dq32, dk32, dv32, widen_on_device(dout), widen_on_device(q), widen_on_device(k),
                               widen_on_device(v), widen_on_device(out), lse, scale, causal, q_pos0, k_pos0, doc_start,
                               accumulate, window, softcap);
      convert(dq, dq32);
      convert(dk, dk32);
      return convert(dv, dv32);
    }
    Tensor rowdot = empty({d.B * d.H * d.T}, DType::f32, q.device());
    int rc = cuda::attention_backward(dq.data<float>(), dk.data<float>(), dv.data<float>(), rowdot.data<float>(),
                                      dout.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
                                      out.data<float>(), lse.data<float>(), d.B, d.T, d.S, d.H, d.KV, d.hd, d.scale,
                                      d.causal, d.q_pos0, d.k_pos0, d.doc_start, d.window, d.softcap, accumulate,
                                      stream);
    MT_CHECK(rc == 0, "attention", "attention_backward: {}", cuda::error_string(rc));
#endif
    return;
  }
  run_cpu(
      q,
      [&](auto z, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
        using T = decltype(z);
        MT_CPU_KERNEL(attention_backward, T)
        (ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), ptr<T>(dout), ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(out), ptr<T>(lse), d,
         accumulate);
      },
      wr(dq), rw(dk), rw(dv), rd(dout), rd(q), rd(k), rd(v), rd(out), rd(lse));
}

}  // namespace mt
#endif  // MT_CPU_OPS
