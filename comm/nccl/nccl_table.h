// comm's table in libmeshtrain_cuda.so (runtime/core/cuda_table.h holds the ground's): the NCCL backend's entry
// points, which the library exports through mt_nccl_backend_v1() and nccl_loader.cpp finds with
// cuda_backend_symbol(). Private to comm/nccl. Change the table: bump kNcclBackendAbi.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <mpi.h>

namespace mt {

class Group;

constexpr uint32_t kNcclBackendAbi = 1;

struct NcclBackend {
  uint32_t abi = kNcclBackendAbi;
  uint32_t size = sizeof(NcclBackend);
  // nccl_group.h's make_nccl_group: the group, owned by the caller.
  Group* (*make_nccl_group)(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device);
};

}  // namespace mt

extern "C" {
// The library's export for comm.
const mt::NcclBackend* mt_nccl_backend_v1();
}
