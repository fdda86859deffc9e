// Mixture of experts (ops.h router_topk_*, moe_dispatch_*, moe_combine_*; declared in runtime/kernels/cpu/moe.cpp):
// the router a warp per row (each lane holds up to kPerLane experts in registers, the top K by K warp argmaxes);
// dispatch and combine one thread per element (row gathers and scatters; the sums over k in f32, in k order);
// the combine's dweights a warp per (token, k) dot product. No atomics: the scatters write each routed row once
// (slots are distinct) and every sum has a fixed order. The grouped GEMM with host counts has no kernel here: the op
// runs one matmul (cuBLASLt) per group on row views (cpu/moe.cpp); the one with device offsets is moe_grouped.cu.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kPerLane = 8;  // experts per lane: E <= 256

__device__ inline float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The warp's best (score, index, prob): the larger score, ties to the lower index; index -1 is no candidate.
// A butterfly: every lane ends with the winner, its prob carried along.
__device__ inline void warp_argmax(float& s, int& i, float& pv) {
  for (int o = 16; o > 0; o >>= 1) {
    const float so = __shfl_xor_sync(0xffffffffu, s, o), po = __shfl_xor_sync(0xffffffffu, pv, o);
    const int io = __shfl_xor_sync(0xffffffffu, i, o);
    if (io >= 0 && (i < 0 || so > s || (so == s && io < i))) s = so, i = io, pv = po;
  }
}

// weights, experts (N, K), probs (N, E) f32 from logits (N, E); bias (E) or null. A warp per row; lane l holds
// experts l, l + 32, ... in p[].
// A warp's two largest values of (a, b) pairs (a >= b in each lane; -inf: none), in every lane.
__device__ inline void warp_top2(float& a, float& b) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ao = __shfl_xor_sync(0xffffffffu, a, o), bo = __shfl_xor_sync(0xffffffffu, b, o);
    const float hi = fmaxf(a, ao), lo = fmaxf(fminf(a, ao), fmaxf(b, bo));
    a = hi, b = lo;
  }
}

template <typename T> __global__ void router_fwd_k(float* weights, int32_t* experts, float* probs, const T* logits,
                                                   const float* bias, int64_t N, int E, int K, bool sigmoid,
                                                   bool renorm, float scale, int n_group, int topk_group) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = logits + row * E;  // (E)
  float p[kPerLane];
  float m = -INFINITY;
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? ld(x[e]) : -INFINITY;
    m = fmaxf(m, p[j]);
  }
  m = warp_max(m);
  float sum = 0;
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e >= E) p[j] = 0;
    else if (sigmoid) p[j] = 1.0f / (1.0f + expf(-p[j]));
    else sum += p[j] = expf(p[j] - m);
  }
  if (!sigmoid) {
    sum = warp_sum_f(sum);
    for (int j = 0; j < kPerLane; ++j) p[j] /= sum;
  }
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < E) probs[row * E + lane + 32 * j] = p[j];
  // Group-limited routing: each group's score (its best p + bias; sigmoid: its two best), the topk_group best
  // groups kept (every lane alike), the others' selection score 0.
  unsigned long long kept = ~0ull;  // bit g: group g kept
  if (n_group > 1) {
    const int per = E / n_group;
    float gs[64];
    for (int g = 0; g < n_group; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e >= E || e / per != g) continue;
        const float v = p[j] + (bias ? bias[e] : 0.0f);
        if (v > a) b = a, a = v;
        else if (v > b) b = v;
      }
      warp_top2(a, b);
      gs[g] = sigmoid ? a + b : a;
    }
    kept = 0;
    for (int k = 0; k < topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < n_group; ++g)
        if (!(kept >> g & 1ull) && (best < 0 || gs[g] > gs[best])) best = g;
      kept |= 1ull << best;
    }
  }
  const int per_group = E / n_group;
  unsigned taken = 0;  // bit j: this lane's expert lane + 32 j is selected
  float S = 0;         // the selected probs' sum (the same in every lane)
  for (int k = 0; k < K; ++k) {
    float s = 0, pb = 0;
    int best = -1;
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e >= E || (taken >> j & 1u)) continue;
      const float v = (kept >> (e / per_group) & 1ull) ? p[j] + (bias ? bias[e] : 0.0f) : 0.0f;
      if (best < 0 || v > s) s = v, best = e, pb = p[j];
    }
    warp_argmax(s, best, pb);
    if (best % 32 == lane) taken |= 1u << (best / 32);
    S += pb;
    if (lane == 0) experts[row * K + k] = best, weights[row * K + k] = pb;
  }
  if (lane == 0) {  // lane 0 rescales what it wrote
    const float f = renorm ? scale / S : scale;
    for (int k = 0; k < K; ++k) weights[row * K + k] *= f;
  }
}

