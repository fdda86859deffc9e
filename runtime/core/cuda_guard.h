// Private to CUDA-built files: makes a device current for a scope and
// restores the previous one (collectives and allocations name their device
// explicitly; the caller's current device must not change under it).
#pragma once
#include <cuda_runtime.h>

#include "runtime/core/error.h"

namespace mt {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MT_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) MT_CUDA_CHECK(cudaSetDevice(device));
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace mt
