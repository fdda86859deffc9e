// Each parallel style alone on Linear, Embedding, RMSNorm and an MLP block,
// forward and backward, against the same module unparallelized, on a 1-D tp
// mesh of every test rank count (uneven shards on 4, 6 and 8 ranks), in f64.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <random>

#include "../check_error.h"
#include "models/llama/llama.h"
#include "models/llama/parallelize.h"
#include "parallel/plan_yaml.h"
#include "parallel/style.h"
#include "mpi_world.h"
#include "../test_util.h"

using namespace mt;

namespace {

ParamFactory factory(const DeviceMesh& mesh) {
  return {.mesh = mesh, .dtype = DType::f64, .seed = 11, .init_std = 0.5};
}

Tensor random_full(const Shape& s, uint64_t seed) { return test::randn(s, seed); }

Placement norm(const Placement& p, int64_t ndim) {
  return p.is_shard() && p.dim < 0 ? Placement::Shard(int(p.dim + ndim)) : p;
}

// This rank's part of a full tensor laid out as `p` on the 1-D tp mesh.
Tensor part(const Tensor& full, const DeviceMesh& mesh, const Placement& p) {
  if (p.is_partial()) return full.clone();  // only used for inputs, never partial here
  return distribute_tensor(full, mesh, {norm(p, full.dim())}).local;
}

// The full tensor from this rank's part laid out as `p`, for a tensor of global shape `global`.
Tensor whole(const Tensor& local, const DeviceMesh& mesh, const Placement& p, const Shape& global) {
  return full_tensor(from_local(local, mesh, {norm(p, int64_t(global.size()))}, global));
}

void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE(got.shape() == want.shape());
  auto [num, den] = test::squared_diff_and_norm(got, want);
  INFO(what << ": relative error " << std::sqrt(num / std::max(den, 1e-300)));
  CHECK(std::sqrt(num) <= 1e-10 * std::sqrt(den) + 1e-14);
}

// Runs `style` on the module at `path` of `par` and compares with `ref` (the same module unparallelized):
// the output, the input gradient and every parameter's gradient.
template <class M> void compare(M& ref, M& par, const DeviceMesh& mesh, const ParallelPlan& plan, const Tensor& x_full,
                                Placement in, Placement out, Placement dx_layout) {
  parallelize(par, mesh, "tp", plan);
  Tensor y_ref = ref.call(x_full);
  Tensor y_local = par.call(x_full.dtype() == DType::i32 ? x_full : part(x_full, mesh, in));
  check_close(whole(y_local, mesh, out, y_ref.shape()), y_ref, "output");
  Tensor dy = random_full(y_ref.shape(), 99);
  zero_grads(ref.parameters());
  zero_grads(par.parameters());
  Tensor dx_ref = ref.call_backward(dy);
  Tensor dx_local = par.call_backward(part(dy, mesh, out));
  if (dx_ref.defined()) check_close(whole(dx_local, mesh, dx_layout, dx_ref.shape()), dx_ref, "input gradient");
  auto rp = ref.parameters(), pp = par.parameters();
  REQUIRE(rp.size() == pp.size());
  for (size_t i = 0; i < rp.size(); ++i) {
    DTensor g = pp[i]->grad;
    for (int d : pp[i]->partial_dims()) g.spec.placements[size_t(d)] = Placement::Partial();
    check_close(full_tensor(g), rp[i]->grad.local, pp[i]->name + " gradient");
  }
}

// compare() on a module made twice from the same arguments: the reference, and the one `style` parallelizes.
template <class M, class... Args>
void compare_one(const ParallelStyle& style, const DeviceMesh& mesh, const Tensor& x_full, Placement in, Placement out,
                 Placement dx_layout, const Args&... args) {
  M ref(args...), par(args...);
  compare(ref, par, mesh, {{par.name(), style}}, x_full, in, out, dx_layout);
}

}  // namespace

