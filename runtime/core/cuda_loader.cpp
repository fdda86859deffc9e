// The CUDA backend loaded at run time (cuda_table.h): finding and loading libmeshtrain_cuda.so, and the
// trampolines through which the rest of meshtrain calls it. Built into the core in every CUDA build (real or
// emulated) instead of cuda_runtime.cpp, which lives in the library. Nothing here loads the library unless CUDA
// work is asked for: a CPU run never maps it (nor, through it, cudart, cuBLAS(Lt) or NCCL).
#include <dlfcn.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <type_traits>
#include <vector>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/cuda_table.h"
#include "runtime/core/device.h"
#include "runtime/core/error.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {

std::atomic<const CudaBackend*> g_backend{nullptr};
void* g_handle = nullptr;  // the library's, set with g_backend
std::once_flag g_once;
std::string g_error;

std::string exe_dir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.parent_path().string();
}

void load() {
  // Where to look, in order: beside the executable (where meson builds and installs it), the override, the
  // default search path (LD_LIBRARY_PATH, the cache; also a copy already loaded, as in tests linked with it).
  std::vector<std::string> candidates;
  if (std::string d = exe_dir(); !d.empty()) candidates.push_back(d + "/" + kCudaBackendLibrary);
  if (const char* o = std::getenv("MESHTRAIN_CUDA_BACKEND"); o && *o) candidates.push_back(o);
  candidates.push_back(kCudaBackendLibrary);
  std::string why;
  for (const std::string& c : candidates) {
    const bool path = c.find('/') != std::string::npos;
    if (path && !std::filesystem::exists(c)) {
      if (why.empty()) why = c + ": no such file";
      continue;
    }
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      // A library that is there but does not load (a CUDA library missing) says more than a later "not found".
      if (why.empty() || why.find("no such file") != std::string::npos || path) why = e ? e : "dlopen failed";
      if (path) break;
      continue;
    }
    auto entry = reinterpret_cast<const CudaBackend* (*)()>(dlsym(h, "mt_cuda_backend_v1"));
    const CudaBackend* b = entry ? entry() : nullptr;
    if (!b || b->abi != kCudaBackendAbi || b->size != sizeof(CudaBackend)) {
      why = fmt::format("{}: not a meshtrain CUDA backend of this build ({})", c,
                        !b ? "no mt_cuda_backend_v1" : "its table differs: rebuild meshtrain and the library together");
      break;
    }
    spdlog::debug("loaded the CUDA backend {}", c);
    g_handle = h;
    g_backend.store(b, std::memory_order_release);
    return;
  }
  g_error = fmt::format(
      "cannot load the CUDA backend {} ({}): a CUDA run needs it beside the executable (or "
      "MESHTRAIN_CUDA_BACKEND=path) and the CUDA libraries it links (libcudart, libcublas, libcublasLt, libnccl) "
      "on the library path",
      kCudaBackendLibrary, why);
}

}  // namespace

const std::string& cuda_backend_error() {
  std::call_once(g_once, load);
  return g_error;
}

const CudaBackend* cuda_backend_if_loaded() { return g_backend.load(std::memory_order_acquire); }

const CudaBackend& cuda_backend() {
  if (const CudaBackend* b = cuda_backend_if_loaded()) return *b;
  const std::string& e = cuda_backend_error();
  if (const CudaBackend* b = cuda_backend_if_loaded()) return *b;
  throw Error("[cuda] " + e);
}

void* cuda_backend_symbol(const char* name) {
  cuda_backend();
  return dlsym(g_handle, name);
}

namespace {
const CudaBackend& be() { return cuda_backend(); }
}  // namespace

// ---------------------------------------------------------------- device.h, stream.h

bool cuda_built() { return true; }
// Asking loads the backend: a caller that counts devices is about to use one (MpiEnv asks lazily).
int cuda_device_count() { return be().device_count(); }
void set_device(int device) { be().set_device(device); }
void device_synchronize() {
  // Without the backend no device work was issued: nothing to wait for (as in a build without CUDA).
  if (const CudaBackend* b = cuda_backend_if_loaded()) b->device_synchronize();
}

