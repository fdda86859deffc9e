// Activation recompute (parallel/recompute.h, parallel.recompute): a small Llama in f64 and f32, forward and
// backward of two micro-batches with and without recompute (whole decoder layers, selective with attention
// kept, every second layer, the MLPs, the attention blocks, the whole trunk), on 1 rank and with tensor
// parallel (and context parallel where the world splits): logits and every gradient bit for bit the same.
// What a recomputed forward holds is measured by the host allocator (the exact bytes each block releases),
// the cp bytes of backward by the communication counters (selective recompute never repeats ring attention's
// transfers), and the errors of bad patterns and keep entries.
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <random>

#include "../check_error.h"
#include "attention/sequence_shard.h"
#include "models/llama/llama.h"
#include "models/llama/parallelize.h"
#include "parallel/recompute.h"
#include "runtime/core/allocator.h"
#include "runtime/train/run_config.h"
#include "runtime/kernels/ops.h"
#include "mpi_world.h"
#include "../test_util.h"
#include "../skip.h"

using namespace mt;

namespace {

constexpr int64_t kB = 2, kT = 16;

ModelConfig small_config() {
  ModelConfig c;
  c.dim = 64;
  c.n_layers = 4;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.ffn_dim = 48;
  c.vocab_size = 64;
  c.max_seq_len = kT;
  c.norm_eps = 1e-5;
  c.init_std = 0.3;
  return c;
}

// The largest tp of {4, 2, 1} that divides n and the heads.
int pick_tp(int n) {
  for (int tp : {4, 2})
    if (n % tp == 0) return tp;
  return 1;
}

struct Setup {
  ParallelDims pd;
  DeviceMesh mesh;
};

Setup make_setup(int cp, int tp) {
  Setup s;
  s.pd = ParallelDims::from_sizes({{dim::cp_ring, cp}, {dim::tp, tp}, {dim::dp_replicate, world_size() / (cp * tp)}});
  s.pd.sequence_parallel = true;
  s.mesh = s.pd.make_mesh();
  return s;
}

Tensor tokens(uint64_t seed) {
  std::mt19937_64 g(seed);
  Tensor t = empty({kB, kT}, DType::i32);
  for (int64_t i = 0; i < t.numel(); ++i) t.at<int32_t>(i) = int32_t(g() % 64);
  return t;
}

Tensor random_like(const Tensor& t, uint64_t seed) { return test::randn(t.shape(), seed, t.dtype()); }

struct Result {
  std::vector<Tensor> logits;               // per micro-batch, this rank's part
  std::vector<Tensor> grads;                // every parameter's local gradient after both micro-batches
  std::vector<int64_t> held;                // bytes held after each forward (allocated after - before)
  int64_t peak = 0;                         // peak allocated bytes over forwards and backwards, above the start
  int64_t cp_forward = 0, cp_backward = 0;  // cp bytes of the first micro-batch
  std::vector<Module*> recomputed;
};

int64_t cp_bytes(const CommCounters& c) { return c.bytes("", dim::cp_ring); }

Result run(const Setup& s, DType dtype, const RecomputeConfig& rc) {
  ParamFactory f;
  f.mesh = s.mesh;
  f.dtype = dtype;
  f.seed = 3;
  f.init_std = 0.3;
  LlamaForCausalLM model(small_config(), f);
  ParallelConfig p;
  p.tp = s.pd.tp();
  p.cp = s.pd.cp();
  p.recompute = rc;
  parallelize_llama(model, s.mesh, s.pd, p, kT);
  SequenceShard shard = sequence_shard(s.pd.cp_load_balance, kT, s.pd.cp_ring(), s.pd.cp_ring_rank(s.mesh));
  model.set_positions(shard_positions(shard));
  Result r;
  for (Module* m : model.modules())
    if (m->recompute) r.recomputed.push_back(m);
  auto params = model.parameters();
  zero_grads(params);
  const Device cpu = Device::cpu();
  const int64_t start = int64_t(allocator_stats(cpu).allocated_bytes);
  reset_peak_allocated(cpu);
  for (int mb = 0; mb < 2; ++mb) {
    Tensor in = tokens(100 + uint64_t(mb));
    if (s.pd.cp() > 1) in = shard_sequence(in, shard);
    reset_comm_counters();
    const int64_t before = int64_t(allocator_stats(cpu).allocated_bytes);
    Tensor logits = model.call(in);
    r.held.push_back(int64_t(allocator_stats(cpu).allocated_bytes) - before);
    if (mb == 0) r.cp_forward = cp_bytes(comm_counters());
    r.logits.push_back(logits.clone());
    Tensor dlogits = random_like(logits, 200 + uint64_t(mb));
    reset_comm_counters();
    model.call_backward(dlogits);
    if (mb == 0) r.cp_backward = cp_bytes(comm_counters());
  }
  r.peak = int64_t(allocator_stats(cpu).peak_allocated_bytes) - start;
  for (Parameter* p : params) r.grads.push_back(p->grad.local.clone());
  return r;
}

RecomputeConfig rc(std::vector<std::string> patterns, int every = 1, std::vector<std::string> keep = {}) {
  RecomputeConfig c;
  c.patterns = std::move(patterns);
  c.every = every;
  c.keep = std::move(keep);
  return c;
}

void check_identical(const Result& got, const Result& base, const std::string& what) {
  INFO(what);
  REQUIRE(got.logits.size() == base.logits.size());
  for (size_t i = 0; i < got.logits.size(); ++i) CHECK(equal(got.logits[i], base.logits[i]));
  REQUIRE(got.grads.size() == base.grads.size());
  int differ = 0;
  for (size_t i = 0; i < got.grads.size(); ++i) differ += equal(got.grads[i], base.grads[i]) ? 0 : 1;
  CHECK(differ == 0);
}

struct Variant {
  const char* name;
  RecomputeConfig config;
};

std::vector<Variant> variants() {
  return {{"full: model.layers.*", rc({"model.layers.*"})},
          {"selective: model.layers.*, keep attention", rc({"model.layers.*"}, 1, {"attention"})},
          {"every 2: model.layers.*", rc({"model.layers.*"}, 2)},
          {"model.layers.*.mlp", rc({"model.layers.*.mlp"})},
          {"model.layers.*.self_attn", rc({"model.layers.*.self_attn"})},
          {"model.layers.*.self_attn, keep attention", rc({"model.layers.*.self_attn"}, 1, {"attention"})},
          {"the whole trunk: model", rc({"model"})},
          {"every 2 of layers 0-1 and the mlps of 2-3", rc({"model.layers.[01]", "model.layers.[23].mlp"}, 2)}};
}

// The variants named (all when empty) in each dtype against no recompute on a cp x tp mesh.
void check_mesh(int cp, int tp, const std::vector<std::string>& f64_names, const std::vector<std::string>& f32_names) {
  ThreadsPerRank threads;
  Setup s = make_setup(cp, tp);
  const int64_t L = small_config().n_layers;
  for (DType dt : {DType::f64, DType::f32}) {
    const auto& names = dt == DType::f64 ? f64_names : f32_names;
    Result base = run(s, dt, RecomputeConfig{});
    CHECK(base.recomputed.empty());
    for (const Variant& v : variants()) {
      if (!names.empty() && std::find(names.begin(), names.end(), v.name) == names.end()) continue;
      std::string what =
          fmt::format("{} on cp={} x tp={} ({} ranks), {}", v.name, cp, tp, world_size(), dtype_name(dt));
      Result r = run(s, dt, v.config);
      const std::string p0 = v.config.patterns[0];
      const size_t expected = p0 == "model" ? 1 : p0.find("[01]") != std::string::npos ? 2 : size_t(L / v.config.every);
      CHECK(r.recomputed.size() == expected);
      check_identical(r, base, what);
      if (cp > 1) {
        INFO(what);
        CHECK(base.cp_forward > 0);
        CHECK(r.cp_forward == base.cp_forward);
        // Ring attention's transfers are repeated only when attention itself runs again.
        const bool keeps = !v.config.keep.empty();
        const bool all_attention = !keeps && v.config.every == 1 &&
                                   (p0 == "model.layers.*" || p0 == "model.layers.*.self_attn" || p0 == "model");
        if (keeps || p0 == "model.layers.*.mlp") CHECK(r.cp_backward == base.cp_backward);
        if (all_attention) CHECK(r.cp_backward == base.cp_backward + base.cp_forward);
        if (v.config.every == 2 && p0 == "model.layers.*")
          CHECK(r.cp_backward == base.cp_backward + base.cp_forward / 2);
      }
    }
  }
}

}  // namespace

