// Mixture of experts (ops.h router_topk_*, moe_dispatch_*, moe_combine_*, grouped_matmul_*): the CPU kernels,
// then the ops; the CUDA launchers are in runtime/kernels/cuda/moe.cu.
// On the CPU the kernels' T is the accum dtype too (f32 for bf16, widened, or f32; f64 for f64), so the
// router's probs and weights and the combine's weights share the activations' pointer type.
// Router: p = softmax(logits) (or sigmoid); top K of p + bias, largest first, ties to the lower index;
// w_k = scale * p_k (/ S = sum of the K selected p, with renormalize).
// Backward: dp_j = dprob_row_j + scale * (dw_j / S - sum_k dw_k p_k / S^2) for selected j (scale * dw_j
// without renormalize), then dlogit = p (dp - sum(p dp)) (softmax) or dp p (1 - p) (sigmoid).
// The grouped GEMM with host counts has no kernel of its own: each group is one matmul_forward / matmul_backward on
// row views, so it runs at the dense GEMM's speed on every backend. The one with device offsets (what the MoE block
// runs: no host read) does the same on the CPU, reading the offsets there, and is one kernel on CUDA
// (cuda/moe_grouped.cu, with the routing and the statistics' ops).
#include "runtime/kernels/cpu/isa_level.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mt::cpu::MT_CPU_ISA {

namespace {
// The K experts of one row with the largest p + bias, largest first, ties to the lower index: K passes of an
// argmax (K <= E is small, and a sort would not keep this tie rule as simply).
template <typename T> void topk_row(int32_t* ex, const T* p, const T* bias, int64_t E, int64_t K,
                                    int64_t n_group = 1, int64_t topk_group = 1, bool top2 = false) {
  // Group-limited routing (DeepSeek): the selection scores of the experts outside the topk_group best groups are 0
  // (transformers' masked_fill 0, not -inf); a group scores its best (top2: its two best) p + bias.
  T sel[1024];
  const bool grouped = n_group > 1 && E <= 1024;
  if (grouped) {
    const int64_t per = E / n_group;
    T gs[1024];
    for (int64_t g = 0; g < n_group; ++g) {
      T a = T(0), b = T(0);
      bool first = true, second = false;
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        const T v = p[e] + (bias ? bias[e] : T(0));
        if (first || v > a) {
          if (!first) b = a, second = true;
          a = v, first = false;
        } else if (!second || v > b) {
          b = v, second = true;
        }
      }
      gs[g] = top2 ? a + b : a;
    }
    bool keep[1024] = {};
    for (int64_t k = 0; k < topk_group; ++k) {
      int64_t best = -1;
      for (int64_t g = 0; g < n_group; ++g)
        if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
      keep[best] = true;
    }
    for (int64_t e = 0; e < E; ++e) sel[e] = keep[e / per] ? p[e] + (bias ? bias[e] : T(0)) : T(0);
  }
  for (int64_t k = 0; k < K; ++k) {
    int64_t best = -1;
    T best_s = T(0);
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < k; ++j) taken = taken || ex[j] == e;
      if (taken) continue;
      const T s = grouped ? sel[e] : p[e] + (bias ? bias[e] : T(0));
      if (best < 0 || s > best_s) best = e, best_s = s;  // strict: the lower index keeps a tie
    }
    ex[k] = int32_t(best);
  }
}
}  // namespace

template <typename T> void router_topk_forward(T* weights, int32_t* experts, T* probs, const T* logits, const T* bias,
                                               int64_t N, int64_t E, int64_t K, bool sigmoid, bool renormalize,
                                               double scale, int64_t n_group, int64_t topk_group) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * E;  // (E)
    T* p = probs + n * E;         // (E)
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = T(1) / (T(1) + std::exp(-x[e]));
    } else {
      T m = x[0], sum = 0;
      for (int64_t e = 1; e < E; ++e) m = std::max(m, x[e]);
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(x[e] - m);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    }
    int32_t* ex = experts + n * K;  // (K)
    T* w = weights + n * K;         // (K)
    topk_row(ex, p, bias, E, K, n_group, topk_group, /*top2=*/sigmoid);
    T S = 0;
    for (int64_t k = 0; k < K; ++k) S += p[ex[k]];
    const T f = renormalize ? T(scale) / S : T(scale);
    for (int64_t k = 0; k < K; ++k) w[k] = p[ex[k]] * f;
  }
}

template <typename T> void router_topk_backward(T* dlogits, const T* dweights, const T* dprob_row, const T* probs,
                                                const int32_t* experts, int64_t N, int64_t E, int64_t K, bool sigmoid,
                                                bool renormalize, double scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* p = probs + n * E;           // (E)
    const T* dw = dweights + n * K;       // (K)
    const int32_t* ex = experts + n * K;  // (K)
    T* dp = dlogits + n * E;              // (E): dprobs first, then turned into dlogits in place
    for (int64_t e = 0; e < E; ++e) dp[e] = dprob_row ? dprob_row[e] : T(0);
    if (renormalize) {
      T S = 0, dot = 0;  // dot = sum_k dw_k p_k
      for (int64_t k = 0; k < K; ++k) S += p[ex[k]], dot += dw[k] * p[ex[k]];
      const T s = T(scale);
      for (int64_t k = 0; k < K; ++k) dp[ex[k]] += s * (dw[k] / S - dot / (S * S));
    } else {
      for (int64_t k = 0; k < K; ++k) dp[ex[k]] += T(scale) * dw[k];
    }
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) dp[e] = dp[e] * p[e] * (T(1) - p[e]);
    } else {
      T pdp = 0;
      for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[e];
      for (int64_t e = 0; e < E; ++e) dp[e] = p[e] * (dp[e] - pdp);
    }
  }
}

