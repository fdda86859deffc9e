// The sparse MoE block (models/llama/moe.h) under expert parallel against the same block unparallelised, in f64:
// on a 1-D ep mesh of every test rank count (2 experts per rank), each rank feeds its own rows of the batch; the
// outputs and input gradients are the reference's rows, the experts' weight gradients (Shard(0) over ep) its
// slices, the router's and the shared expert's (replicated, each rank's rows) sum to its. Dropless with exact sizes
// (no loss scale: an evaluation's forward), with a capacity, and bounded dropless in a training forward.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>

#include "comm/comm_counters.h"
#include "models/llama/moe.h"
#include "models/moe_cost.h"
#include "runtime/core/stream.h"
#include "parallel/dtensor.h"
#include "parallel/module.h"
#include "mpi_world.h"
#include "../test_util.h"

using namespace mt;

namespace {

void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE(got.shape() == want.shape());
  auto [num, den] = test::squared_diff_and_norm(got, want);
  INFO(what << ": relative error " << std::sqrt(num / std::max(den, 1e-300)));
  CHECK(den > 0);
  CHECK(std::sqrt(num) <= 1e-10 * std::sqrt(den) + 1e-14);
}

ModelConfig moe_config(const std::string& type, int64_t n_experts, int64_t shared) {
  ModelConfig c;
  c.type = type;
  c.dim = 8;
  c.ffn_dim = 12;
  c.moe.n_experts = n_experts;
  c.moe.experts_per_token = 2;
  c.moe.ffn_dim = 6;
  c.moe.shared_expert_ffn_dim = shared;
  c.moe.norm_topk_prob = true;
  return c;
}

// capacity_factor > 0: E / K, so that no expert drops a row (the capacity is every token) and the reference's
// routing is the dropless one, while ep sends fixed blocks of the capacity per expert (mostly padding).
// bound > 0: bounded dropless (model.moe.dropless_bound) in a training forward (loss_scale set): fixed blocks of
// ceil(bound N K / E) rows, no host read; the forward's all-to-alls are checked to be the equal-size kind.
void compare_ep(const std::string& type, int64_t shared, double capacity_factor = 0, double bound = 0) {
  ThreadsPerRank threads;
  const int n = world_size(), r = world_rank();
  const int64_t E = 2 * n, B = 2 * n, T = 3, C = 8, rows = B / n;
  INFO(type << " on ep " << n << ", " << E << " experts");
  DeviceMesh mesh = DeviceMesh::create({{"ep", n}});
  ParamFactory f{mesh, DType::f64, Device::cpu(), 7, 0.5};
  ModelConfig c = moe_config(type, E, shared);
  c.moe.capacity_factor = capacity_factor;
  c.moe.dropless_bound = bound;
  const MoeNames names{"gate_proj", "up_proj", "down_proj"};
  auto ref_ctx = std::make_shared<MoeContext>(c.moe, 1, DType::f64, Device::cpu()),
       par_ctx = std::make_shared<MoeContext>(c.moe, 1, DType::f64, Device::cpu());
  SparseMoeBlock ref("mlp", c, names, 0, f, ref_ctx), par("mlp", c, names, 0, f, par_ctx);
  // Expert parallel as apply_moe lays it out: each rank E / n experts of every stacked weight.
  par_ctx->ep = &mesh.group("ep");
  for (Parameter* q : par.experts->own_parameters()) relayout_param(*q, {Placement::Shard(0)});
  CHECK(par.experts->gate_proj->compute_local().size(0) == E / n);

  const Tensor x = test::randn({B, T, C}, 5), dy = test::randn({B, T, C}, 6);
  Tensor y_ref = ref.call(x);
  if (bound > 0) par_ctx->loss_scale = 1.0 / double(B * T);  // a training forward
  reset_comm_counters();
  const int64_t syncs = host_sync_count();
  Tensor y = par.call(x.slice0(r * rows, (r + 1) * rows).clone());
  if (bound > 0 && n > 1) {
    CHECK(host_sync_count() == syncs);  // no host read of the counts
    CHECK(comm_counters().calls(kMoeDispatchTag, "", "all_to_all") == 2);
    CHECK(comm_counters().calls(kMoeDispatchTag, "", "all_to_all_v") == 0);
  }
  check_close(y, y_ref.slice0(r * rows, (r + 1) * rows).clone(), "output (this rank's rows)");
  zero_grads(ref.parameters());
  zero_grads(par.parameters());
  Tensor dx_ref = ref.call_backward(dy);
  Tensor dx = par.call_backward(dy.slice0(r * rows, (r + 1) * rows).clone());
  check_close(dx, dx_ref.slice0(r * rows, (r + 1) * rows).clone(), "input gradient (this rank's rows)");
  auto rp = ref.parameters(), pp = par.parameters();
  REQUIRE(rp.size() == pp.size());
  for (size_t i = 0; i < rp.size(); ++i) {
    DTensor g = pp[i]->grad;
    // The experts' slices hold every rank's rows already; the replicated weights saw this rank's rows only.
    if (!g.placements()[0].is_shard()) g.spec.placements[0] = Placement::Partial();
    check_close(full_tensor(g), rp[i]->grad.local, pp[i]->name + " gradient");
  }
}

}  // namespace

