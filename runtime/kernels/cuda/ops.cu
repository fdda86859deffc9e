// CUDA kernels of the training step (see cuda_ops.h), templated on the
// activation type T (float or bf16, computed in fp32 registers). Deterministic
// throughout: no floating-point atomics, reductions in a fixed order, so that
// a rerun gives the same bits (exact resume).
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <cub/device/device_radix_sort.cuh>
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "runtime/kernels/cuda/cuda_ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 256;
int blocks_for(int64_t n, int threads = kThreads) { return int((n + threads - 1) / threads); }
cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
int last_error() { return int(cudaGetLastError()); }

}  // namespace

const char* error_string(int code) {
  thread_local char text[256];
  if (code < 0) {
    std::snprintf(text, sizeof(text), "error %d: arguments the kernel does not take", code);
  } else if (code >= kCublasErrorBase) {
    auto s = cublasStatus_t(code - kCublasErrorBase);
    std::snprintf(text, sizeof(text), "cuBLAS status %d %s: %s", int(s), cublasGetStatusName(s),
                  cublasGetStatusString(s));
  } else {
    auto e = cudaError_t(code);
    std::snprintf(text, sizeof(text), "CUDA error %d %s: %s", code, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return text;
}

namespace {

// The device type of a host element type.
template <typename T> struct DevType { using type = T; };
template <> struct DevType<bf16> { using type = __nv_bfloat16; };
template <typename T> using Dev = typename DevType<T>::type;
template <typename T> Dev<T>* dp(T* p) { return reinterpret_cast<Dev<T>*>(p); }
template <typename T> const Dev<T>* dp(const T* p) { return reinterpret_cast<const Dev<T>*>(p); }

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T to(float x);
template <> __device__ __forceinline__ float to<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// An NVTX range over a launcher, so that Nsight Systems shows the op by name.
struct Range {
  explicit Range(const char* name) { nvtxRangePushA(name); }
  ~Range() { nvtxRangePop(); }
};

__device__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ double warp_max_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---------------------------------------------------------------- GEMMs (cuBLASLt)

template <typename T> constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, bf16>) return CUDA_R_16BF;
  else return CUDA_R_32F;
}

// One plan per (device, problem): descriptors, layouts and the heuristic's algorithm, made on first
// use; later calls with the same shape only launch (no heuristic query, no descriptor set-up).
struct GemmKey {
  int device, transa, transb, m, n, k;
  int a_type, d_type, align, accumulate;
  auto tie() const { return std::tie(device, transa, transb, m, n, k, a_type, d_type, align, accumulate); }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
struct LtDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // cuBLASLt's scratch, one per device, allocated once
};
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

std::mutex g_gemm_mu;
std::map<GemmKey, GemmPlan> g_plans;
std::vector<LtDevice> g_lt;

// cuBLAS statuses are returned offset by kCublasErrorBase, so that the caller's message tells them from CUDA
// errors (error_string).
int lt_status(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : kCublasErrorBase + int(s); }

int lt_device(int device, LtDevice** out) {
  if (int(g_lt.size()) <= device) g_lt.resize(size_t(device + 1));
  LtDevice& d = g_lt[size_t(device)];
  if (!d.handle) {
    if (int err = lt_status(cublasLtCreate(&d.handle))) return err;
  }
  if (!d.workspace) {  // retried after a failure: a null workspace must never reach cublasLtMatmul
    if (int err = int(cudaMalloc(&d.workspace, kWorkspaceBytes))) {
      d.workspace = nullptr;
      (void)cudaGetLastError();  // out of memory is not sticky: later launch checks must not read it
      return err;
    }
  }
  *out = &d;
  return 0;
}

int alignment_of(const void* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && u % uintptr_t(a) != 0) a /= 2;
  return a;
}