template <typename T>
void moe_dispatch_forward(T* out, const T* inp, const int32_t* slot, int64_t N, int64_t K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t s = slot[t * K + k];
      if (s >= 0) std::memcpy(out + int64_t(s) * C, inp + t * C, size_t(C) * sizeof(T));
    }
}

// Each token row gathers its K routed rows in k order, each weighted (weights null: by 1, dispatch's transpose):
// deterministic, no atomics.
template <typename T>
void moe_combine_forward(T* out, const T* inp, const T* weights, const int32_t* slot, int64_t N, int64_t K, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    T* y = out + t * C;  // (C)
    std::fill(y, y + C, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const int32_t s = slot[t * K + k];
      if (s < 0) continue;
      const T w = weights ? weights[t * K + k] : T(1);
      const T* x = inp + int64_t(s) * C;  // (C)
      for (int64_t c = 0; c < C; ++c) y[c] += w * x[c];
    }
  }
}

template <typename T>
void moe_dispatch_backward(T* dinp, const T* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C) {
  moe_combine_forward<T>(dinp, dout, nullptr, slot, N, K, C);
}

// dinp is zeroed first: the rows no slot names (capacity padding) get 0, the others are written once below.
template <typename T> void moe_combine_backward(T* dinp, T* dweights, const T* dout, const T* inp, const T* weights,
                                                const int32_t* slot, int64_t N, int64_t K, int64_t M, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < M; ++r) std::fill(dinp + r * C, dinp + (r + 1) * C, T(0));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const T* dy = dout + t * C;  // (C)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t s = slot[t * K + k];
      if (s < 0) {
        dweights[t * K + k] = T(0);
        continue;
      }
      const T w = weights[t * K + k];
      const T* x = inp + int64_t(s) * C;  // (C)
      T* dx = dinp + int64_t(s) * C;      // (C)
      T dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += dy[c] * x[c], dx[c] = w * dy[c];
      dweights[t * K + k] = dot;
    }
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(router_topk_forward)
MT_CPU_EXPORT(router_topk_backward)
MT_CPU_EXPORT(moe_dispatch_forward)
MT_CPU_EXPORT(moe_dispatch_backward)
MT_CPU_EXPORT(moe_combine_forward)
MT_CPU_EXPORT(moe_combine_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include <vector>

#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/moe.cu: one warp per row (router, gathers, scatters), f32 math
// weights (N, K) f32, experts (N, K), probs (N, E) f32 from logits (N, E) T; bias (E) f32 or null.
template <typename T> int router_topk_forward(float* weights, int32_t* experts, float* probs, const T* logits,
                                              const float* bias, int64_t N, int64_t E, int64_t K, bool sigmoid,
                                              bool renormalize, double scale, int64_t n_group, int64_t topk_group,
                                              void* stream);
// dlogits (N, E) T overwritten from dweights (N, K) f32, dprob_row (E) f32 or null, probs (N, E) f32.
template <typename T> int router_topk_backward(T* dlogits, const float* dweights, const float* dprob_row,
                                               const float* probs, const int32_t* experts, int64_t N, int64_t E,
                                               int64_t K, bool sigmoid, bool renormalize, double scale, void* stream);
// out (M, C) rows slot[t,k] = inp (N, C) row t.
template <typename T>
int moe_dispatch_forward(T* out, const T* inp, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream);
// dinp (N, C) row t = sum_k dout (M, C) row slot[t,k], in f32.
template <typename T>
int moe_dispatch_backward(T* dinp, const T* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream);
// out (N, C) row t = sum_k weights[t,k] inp (M, C) row slot[t,k], in f32.
template <typename T> int moe_combine_forward(T* out, const T* inp, const float* weights, const int32_t* slot,
                                              int64_t N, int64_t K, int64_t C, void* stream);
// dinp (M, C) (zeroed, then rows slot[t,k] = weights[t,k] dout row t), dweights (N, K) f32 = dout . inp rows.
template <typename T> int moe_combine_backward(T* dinp, float* dweights, const T* dout, const T* inp,
                                               const float* weights, const int32_t* slot, int64_t N, int64_t K,
                                               int64_t M, int64_t C, void* stream);
// moe_grouped.cu: the routing and the grouped GEMM with the groups' offsets (G + 1) i32 on the device.
int moe_route(int32_t* slot, int32_t* counts, int32_t* selected, int32_t* offsets, int32_t* dropped,
              const int32_t* experts, int64_t n, int64_t E, int64_t capacity, bool padded, void* stream);
int moe_unpad_order(int32_t* order, int32_t* offsets, const int32_t* counts, int64_t P, int64_t El, int64_t capacity,
                    void* stream);
int moe_stats_record(double* stats, const int32_t* selected, const float* prob_sums, const int32_t* dropped, int64_t L,
                     int64_t E, int64_t layer, int64_t rows, void* stream);
int moe_stats_add(double* stats, const double* in, int64_t n, void* stream);
int moe_aux_grad_row(float* row, const double* stats, int64_t L, int64_t E, double coef, double loss_scale,
                     void* stream);
// out (M, OC) rows of group g = inp rows @ weight[g]^T (rows past offsets[G]: 0).
template <typename T>
int grouped_matmul_forward_dev(T* out, const T* inp, const T* weight, const int32_t* offsets, int64_t M, int64_t C,
                               int64_t OC, int64_t G, void* stream);
// dinp (M, C) (or null) = dout @ weight[g] per group (rows past offsets[G]: 0); dweight (G, OC, C) f32 (or null)
// += dout^T @ inp per group.
template <typename T>
int grouped_matmul_backward_dev(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight,
                                const int32_t* offsets, int64_t M, int64_t C, int64_t OC, int64_t G, void* stream);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

namespace {
// Host slots only (device slots come from the routing code, which built them): each in [-1, M), and no routed
// row named twice (the scatters write each row once, without atomics).
void check_slots(const char* op, const Tensor& slot, int64_t M) {
  const int32_t* s = slot.data<int32_t>();
  std::vector<char> seen(size_t(M), 0);
  for (int64_t i = 0; i < slot.numel(); ++i) {
    MT_CHECK(s[i] >= -1 && s[i] < M, "kernels", "{}: slot {} at {} is outside [-1, {})", op, s[i], i, M);
    if (s[i] < 0) continue;
    MT_CHECK(!seen[size_t(s[i])], "kernels", "{}: routed row {} is named twice (slot {})", op, s[i], i);
    seen[size_t(s[i])] = 1;
  }
}

// slot (N, K) i32; returns K.
int64_t check_slot_shape(const char* op, const Tensor& slot, int64_t N) {
  MT_CHECK(slot.defined() && slot.dim() == 2 && slot.size(0) == N, "kernels", "{}: slot must be ({}, K), got {}", op, N,
           slot.defined() ? shape_str(slot.shape()) : "none");
  check_i32(op, slot, slot.numel(), "slot");
  return slot.size(1);
}

// (N, E) logits and the (N, K) experts; K in [1, E].
void check_router(const char* op, const Tensor& logits, const Tensor& experts, const Tensor& weights,
                  const Tensor& probs) {
  MT_CHECK(logits.dim() == 2 && experts.defined() && experts.dim() == 2 && experts.size(0) == logits.size(0) &&
               experts.size(1) >= 1 && experts.size(1) <= logits.size(1),
           "kernels", "{}: logits {} (N, E) and experts {} (N, K), 1 <= K <= E", op, shape_str(logits.shape()),
           experts.defined() ? shape_str(experts.shape()) : "none");
  const int64_t N = logits.size(0), E = logits.size(1), K = experts.size(1);
  check_i32(op, experts, N * K, "experts");
  expect_shape(op, weights, {N, K}, "weights");
  expect_shape(op, probs, {N, E}, "probs");
  expect_acc(op, weights, logits.dtype(), "weights");
  expect_acc(op, probs, logits.dtype(), "probs");
}

// (M, C) rows in groups of counts; returns the groups' first rows (G + 1 entries).
std::vector<int64_t> group_begins(const char* op, const std::vector<int64_t>& counts, int64_t M) {
  std::vector<int64_t> begin(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) {
    MT_CHECK(counts[g] >= 0, "kernels", "{}: group {} has {} rows", op, g, counts[g]);
    begin[g + 1] = begin[g] + counts[g];
  }
  MT_CHECK(begin.back() == M, "kernels", "{}: the groups' counts sum to {}, but there are {} rows", op, begin.back(),
           M);
  return begin;
}

// weight (G, OC, C) with G = counts.size() and inp's C.
void check_grouped_weight(const char* op, const Tensor& weight, const std::vector<int64_t>& counts, int64_t C) {
  check_float(op, weight, "weight");
  MT_CHECK(weight.dim() == 3 && weight.size(0) == int64_t(counts.size()) && weight.size(2) == C, "kernels",
           "{}: weight must be ({}, OC, {}), got {}", op, counts.size(), C, shape_str(weight.shape()));
}

// Group g's (OC, C) slice of a (G, OC, C) tensor.
Tensor group_slice(const Tensor& w, size_t g) {
  const int64_t OC = w.size(1), C = w.size(2);
  return w.view(int64_t(g) * OC * C, {OC, C});
}
}  // namespace

void router_topk_forward(const Tensor& weights, const Tensor& experts, const Tensor& probs, const Tensor& logits,
                         const Tensor& bias, bool sigmoid, bool renormalize, double scale, int64_t n_group,
                         int64_t topk_group) {
  const char* op = "router_topk_forward";
  check_float(op, logits, "logits");
  check_router(op, logits, experts, weights, probs);
  const int64_t N = logits.size(0), E = logits.size(1), K = experts.size(1);
  MT_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group && E <= 1024 &&
               (n_group == 1 || K <= topk_group * (E / n_group)) && (n_group == 1 || !sigmoid || E / n_group >= 2) &&
               n_group <= 64,
           "kernel", "{}: {} experts in {} groups, top {} groups, k {}: expected groups of at least {} experts "
           "dividing them, at most 64 groups and 1024 experts, k within the kept groups",
           op, E, n_group, topk_group, K, sigmoid ? 2 : 1);
  if (bias.defined()) {
    expect_shape(op, bias, {E}, "bias");
    expect_acc(op, bias, logits.dtype(), "bias");
  }
  dispatch(
      op, logits,
      MT_CUDA_FN(return cuda::router_topk_forward<T>(ptr<float>(weights), experts.data<int32_t>(), ptr<float>(probs),
                                                     ptr<T>(logits), ptr<float>(bias), N, E, K, sigmoid, renormalize,
                                                     scale, n_group, topk_group, stream_of(logits));),
      [&](auto z, const Tensor& weights, const Tensor& experts, const Tensor& probs, const Tensor& logits,
          const Tensor& bias) {
        using T = decltype(z);
        MT_CPU_KERNEL(router_topk_forward, T)
        (ptr<T>(weights), experts.data<int32_t>(), ptr<T>(probs), ptr<T>(logits), ptr<T>(bias), N, E, K, sigmoid,
         renormalize, scale, n_group, topk_group);
      },
      wr(weights), wr(experts), wr(probs), rd(logits), rd(bias));
}

