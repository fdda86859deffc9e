// world.h on MPI_COMM_WORLD: each call is control.h's watched collective on it, named as the world ("" where).
#include "comm/world.h"

#include <mpi.h>

#include <climits>

#include "comm/control.h"
#include "runtime/core/error.h"

namespace mt::world {

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

void barrier(std::string_view label, double extra_wait_s) {
  control_barrier(MPI_COMM_WORLD, label, {}, extra_wait_s);
}

template <Reducible T> void all_reduce(std::span<T> values, ReduceOp op, std::string_view label) {
  control_all_reduce(MPI_COMM_WORLD, values, op, label);
}
template void all_reduce(std::span<int>, ReduceOp, std::string_view);
template void all_reduce(std::span<int64_t>, ReduceOp, std::string_view);
template void all_reduce(std::span<uint64_t>, ReduceOp, std::string_view);
template void all_reduce(std::span<double>, ReduceOp, std::string_view);

namespace {
int byte_count(size_t bytes, std::string_view label) {
  MT_CHECK(bytes <= size_t(INT_MAX), "comm", "'{}': {} bytes exceed MPI's int count", label, bytes);
  return int(bytes);
}
}  // namespace

void detail::all_gather_bytes(std::span<std::byte> out, std::span<const std::byte> mine, std::string_view label) {
  MT_CHECK(out.size() == mine.size() * size_t(size()), "comm", "'{}': {} bytes to gather {} from each of {} ranks",
           label, out.size(), mine.size(), size());
  control_all_gather(MPI_COMM_WORLD, out.data(), mine.data(), byte_count(mine.size(), label), MPI_BYTE, label);
}

void broadcast(std::span<std::byte> bytes, int root, std::string_view label) {
  control_broadcast(MPI_COMM_WORLD, bytes.data(), byte_count(bytes.size(), label), MPI_BYTE, root, label);
}

ClockSync clock_sync(int rounds) { return control_clock_sync(MPI_COMM_WORLD, rounds); }

}  // namespace mt::world
