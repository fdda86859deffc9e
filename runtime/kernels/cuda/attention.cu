// Local attention in fp32 (ops.h local_attention_forward / _backward; declared in
// runtime/kernels/cpu/attention.cpp): one thread per row, a correctness reference for fp32 runs; bf16 runs use
// the tensor-core kernel of flash_attention.cu, or this one on widened copies for a sliding window or soft-capped
// scores (Gemma), which only this one implements on CUDA yet.

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kMaxHeadDim = 256;

struct AttnDims {
  int64_t B, T, S, H, KV, hd;
  float scale;
  bool causal;
  int64_t q_pos0, k_pos0;
  const int64_t* doc_start;  // (B, T) global positions where each query's document starts, or null
  int64_t window;            // > 0: a query at position p sees keys at positions > p - window only
  float softcap;             // > 0: scores s -> softcap tanh(s / softcap) before the softmax
  // Query t of row b sees keys [first(b, t), visible(t)) (none when first >= visible): the window's keys are
  // skipped, not masked.
  __device__ int64_t visible(int64_t t) const {
    if (!causal) return S;
    int64_t v = q_pos0 + t - k_pos0 + 1;
    return v < 0 ? 0 : (v > S ? S : v);
  }
  __device__ int64_t first(int64_t b, int64_t t) const {
    int64_t v = doc_start ? doc_start[b * T + t] - k_pos0 : 0;
    if (window > 0 && q_pos0 + t - window + 1 - k_pos0 > v) v = q_pos0 + t - window + 1 - k_pos0;
    return v < 0 ? 0 : (v > S ? S : v);
  }
  // The scaled score, soft-capped.
  __device__ float score(float dot) const {
    const float s = dot * scale;
    return softcap > 0 ? softcap * tanhf(s / softcap) : s;
  }
  // d(score) / d(dot) at a soft-capped score c: scale (1 - (c / softcap)^2), or scale.
  __device__ float slope(float c) const {
    if (softcap <= 0) return scale;
    const float u = c / softcap;
    return scale * (1.0f - u * u);
  }
};

// One thread per query row with an online softmax: a correct fp32 reference, not a fast kernel.
__global__ void attn_fwd_k(float* out, float* lse, const float* q, const float* k, const float* v, AttnDims d) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.B * d.H * d.T) return;
  int64_t t = i % d.T, h = (i / d.T) % d.H, b = i / (d.T * d.H), j = h / (d.H / d.KV);
  const float* qr = q + ((b * d.T + t) * d.H + h) * d.hd;
  float acc[kMaxHeadDim];
  for (int64_t c = 0; c < d.hd; ++c) acc[c] = 0;
  float m = -INFINITY, l = 0;
  for (int64_t s = d.first(b, t), vis = d.visible(t); s < vis; ++s) {
    const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
    float sc = 0;
    for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c];
    sc = d.score(sc);
    float mn = fmaxf(m, sc), corr = expf(m - mn), p = expf(sc - mn);
    l = l * corr + p;
    const float* vr = v + ((b * d.S + s) * d.KV + j) * d.hd;
    for (int64_t c = 0; c < d.hd; ++c) acc[c] = acc[c] * corr + p * vr[c];
    m = mn;
  }
  float* o = out + ((b * d.T + t) * d.H + h) * d.hd;
  for (int64_t c = 0; c < d.hd; ++c) o[c] = l > 0 ? acc[c] / l : 0.0f;
  lse[(b * d.H + h) * d.T + t] = l > 0 ? m + logf(l) : -INFINITY;
}

}  // namespace

int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, const int64_t* doc_start, int64_t window, double softcap, void* stream) {
  Range r("attention_forward_f32");
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0, doc_start, window, float(softcap)};
  if (B * H * T == 0) return 0;
  MT_LAUNCH(attn_fwd_k, blocks_for(B * H * T, 128), 128, 0, st(stream), out, lse, q, k, v, d);
  return last_error();
}

namespace {

__global__ void attn_rowdot_k(float* D, const float* dout, const float* out, AttnDims d) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.B * d.H * d.T) return;
  int64_t t = i % d.T, h = (i / d.T) % d.H, b = i / (d.T * d.H);
  const float* a = dout + ((b * d.T + t) * d.H + h) * d.hd;
  const float* o = out + ((b * d.T + t) * d.H + h) * d.hd;
  float s = 0;
  for (int64_t c = 0; c < d.hd; ++c) s += a[c] * o[c];
  D[i] = s;
}