void router_topk_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& dprob_row, const Tensor& probs,
                          const Tensor& weights, const Tensor& experts, bool sigmoid, bool renormalize, double scale) {
  const char* op = "router_topk_backward";
  check_float(op, dlogits, "dlogits");
  check_router(op, dlogits, experts, weights, probs);
  const int64_t N = dlogits.size(0), E = dlogits.size(1), K = experts.size(1);
  expect_shape(op, dweights, {N, K}, "dweights");
  expect_acc(op, dweights, dlogits.dtype(), "dweights");
  if (dprob_row.defined()) {
    expect_shape(op, dprob_row, {E}, "dprob_row");
    expect_acc(op, dprob_row, dlogits.dtype(), "dprob_row");
  }
  // weights are implied by probs and experts (the kernels recompute the sum S); checked, not read.
  dispatch(
      op, dlogits,
      MT_CUDA_FN(return cuda::router_topk_backward<T>(ptr<T>(dlogits), ptr<float>(dweights), ptr<float>(dprob_row),
                                                      ptr<float>(probs), experts.data<int32_t>(), N, E, K, sigmoid,
                                                      renormalize, scale, stream_of(dlogits));),
      [&](auto z, const Tensor& dlogits, const Tensor& dweights, const Tensor& dprob_row, const Tensor& probs,
          const Tensor& experts) {
        using T = decltype(z);
        MT_CPU_KERNEL(router_topk_backward, T)
        (ptr<T>(dlogits), ptr<T>(dweights), ptr<T>(dprob_row), ptr<T>(probs), experts.data<int32_t>(), N, E, K, sigmoid,
         renormalize, scale);
      },
      wr(dlogits), rd(dweights), rd(dprob_row), rd(probs), rd(experts));
}