TEST_CASE("recompute: bit-identical losses and gradients on 1 rank (every rank alone), f64 and f32") {
  check_mesh(1, 1, {}, {});
}

// Fewer variants where every forward communicates: oversubscribed ranks make each collective slow.
TEST_CASE("recompute: bit-identical losses and gradients with tp") {
  const int tp = pick_tp(world_size());
  if (tp == 1) MT_SKIP("needs 2 ranks or more (1 rank: the case above)");
  check_mesh(1, tp,
             {"full: model.layers.*", "selective: model.layers.*, keep attention", "every 2: model.layers.*",
              "model.layers.*.mlp", "model.layers.*.self_attn"},
             {"full: model.layers.*", "selective: model.layers.*, keep attention"});
}

TEST_CASE("recompute: bit-identical with cp x tp; selective recompute never repeats ring attention's transfers") {
  if (world_size() % 2 != 0) MT_SKIP("needs an even number of ranks");
  check_mesh(2, pick_tp(world_size() / 2),
             {"full: model.layers.*", "selective: model.layers.*, keep attention", "every 2: model.layers.*",
              "model.layers.*.mlp"},
             {"selective: model.layers.*, keep attention"});
}

TEST_CASE("recompute: a recomputed block releases what it saved (bytes held after forward, exactly)") {
  ThreadsPerRank threads;
  Setup s = make_setup(1, 1);  // every rank alone: no communication, the allocator sees only the model
  const ModelConfig c = small_config();
  for (DType dt : {DType::f64, DType::f32}) {
    INFO(dtype_name(dt));
    const int64_t e = int64_t(dtype_size(dt)), a = int64_t(dtype_size(accum_dtype(dt)));
    const int64_t BT = kB * kT, C = c.dim, F = c.ffn_dim, hd = c.dim / c.n_heads, KV = c.n_kv_heads, H = c.n_heads;
    // Per decoder layer, what backward needs beyond the layer's input (held by the layer, or the next one):
    // the two norms' rstd, the normed input of q/k/v, q, k, v, the attention output and lse, the residual sum
    // h, its normed value (the MLP's input), gate, up and silu(gate) * up. (Sizes are multiples of 64 bytes:
    // the allocator's rounding adds nothing.)
    const int64_t attention_kept = BT * C * e + kB * H * kT * a;  // out and lse
    const int64_t layer = BT * (5 * C + 2 * KV * hd + 3 * F) * e + (2 * BT + kB * H * kT) * a;
    const int64_t mlp = 3 * BT * F * e;  // gate, up, silu(gate) * up (the input is kept)
    Result none = run(s, dt, RecomputeConfig{});
    Result full = run(s, dt, rc({"model.layers.*"}));
    Result keep = run(s, dt, rc({"model.layers.*"}, 1, {"attention"}));
    Result every2 = run(s, dt, rc({"model.layers.*"}, 2));
    Result mlps = run(s, dt, rc({"model.layers.*.mlp"}));
    for (size_t mb = 0; mb < 2; ++mb) {
      CHECK(none.held[mb] - full.held[mb] == c.n_layers * layer);
      CHECK(keep.held[mb] - full.held[mb] == c.n_layers * attention_kept);
      CHECK(none.held[mb] - every2.held[mb] == c.n_layers / 2 * layer);
      CHECK(none.held[mb] - mlps.held[mb] == c.n_layers * mlp);
    }
    CHECK(full.peak < keep.peak);
    CHECK(keep.peak < none.peak);
  }
}

