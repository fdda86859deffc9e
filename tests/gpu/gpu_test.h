// What the GPU test files share: skipping without a device, this rank's device, inputs, poisoned outputs and
// the error measure of the device-vs-CPU checks.
#pragma once
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <random>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/tensor.h"
#include "runtime/kernels/ops.h"
#include "../mpi/mpi_world.h"

#define MT_REQUIRE_GPU()                                   \
  do {                                                     \
    if (mt::cuda_device_count() == 0) {                    \
      MESSAGE("no CUDA device visible: GPU test skipped"); \
      return;                                              \
    }                                                      \
  } while (0)

// Ranks share the visible devices round robin.
inline int test_device() { return world_rank() % mt::cuda_device_count(); }

inline mt::Device gpu() { return mt::Device::cuda(test_device()); }

// Normal values, rounded to bf16 when bf16_exact (so the bf16 kernel and its f32 reference see the same
// inputs), held in an f32 host tensor.
inline mt::Tensor rnd(const mt::Shape& s, uint64_t seed, double scale = 1.0, bool bf16_exact = true) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> n(0, scale);
  std::vector<double> v(size_t(mt::shape_numel(s)));
  for (auto& x : v) x = bf16_exact ? double(float(mt::bf16(float(n(g))))) : n(g);
  return mt::from_values(v, s, mt::DType::f32);
}
// The same values as a bf16 tensor on the GPU.
inline mt::Tensor bf(const mt::Tensor& t) {
  mt::Tensor b = mt::empty(t.shape(), mt::DType::bf16);
  mt::convert(b, t);
  return b.to(gpu());
}
// A device tensor of NaN: an output the kernel must overwrite.
inline mt::Tensor nan_dev(const mt::Shape& s, mt::DType dt) {
  std::vector<double> v(size_t(mt::shape_numel(s)), std::nan(""));
  return mt::from_values(v, s, dt).to(gpu());
}
// Norm of the difference over the norm of the reference; a NaN fails, infinities (the -inf log-sum-exp of
// rows that see no key) must match exactly.
inline double rel(const mt::Tensor& got_dev, const mt::Tensor& want) {
  auto a = mt::to_f64(got_dev), b = mt::to_f64(want);
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}
#define CHECK_BF16(got, want) CHECK(rel(got, want) < 1e-2)
#define CHECK_F32(got, want) CHECK(rel(got, want) < 1e-5)
