// The CUDA backend of runtime/core: streams and events (stream.h), the few
// runtime calls the device-independent code needs (cuda_backend.h), the
// caching device allocator, and the CUDA/cuBLAS error formatting of error.h.
// Compiled only when CUDA is built (cuda_stub.cpp stands in otherwise), by nvcc's host compiler or, in the
// emulated build (-Demulate_cuda=true, MT_CUDA_EMULATED), against tests/emu's runtime, which hears of the
// allocator's blocks through set_cuda_block_hook (cuda_backend.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <spdlog/spdlog.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"
#include "runtime/core/stream.h"
#include "runtime/core/trace.h"
#include "runtime/core/cuda_guard.h"

namespace mt {

// ---------------------------------------------------------------- errors

void fail_cuda(int code, const char* call, const char* file, int line) {
  auto e = static_cast<cudaError_t>(code);
  throw Error(fmt::format("[cuda] {} failed: {}: {} at {}", call, cudaGetErrorName(e), cudaGetErrorString(e),
                          where(file, line)));
}

void fail_cublas(int code, const char* call, const char* file, int line) {
  auto s = static_cast<cublasStatus_t>(code);
  throw Error(fmt::format("[cublas] {} failed: {}: {} at {}", call, cublasGetStatusName(s), cublasGetStatusString(s),
                          where(file, line)));
}

// ---------------------------------------------------------------- devices

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return 0;
  }
  return n;
}

void set_device(int device) {
  MT_CUDA_CHECK(cudaSetDevice(device));
#if MT_CUDA_EMULATED
  // The emulated build (-Demulate_cuda=true, tests/emu) says so once, wherever a device is first chosen.
  static std::once_flag said;
  std::call_once(said, [device] {
    spdlog::warn("cuda:{} (emulated CUDA device, test-only): this binary was built with -Demulate_cuda=true, its CUDA "
                 "kernels run on the CPU (tests/emu); never a build for a GPU machine",
                 device);
  });
#endif
}

void device_synchronize() {
  note_host_sync();
  MT_CUDA_CHECK(cudaDeviceSynchronize());
}

namespace {

void check_device_index(int device) {
  int n = cuda_device_count();
  MT_CHECK(device >= 0 && device < n, "cuda", "device cuda:{} does not exist ({} visible CUDA device{})", device, n,
           n == 1 ? "" : "s");
}

}  // namespace

// ---------------------------------------------------------------- streams

Stream Stream::create(int device, bool non_blocking) {
  check_device_index(device);
  DeviceGuard g(device);
  cudaStream_t s = nullptr;
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault));
  Stream r;
  r.handle_ = s;
  r.device_ = device;
  r.owned_ = true;
  return r;
}

Stream::~Stream() {
  // Errors are ignored: at process exit the runtime may already be unloading.
  if (owned_ && handle_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (owned_ && handle_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
    handle_ = o.handle_;
    device_ = o.device_;
    owned_ = o.owned_;
    o.owned_ = false;
  }
  return *this;
}

void Stream::synchronize() const {
  note_host_sync();
  DeviceGuard g(device_);
  MT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
}

Event Event::create(bool timing) {
  cudaEvent_t e = nullptr;
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  Event r;
  r.handle_ = e;
  return r;
}

Event::~Event() {
  if (handle_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (handle_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
    handle_ = o.handle_;
    o.handle_ = nullptr;
  }
  return *this;
}

void Event::record(const Stream& s) {
  MT_CHECK(handle_, "cuda", "record on an empty Event (make one with Event::create)");
  MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(s.handle())));
}

void Event::wait_on(const Stream& s) const {
  if (!handle_) return;  // an empty event is complete
  MT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.handle()), static_cast<cudaEvent_t>(handle_), 0));
}

bool Event::query() const {
  if (!handle_) return true;
  cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (rc == cudaSuccess) return true;
  if (rc == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer: it must not be the error a later launch check reads
    return false;
  }
  fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
}

