// Placements, specs, the planner and the random factories: pure logic, no MPI.
#include <doctest/doctest.h>

#include <functional>
#include <random>

#include "check_error.h"
#include "parallel/copy_block.h"
#include "parallel/planner.h"
#include "parallel/random.h"

using namespace mt;

namespace {

using Mesh = std::vector<MeshDim>;
Mesh mesh_of(std::vector<int> sizes) {
  Mesh m;
  for (size_t i = 0; i < sizes.size(); ++i) m.push_back({"d" + std::to_string(i), sizes[i]});
  return m;
}
int mesh_size(const Mesh& m) {
  int p = 1;
  for (auto& d : m) p *= d.size;
  return p;
}

// Every placement list for a mesh of `nd` dims and a tensor of `td` dims.
std::vector<Placements> all_placements(int nd, int td, bool partial) {
  std::vector<Placement> one{Placement::Replicate()};
  for (int d = 0; d < td; ++d) one.push_back(Placement::Shard(d));
  if (partial) one.push_back(Placement::Partial(ReduceOp::sum));
  return placement_product(one, nd);
}

}  // namespace

TEST_CASE("chunks follow torch.chunk: ceil-sized until the size runs out") {
  auto lens = [](int64_t size, int n) {
    std::vector<int64_t> v;
    for (int k = 0; k < n; ++k) v.push_back(chunk_of(size, n, k).len);
    return v;
  };
  CHECK(lens(8, 4) == std::vector<int64_t>{2, 2, 2, 2});
  CHECK(lens(7, 4) == std::vector<int64_t>{2, 2, 2, 1});
  CHECK(lens(5, 4) == std::vector<int64_t>{2, 2, 1, 0});
  CHECK(lens(2, 4) == std::vector<int64_t>{1, 1, 0, 0});
  CHECK(lens(0, 3) == std::vector<int64_t>{0, 0, 0});
  CHECK(chunk_of(5, 4, 3).begin == 5);
}

TEST_CASE("local shards tile the global tensor once per replica, any order, uneven sizes") {
  for (auto sizes : std::vector<std::vector<int>>{{4}, {2, 3}, {2, 2, 2}}) {
    Mesh mesh = mesh_of(sizes);
    for (Shape gs : std::vector<Shape>{{7}, {5, 3}, {2, 9}, {0, 4}, {1, 1}}) {
      for (auto& p : all_placements(int(sizes.size()), int(gs.size()), false)) {
        std::vector<ShardOrder> orders{{}};
        // Reverse the order of dim 0 when several mesh dims shard it.
        DTensorSpec def = DTensorSpec::make(mesh, p, gs);
        if (def.shard_order[0].size() > 1) {
          ShardOrder o = def.shard_order;
          std::reverse(o[0].begin(), o[0].end());
          orders.push_back(o);
        }
        for (auto& order : orders) {
          DTensorSpec s = DTensorSpec::make(mesh, p, gs, order);
          int replicas = 1;
          for (size_t m = 0; m < p.size(); ++m)
            if (!p[m].is_shard()) replicas *= sizes[m];
          std::vector<int> cover(size_t(shape_numel(gs)), 0);
          for (int r = 0; r < mesh_size(mesh); ++r) {
            auto c = mesh_coordinate(mesh, r);
            Shape ls = s.local_shape(c), off = s.local_offset(c);
            for (int64_t i = 0; i < shape_numel(ls); ++i) {
              int64_t g = 0, rem = i;
              std::vector<int64_t> idx(ls.size());
              for (size_t d = ls.size(); d-- > 0;) idx[d] = rem % ls[d], rem /= ls[d];
              for (size_t d = 0; d < ls.size(); ++d) g = g * gs[d] + idx[d] + off[d];
              cover[size_t(g)]++;
            }
          }
          INFO(s.str(), " ", shape_str(gs));
          CHECK(std::all_of(cover.begin(), cover.end(), [&](int c) { return c == replicas; }));
        }
      }
    }
  }
}