TEST_CASE("styles: Colwise, Rowwise, SequenceParallel and PrepareModuleInput against the unparallelized module") {
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"tp", n}});
  ParamFactory f = factory(mesh);
  const Placement R = Placement::Replicate(), S1 = Placement::Shard(1), Slast = Placement::Shard(-1);
  const int64_t B = 2, T = 24;  // T divides by 1, 2, 4, 6 and 8; feature sizes 10 and 11 do not
  Tensor x6 = random_full({B, T, 6}, 1), x10 = random_full({B, T, 10}, 2);
  Tensor tokens = empty({B, T}, DType::i32);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.at<int32_t>(i) = int32_t((i * 7) % 11);

  SUBCASE("ColwiseParallel on Linear, output Shard(-1) (uneven)") {
    compare_one<Linear>(ColwiseParallel{}, mesh, x6, R, Slast, R, "lin", 6, 10, f);
  }
  SUBCASE("ColwiseParallel on Linear, output Replicate, input Shard(1)") {
    compare_one<Linear>(ColwiseParallel{S1, R}, mesh, x6, S1, R, S1, "lin", 6, 10, f);
  }
  SUBCASE("RowwiseParallel on Linear, input Shard(-1) (uneven), output Replicate") {
    compare_one<Linear>(RowwiseParallel{}, mesh, x10, Slast, R, Slast, "lin", 10, 6, f);
  }
  SUBCASE("RowwiseParallel on Linear, output Shard(1)") {
    compare_one<Linear>(RowwiseParallel{std::nullopt, S1}, mesh, x10, Slast, S1, Slast, "lin", 10, 6, f);
  }
  SUBCASE("ColwiseParallel on Embedding (dim-sharded, uneven)") {
    compare_one<Embedding>(ColwiseParallel{}, mesh, tokens, R, Slast, R, "emb", 11, 10, f);
  }
  SUBCASE("RowwiseParallel on Embedding (vocab-sharded, masked rows), output Replicate") {
    compare_one<Embedding>(RowwiseParallel{}, mesh, tokens, R, R, R, "emb", 11, 10, f);
  }
  SUBCASE("RowwiseParallel on Embedding, output Shard(1)") {
    compare_one<Embedding>(RowwiseParallel{R, S1}, mesh, tokens, R, S1, R, "emb", 11, 10, f);
  }
  SUBCASE("SequenceParallel on RMSNorm: weight gradient partial over tp") {
    RMSNorm ref("norm", 10, 1e-5, f), par("norm", 10, 1e-5, f);
    ref.weight->value.local = random_full({10}, 5);
    copy_(par.weight->value.local, ref.weight->value.local);
    compare(ref, par, mesh, {{par.name(), SequenceParallel{}}}, x10, S1, S1, S1);
  }
  SUBCASE("An MLP block under sequence parallel: PrepareModuleInput, Colwise, Rowwise") {
    ModelConfig c;
    c.dim = 10;
    c.ffn_dim = 13;
    LlamaMLP ref("mlp", c, f), par("mlp", c, f);
    ParallelPlan plan{{"mlp", PrepareModuleInput{{S1}, {R}, false}},
                      {"mlp.gate_proj", ColwiseParallel{}},
                      {"mlp.up_proj", ColwiseParallel{}},
                      {"mlp.down_proj", RowwiseParallel{std::nullopt, S1}}};
    compare(ref, par, mesh, plan, x10, S1, S1, S1);
  }
}

