// Redistribution on live meshes: full_tensor(redistribute(distribute(x, A), B)) == x
// exactly for every ordered pair of placements on 1-D, 2-D and 3-D meshes
// (the 3-D one on a deterministic sample of pairs), tensors of rank 1 to 3 with
// even, uneven, smaller-than-mesh and zero sizes, default and reversed shard
// orders, f32 and i64. Values are multiples of 24 so that partial sums made by
// dividing by a mesh size are exact.
#include <doctest/doctest.h>
#include <mpi.h>

#include <random>

#include "../check_error.h"
#include "parallel/random.h"
#include "parallel/style.h"
#include "../skip.h"
#include "mpi_world.h"

using namespace mt;

namespace {

// Multiples of 24: exact after dividing by 2, 3, 4 or 8 (partial sums on meshes of those sizes).
Tensor iota8(const Shape& s, DType dt) {
  std::vector<double> v(static_cast<size_t>(shape_numel(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 24.0 * double(i + 1);
  return from_values(v, s, dt);
}

std::vector<Placement> choices(int tensor_ndim, bool all_partials) {
  std::vector<Placement> c{Placement::Replicate(), Placement::Partial(ReduceOp::sum)};
  for (int d = 0; d < tensor_ndim; ++d) c.push_back(Placement::Shard(d));
  if (all_partials) {
    c.push_back(Placement::Partial(ReduceOp::max));
    c.push_back(Placement::Partial(ReduceOp::avg));
  }
  return c;
}


bool partial_clash(const Placements& a, const Placements& b) {
  for (size_t m = 0; m < a.size(); ++m)
    if (a[m].is_partial() && b[m].is_partial() && a[m].op != b[m].op) return true;
  return false;
}

// Reversed shard order of tensor dim 0 when two mesh dims shard it, else default.
ShardOrder reversed(const DeviceMesh& mesh, const Placements& p, const Shape& s) {
  DTensorSpec d = DTensorSpec::make(mesh.dims(), p, s);
  if (d.shard_order[0].size() < 2) return {};
  ShardOrder o = d.shard_order;
  std::reverse(o[0].begin(), o[0].end());
  return o;
}

// Runs every pair (or `sample` random ones) and returns the number that failed.
int check_pairs(const DeviceMesh& mesh, const std::vector<Shape>& shapes, bool all_partials, int sample,
                Planner planner = Planner::min_cost) {
  int bad = 0, count = 0;
  std::mt19937 rng(11);
  for (const Shape& s : shapes) {
    auto all = placement_product(choices(int(s.size()), all_partials), mesh.ndim());
    std::vector<std::pair<size_t, size_t>> pairs;
    for (size_t i = 0; i < all.size(); ++i)
      for (size_t j = 0; j < all.size(); ++j) pairs.emplace_back(i, j);
    if (sample > 0 && size_t(sample) < pairs.size()) {
      std::shuffle(pairs.begin(), pairs.end(), rng);
      pairs.resize(size_t(sample));
    }
    for (auto [i, j] : pairs) {
      const Placements &a = all[i], &b = all[j];
      if (partial_clash(a, b)) continue;
      DType dt = (count++ % 2) ? DType::i64 : DType::f32;
      Tensor x = iota8(s, dt);
      ShardOrder oa = (count % 3 == 0) ? reversed(mesh, a, s) : ShardOrder{};
      ShardOrder ob = (count % 5 == 0) ? reversed(mesh, b, s) : ShardOrder{};
      DTensor src = distribute_tensor(x, mesh, a, std::nullopt, oa);
      RedistributeOptions opts;
      opts.planner = planner;
      DTensor dst = redistribute(src, b, opts, ob);
      Tensor back = full_tensor(dst);
      bool ok = equal(back, x) && dst.local.shape() == dst.spec.local_shape(mesh.coordinate());
      if (!ok && bad < 5)
        MESSAGE(mesh_str(mesh.dims()), " ", shape_str(s), " ", src.spec.str(), " -> ", dst.spec.str(), " ",
                dtype_name(dt), " got ", back.str());
      bad += !ok;
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("redistribute: every pair on a 1-D mesh, uneven, smaller than the mesh, empty") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", world_size()}});
  CHECK(check_pairs(mesh, {{8}, {5}, {3}, {0}, {7, 5}, {2, 3, 3}}, true, 0) == 0);
}

TEST_CASE("redistribute: every pair on a 2-D mesh, with reversed shard orders; greedy too") {
  int n = world_size();
  if (n < 4 || n % 2) MT_SKIP("needs an even number of ranks >= 4");
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", 2}, {"tp", n / 2}});
  CHECK(check_pairs(mesh, {{8, 6}, {5, 3}, {1, 2}}, false, 0) == 0);
  CHECK(check_pairs(mesh, {{7, 5}}, false, 0, Planner::greedy) == 0);
  CHECK(check_pairs(mesh, {{4, 3, 2}}, false, 120) == 0);
}

TEST_CASE("redistribute: sampled pairs on a 3-D mesh") {
  if (world_size() != 8) MT_SKIP("needs 8 ranks");
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}});
  CHECK(check_pairs(mesh, {{8, 4}, {3, 5}, {0, 2}}, false, 150) == 0);
  CHECK(check_pairs(mesh, {{5, 2, 3}}, false, 100) == 0);
}

TEST_CASE("distribute from a source rank, from_local checks, factories on a live mesh") {
  int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n}});
  int me = mesh.coordinate()[0];
  Tensor x = iota8({6, 2}, DType::f32);
  DTensor a = distribute_tensor(me == n - 1 ? x : Tensor(), mesh, {Placement::Shard(0)}, n - 1);
  CHECK(equal(full_tensor(a), x));
  DTensor b = from_local(a.local, mesh, {Placement::Shard(0)}, Shape{6, 2}, true);
  CHECK(b.spec == a.spec);
  if (n > 1) {
    // Inferred global shape assumes even shards: 6 rows over n ranks is not that unless n divides 6 evenly.
    Tensor wrong = zeros({me == 0 ? 3 : 1, 2}, DType::f32);
    CHECK_ERROR_CONTAINS(from_local(wrong, mesh, {Placement::Shard(0)}, Shape{6, 2}, true),
                         me == 0 || n == 2 ? "holds a local tensor of shape" : "holds a local tensor of shape");
  }
  RandomKey key{5, "w"};
  DTensor r = randn(mesh, {9, 3}, {Placement::Shard(0)}, key);
  DTensor whole = randn(mesh, {9, 3}, {Placement::Replicate()}, key);
  CHECK(equal(full_tensor(r), whole.local));
  DTensor o = ones(mesh, {5}, {Placement::Shard(0)});
  CHECK(to_f64(full_tensor(o)) == std::vector<double>(5, 1.0));
}