void moe_dispatch_forward(const Tensor& out, const Tensor& inp, const Tensor& slot) {
  const char* op = "moe_dispatch_forward";
  check_float(op, inp, "inp");
  check_float(op, out, "out");
  same_dtype(op, inp, out, "out");
  MT_CHECK(inp.dim() == 2 && out.dim() == 2 && out.size(1) == inp.size(1), "kernels",
           "{}: inp {} (N, C) and out {} (M, C)", op, shape_str(inp.shape()), shape_str(out.shape()));
  const int64_t N = inp.size(0), C = inp.size(1), M = out.size(0), K = check_slot_shape(op, slot, N);
  // out is read-and-written: the rows no slot names keep their values (bf16 on the CPU: widened and rounded
  // back, exactly).
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::moe_dispatch_forward<T>(ptr<T>(out), ptr<T>(inp), slot.data<int32_t>(), N, K, C,
                                                      stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& slot) {
        using T = decltype(z);
        check_slots(op, slot, M);
        MT_CPU_KERNEL(moe_dispatch_forward, T)(ptr<T>(out), ptr<T>(inp), slot.data<int32_t>(), N, K, C);
      },
      rw(out), rd(inp), rd(slot));
}

void moe_dispatch_backward(const Tensor& dinp, const Tensor& dout, const Tensor& slot) {
  const char* op = "moe_dispatch_backward";
  check_float(op, dout, "dout");
  check_float(op, dinp, "dinp");
  same_dtype(op, dout, dinp, "dinp");
  MT_CHECK(dinp.dim() == 2 && dout.dim() == 2 && dout.size(1) == dinp.size(1), "kernels",
           "{}: dinp {} (N, C) and dout {} (M, C)", op, shape_str(dinp.shape()), shape_str(dout.shape()));
  const int64_t N = dinp.size(0), C = dinp.size(1), M = dout.size(0), K = check_slot_shape(op, slot, N);
  dispatch(
      op, dout,
      MT_CUDA_FN(return cuda::moe_dispatch_backward<T>(ptr<T>(dinp), ptr<T>(dout), slot.data<int32_t>(), N, K, C,
                                                       stream_of(dout));),
      [&](auto z, const Tensor& dinp, const Tensor& dout, const Tensor& slot) {
        using T = decltype(z);
        check_slots(op, slot, M);
        MT_CPU_KERNEL(moe_dispatch_backward, T)(ptr<T>(dinp), ptr<T>(dout), slot.data<int32_t>(), N, K, C);
      },
      wr(dinp), rd(dout), rd(slot));
}

