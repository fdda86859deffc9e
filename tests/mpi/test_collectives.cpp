// Every collective of the MPI backend on every group of 1-D, 2-D and 3-D
// meshes that fit the world size, with element counts 0, 1, odd and unequal
// per rank, in f32, bf16 and i64, blocking and async. Expected values are
// computed locally from the formula that made the inputs.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <functional>

#include "../check_error.h"
#include "comm/mesh.h"
#include "mpi_world.h"

using namespace mt;

namespace {

// Rank r's input at element i: small integers, exact in every dtype's reductions.
double val(int r, int64_t i) { return double((r * 5 + 1) % 11) + double(i % 7); }

Tensor make(int r, int64_t n, DType dt, int64_t base = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = val(r, base + i);
  return from_values(v, {n}, dt);
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
    case ReduceOp::avg:
      if (dt == DType::i64) return double(int64_t(s) / n);
      if (dt == DType::bf16) return double(float(bf16(float(bf16(float(s))) / float(n))));
      return double(float(s) / float(n));
  }
  return 0;
}

// Number of elements of got that differ from want(i).
int64_t mismatches(const Tensor& got, const std::function<double(int64_t)>& want) {
  auto v = to_f64(got);
  int64_t bad = 0;
  for (size_t i = 0; i < v.size(); ++i)
    if (std::abs(v[i] - want(int64_t(i))) > 1e-6 * std::max(1.0, std::abs(want(int64_t(i))))) ++bad;
  return bad;
}

// The meshes whose sizes multiply to the world size: 1-D always, 2-D and 3-D when they fit.
std::vector<std::vector<MeshDim>> meshes_for(int world) {
  std::vector<std::vector<MeshDim>> m{{{"dp_replicate", world}}};
  if (world % 2 == 0 && world >= 4) m.push_back({{"dp_shard", 2}, {"tp", world / 2}});
  if (world == 8) m.push_back({{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}});
  return m;
}

// Runs f on every group (each dim, dp, world) of every mesh that fits.
void for_each_group(const std::function<void(Group&)>& f) {
  for (auto& dims : meshes_for(world_size())) {
    DeviceMesh mesh = DeviceMesh::create(dims);
    for (int d = 0; d < mesh.ndim(); ++d) f(mesh.group(d));
    f(mesh.group("dp"));
    f(mesh.group("world"));
  }
}

const DType kDtypes[] = {DType::f32, DType::bf16, DType::i64};
const int64_t kCounts[] = {0, 1, 7};

}  // namespace

TEST_CASE("all_reduce: sum, avg, max, min") {
  for_each_group([](Group& g) {
    for (DType dt : kDtypes)
      for (int64_t c : kCounts)
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
          for (bool async : {false, true}) {
            Tensor t = make(g.rank(), c, dt);
            g.all_reduce(t, op, async).wait();
            INFO(g.describe(), " ", dtype_name(dt), " count ", c, " op ", reduce_op_name(op), " async ", async);
            CHECK(mismatches(t, [&](int64_t i) { return reduce_expect(op, g.size(), i, dt); }) == 0);
          }
  });
}

TEST_CASE("all_gather and all_gather_v with unequal and empty contributions") {
  for_each_group([](Group& g) {
    int n = g.size();
    for (DType dt : kDtypes) {
      for (int64_t c : kCounts)
        for (bool async : {false, true}) {
          Tensor in = make(g.rank(), c, dt), out = zeros({c * n}, dt);
          g.all_gather(out, in, async).wait();
          INFO(g.describe(), " ", dtype_name(dt), " count ", c);
          CHECK(mismatches(out, [&](int64_t j) { return val(int(j / c), j % c); }) == 0);
        }
      // Rank r contributes (3r+1) mod 5 elements: some zero, all different.
      std::vector<int64_t> counts(static_cast<size_t>(n));
      std::vector<int64_t> start(size_t(n) + 1, 0);
      for (int r = 0; r < n; ++r) {
        counts[size_t(r)] = (3 * r + 1) % 5;
        start[size_t(r) + 1] = start[size_t(r)] + counts[size_t(r)];
      }
      for (bool async : {false, true}) {
        Tensor in = make(g.rank(), counts[size_t(g.rank())], dt), out = zeros({start[size_t(n)]}, dt);
        g.all_gather_v(out, in, counts, async).wait();
        CHECK(mismatches(out, [&](int64_t j) {
                int r = 0;
                while (j >= start[size_t(r) + 1]) ++r;
                return val(r, j - start[size_t(r)]);
              }) == 0);
      }
    }
  });
}