// Column-major D (m, n) = op(A) (m, k) op(B) (k, n) (+ D if accumulate), fp32 accumulation
// (CUBLAS_COMPUTE_32F: no TF32 for fp32 inputs). A and B have type AT, D has type DT.
template <typename AT, typename DT> int lt_gemm(int device, cudaStream_t stream, bool transa, bool transb, int m, int n,
                                                int k, const AT* A, int lda, const AT* B, int ldb, DT* D, int ldd,
                                                bool accumulate) {
  std::lock_guard<std::mutex> lock(g_gemm_mu);
  LtDevice* dev = nullptr;
  if (int err = lt_device(device, &dev)) return err;
  int align = std::min(alignment_of(A), std::min(alignment_of(B), alignment_of(D)));
  GemmKey key{device, transa, transb, m, n, k, int(cuda_type<AT>()), int(cuda_type<DT>()), align, accumulate};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    GemmPlan p;
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    int err = lt_status(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    // Layouts of the stored matrices: op(A) is (m, k), so A is (k, m) when transposed.
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.a, cuda_type<AT>(), transa ? k : m, transa ? m : k, lda));
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.b, cuda_type<AT>(), transb ? n : k, transb ? k : n, ldb));
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.d, cuda_type<DT>(), m, n, ldd));
    cublasLtMatmulPreference_t pref = nullptr;
    if (!err) err = lt_status(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = kWorkspaceBytes;
    uint32_t al = uint32_t(align);
    if (!err)
      err = lt_status(
          cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (!err) err = lt_status(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (!err)
      err = lt_status(cublasLtMatmulAlgoGetHeuristic(dev->handle, p.op, p.a, p.b, p.d, p.d, pref, 1, &result, &found));
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!err && found == 0) err = lt_status(CUBLAS_STATUS_NOT_SUPPORTED);
    if (err) {
      if (p.op) cublasLtMatmulDescDestroy(p.op);
      for (auto l : {p.a, p.b, p.d})
        if (l) cublasLtMatrixLayoutDestroy(l);
      return err;
    }
    p.algo = result.algo;
    it = g_plans.emplace(key, p).first;
  }
  const GemmPlan& p = it->second;
  float alpha = 1, beta = accumulate ? 1 : 0;
  return lt_status(cublasLtMatmul(dev->handle, p.op, &alpha, A, p.a, B, p.b, &beta, D, p.d, D, p.d, &p.algo,
                                  dev->workspace, kWorkspaceBytes, stream));
}

// ---------------------------------------------------------------- RMSNorm

// A warp per row; the sum of squares in fp32 per lane, then across the warp in double.
template <typename T> __global__ void rmsnorm_fwd_k(T* out, float* rstd, const T* inp, const T* w, int64_t N, int64_t C,
                                                    float eps, T* sum, const T* residual) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  double ss = 0;
  if (residual) {          // fused residual add: sum = inp + residual, rounded as add() rounds; the norm reads it back
    T* s = sum + row * C;  // from the cache (each lane re-reads only what it wrote)
    for (int64_t c = lane; c < C; c += 32) {
      const T v = to<T>(ld(x[c]) + ld(residual[row * C + c]));
      s[c] = v;
      ss += double(ld(v)) * ld(v);
    }
    x = s;
  } else {
    for (int64_t c = lane; c < C; c += 32) ss += double(ld(x[c])) * ld(x[c]);
  }
  ss = warp_sum_d(ss);
  float r = float(1.0 / sqrt(ss / double(C) + double(eps)));
  if (lane == 0) rstd[row] = r;
  // Hugging Face's order: normalise in fp32, round to the activation type, then scale by the weight.
  for (int64_t c = lane; c < C; c += 32) out[row * C + c] = to<T>(ld(to<T>(ld(x[c]) * r)) * ld(w[c]));
}

template <typename T> __global__ void rmsnorm_bwd_dx_k(T* dinp, const T* dout, const T* inp, const T* w,
                                                       const float* rstd, int64_t N, int64_t C, const T* dres) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  double r = rstd[row], dot = 0;
  for (int64_t c = lane; c < C; c += 32) dot += double(ld(dy[c])) * ld(w[c]) * ld(x[c]) * r;
  dot = warp_sum_d(dot);
  double mean = dot / double(C);
  for (int64_t c = lane; c < C; c += 32) {
    double v = r * (double(ld(dy[c])) * ld(w[c]) - double(ld(x[c])) * r * mean);
    if (dres) v += ld(dres[row * C + c]);  // the residual branch's gradient, fused: one rounding
    dinp[row * C + c] = to<T>(float(v));
  }
}

constexpr int64_t kRowChunk = 256;
// scratch[chunk][c] = sum over the chunk's rows of dy * x * rstd, rows in order.
template <typename T> __global__ void rmsnorm_bwd_partial_k(float* scratch, const T* dout, const T* inp,
                                                            const float* rstd, int64_t N, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, chunk = blockIdx.y;
  if (c >= C) return;
  double acc = 0;
  for (int64_t n = chunk * kRowChunk; n < min(N, (chunk + 1) * kRowChunk); ++n)
    acc += double(ld(dout[n * C + c])) * ld(inp[n * C + c]) * rstd[n];
  scratch[chunk * C + c] = float(acc);
}
__global__ void rmsnorm_bwd_sum_k(float* dweight, const float* scratch, int64_t chunks, int64_t C) {
  int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k) acc += scratch[k * C + c];
  dweight[c] += float(acc);
}

// ---------------------------------------------------------------- RoPE, SwiGLU

