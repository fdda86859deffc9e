// What the GPU test files share: skipping without a device, and this rank's device.
#pragma once
#include <doctest/doctest.h>
#include <mpi.h>

#include "runtime/core/device.h"

#define MT_REQUIRE_GPU()                                   \
  do {                                                     \
    if (mt::cuda_device_count() == 0) {                    \
      MESSAGE("no CUDA device visible: GPU test skipped"); \
      return;                                              \
    }                                                      \
  } while (0)

// Ranks share the visible devices round robin.
inline int test_device() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r % mt::cuda_device_count();
}
