// Private to runtime/core and comm: the few CUDA runtime calls that the
// device-independent code needs, so that only CUDA-built files include
// cuda_runtime.h. Implemented in cuda_runtime.cpp, in libmeshtrain_cuda.so and
// called through cuda_loader.cpp's trampolines (cuda_table.h); throwing stubs in
// cuda_stub.cpp when CUDA is not built.
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
// The device's total memory in bytes (cudaMemGetInfo's total).
size_t device_memory_bytes(int device);
// The device's name (cudaGetDeviceProperties: "NVIDIA H100 80GB HBM3").
std::string device_name(int device);
// CUDA graphs (training.cuda_graph, runtime/train/cuda_graph.h). graph_begin: the calling thread's current stream
// of `device` starts a capture (cudaStreamCaptureModeRelaxed: the caching allocator may still cudaMalloc); until
// graph_end the device's work is recorded, not run, and the caching allocator serves it from the graph pool: blocks
// that allocations and frees inside a capture touch belong to the device's graphs from then on and never serve
// eager work, because every replay writes them again (PyTorch's private pool, one for all of a device's graphs:
// they replay one after the other on one stream). graph_end: the executable graph, or null with *why set when the
// capture failed (what broke it). graph_launch: one replay on the current stream.
void graph_begin(int device);
void* graph_end(int device, std::string* why);
void graph_launch(void* exec, int device);
void graph_destroy(void* exec);
bool graph_capturing(int device);
}  // namespace mt::cuda

namespace mt::detail {
void* cuda_caching_alloc(int device, size_t bytes);
void cuda_caching_free(int device, void* p, size_t bytes);
AllocatorStats cuda_allocator_stats(int device);
void cuda_reset_peak(int device);
// The block size a request of `bytes` takes: requests under 1 MiB round up to 512 bytes, larger ones to 2 MiB
// (cuda_runtime.cpp's caching allocator). Here, not in the CUDA backend, so that estimates for a CUDA device
// (models' activation bytes) need no CUDA library loaded; a build without CUDA takes the bytes as they are.
inline size_t cuda_allocation_bytes(size_t bytes) {
#if MT_CUDA
  constexpr size_t kSmall = size_t(1) << 20, kSmallRound = 512, kLargeRound = size_t(2) << 20;
  if (bytes < kSmall) return (bytes + kSmallRound - 1) / kSmallRound * kSmallRound;
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
#else
  return bytes;
#endif
}
void cuda_empty_cache(int device);
// What the caching allocator tells a device that checks every access (the emulated device of a test build): after
// an allocation, the block now holds a tensor of `bytes`, what the checks should see of it; after a free, bytes 0
// (the block is cached, and any use of it is an error). Set once, before the first allocation, from inside
// libmeshtrain_cuda.so (cuda_runtime.cpp keeps it); none by default.
using CudaBlockHook = void (*)(void* block, size_t bytes);
void set_cuda_block_hook(CudaBlockHook hook);
}  // namespace mt::detail
