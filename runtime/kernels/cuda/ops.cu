// fp32 CUDA kernels of the training step (see cuda_ops.h). Simple and
// deterministic first: no atomics, reductions in a fixed order; the fused,
// bf16, tensor-core versions replace them one by one (issue 6).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "runtime/kernels/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 256;
int blocks_for(int64_t n, int threads = kThreads) { return int((n + threads - 1) / threads); }
cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
int last_error() { return int(cudaGetLastError()); }

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One cuBLAS handle per device, made on first use.
cublasHandle_t cublas_handle(int device, int* err) {
  static std::mutex mu;
  static std::vector<cublasHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  if (int(handles.size()) <= device) handles.resize(size_t(device + 1), nullptr);
  if (!handles[size_t(device)]) {
    *err = int(cublasCreate(&handles[size_t(device)]));
    // fp32 stays fp32: no TF32 tensor-op math (cuBLAS's default math mode).
    if (!*err) *err = int(cublasSetMathMode(handles[size_t(device)], CUBLAS_DEFAULT_MATH));
  }
  return handles[size_t(device)];
}

// ---- kernels ----

__global__ void rmsnorm_fwd_k(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C, float eps) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + row * C;
  double ss = 0;
  for (int64_t c = lane; c < C; c += 32) ss += double(x[c]) * x[c];
  ss = warp_sum_d(ss);
  float r = float(1.0 / sqrt(ss / double(C) + double(eps)));
  if (lane == 0) rstd[row] = r;
  for (int64_t c = lane; c < C; c += 32) out[row * C + c] = x[c] * r * w[c];
}

__global__ void rmsnorm_bwd_dx_k(float* dinp, const float* dout, const float* inp, const float* w, const float* rstd,
                                 int64_t N, int64_t C) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  double r = rstd[row], dot = 0;
  for (int64_t c = lane; c < C; c += 32) dot += double(dy[c]) * w[c] * x[c] * r;
  dot = warp_sum_d(dot);
  double mean = dot / double(C);
  for (int64_t c = lane; c < C; c += 32) dinp[row * C + c] = float(r * (double(dy[c]) * w[c] - double(x[c]) * r * mean));
}

constexpr int64_t kRowChunk = 256;
// scratch[chunk][c] = sum over the chunk's rows of dy * x * rstd, rows in order.
__global__ void rmsnorm_bwd_partial_k(float* scratch, const float* dout, const float* inp, const float* rstd, int64_t N,
                                      int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, chunk = blockIdx.y;
  if (c >= C) return;
  double acc = 0;
  for (int64_t n = chunk * kRowChunk; n < min(N, (chunk + 1) * kRowChunk); ++n)
    acc += double(dout[n * C + c]) * inp[n * C + c] * rstd[n];
  scratch[chunk * C + c] = float(acc);
}
__global__ void rmsnorm_bwd_sum_k(float* dweight, const float* scratch, int64_t chunks, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k) acc += scratch[k * C + c];
  dweight[c] += float(acc);
}

__global__ void rope_k(float* out, const float* inp, const float* cs, const float* sn, int64_t B, int64_t T, int64_t H,
                       int64_t hd, bool backward) {
  int64_t half = hd / 2, n = B * T * H * half;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t j = i % half, bth = i / half, t = (bth / H) % T;
  const float* c = cs + t * hd;
  const float* s = sn + t * hd;
  float x1 = inp[bth * hd + j], x2 = inp[bth * hd + j + half];
  if (!backward) {
    out[bth * hd + j] = x1 * c[j] - x2 * s[j];
    out[bth * hd + j + half] = x2 * c[j + half] + x1 * s[j + half];
  } else {
    out[bth * hd + j] = x1 * c[j] + x2 * s[j + half];
    out[bth * hd + j + half] = x2 * c[j + half] - x1 * s[j];
  }
}

__global__ void swiglu_fwd_k(float* out, const float* g, const float* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
__global__ void swiglu_bwd_k(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = g[i], s = 1.0f / (1.0f + expf(-x)), d = dy[i], up = u[i];
  du[i] = d * x * s;
  dg[i] = d * up * s * (1.0f + x * (1.0f - s));
}

__global__ void embedding_fwd_k(float* out, const int32_t* tok, const float* table, int64_t N, int64_t V, int64_t C,
                                int64_t row_begin) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  int64_t n = i / C, c = i % C, r = int64_t(tok[n]) - row_begin;
  out[i] = (r >= 0 && r < V) ? table[r * C + c] : 0.0f;
}
// One thread per column, tokens in order: deterministic, no atomics.
__global__ void embedding_bwd_k(float* dtable, const float* dout, const int32_t* tok, int64_t N, int64_t V, int64_t C,
                                int64_t row_begin) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    int64_t r = int64_t(tok[n]) - row_begin;
    if (r >= 0 && r < V) dtable[r * C + c] += dout[n * C + c];
  }
}

