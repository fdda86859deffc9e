// Every collective of Group, one suite run over each comm backend: MPI on host tensors, NCCL on device
// tensors (one GPU per rank; counted as skipped where NCCL is not built, no device is visible or ranks would
// share a device), and MPI staging device tensors through the host (all_reduce and all_gather). Every group of the 1-D, 2-D and 3-D meshes
// that fit the world size; element counts 0, 1, odd, large and unequal per rank; f32, bf16 and i64; blocking
// and async. Expected values are computed locally from the formula that made the inputs.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <functional>
#include <string>

#include "../check_error.h"
#include "../skip.h"
#include "comm/comm_counters.h"
#include "comm/mesh.h"
#include "comm/mpi/mpi_group.h"
#include "comm/nccl/nccl_group.h"
#include "mpi_world.h"
#include "runtime/core/device.h"

using namespace mt;

namespace {

// Rank r's input at element i: small integers, exact in every dtype's reductions.
double val(int r, int64_t i) { return double((r * 5 + 1) % 11) + double(i % 7); }

// Where a backend's buffers live and how its meshes are made.
struct Backend {
  std::string name;  // mpi | nccl | mpi-staged
  std::string comm;  // the MeshOptions backend
  bool on_device;
};
const Backend kMpi{"mpi", "mpi", false}, kNccl{"nccl", "nccl", true}, kStaged{"mpi-staged", "mpi", true};

// Why a backend cannot run here (empty: it can). The same answer on every rank.
std::string unavailable(const Backend& b) {
  if (!b.on_device) return "";
  if (cuda_device_count() == 0) return "no CUDA device visible";
  if (b.comm == "nccl" && !nccl_built()) return "NCCL not built";
  if (b.comm == "nccl" && world_size() > cuda_device_count())
    return "more ranks than GPUs (NCCL needs one GPU per rank)";
  return "";
}

Device device_of(const Backend& b) {
  return b.on_device ? Device::cuda(world_rank() % cuda_device_count()) : Device::cpu();
}

Tensor make(const Backend& b, int r, int64_t n, DType dt, int64_t base = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = val(r, base + i);
  Tensor t = from_values(v, {n}, dt);
  return b.on_device ? t.to(device_of(b)) : t;
}
Tensor zeros_on(const Backend& b, int64_t n, DType dt) { return zeros({n}, dt, device_of(b)); }

double reduce_expect(ReduceOp op, int n, int64_t i, DType dt) {
  double s = 0, mx = -1e30, mn = 1e30;
  for (int r = 0; r < n; ++r) {
    double x = val(r, i);
    s += x;
    mx = std::max(mx, x);
    mn = std::min(mn, x);
  }
  switch (op) {
    case ReduceOp::sum:
      return s;
    case ReduceOp::max:
      return mx;
    case ReduceOp::min:
      return mn;
    case ReduceOp::avg:
      if (dt == DType::i64) return double(int64_t(s) / n);
      if (dt == DType::bf16) return double(float(bf16(float(bf16(float(s))) / float(n))));
      return double(float(s) / float(n));
  }
  return 0;
}

// NCCL averages bf16 in its own precision: within 1e-2; everything else is exact (small integers) or f32.
double tol(const Backend& b, DType dt, ReduceOp op) {
  return op == ReduceOp::avg && dt == DType::bf16 && b.comm == "nccl" ? 1e-2 : 1e-6;
}

// Number of elements of got that differ from want(i).
int64_t mismatches(const Tensor& got, const std::function<double(int64_t)>& want, double rel = 1e-6) {
  auto v = to_f64(got);
  int64_t bad = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double w = want(int64_t(i));
    if (std::abs(v[i] - w) > rel * std::max(1.0, std::abs(w))) ++bad;
  }
  return bad;
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> s(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) s[i + 1] = s[i] + counts[i];
  return s;
}

// The meshes whose sizes multiply to the world size: 1-D always, 2-D and 3-D when they fit.
std::vector<std::vector<MeshDim>> meshes_for(int world) {
  std::vector<std::vector<MeshDim>> m{{{"dp_replicate", world}}};
  if (world % 2 == 0 && world >= 4) m.push_back({{"dp_shard", 2}, {"tp", world / 2}});
  if (world == 8) m.push_back({{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}});
  return m;
}