TEST_CASE("moe: a sparse block on ep = every rank equals it on one rank (mixtral-style, forward and gradients)") {
  compare_ep("mixtral", 0);
}

TEST_CASE("moe: a sparse block with a shared expert on ep = every rank equals it on one rank (qwen2_moe)") {
  compare_ep("qwen2_moe", 10);
}

TEST_CASE("moe: expert parallel with a capacity (fixed blocks, counts on the device) equals one rank") {
  compare_ep("mixtral", 0, double(2 * world_size()) / 2);
}

TEST_CASE("moe: bounded dropless expert parallel (fixed blocks of the bound, no host read) equals one rank") {
  // The bound E / K: cap = every token of the rank, so no routing overflows it.
  compare_ep("mixtral", 0, 0, double(2 * world_size()) / 2);
  compare_ep("qwen2_moe", 10, 0, double(2 * world_size()) / 2);
}

TEST_CASE("moe: the dropless bound rises by 1.5 on an overflow and settles back after 100 clean steps") {
  ModelConfig c = moe_config("mixtral", 8, 0);  // E 8, K 2: the bound's most is E / K = 4
  c.moe.dropless_bound = 1.25;
  MoeContext ctx(c.moe, 1, DType::f64, Device::cpu());
  ctx.bound_tokens = 64;
  ctx.raise_bound(1);
  CHECK(ctx.bound == doctest::Approx(1.875));
  for (int64_t s = 0; s < MoeContext::kBoundSettleSteps - 1; ++s) ctx.settle_bound(2 + s);
  CHECK(ctx.bound == doctest::Approx(1.875));  // 99 clean steps: not yet
  ctx.raise_bound(101);                        // an overflow starts the count again
  CHECK(ctx.bound == doctest::Approx(2.8125));
  for (int64_t s = 0; s < MoeContext::kBoundSettleSteps; ++s) ctx.settle_bound(102 + s);
  CHECK(ctx.bound == doctest::Approx(1.875));
  for (int64_t s = 0; s < 3 * MoeContext::kBoundSettleSteps; ++s) ctx.settle_bound(202 + s);
  CHECK(ctx.bound == doctest::Approx(1.25));  // never below model.moe.dropless_bound
  for (int i = 0; i < 3; ++i) ctx.raise_bound(600 + i);
  CHECK(ctx.bound == doctest::Approx(4.0));  // clamped at E / K: cap = N
  CHECK_THROWS(ctx.raise_bound(700));        // no overflow is possible there
}
