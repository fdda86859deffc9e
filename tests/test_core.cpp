#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "check_error.h"
#include "runtime/core/allocator.h"
#include "runtime/core/tensor.h"
#include "runtime/core/trace.h"

using namespace mt;

TEST_CASE("bf16 rounds to nearest even and keeps NaN") {
  CHECK(float(bf16(1.0f)) == 1.0f);
  CHECK(float(bf16(3.0f)) == 3.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  CHECK(float(bf16(1.0f + std::ldexp(1.0f, -8))) == 1.0f);
  CHECK(float(bf16(1.0f + 3 * std::ldexp(1.0f, -8))) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(float(bf16(std::numeric_limits<float>::infinity()))));
  CHECK(float(bf16(-2.5f)) == -2.5f);
}

TEST_CASE("dtype names and sizes") {
  for (DType d : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u16, DType::u8})
    CHECK(dtype_from_name(dtype_name(d)) == d);
  CHECK(dtype_size(DType::u8) == 1);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK_ERROR_CONTAINS(dtype_from_name("f16"), "[core] unknown dtype 'f16'");
}

TEST_CASE("tensor is a value handle over shared storage") {
  Tensor a = from_values({0, 1, 2, 3, 4, 5}, {2, 3}, DType::f32);
  Tensor b = a;  // same storage
  b.at<float>(4) = 40;
  CHECK(a.at<float>(4) == 40);
  Tensor c = a.clone();
  c.at<float>(0) = -1;
  CHECK(a.at<float>(0) == 0);
  CHECK(a.numel() == 6);
  CHECK(a.nbytes() == 24);
  CHECK(a.size(-1) == 3);
  CHECK_ERROR_CONTAINS(a.size(2), "[core] dim 2 out of range");
}

TEST_CASE("views, reshape, slice and bitcast") {
  Tensor a = from_values({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {4, 3}, DType::i64);
  Tensor rows = a.slice0(1, 3);
  CHECK(rows.shape() == Shape{2, 3});
  CHECK(rows.at<int64_t>(0) == 3);
  CHECK(rows.offset() == 3);
  Tensor v = a.view(5, {4});
  CHECK(to_f64(v) == std::vector<double>{5, 6, 7, 8});
  CHECK(a.reshape({-1, 6}).shape() == Shape{2, 6});
  CHECK_ERROR_CONTAINS(a.reshape({5, -1}), "cannot reshape");
  CHECK_ERROR_CONTAINS(a.view(10, {3}), "outside a tensor");
  Tensor empty_rows = a.slice0(4, 4);
  CHECK(empty_rows.numel() == 0);
  Tensor h = from_values({1.5, -2}, {2}, DType::bf16);
  Tensor u = h.bitcast(DType::u16);
  CHECK(u.at<uint16_t>(0) == bf16(1.5f).bits);
  CHECK_ERROR_CONTAINS(h.bitcast(DType::f32), "sizes differ");
  CHECK_ERROR_CONTAINS(h.data<float>(), "data<f32>() on a bf16 tensor");
}

TEST_CASE("zero-size tensors and copies") {
  Tensor z = zeros({0, 5}, DType::f32);
  CHECK(z.numel() == 0);
  Tensor z2 = z.clone();
  CHECK(z2.shape() == Shape{0, 5});
  Tensor a = from_values({1, 2, 3}, {3}, DType::f64);
  Tensor b = zeros({3}, DType::f64);
  copy_(b, a);
  CHECK(equal(a, b));
  Tensor wrong = zeros({3}, DType::f32);
  CHECK_ERROR_CONTAINS(copy_(wrong, a), "dtype and element count must match");
  CHECK_ERROR_CONTAINS(empty({2, -1}, DType::f32), "negative size");
}

TEST_CASE("host allocator statistics track live bytes") {
  auto before = allocator_stats(Device::cpu());
  {
    Tensor t = empty({1024}, DType::f64);
    auto during = allocator_stats(Device::cpu());
    CHECK(during.allocated_bytes == before.allocated_bytes + 8192);
    CHECK(during.peak_allocated_bytes >= during.allocated_bytes);
  }
  CHECK(allocator_stats(Device::cpu()).allocated_bytes == before.allocated_bytes);
}

TEST_CASE("devices parse and a build without a GPU says so") {
  CHECK(Device::parse("cpu") == Device::cpu());
  CHECK(Device::parse("cuda:3") == Device::cuda(3));
  CHECK_ERROR_CONTAINS(Device::parse("gpu"), "[core] bad device 'gpu'");
  if (!cuda_built()) {
    CHECK(cuda_device_count() == 0);
    CHECK_ERROR_CONTAINS(empty({4}, DType::f32, Device::cuda(0)), "[cuda]");
  }
}

TEST_CASE("large host blocks are cached and reused, small ones are not") {
  empty_cache(Device::cpu());
  auto s0 = allocator_stats(Device::cpu());
  { Tensor a = empty({3 << 20}, DType::f32); }  // 12 MiB, cached on free
  auto s1 = allocator_stats(Device::cpu());
  CHECK(s1.driver_allocs == s0.driver_allocs + 1);
  CHECK(s1.allocated_bytes == s0.allocated_bytes);
  CHECK(s1.reserved_bytes >= s0.reserved_bytes + (12u << 20));
  { Tensor b = empty({(3 << 20) - 100}, DType::f32); }  // fits the cached block: no new allocation
  { Tensor c = empty({2 << 20}, DType::f32); }          // 8 MiB: the 12 MiB block is under 2x, reused
  CHECK(allocator_stats(Device::cpu()).driver_allocs == s1.driver_allocs);
  { Tensor d = empty({1 << 20}, DType::f32); }  // 4 MiB: 12 MiB would waste too much, a new block
  CHECK(allocator_stats(Device::cpu()).driver_allocs == s1.driver_allocs + 1);
  empty_cache(Device::cpu());
  CHECK(allocator_stats(Device::cpu()).reserved_bytes == s0.reserved_bytes);
}

TEST_CASE("the trace recorder keeps profile.max_events events and counts the ones past it") {
  trace::set_max_events(5);
  trace::clear();
  trace::start();
  for (int i = 0; i < 8; ++i) trace::complete("span", "op", i, i + 1);
  trace::counter("memory", {{"bytes", 1.0}});
  CHECK(trace::full());
  trace::stop();
  CHECK(trace::event_count() == 5);
  CHECK(trace::dropped_events() == 4);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("mt_trace_bound_" + std::to_string(::getpid()) + ".json")).string();
  REQUIRE(trace::write(path, "{\"dropped_events\":4}"));
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t spans = 0;
  for (size_t at = text.find("\"ph\":\"X\""); at != std::string::npos; at = text.find("\"ph\":\"X\"", at + 1))
    ++spans;
  CHECK(spans == 5);
  CHECK(text.find("\"dropped_events\":4") != std::string::npos);
  std::remove(path.c_str());
  trace::clear();  // the count goes with the events
  CHECK(trace::dropped_events() == 0);
  CHECK(!trace::full());
  trace::set_max_events(SIZE_MAX);
}