// Runs f on every group (each dim, dp_replicate x dp_shard, world) of every mesh that fits, made by backend b.
void for_each_group(const Backend& b, const std::function<void(Group&)>& f) {
  MeshOptions o;
  o.device = device_of(b);
  o.backend = b.comm;
  for (auto& dims : meshes_for(world_size())) {
    DeviceMesh mesh = DeviceMesh::create(dims, o);
    CHECK(mesh.backend() == b.comm);
    for (int d = 0; d < mesh.ndim(); ++d) f(mesh.group(d));
    if (mesh.has_dim("dp_replicate") && mesh.has_dim("dp_shard")) f(mesh.group("dp_replicate,dp_shard"));
    f(mesh.group("world"));
  }
}

const DType kDtypes[] = {DType::f32, DType::bf16, DType::i64};
const int64_t kCounts[] = {0, 1, 7, 1001};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

void all_reduce_case(const Backend& b) {
  for_each_group(b, [&](Group& g) {
    for (DType dt : kDtypes)
      for (int64_t c : kCounts)
        for (ReduceOp op : kOps)
          for (bool async : {false, true}) {
            Tensor t = make(b, g.rank(), c, dt);
            Work w = g.all_reduce(t, op, async);
            w.wait();
            INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " count ", c, " op ", reduce_op_name(op), " async ",
                 async);
            if (async) CHECK(w.test());
            CHECK(t.device() == device_of(b));
            CHECK(mismatches(
                      t, [&](int64_t i) { return reduce_expect(op, g.size(), i, dt); }, tol(b, dt, op)) == 0);
          }
    // Out of place: the input is left alone.
    for (DType dt : kDtypes)
      for (ReduceOp op : kOps) {
        Tensor in = make(b, g.rank(), 7, dt), keep = in.clone(), out = zeros_on(b, 7, dt);
        g.all_reduce(out, in, op);
        CHECK(equal(in.to(Device::cpu()), keep.to(Device::cpu())));
        CHECK(mismatches(
                  out, [&](int64_t i) { return reduce_expect(op, g.size(), i, dt); }, tol(b, dt, op)) == 0);
      }
  });
}

void all_gather_case(const Backend& b) {
  for_each_group(b, [&](Group& g) {
    const int n = g.size();
    for (DType dt : kDtypes) {
      for (int64_t c : kCounts)
        for (bool async : {false, true}) {
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " count ", c, " async ", async);
          Tensor in = make(b, g.rank(), c, dt), out = zeros_on(b, c * n, dt);
          g.all_gather(out, in, async).wait();
          CHECK(mismatches(out, [&](int64_t j) { return val(int(j / c), j % c); }) == 0);
        }
      // Unequal contributions, some empty; k = 0: all empty.
      for (int k : {0, 1, 4}) {
        std::vector<int64_t> counts(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) counts[size_t(r)] = k == 0 ? 0 : (3 * r + k) % 5 + (r == 0 ? 1 : 0);
        auto st = starts_of(counts);
        for (bool async : {false, true}) {
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " k ", k, " async ", async);
          Tensor in = make(b, g.rank(), counts[size_t(g.rank())], dt), out = zeros_on(b, st[size_t(n)], dt);
          g.all_gather_v(out, in, counts, async).wait();
          CHECK(mismatches(out, [&](int64_t j) {
                  int r = 0;
                  while (j >= st[size_t(r) + 1]) ++r;
                  return val(r, j - st[size_t(r)]);
                }) == 0);
        }
      }
    }
  });
}

