// The collectives' self-check of `meshtrain check`: every collective run on a set of groups, each result compared
// with values computed without communication, and each timed (median of the iterations) in nccl-tests'
// conventions beside Open MPI's own call on the same buffers (comm/mpi/mpi_baseline.h). Here so that the check
// needs only Group and DeviceMesh; choosing the mesh and the options is the command's.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "comm/mesh.h"

namespace mt {

// Every collective the check knows, in the order it runs them when none are named.
const std::vector<std::string>& self_check_ops();

// "1K:64M" -> 1 KiB, 2 KiB, ..., 64 MiB (factor 2); "4M" -> one size. Binary units (B, K/KiB, M/MiB, G/GiB).
// Throws "[check] ..." naming the size and the spec.
std::vector<int64_t> parse_size_range(const std::string& spec);

struct SelfCheckOptions {
  std::vector<std::string> ops;  // some of self_check_ops(), checked by the caller
  std::vector<int64_t> sizes;    // the bytes each op but barrier is timed at
  int iters = 20;                // timed repetitions per size, >= 1 (the median is reported)
  int warmup = 3;                // untimed repetitions first
  bool compare_mpi = true;       // time Open MPI's own call beside ours (MPI backend, host buffers only)
  std::ostream* json = nullptr;  // rank 0: one JSON object per result line; null: none
};

// Every dim's group, then each named group and the whole world when they add a new set of ranks (a named group
// of one present dim is that dim's group).
std::vector<Group*> self_check_groups(DeviceMesh& mesh, const std::vector<MeshGroupName>& names);

// On each group in turn, on the mesh's device: each op's results in f32, bf16 and i64, blocking and async, on a
// small odd count (a wrong one logged as an error), then each op timed at each size with its result checked
// again. World rank 0 prints each op's table on stdout as it goes: size, time, algorithm and bus bandwidth, bare
// MPI's bus bandwidth and ratio where compared, "ok" or "WRONG". Collective over the mesh: every rank calls it
// with the same groups and options. Returns the wrong results counted by this rank (values on this rank, timed
// sizes wrong on any rank of the group).
int64_t run_self_check(const std::vector<Group*>& groups, Device device, const SelfCheckOptions& opt);

}  // namespace mt