void moe_combine_forward(const Tensor& out, const Tensor& inp, const Tensor& weights, const Tensor& slot) {
  const char* op = "moe_combine_forward";
  check_float(op, inp, "inp");
  check_float(op, out, "out");
  same_dtype(op, inp, out, "out");
  MT_CHECK(inp.dim() == 2 && out.dim() == 2 && out.size(1) == inp.size(1), "kernels",
           "{}: inp {} (M, C) and out {} (N, C)", op, shape_str(inp.shape()), shape_str(out.shape()));
  const int64_t N = out.size(0), C = out.size(1), M = inp.size(0), K = check_slot_shape(op, slot, N);
  expect_shape(op, weights, {N, K}, "weights");
  expect_acc(op, weights, inp.dtype(), "weights");
  dispatch(
      op, inp,
      MT_CUDA_FN(return cuda::moe_combine_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<float>(weights),
                                                     slot.data<int32_t>(), N, K, C, stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& weights, const Tensor& slot) {
        using T = decltype(z);
        check_slots(op, slot, M);
        MT_CPU_KERNEL(moe_combine_forward, T)
        (ptr<T>(out), ptr<T>(inp), ptr<T>(weights), slot.data<int32_t>(), N, K, C);
      },
      wr(out), rd(inp), rd(weights), rd(slot));
}

void moe_combine_backward(const Tensor& dinp, const Tensor& dweights, const Tensor& dout, const Tensor& inp,
                          const Tensor& weights, const Tensor& slot) {
  const char* op = "moe_combine_backward";
  check_float(op, dout, "dout");
  for (auto* t : {&dinp, &inp}) {
    check_float(op, *t, "an operand");
    same_dtype(op, dout, *t, "an operand");
  }
  MT_CHECK(dout.dim() == 2 && inp.dim() == 2 && inp.size(1) == dout.size(1), "kernels",
           "{}: inp {} (M, C) and dout {} (N, C)", op, shape_str(inp.shape()), shape_str(dout.shape()));
  const int64_t N = dout.size(0), C = dout.size(1), M = inp.size(0), K = check_slot_shape(op, slot, N);
  expect_shape(op, dinp, inp.shape(), "dinp");
  for (auto* t : {&dweights, &weights}) {
    expect_shape(op, *t, {N, K}, "weights / dweights");
    expect_acc(op, *t, dout.dtype(), "weights / dweights");
  }
  dispatch(
      op, dout,
      MT_CUDA_FN(return cuda::moe_combine_backward<T>(ptr<T>(dinp), ptr<float>(dweights), ptr<T>(dout), ptr<T>(inp),
                                                      ptr<float>(weights), slot.data<int32_t>(), N, K, M, C,
                                                      stream_of(dout));),
      [&](auto z, const Tensor& dinp, const Tensor& dweights, const Tensor& dout, const Tensor& inp,
          const Tensor& weights, const Tensor& slot) {
        using T = decltype(z);
        check_slots(op, slot, M);
        MT_CPU_KERNEL(moe_combine_backward, T)
        (ptr<T>(dinp), ptr<T>(dweights), ptr<T>(dout), ptr<T>(inp), ptr<T>(weights), slot.data<int32_t>(), N, K, M, C);
      },
      wr(dinp), wr(dweights), rd(dout), rd(inp), rd(weights), rd(slot));
}

void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight,
                            const std::vector<int64_t>& counts) {
  const char* op = "grouped_matmul_forward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (M, C), got {}", op, shape_str(inp.shape()));
  check_grouped_weight(op, weight, counts, inp.size(1));
  const auto begin = group_begins(op, counts, inp.size(0));
  expect_shape(op, out, {inp.size(0), weight.size(1)}, "out");
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;  // matmul's checks and dtype rules apply per group
    matmul_forward(out.slice0(begin[g], begin[g + 1]), inp.slice0(begin[g], begin[g + 1]), group_slice(weight, g),
                   false);
  }
}

void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const std::vector<int64_t>& counts) {
  const char* op = "grouped_matmul_backward";
  check_float(op, dout, "dout");
  MT_CHECK(dout.dim() == 2, "kernels", "{}: dout must be (M, OC), got {}", op, shape_str(dout.shape()));
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2 && inp.size(0) == dout.size(0), "kernels", "{}: inp must be ({}, C), got {}", op,
           dout.size(0), shape_str(inp.shape()));
  check_grouped_weight(op, weight, counts, inp.size(1));
  expect_shape(op, dout, {inp.size(0), weight.size(1)}, "dout");
  if (dinp.defined()) expect_shape(op, dinp, inp.shape(), "dinp");
  if (dweight.defined()) expect_shape(op, dweight, weight.shape(), "dweight");
  const auto begin = group_begins(op, counts, inp.size(0));
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;
    const int64_t b = begin[g], e = begin[g + 1];
    matmul_backward(dinp.defined() ? dinp.slice0(b, e) : Tensor(),
                    dweight.defined() ? group_slice(dweight, g) : Tensor(), dout.slice0(b, e), inp.slice0(b, e),
                    group_slice(weight, g), false);
  }
}


// ---- The same with the groups on the device (moe_grouped.cu on CUDA)