Stream Stream::create(int device, bool non_blocking) {
  Stream r;
  be().stream_create(&r, device, non_blocking);
  return r;
}
Stream::~Stream() {
  if (owned_ && handle_) be().stream_release(this);
}
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (owned_ && handle_) be().stream_release(this);
    handle_ = o.handle_;
    device_ = o.device_;
    owned_ = o.owned_;
    o.owned_ = false;
  }
  return *this;
}
void Stream::synchronize() const { be().stream_synchronize(this); }

Event Event::create(bool timing) {
  Event r;
  be().event_create(&r, timing);
  return r;
}
Event::~Event() {
  if (handle_) be().event_release(this);
}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (handle_) be().event_release(this);
    handle_ = o.handle_;
    o.handle_ = nullptr;
  }
  return *this;
}
void Event::record(const Stream& s) { be().event_record(this, &s); }
void Event::wait_on(const Stream& s) const {
  if (handle_) be().event_wait_on(this, &s);  // an empty event is complete
}
bool Event::query() const { return !handle_ || be().event_query(this); }
void Event::synchronize() const {
  if (handle_) be().event_synchronize(this);
}
float Event::elapsed_ms(const Event& end) const { return be().event_elapsed_ms(this, &end); }

const Stream& current_stream(int device) { return *be().current_stream(device); }
void set_current_stream(int device, Stream s) { be().set_current_stream(device, &s); }

// NVTX ranges are opened on CPU runs too (the trainer's step phases): never a reason to load the backend.
void nvtx_push(const char* name) {
  if (const CudaBackend* b = cuda_backend_if_loaded()) b->nvtx_push(name);
}
void nvtx_pop() {
  if (const CudaBackend* b = cuda_backend_if_loaded()) b->nvtx_pop();
}

// ---------------------------------------------------------------- cuda_backend.h, the launchers

namespace detail {
void* cuda_caching_alloc(int device, size_t bytes) { return be().caching_alloc(device, bytes); }
void cuda_caching_free(int device, void* p, size_t bytes) { be().caching_free(device, p, bytes); }
AllocatorStats cuda_allocator_stats(int device) {
  const CudaBackend* b = cuda_backend_if_loaded();
  return b ? b->allocator_stats(device) : AllocatorStats{};  // nothing allocated yet
}
void cuda_reset_peak(int device) {
  if (const CudaBackend* b = cuda_backend_if_loaded()) b->reset_peak(device);
}
void cuda_empty_cache(int device) {
  if (const CudaBackend* b = cuda_backend_if_loaded()) b->empty_cache(device);
}
}  // namespace detail

namespace cuda {

#define MT_TRAMPOLINE(R, NAME, PARAMS, ARGS)     \
  template <typename T> R NAME PARAMS {           \
    if constexpr (std::is_same_v<T, float>)       \
      return be().NAME##_f32 ARGS;                \
    else                                          \
      return be().NAME##_bf16 ARGS;               \
  }
MT_CUDA_TEMPLATE_LAUNCHERS(MT_TRAMPOLINE)
#undef MT_TRAMPOLINE

#define MT_TRAMPOLINE(R, NAME, PARAMS, ARGS) \
  R NAME PARAMS { return be().NAME ARGS; }
MT_CUDA_FUNCTIONS(MT_TRAMPOLINE)
#undef MT_TRAMPOLINE

// Every launcher instantiated for float and bf16 (what the callers beside the ops link against).
#define MT_INSTANTIATE(R, NAME, PARAMS, ARGS) \
  reinterpret_cast<void*>(&NAME<float>), reinterpret_cast<void*>(&NAME<bf16>),
[[gnu::used]] void* const g_instantiated[] = {MT_CUDA_TEMPLATE_LAUNCHERS(MT_INSTANTIATE)};
#undef MT_INSTANTIATE

}  // namespace cuda

}  // namespace mt