void Event::synchronize() const {
  if (handle_) note_host_sync();
  if (handle_) MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

float Event::elapsed_ms(const Event& end) const {
  MT_CHECK(handle_ && end.handle_, "cuda", "elapsed_ms on an empty Event");
  float ms = 0;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
  return ms;
}

namespace {
// This thread's current stream per device. A slot not yet set gets a fresh
// non-blocking stream on first use (nothing runs on the legacy default stream,
// which would serialise against every other stream).
struct StreamSlot {
  Stream stream;
  bool set = false;
};
thread_local std::vector<StreamSlot> t_streams;
}  // namespace

const Stream& current_stream(int device) {
  MT_CHECK(device >= 0, "cuda", "current_stream of negative device {}", device);
  if (size_t(device) >= t_streams.size()) t_streams.resize(size_t(device) + 1);
  auto& slot = t_streams[size_t(device)];
  if (!slot.set) {
    slot.stream = Stream::create(device, true);
    slot.set = true;
  }
  return slot.stream;
}

void set_current_stream(int device, Stream s) {
  MT_CHECK(device >= 0, "cuda", "set_current_stream of negative device {}", device);
  if (size_t(device) >= t_streams.size()) t_streams.resize(size_t(device) + 1);
  auto& slot = t_streams[size_t(device)];
  slot.stream = std::move(s);
  slot.set = true;
}

// ---------------------------------------------------------------- raw calls

namespace detail {
void cuda_graph_pool(int device, bool capturing);  // the caching allocator's graph pool on or off (below)
}

namespace cuda {

void* raw_malloc(int device, size_t bytes) {
  if (bytes == 0) return nullptr;
  DeviceGuard g(device);
  void* p = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void raw_free(int device, void* p) {
  if (!p) return;
  DeviceGuard g(device);
  MT_CUDA_CHECK(cudaFree(p));
}

void memcpy_async(void* dst, const void* src, size_t bytes, int kind, int device) {
  if (bytes == 0) return;
  static constexpr cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice};
  MT_CHECK(kind >= 0 && kind <= 2, "cuda", "memcpy_async: bad kind {}", kind);
  DeviceGuard g(device);
  MT_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, bytes, kinds[kind], static_cast<cudaStream_t>(current_stream(device).handle())));
}

void memset_zero_async(void* p, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard g(device);
  MT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(current_stream(device).handle())));
}

void stream_sync_current(int device) { current_stream(device).synchronize(); }

void* pinned_malloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  MT_CUDA_CHECK(cudaMallocHost(&p, bytes));
  return p;
}

void pinned_free(void* p) {
  if (p) MT_CUDA_CHECK(cudaFreeHost(p));
}

std::string pci_bus_id(int device) {
  char id[64] = {0};
  MT_CUDA_CHECK(cudaDeviceGetPCIBusId(id, int(sizeof id), device));
  return id;
}

size_t device_memory_bytes(int device) {
  DeviceGuard g(device);
  size_t free_b = 0, total_b = 0;
  MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.name;
}

void graph_begin(int device) {
  DeviceGuard g(device);
  auto s = static_cast<cudaStream_t>(current_stream(device).handle());
  MT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  detail::cuda_graph_pool(device, true);
}

void* graph_end(int device, std::string* why) {
  DeviceGuard g(device);
  auto s = static_cast<cudaStream_t>(current_stream(device).handle());
  detail::cuda_graph_pool(device, false);
  cudaGraph_t graph = nullptr;
  const cudaError_t rc = cudaStreamEndCapture(s, &graph);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = fmt::format("{}: {}", cudaGetErrorName(rc), cudaGetErrorString(rc));
    if (graph) (void)cudaGraphDestroy(graph);
    return nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ri = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  if (ri != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = fmt::format("cudaGraphInstantiate: {}: {}", cudaGetErrorName(ri), cudaGetErrorString(ri));
    return nullptr;
  }
  return exec;
}

void graph_launch(void* exec, int device) {
  DeviceGuard g(device);
  MT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec),
                                static_cast<cudaStream_t>(current_stream(device).handle())));
}

