// Issue-3 benchmark. (1) Planning time per (source, target) pair on a 3-D
// mesh, uncached and cached. (2) Redistribution of a 16 MiB f32 tensor on a
// 1-D mesh of all ranks for S(0)->R, P->R, P->S(0), S(0)->S(1), beside the bare
// MPI collective on the same buffers in the same run; prints both and the ratio.
//   build/scripts/bench/bench_redistribute                     (1 process: planning times)
//   mpirun -np 4 build/scripts/bench/bench_redistribute [--iters N] [--mib M]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "comm/env.h"
#include "comm/mpi/mpi_group.h"
#include "parallel/dtensor.h"
#include "runtime/core/log.h"

using namespace mt;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void planning(int rank) {
  std::vector<MeshDim> mesh{{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}};
  std::vector<Placement> one{Placement::Replicate(), Placement::Shard(0), Placement::Shard(1), Placement::Partial()};
  std::vector<Placements> all{{}};
  for (int m = 0; m < 3; ++m) {
    std::vector<Placements> next;
    for (auto& p : all)
      for (auto& x : one) {
        auto q = p;
        q.push_back(x);
        next.push_back(q);
      }
    all = next;
  }
  std::vector<std::pair<DTensorSpec, DTensorSpec>> pairs;
  for (auto& a : all)
    for (auto& b : all)
      pairs.emplace_back(DTensorSpec::make(mesh, a, {4096, 4096}), DTensorSpec::make(mesh, b, {4096, 4096}));
  std::vector<double> unc;
  double worst = 0;
  for (auto& [a, b] : pairs) {
    auto t0 = Clock::now();
    Plan p = plan_redistribute_uncached(a, b);
    double t = seconds_since(t0);
    unc.push_back(t);
    worst = std::max(worst, t);
  }
  clear_plan_cache();
  for (auto& [a, b] : pairs) plan_redistribute(a, b);
  int reps = 20;
  auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r)
    for (auto& [a, b] : pairs) plan_redistribute(a, b);
  double cached = seconds_since(t0) / double(reps * pairs.size());
  double mean = 0;
  for (double t : unc) mean += t / double(unc.size());
  if (rank == 0)
    std::printf(
        "planning, 3-D mesh 2x2x2, %zu pairs of {R,S(0),S(1),P}^3: uncached mean %.1f us, median %.1f us, "
        "max %.1f us (target < 1000 us); cached %.3f us (target < 1 us)\n",
        pairs.size(), mean * 1e6, median(unc) * 1e6, worst * 1e6, cached * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnv env(&argc, &argv);
  init_logging(env.rank(), "warn");
  int iters = 10;
  int64_t mib = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--mib")) mib = std::atoll(argv[i + 1]);
  }
  // Planning is timed by one process alone (other ranks would share its cores).
  if (env.size() == 1) {
    planning(env.rank());
    return 0;
  }

  int n = env.size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n}});
  MPI_Comm comm = group_mpi_comm(mesh.group(0));
  int64_t side = 1;
  while (side * side * 4 < mib << 20) side *= 2;  // a square f32 tensor of `mib` MiB
  Shape shape{side, side};
  std::vector<double> v(static_cast<size_t>(side * side));
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i % 1000);
  Tensor x = from_values(v, shape, DType::f32);
  struct Case {
    const char* name;
    Placements from, to;
  };
  std::vector<Case> cases{{"S(0)->R", {Placement::Shard(0)}, {Placement::Replicate()}},
                          {"P->R", {Placement::Partial()}, {Placement::Replicate()}},
                          {"P->S(0)", {Placement::Partial()}, {Placement::Shard(0)}},
                          {"S(0)->S(1)", {Placement::Shard(0)}, {Placement::Shard(1)}}};
  if (env.rank() == 0)
    std::printf(
        "\nredistribute %lld MiB f32 (%lldx%lld) on %d ranks, median of %d (slowest rank per iteration)\n"
        "%-12s %12s %12s %8s  %s\n",
        (long long)mib, (long long)side, (long long)side, n, iters, "case", "ours_ms", "bare_ms", "ratio", "bare call");
  for (auto& c : cases) {
    DTensor src = distribute_tensor(x, mesh, c.from);
    Tensor local = src.local;
    int64_t cnt = local.numel();
    Tensor out = empty({cnt * n}, DType::f32), part = empty({cnt / n}, DType::f32), a2a = empty({cnt}, DType::f32);
    Tensor work = local.clone();
    std::vector<double> ours, bare;
    for (int it = -2; it < iters; ++it) {
      MPI_Barrier(comm);
      auto t0 = Clock::now();
      DTensor dst = redistribute(src, c.to);
      double t = seconds_since(t0);
      MPI_Barrier(comm);
      auto t1 = Clock::now();
      std::string name(c.name);
      if (name == "S(0)->R")
        MPI_Allgather(local.data_ptr(), int(cnt), MPI_FLOAT, out.data_ptr(), int(cnt), MPI_FLOAT, comm);
      else if (name == "P->R") MPI_Allreduce(MPI_IN_PLACE, work.data_ptr(), int(cnt), MPI_FLOAT, MPI_SUM, comm);
      else if (name == "P->S(0)")
        MPI_Reduce_scatter_block(local.data_ptr(), part.data_ptr(), int(cnt / n), MPI_FLOAT, MPI_SUM, comm);
      else MPI_Alltoall(local.data_ptr(), int(cnt / n), MPI_FLOAT, a2a.data_ptr(), int(cnt / n), MPI_FLOAT, comm);
      double tb = seconds_since(t1);
      if (it >= 0) ours.push_back(t), bare.push_back(tb);
    }
    MPI_Allreduce(MPI_IN_PLACE, ours.data(), iters, MPI_DOUBLE, MPI_MAX, comm);
    MPI_Allreduce(MPI_IN_PLACE, bare.data(), iters, MPI_DOUBLE, MPI_MAX, comm);
    double to = median(ours), tb = median(bare);
    const char* call = std::string(c.name) == "S(0)->R"   ? "MPI_Allgather"
                       : std::string(c.name) == "P->R"    ? "MPI_Allreduce"
                       : std::string(c.name) == "P->S(0)" ? "MPI_Reduce_scatter_block"
                                                          : "MPI_Alltoall (pre-packed)";
    if (env.rank() == 0) std::printf("%-12s %12.2f %12.2f %8.3f  %s\n", c.name, to * 1e3, tb * 1e3, to / tb, call);
  }
  return 0;
}
