#include "comm/mpi/mpi_baseline.h"

#include <chrono>

#include "comm/control.h"
#include "comm/mpi/mpi_group.h"
#include "comm/watchdog.h"

namespace mt::mpi_baseline {

void barrier(const Group& g, std::string_view label) { control_barrier(group_mpi_comm(g), label, g.describe()); }

void all_reduce(const Group& g, std::span<double> values, ReduceOp op, std::string_view label) {
  control_all_reduce(group_mpi_comm(g), values, op, label, g.describe());
}

void all_reduce(const Group& g, std::span<int64_t> values, ReduceOp op, std::string_view label) {
  control_all_reduce(group_mpi_comm(g), values, op, label, g.describe());
}

namespace {

void run(MPI_Comm c, const std::string& op, const Tensor& in, const Tensor& out, int me, int n) {
  auto ty = mpi_datatype(in.dtype());
  int cnt = int(in.numel());
  if (op == "all_reduce") MPI_Allreduce(MPI_IN_PLACE, in.data_ptr(), cnt, ty, MPI_SUM, c);
  else if (op == "all_gather") MPI_Allgather(in.data_ptr(), cnt, ty, out.data_ptr(), cnt, ty, c);
  else if (op == "reduce_scatter")
    MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), int(out.numel()), ty, MPI_SUM, c);
  else if (op == "all_to_all") MPI_Alltoall(in.data_ptr(), cnt / n, ty, out.data_ptr(), cnt / n, ty, c);
  else if (op == "broadcast") MPI_Bcast(in.data_ptr(), cnt, ty, 0, c);
  else if (op == "ring_shift")
    MPI_Sendrecv(in.data_ptr(), cnt, ty, (me + 1) % n, 99, out.data_ptr(), cnt, ty, (me + n - 1) % n, 99, c,
                 MPI_STATUS_IGNORE);
  else MPI_Barrier(c);
}

}  // namespace

double time_collective(const Group& g, const std::string& op, const Tensor& in, const Tensor& out,
                       std::string_view barrier_label) {
  const MPI_Comm comm = group_mpi_comm(g);
  control_barrier(comm, barrier_label, g.describe());
  WatchdogScope w(op.c_str(), g);
  const auto t0 = std::chrono::steady_clock::now();
  run(comm, op, in, out, g.rank(), g.size());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mt::mpi_baseline
