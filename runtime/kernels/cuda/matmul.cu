// GEMMs on cuBLASLt (ops.h matmul_forward / matmul_backward; declared in runtime/kernels/cpu/matmul.cpp):
// fp32 accumulation (CUBLAS_COMPUTE_32F: no TF32 for fp32 inputs); one plan per shape, made on first use.
#include <cublasLt.h>
#include <cublas_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

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

// A plan's algorithm: the heuristic's first for its descriptors, the workspace and the operands' alignment; err (a
// failure while the caller made the descriptors) or a failure here destroys the descriptors and is returned.
int choose_algo(LtDevice* dev, GemmPlan& p, int align, int err) {
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
    if ((err = choose_algo(dev, p, align, err))) return err;
    it = g_plans.emplace(key, p).first;
  }
  const GemmPlan& p = it->second;
  float alpha = 1, beta = accumulate ? 1 : 0;
  return lt_status(cublasLtMatmul(dev->handle, p.op, &alpha, A, p.a, B, p.b, &beta, D, p.d, D, p.d, &p.algo,
                                  dev->workspace, kWorkspaceBytes, stream));
}

}  // namespace

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

// FP8 (ops.h fp8_matmul): row-major out (M, N) = a (M, K) . b (N, K)^T is column-major out^T (N, M) = b . a^T, i.e.
// cuBLASLt's A = b transposed, B = a not: TN, the only FP8 layout Hopper takes, both with K contiguous. The
// inverse scales go in as A's and B's scale pointers (device memory: no host read), one f32 each, or vectors
// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: A's N, B's M). D is bf16 (C = D) or f32 (weight gradients, beta = 1).
// The plan is cached per shape like lt_gemm's; the scale pointers are set on the cached descriptor each call.
namespace {
struct Fp8Key {
  int device, m, n, k, a_type, b_type, d_type, vec, accumulate, align;
  auto tie() const { return std::tie(device, m, n, k, a_type, b_type, d_type, vec, accumulate, align); }
  bool operator<(const Fp8Key& o) const { return tie() < o.tie(); }
};
std::map<Fp8Key, GemmPlan> g_fp8_plans;
cudaDataType_t fp8_type(int fmt) { return fmt == 0 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
}  // namespace

int fp8_matmul(void* out, bool out_f32, const uint8_t* a, const float* a_inv, const uint8_t* b, const float* b_inv,
               int64_t M, int64_t N, int64_t K, int a_fmt, int b_fmt, bool vec_scales, bool accumulate, void* stream,
               int device) {
  Range r("fp8_matmul");
  if (M == 0 || N == 0) return 0;
  if (K == 0)
    return accumulate ? 0 : int(cudaMemsetAsync(out, 0, size_t(M * N) * (out_f32 ? 4 : 2), st(stream)));
  std::lock_guard<std::mutex> lock(g_gemm_mu);
  LtDevice* dev = nullptr;
  if (int err = lt_device(device, &dev)) return err;
  const int m = int(N), n = int(M), k = int(K);
  const cudaDataType_t at = fp8_type(b_fmt), bt = fp8_type(a_fmt), dt = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
  const int align = std::min(alignment_of(a), std::min(alignment_of(b), alignment_of(out)));
  Fp8Key key{device, m, n, k, int(at), int(bt), int(dt), vec_scales, accumulate, align};
  auto it = g_fp8_plans.find(key);
  if (it == g_fp8_plans.end()) {
    GemmPlan p;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    int err = lt_status(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (vec_scales) {
      int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      for (auto attr : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
        if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, attr, &mode, sizeof(mode)));
    }
    // The heuristic sees the scale pointers set (values are read only at the launch).
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_inv,
                                                             sizeof(b_inv)));
    if (!err) err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_inv,
                                                             sizeof(a_inv)));
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.a, at, k, m, k));  // b (N, K) row-major: (K, N) col-major
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.b, bt, k, n, k));  // a (M, K) row-major: (K, M)
    if (!err) err = lt_status(cublasLtMatrixLayoutCreate(&p.d, dt, m, n, m));
    if ((err = choose_algo(dev, p, align, err))) return err;
    it = g_fp8_plans.emplace(key, p).first;
  }
  const GemmPlan& p = it->second;
  int err = lt_status(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_inv, sizeof(b_inv)));
  if (!err)
    err = lt_status(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_inv, sizeof(a_inv)));
  if (err) return err;
  float alpha = 1, beta = accumulate ? 1 : 0;
  return lt_status(cublasLtMatmul(dev->handle, p.op, &alpha, b, p.a, a, p.b, &beta, out, p.d, out, p.d, &p.algo,
                                  dev->workspace, kWorkspaceBytes, st(stream)));
}

int64_t gemm_cached_algos() {
  std::lock_guard<std::mutex> lock(g_gemm_mu);
  return int64_t(g_plans.size() + g_fp8_plans.size());
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                                                          \
  template int matmul_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool, void*, int);             \
  template int matmul_backward<T>(T*, float*, const T*, const T*, const T*, int64_t, int64_t, int64_t, void*, int, \
                                  bool);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
