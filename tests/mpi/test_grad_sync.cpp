// GradSync (parallel/grad_sync.h): buckets launched by backward's hooks give
// the sums of the one-redistribute-per-parameter rule (bit for bit on 2 ranks);
// every bucket is launched from a hook (overlapped with the rest of backward),
// none on a micro-batch that is not the last; bf16 reduction stays close;
// mixed-precision parameters carry an f32 gradient and a bf16 compute copy.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <random>

#include "models/llama/llama.h"
#include "models/llama/parallelize.h"
#include "parallel/fully_shard.h"
#include "parallel/grad_sync.h"
#include "runtime/kernels/ops.h"
#include "../skip.h"
#include "mpi_world.h"

using namespace mt;

namespace {

ModelConfig tiny() {
  return {.dim = 16, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 24, .vocab_size = 32, .max_seq_len = 8};
}

// Every rank gets different tokens: the gradients differ until they are summed.
Tensor rank_tokens(int rank, uint64_t salt) {
  std::mt19937_64 g(uint64_t(rank) * 1000 + salt);
  Tensor t = empty({2, 8}, DType::i32);
  for (int64_t i = 0; i < t.numel(); ++i) t.at<int32_t>(i) = int32_t(g() % 32);
  return t;
}

// Forward, a loss gradient of ones * 1e-2 on the logits, backward.
void backward_once(LlamaForCausalLM& m, const Tensor& tokens) {
  Tensor logits = m.call(tokens);
  Tensor d = empty(logits.shape(), logits.dtype());
  auto v = std::vector<double>(size_t(d.numel()), 1e-2);
  copy_(d, from_values(v, d.shape(), d.dtype()));
  m.call_backward(d);
}

}  // namespace

TEST_CASE("grad sync: hook-launched buckets equal per-parameter redistribute, bit for bit") {
  const int n = world_size();
  // On one rank both sides are no-ops (nothing is summed): the comparison could not fail.
  if (n == 1) MT_SKIP("needs 2 or more ranks");
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", n}});
  ParamFactory f{mesh, DType::f64, Device::cpu(), 3, 0.3};
  LlamaForCausalLM a(tiny(), f), b(tiny(), f);
  // Buckets of about 2 KiB: several of them, so that launches interleave with backward.
  GradSync sync(a, mesh, GradSyncOptions{{0}, 2048, DType::f64});
  INFO(sync.describe());

  auto pa = a.parameters(), pb = b.parameters();
  zero_grads(pa);
  zero_grads(pb);
  // Two micro-batches: the first must launch nothing.
  sync.arm(false);
  backward_once(a, rank_tokens(mesh.coordinate(0), 1));
  CHECK(sync.buckets_launched_early() == 0);
  sync.arm(true);
  backward_once(a, rank_tokens(mesh.coordinate(0), 2));
  int64_t early = sync.buckets_launched_early();
  sync.finish();
  backward_once(b, rank_tokens(mesh.coordinate(0), 1));
  backward_once(b, rank_tokens(mesh.coordinate(0), 2));
  for (Parameter* p : pb) {
    p->grad.spec.placements[0] = Placement::Partial();
    p->grad = redistribute(p->grad, p->value.spec);
  }
  if (n > 1) {
    CHECK(early >= 3);  // every bucket, launched by the hooks
    CHECK(sync.describe().find(std::to_string(early) + " bucket(s)") == 0);
  } else {
    CHECK(early == 0);  // one rank: nothing to sync, no buckets
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i]->name);
    CHECK(pa[i]->grad.placements() == pa[i]->value.placements());
    // Two ranks add two numbers: the same bits whatever the message size. With more ranks MPI may pick
    // another reduction order for another message size, so only rounding may differ.
    if (n <= 2) CHECK(equal(pa[i]->grad.local, pb[i]->grad.local));
    auto x = to_f64(pa[i]->grad.local), y = to_f64(pb[i]->grad.local);
    for (size_t j = 0; j < x.size(); ++j) CHECK(std::abs(x[j] - y[j]) <= 1e-12 * std::max(1.0, std::abs(y[j])));
  }
}

TEST_CASE("grad sync: bucket_bytes 0 is one redistribute per parameter, the same bits") {
  const int n = world_size();
  // On one rank both sides are no-ops (nothing is summed): the comparison could not fail.
  if (n == 1) MT_SKIP("needs 2 or more ranks");
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", n}});
  ParamFactory f{mesh, DType::f64, Device::cpu(), 3, 0.3};
  LlamaForCausalLM a(tiny(), f), b(tiny(), f);
  GradSync sync(a, mesh, GradSyncOptions{{0}, 0, DType::f64});
  auto pa = a.parameters(), pb = b.parameters();
  zero_grads(pa);
  zero_grads(pb);
  sync.arm(true);
  backward_once(a, rank_tokens(mesh.coordinate(0), 3));
  CHECK(sync.buckets_launched_early() == 0);  // no buckets: nothing launched by the hooks
  sync.finish();
  if (n > 1) CHECK(sync.describe().find("0 bucket(s) (f64); " + std::to_string(pa.size()) + " parameter(s)") == 0);
  backward_once(b, rank_tokens(mesh.coordinate(0), 3));
  for (Parameter* p : pb) {
    p->grad.spec.placements[0] = Placement::Partial();
    p->grad = redistribute(p->grad, p->value.spec);
  }
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i]->name);
    CHECK(pa[i]->grad.placements() == pa[i]->value.placements());
    CHECK(equal(pa[i]->grad.local, pb[i]->grad.local));  // the same collectives on the same messages
  }
}