void reduce_scatter_case(const Backend& b) {
  for_each_group(b, [&](Group& g) {
    const int n = g.size(), me = g.rank();
    for (DType dt : kDtypes)
      for (ReduceOp op : kOps) {
        for (int64_t c : kCounts)
          for (bool async : {false, true}) {
            INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " count ", c, " op ", reduce_op_name(op), " async ",
                 async);
            Tensor in = make(b, me, c * n, dt), out = zeros_on(b, c, dt);
            g.reduce_scatter(out, in, op, async).wait();
            CHECK(mismatches(
                      out, [&](int64_t i) { return reduce_expect(op, n, me * c + i, dt); }, tol(b, dt, op)) == 0);
          }
        for (int k : {0, 2, 5}) {
          std::vector<int64_t> counts(static_cast<size_t>(n));
          for (int r = 0; r < n; ++r) counts[size_t(r)] = k == 0 ? 0 : (2 * r + k) % 6;
          auto st = starts_of(counts);
          for (bool async : {false, true}) {
            INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " k ", k, " op ", reduce_op_name(op), " async ",
                 async);
            Tensor in = make(b, me, st[size_t(n)], dt), out = zeros_on(b, counts[size_t(me)], dt);
            g.reduce_scatter_v(out, in, counts, op, async).wait();
            CHECK(mismatches(
                      out, [&](int64_t i) { return reduce_expect(op, n, st[size_t(me)] + i, dt); }, tol(b, dt, op)) ==
                  0);
          }
        }
      }
  });
}

void all_to_all_case(const Backend& b) {
  for_each_group(b, [&](Group& g) {
    const int n = g.size(), me = g.rank();
    for (DType dt : kDtypes) {
      for (int64_t c : kCounts)
        for (bool async : {false, true}) {
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " chunk ", c, " async ", async);
          Tensor in = make(b, me, c * n, dt), out = zeros_on(b, c * n, dt);
          g.all_to_all(out, in, async).wait();
          // Chunk j of out came from rank j's chunk me.
          const int64_t cc = std::max<int64_t>(c, 1);
          CHECK(mismatches(out, [&](int64_t j) { return val(int(j / cc), me * c + j % cc); }) == 0);
        }
      // Rank a sends (a + 2b + k) % 4 elements to rank b, from its input at the running offset.
      for (int k : {0, 1, 3}) {
        auto cnt = [&](int a, int bb) { return int64_t((a + 2 * bb + k) % 4); };
        std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
        for (int j = 0; j < n; ++j) sc[size_t(j)] = cnt(me, j), rc[size_t(j)] = cnt(j, me);
        auto rs = starts_of(rc);
        for (bool async : {false, true}) {
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " k ", k, " async ", async);
          Tensor in = make(b, me, starts_of(sc)[size_t(n)], dt), out = zeros_on(b, rs[size_t(n)], dt);
          g.all_to_all_v(out, in, sc, rc, async).wait();
          CHECK(mismatches(out, [&](int64_t j) {
                  int src = 0;
                  while (j >= rs[size_t(src) + 1]) ++src;
                  int64_t off = 0;  // where src's part for me starts in its input
                  for (int bb = 0; bb < me; ++bb) off += cnt(src, bb);
                  return val(src, off + j - rs[size_t(src)]);
                }) == 0);
        }
      }
    }
  });
}

void broadcast_ring_send_case(const Backend& b) {
  for_each_group(b, [&](Group& g) {
    const int n = g.size(), me = g.rank();
    for (DType dt : kDtypes)
      for (int64_t c : kCounts) {
        for (int root = 0; root < n; ++root) {
          Tensor t = make(b, me, c, dt);
          g.broadcast(t, root, root % 2 == 1).wait();
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " count ", c, " root ", root);
          CHECK(mismatches(t, [&](int64_t i) { return val(root, i); }) == 0);
        }
        for (int shift : {1, -1, 2, n}) {
          Tensor in = make(b, me, c, dt), out = zeros_on(b, c, dt);
          g.ring_shift(out, in, shift, shift == 2).wait();
          const int from = ((me - shift) % n + n) % n;
          INFO(b.name, " ", g.describe(), " ", dtype_name(dt), " count ", c, " shift ", shift);
          CHECK(mismatches(out, [&](int64_t i) { return val(from, i); }) == 0);
        }
      }
    if (n >= 2)  // pairs (0,1), (2,3), ...: even ranks send, odd ranks receive
      for (DType dt : kDtypes) {
        Tensor t = zeros_on(b, 9, dt);
        if (me % 2 == 0 && me + 1 < n) g.send(make(b, me, 9, dt), me + 1);
        if (me % 2 == 1) {
          g.recv(t, me - 1);
          CHECK(mismatches(t, [&](int64_t i) { return val(me - 1, i); }) == 0);
        }
      }
    g.barrier();
  });
}

}  // namespace

