// TEMPORARY stand-in (the real one comes from the h-ground branch).
#include "comm/world.h"

#include <mpi.h>

#include <cstdint>

#include "comm/control.h"

namespace mt::world {
int rank() { int r = 0; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int size() { int n = 1; MPI_Comm_size(MPI_COMM_WORLD, &n); return n; }
void barrier(std::string_view label) { control_barrier(MPI_COMM_WORLD, label); }
namespace {
MPI_Op op_of(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : op == ReduceOp::min ? MPI_MIN : MPI_SUM; }
template <class T> MPI_Datatype type_of();
template <> MPI_Datatype type_of<double>() { return MPI_DOUBLE; }
template <> MPI_Datatype type_of<int>() { return MPI_INT; }
template <> MPI_Datatype type_of<int64_t>() { return MPI_INT64_T; }
template <> MPI_Datatype type_of<uint64_t>() { return MPI_UINT64_T; }
}  // namespace
template <class T> void all_reduce(std::span<T> v, ReduceOp op, std::string_view label) {
  control_all_reduce(MPI_COMM_WORLD, v.data(), int(v.size()), type_of<T>(), op_of(op), label);
}
template void all_reduce<double>(std::span<double>, ReduceOp, std::string_view);
template void all_reduce<int>(std::span<int>, ReduceOp, std::string_view);
template void all_reduce<int64_t>(std::span<int64_t>, ReduceOp, std::string_view);
template void all_reduce<uint64_t>(std::span<uint64_t>, ReduceOp, std::string_view);
void all_gather_bytes(void* out, const void* in, size_t bytes, std::string_view label) {
  control_all_gather(MPI_COMM_WORLD, out, in, int(bytes), MPI_BYTE, label);
}
void broadcast(std::span<std::byte> b, int root, std::string_view label) {
  control_broadcast(MPI_COMM_WORLD, b.data(), int(b.size()), MPI_BYTE, root, label);
}
}  // namespace mt::world
