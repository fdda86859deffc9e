// The NCCL backend on device tensors (every collective, f32/bf16/i64, counts
// 0, 1, odd and unequal, blocking and async) against values computed on the
// host, and the MPI backend staging device tensors through the host. NCCL
// needs one GPU per rank: its tests skip themselves when ranks share a GPU.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <functional>

#include "../check_error.h"
#include "comm/mesh.h"
#include "comm/mpi/mpi_group.h"
#include "comm/nccl/nccl_group.h"
#include "../mpi/mpi_world.h"

using namespace mt;

namespace {

double val(int r, int64_t i) { return double((r * 5 + 1) % 11) + double(i % 7); }

Tensor make(int r, int64_t n, DType dt, Device d, int64_t base = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = val(r, base + i);
  return from_values(v, {n}, dt).to(d);
}

double reduce_expect(ReduceOp op, int n, int64_t i, DType dt) {
  double s = 0, mx = -1e30, mn = 1e30;
  for (int r = 0; r < n; ++r) {
    double x = val(r, i);
    s += x;
    mx = std::max(mx, x);
    mn = std::min(mn, x);
  }
  switch (op) {
    case ReduceOp::sum: return s;
    case ReduceOp::max: return mx;
    case ReduceOp::min: return mn;
    case ReduceOp::avg: return dt == DType::i64 ? double(int64_t(s) / n) : s / n;
  }
  return 0;
}

// Elements of got that differ from want(i) (tolerance: bf16 avg rounds).
int64_t mismatches(const Tensor& got, const std::function<double(int64_t)>& want, double rel = 1e-6) {
  auto v = to_f64(got);
  int64_t bad = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    double w = want(int64_t(i));
    if (std::abs(v[i] - w) > rel * std::max(1.0, std::abs(w))) ++bad;
  }
  return bad;
}

double tol(DType dt, ReduceOp op) { return op == ReduceOp::avg && dt == DType::bf16 ? 1e-2 : 1e-6; }

// NCCL allows one rank per GPU; the test runs when the world fits the visible devices.
std::unique_ptr<Group> nccl_world() {
  int ndev = cuda_device_count();
  if (ndev == 0) {
    MESSAGE("no CUDA device visible: NCCL test skipped");
    return nullptr;
  }
  if (world_size() > ndev) {
    MESSAGE("more ranks than GPUs (NCCL needs one GPU per rank): NCCL test skipped");
    return nullptr;
  }
  std::vector<int> ranks(static_cast<size_t>(world_size()));
  for (int r = 0; r < world_size(); ++r) ranks[size_t(r)] = r;
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return make_nccl_group(c, "world", ranks, world_rank());
}

const DType kDtypes[] = {DType::f32, DType::bf16, DType::i64};
const int64_t kCounts[] = {0, 1, 7, 1001};
const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

std::vector<int64_t> starts_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> s(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) s[i + 1] = s[i] + counts[i];
  return s;
}

}  // namespace

TEST_CASE("nccl: group basics and errors") {
  CHECK(nccl_built());
  auto g = nccl_world();
  if (!g) return;
  CHECK(g->backend() == "nccl");
  CHECK(g->size() == world_size());
  CHECK(g->rank() == world_rank());
  int cmp = 0;
  MPI_Comm_compare(group_mpi_comm(*g), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);
  Tensor host = zeros({4}, DType::f32);
  CHECK_ERROR_CONTAINS(g->all_reduce(host, ReduceOp::sum),
                       "[nccl] all_reduce on group 'world': tensor is on cpu, NCCL needs cuda:" +
                           std::to_string(world_rank()) + " buffers (use the mpi backend for host tensors)");
  Device d = Device::cuda(world_rank());
  Tensor u = zeros({4}, DType::u16, d);
  CHECK_ERROR_CONTAINS(g->all_reduce(u, ReduceOp::sum), "u16 tensors cannot be reduced");
  // u16 moves as bytes.
  Tensor uin = make(g->rank(), 5, DType::bf16, d).bitcast(DType::u16);
  Tensor uout = zeros({5 * g->size()}, DType::u16, d);
  g->all_gather(uout, uin);
  CHECK(mismatches(uout.bitcast(DType::bf16), [&](int64_t j) { return val(int(j / 5), j % 5); }) == 0);
  CHECK_ERROR_CONTAINS(g->all_gather(zeros({3}, DType::f32, d), zeros({2}, DType::f32, d)), "expected");
  g->barrier();
  g->barrier();
  // Zero-count collectives are no-ops with a valid Work.
  Work w = g->all_reduce(empty({0}, DType::f32, d), ReduceOp::sum, true);
  CHECK(w.test());
  w.wait();
}

