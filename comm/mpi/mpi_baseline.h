// `meshtrain check`'s baseline: Open MPI's own collective on the communicator under a Group, on the buffers the
// Group's collective uses, so that the check sets the wrapper's time beside the library's; and the check's own
// bookkeeping on that communicator (the barriers that start each timed call together, the reductions of the times
// and of the wrong-element counts), done by control.h's watched collectives so that it never counts as the
// group's traffic. Messages name the group (g.describe()).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "comm/group.h"

namespace mt::mpi_baseline {

void barrier(const Group& g, std::string_view label);
// In place, element-wise over g's ranks.
void all_reduce(const Group& g, std::span<double> values, ReduceOp op, std::string_view label);
void all_reduce(const Group& g, std::span<int64_t> values, ReduceOp op, std::string_view label);

// This rank's seconds in Open MPI's own `op` on g's communicator, started by a barrier labelled barrier_label on
// every rank: op is one of the check's (all_reduce: sum in place on in; all_gather, reduce_scatter (sum) and
// all_to_all: in to out; broadcast: from rank 0 in place on in; ring_shift: in to the next rank's out; anything
// else: a barrier); in and out are host buffers as the Group's collective takes them (out undefined for in-place
// ops). Watched as the Group's op, with the watchdog's bookkeeping outside the timed span.
double time_collective(const Group& g, const std::string& op, const Tensor& in, const Tensor& out,
                       std::string_view barrier_label);

}  // namespace mt::mpi_baseline
