// The NCCL backend in a build without CUDA.
#include "comm/nccl/nccl_group.h"
#include "runtime/core/error.h"

namespace mt {

bool nccl_built() { return false; }

std::unique_ptr<Group> make_nccl_group(MPI_Comm, std::string name, std::vector<int>, int) {
  fail("nccl", "meshtrain was built without CUDA/NCCL (cannot make group '{}'; use comm.backend=mpi)", name);
}

void fail_nccl(int code, void*, const char* call, const char* file, int line) {
  throw Error(fmt::format("[nccl] {} failed with code {} at {}", call, code, where(file, line)));
}

}  // namespace mt
