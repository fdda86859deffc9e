#include "runtime/core/allocator.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"

namespace mt {

namespace {
// Host memory goes straight to the C library; only statistics are kept.
struct HostStats {
  std::mutex mu;
  AllocatorStats s;
};
HostStats& host_stats() {
  static HostStats h;
  return h;
}
}  // namespace

void* device_alloc(Device d, size_t bytes) {
  if (d.is_cuda()) return detail::cuda_caching_alloc(d.index, bytes);
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
  if (rounded && !p) fail("core", "out of host memory allocating {} bytes", bytes);
  auto& h = host_stats();
  std::lock_guard lock(h.mu);
  h.s.allocated_bytes += bytes;
  h.s.reserved_bytes += bytes;
  h.s.peak_allocated_bytes = std::max(h.s.peak_allocated_bytes, h.s.allocated_bytes);
  h.s.driver_allocs++;
  return p;
}

void device_free(Device d, void* p, size_t bytes) {
  if (d.is_cuda()) return detail::cuda_caching_free(d.index, p, bytes);
  std::free(p);
  auto& h = host_stats();
  std::lock_guard lock(h.mu);
  h.s.allocated_bytes -= bytes;
  h.s.reserved_bytes -= bytes;
  h.s.driver_frees++;
}

AllocatorStats allocator_stats(Device d) {
  if (d.is_cuda()) return detail::cuda_allocator_stats(d.index);
  auto& h = host_stats();
  std::lock_guard lock(h.mu);
  return h.s;
}

void reset_peak_allocated(Device d) {
  if (d.is_cuda()) return detail::cuda_reset_peak(d.index);
  auto& h = host_stats();
  std::lock_guard lock(h.mu);
  h.s.peak_allocated_bytes = h.s.allocated_bytes;
}

void empty_cache(Device d) {
  if (d.is_cuda()) detail::cuda_empty_cache(d.index);
}

void* pinned_alloc(size_t bytes) { return cuda::pinned_malloc(bytes); }
void pinned_free(void* p) { cuda::pinned_free(p); }

}  // namespace mt