// One test case per collective and backend; a backend that cannot run here is counted as skipped.
#define COLLECTIVE_CASES(what, fn)                                        \
  TEST_CASE("collectives mpi: " what) { fn(kMpi); }                       \
  TEST_CASE("collectives nccl: " what) {                                  \
    if (std::string why = unavailable(kNccl); !why.empty()) MT_SKIP(why); \
    fn(kNccl);                                                            \
  }

// The MPI backend on device tensors stages them through the host: the collectives the layouts use with it.
#define STAGED_CASE(what, fn)                                                    \
  TEST_CASE("collectives mpi-staged (device tensors through the host): " what) { \
    if (std::string why = unavailable(kStaged); !why.empty()) MT_SKIP(why);      \
    fn(kStaged);                                                                 \
  }

COLLECTIVE_CASES("all_reduce sum, avg, max, min, in and out of place", all_reduce_case)
COLLECTIVE_CASES("all_gather and all_gather_v with unequal and empty contributions", all_gather_case)
COLLECTIVE_CASES("reduce_scatter and reduce_scatter_v", reduce_scatter_case)
COLLECTIVE_CASES("all_to_all and all_to_all_v", all_to_all_case)
COLLECTIVE_CASES("broadcast from every root, ring shift both ways, send/recv, barrier", broadcast_ring_send_case)
STAGED_CASE("all_reduce sum, avg, max, min, in and out of place", all_reduce_case)
STAGED_CASE("all_gather and all_gather_v with unequal and empty contributions", all_gather_case)

TEST_CASE("collectives mpi: mismatched buffers are errors naming the group") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  Group& g = mesh.group(0);
  const int n = g.size();
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({3 * n + 1}, DType::f32), zeros({3}, DType::f32)),
                       "all_gather on group 'dp_replicate'");
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({3 * n}, DType::f32), zeros({3}, DType::i64)), "they must match");
  CHECK_ERROR_CONTAINS(
      g.all_gather_v(zeros({1}, DType::f32), zeros({1}, DType::f32), std::vector<int64_t>(size_t(n) + 1, 1)),
      "counts given for");
  CHECK_ERROR_CONTAINS(g.broadcast(zeros({1}, DType::f32), n), "root");
  CHECK_ERROR_CONTAINS(reduce_op_from_name("prod"), "unknown reduce op 'prod'");
}