TEST_CASE("styles: patterns, shard_param and the errors of a plan") {
  CHECK(pattern_matches("model.layers.*.mlp", "model.layers.3.mlp"));
  CHECK_FALSE(pattern_matches("model.layers.*.mlp", "model.layers.3.mlp.up_proj"));
  CHECK(pattern_matches("**.q_proj", "model.layers.0.self_attn.q_proj"));
  CHECK(pattern_matches("model.**", "model.layers.0.self_attn.q_proj"));
  CHECK(pattern_matches("model.layers.*.*_layernorm", "model.layers.1.post_attention_layernorm"));
  CHECK_FALSE(pattern_matches("**.q_proj", "model.layers.0.self_attn.k_proj"));

  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"tp", n}});
  ModelConfig c;
  c.dim = 16;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.ffn_dim = 24;
  c.vocab_size = 32;
  LlamaForCausalLM model(c, factory(mesh));
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "tp", {{"model.layers.*.attn", ColwiseParallel{}}}),
                       "plan pattern 'model.layers.*.attn' (ColwiseParallel) matches no module");
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "tp", {{"lm_head", ColwiseParallel{}}, {"*", RowwiseParallel{}}}),
                       "lm_head is matched by two plan entries");
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "tp", {{"model.layers.0.mlp", ColwiseParallel{}}}),
                       "ColwiseParallel cannot handle model.layers.0.mlp (LlamaMLP)");
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "tp", {{"model.norm", RowwiseParallel{}}}),
                       "RowwiseParallel cannot handle model.norm (RMSNorm)");
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "tp", {{"model.layers.0", SequenceParallel{}}}),
                       "SequenceParallel cannot handle model.layers.0 (LlamaDecoderLayer)");
  CHECK_ERROR_CONTAINS(parallelize(model, mesh, "nope", {}), "nope");
  CHECK_ERROR_CONTAINS(plan_from_config({TpPlanEntryConfig{"x", "Colwise", "", "", "", "", ""}}),
                       "parallel.tp_plan[0].style = 'Colwise'");
  CHECK(parse_plan_placement("Shard(-1)", "k") == Placement::Shard(-1));
  CHECK(parse_plan_placement("R", "k") == Placement::Replicate());
  CHECK(parse_plan_placement("Replicate", "k") == Placement::Replicate());
  CHECK(parse_plan_placement("Partial", "k") == Placement::Partial());
  CHECK(parse_plan_placement("P(max)", "k") == Placement::Partial(ReduceOp::max));
  CHECK_ERROR_CONTAINS(parse_plan_placement("S[1]", "k"), "k = 'S[1]': expected a placement");
  CHECK_ERROR_CONTAINS(parse_plan_placement("S(0)R", "k"), "k = 'S(0)R': expected a placement");
  // Each style takes its own arguments; the plan reader finds the style by its name.
  CHECK_ERROR_CONTAINS(plan_from_config({TpPlanEntryConfig{"x", "SequenceParallel", "", "", "", "", "true"}}),
                       "parallel.tp_plan[0].use_local_output: SequenceParallel takes no arguments");
  CHECK_ERROR_CONTAINS(
      plan_from_config({TpPlanEntryConfig{"x", "RowwiseParallel", "", "", "R", "", ""}}),
      "parallel.tp_plan[0].desired_input_layouts: RowwiseParallel takes input_layouts, output_layouts");
  ParallelPlan read = plan_from_config({TpPlanEntryConfig{"a", "ColwiseParallel", "Shard(1)", "S(-1)", "", "", ""},
                                        TpPlanEntryConfig{"b", "PrepareModuleInput", "S(1)", "", "R", "", "true"},
                                        TpPlanEntryConfig{"c", "SequenceParallel", "", "", "", "", ""}});
  REQUIRE(read.size() == 3);
  CHECK(style_str(read[0].style) == "ColwiseParallel(input S(1), output S(-1))");
  CHECK(style_str(read[1].style) == "PrepareModuleInput(S(1) -> R)");
  CHECK(std::get<PrepareModuleInput>(read[1].style).use_local_output);
  CHECK(style_name(read[2].style) == "SequenceParallel");

  // shard_param keeps this rank's chunk of the value (bit for bit) and resizes the gradient.
  Parameter* w = model.lm_head->weight;
  Tensor full = w->value.local.clone();
  shard_param(*w, 0, Placement::Shard(0));
  Chunk ch = chunk_of(32, n, mesh.coordinate(0));
  CHECK(w->value.local.shape() == Shape{ch.len, 16});
  CHECK(w->grad.local.shape() == Shape{ch.len, 16});
  if (ch.len > 0) CHECK(equal(w->value.local, full.slice0(ch.begin, ch.begin + ch.len)));
  CHECK(equal(full_tensor(w->value), full));
}