// dlogits (N, E) from dweights (N, K), dprob_row (E) or null, probs (N, E), experts (N, K). A warp per row.
template <typename T> __global__ void router_bwd_k(T* dlogits, const float* dweights, const float* dprob_row,
                                                   const float* probs, const int32_t* experts, int64_t N, int E, int K,
                                                   bool sigmoid, bool renorm, float scale) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* p = probs + row * E;       // (E)
  const float* dw = dweights + row * K;   // (K)
  const int32_t* ex = experts + row * K;  // (K)
  float S = 0, dot = 0;                   // every lane: K is small
  for (int k = 0; k < K; ++k) S += p[ex[k]], dot += dw[k] * p[ex[k]];
  float dp[kPerLane], pdp = 0;
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    dp[j] = 0;
    if (e >= E) continue;
    dp[j] = dprob_row ? dprob_row[e] : 0.0f;
    for (int k = 0; k < K; ++k)
      if (ex[k] == e) dp[j] += renorm ? scale * (dw[k] / S - dot / (S * S)) : scale * dw[k];
    pdp += p[e] * dp[j];
  }
  if (!sigmoid) pdp = warp_sum_f(pdp);
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e >= E) continue;
    const float pe = p[e];
    dlogits[row * E + e] = to<T>(sigmoid ? dp[j] * pe * (1.0f - pe) : pe * (dp[j] - pdp));
  }
}

}  // namespace

template <typename T> int router_topk_forward(float* weights, int32_t* experts, float* probs, const T* logits,
                                              const float* bias, int64_t N, int64_t E, int64_t K, bool sigmoid,
                                              bool renormalize, double scale, int64_t n_group, int64_t topk_group,
                                              void* stream) {
  Range r("router_topk_forward");
  if (E > 32 * kPerLane) return int(cudaErrorInvalidValue);
  if (N == 0) return 0;
  MT_LAUNCH(router_fwd_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), weights, experts, probs, dp(logits),
            bias, N, int(E), int(K), sigmoid, renormalize, float(scale), int(n_group), int(topk_group));
  return last_error();
}

template <typename T> int router_topk_backward(T* dlogits, const float* dweights, const float* dprob_row,
                                               const float* probs, const int32_t* experts, int64_t N, int64_t E,
                                               int64_t K, bool sigmoid, bool renormalize, double scale, void* stream) {
  Range r("router_topk_backward");
  if (E > 32 * kPerLane) return int(cudaErrorInvalidValue);
  if (N == 0) return 0;
  MT_LAUNCH(router_bwd_k<Dev<T>>, blocks_for(N * 32), kThreads, 0, st(stream), dp(dlogits), dweights, dprob_row, probs,
            experts, N, int(E), int(K), sigmoid, renormalize, float(scale));
  return last_error();
}

namespace {

// out (M, C) row slot[t,k] = inp (N, C) row t: a thread per element of the (N, K, C) routed copies.
template <typename T>
__global__ void dispatch_fwd_k(T* out, const T* inp, const int32_t* slot, int64_t N, int64_t K, int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * K * C) return;
  const int64_t tk = i / C, c = i % C;
  const int32_t s = slot[tk];
  if (s >= 0) out[int64_t(s) * C + c] = inp[tk / K * C + c];
}

// out (N, C) row t = sum_k weights[t,k] inp (M, C) row slot[t,k], in f32 in k order (weights null: 1, which is
// dispatch's transpose).
template <typename T> __global__ void combine_fwd_k(T* out, const T* inp, const float* weights, const int32_t* slot,
                                                    int64_t N, int64_t K, int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t t = i / C, c = i % C;
  float acc = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t s = slot[t * K + k];
    if (s >= 0) acc += (weights ? weights[t * K + k] : 1.0f) * ld(inp[int64_t(s) * C + c]);
  }
  out[i] = to<T>(acc);
}