template <typename T> __global__ void rope_k(T* out, const T* inp, const T* cs, const T* sn, int64_t B, int64_t T_,
                                             int64_t H, int64_t hd, bool backward) {
  int64_t half = hd / 2, n = B * T_ * H * half;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t j = i % half, bth = i / half, t = (bth / H) % T_;
  const T* c = cs + t * hd;
  const T* s = sn + t * hd;
  float x1 = ld(inp[bth * hd + j]), x2 = ld(inp[bth * hd + j + half]);
  if (!backward) {
    out[bth * hd + j] = to<T>(x1 * ld(c[j]) - x2 * ld(s[j]));
    out[bth * hd + j + half] = to<T>(x2 * ld(c[j + half]) + x1 * ld(s[j + half]));
  } else {
    out[bth * hd + j] = to<T>(x1 * ld(c[j]) + x2 * ld(s[j + half]));
    out[bth * hd + j + half] = to<T>(x2 * ld(c[j + half]) - x1 * ld(s[j]));
  }
}

template <typename T> __global__ void swiglu_fwd_k(T* out, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = ld(g[i]);
  out[i] = to<T>(x / (1.0f + expf(-x)) * ld(u[i]));
}
template <typename T> __global__ void swiglu_bwd_k(T* dg, T* du, const T* dy, const T* g, const T* u, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = ld(g[i]), s = 1.0f / (1.0f + expf(-x)), d = ld(dy[i]), up = ld(u[i]);
  du[i] = to<T>(d * x * s);
  dg[i] = to<T>(d * up * s * (1.0f + x * (1.0f - s)));
}

// ---------------------------------------------------------------- Embedding

template <typename T> __global__ void embedding_fwd_k(T* out, const int32_t* tok, const T* table, int64_t N, int64_t V,
                                                      int64_t C, int64_t row_begin) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  int64_t n = i / C, c = i % C, r = int64_t(tok[n]) - row_begin;
  out[i] = (r >= 0 && r < V) ? table[r * C + c] : to<T>(0.0f);
}

__global__ void iota_k(int32_t* idx, const int32_t* tok, int32_t* keys, int64_t N) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) idx[i] = int32_t(i), keys[i] = tok[i];
}
// After a stable sort of (token, position) by token: the block at the first position of each token's
// run sums that token's rows in position order (deterministic), then adds them to its table row.
template <typename T> __global__ void embedding_bwd_k(float* dtable, const T* dout, const int32_t* keys,
                                                      const int32_t* pos, int64_t N, int64_t V, int64_t C,
                                                      int64_t row_begin) {
  int64_t i = blockIdx.x;
  if (i >= N || (i > 0 && keys[i] == keys[i - 1])) return;
  int64_t r = int64_t(keys[i]) - row_begin;
  if (r < 0 || r >= V) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0;
    for (int64_t j = i; j < N && keys[j] == keys[i]; ++j) acc += ld(dout[int64_t(pos[j]) * C + c]);
    dtable[r * C + c] += acc;
  }
}

// Scratch of the embedding backward: sorted keys and positions (4 arrays of N) and CUB's temporary storage.
size_t embedding_sort_temp_bytes(int64_t N) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const int32_t*)nullptr, (int32_t*)nullptr, (const int32_t*)nullptr,
                                  (int32_t*)nullptr, int(N));
  return bytes;
}

// ---------------------------------------------------------------- cross-entropy

// Online max and sum of exponentials of a row, per lane then merged across the warp.
template <typename T> __device__ void row_stats(const T* x, int64_t V, int lane, float* mx_out, double* se_out) {
  float m = -INFINITY;
  double s = 0;
  for (int64_t v = lane; v < V; v += 32) {
    float xv = ld(x[v]);
    if (xv > m) {
      s = s * exp(double(m) - xv) + 1.0;
      m = xv;
    } else {
      s += double(__expf(xv - m));
    }
  }
  float M = warp_max(m);
  s = m == -INFINITY ? 0.0 : s * exp(double(m) - M);
  *mx_out = M;
  *se_out = warp_sum_d(s);
}

// A warp per row: one read for the statistics, one pass writing the gradient over the logits' buffer.
template <typename T> __global__ void cross_entropy_k(float* losses, T* dlogits, const T* logits,
                                                      const int32_t* targets, int64_t N, int64_t V, float scale) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = logits + row * V;
  int32_t t = targets[row];
  if (t < 0) {
    if (lane == 0) losses[row] = 0.0f;
    if (dlogits)
      for (int64_t v = lane; v < V; v += 32) dlogits[row * V + v] = to<T>(0.0f);
    return;
  }
  float mx;
  double se;
  row_stats(x, V, lane, &mx, &se);
  double lse = mx + log(se);
  float xt = ld(x[t]);
  __syncwarp();  // every lane has read x[t] before the gradient overwrites it
  if (lane == 0) losses[row] = float(lse - xt);
  if (dlogits) {
    for (int64_t v = lane; v < V; v += 32) {
      float p = float(exp(double(ld(x[v])) - lse)) * scale;
      dlogits[row * V + v] = to<T>(v == t ? p - scale : p);
    }
  }
}

