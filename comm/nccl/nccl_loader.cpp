// The NCCL backend of a CUDA build: make_nccl_group in libmeshtrain_cuda.so, through the loaded backend's table
// (runtime/core/cuda_table.h). nccl_built() does not load it: the auto backend asks only for a CUDA device,
// whose run has loaded it already.
#include "comm/nccl/nccl_group.h"
#include "runtime/core/cuda_table.h"

namespace mt {

bool nccl_built() { return true; }

std::unique_ptr<Group> make_nccl_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device) {
  return std::unique_ptr<Group>(cuda_backend().make_nccl_group(comm, std::move(name), std::move(world_ranks), device));
}

}  // namespace mt