TEST_CASE("notation prints and parses back, with shard order marks") {
  Mesh mesh = mesh_of({2, 2, 2});
  for (auto& p : all_placements(3, 2, true)) {
    DTensorSpec s = DTensorSpec::make(mesh, p, {6, 4});
    CHECK(DTensorSpec::make(mesh, parse_placements(s.str()), {6, 4}) == s);
  }
  DTensorSpec rev = DTensorSpec::make(mesh, parse_placements("S(0)[1] S(0)[0] R"), {8});
  CHECK(rev.shard_order[0] == std::vector<int>{1, 0});
  CHECK(rev.str() == "S(0)[1]S(0)[0]R");
  CHECK(DTensorSpec::make(mesh, parse_placements("S(-1),P(max),R"), {3, 5}).str() == "S(1)P(max)R");
  CHECK_ERROR_CONTAINS(parse_placements("S(x)"), "shard dim 'x' is not an integer");
  CHECK_ERROR_CONTAINS(parse_placements("Q"), "unexpected 'Q'");
  CHECK_ERROR_CONTAINS(parse_placements("P(prod)"), "unknown partial op 'prod'");
  CHECK_ERROR_CONTAINS(parse_placements("R[0]"), "only S(d) takes a shard order mark");
  CHECK_ERROR_CONTAINS(DTensorSpec::make(mesh, parse_placements("S(0),R"), {8}), "2 placements for a mesh of 3 dims");
  CHECK_ERROR_CONTAINS(DTensorSpec::make(mesh, parse_placements("S(2),R,R"), {8, 8}),
                       "S(2) on a tensor of shape (8, 8)");
  CHECK(DTensorSpec::make(mesh, parse_placements("S(0)S(0)R"), {8}).str() == "S(0)[0]S(0)[1]R");  // default order
  CHECK_ERROR_CONTAINS(DTensorSpec::make(mesh, parse_placements("S(0)[0]S(0)R"), {8}), "give each an order mark");
}

TEST_CASE("min-cost plans match a brute-force search; greedy is never cheaper") {
  std::mt19937 rng(7);
  for (auto sizes : std::vector<std::vector<int>>{{2, 4}, {4, 2}, {2, 2, 2}}) {
    Mesh mesh = mesh_of(sizes);
    int nd = int(sizes.size());
    auto all = all_placements(nd, 2, true);
    Shape gs{12, 10};
    auto gbps = link_bandwidths(nd, {});
    int pairs = nd == 2 ? 400 : 120;
    for (int t = 0; t < pairs; ++t) {
      DTensorSpec src = DTensorSpec::make(mesh, all[rng() % all.size()], gs);
      DTensorSpec dst = DTensorSpec::make(mesh, all[rng() % all.size()], gs);
      Plan best = plan_redistribute_uncached(src, dst);
      // Depth-first search over every path up to a bound, pruned by the best cost so far.
      double brute = 1e30;
      int max_len = 2 * nd + 1;
      std::function<void(const DTensorSpec&, double, int)> dfs = [&](const DTensorSpec& s, double cost, int len) {
        if (cost >= brute) return;
        if (same_layout(s, dst)) {
          brute = cost;
          return;
        }
        if (len == max_len) return;
        for (auto& st : next_steps(s, dst, 4, gbps)) dfs(st.after, cost + st.cost_s, len + 1);
      };
      dfs(src, 0, 0);
      INFO(src.str(), " -> ", dst.str(), " plan ", best.chain());
      CHECK(best.cost_s == doctest::Approx(brute).epsilon(1e-12));
      Plan greedy = plan_redistribute_uncached(src, dst, 4, {}, Planner::greedy);
      CHECK(greedy.cost_s >= best.cost_s * (1 - 1e-12));
      CHECK(same_layout(greedy.steps.empty() ? src : greedy.steps.back().after, dst));
    }
  }
}

