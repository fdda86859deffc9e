#include "runtime/core/device.h"

#include <atomic>
#include <cstdlib>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {
std::atomic<int64_t> g_host_syncs{0};
}  // namespace

void note_host_sync() { g_host_syncs.fetch_add(1, std::memory_order_relaxed); }
int64_t host_sync_count() { return g_host_syncs.load(std::memory_order_relaxed); }

size_t cuda_device_memory_bytes(int device) { return cuda::device_memory_bytes(device); }
std::string cuda_device_name(int device) { return cuda::device_name(device); }
std::string cuda_device_pci_bus_id(int device) { return cuda::pci_bus_id(device); }

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    char* end = nullptr;
    long i = std::strtol(s.c_str() + 5, &end, 10);
    if (end && *end == '\0' && end != s.c_str() + 5 && i >= 0) return cuda(int(i));
  }
  fail("core", "bad device '{}' (expected cpu, cuda or cuda:N)", s);
}

}  // namespace mt
