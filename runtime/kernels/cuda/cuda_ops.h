// What the CUDA backend's launchers share (runtime/kernels/cuda/<family>.cu, one file per op family, kernels
// next to their launchers). Each launcher is declared beside the op that calls it
// (runtime/kernels/cpu/<family>.cpp, the baseline pass), over raw device pointers: outputs first, then inputs,
// sizes and the stream (a cudaStream_t passed as void*). Private to runtime/kernels. Compiled by nvcc too: no
// fmt or spdlog in here.
//
// T is the activation and parameter type: float (fp32 runs, TF32 off) or mt::bf16 (mixed precision, computed
// as __nv_bfloat16 with fp32 math). Whatever T is, the mixed-precision policy keeps these in fp32 (float*):
// weight gradients (dweight, dtable), norms' statistics (rstd), losses, the master weights and the optimizer
// state. Every launcher returns a code (0 = success) for the caller to check, and opens an NVTX range named
// after the op.
#pragma once
#include <cstdint>

namespace mt::cuda {

// The launchers' codes: a cudaError_t, or kCublasErrorBase + a cublasStatus_t from the GEMMs.
constexpr int kCublasErrorBase = 100000;
// "CUDA error 700 cudaErrorIllegalAddress: an illegal memory access was encountered", or the cuBLAS status's
// name and text, for a launcher's non-zero code.
const char* error_string(int code);

// How sum_partials_into's kernel (elementwise.cu) adds n f64 partials, one block of kSumPartialsThreads: thread t
// sums partials t, t + kSumPartialsThreads, ... in order; each warp's 32 sums by a butterfly (lane l adds lane
// l ^ o, o = 16 .. 1); thread 0 the warps' in order. The host sums a copy of the same partials this way, so that
// sum_squares (read back) and sum_squares_into (on the device) give the same bits.
constexpr int kSumPartialsThreads = 256;
inline double sum_partials_in_order(const double* p, int64_t n) {
  double lane[kSumPartialsThreads] = {};
  for (int64_t i = 0; i < n; ++i) lane[i % kSumPartialsThreads] += p[i];
  double total = 0;
  for (int w = 0; w < kSumPartialsThreads / 32; ++w) {
    double* v = lane + 32 * w;
    for (int o = 16; o > 0; o >>= 1) {
      double next[32];
      for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ o];
      for (int l = 0; l < 32; ++l) v[l] = next[l];
    }
    total += v[0];
  }
  return total;
}

// GEMM shapes whose cuBLASLt algorithm is cached, on every device so far (matmul.cu; for tests and logs).
int64_t gemm_cached_algos();

}  // namespace mt::cuda
