// The NCCL backend of a CUDA build: make_nccl_group in libmeshtrain_cuda.so, through comm's table there
// (nccl_table.h), found in the library the core has loaded (runtime/core/cuda_table.h). nccl_built() does not load
// it: the auto backend asks only for a CUDA device, whose run has loaded it already.
#include "comm/nccl/nccl_group.h"
#include "comm/nccl/nccl_table.h"
#include "runtime/core/cuda_table.h"
#include "runtime/core/error.h"

namespace mt {

namespace {

// Loads the library on the first call; a library without this build's table is an error, as the core's would be.
const NcclBackend& nccl_backend() {
  static const NcclBackend* const table = [] {
    auto entry = reinterpret_cast<const NcclBackend* (*)()>(cuda_backend_symbol("mt_nccl_backend_v1"));
    const NcclBackend* t = entry ? entry() : nullptr;
    if (!t || t->abi != kNcclBackendAbi || t->size != sizeof(NcclBackend))
      fail("cuda", "{} is not a meshtrain CUDA backend of this build ({})", kCudaBackendLibrary,
           !t ? "no mt_nccl_backend_v1" : "its NCCL table differs: rebuild meshtrain and the library together");
    return t;
  }();
  return *table;
}

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Group> make_nccl_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device) {
  return std::unique_ptr<Group>(nccl_backend().make_nccl_group(comm, std::move(name), std::move(world_ranks), device));
}

}  // namespace mt