namespace {
// offsets (G + 1) i32 of a grouped op: read on the CPU (host memory: no sync), checked; the CUDA kernels trust them.
std::vector<int64_t> host_offsets(const char* op, const Tensor& offsets, int64_t M) {
  const int32_t* o = offsets.data<int32_t>();
  std::vector<int64_t> b(size_t(offsets.numel()));
  for (size_t g = 0; g < b.size(); ++g) {
    b[g] = o[g];
    MT_CHECK(g == 0 ? b[g] == 0 : b[g] >= b[g - 1], "kernels", "{}: offsets[{}] = {} (must start at 0 and not decrease)",
             op, g, b[g]);
  }
  MT_CHECK(b.back() <= M, "kernels", "{}: the groups end at row {}, past the buffer's {}", op, b.back(), M);
  return b;
}

void check_offsets_shape(const char* op, const Tensor& offsets, const Tensor& weight, int64_t C) {
  MT_CHECK(offsets.defined() && offsets.numel() >= 1, "kernels", "{}: offsets must be (G + 1) i32", op);
  check_i32(op, offsets, offsets.numel(), "offsets");
  check_float(op, weight, "weight");
  const int64_t G = offsets.numel() - 1;
  MT_CHECK(weight.dim() == 3 && weight.size(0) == G && weight.size(2) == C, "kernels",
           "{}: weight must be ({}, OC, {}), got {}", op, G, C, shape_str(weight.shape()));
}
}  // namespace

void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets) {
  const char* op = "grouped_matmul_forward";
  check_float(op, inp, "inp");
  MT_CHECK(inp.dim() == 2, "kernels", "{}: inp must be (M, C), got {}", op, shape_str(inp.shape()));
  const int64_t M = inp.size(0), C = inp.size(1);
  check_offsets_shape(op, offsets, weight, C);
  const int64_t G = weight.size(0), OC = weight.size(1);
  expect_shape(op, out, {M, OC}, "out");
  if (on_cuda(op, {&out, &inp, &weight, &offsets})) {
#if MT_CUDA
    same_dtype(op, inp, weight, "weight");
    same_dtype(op, inp, out, "out");
    kprof::Scope prof(op, inp.device(), 0, kprof::enabled() ? kprof::bytes_of({&out, &inp, &weight}) : 0);
    cuda_check(by_cuda_float(inp, [&](auto z) {
                 using T = decltype(z);
                 return cuda::grouped_matmul_forward_dev<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(weight),
                                                            offsets.data<int32_t>(), M, C, OC, G, stream_of(inp));
               }),
               op);
#endif
    return;
  }
  // The CPU: one matmul per group on row views, as the host-counts op.
  const std::vector<int64_t> b = host_offsets(op, offsets, M);
  for (int64_t g = 0; g < G; ++g)
    if (b[size_t(g) + 1] > b[size_t(g)])
      matmul_forward(out.slice0(b[size_t(g)], b[size_t(g) + 1]), inp.slice0(b[size_t(g)], b[size_t(g) + 1]),
                     group_slice(weight, size_t(g)), false);
  if (b.back() < M) fill_zero_(out.slice0(b.back(), M));
}

void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets) {
  const char* op = "grouped_matmul_backward";
  check_float(op, dout, "dout");
  check_float(op, inp, "inp");
  MT_CHECK(dout.dim() == 2 && inp.dim() == 2 && inp.size(0) == dout.size(0), "kernels",
           "{}: dout (M, OC) and inp (M, C), got {} and {}", op, shape_str(dout.shape()), shape_str(inp.shape()));
  const int64_t M = inp.size(0), C = inp.size(1);
  check_offsets_shape(op, offsets, weight, C);
  const int64_t G = weight.size(0), OC = weight.size(1);
  expect_shape(op, dout, {M, OC}, "dout");
  if (dinp.defined()) expect_shape(op, dinp, inp.shape(), "dinp");
  if (dweight.defined()) expect_shape(op, dweight, weight.shape(), "dweight");
  if (on_cuda(op, {&dinp, &dweight, &dout, &inp, &weight, &offsets})) {
#if MT_CUDA
    same_dtype(op, dout, inp, "inp");
    same_dtype(op, dout, weight, "weight");
    if (dinp.defined()) same_dtype(op, dout, dinp, "dinp");
    if (dweight.defined())
      MT_CHECK(dweight.dtype() == DType::f32, "kernels", "{}: dweight must be f32 on CUDA, got {}", op,
               dtype_name(dweight.dtype()));
    kprof::Scope prof(op, dout.device(), 0, kprof::enabled() ? kprof::bytes_of({&dinp, &dweight, &dout, &inp}) : 0);
    cuda_check(by_cuda_float(dout, [&](auto z) {
                 using T = decltype(z);
                 return cuda::grouped_matmul_backward_dev<T>(ptr<T>(dinp), ptr<float>(dweight), ptr<T>(dout),
                                                             ptr<T>(inp), ptr<T>(weight), offsets.data<int32_t>(), M,
                                                             C, OC, G, stream_of(dout));
               }),
               op);
#endif
    return;
  }
  const std::vector<int64_t> b = host_offsets(op, offsets, M);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = b[size_t(g)], r1 = b[size_t(g) + 1];
    if (r1 == r0) continue;
    matmul_backward(dinp.defined() ? dinp.slice0(r0, r1) : Tensor(),
                    dweight.defined() ? group_slice(dweight, size_t(g)) : Tensor(), dout.slice0(r0, r1),
                    inp.slice0(r0, r1), group_slice(weight, size_t(g)), false);
  }
  if (dinp.defined() && b.back() < M) fill_zero_(dinp.slice0(b.back(), M));
}

