// The launchers' error codes as text (cuda_ops.h error_string).
#include <cublas_api.h>
#include <cstdio>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

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

}  // namespace mt::cuda