TEST_CASE("grad sync: bf16 reduction of f32 gradients under mixed precision") {
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", n}});
  ParamFactory f{mesh, DType::bf16, Device::cpu(), 3, 0.3};
  LlamaForCausalLM a(tiny(), f);
  for (Parameter* p : a.parameters()) {
    CHECK(p->value.local.dtype() == DType::f32);  // master
    CHECK(p->grad.local.dtype() == DType::f32);
    const Tensor copy = compute_copy(*p);
    REQUIRE(copy.defined());
    CHECK(copy.dtype() == DType::bf16);
    CHECK(&p->compute_local() != &p->value.local);  // layers compute with the copy
    Tensor rounded = empty(p->value.local.shape(), DType::bf16);
    convert(rounded, p->value.local);
    CHECK(equal(rounded, copy));
  }
  GradSync sync(a, mesh, GradSyncOptions{{0}, 1 << 20, DType::bf16});
  auto ps = a.parameters();
  zero_grads(ps);
  sync.arm(true);
  backward_once(a, rank_tokens(mesh.coordinate(0), 5));
  // The exact f32 sums, from copies taken before the sync.
  std::vector<Tensor> want;
  for (Parameter* p : ps) {
    Tensor s = p->grad.local.clone();
    mesh.group(0).all_reduce(s, ReduceOp::sum);
    want.push_back(s);
  }
  sync.finish();
  for (size_t i = 0; i < ps.size(); ++i) {
    auto g = to_f64(ps[i]->grad.local), w = to_f64(want[i]);
    double num = 0, den = 0;
    for (size_t j = 0; j < g.size(); ++j) num += (g[j] - w[j]) * (g[j] - w[j]), den += w[j] * w[j];
    INFO(ps[i]->name);
    CHECK(std::sqrt(num / std::max(den, 1e-300)) < 2e-2);
  }
}

TEST_CASE("parameter states: layers see the compute copy at rest, fully_shard's gathered weight while its unit runs") {
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n}});
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dt));
    ParamFactory f{mesh, dt, Device::cpu(), 3, 0.3};
    LlamaForCausalLM a(tiny(), f);
    LlamaDecoderLayer* layer = a.model->layers[0];
    Parameter* w = static_cast<LlamaMLP*>(layer->mlp)->gate_proj->weight;  // (ffn, dim): sharded on dim 0
    // Whole and replicated before sharding: what layers must see gathered, in the compute dtype.
    const Tensor whole = w->compute_local().clone();
    CHECK(whole.dtype() == dt);
    CHECK((dt == DType::bf16) == compute_copy(*w).defined());
    FullyShardOptions o;
    o.min_weight_size = 0;
    o.units = {"model.embed_tokens", "model.layers.*", "model.norm+lm_head"};
    o.param_dtype = dt;
    auto fs = fully_shard(a, mesh, o);
    CHECK(w->reduced_dims() == std::vector<int>{0});  // the reduce-scatter sums over dp_shard
    CHECK(w->grad_ready_at() == layer);
    // At rest: this rank's shard (its compute copy under mixed precision) and the sharded gradient.
    auto at_rest = [&] {
      CHECK(w->compute_local().shape() == w->value.local.shape());
      if (dt == DType::bf16) CHECK(w->compute_local().data_ptr() == compute_copy(*w).data_ptr());
      else CHECK(w->compute_local().data_ptr() == w->value.local.data_ptr());
      CHECK(w->grad_local().data_ptr() == w->grad.local.data_ptr());
      CHECK(w->compute_offset() == Shape{0, 0});  // the gathered tensor's offset, gathered or not
    };
    at_rest();
    if (n > 1) CHECK(w->value.local.size(0) < whole.size(0));
    // Hooks after fully_shard's own (installed first): what the layer's forward and backward get.
    int forwards = 0, backwards = 0;
    layer->pre_forward.push_back([&](Module&) {
      CHECK(equal(w->compute_local(), whole));
      CHECK(w->grad_local().data_ptr() == w->grad.local.data_ptr());  // no gradient buffer in forward
      ++forwards;
    });
    layer->pre_backward.push_back([&](Module&) {
      CHECK(equal(w->compute_local(), whole));
      CHECK(w->grad_local().shape() == whole.shape());  // full size, reduce-scattered after the unit
      ++backwards;
    });
    zero_grads(a.parameters());
    Tensor logits = a.call(rank_tokens(mesh.coordinate(0), 7));
    at_rest();  // reshard_after_forward: the shard is back
    a.call_backward(zeros(logits.shape(), logits.dtype()));
    at_rest();
    CHECK(forwards == 1);
    CHECK(backwards == 1);
  }
}