TEST_CASE("nccl: all_reduce sum, avg, max, min") {
  auto g = nccl_world();
  if (!g) return;
  Device d = Device::cuda(world_rank());
  for (DType dt : kDtypes)
    for (int64_t c : kCounts)
      for (ReduceOp op : kOps)
        for (bool async : {false, true}) {
          Tensor t = make(g->rank(), c, dt, d);
          Work w = g->all_reduce(t, op, async);
          if (async) {
            w.wait();
            CHECK(w.test());
          }
          INFO(dtype_name(dt), " count ", c, " op ", reduce_op_name(op), " async ", async);
          CHECK(mismatches(t, [&](int64_t i) { return reduce_expect(op, g->size(), i, dt); }, tol(dt, op)) == 0);
        }
}

TEST_CASE("nccl: all_gather, all_gather_v, broadcast") {
  auto g = nccl_world();
  if (!g) return;
  Device d = Device::cuda(world_rank());
  int n = g->size();
  for (DType dt : kDtypes) {
    for (int64_t c : kCounts)
      for (bool async : {false, true}) {
        INFO(dtype_name(dt), " count ", c, " async ", async);
        Tensor in = make(g->rank(), c, dt, d), out = zeros({c * n}, dt, d);
        g->all_gather(out, in, async).wait();
        CHECK(mismatches(out, [&](int64_t j) { return val(int(j / c), j % c); }) == 0);
        Tensor b = make(g->rank(), c, dt, d);
        int root = n - 1;
        g->broadcast(b, root, async).wait();
        CHECK(mismatches(b, [&](int64_t j) { return val(root, j); }) == 0);
      }
    for (int k : {0, 1, 4}) {
      std::vector<int64_t> counts(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) counts[size_t(r)] = k == 0 ? 0 : (3 * r + k) % 5 + (r == 0 ? 1 : 0);
      auto st = starts_of(counts);
      for (bool async : {false, true}) {
        INFO(dtype_name(dt), " k ", k, " async ", async);
        Tensor in = make(g->rank(), counts[size_t(g->rank())], dt, d), out = zeros({st[size_t(n)]}, dt, d);
        g->all_gather_v(out, in, counts, async).wait();
        CHECK(mismatches(out, [&](int64_t j) {
                int r = 0;
                while (j >= st[size_t(r) + 1]) ++r;
                return val(r, j - st[size_t(r)]);
              }) == 0);
      }
    }
  }
}

TEST_CASE("nccl: reduce_scatter and reduce_scatter_v") {
  auto g = nccl_world();
  if (!g) return;
  Device d = Device::cuda(world_rank());
  int n = g->size(), me = g->rank();
  for (DType dt : kDtypes)
    for (ReduceOp op : kOps) {
      for (int64_t c : kCounts)
        for (bool async : {false, true}) {
          INFO(dtype_name(dt), " count ", c, " op ", reduce_op_name(op), " async ", async);
          Tensor in = make(me, c * n, dt, d), out = zeros({c}, dt, d);
          g->reduce_scatter(out, in, op, async).wait();
          CHECK(mismatches(out, [&](int64_t i) { return reduce_expect(op, n, me * c + i, dt); }, tol(dt, op)) == 0);
        }
      for (int k : {0, 2, 5}) {
        std::vector<int64_t> counts(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) counts[size_t(r)] = k == 0 ? 0 : (2 * r + k) % 6;
        auto st = starts_of(counts);
        for (bool async : {false, true}) {
          INFO(dtype_name(dt), " k ", k, " op ", reduce_op_name(op), " async ", async);
          Tensor in = make(me, st[size_t(n)], dt, d), out = zeros({counts[size_t(me)]}, dt, d);
          g->reduce_scatter_v(out, in, counts, op, async).wait();
          CHECK(mismatches(out, [&](int64_t i) { return reduce_expect(op, n, st[size_t(me)] + i, dt); },
                           tol(dt, op)) == 0);
        }
      }
    }
}