void moe_route(const Tensor& slot, const Tensor& counts, const Tensor& selected, const Tensor& offsets,
               const Tensor& dropped, const Tensor& experts, int64_t capacity, bool padded) {
  const char* op = "moe_route";
  MT_CHECK(experts.defined() && experts.dim() == 2, "kernels", "{}: experts must be (N, K) i32", op);
  const int64_t N = experts.size(0), K = experts.size(1), n = N * K;
  MT_CHECK(counts.defined() && counts.numel() >= 1, "kernels", "{}: counts must be (E) i32", op);
  const int64_t E = counts.numel();
  check_i32(op, experts, n, "experts");
  check_i32(op, slot, n, "slot");
  expect_shape(op, slot, experts.shape(), "slot");
  check_i32(op, counts, E, "counts");
  check_i32(op, selected, E, "selected");
  check_i32(op, offsets, E + 1, "offsets");
  check_i32(op, dropped, 1, "dropped");
  MT_CHECK(!padded || capacity > 0, "kernels", "{}: padded blocks need a capacity", op);
  MT_CHECK(n <= INT32_MAX && (capacity <= 0 || E * capacity <= INT32_MAX), "kernels",
           "{}: {} routed rows do not fit i32 slots", op, padded ? E * capacity : n);
  if (on_cuda(op, {&slot, &counts, &selected, &offsets, &dropped, &experts})) {
#if MT_CUDA
    kprof::Scope prof(op, experts.device(), 0, 0);
    cuda_check(cuda::moe_route(slot.data<int32_t>(), counts.data<int32_t>(), selected.data<int32_t>(),
                               offsets.data<int32_t>(), dropped.data<int32_t>(), experts.data<int32_t>(), n, E,
                               capacity, padded, stream_of(experts)),
               op);
#endif
    return;
  }
  // The host loop models/llama/moe.cpp ran before (the reference of the CUDA kernels' order).
  const int32_t* ex = experts.data<int32_t>();
  int32_t *s = slot.data<int32_t>(), *c = counts.data<int32_t>(), *sel = selected.data<int32_t>(),
          *o = offsets.data<int32_t>();
  const int64_t cap = capacity > 0 ? capacity : INT64_MAX;
  std::fill(c, c + E, 0);
  std::fill(sel, sel + E, 0);
  int32_t drop = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ex[i];
    MT_CHECK(e >= 0 && e < E, "model", "router: expert {} out of {}", e, E);
    ++sel[e];
    if (c[e] < cap) s[i] = c[e]++;
    else s[i] = -1, ++drop;
  }
  o[0] = 0;
  for (int64_t e = 0; e < E; ++e) o[e + 1] = o[e] + c[e];
  for (int64_t i = 0; i < n; ++i)
    if (s[i] >= 0) s[i] = int32_t((padded ? int64_t(ex[i]) * capacity : int64_t(o[ex[i]])) + s[i]);
  dropped.data<int32_t>()[0] = drop;
}

void moe_unpad_order(const Tensor& order, const Tensor& offsets, const Tensor& counts, int64_t capacity) {
  const char* op = "moe_unpad_order";
  MT_CHECK(counts.defined() && counts.dim() == 2 && capacity > 0, "kernels",
           "{}: counts must be (P, El) i32 and the capacity positive", op);
  const int64_t P = counts.size(0), El = counts.size(1);
  check_i32(op, counts, P * El, "counts");
  check_i32(op, order, P * El * capacity, "order");
  check_i32(op, offsets, El + 1, "offsets");
  if (on_cuda(op, {&order, &offsets, &counts})) {
#if MT_CUDA
    kprof::Scope prof(op, counts.device(), 0, 0);
    cuda_check(cuda::moe_unpad_order(order.data<int32_t>(), offsets.data<int32_t>(), counts.data<int32_t>(), P, El,
                                     capacity, stream_of(counts)),
               op);
#endif
    return;
  }
  const int32_t* n = counts.data<int32_t>();
  int32_t *ord = order.data<int32_t>(), *o = offsets.data<int32_t>();
  std::vector<int32_t> next(size_t(El), 0);  // expert j's next grouped row
  int32_t run = 0;
  for (int64_t j = 0; j < El; ++j) {
    o[j] = next[size_t(j)] = run;
    for (int64_t p = 0; p < P; ++p) {
      MT_CHECK(n[p * El + j] >= 0 && n[p * El + j] <= capacity, "kernels", "{}: counts[{}, {}] = {} outside [0, {}]",
               op, p, j, n[p * El + j], capacity);
      run += n[p * El + j];
    }
  }
  o[El] = run;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < El; ++j)
      for (int64_t i = 0; i < capacity; ++i) ord[(p * El + j) * capacity + i] = i < n[p * El + j] ? next[size_t(j)]++ : -1;
}

