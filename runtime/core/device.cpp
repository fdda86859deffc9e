#include "runtime/core/device.h"

#include <atomic>
#include <cstdlib>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {
std::atomic<int64_t> g_host_syncs{0};
thread_local const char* t_no_host_sync = nullptr;  // forbid_host_sync's reason
}  // namespace

void note_host_sync() {
  if (t_no_host_sync)
    fail("cuda", "a host synchronisation (the host waiting for the device, e.g. reading a tensor's values) during {}: "
         "it cannot be recorded", t_no_host_sync);
  g_host_syncs.fetch_add(1, std::memory_order_relaxed);
}
void forbid_host_sync(const char* why) { t_no_host_sync = why; }
int64_t host_sync_count() { return g_host_syncs.load(std::memory_order_relaxed); }

void CudaGraph::begin_capture(int device) { cuda::graph_begin(device); }
CudaGraph CudaGraph::end_capture(int device) {
  std::string why;
  CudaGraph g;
  g.device_ = device;
  g.exec_ = cuda::graph_end(device, &why);
  MT_CHECK(g.exec_, "cuda", "the CUDA graph's capture on cuda:{} failed: {}", device, why);
  return g;
}
bool CudaGraph::capturing(int device) { return cuda::graph_capturing(device); }
CudaGraph::~CudaGraph() {
  if (exec_) cuda::graph_destroy(exec_);
}
CudaGraph& CudaGraph::operator=(CudaGraph&& o) noexcept {
  if (this != &o) {
    if (exec_) cuda::graph_destroy(exec_);
    exec_ = o.exec_, device_ = o.device_;
    o.exec_ = nullptr;
  }
  return *this;
}
void CudaGraph::replay() const {
  MT_CHECK(exec_, "cuda", "replay of an empty CUDA graph");
  cuda::graph_launch(exec_, device_);
}

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
