// meshtrain check: the cluster self-check. Runs every collective on every
// mesh dim and on the flattened groups, verifies each result against values
// computed without communication, and times it (median of --iters) in
// nccl-tests' conventions, beside the bare MPI call on the same buffers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/train/run_context.h"

namespace mt {

struct CheckArgs {
  std::string mesh;  // "dp_shard=2,cp=2,tp=2"; empty: from the config
  std::string sizes = "1K:64M";
  int iters = 20;
  int warmup = 3;
  std::string device;            // cpu | cuda; empty: comm.device
  std::string backend;           // auto | mpi | nccl; empty: comm.backend
  std::vector<std::string> ops;  // empty: all
  bool compare_mpi = true;       // time bare MPI beside ours (host buffers)
  std::string json;              // write the results as JSON lines here (rank 0)
};

void add_check_options(CLI::App* sub, CheckArgs& args);
int run_check_command(const RunContext& ctx, const CheckArgs& args);

// "1K:64M" -> 1024, 2048, ..., 64 MiB (factor 2); "4M" -> one size. Binary units.
std::vector<int64_t> parse_size_range(const std::string& spec);

}  // namespace mt
