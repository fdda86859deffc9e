#include <doctest/doctest.h>
#include <mpi.h>

#include <chrono>

#include "../check_error.h"
#include "comm/mesh.h"
#include "comm/watchdog.h"
#include "mpi_world.h"
#include "../skip.h"

using namespace mt;

namespace {
// The training mesh's "dp" name (parallel_dims.h gives it; the mesh itself knows no names).
MeshOptions with_dp() {
  MeshOptions o;
  o.group_names = {{"dp", {"dp_replicate", "dp_shard"}}};
  return o;
}
}  // namespace

TEST_CASE("mesh coordinates are row-major with the last dim innermost") {
  int n = world_size();
  if (n < 4 || n % 2) MT_SKIP("needs an even number of ranks >= 4");
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n / 2}, {"tp", 2}}, with_dp());
  int r = world_rank();
  CHECK(mesh.coordinate() == std::vector<int>{r / 2, r % 2});
  CHECK(mesh.world_rank_of(mesh.coordinate()) == r);
  // tp neighbours are consecutive ranks; dp_shard members stride by 2.
  CHECK(mesh.group("tp").world_ranks() == std::vector<int>{r - r % 2, r - r % 2 + 1});
  CHECK(mesh.group("tp").rank() == r % 2);
  CHECK(mesh.group("dp_shard").world_ranks()[1] - mesh.group("dp_shard").world_ranks()[0] == 2);
  CHECK(&mesh.group("dp") == &mesh.group("dp_shard"));  // only dp_shard of dp's dims exists
  CHECK(mesh.group("world").size() == n);
  CHECK(mesh.group("world").rank() == r);
}

TEST_CASE("3-D mesh: dp flattens dp_replicate x dp_shard, named sets flatten in mesh order") {
  if (world_size() != 8) MT_SKIP("needs 8 ranks");
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}}, with_dp());
  int r = world_rank();
  Group& dp = mesh.group("dp");
  CHECK(&mesh.group("dp_shard,dp_replicate") == &dp);  // the same set of dims is the same group
  CHECK(dp.size() == 4);
  CHECK(dp.rank() == r / 2);
  std::vector<int> expect;
  for (int i = 0; i < 4; ++i) expect.push_back(i * 2 + r % 2);
  CHECK(dp.world_ranks() == expect);
  Group& st = mesh.group("tp,dp_shard");  // order given does not matter
  CHECK(st.size() == 4);
  CHECK(st.world_ranks()[0] == (r / 4) * 4);
  // A sum over dp equals the sum of the dp members' world ranks.
  Tensor t = from_values({double(r)}, {1}, DType::i64);
  dp.all_reduce(t, ReduceOp::sum);
  int64_t s = 0;
  for (int w : expect) s += w;
  CHECK(t.at<int64_t>(0) == s);
}

TEST_CASE("mesh errors") {
  int n = world_size();
  CHECK_ERROR_CONTAINS(DeviceMesh::create({{"tp", n + 1}}), "has " + std::to_string(n + 1) + " ranks but the job has");
  DeviceMesh m = DeviceMesh::create({{"dp_replicate", n}});
  CHECK_ERROR_CONTAINS(m.group("cp"), "[mesh] mesh dp_replicate=" + std::to_string(n) + " has no dim 'cp'");
  CHECK_ERROR_CONTAINS(m.group(3), "out of range");
  MeshOptions named;
  named.group_names = {{"cp", {"cp_ring", "cp_ulysses"}}};
  DeviceMesh m2 = DeviceMesh::create({{"dp_replicate", n}}, named);
  CHECK_ERROR_CONTAINS(m2.group("cp"), "group 'cp': none of its dims is in mesh dp_replicate=");
  named.group_names = {{"dp_replicate", {"dp_replicate"}}};
  CHECK_ERROR_CONTAINS(DeviceMesh::create({{"dp_replicate", n}}, named),
                       "'dp_replicate' names both a mesh dim and a flattened group");
  MeshOptions o;
  o.backend = "nccl";
  CHECK_ERROR_CONTAINS(DeviceMesh::create({{"dp_replicate", n}}, o), "the nccl backend needs device cuda");
  o.backend = "gloo";
  CHECK_ERROR_CONTAINS(DeviceMesh::create({{"dp_replicate", n}}, o), "unknown comm backend 'gloo'");
}

TEST_CASE("the mesh table lists every rank on rank 0") {
  int n = world_size();
  DeviceMesh m = DeviceMesh::create({{"dp_replicate", n}});
  std::string t = m.table();
  if (world_rank() == 0) {
    CHECK(t.find("dp_replicate=" + std::to_string(n)) != std::string::npos);
    int lines = 0;
    for (char c : t) lines += c == '\n';
    CHECK(lines == n + 2);
  } else {
    CHECK(t.empty());
  }
}

// The watchdog's thread erases an operation whose done() already holds when it polls (every 100 ms): registering one
// on a Group must not look its id up again after the lock is let go (it threw map::at once in CI, from an NCCL send
// that finished at once). 1.5 s of registrations put about 15 polls among them, each landing between two of
// registering's steps about a third of the time before the fix.
TEST_CASE("watchdog: an operation done at once registers on its group without a race with the polling thread") {
  DeviceMesh m = DeviceMesh::create({{"dp_replicate", world_size()}});
  const Group& g = m.group("dp_replicate");
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  int64_t n = 0;
  auto spin = [&] {
    for (; std::chrono::steady_clock::now() < until; ++n)
      watchdog_end(watchdog_begin("test op", g, [] { return true; }));
  };
  CHECK_NOTHROW(spin());
  CHECK(n > 1000);
}
