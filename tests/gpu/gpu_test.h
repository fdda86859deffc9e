// What the GPU test files share: skipping without a device, this rank's device, inputs, poisoned outputs and
// the error measure of the device-vs-CPU checks.
#pragma once
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/tensor.h"
#include "runtime/kernels/ops.h"
#include "../mpi/mpi_world.h"
#include "../skip.h"
#include "../test_util.h"

// Without a device the case ends counted as skipped (tests/skip.h), never as passed.
#define MT_REQUIRE_GPU()                                                 \
  do {                                                                   \
    if (mt::cuda_device_count() == 0) MT_SKIP("no CUDA device visible"); \
  } while (0)

// On the emulated CUDA device (-Demulate_cuda=true, tests/emu: the kernels run on the CPU, every mma.sync through
// the warp emulator) the largest sizes of a case run only with MT_TEST_FULL=1 (scripts/test.sh --full); on a GPU
// always.
inline bool emulated_quick() {
#if defined(MT_CUDA_EMULATED)
  const char* f = std::getenv("MT_TEST_FULL");
  return !(f && *f && std::string(f) != "0");
#else
  return false;
#endif
}

// Ranks share the visible devices round robin.
inline int test_device() { return world_rank() % mt::cuda_device_count(); }

inline mt::Device gpu() { return mt::Device::cuda(test_device()); }

// Normal values, rounded to bf16 when bf16_exact (so the bf16 kernel and its f32 reference see the same
// inputs), held in an f32 host tensor.
inline mt::Tensor rnd(const mt::Shape& s, uint64_t seed, double scale = 1.0, bool bf16_exact = true) {
  return mt::test::randn(s, seed, mt::DType::f32, scale, bf16_exact);
}
// The same values as a bf16 tensor on the GPU.
inline mt::Tensor bf(const mt::Tensor& t) {
  mt::Tensor b = mt::empty(t.shape(), mt::DType::bf16);
  mt::convert(b, t);
  return b.to(gpu());
}
// A device tensor of NaN: an output the kernel must overwrite.
inline mt::Tensor nan_dev(const mt::Shape& s, mt::DType dt) { return mt::test::poisoned(s, dt, gpu()); }
// Norm of the difference over the norm of the reference (tests/test_util.h: a NaN fails, infinities must match).
inline double rel(const mt::Tensor& got_dev, const mt::Tensor& want) { return mt::test::rel_err(got_dev, want); }
#define CHECK_BF16(got, want) CHECK(rel(got, want) < 1e-2)
#define CHECK_F32(got, want) CHECK(rel(got, want) < 1e-5)