template <typename T> __global__ void zero_k(T* x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = to<T>(0.0f);
}

// dinp (M, C) row slot[t,k] = weights[t,k] dout (N, C) row t (after zero_k: the unnamed rows stay 0).
template <typename T> __global__ void combine_bwd_dx_k(T* dinp, const T* dout, const float* weights,
                                                       const int32_t* slot, int64_t N, int64_t K, int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * K * C) return;
  const int64_t tk = i / C, c = i % C;
  const int32_t s = slot[tk];
  if (s >= 0) dinp[int64_t(s) * C + c] = to<T>(weights[tk] * ld(dout[tk / K * C + c]));
}

// dweights (N, K) = dout row t . inp row slot[t,k] (0 when dropped): a warp per (t, k).
template <typename T> __global__ void combine_bwd_dw_k(float* dweights, const T* dout, const T* inp,
                                                       const int32_t* slot, int64_t N, int64_t K, int64_t C) {
  const int64_t tk = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (tk >= N * K) return;
  const int32_t s = slot[tk];
  float dot = 0;
  if (s >= 0)
    for (int64_t c = lane; c < C; c += 32) dot += ld(dout[tk / K * C + c]) * ld(inp[int64_t(s) * C + c]);
  dot = warp_sum_f(dot);
  if (lane == 0) dweights[tk] = dot;
}

}  // namespace

template <typename T>
int moe_dispatch_forward(T* out, const T* inp, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream) {
  Range r("moe_dispatch_forward");
  if (N * K * C == 0) return 0;
  MT_LAUNCH(dispatch_fwd_k<Dev<T>>, blocks_for(N * K * C), kThreads, 0, st(stream), dp(out), dp(inp), slot, N, K, C);
  return last_error();
}

template <typename T>
int moe_dispatch_backward(T* dinp, const T* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream) {
  Range r("moe_dispatch_backward");
  if (N * C == 0) return 0;
  MT_LAUNCH(combine_fwd_k<Dev<T>>, blocks_for(N * C), kThreads, 0, st(stream), dp(dinp), dp(dout), nullptr, slot, N,
            K, C);
  return last_error();
}

template <typename T> int moe_combine_forward(T* out, const T* inp, const float* weights, const int32_t* slot,
                                              int64_t N, int64_t K, int64_t C, void* stream) {
  Range r("moe_combine_forward");
  if (N * C == 0) return 0;
  MT_LAUNCH(combine_fwd_k<Dev<T>>, blocks_for(N * C), kThreads, 0, st(stream), dp(out), dp(inp), weights, slot, N, K,
            C);
  return last_error();
}

template <typename T> int moe_combine_backward(T* dinp, float* dweights, const T* dout, const T* inp,
                                               const float* weights, const int32_t* slot, int64_t N, int64_t K,
                                               int64_t M, int64_t C, void* stream) {
  Range r("moe_combine_backward");
  if (M * C > 0) {
    MT_LAUNCH(zero_k<Dev<T>>, blocks_for(M * C), kThreads, 0, st(stream), dp(dinp), M * C);
  }
  if (N * K * C > 0) {
    MT_LAUNCH(combine_bwd_dx_k<Dev<T>>, blocks_for(N * K * C), kThreads, 0, st(stream), dp(dinp), dp(dout), weights,
              slot, N, K, C);
  }
  if (N * K > 0) {
    MT_LAUNCH(combine_bwd_dw_k<Dev<T>>, blocks_for(N * K * 32), kThreads, 0, st(stream), dweights, dp(dout), dp(inp),
              slot, N, K, C);
  }
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                                              \
  template int router_topk_forward<T>(float*, int32_t*, float*, const T*, const float*, int64_t, int64_t, int64_t,     \
                                      bool, bool, double, int64_t, int64_t, void*);                                    \
  template int router_topk_backward<T>(T*, const float*, const float*, const float*, const int32_t*, int64_t, int64_t, \
                                       int64_t, bool, bool, double, void*);                                            \
  template int moe_dispatch_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, void*);                \
  template int moe_dispatch_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, void*);               \
  template int moe_combine_forward<T>(T*, const T*, const float*, const int32_t*, int64_t, int64_t, int64_t, void*);   \
  template int moe_combine_backward<T>(T*, float*, const T*, const T*, const float*, const int32_t*, int64_t, int64_t, \
                                       int64_t, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
