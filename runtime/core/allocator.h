// Memory for tensors. Host memory is 64-byte aligned (Eigen and AVX like it).
// Device memory comes from a caching allocator: freed blocks are kept in
// size-rounded bins per device and reused, so a training step in steady state
// never calls cudaMalloc/cudaFree (both synchronise the device).
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/core/device.h"

namespace mt {

struct AllocatorStats {
  size_t allocated_bytes = 0;  // in use by live tensors
  size_t reserved_bytes = 0;   // obtained from the driver, in use or cached
  size_t peak_allocated_bytes = 0;
  // What the live tensors asked for (each rounded to the allocation granule): allocated_bytes less the slack of
  // cached blocks reused for smaller requests (a host block up to twice the request may serve it). The tensors'
  // own high-water mark, which `meshtrain estimate` predicts; the slack is the allocator's.
  size_t requested_bytes = 0;
  size_t peak_requested_bytes = 0;
  uint64_t driver_allocs = 0;  // cudaMalloc calls so far (host: malloc calls)
  uint64_t driver_frees = 0;
};

void* device_alloc(Device d, size_t bytes);
void device_free(Device d, void* p, size_t bytes);
AllocatorStats allocator_stats(Device d);
void reset_peak_allocated(Device d);
// The bytes a tensor of `bytes` takes from the allocator of d (its rounding: 64 B on the host and 512 B on a
// device below 1 MiB, 2 MiB granules above): what `meshtrain estimate` counts each tensor as.
size_t allocation_bytes(Device d, size_t bytes);
// Returns cached device blocks to the driver (after an out-of-memory, or at exit).
void empty_cache(Device d);
// A cap on the host memory this process's tensors may hold (reserved bytes: in use and cached); 0 = none.
// An allocation that would pass it first returns the cached blocks, then fails with an error naming the cap
// (`what`: the setting that set it) and the sizes, instead of the process being killed by the kernel.
void set_host_memory_limit(size_t bytes, const char* what = "the host memory limit");

// Page-locked host memory for staging device buffers through MPI.
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);

}  // namespace mt