TEST_CASE("reduce_scatter and reduce_scatter_v") {
  for_each_group([](Group& g) {
    int n = g.size(), me = g.rank();
    for (DType dt : kDtypes) {
      for (int64_t c : kCounts)
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max})
          for (bool async : {false, true}) {
            Tensor in = make(me, c * n, dt), out = zeros({c}, dt);
            g.reduce_scatter(out, in, op, async).wait();
            INFO(g.describe(), " ", dtype_name(dt), " count ", c, " op ", reduce_op_name(op));
            CHECK(mismatches(out, [&](int64_t k) { return reduce_expect(op, n, me * c + k, dt); }) == 0);
          }
      std::vector<int64_t> counts(static_cast<size_t>(n));
      int64_t total = 0, mine_start = 0;
      for (int r = 0; r < n; ++r) {
        counts[size_t(r)] = (2 * r + 3) % 4;
        if (r < me) mine_start += counts[size_t(r)];
        total += counts[size_t(r)];
      }
      for (bool async : {false, true}) {
        Tensor in = make(me, total, dt), out = zeros({counts[size_t(me)]}, dt);
        g.reduce_scatter_v(out, in, counts, ReduceOp::sum, async).wait();
        CHECK(mismatches(out, [&](int64_t k) { return reduce_expect(ReduceOp::sum, n, mine_start + k, dt); }) == 0);
      }
    }
  });
}

TEST_CASE("all_to_all and all_to_all_v") {
  for_each_group([](Group& g) {
    int n = g.size(), me = g.rank();
    for (DType dt : kDtypes) {
      for (int64_t c : kCounts)
        for (bool async : {false, true}) {
          Tensor in = make(me, c * n, dt), out = zeros({c * n}, dt);
          g.all_to_all(out, in, async).wait();
          INFO(g.describe(), " ", dtype_name(dt), " chunk ", c);
          // Chunk j of out came from rank j's chunk me.
          CHECK(mismatches(out, [&](int64_t j) { return val(int(j / std::max<int64_t>(c, 1)), me * c + j % std::max<int64_t>(c, 1)); }) == 0);
        }
      // Rank s sends (s + d) mod 3 elements to rank d, taken from its input at the running offset.
      auto cnt = [](int s, int d) { return int64_t((s + d) % 3); };
      std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        sc[size_t(j)] = cnt(me, j);
        rc[size_t(j)] = cnt(j, me);
      }
      int64_t st = 0, rt = 0;
      for (int j = 0; j < n; ++j) st += sc[size_t(j)], rt += rc[size_t(j)];
      for (bool async : {false, true}) {
        Tensor in = make(me, st, dt), out = zeros({rt}, dt);
        g.all_to_all_v(out, in, sc, rc, async).wait();
        CHECK(mismatches(out, [&](int64_t k) {
                int j = 0;
                int64_t base = 0;
                while (k >= base + rc[size_t(j)]) base += rc[size_t(j++)];
                int64_t off = 0;  // where rank j's block for me starts in j's input
                for (int d = 0; d < me; ++d) off += cnt(j, d);
                return val(j, off + (k - base));
              }) == 0);
      }
    }
  });
}

TEST_CASE("broadcast from every root, ring shift both ways, send/recv, barrier") {
  for_each_group([](Group& g) {
    int n = g.size(), me = g.rank();
    for (DType dt : kDtypes)
      for (int64_t c : kCounts) {
        for (int root = 0; root < n; ++root) {
          Tensor t = make(me, c, dt);
          g.broadcast(t, root, root % 2 == 1).wait();
          INFO(g.describe(), " root ", root);
          CHECK(mismatches(t, [&](int64_t i) { return val(root, i); }) == 0);
        }
        for (int shift : {1, -1, 2}) {
          Tensor in = make(me, c, dt), out = zeros({c}, dt);
          g.ring_shift(out, in, shift, shift == 2).wait();
          int from = ((me - shift) % n + n) % n;
          CHECK(mismatches(out, [&](int64_t i) { return val(from, i); }) == 0);
        }
      }
    if (n >= 2) {
      // Pairs (0,1), (2,3), ...: even ranks send, odd ranks receive.
      Tensor t = make(me, 5, DType::f32);
      if (me % 2 == 0 && me + 1 < n) g.send(t, me + 1);
      if (me % 2 == 1) {
        g.recv(t, me - 1);
        CHECK(mismatches(t, [&](int64_t i) { return val(me - 1, i); }) == 0);
      }
    }
    g.barrier();
  });
}

TEST_CASE("collectives refuse mismatched buffers with the group named") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  Group& g = mesh.group(0);
  int n = g.size();
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({3 * n + 1}, DType::f32), zeros({3}, DType::f32)),
                       "all_gather on group 'dp_replicate'");
  CHECK_ERROR_CONTAINS(g.all_gather(zeros({3 * n}, DType::f32), zeros({3}, DType::i64)), "they must match");
  CHECK_ERROR_CONTAINS(g.all_gather_v(zeros({1}, DType::f32), zeros({1}, DType::f32), std::vector<int64_t>(size_t(n) + 1, 1)),
                       "counts given for");
  CHECK_ERROR_CONTAINS(g.broadcast(zeros({1}, DType::f32), n), "root");
  CHECK_ERROR_CONTAINS(reduce_op_from_name("prod"), "unknown reduce op 'prod'");
}

TEST_CASE("out-of-place all_reduce leaves the input alone") {
  for_each_group([](Group& g) {
    for (DType dt : kDtypes)
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        Tensor in = make(g.rank(), 7, dt), keep = in.clone(), out = zeros({7}, dt);
        g.all_reduce(out, in, op);
        CHECK(equal(in, keep));
        CHECK(mismatches(out, [&](int64_t i) { return reduce_expect(op, g.size(), i, dt); }) == 0);
      }
  });
}
