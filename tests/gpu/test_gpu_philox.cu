// philox.h on the device gives the same bits as on the host, so random
// parameters are the same whether a CPU or a CUDA rank makes them. (No
// error.h here: fmt 9 does not compile under nvcc, so plain status checks.)
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "runtime/core/philox.h"
#include "runtime/core/device.h"
#include "runtime/kernels/cuda/launch.cuh"
#include "../skip.h"

namespace {
__global__ void fill(float* u, float* z, uint64_t seed, uint64_t stream, uint64_t base, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    u[i] = mt::philox::uniform(seed, stream, base + uint64_t(i));
    z[i] = mt::philox::normal(seed, stream, base + uint64_t(i));
  }
}
}  // namespace

TEST_CASE("philox uniform and normal are bit-identical on CPU and CUDA") {
  if (mt::cuda_device_count() == 0) MT_SKIP("no GPU");
  const int n = 1 << 20;
  uint64_t seed = 20261122, stream = mt::philox::stream_id("model.layers.7.self_attn.q_proj.weight"),
           base = (uint64_t(1) << 33) + 5;  // indices past 2^32 use the counter's high word
  float *du, *dz;
  REQUIRE(cudaMalloc(&du, n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&dz, n * sizeof(float)) == cudaSuccess);
  MT_LAUNCH(fill, (n + 255) / 256, 256, 0, nullptr, du, dz, seed, stream, base, n);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  std::vector<float> u(n), z(n);
  REQUIRE(cudaMemcpy(u.data(), du, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(z.data(), dz, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(du);
  cudaFree(dz);
  int64_t diff_u = 0, diff_z = 0;
  for (int i = 0; i < n; ++i) {
    float hu = mt::philox::uniform(seed, stream, base + uint64_t(i));
    float hz = mt::philox::normal(seed, stream, base + uint64_t(i));
    diff_u += std::memcmp(&hu, &u[size_t(i)], 4) != 0;
    diff_z += std::memcmp(&hz, &z[size_t(i)], 4) != 0;
  }
  CHECK(diff_u == 0);
  CHECK(diff_z == 0);
}