TEST_CASE("min-cost plans: leaving unchanged size-1 mesh dims in place finds the plan of the search over every dim") {
  // The meshes a run builds hold every dim, most of size 1 (dp, ep, cp beside tp): the search leaves those in place
  // (still_dims in parallel/planner.cpp) and must choose exactly the plan it chose when it moved them too.
  std::mt19937 rng(11);
  for (auto sizes : std::vector<std::vector<int>>{{1, 2}, {2, 1}, {1, 2, 1}, {2, 1, 2}, {1, 1, 2}, {1, 2, 1, 2}}) {
    Mesh mesh = mesh_of(sizes);
    const int nd = int(sizes.size());
    auto all = all_placements(nd, 2, true);
    Shape gs{12, 10};
    const int pairs = nd <= 2 ? 300 : nd == 3 ? 150 : 40;
    int pruned = 0;
    for (int t = 0; t < pairs; ++t) {
      DTensorSpec src = DTensorSpec::make(mesh, all[rng() % all.size()], gs);
      // Half the targets keep the size-1 dims' placements, as a run's layout changes do.
      std::vector<Placement> to = all[rng() % all.size()];
      if (t % 2 == 0)
        for (int m = 0; m < nd; ++m)
          if (sizes[size_t(m)] == 1) to[size_t(m)] = src.placements[size_t(m)];
      DTensorSpec dst = DTensorSpec::make(mesh, to, gs);
      const Plan fast = plan_redistribute_uncached(src, dst, 4, {}, Planner::min_cost);
      const Plan every = plan_redistribute_uncached(src, dst, 4, {}, Planner::min_cost_every_dim);
      INFO(src.str(), " -> ", dst.str());
      CHECK(fast.chain() == every.chain());
      CHECK(fast.cost_s == every.cost_s);
      CHECK(fast.bytes_per_rank == every.bytes_per_rank);
      for (size_t i = 0; i < fast.steps.size() && i < every.steps.size(); ++i)
        CHECK(fast.steps[i].kind == every.steps[i].kind);
      for (int m = 0; m < nd; ++m) pruned += sizes[size_t(m)] == 1 && src.placements[size_t(m)] == dst.placements[size_t(m)];
    }
    CHECK(pruned > 0);  // the rule applied on this mesh
  }
}

TEST_CASE("plans: costs use the link model, are cached, print as a chain") {
  Mesh mesh = mesh_of({2, 2});
  DTensorSpec src = DTensorSpec::make(mesh, parse_placements("S(0)[0]S(0)[1]"), {16, 4});
  DTensorSpec dst = DTensorSpec::make(mesh, parse_placements("RR"), {16, 4});
  Plan p = plan_redistribute_uncached(src, dst);
  // Only the innermost shard can be gathered first: S(0)[0]S(0)[1] -> S(0)R -> RR.
  CHECK(p.chain() == "S(0)[0]S(0)[1] -> S(0)R -> RR");
  REQUIRE(p.steps.size() == 2);
  CHECK(p.steps[0].kind == StepKind::all_gather);
  CHECK(p.steps[0].bytes_per_rank == 16 * 4 / 4 * 4);  // its 16-element shard to the 1 other rank
  CHECK(p.steps[1].bytes_per_rank == 16 * 4 / 2 * 4);
  CHECK(p.steps[0].cost_s == doctest::Approx(256.0 / 100e9 + kCollectiveLatencyS));  // inner dim: 100 GB/s
  CHECK(p.steps[1].cost_s == doctest::Approx(512.0 / 25e9 + kCollectiveLatencyS));   // outer dim: 4x slower
  // Gathering S(0)S(1) to RR: the slow link goes first, while the shard is small.
  DTensorSpec a = DTensorSpec::make(mesh, parse_placements("S(0)S(1)"), {1024, 1024});
  DTensorSpec b = DTensorSpec::make(mesh, parse_placements("RR"), {1024, 1024});
  CHECK(plan_redistribute_uncached(a, b, 4, {1, 100}).steps[0].mesh_dim == 0);
  CHECK(plan_redistribute_uncached(a, b, 4, {100, 1}).steps[0].mesh_dim == 1);
  clear_plan_cache();
  const Plan& c1 = plan_redistribute(src, dst);
  const Plan& c2 = plan_redistribute(src, dst);
  CHECK(&c1 == &c2);
  CHECK(plan_cache_size() == 1);
  plan_redistribute(src, dst, 8);
  CHECK(plan_cache_size() == 2);
  CHECK(p.str().find("all_gather") != std::string::npos);
  CHECK_ERROR_CONTAINS(plan_redistribute_uncached(DTensorSpec::make(mesh, parse_placements("P(sum)R"), {4}),
                                                  DTensorSpec::make(mesh, parse_placements("P(max)R"), {4})),
                       "P(sum) -> P(max) on mesh dim 0");
  CHECK_ERROR_CONTAINS(plan_redistribute_uncached(src, DTensorSpec::make(mesh, parse_placements("RR"), {16, 5})),
                       "source shape (16, 4) and target shape (16, 5) differ");
  CHECK_ERROR_CONTAINS(link_bandwidths(2, {1, 2, 3}), "comm.link_gbps has 3 entries for a mesh of 2 dims");
  CHECK_ERROR_CONTAINS(planner_from_name("fast"), "unknown planner 'fast'");
}

