// Private to runtime/core and comm: the few CUDA runtime calls that the
// device-independent code needs, so that only CUDA-built files include
// cuda_runtime.h. Implemented in cuda_runtime.cpp (throwing stubs in
// cuda_stub.cpp when CUDA is not built).
#pragma once
#include <cstddef>
#include <string>

#include "runtime/core/allocator.h"

namespace mt::cuda {
void* raw_malloc(int device, size_t bytes);
void raw_free(int device, void* p);
// kind: 0 host to device, 1 device to host, 2 device to device; on current_stream(device).
void memcpy_async(void* dst, const void* src, size_t bytes, int kind, int device);
void memset_zero_async(void* p, size_t bytes, int device);
void stream_sync_current(int device);
void* pinned_malloc(size_t bytes);
void pinned_free(void* p);
// The device's PCI bus id ("0000:3b:00.0"): the same GPU has the same id in every process of a node, whatever
// each process's CUDA_VISIBLE_DEVICES.
std::string pci_bus_id(int device);
}  // namespace mt::cuda

namespace mt::detail {
void* cuda_caching_alloc(int device, size_t bytes);
void cuda_caching_free(int device, void* p, size_t bytes);
AllocatorStats cuda_allocator_stats(int device);
void cuda_reset_peak(int device);
size_t cuda_allocation_bytes(size_t bytes);  // the block size a request of `bytes` takes
void cuda_empty_cache(int device);
}  // namespace mt::detail
