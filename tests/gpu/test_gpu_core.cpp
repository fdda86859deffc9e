// runtime/core on a GPU: the caching allocator (reuse without driver calls,
// statistics, out-of-memory message), host <-> device copies, streams and
// events, CUDA error formatting. Skips itself when no device is visible.
#include <doctest/doctest.h>
#include <mpi.h>

#include <thread>

#include "../check_error.h"
#include "gpu_test.h"
#include "runtime/core/allocator.h"
#include "runtime/core/stream.h"
#include "runtime/core/tensor.h"

using namespace mt;

namespace {

Tensor host_values(int64_t n, DType dt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double((i * 37) % 101) - 50.0 + (dt == DType::i64 ? 0 : 0.25);
  return from_values(v, {n}, dt);
}

}  // namespace

TEST_CASE("gpu: build and device queries") {
  CHECK(cuda_built());
  MT_REQUIRE_GPU();
  CHECK(cuda_device_count() >= 1);
  CHECK(device_alloc(Device::cuda(test_device()), 0) == nullptr);
  Tensor e = empty({0}, DType::f32, Device::cuda(test_device()));
  CHECK(e.numel() == 0);
  CHECK(e.to(Device::cpu()).numel() == 0);
}

TEST_CASE("gpu: caching allocator reuses blocks without driver calls in steady state") {
  MT_REQUIRE_GPU();
  Device d = Device::cuda(test_device());
  const std::vector<int64_t> sizes{1, 100, 1000, 4096, 300000, (3 << 20) / 4 + 1, (17 << 20) / 4};
  auto round = [&] {
    std::vector<Tensor> ts;
    for (int64_t n : sizes) ts.push_back(empty({n}, DType::f32, d));
    for (int64_t n : sizes) ts.push_back(empty({n}, DType::bf16, d));
  };
  round();
  AllocatorStats a = allocator_stats(d);
  round();
  round();
  AllocatorStats b = allocator_stats(d);
  CHECK(b.driver_allocs == a.driver_allocs);
  CHECK(b.driver_frees == a.driver_frees);
  CHECK(b.allocated_bytes == a.allocated_bytes);
  CHECK(b.reserved_bytes == a.reserved_bytes);
}

TEST_CASE("gpu: allocator statistics, rounding, reuse rule, empty_cache") {
  MT_REQUIRE_GPU();
  Device d = Device::cuda(test_device());
  empty_cache(d);
  AllocatorStats s0 = allocator_stats(d);
  CHECK(s0.reserved_bytes >= s0.allocated_bytes);
  {
    Tensor t = empty({1000}, DType::f32, d);  // 4000 bytes -> one 4096-byte block
    AllocatorStats s1 = allocator_stats(d);
    CHECK(s1.allocated_bytes - s0.allocated_bytes == 4096);
    CHECK(s1.reserved_bytes - s0.reserved_bytes == 4096);
    CHECK(s1.driver_allocs == s0.driver_allocs + 1);
    CHECK(s1.peak_allocated_bytes >= s1.allocated_bytes);
    Tensor big = empty({(3 << 20) / 4 + 1}, DType::f32, d);  // 3 MiB + 4 bytes -> 4 MiB
    CHECK(allocator_stats(d).allocated_bytes - s1.allocated_bytes == (size_t(4) << 20));
  }
  AllocatorStats s2 = allocator_stats(d);
  CHECK(s2.allocated_bytes == s0.allocated_bytes);
  CHECK(s2.reserved_bytes == s0.reserved_bytes + 4096 + (size_t(4) << 20));
  CHECK(s2.peak_allocated_bytes >= s0.allocated_bytes + 4096 + (size_t(4) << 20));
  reset_peak_allocated(d);
  CHECK(allocator_stats(d).peak_allocated_bytes == s2.allocated_bytes);

  // A cached 16 MiB block serves a 10 MiB request (less than twice) but not a 6 MiB one.
  { Tensor t = empty({(16 << 20) / 4}, DType::f32, d); }
  uint64_t allocs = allocator_stats(d).driver_allocs;
  { Tensor t = empty({(10 << 20) / 4}, DType::f32, d); }
  CHECK(allocator_stats(d).driver_allocs == allocs);
  { Tensor t = empty({(6 << 20) / 4}, DType::f32, d); }
  CHECK(allocator_stats(d).driver_allocs == allocs + 1);

  AllocatorStats s3 = allocator_stats(d);
  empty_cache(d);
  AllocatorStats s4 = allocator_stats(d);
  CHECK(s4.reserved_bytes == s4.allocated_bytes);
  CHECK(s4.driver_frees > s3.driver_frees);
}