TEST_CASE("shard_param shards evenly or names what does not divide") {
  Mesh mesh{{"dp_shard", 4}, {"tp", 2}};
  DTensorSpec s = DTensorSpec::make(mesh, parse_placements("RR"), {16, 6});
  DTensorSpec t = shard_param(s, 0, {0, 1});
  CHECK(t.str() == "S(0)[0]S(0)[1]");
  CHECK(t.local_shape({3, 1}) == Shape{2, 6});
  DTensorSpec u = shard_param(shard_param(s, 1, {1}), 0, {0});
  CHECK(u.str() == "S(0)S(1)");
  CHECK_ERROR_CONTAINS(shard_param(s, 1, {0}),
                       "[shard_param] tensor dim 1 of size 6 cannot be sharded evenly over dp_shard (4) = 4");
  CHECK_ERROR_CONTAINS(shard_param(shard_param(s, 1, {1}), 1, {0}), "after the existing 2-way shard");
  CHECK_ERROR_CONTAINS(shard_param(t, 1, {1}), "mesh dim 1 ('tp') is already S(0)");
  CHECK_ERROR_CONTAINS(shard_param(s, 2, {0}), "tensor dim 2 out of range");
}

TEST_CASE("random factories are bitwise invariant to the layout") {
  RandomKey key{1234, "model.layers.0.mlp.up_proj.weight"};
  for (auto sizes : std::vector<std::vector<int>>{{4}, {2, 3}, {2, 2, 2}}) {
    Mesh mesh = mesh_of(sizes);
    Shape gs{7, 5};
    DTensorSpec whole = DTensorSpec::make(mesh, Placements(sizes.size(), Placement::Replicate()), gs);
    for (const char* kind : {"rand", "randn"}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        Tensor ref = make_local(whole, std::vector<int>(sizes.size(), 0), kind, dt, key);
        for (auto& p : all_placements(int(sizes.size()), 2, false)) {
          DTensorSpec s = DTensorSpec::make(mesh, p, gs);
          for (int r = 0; r < mesh_size(mesh); ++r) {
            auto c = mesh_coordinate(mesh, r);
            Tensor mine = make_local(s, c, kind, dt, key);
            Shape ls = s.local_shape(c);
            Tensor slice = mt::empty(ls, dt);
            copy_block(slice, Shape(2, 0), ref, s.local_offset(c), ls);
            INFO(kind, " ", s.str(), " rank ", r);
            CHECK(std::memcmp(mine.data_ptr(), slice.data_ptr(), mine.nbytes()) == 0);
          }
        }
      }
    }
  }
  // Different streams and seeds differ; the normal draw has the right moments.
  DTensorSpec s = DTensorSpec::make(mesh_of({1}), {Placement::Replicate()}, {20000});
  auto a = to_f64(make_local(s, {0}, "randn", DType::f32, {1, "a"}));
  auto b = to_f64(make_local(s, {0}, "randn", DType::f32, {1, "b"}));
  auto c = to_f64(make_local(s, {0}, "randn", DType::f32, {2, "a"}));
  CHECK(a != b);
  CHECK(a != c);
  double mean = 0, var = 0;
  for (double x : a) mean += x / double(a.size());
  for (double x : a) var += (x - mean) * (x - mean) / double(a.size());
  CHECK(std::abs(mean) < 0.03);
  CHECK(std::abs(var - 1) < 0.05);
  auto u = to_f64(make_local(s, {0}, "rand", DType::f32, {1, "u"}));
  CHECK(*std::min_element(u.begin(), u.end()) >= 0.0);
  CHECK(*std::max_element(u.begin(), u.end()) < 1.0);
  CHECK_ERROR_CONTAINS(
      make_local(DTensorSpec::make(mesh_of({2}), {Placement::Partial()}, {4}), {0}, "randn", DType::f32, {}),
      "only zeros and empty can be made partial");
}