TEST_CASE("the gradient of redistribute matches finite differences") {
  int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n}});
  Shape s{5, 3};
  // L(X) = sum_i w_i * full(redistribute(distribute(X, A), B))_i, in f64.
  std::vector<double> wv(15), xv(15);
  for (int i = 0; i < 15; ++i) wv[size_t(i)] = 0.25 * (i % 7) - 0.5, xv[size_t(i)] = 0.1 * i;
  Tensor w = from_values(wv, s, DType::f64), X = from_values(xv, s, DType::f64);
  std::vector<Placements> srcs{
      {Placement::Shard(0)}, {Placement::Replicate()}, {Placement::Partial()}, {Placement::Shard(1)}};
  std::vector<Placements> dsts{{Placement::Replicate()}, {Placement::Shard(1)}, {Placement::Shard(0)}};
  auto loss = [&](const Tensor& x, const Placements& a, const Placements& b) {
    Tensor y = full_tensor(redistribute(distribute_tensor(x, mesh, a), b));
    double l = 0;
    for (int i = 0; i < 15; ++i) l += wv[size_t(i)] * y.at<double>(i);
    return l;
  };
  for (auto& a : srcs)
    for (auto& b : dsts) {
      DTensorSpec src_spec = distribute_tensor(X, mesh, a).spec;
      DTensor grad_out = distribute_tensor(w, mesh, b);  // dL/dy, laid out like y
      DTensor grad_in = redistribute_backward(grad_out, src_spec);
      CHECK(grad_in.placements() == redistribute_backward_placements(a));
      Tensor g = full_tensor(grad_in);
      for (int j : {0, 4, 14}) {
        double eps = 1e-3;
        Tensor xp = X.clone(), xm = X.clone();
        xp.at<double>(j) += eps;
        xm.at<double>(j) -= eps;
        double fd = (loss(xp, a, b) - loss(xm, a, b)) / (2 * eps);
        INFO(Placement(a[0]).str(), " -> ", Placement(b[0]).str(), " element ", j);
        CHECK(g.at<double>(j) == doctest::Approx(fd).epsilon(1e-9));
      }
    }
}