template <typename T> __global__ void vocab_max_k(double* row_max, const T* logits, int64_t N, int64_t V) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  double m = -INFINITY;
  for (int64_t v = lane; v < V; v += 32) m = fmax(m, double(ld(logits[row * V + v])));
  m = warp_max_d(m);
  if (lane == 0) row_max[row] = m;
}
template <typename T> __global__ void vocab_sumexp_k(double* sumexp, double* target_logit, const T* logits,
                                                     const int32_t* targets, const double* row_max, int64_t N,
                                                     int64_t V, int64_t vocab_begin) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  double m = row_max[row], s = 0;
  for (int64_t v = lane; v < V; v += 32) s += exp(double(ld(logits[row * V + v])) - m);
  s = warp_sum_d(s);
  if (lane == 0) {
    int64_t t = int64_t(targets[row]) - vocab_begin;
    sumexp[row] = s;
    target_logit[row] = (targets[row] >= 0 && t >= 0 && t < V) ? double(ld(logits[row * V + t])) : 0.0;
  }
}
template <typename T> __global__ void vocab_loss_k(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                                                   const double* row_max, const double* sumexp,
                                                   const double* target_logit, int64_t N, int64_t V,
                                                   int64_t vocab_begin, float scale) {
  int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;
  bool ignored = targets[row] < 0;
  double lse = log(sumexp[row]) + row_max[row];
  if (lane == 0) losses[row] = ignored ? 0.0f : float(lse - target_logit[row]);
  if (!dlogits) return;
  int64_t t = int64_t(targets[row]) - vocab_begin;
  for (int64_t v = lane; v < V; v += 32) {
    float p = ignored ? 0.0f : float(exp(double(ld(logits[row * V + v])) - lse)) * scale;
    dlogits[row * V + v] = to<T>(!ignored && v == t ? p - scale : p);
  }
}

// ---------------------------------------------------------------- element-wise, reductions, AdamW

template <typename T> __global__ void add_k(T* out, const T* a, const T* b, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = to<T>(ld(a[i]) + ld(b[i]));
}
template <typename T> __global__ void scale_k(T* t, float s, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) t[i] = to<T>(ld(t[i]) * s);
}
template <typename D, typename S> __global__ void convert_k(D* dst, const S* src, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = to<D>(ld(src[i]));
}

constexpr int64_t kReduceChunk = 4096;
template <typename T> __global__ void reduce_k(double* partials, const T* t, int64_t n, bool squares) {
  __shared__ double warp_part[kThreads / 32];
  int64_t begin = int64_t(blockIdx.x) * kReduceChunk, end = min(n, begin + kReduceChunk);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    double x = ld(t[i]);
    s += squares ? x * x : x;
  }
  s = warp_sum_d(s);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_part[w];
    partials[blockIdx.x] = total;
  }
}

__global__ void adamw_k(float* p, __nv_bfloat16* p_lowp, const float* g, float* m, float* v, int64_t n, float decay,
                        float b1, float b2, float step_size, float bc2_sqrt, float eps) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float pi = p[i] * decay, gi = g[i];
  float mi = m[i] + (1.0f - b1) * (gi - m[i]);
  float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  pi -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  p[i] = pi;
  if (p_lowp) p_lowp[i] = __float2bfloat16_rn(pi);  // the compute copy, written in the same pass
}

// ---------------------------------------------------------------- fp32 reference attention

