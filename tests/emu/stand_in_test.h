// Shared by the suites of the emulated libraries (test_cublaslt_emu.cpp, test_nccl_emu.cpp): the tests' own bf16
// rounding (not the runtime's, so that the stand-ins are checked against an independent one), a device
// allocation, and the check of a refused call.
#pragma once
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "tests/emu/capture_stderr.h"
#include "tests/emu/device_registry.h"

// f32 to bf16, rounded to nearest even; and back.
inline uint16_t to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  w += 0x7fffu + ((w >> 16) & 1u);
  return uint16_t(w >> 16);
}
inline float from_bf16(uint16_t u) {
  const uint32_t w = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// A device allocation (emulated: host memory the registry knows), freed with its scope.
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : bytes(n) { REQUIRE(cudaMalloc(&p, n) == cudaSuccess); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(p); }
  unsigned char* at(size_t byte_offset) const { return static_cast<unsigned char*>(p) + byte_offset; }
};

// The call returns `want` and reports once, naming each of the words (a macro, so that a failed check names the
// test's line).
#define EXPECT_REPORTED(expr, want, ...)                                                                               \
  do {                                                                                                                 \
    const long long before_ = emu::reports();                                                                          \
    CaptureStderr cap_;                                                                                                \
    const auto got_ = (expr);                                                                                          \
    const std::string text_ = cap_.text();                                                                             \
    CHECK(got_ == (want));                                                                                             \
    CHECK(emu::reports() > before_);                                                                                   \
    for (const char* w_ : {__VA_ARGS__}) CHECK_MESSAGE(text_.find(w_) != std::string::npos, "'", w_, "' in: ", text_); \
  } while (0)