void moe_stats_record(const Tensor& stats, const Tensor& selected, const Tensor& prob_sums, const Tensor& dropped,
                      int64_t layer, int64_t rows) {
  const char* op = "moe_stats_record";
  MT_CHECK(selected.defined(), "kernels", "{}: selected must be (E) i32", op);
  const int64_t E = selected.numel();
  check_i32(op, selected, E, "selected");
  MT_CHECK(stats.defined() && stats.dtype() == DType::f64 && stats.numel() >= E + 2 && (stats.numel() - 2) % E == 0,
           "kernels", "{}: stats must be (L E + E + 2) f64 with E = {}", op, E);
  const int64_t L = (stats.numel() - 2) / E - 1;
  MT_CHECK(layer >= 0 && layer < L, "kernels", "{}: layer {} of {}", op, layer, L);
  if (dropped.defined()) check_i32(op, dropped, 1, "dropped");
  if (prob_sums.defined()) {
    check_float(op, prob_sums, "prob_sums");
    MT_CHECK(prob_sums.numel() == E, "kernels", "{}: prob_sums must be ({})", op, E);
  }
  if (on_cuda(op, {&stats, &selected, &prob_sums, &dropped})) {
#if MT_CUDA
    MT_CHECK(!prob_sums.defined() || prob_sums.dtype() == DType::f32, "kernels", "{}: prob_sums must be f32 on CUDA",
             op);
    kprof::Scope prof(op, stats.device(), 0, 0);
    cuda_check(cuda::moe_stats_record(stats.data<double>(), selected.data<int32_t>(), ptr<float>(prob_sums),
                                      ptr<int32_t>(dropped), L, E, layer, rows, stream_of(stats)),
               op);
#endif
    return;
  }
  double* st = stats.data<double>();
  const int32_t* sel = selected.data<int32_t>();
  for (int64_t e = 0; e < E; ++e) st[layer * E + e] = double(sel[e]);
  if (prob_sums.defined()) {
    const std::vector<double> ps = [&] {  // widened as to_f64 does, without counting a host read: this is host memory
      std::vector<double> v(static_cast<size_t>(E));
      if (prob_sums.dtype() == DType::f64) std::copy_n(prob_sums.data<double>(), E, v.begin());
      else if (prob_sums.dtype() == DType::f32) std::copy_n(prob_sums.data<float>(), E, v.begin());
      else for (int64_t e = 0; e < E; ++e) v[size_t(e)] = double(bf16::to_float(prob_sums.data<bf16>()[e].bits));
      return v;
    }();
    std::copy(ps.begin(), ps.end(), st + L * E);
  }
  st[L * E + E] += double(rows);
  if (dropped.defined()) st[L * E + E + 1] += double(dropped.data<int32_t>()[0]);
}

void moe_stats_add(const Tensor& stats, const Tensor& in) {
  const char* op = "moe_stats_add";
  for (const Tensor* t : {&stats, &in})
    MT_CHECK(t->defined() && t->dtype() == DType::f64, "kernels", "{}: {} must be f64", op, t == &stats ? "stats" : "in");
  MT_CHECK(in.numel() == stats.numel(), "kernels", "{}: in has {} numbers, stats {}", op, in.numel(), stats.numel());
  const int64_t n = stats.numel();
  if (on_cuda(op, {&stats, &in})) {
#if MT_CUDA
    kprof::Scope prof(op, stats.device(), 0, 0);
    cuda_check(cuda::moe_stats_add(stats.data<double>(), in.data<double>(), n, stream_of(stats)), op);
#endif
    return;
  }
  double* st = stats.data<double>();
  const double* a = in.data<double>();
  for (int64_t i = 0; i < n; ++i) st[i] += a[i];
}

void moe_aux_grad_row(const Tensor& row, const Tensor& stats, int64_t L, double coef, double loss_scale) {
  const char* op = "moe_aux_grad_row";
  check_float(op, row, "row");
  const int64_t E = row.numel();
  MT_CHECK(stats.defined() && stats.dtype() == DType::f64 && L >= 1 && stats.numel() == L * E + E + 2, "kernels",
           "{}: stats must be ({} x {} + {} + 2) f64", op, L, E, E);
  if (on_cuda(op, {&row, &stats})) {
#if MT_CUDA
    MT_CHECK(row.dtype() == DType::f32, "kernels", "{}: row must be f32 on CUDA", op);
    kprof::Scope prof(op, stats.device(), 0, 0);
    cuda_check(cuda::moe_aux_grad_row(row.data<float>(), stats.data<double>(), L, E, coef, loss_scale,
                                      stream_of(stats)),
               op);
#endif
    return;
  }
  // The same operations in the same order as the kernel (and as the host formula this replaced).
  const double* st = stats.data<double>();
  const double R = st[L * E + E];
  std::vector<double> v(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    double C = 0;
    for (int64_t l = 0; l < L; ++l) C += st[l * E + e];
    const double w = R / double(L) * loss_scale;
    v[size_t(e)] = R > 0 ? w * coef * double(E) * C / (R * R) : 0.0;
  }
  if (row.dtype() == DType::f64) std::copy(v.begin(), v.end(), row.data<double>());
  else if (row.dtype() == DType::f32) for (int64_t e = 0; e < E; ++e) row.data<float>()[e] = float(v[size_t(e)]);
  else for (int64_t e = 0; e < E; ++e) row.data<bf16>()[e] = bf16(float(v[size_t(e)]));
}

}  // namespace mt
#endif  // MT_CPU_OPS