struct AttnDims {
  int64_t B, T, S, H, KV, hd;
  float scale;
  bool causal;
  int64_t q_pos0, k_pos0;
  const int64_t* doc_start;  // (B, T) global positions where each query's document starts, or null
  // Query t of row b sees keys [first(b, t), visible(t)) (none when first >= visible).
  __device__ int64_t visible(int64_t t) const {
    if (!causal) return S;
    int64_t v = q_pos0 + t - k_pos0 + 1;
    return v < 0 ? 0 : (v > S ? S : v);
  }
  __device__ int64_t first(int64_t b, int64_t t) const {
    if (!doc_start) return 0;
    int64_t v = doc_start[b * T + t] - k_pos0;
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
  for (int64_t s = d.first(b, t), vis = d.visible(t); s < vis; ++s) {
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
    for (int64_t s = d.first(b, t), vis = d.visible(t); s < vis; ++s) {
      const float* kr = k + ((b * d.S + s) * d.KV + j) * d.hd;
      const float* vr = v + ((b * d.S + s) * d.KV + j) * d.hd;
      float sc = 0, dpv = 0;
      for (int64_t c = 0; c < d.hd; ++c) sc += qr[c] * kr[c], dpv += dor[c] * vr[c];
      float p = expf(sc * d.scale - L), ds = p * (dpv - D[i]) * d.scale;
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
      float p = expf(sc * d.scale - L), ds = p * (dpv - D[(b * d.H + h) * d.T + t]) * d.scale;
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

// ================================================================ launchers

template <typename T> int matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC,
                                         bool accumulate, void* stream, int device) {
  Range r("matmul_forward");
  if (N == 0 || OC == 0) return 0;
  if (C == 0) return accumulate ? 0 : int(cudaMemsetAsync(out, 0, size_t(N * OC) * sizeof(T), st(stream)));
  // Row-major out (N, OC) = inp (N, C) W^T is column-major out^T (OC, N) = W (OC, C) . inp^T.
  return lt_gemm(device, st(stream), true, false, int(OC), int(N), int(C), weight, int(C), inp, int(C), out, int(OC),
                 accumulate);
}

template <typename T> int matmul_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight,
                                          int64_t N, int64_t C, int64_t OC, void* stream, int device,
                                          bool accumulate_dinp) {
  Range r("matmul_backward");
  if (dinp && N > 0 && C > 0) {
    int err = 0;
    if (OC == 0) err = accumulate_dinp ? 0 : int(cudaMemsetAsync(dinp, 0, size_t(N * C) * sizeof(T), st(stream)));
    else  // dinp^T (C, N) = W^T (C, OC) . dout^T (OC, N), + dinp^T with beta = 1 when accumulating
      err = lt_gemm(device, st(stream), false, false, int(C), int(N), int(OC), weight, int(C), dout, int(OC), dinp,
                    int(C), accumulate_dinp);
    if (err) return err;
  }
  if (dweight && N > 0 && C > 0 && OC > 0)  // dW^T (C, OC) += inp^T (C, N) . dout (N, OC), in fp32
    return lt_gemm(device, st(stream), false, true, int(C), int(OC), int(N), inp, int(C), dout, int(OC), dweight,
                   int(C), true);
  return 0;
}

int64_t gemm_cached_algos() {
  std::lock_guard<std::mutex> lock(g_gemm_mu);
  return int64_t(g_plans.size());
}

template <typename T> int rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                          double eps, void* stream) {
  Range r("rmsnorm_forward");
  if (N == 0) return 0;
  rmsnorm_fwd_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(dp(out), rstd, dp(inp), dp(weight), N, C, float(eps),
                                                                 dp(static_cast<T*>(nullptr)),
                                                                 dp(static_cast<const T*>(nullptr)));
  return last_error();
}

template <typename T> int add_rmsnorm_forward(T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                                              int64_t N, int64_t C, double eps, void* stream) {
  Range r("add_rmsnorm_forward");
  if (N == 0) return 0;
  rmsnorm_fwd_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(dp(out), rstd, dp(a), dp(weight), N, C, float(eps),
                                                                 dp(sum), dp(b));
  return last_error();
}

int64_t rmsnorm_backward_scratch(int64_t N, int64_t C) { return ((N + kRowChunk - 1) / kRowChunk) * C; }

template <typename T> int rmsnorm_backward(T* dinp, float* dweight, float* scratch, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int64_t N, int64_t C, void* stream,
                                           const T* dresidual) {
  Range r("rmsnorm_backward");
  if (N == 0 || C == 0) return 0;
  rmsnorm_bwd_dx_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(dp(dinp), dp(dout), dp(inp), dp(weight), rstd, N, C,
                                                                    dp(dresidual));
  int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  rmsnorm_bwd_partial_k<<<dim3(unsigned(blocks_for(C)), unsigned(chunks)), kThreads, 0, st(stream)>>>(
      scratch, dp(dout), dp(inp), rstd, N, C);
  rmsnorm_bwd_sum_k<<<blocks_for(C), kThreads, 0, st(stream)>>>(dweight, scratch, chunks, C);
  return last_error();
}

template <typename T> int rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_,
                                       int64_t H, int64_t hd, bool backward, void* stream) {
  Range r(backward ? "rope_backward" : "rope_forward");
  int64_t n = B * T_ * H * (hd / 2);
  if (n == 0) return 0;
  rope_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dp(out), dp(inp), dp(cos), dp(sin), B, T_, H, hd, backward);
  return last_error();
}

template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_forward");
  if (n == 0) return 0;
  swiglu_fwd_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dp(out), dp(gate), dp(up), n);
  return last_error();
}
template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream) {
  Range r("swiglu_backward");
  if (n == 0) return 0;
  swiglu_bwd_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dp(dgate), dp(dup), dp(dout), dp(gate), dp(up), n);
  return last_error();
}