// The one gradient rule of redistribute (redistribute_grad_placement), used by redistribute_backward and the
// styles' layout hooks alike, against central differences when the incoming gradient is Partial: a consumer
// on every rank uses the whole y = redistribute(x, -> R) with its own weights, L = sum_r <w_r, y>, so rank r
// holds dL/dy = w_r, a Partial gradient. Each rank's local gradient, read with the placement the rule must
// give (written out here: R -> R, S(d) -> S(d), P -> R), must equal dL/dx; keeping a Replicate source's
// gradient Partial would leave w_r on rank r instead of their sum.
TEST_CASE("redistribute's gradient rule with a Partial gradient: redistribute_backward and the style hooks") {
  const int n = world_size(), rank = world_rank();
  DeviceMesh mesh = DeviceMesh::create({{"tp", n}});
  const Shape s{4, 3};
  std::vector<double> xv(12), wv(12);
  for (int i = 0; i < 12; ++i) xv[size_t(i)] = 0.1 * i - 0.4, wv[size_t(i)] = 0.25 * (i % 5) - 0.3 + 0.7 * rank;
  Tensor X = from_values(xv, s, DType::f64), w = from_values(wv, s, DType::f64);  // (4, 3) each
  struct Case {
    Placement from, grad;  // the source's placement and its gradient's
  };
  std::vector<Case> cases{{Placement::Replicate(), Placement::Replicate()},
                          {Placement::Shard(0), Placement::Shard(0)},
                          {Placement::Shard(1), Placement::Shard(1)},
                          {Placement::Partial(), Placement::Replicate()}};
  auto loss = [&](const Tensor& x, const Placement& a) {
    Tensor y = redistribute(distribute_tensor(x, mesh, {a}), {Placement::Replicate()}).local;  // (4, 3)
    double l = 0, total = 0;
    for (int i = 0; i < 12; ++i) l += wv[size_t(i)] * y.at<double>(i);
    MPI_Allreduce(&l, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return total;
  };
  for (const Case& c : cases) {
    CHECK(redistribute_grad_placement(c.from) == c.grad);
    DTensor x = distribute_tensor(X, mesh, {c.from});
    DTensor grad_out = from_local(w, mesh, {Placement::Partial()}, s);
    // redistribute_backward: a DTensor gradient laid out by the rule.
    DTensor g1 = redistribute_backward(grad_out, x.spec);
    CHECK(g1.placements() == Placements{c.grad});
    // A layout hook from the source to Replicate whose module gives a Partial input gradient.
    LayoutHook hook = layout_hook(mesh, 0, c.from, Placement::Replicate(), Placement::Partial(),
                                  c.from.is_shard() ? s[size_t(c.from.dim)] : -1);  // uneven shards on 4+ ranks
    hook.forward(x.local);
    Tensor g2_local = hook.backward(w);
    Tensor g1_full = full_tensor(from_local(g1.local, mesh, {c.grad}, s));
    Tensor g2_full = full_tensor(from_local(g2_local, mesh, {c.grad}, s));
    for (int j : {0, 5, 11}) {
      const double eps = 1e-3;
      Tensor xp = X.clone(), xm = X.clone();
      xp.at<double>(j) += eps;
      xm.at<double>(j) -= eps;
      double fd = (loss(xp, c.from) - loss(xm, c.from)) / (2 * eps);
      INFO(c.from.str(), " element ", j, ": finite difference ", fd);
      CHECK(g1_full.at<double>(j) == doctest::Approx(fd).epsilon(1e-9));
      CHECK(g2_full.at<double>(j) == doctest::Approx(fd).epsilon(1e-9));
    }
  }
}
