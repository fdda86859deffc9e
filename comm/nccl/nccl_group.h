// NCCL backend of Group: device buffers only, collectives on the group's own
// stream, ordered after the compute stream's work by an event and, in the
// blocking form, the compute stream made to wait for the collective (no host
// synchronisation). The unique id is broadcast over the group's MPI
// communicator. In a build without CUDA, make_nccl_group throws.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

#include "comm/group.h"

namespace mt {

bool nccl_built();
// Takes ownership of comm (used for bootstrap and barrier). device: this rank's CUDA device.
std::unique_ptr<Group> make_nccl_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device);

}  // namespace mt