template <typename T> int embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                            int64_t C, int64_t row_begin, void* stream) {
  Range r("embedding_forward");
  if (N * C == 0) return 0;
  embedding_fwd_k<<<blocks_for(N * C), kThreads, 0, st(stream)>>>(dp(out), tokens, dp(table), N, V_local, C, row_begin);
  return last_error();
}

int64_t embedding_backward_scratch_bytes(int64_t N) {
  return int64_t(4 * size_t(N) * sizeof(int32_t) + embedding_sort_temp_bytes(N) + 256);
}

template <typename T> int embedding_backward(float* dtable, void* scratch, const T* dout, const int32_t* tokens,
                                             int64_t N, int64_t V_local, int64_t C, int64_t row_begin, void* stream) {
  Range r("embedding_backward");
  if (N * C == 0) return 0;
  auto* keys_in = static_cast<int32_t*>(scratch);  // (N) tokens
  int32_t* pos_in = keys_in + N;                   // (N) positions 0..N-1
  int32_t* keys = pos_in + N;                      // (N) tokens, sorted
  int32_t* pos = keys + N;                         // (N) positions, grouped by token, ascending within a token
  // CUB's temporary storage, 256-byte aligned (the scratch size has the slack).
  void* temp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(pos + N) + 255) & ~uintptr_t(255));
  size_t temp_bytes = embedding_sort_temp_bytes(N);
  iota_k<<<blocks_for(N), kThreads, 0, st(stream)>>>(pos_in, tokens, keys_in, N);
  // Radix sort is stable: positions stay ascending within each token's run.
  if (int err =
          int(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys, pos_in, pos, int(N), 0, 32, st(stream))))
    return err;
  embedding_bwd_k<<<unsigned(N), 128, 0, st(stream)>>>(dtable, dp(dout), keys, pos, N, V_local, C, row_begin);
  return last_error();
}

template <typename T> int cross_entropy(float* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                        int64_t V, double grad_scale, void* stream) {
  Range r("cross_entropy");
  if (N == 0) return 0;
  cross_entropy_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(losses, dp(dlogits), dp(logits), targets, N, V,
                                                                   float(grad_scale));
  return last_error();
}

template <typename T> int vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V, void* stream) {
  Range r("vocab_shard_max");
  if (N == 0) return 0;
  vocab_max_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(row_max, dp(logits), N, V);
  return last_error();
}
template <typename T> int vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                             const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                             int64_t vocab_begin, void* stream) {
  Range r("vocab_shard_sumexp");
  if (N == 0) return 0;
  vocab_sumexp_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(sumexp, target_logit, dp(logits), targets, row_max, N,
                                                                  V, vocab_begin);
  return last_error();
}
template <typename T> int vocab_shard_loss(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                                           const double* row_max, const double* sumexp, const double* target_logit,
                                           int64_t N, int64_t V, int64_t vocab_begin, double grad_scale, void* stream) {
  Range r("vocab_shard_loss");
  if (N == 0) return 0;
  vocab_loss_k<<<blocks_for(N * 32), kThreads, 0, st(stream)>>>(
      losses, dp(dlogits), dp(logits), targets, row_max, sumexp, target_logit, N, V, vocab_begin, float(grad_scale));
  return last_error();
}

template <typename T> int add(T* out, const T* a, const T* b, int64_t n, void* stream) {
  Range r("add");
  if (n == 0) return 0;
  add_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dp(out), dp(a), dp(b), n);
  return last_error();
}
template <typename T> int scale(T* t, double s, int64_t n, void* stream) {
  Range r("scale");
  if (n == 0) return 0;
  scale_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(dp(t), float(s), n);
  return last_error();
}

int convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, void* stream) {
  Range r("convert");
  if (n == 0) return 0;
  if (dst_type == DType::bf16 && src_type == DType::f32)
    convert_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(static_cast<__nv_bfloat16*>(dst),
                                                          static_cast<const float*>(src), n);
  else if (dst_type == DType::f32 && src_type == DType::bf16)
    convert_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(static_cast<float*>(dst),
                                                          static_cast<const __nv_bfloat16*>(src), n);
  else if (dst_type == src_type)
    return int(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(dst_type), cudaMemcpyDeviceToDevice, st(stream)));
  else return int(cudaErrorInvalidValue);
  return last_error();
}

int64_t reduce_partials_count(int64_t n) { return (n + kReduceChunk - 1) / kReduceChunk; }
template <typename T> int reduce_sum(double* partials, const T* t, int64_t n, bool squares, void* stream) {
  Range r(squares ? "sum_squares" : "sum");
  int64_t blocks = reduce_partials_count(n);
  if (blocks == 0) return 0;
  reduce_k<<<unsigned(blocks), kThreads, 0, st(stream)>>>(partials, dp(t), n, squares);
  return last_error();
}