TEST_CASE("collectives mpi: Group counts every collective it runs (kind, group, tag, calls, bytes)") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  Group& g = mesh.group(0);
  const int n = g.size(), me = g.rank();
  const int64_t k = 6, B = 4 * k;  // elements per rank, and their f32 bytes
  reset_comm_counters();
  {
    CommTag tag("test.a");
    g.all_reduce(zeros({k}, DType::f32), ReduceOp::sum);
    g.all_gather(zeros({n * k}, DType::f32), zeros({k}, DType::f32));
    g.reduce_scatter(zeros({k}, DType::f32), zeros({n * k}, DType::f32), ReduceOp::sum);
    {
      CommTag inner("test.b");  // the innermost tag wins, then the outer one is back
      g.all_to_all(zeros({n * k}, DType::f32), zeros({n * k}, DType::f32));
    }
    g.broadcast(zeros({k}, DType::f32), 0);
    g.ring_shift(zeros({k}, DType::f32), zeros({k}, DType::f32), 1);
  }
  g.all_reduce(zeros({k}, DType::f32), ReduceOp::max);  // untagged
  // Refused before anything runs: not counted.
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({n * k + 1}, DType::f32), zeros({k}, DType::f32)),
                       "all_gather on group 'dp_replicate'");
  const CommCounters c = comm_counters();
  if (n == 1) {  // a group of one rank sends nothing: no entry at all
    CHECK(c.entries.empty());
    return;
  }
  // The ring algorithms' bytes per rank, written out here from the collectives' definitions.
  CHECK(c.bytes("test.a", "dp_replicate", "all_reduce") == 2 * B * (n - 1) / n);
  CHECK(c.bytes("test.a", "dp_replicate", "all_gather") == B * (n - 1));
  CHECK(c.bytes("test.a", "dp_replicate", "reduce_scatter") == B * (n - 1));
  CHECK(c.bytes("test.b", "dp_replicate", "all_to_all") == n * B * (n - 1) / n);
  CHECK(c.bytes("test.a", "dp_replicate", "all_to_all") == 0);
  CHECK(c.bytes("test.a", "dp_replicate", "broadcast") == (me == 0 ? B : 0));
  CHECK(c.bytes("test.a", "dp_replicate", "ring_shift") == B);
  CHECK(c.calls("test.") == 6);
  CHECK(c.calls("", "dp_replicate", "all_reduce") == 2);
  CHECK(c.entries.count(CommCounters::Key{"", "dp_replicate", "all_reduce"}) == 1);  // the untagged one
  CHECK(c.calls("", "dp_replicate", "all_gather") == 1);    // the refused call is not there
  const int64_t total = 2 * B * (n - 1) / n * 2 + B * (n - 1) * 2 + B * (n - 1) + (me == 0 ? B : 0) + B;
  CHECK(c.total() == total);
  CHECK(c.bytes("", "dp_replicate") == total);
  // all_to_all_v counts exactly what leaves the rank: its counts to the others, not its own block.
  reset_comm_counters();
  {
    std::vector<int64_t> sc(size_t(n), 0), rc(size_t(n), 0);
    for (int j = 0; j < n; ++j) sc[size_t(j)] = j + 1, rc[size_t(j)] = me + 1;  // rank j gets j + 1 from everyone
    g.all_to_all_v(zeros({int64_t(n) * (me + 1)}, DType::f32), zeros({int64_t(n) * (n + 1) / 2}, DType::f32), sc, rc);
    CHECK(comm_counters().bytes("", "dp_replicate", "all_to_all") == (int64_t(n) * (n + 1) / 2 - (me + 1)) * 4);
  }
  // Point to point: the sender counts the bytes, the receiver the call.
  reset_comm_counters();
  if (me == 0) g.send(zeros({k}, DType::f32), 1);
  if (me == 1) g.recv(zeros({k}, DType::f32), 0);
  const CommCounters p = comm_counters();
  if (me == 0) CHECK(p.bytes("", "dp_replicate", "send") == B);
  if (me == 1) CHECK((p.bytes("", "dp_replicate", "recv") == 0 && p.calls("", "dp_replicate", "recv") == 1));
  CHECK_ERROR_CONTAINS(g.send(zeros({1}, DType::f32), n), "peer");
}

TEST_CASE("collectives nccl: the group's communicator, host tensors and u16 refused, u16 moved as bytes") {
  if (std::string why = unavailable(kNccl); !why.empty()) MT_SKIP(why);
  MeshOptions o;
  o.device = device_of(kNccl);
  o.backend = "nccl";
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}}, o);
  Group& g = mesh.group("world");
  CHECK(g.backend() == "nccl");
  CHECK(g.size() == world_size());
  CHECK(g.rank() == world_rank());
  int cmp = 0;
  MPI_Comm_compare(group_mpi_comm(g), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);
  const Device d = o.device;
  CHECK_ERROR_CONTAINS(g.all_reduce(zeros({4}, DType::f32), ReduceOp::sum),
                       "tensor is on cpu, NCCL needs " + d.str() + " buffers (use the mpi backend for host tensors)");
  CHECK_ERROR_CONTAINS(g.all_reduce(zeros({4}, DType::u16, d), ReduceOp::sum), "u16 tensors cannot be reduced");
  Tensor uin = make(kNccl, g.rank(), 5, DType::bf16).bitcast(DType::u16), uout = zeros({5 * g.size()}, DType::u16, d);
  g.all_gather(uout, uin);
  CHECK(mismatches(uout.bitcast(DType::bf16), [&](int64_t j) { return val(int(j / 5), j % 5); }) == 0);
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({3}, DType::f32, d), zeros({2}, DType::f32, d)), "expected");
  g.barrier();
  // Zero-count collectives are no-ops with a valid Work.
  Work w = g.all_reduce(empty({0}, DType::f32, d), ReduceOp::sum, true);
  CHECK(w.test());
  w.wait();
}