void graph_destroy(void* exec) {
  if (exec) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

bool graph_capturing(int device) {
  DeviceGuard g(device);
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(current_stream(device).handle()), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace cuda

// ---------------------------------------------------------------- caching allocator
//
// Blocks come from cudaMalloc in rounded sizes (512 B granularity below 1 MiB,
// 2 MiB above) and go back into per-device bins when freed; a later request
// takes the smallest cached block that is at least its rounded size and less
// than twice it. Blocks are never split or merged.
//
// Reusing a freed block without any synchronisation is safe because all of a
// device's work is ordered on one compute stream (the current stream; the NCCL
// backend's own stream is joined back into it with an event before a
// collective's buffers can be released): work issued after the free runs
// after every use issued before it. This is PyTorch's rule for its caching
// allocator. Code that uses a block on another stream must make the compute
// stream wait for that stream before freeing it.

namespace detail {

namespace {

struct DeviceCache {
  std::multimap<size_t, void*> free_blocks;  // rounded size -> block
  std::unordered_map<void*, size_t> live;    // block -> its size
  AllocatorStats stats;
  // The graph pool (cuda_backend.h, graph_begin): blocks a capture allocated or freed, and the free ones among them.
  bool capturing = false;
  std::unordered_map<void*, size_t> graph_blocks;
  std::multimap<size_t, void*> graph_free;
};

struct Caches {
  std::mutex mu;
  std::vector<DeviceCache> dev;
  DeviceCache& at(int device) {
    MT_CHECK(device >= 0, "cuda", "negative device index {}", device);
    if (size_t(device) >= dev.size()) dev.resize(size_t(device) + 1);
    return dev[size_t(device)];
  }
};

CudaBlockHook g_block_hook = nullptr;  // cuda_backend.h

// Never destroyed: tensors freed from static destructors must still find it.
Caches& caches() {
  static Caches* c = new Caches;
  return *c;
}

std::string human_bytes(size_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

// Returns every cached block of c to the driver (mutex held).
void release_cached(int device, DeviceCache& c) {
  if (c.free_blocks.empty()) return;
  DeviceGuard g(device);
  for (auto& [size, p] : c.free_blocks) {
    MT_CUDA_CHECK(cudaFree(p));
    c.stats.reserved_bytes -= size;
    c.stats.driver_frees++;
  }
  c.free_blocks.clear();
}

}  // namespace

void* cuda_caching_alloc(int device, size_t bytes) {
  if (bytes == 0) return nullptr;
  size_t size = cuda_allocation_bytes(bytes);  // cuda_backend.h
  auto& C = caches();
  std::lock_guard lock(C.mu);
  DeviceCache& c = C.at(device);
  void* p = nullptr;
  auto take = [&](std::multimap<size_t, void*>& bins) {  // a cached block at least as large, under twice the size
    auto it = bins.lower_bound(size);
    if (it == bins.end() || it->first >= 2 * size) return false;
    size = it->first;
    p = it->second;
    bins.erase(it);
    return true;
  };
  // In a capture the graph pool first: its blocks are free in every replay at the same point of the step.
  const bool from_cache = (c.capturing && take(c.graph_free)) || take(c.free_blocks);
  if (!from_cache) {
    DeviceGuard g(device);
    cudaError_t rc = cudaMalloc(&p, size);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      release_cached(device, c);
      rc = cudaMalloc(&p, size);
    }
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
      fail("cuda",
           "out of memory allocating {} bytes on cuda:{} (allocated {}, reserved {}; the device has {} free of {})",
           bytes, device, human_bytes(c.stats.allocated_bytes), human_bytes(c.stats.reserved_bytes),
           human_bytes(free_b), human_bytes(total_b));
    }
    if (rc != cudaSuccess) fail_cuda(rc, "cudaMalloc", __FILE__, __LINE__);
    c.stats.reserved_bytes += size;
    c.stats.driver_allocs++;
  }
  c.live.emplace(p, size);
  const bool graph_block = c.capturing || c.graph_blocks.count(p);
  if (c.capturing) c.graph_blocks.emplace(p, size);
  // A checking device sees the tensor's bytes, not the block's; a graph's block keeps its whole size (the replays
  // use it for every tensor the capture put there, whatever their sizes).
  if (g_block_hook) g_block_hook(p, graph_block ? size : bytes);
  c.stats.allocated_bytes += size;
  c.stats.requested_bytes += size;  // device blocks are the request's rounded size
  c.stats.peak_requested_bytes = std::max(c.stats.peak_requested_bytes, c.stats.requested_bytes);
  c.stats.peak_allocated_bytes = std::max(c.stats.peak_allocated_bytes, c.stats.allocated_bytes);
  if (trace::g_on && trace::g_memory_device == device) {  // the trace's memory track (trace.h)
    trace::memory_block(p, int64_t(size), true);
    trace::memory_sample(int64_t(c.stats.allocated_bytes));
  }
  return p;
}

void cuda_caching_free(int device, void* p, size_t /*bytes*/) {
  if (!p) return;
  auto& C = caches();
  std::lock_guard lock(C.mu);
  DeviceCache& c = C.at(device);
  auto it = c.live.find(p);
  if (it == c.live.end()) return;  // not ours (never happens for tensors); do not corrupt the bins
  size_t size = it->second;
  c.live.erase(it);
  c.stats.allocated_bytes -= size;
  c.stats.requested_bytes -= size;
  // A block freed in a capture may be used by the graph up to that point at every replay: the graph's from now on.
  if (c.capturing && !c.graph_blocks.count(p)) {
    c.graph_blocks.emplace(p, size);
    if (g_block_hook) g_block_hook(p, size);
  }
  if (c.graph_blocks.count(p)) {
    c.graph_free.emplace(size, p);  // the checking device keeps it in use: the replays use it
  } else {
    if (g_block_hook) g_block_hook(p, 0);  // a use after this free is an error
    c.free_blocks.emplace(size, p);
  }
  if (trace::g_on && trace::g_memory_device == device) {
    trace::memory_block(p, 0, false);
    trace::memory_sample(int64_t(c.stats.allocated_bytes));
  }
}

void cuda_graph_pool(int device, bool capturing) {
  auto& C = caches();
  std::lock_guard lock(C.mu);
  C.at(device).capturing = capturing;
}

void set_cuda_block_hook(CudaBlockHook hook) { g_block_hook = hook; }

AllocatorStats cuda_allocator_stats(int device) {
  auto& C = caches();
  std::lock_guard lock(C.mu);
  return C.at(device).stats;
}


void cuda_reset_peak(int device) {
  auto& C = caches();
  std::lock_guard lock(C.mu);
  auto& s = C.at(device).stats;
  s.peak_allocated_bytes = s.allocated_bytes;
  s.peak_requested_bytes = s.requested_bytes;
}

void cuda_empty_cache(int device) {
  auto& C = caches();
  std::lock_guard lock(C.mu);
  release_cached(device, C.at(device));
}

}  // namespace detail

}  // namespace mt