int adamw(float* param, bf16* param_lowp, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
          double beta2, double eps, double weight_decay, int64_t step, void* stream) {
  Range r("adamw");
  if (n == 0) return 0;
  float step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  float bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  adamw_k<<<blocks_for(n), kThreads, 0, st(stream)>>>(param, dp(param_lowp), grad, m, v, n,
                                                      float(1.0 - lr * weight_decay), float(beta1), float(beta2),
                                                      step_size, bc2_sqrt, float(eps));
  return last_error();
}

int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, const int64_t* doc_start, void* stream) {
  Range r("attention_forward_f32");
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0, doc_start};
  if (B * H * T == 0) return 0;
  attn_fwd_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(out, lse, q, k, v, d);
  return last_error();
}

int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, const int64_t* doc_start, bool accumulate, void* stream) {
  Range r("attention_backward_f32");
  if (hd > kMaxHeadDim) return int(cudaErrorInvalidValue);
  AttnDims d{B, T, S, H, KV, hd, float(scale), causal, q_pos0, k_pos0, doc_start};
  if (B * H * T > 0) {
    attn_rowdot_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(scratch, dout, out, d);
    attn_dq_k<<<blocks_for(B * H * T, 128), 128, 0, st(stream)>>>(dq, scratch, dout, q, k, v, lse, d);
  }
  if (B * KV * S > 0)
    attn_dkv_k<<<blocks_for(B * KV * S, 128), 128, 0, st(stream)>>>(dk, dv, scratch, dout, q, k, v, lse, d, accumulate);
  return last_error();
}

int copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, void* stream) {
  Range r("copy_2d");
  if (width == 0 || rows == 0) return 0;
  // One contiguous range (a slice along dim 0, or whole rows): a plain copy. cudaMemcpy2DAsync refuses pitches
  // above the device's maximum (2^31 - 1 bytes), which a slice of a tensor of 2 GiB or more has.
  if (rows == 1 || (width == dpitch && width == spitch))
    return int(cudaMemcpyAsync(dst, src, width * rows, cudaMemcpyDeviceToDevice, st(stream)));
  constexpr size_t kMaxPitch = size_t(INT_MAX);
  if (dpitch > kMaxPitch || spitch > kMaxPitch) {  // few rows then (each is over 2 GiB): one copy per row
    for (size_t row = 0; row < rows; ++row)
      if (int err =
              int(cudaMemcpyAsync(static_cast<char*>(dst) + row * dpitch, static_cast<const char*>(src) + row * spitch,
                                  width, cudaMemcpyDeviceToDevice, st(stream))))
        return err;
    return 0;
  }
  return int(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, st(stream)));
}

// One thread per (b, t, h) row: the weights of the two sides, then the row's hd values.
template <typename T> __global__ void attention_merge_k(float* out, float* lse, const T* part_out,
                                                        const float* part_lse, int64_t B, int64_t T_, int64_t H,
                                                        int64_t hd) {
  int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (b, t, h) in out's order
  if (row >= B * T_ * H) return;
  int64_t h = row % H, t = (row / H) % T_, b = row / (H * T_);
  int64_t li = (b * H + h) * T_ + t;
  float a = lse[li], p = part_lse[li];
  if (p == -INFINITY) return;
  float* o = out + row * hd;
  const T* po = part_out + row * hd;
  if (a == -INFINITY) {
    for (int64_t i = 0; i < hd; ++i) o[i] = ld(po[i]);
    lse[li] = p;
    return;
  }
  float m = fmaxf(a, p), merged = m + logf(expf(a - m) + expf(p - m));
  float wa = expf(a - merged), wp = expf(p - merged);
  for (int64_t i = 0; i < hd; ++i) o[i] = wa * o[i] + wp * ld(po[i]);
  lse[li] = merged;
}
template <typename T> int attention_merge(float* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                                          int64_t T_, int64_t H, int64_t hd, void* stream) {
  Range r("attention_merge");
  if (B * T_ * H == 0) return 0;
  attention_merge_k<<<blocks_for(B * T_ * H, 128), 128, 0, st(stream)>>>(out, lse, dp(part_out), part_lse, B, T_, H,
                                                                         hd);
  return last_error();
}