TEST_CASE("gpu: out of memory names the request, device and usage") {
  MT_REQUIRE_GPU();
  Device d = Device::cuda(test_device());
  AllocatorStats before = allocator_stats(d);
  // 2^48 f32 = 1 PiB.
  CHECK_ERROR_CONTAINS(empty({int64_t(1) << 48}, DType::f32, d),
                       "[cuda] out of memory allocating 1125899906842624 bytes on " + d.str() + " (allocated ");
  CHECK_ERROR_CONTAINS(empty({int64_t(1) << 48}, DType::f32, d), "reserved ");
  // The allocator still works afterwards and nothing leaked into the stats.
  CHECK(allocator_stats(d).allocated_bytes == before.allocated_bytes);
  Tensor t = zeros({10}, DType::f32, d);
  CHECK(to_f64(t) == std::vector<double>(10, 0.0));
}

TEST_CASE("gpu: host <-> device copies round-trip f32, bf16, i64") {
  MT_REQUIRE_GPU();
  Device d = Device::cuda(test_device());
  for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::f64, DType::i32, DType::u16})
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(100003)}) {
      INFO(dtype_name(dt), " n=", n);
      Tensor h = dt == DType::u16 ? host_values(n, DType::bf16).bitcast(DType::u16) : host_values(n, dt);
      Tensor g = h.to(d);
      CHECK(g.device() == d);
      Tensor g2 = g.clone();  // device to device
      CHECK(g2.device() == d);
      Tensor back = g2.to(Device::cpu());
      CHECK(equal(back, h));
      // A view of a device tensor copies only its range.
      if (n >= 7) {
        Tensor part = g.view(2, {5}).to(Device::cpu());
        CHECK(equal(part, h.view(2, {5}).clone()));
      }
      // zeros on the device.
      Tensor z = zeros({n}, dt, d);
      for (double x : to_f64(z)) CHECK(x == 0.0);
      // copy_ host -> existing device tensor.
      Tensor dst = empty({n}, dt, d);
      copy_(dst, h);
      CHECK(equal(dst.to(Device::cpu()), h));
    }
}

TEST_CASE("gpu: streams and events") {
  MT_REQUIRE_GPU();
  int dev = test_device();
  Device d = Device::cuda(dev);
  const Stream& cur = current_stream(dev);
  CHECK(cur.handle() != nullptr);  // a created stream, not the legacy default
  CHECK(&current_stream(dev) == &cur);
  void* main_handle = cur.handle();

  // Another thread gets its own current stream.
  void* other = nullptr;
  std::thread th([&] { other = current_stream(dev).handle(); });
  th.join();
  CHECK(other != nullptr);
  CHECK(other != main_handle);

  // Timing events around device work on the current stream.
  Tensor a = zeros({int64_t(16) << 20}, DType::f32, d), b = empty({int64_t(16) << 20}, DType::f32, d);
  Event start = Event::create(true), end = Event::create(true);
  start.record(current_stream(dev));
  for (int i = 0; i < 4; ++i) copy_(b, a);
  end.record(current_stream(dev));
  end.synchronize();
  CHECK(end.query());
  CHECK(start.query());
  float ms = start.elapsed_ms(end);
  CHECK(ms >= 0.0f);

  // A stream made current, then waited on by the default one through an event.
  {
    Stream s = Stream::create(dev);
    void* sh = s.handle();
    set_current_stream(dev, s.borrow());
    CHECK(current_stream(dev).handle() == sh);
    Tensor h = host_values(1000, DType::f32);
    Tensor g = h.to(d);  // issued on s
    Event ev = Event::create();
    ev.record(current_stream(dev));
    set_current_stream(dev, Stream::create(dev));  // owned, replaces the borrowed one
    ev.wait_on(current_stream(dev));
    CHECK(equal(g.to(Device::cpu()), h));
    s.synchronize();
  }
  Event empty_ev;
  CHECK(empty_ev.query());
  empty_ev.synchronize();
  empty_ev.wait_on(current_stream(dev));
  CHECK_ERROR_CONTAINS(empty_ev.record(current_stream(dev)), "[cuda] record on an empty Event");

  // Move semantics: the moved-from handle no longer owns the stream.
  Stream s1 = Stream::create(dev);
  void* h1 = s1.handle();
  Stream s2 = std::move(s1);
  CHECK(s2.handle() == h1);
  s2.synchronize();
  device_synchronize();
  CHECK_ERROR_CONTAINS(Stream::create(cuda_device_count() + 3), "does not exist");
}

TEST_CASE("gpu: CUDA and cuBLAS errors are formatted with name, text and place") {
  MT_REQUIRE_GPU();
  CHECK_ERROR_CONTAINS([] { MT_CUDA_CHECK(1); }(), "[cuda] 1 failed: cudaErrorInvalidValue: invalid argument at ");
  CHECK_ERROR_CONTAINS([] { MT_CUDA_CHECK(2); }(), "test_gpu_core.cpp:");
  CHECK_ERROR_CONTAINS([] { MT_CUBLAS_CHECK(3); }(), "[cublas] 3 failed: CUBLAS_STATUS_ALLOC_FAILED");
}