// A warp per row: max, sum of exponentials, loss, gradient written over the logits' buffer if asked.
__global__ void cross_entropy_k(float* losses, float* dlogits, const float* logits, const int32_t* targets, int64_t N,
                                int64_t V, float scale) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = logits + row * V;
  int32_t t = targets[row];
  if (t < 0) {
    if (lane == 0) losses[row] = 0.0f;
    if (dlogits)
      for (int64_t v = lane; v < V; v += 32) dlogits[row * V + v] = 0.0f;
    return;
  }
  float mx = -INFINITY;
  for (int64_t v = lane; v < V; v += 32) mx = fmaxf(mx, x[v]);
  mx = warp_max(mx);
  double se = 0;
  for (int64_t v = lane; v < V; v += 32) se += exp(double(x[v]) - mx);
  se = warp_sum_d(se);
  double lse = mx + log(se);
  float xt = x[t];
  __syncwarp();
  if (lane == 0) losses[row] = float(lse - xt);
  if (dlogits) {
    for (int64_t v = lane; v < V; v += 32) {
      float p = float(exp(double(x[v]) - lse) * scale);
      dlogits[row * V + v] = v == t ? p - scale : p;
    }
  }
}

__global__ void add_k(float* out, const float* a, const float* b, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
__global__ void scale_k(float* t, float s, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) t[i] *= s;
}

constexpr int64_t kReduceChunk = 4096;
__global__ void reduce_k(double* partials, const float* t, int64_t n, bool squares) {
  __shared__ double warp_part[kThreads / 32];
  int64_t begin = int64_t(blockIdx.x) * kReduceChunk, end = min(n, begin + kReduceChunk);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += squares ? double(t[i]) * t[i] : double(t[i]);
  s = warp_sum_d(s);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_part[w];
    partials[blockIdx.x] = total;
  }
}

__global__ void adamw_k(float* p, const float* g, float* m, float* v, int64_t n, float decay, float b1, float b2,
                        float step_size, float bc2_sqrt, float eps) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float pi = p[i] * decay, gi = g[i];
  float mi = m[i] + (1.0f - b1) * (gi - m[i]);
  float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
}

struct AttnDims {
  int64_t B, T, S, H, KV, hd;
  float scale;
  bool causal;
  int64_t q_pos0, k_pos0;
  __device__ int64_t visible(int64_t t) const {
    if (!causal) return S;
    int64_t v = q_pos0 + t - k_pos0 + 1;
    return v < 0 ? 0 : (v > S ? S : v);
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
  for (int64_t s = 0, vis = d.visible(t); s < vis; ++s) {
    const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
    float sc = 0;
    for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c];
    sc *= d.scale;
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
    for (int64_t s = 0, vis = d.visible(t); s < vis; ++s) {
      const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
      const float* vr = v + ((b * d.S + s) * d.KV + j) * d.hd;
      float sc = 0, dp = 0;
      for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c], dp += dor[c] * vr[c];
      float p = expf(sc * d.scale - L), ds = p * (dp - D[i]) * d.scale;
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
      if (s >= d.visible(t)) continue;
      float L = lse[(b * d.H + h) * d.T + t];
      if (L == -INFINITY) continue;
      const float* qr = q + ((b * d.T + t) * d.H + h) * d.hd;
      const float* dor = dout + ((b * d.T + t) * d.H + h) * d.hd;
      float sc = 0, dp = 0;
      for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c], dp += dor[c] * vr[c];
      float p = expf(sc * d.scale - L), ds = p * (dp - D[(b * d.H + h) * d.T + t]) * d.scale;
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

int matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC, bool accumulate,
                   void* stream, int device) {
  if (N == 0 || OC == 0) return 0;
  int err = 0;
  cublasHandle_t h = cublas_handle(device, &err);
  if (err) return err;
  if ((err = int(cublasSetStream(h, st(stream))))) return err;
  float alpha = 1, beta = accumulate ? 1 : 0;
  if (C == 0) return accumulate ? 0 : int(cudaMemsetAsync(out, 0, size_t(N * OC) * 4, st(stream)));
  // Row-major out (N, OC) = inp (N, C) W^T is column-major out^T (OC, N) = W (OC, C) . inp^T.
  return int(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, int(OC), int(N), int(C), &alpha, weight, int(C), inp, int(C),
                         &beta, out, int(OC)));
}

int matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int64_t N,
                    int64_t C, int64_t OC, void* stream, int device) {
  int err = 0;
  cublasHandle_t h = cublas_handle(device, &err);
  if (err) return err;
  if ((err = int(cublasSetStream(h, st(stream))))) return err;
  float one = 1, zero = 0;
  if (dinp && N > 0 && C > 0) {
    if (OC == 0) err = int(cudaMemsetAsync(dinp, 0, size_t(N * C) * 4, st(stream)));
    else  // dinp (N, C) = dout (N, OC) W (OC, C)
      err = int(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, int(C), int(N), int(OC), &one, weight, int(C), dout, int(OC),
                            &zero, dinp, int(C)));
    if (err) return err;
  }
  if (dweight && N > 0 && C > 0 && OC > 0)  // dW (OC, C) += dout^T (OC, N) inp (N, C)
    err = int(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, int(C), int(OC), int(N), &one, inp, int(C), dout, int(OC), &one,
                          dweight, int(C)));
  return err;
}

int rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, double eps,
                    void* stream) {
  if (N == 0) return 0;
  rmsnorm_fwd_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(out, rstd, inp, weight, N, C, float(eps));
  return last_error();
}

int64_t rmsnorm_backward_scratch(int64_t N, int64_t C) { return ((N + kRowChunk - 1) / kRowChunk) * C; }

int rmsnorm_backward(float* dinp, float* dweight, float* scratch, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t N, int64_t C, void* stream) {
  if (N == 0 || C == 0) return 0;
  rmsnorm_bwd_dx_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(dinp, dout, inp, weight, rstd, N, C);
  int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  rmsnorm_bwd_partial_k<<<dim3(unsigned(blocks_for(C)), unsigned(chunks)), kThreads, 0, st(stream)>>>(scratch, dout, inp,
                                                                                                    rstd, N, C);
  rmsnorm_bwd_sum_k<<<blocks_for(C), kThreads, 0, st(stream)>>>(dweight, scratch, chunks, C);
  return last_error();
}

int rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H,
                 int64_t hd, bool backward, void* stream) {
  int64_t n = B * T * H * (hd / 2);
  if (n == 0) return 0;
  rope_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(out, inp, cos, sin, B, T, H, hd, backward);
  return last_error();
}

int swiglu_forward(float* out, const float* gate, const float* up, int64_t n, void* stream) {
  if (n == 0) return 0;
  swiglu_fwd_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(out, gate, up, n);
  return last_error();
}
int swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n,
                    void* stream) {
  if (n == 0) return 0;
  swiglu_bwd_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dgate, dup, dout, gate, up, n);
  return last_error();
}

int embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t V_local, int64_t C,
                      int64_t row_begin, void* stream) {
  if (N * C == 0) return 0;
  embedding_fwd_k<<<blocks_for(N * C), kThreads, 0, st(stream)>>>(out, tokens, table, N, V_local, C, row_begin);
  return last_error();
}
int embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N, int64_t V_local, int64_t C,
                       int64_t row_begin, void* stream) {
  if (N * C == 0) return 0;
  embedding_bwd_k<<<blocks_for(C, 64), 64, 0, st(stream)>>>(dtable, dout, tokens, N, V_local, C, row_begin);
  return last_error();
}

int cross_entropy(float* losses, float* dlogits, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                  double grad_scale, void* stream) {
  if (N == 0) return 0;
  cross_entropy_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(losses, dlogits, logits, targets, N, V,
                                                                    float(grad_scale));
  return last_error();
}

int add(float* out, const float* a, const float* b, int64_t n, void* stream) {
  if (n == 0) return 0;
  add_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(out, a, b, n);
  return last_error();
}
int scale(float* t, double s, int64_t n, void* stream) {
  if (n == 0) return 0;
  scale_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(t, float(s), n);
  return last_error();
}

int64_t reduce_partials_count(int64_t n) { return (n + kReduceChunk - 1) / kReduceChunk; }
int reduce_sum(double* partials, const float* t, int64_t n, bool squares, void* stream) {
  int64_t blocks = reduce_partials_count(n);
  if (blocks == 0) return 0;
  reduce_k<<<unsigned(blocks), kThreads, 0, st(stream)>>>(partials, t, n, squares);
  return last_error();
}

int adamw(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
          double eps, double weight_decay, int64_t step, void* stream) {
  if (n == 0) return 0;
  float step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  float bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  adamw_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(param, grad, m, v, n, float(1.0 - lr * weight_decay), float(beta1),
                                                      float(beta2), step_size, bc2_sqrt, float(eps));
  return last_error();
}

int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, void* stream) {
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0};
  if (B * H * T == 0) return 0;
  attn_fwd_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(out, lse, q, k, v, d);
  return last_error();
}

int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, bool accumulate, void* stream) {
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0};
  if (B * H * T > 0) {
    attn_rowdot_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(scratch, dout, out, d);
    attn_dq_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(dq, scratch, dout, q, k, v, lse, d);
  }
  if (B * KV * S > 0)
    attn_dkv_k<<<blocks_for(B * KV * S, 128), 128, 0, st(stream)>>>(dk, dv, scratch, dout, q, k, v, lse, d, accumulate);
  return last_error();
}

}  // namespace mt::cuda
