// MPI backend of Group. Host tensors go straight to MPI; device tensors are
// staged through pinned host buffers (so several ranks can share one GPU in
// tests, which NCCL does not allow). bf16 reductions use a user-defined MPI op.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

#include "comm/group.h"

namespace mt {

// Implemented by every Group that sits on an MPI communicator (MPI and NCCL
// groups both do: NCCL bootstraps over it).
struct HasMpiComm {
  virtual ~HasMpiComm() = default;
  virtual MPI_Comm mpi_comm() const = 0;
};

// Takes ownership of comm (freed with the group). world_ranks: the world rank
// of each member in group-rank order.
std::unique_ptr<Group> make_mpi_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks);
// The MPI communicator underneath an MPI or NCCL group (for bootstrap and for
// benchmarks that time bare MPI on the same ranks).
MPI_Comm group_mpi_comm(const Group& g);
MPI_Datatype mpi_datatype(DType d);  // bf16 maps to a 2-byte type with its own ops

}  // namespace mt
