// The world communicator's size and this process's rank, for the multi-rank test files, and the CPU
// threads shared among the ranks of a node.
#pragma once
#include <mpi.h>

#include <algorithm>

#include "runtime/kernels/ops.h"

namespace mt {
class MpiEnv;
}
// The job's MpiEnv (the test main's), for the tests that build a whole run as the commands do (make_train_run).
const mt::MpiEnv& test_env();

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// This node's cores shared among its ranks for the CPU kernels (OpenMP threads of 8 ranks on 2 cores
// otherwise spin against each other: ten times slower), restored at the end. Collective over the world.
struct ThreadsPerRank {
  int saved = mt::cpu_threads();
  ThreadsPerRank() {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local = 1;
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
    mt::set_cpu_threads(std::max(1, saved / local));
  }
  ~ThreadsPerRank() { mt::set_cpu_threads(saved); }
};
