// The CUDA entry points in a build without CUDA: queries answer "none",
// anything that would need a device throws a clear error.
#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {
[[noreturn]] void no_cuda() {
  fail("cuda", "meshtrain was built without CUDA (rebuild with nvcc on PATH, -Dcuda=enabled)");
}
}  // namespace

bool cuda_built() { return false; }
const std::string& cuda_backend_error() {
  static const std::string why = "meshtrain was built without CUDA";
  return why;
}
int cuda_device_count() { return 0; }

Stream Stream::create(int, bool) { no_cuda(); }
Stream::~Stream() = default;
Stream& Stream::operator=(Stream&& o) noexcept {
  handle_ = o.handle_;
  device_ = o.device_;
  owned_ = o.owned_;
  o.owned_ = false;
  return *this;
}
void Stream::synchronize() const { no_cuda(); }
// (A build without CUDA never makes a non-null handle, so the destructors and
// move operators have nothing to release.)

Event Event::create(bool) { no_cuda(); }
Event::~Event() = default;
Event& Event::operator=(Event&& o) noexcept {
  handle_ = o.handle_;
  o.handle_ = nullptr;
  return *this;
}
void Event::record(const Stream&) { no_cuda(); }
void Event::wait_on(const Stream&) const { no_cuda(); }
bool Event::query() const { no_cuda(); }
void Event::synchronize() const {
  if (handle_) no_cuda();
}
float Event::elapsed_ms(const Event&) const { no_cuda(); }

const Stream& current_stream(int) { no_cuda(); }
void set_current_stream(int, Stream) { no_cuda(); }
void set_device(int) { no_cuda(); }
void device_synchronize() {}

void fail_cuda(int code, const char* call, const char* file, int line) {
  throw Error(fmt::format("[cuda] {} failed with code {} at {}", call, code, where(file, line)));
}
void fail_cublas(int code, const char* call, const char* file, int line) {
  throw Error(fmt::format("[cublas] {} failed with status {} at {}", call, code, where(file, line)));
}

namespace cuda {
void* raw_malloc(int, size_t bytes) {
  if (bytes == 0) return nullptr;
  no_cuda();
}
void raw_free(int, void*) {}
void memcpy_async(void*, const void*, size_t bytes, int, int) {
  if (bytes) no_cuda();
}
void memset_zero_async(void*, size_t bytes, int) {
  if (bytes) no_cuda();
}
void stream_sync_current(int) { no_cuda(); }
void graph_begin(int) { no_cuda(); }
void* graph_end(int, std::string*) { no_cuda(); }
void graph_launch(void*, int) { no_cuda(); }
void graph_destroy(void*) {}
bool graph_capturing(int) { return false; }
void* pinned_malloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  no_cuda();
}
void pinned_free(void*) {}
std::string pci_bus_id(int) { no_cuda(); }
size_t device_memory_bytes(int) { no_cuda(); }
std::string device_name(int) { no_cuda(); }
}  // namespace cuda

namespace detail {
void* cuda_caching_alloc(int, size_t bytes) {
  if (bytes == 0) return nullptr;
  no_cuda();
}
void cuda_caching_free(int, void*, size_t) {}
AllocatorStats cuda_allocator_stats(int) { return {}; }
void cuda_reset_peak(int) {}
void cuda_empty_cache(int) {}
}  // namespace detail

}  // namespace mt