// Block j of the pack: blockIdx.y; its rows of len * inner units copied by a grid-stride loop over x.
constexpr int kMaxPackBlocks = 64;
struct PackBlocks {
  int64_t begin[kMaxPackBlocks + 1];  // along D, relative to the tensor's row
  int n;
};
template <typename U>
__global__ void pack_blocks_k(U* packed, U* t, int64_t D, int64_t inner, int64_t outer, PackBlocks b, bool unpack) {
  const int j = int(blockIdx.y);
  const int64_t len = b.begin[j + 1] - b.begin[j], width = len * inner, count = outer * width;
  U* block = packed + outer * inner * b.begin[j];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    U* x = t + r * D * inner + b.begin[j] * inner + c;
    if (unpack) *x = block[i];
    else block[i] = *x;
  }
}
template <typename U> int launch_pack(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes,
                                      const int64_t* begin, int n, bool unpack, void* stream) {
  const int64_t inner = int64_t(inner_bytes / sizeof(U));
  for (int j0 = 0; j0 < n; j0 += kMaxPackBlocks) {
    PackBlocks b{};
    b.n = std::min(kMaxPackBlocks, n - j0);
    int64_t widest = 0;
    for (int j = 0; j <= b.n; ++j) b.begin[j] = begin[j0 + j];
    for (int j = 0; j < b.n; ++j) widest = std::max(widest, outer * (b.begin[j + 1] - b.begin[j]) * inner);
    if (widest == 0) continue;
    const unsigned gx = unsigned(std::min<int64_t>(blocks_for(widest), 1024));
    pack_blocks_k<U><<<dim3(gx, unsigned(b.n)), kThreads, 0, st(stream)>>>(static_cast<U*>(packed), static_cast<U*>(t),
                                                                           D, inner, outer, b, unpack);
  }
  return last_error();
}

int pack_blocks(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes, const int64_t* begin, int n,
                bool unpack, void* stream) {
  Range r(unpack ? "unpack_blocks" : "pack_blocks");
  if (outer * D == 0 || inner_bytes == 0 || n == 0) return 0;
  // The widest unit that divides the rows and the two base addresses.
  const uintptr_t a = reinterpret_cast<uintptr_t>(packed) | reinterpret_cast<uintptr_t>(t) | uintptr_t(inner_bytes);
  if (a % 16 == 0) return launch_pack<uint4>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 8 == 0) return launch_pack<uint2>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 4 == 0) return launch_pack<uint32_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  if (a % 2 == 0) return launch_pack<uint16_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
  return launch_pack<uint8_t>(packed, t, outer, D, inner_bytes, begin, n, unpack, stream);
}

__global__ void sum_partials_into_k(double* out, const double* partials, int64_t n) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += partials[i];
  out[0] += total;
}
int sum_partials_into(double* out, const double* partials, int64_t n, void* stream) {
  Range r("sum_partials_into");
  sum_partials_into_k<<<1, 1, 0, st(stream)>>>(out, partials, n);
  return last_error();
}

// Explicit instantiations for the two activation types.
#define MT_INSTANTIATE(T)                                                                                             \
  template int matmul_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool, void*, int);                \
  template int matmul_backward<T>(T*, float*, const T*, const T*, const T*, int64_t, int64_t, int64_t, void*, int,    \
                                  bool);                                                                              \
  template int rmsnorm_forward<T>(T*, float*, const T*, const T*, int64_t, int64_t, double, void*);                   \
  template int add_rmsnorm_forward<T>(T*, T*, float*, const T*, const T*, const T*, int64_t, int64_t, double, void*); \
  template int rmsnorm_backward<T>(T*, float*, float*, const T*, const T*, const T*, const float*, int64_t, int64_t,  \
                                   void*, const T*);                                                                  \
  template int rope_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, bool, void*);    \
  template int swiglu_forward<T>(T*, const T*, const T*, int64_t, void*);                                             \
  template int swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, void*);                              \
  template int embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t, int64_t, void*);         \
  template int embedding_backward<T>(float*, void*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,     \
                                     void*);                                                                          \
  template int cross_entropy<T>(float*, T*, const T*, const int32_t*, int64_t, int64_t, double, void*);               \
  template int vocab_shard_max<T>(double*, const T*, int64_t, int64_t, void*);                                        \
  template int vocab_shard_sumexp<T>(double*, double*, const T*, const int32_t*, const double*, int64_t, int64_t,     \
                                     int64_t, void*);                                                                 \
  template int vocab_shard_loss<T>(float*, T*, const T*, const int32_t*, const double*, const double*, const double*, \
                                   int64_t, int64_t, int64_t, double, void*);                                         \
  template int add<T>(T*, const T*, const T*, int64_t, void*);                                                        \
  template int scale<T>(T*, double, int64_t, void*);                                                                  \
  template int reduce_sum<T>(double*, const T*, int64_t, bool, void*);                                                \
  template int attention_merge<T>(float*, float*, const T*, const float*, int64_t, int64_t, int64_t, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