__global__ void attn_dq_k(float* dq, const float* D, const float* dout, const float* q, const float* k, const float* v,
                          const float* lse, AttnDims d) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.B * d.H * d.T) return;
  int64_t t = i % d.T, h = (i / d.T) % d.H, b = i / (d.T * d.H), j = h / (d.H / d.KV);
  const float* qr = q + ((b * d.T + t) * d.H + h) * d.hd;
  const float* dor = dout + ((b * d.T + t) * d.H + h) * d.hd;
  float L = lse[(b * d.H + h) * d.T + t];
  float acc[kMaxHeadDim];
  for (int64_t c = 0; c < d.hd; ++c) acc[c] = 0;
  if (L != -INFINITY)
    for (int64_t s = d.first(b, t), vis = d.visible(t); s < vis; ++s) {
      const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
      const float* vr = v + ((b * d.S + s) * d.KV + j) * d.hd;
      float sc = 0, dpv = 0;
      for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c], dpv += dor[c] * vr[c];
      const float cs = d.score(sc);
      float p = expf(cs - L), ds = p * (dpv - D[i]) * d.slope(cs);
      for (int64_t c = 0; c < d.hd; ++c) acc[c] += ds * kr[c];
    }
  float* o = dq + ((b * d.T + t) * d.H + h) * d.hd;
  for (int64_t c = 0; c < d.hd; ++c) o[c] = acc[c];
}

// One thread per key row: every query of the kv head's group, in order (deterministic).
__global__ void attn_dkv_k(float* dk, float* dv, const float* D, const float* dout, const float* q, const float* k,
                           const float* v, const float* lse, AttnDims d, bool accumulate) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.B * d.KV * d.S) return;
  int64_t s = i % d.S, j = (i / d.S) % d.KV, b = i / (d.S * d.KV), group = d.H / d.KV;
  const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
  const float* vr = v + ((b * d.S + s) * d.KV + j) * d.hd;
  float ak[kMaxHeadDim], av[kMaxHeadDim];
  for (int64_t c = 0; c < d.hd; ++c) ak[c] = av[c] = 0;
  for (int64_t h = j * group; h < (j + 1) * group; ++h)
    for (int64_t t = 0; t < d.T; ++t) {
      if (s >= d.visible(t) || s < d.first(b, t)) continue;  // query t does not see key s
      float L = lse[(b * d.H + h) * d.T + t];
      if (L == -INFINITY) continue;
      const float* qr = q + ((b * d.T + t) * d.H + h) * d.hd;
      const float* dor = dout + ((b * d.T + t) * d.H + h) * d.hd;
      float sc = 0, dpv = 0;
      for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c], dpv += dor[c] * vr[c];
      const float cs = d.score(sc);
      float p = expf(cs - L), ds = p * (dpv - D[(b * d.H + h) * d.T + t]) * d.slope(cs);
      for (int64_t c = 0; c < d.hd; ++c) av[c] += p * dor[c], ak[c] += ds * qr[c];
    }
  float* okr = dk + ((b * d.S + s) * d.KV + j) * d.hd;
  float* ovr = dv + ((b * d.S + s) * d.KV + j) * d.hd;
  for (int64_t c = 0; c < d.hd; ++c) {
    okr[c] = accumulate ? okr[c] + ak[c] : ak[c];
    ovr[c] = accumulate ? ovr[c] + av[c] : av[c];
  }
}

}  // namespace

int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, const int64_t* doc_start, int64_t window, double softcap, bool accumulate,
                       void* stream) {
  Range r("attention_backward_f32");
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0, doc_start, window, float(softcap)};
  if (B * H * T > 0) {
    MT_LAUNCH(attn_rowdot_k, blocks_for(B * H * T, 128), 128, 0, st(stream), scratch, dout, out, d);
    MT_LAUNCH(attn_dq_k, blocks_for(B * H * T, 128), 128, 0, st(stream), dq, scratch, dout, q, k, v, lse, d);
  }
  if (B * KV * S > 0)
    MT_LAUNCH(attn_dkv_k, blocks_for(B * KV * S, 128), 128, 0, st(stream), dk, dv, scratch, dout, q, k, v, lse, d,
              accumulate);
  return last_error();
}

}  // namespace mt::cuda
