// Small host-side collectives on a bare MPI communicator, for the calls that
// run outside a Group: the config agreement and mesh table at start-up, the
// per-step stop signal, the checkpoint barrier, the exit barrier, and the
// self-check's own bookkeeping. Each one is non-blocking MPI polled under the
// watchdog. Before it, every rank posts an "arrived at <label>" marker to its
// peers (small non-blocking sends; with more than 64 ranks, only to and from
// the communicator's rank 0), so a timeout names the ranks that never reached
// the call, and a rank whose peers are in a different call fails at once
// naming both calls. Labels must be the same on every rank. Private to comm: the layers above reach the world
// through world.h and a Group's communicator through mpi/mpi_baseline.h.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "comm/group.h"
#include "comm/world.h"

namespace mt {

// where: what the communicator is, for messages ("" = the world). extra_wait_s: added to the watchdog's timeout
// for this call (world.h's barrier).
void control_barrier(MPI_Comm comm, std::string_view label, const std::string& where = {}, double extra_wait_s = 0);
void control_all_reduce(MPI_Comm comm, void* buf, int count, MPI_Datatype type, MPI_Op op, std::string_view label,
                        const std::string& where = {});
// Typed and in place (T: world.h's Reducible; avg: the sum divided by the ranks, in T's arithmetic).
template <class T>
void control_all_reduce(MPI_Comm comm, std::span<T> values, ReduceOp op, std::string_view label,
                        const std::string& where = {});
// out holds size * count elements, rank r's in at r * count.
void control_all_gather(MPI_Comm comm, void* out, const void* in, int count, MPI_Datatype type, std::string_view label,
                        const std::string& where = {});
void control_broadcast(MPI_Comm comm, void* buf, int count, MPI_Datatype type, int root, std::string_view label,
                       const std::string& where = {});
// out (size * count elements) is written on root only.
void control_gather(MPI_Comm comm, void* out, const void* in, int count, MPI_Datatype type, int root,
                    std::string_view label, const std::string& where = {});

// Clock alignment for traces (world.h's ClockSync). Collective over comm.
ClockSync control_clock_sync(MPI_Comm comm, int rounds = 8);

}  // namespace mt