TEST_CASE("recompute: errors name the key, the pattern and the module; nothing changes on an error") {
  Setup s = make_setup(1, 1);
  ParamFactory f;
  f.mesh = s.mesh;
  f.dtype = DType::f32;
  LlamaForCausalLM model(small_config(), f);
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layer.*"})),
                       "parallel.recompute.patterns[0] = 'model.layer.*' matches no module of the model");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*", "model.layers.*.input_layernorm"})),
                       "parallel.recompute.patterns[1] = 'model.layers.*.input_layernorm' matches "
                       "model.layers.0.input_layernorm (RMSNorm): recompute applies to LlamaModel, "
                       "LlamaDecoderLayer, LlamaAttention, LlamaMLP, SparseMoeBlock modules only");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"lm_head"})), "matches lm_head (Linear)");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*", "model.layers.*.mlp"})),
                       "model.layers.0.mlp ('model.layers.*.mlp') lies inside model.layers.0 ('model.layers.*')");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*"}, 1, {"mlp"})),
                       "parallel.recompute.keep[0] = 'mlp': expected one of 'attention'");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*.mlp"}, 1, {"attention"})),
                       "parallel.recompute.keep[0] = 'attention': no recomputed module contains one");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*"}, 0)), "parallel.recompute.every = 0");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({"model.layers.*"}, 5)),
                       "parallel.recompute.every = 5: the patterns match only 4 modules");
  CHECK_ERROR_CONTAINS(apply_recompute_llama(model, rc({}, 1, {"attention"})),
                       "parallel.recompute.keep is set but parallel.recompute.patterns is empty");
  for (Module* m : model.modules()) CHECK_FALSE(m->recompute);
  for (auto* layer : model.model->layers) CHECK_FALSE(layer->self_attn->keep_attention_output);
  CHECK(apply_recompute_llama(model, RecomputeConfig{}).empty());  // the default: off

  // The config's own checks name the key.
  const std::string base = "parallel: {recompute: {patterns: ['model.layers.*'], keep: [attention], every: 2}}\n";
  Config cfg = config_from_yaml_string(base);
  CHECK(cfg.parallel.recompute.patterns == std::vector<std::string>{"model.layers.*"});
  CHECK(cfg.parallel.recompute.every == 2);
  CHECK(cfg.parallel.recompute.keep == std::vector<std::string>{"attention"});
  CHECK(config_from_yaml_string("").parallel.recompute.patterns.empty());
  CHECK_ERROR_CONTAINS(config_from_yaml_string(base, {"parallel.recompute.keep=[mlp]"}),
                       "parallel.recompute.keep[0] = 'mlp': expected one of 'attention'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string(base, {"parallel.recompute.every=0"}), "parallel.recompute.every = 0");
  CHECK_ERROR_CONTAINS(config_from_yaml_string(base, {"parallel.recompute.patterns=['']"}),
                       "parallel.recompute.patterns[0] is empty");
  CHECK_ERROR_CONTAINS(config_from_yaml_string(base, {"parallel.recompute.patterns=[]"}),
                       "parallel.recompute.keep is set but parallel.recompute.patterns is empty");
  CHECK_ERROR_CONTAINS(config_from_yaml_string(base, {"parallel.recompute.kept=[attention]"}),
                       "unknown key 'parallel.recompute.kept'");
}