TEST_CASE("nccl: all_to_all, all_to_all_v, ring_shift") {
  auto g = nccl_world();
  if (!g) return;
  Device d = Device::cuda(world_rank());
  int n = g->size(), me = g->rank();
  for (DType dt : kDtypes) {
    for (int64_t c : kCounts)
      for (bool async : {false, true}) {
        INFO(dtype_name(dt), " chunk ", c, " async ", async);
        Tensor in = make(me, c * n, dt, d), out = zeros({c * n}, dt, d);
        g->all_to_all(out, in, async).wait();
        // Chunk r of out is chunk me of rank r's in.
        CHECK(mismatches(out, [&](int64_t j) { return val(int(j / std::max<int64_t>(c, 1)), me * c + j % std::max<int64_t>(c, 1)); }) == 0);
        for (int shift : {1, -1, 2, n}) {
          Tensor rin = make(me, c, dt, d), rout = zeros({c}, dt, d);
          g->ring_shift(rout, rin, shift, async).wait();
          int from = ((me - shift) % n + n) % n;
          CHECK(mismatches(rout, [&](int64_t j) { return val(from, j); }) == 0);
        }
      }
    // Rank a sends (a + 2b + k) % 4 elements to rank b.
    for (int k : {0, 1, 3}) {
      auto cnt = [&](int a, int b) { return int64_t((a + 2 * b + k) % 4); };
      std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        sc[size_t(j)] = cnt(me, j);
        rc[size_t(j)] = cnt(j, me);
      }
      auto rs = starts_of(rc);
      for (bool async : {false, true}) {
        INFO(dtype_name(dt), " k ", k, " async ", async);
        int64_t stot = starts_of(sc)[size_t(n)];
        Tensor in = make(me, stot, dt, d), out = zeros({rs[size_t(n)]}, dt, d);
        g->all_to_all_v(out, in, sc, rc, async).wait();
        CHECK(mismatches(out, [&](int64_t j) {
                int src = 0;
                while (j >= rs[size_t(src) + 1]) ++src;
                int64_t off = 0;  // where src's part for me starts in its input
                for (int b = 0; b < me; ++b) off += cnt(src, b);
                return val(src, off + j - rs[size_t(src)]);
              }) == 0);
      }
    }
  }
}

TEST_CASE("nccl: send and recv between neighbours") {
  auto g = nccl_world();
  if (!g) return;
  int n = g->size(), me = g->rank();
  if (n < 2) {
    MESSAGE("send/recv needs 2 ranks: skipped");
    return;
  }
  Device d = Device::cuda(world_rank());
  for (DType dt : kDtypes) {
    Tensor out = zeros({9}, dt, d);
    if (me % 2 == 0 && me + 1 < n) g->send(make(me, 9, dt, d), me + 1);
    if (me % 2 == 1) {
      g->recv(out, me - 1);
      CHECK(mismatches(out, [&](int64_t j) { return val(me - 1, j); }) == 0);
    }
  }
}

TEST_CASE("mpi backend stages device tensors through the host") {
  if (cuda_device_count() == 0) {
    MESSAGE("no CUDA device visible: staged MPI test skipped");
    return;
  }
  int n = world_size();
  MeshOptions o;
  o.device = Device::cuda(world_rank() % cuda_device_count());
  o.backend = "mpi";
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", n}}, o);
  CHECK(mesh.backend() == "mpi");
  Group& g = mesh.group("dp_replicate");
  Device d = o.device;
  for (DType dt : kDtypes)
    for (int64_t c : kCounts)
      for (bool async : {false, true}) {
        INFO(dtype_name(dt), " count ", c, " async ", async);
        Tensor t = make(g.rank(), c, dt, d);
        g.all_reduce(t, ReduceOp::sum, async).wait();
        CHECK(t.device() == d);
        CHECK(mismatches(t, [&](int64_t i) { return reduce_expect(ReduceOp::sum, n, i, dt); }) == 0);
        Tensor in = make(g.rank(), c, dt, d), out = zeros({c * n}, dt, d);
        g.all_gather(out, in, async).wait();
        CHECK(mismatches(out, [&](int64_t j) { return val(int(j / c), j % c); }) == 0);
      }
}
