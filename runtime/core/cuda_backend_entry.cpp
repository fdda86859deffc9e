// The core's entry of libmeshtrain_cuda.so (cuda_table.h): the table of the library's functions that the rest of
// meshtrain calls through cuda_loader.cpp. Built into the library only.
#include <utility>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/cuda_table.h"
#include "runtime/core/device.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"

namespace mt {
namespace {

CudaBackend make_table() {
  CudaBackend t;
  t.device_count = &cuda_device_count;
  t.set_device = &set_device;
  t.device_synchronize = &device_synchronize;
  t.stream_create = [](Stream* out, int device, bool non_blocking) { *out = Stream::create(device, non_blocking); };
  t.stream_release = [](Stream* s) { Stream dead(std::move(*s)); };
  t.stream_synchronize = [](const Stream* s) { s->synchronize(); };
  t.event_create = [](Event* out, bool timing) { *out = Event::create(timing); };
  t.event_release = [](Event* e) { Event dead(std::move(*e)); };
  t.event_record = [](Event* e, const Stream* s) { e->record(*s); };
  t.event_wait_on = [](const Event* e, const Stream* s) { e->wait_on(*s); };
  t.event_query = [](const Event* e) { return e->query(); };
  t.event_synchronize = [](const Event* e) { e->synchronize(); };
  t.event_elapsed_ms = [](const Event* a, const Event* b) { return a->elapsed_ms(*b); };
  t.current_stream = [](int device) { return &current_stream(device); };
  t.set_current_stream = [](int device, Stream* s) { set_current_stream(device, std::move(*s)); };
  t.nvtx_push = &nvtx_push;
  t.nvtx_pop = &nvtx_pop;
  t.caching_alloc = &detail::cuda_caching_alloc;
  t.caching_free = &detail::cuda_caching_free;
  t.allocator_stats = &detail::cuda_allocator_stats;
  t.reset_peak = &detail::cuda_reset_peak;
  t.empty_cache = &detail::cuda_empty_cache;
#define MT_SET_LAUNCHER(R, NAME, PARAMS, ARGS) \
  t.NAME##_f32 = &cuda::NAME<float>;           \
  t.NAME##_bf16 = &cuda::NAME<bf16>;
  MT_CUDA_TEMPLATE_LAUNCHERS(MT_SET_LAUNCHER)
#undef MT_SET_LAUNCHER
#define MT_SET_FUNCTION(R, NAME, PARAMS, ARGS) t.NAME = &cuda::NAME;
  MT_CUDA_FUNCTIONS(MT_SET_FUNCTION)
#undef MT_SET_FUNCTION
  return t;
}

}  // namespace
}  // namespace mt

extern "C" __attribute__((visibility("default"))) const mt::CudaBackend* mt_cuda_backend_v1() {
  static const mt::CudaBackend table = mt::make_table();
  return &table;
}
