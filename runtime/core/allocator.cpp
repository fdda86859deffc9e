#include "runtime/core/allocator.h"

#include "runtime/core/trace.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"

namespace mt {

namespace {
// Host memory: small blocks straight from the C library; blocks of 1 MiB and
// more are cached after free and reused, because the C library returns large
// blocks to the kernel and touching fresh pages again costs a page fault per
// 4 KiB (over 20 us each on some virtual machines: 100 ms for 16 MiB).
constexpr size_t kLargeBlock = 1 << 20;
constexpr size_t kLargeGranule = 2 << 20;
struct HostPool {
  std::mutex mu;
  AllocatorStats s;
  size_t limit = 0;  // set_host_memory_limit; 0: none
  const char* limit_what = "";
  std::multimap<size_t, void*> cached;     // block size -> free block
  std::unordered_map<void*, size_t> live;  // large blocks in use -> block size
};
HostPool& host_pool() {
  static HostPool h;
  return h;
}
size_t host_rounded(size_t bytes) {
  return bytes >= kLargeBlock ? (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule : (bytes + 63) / 64 * 64;
}
}  // namespace

void* device_alloc(Device d, size_t bytes) {
  if (d.is_cuda()) return detail::cuda_caching_alloc(d.index, bytes);
  size_t rounded = host_rounded(bytes);
  if (!rounded) return nullptr;
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  void* p = nullptr;
  const size_t requested = rounded;
  if (rounded >= kLargeBlock) {
    // A cached block at least as large and less than twice the size.
    auto it = h.cached.lower_bound(rounded);
    if (it != h.cached.end() && it->first < 2 * rounded) {
      p = it->second;
      rounded = it->first;
      h.cached.erase(it);
    }
  }
  if (!p && h.limit && h.s.reserved_bytes + rounded > h.limit) {
    for (auto& [size, block] : h.cached) {  // the cache first: only live tensors count against the cap
      std::free(block);
      h.s.reserved_bytes -= size;
      h.s.driver_frees++;
    }
    h.cached.clear();
    if (h.s.reserved_bytes + rounded > h.limit)
      fail("memory",
           "allocating {:.1f} MiB of host memory would take this rank's tensors to {:.1f} MiB, above {} = {:.1f} MiB "
           "(in use: {:.1f} MiB, peak so far {:.1f} MiB)",
           double(rounded) / (1 << 20), double(h.s.reserved_bytes + rounded) / (1 << 20), h.limit_what,
           double(h.limit) / (1 << 20), double(h.s.allocated_bytes) / (1 << 20),
           double(h.s.peak_allocated_bytes) / (1 << 20));
  }
  if (!p) {
    p = std::aligned_alloc(64, rounded);
    if (!p) fail("core", "out of host memory allocating {} bytes", bytes);
    h.s.reserved_bytes += rounded;
    h.s.driver_allocs++;
  }
  if (rounded >= kLargeBlock) h.live[p] = rounded;
  h.s.allocated_bytes += rounded;
  h.s.peak_allocated_bytes = std::max(h.s.peak_allocated_bytes, h.s.allocated_bytes);
  h.s.requested_bytes += requested;
  h.s.peak_requested_bytes = std::max(h.s.peak_requested_bytes, h.s.requested_bytes);
  if (trace::g_on && trace::g_memory_device < 0) {
    trace::memory_block(p, int64_t(rounded), true);  // the block's real size (a reused one may be larger)
    trace::memory_sample(int64_t(h.s.allocated_bytes));
  }
  return p;
}

void device_free(Device d, void* p, size_t bytes) {
  if (d.is_cuda()) return detail::cuda_caching_free(d.index, p, bytes);
  if (!p) return;
  size_t rounded = host_rounded(bytes);
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  h.s.requested_bytes -= rounded;
  // A reused block may be larger than this request: its real size is recorded.
  if (auto it = h.live.find(p); it != h.live.end()) {
    h.s.allocated_bytes -= it->second;
    h.cached.emplace(it->second, p);
    h.live.erase(it);
    if (trace::g_on && trace::g_memory_device < 0) trace::memory_block(p, 0, false), trace::memory_sample(int64_t(h.s.allocated_bytes));
    return;
  }
  if (trace::g_on && trace::g_memory_device < 0) trace::memory_block(p, 0, false);  // before the free: the address is the block's key
  std::free(p);
  h.s.allocated_bytes -= rounded;
  if (trace::g_on && trace::g_memory_device < 0) trace::memory_sample(int64_t(h.s.allocated_bytes));
  h.s.reserved_bytes -= rounded;
  h.s.driver_frees++;
}

AllocatorStats allocator_stats(Device d) {
  if (d.is_cuda()) return detail::cuda_allocator_stats(d.index);
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  return h.s;
}

void set_host_memory_limit(size_t bytes, const char* what) {
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  h.limit = bytes;
  h.limit_what = what;
}

size_t allocation_bytes(Device d, size_t bytes) {
  return d.is_cuda() ? detail::cuda_allocation_bytes(bytes) : host_rounded(bytes);
}

void reset_peak_allocated(Device d) {
  if (d.is_cuda()) return detail::cuda_reset_peak(d.index);
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  h.s.peak_allocated_bytes = h.s.allocated_bytes;
  h.s.peak_requested_bytes = h.s.requested_bytes;
}

void empty_cache(Device d) {
  if (d.is_cuda()) return detail::cuda_empty_cache(d.index);
  auto& h = host_pool();
  std::lock_guard lock(h.mu);
  for (auto& [size, p] : h.cached) {
    std::free(p);
    h.s.reserved_bytes -= size;
    h.s.driver_frees++;
  }
  h.cached.clear();
}

void* pinned_alloc(size_t bytes) { return cuda::pinned_malloc(bytes); }
void pinned_free(void* p) { cuda::pinned_free(p); }

}  // namespace mt
