// The model's layers against finite differences in f64: every layer's input
// gradient and parameter gradients, and the whole Llama's loss gradient, on a
// tiny config (tied and untied embeddings). Every rank runs the same checks on
// a replicated mesh.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <random>

#include "../check_error.h"
#include "models/llama/llama.h"
#include "runtime/kernels/ops.h"
#include "mpi_world.h"
#include "../test_util.h"

using namespace mt;

namespace {

ModelConfig tiny_config(bool tied = false) {
  ModelConfig c;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 24;
  c.vocab_size = 32;
  c.max_seq_len = 16;
  c.norm_eps = 1e-5;
  c.tie_embeddings = tied;
  c.init_std = 0.3;  // large enough that every path carries signal
  return c;
}

ParamFactory f64_factory(const DeviceMesh& mesh) {
  return {.mesh = mesh, .dtype = DType::f64, .seed = 7, .init_std = 0.3};
}

Tensor random_tensor(const Shape& s, uint64_t seed, double scale = 1.0) {
  return test::randn(s, seed, DType::f64, scale);
}

Tensor random_tokens(const Shape& s, int64_t vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  Tensor t = empty(s, DType::i32);
  for (int64_t i = 0; i < t.numel(); ++i) t.at<int32_t>(i) = int32_t(g() % uint64_t(vocab));
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.at<double>(i) * b.at<double>(i);
  return s;
}

// Relative error of an analytic derivative against a central difference.
void check_close(double analytic, double numeric, const std::string& what) {
  double err = std::abs(analytic - numeric) / std::max(1e-6, std::abs(analytic) + std::abs(numeric));
  INFO(what << ": analytic " << analytic << " numeric " << numeric);
  CHECK(err < 1e-5);
}

// Checks d(sum(m(x) * R))/dx and /dparams at a few elements each.
void check_module(Module& m, const Tensor& x, uint64_t seed) {
  Tensor y = m.call(x);
  Tensor R = random_tensor(y.shape(), seed);
  auto params = m.parameters();
  zero_grads(params);
  Tensor dx = m.call_backward(R.clone());
  auto loss = [&] { return dot(m.call(x), R); };
  std::mt19937_64 g(seed + 1);
  if (x.dtype() == DType::f64) {
    REQUIRE(dx.defined());
    for (int k = 0; k < 6; ++k) {
      int64_t i = int64_t(g() % uint64_t(x.numel()));
      check_close(dx.at<double>(i), test::finite_difference_at(x, i, loss),
                  m.name() + " input[" + std::to_string(i) + "]");
    }
  }
  for (Parameter* p : params) {
    const Tensor& w = p->value.local;
    for (int k = 0; k < 4; ++k) {
      int64_t i = int64_t(g() % uint64_t(w.numel()));
      check_close(p->grad.local.at<double>(i), test::finite_difference_at(w, i, loss),
                  p->name + "[" + std::to_string(i) + "]");
    }
  }
}

// Mean token cross-entropy of the model's logits.
double model_loss(LlamaForCausalLM& model, const Tensor& inputs, const Tensor& targets, bool backward) {
  Tensor logits = model.call(inputs);
  int64_t N = inputs.numel();
  Tensor losses = empty({N}, DType::f64);
  Tensor rows = as_rows(logits);
  cross_entropy_forward_backward(losses, backward ? rows : Tensor(), rows, targets.reshape({-1}), 1.0 / double(N));
  if (backward) model.call_backward(logits);
  return sum(losses) / double(N);
}

}  // namespace

TEST_CASE("model: every layer's gradients match finite differences (f64)") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  ParamFactory f = f64_factory(mesh);
  ModelConfig c = tiny_config();
  const int64_t B = 2, T = 7;
  auto rope = std::make_shared<SequenceContext>();
  Tensor pos = empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = t;
  rope->set_positions(pos, c.dim / c.n_heads, DType::f64, Device::cpu());

  SUBCASE("Linear") {
    Linear m("lin", 5, 3, f);
    check_module(m, random_tensor({B, T, 5}, 1), 11);
  }
  SUBCASE("Embedding") {
    Embedding m("emb", 11, 6, f);
    check_module(m, random_tokens({B, T}, 11, 2), 12);
  }
  SUBCASE("RMSNorm") {
    RMSNorm m("norm", 9, 1e-5, f);
    // Non-trivial weights so that the weight gradient is tested away from 1.
    m.weight->value.local = random_tensor({9}, 3);
    check_module(m, random_tensor({B, T, 9}, 4), 13);
  }
  SUBCASE("LlamaAttention (GQA, causal, RoPE)") {
    LlamaAttention m("attn", c, LlamaVariant{}, f, rope);
    check_module(m, random_tensor({B, T, c.dim}, 5), 14);
  }
  SUBCASE("LlamaMLP") {
    LlamaMLP m("mlp", c, f);
    check_module(m, random_tensor({B, T, c.dim}, 6), 15);
  }
  SUBCASE("LlamaDecoderLayer") {
    LlamaDecoderLayer m("layer", c, LlamaVariant{}, f, rope);
    check_module(m, random_tensor({B, T, c.dim}, 7), 16);
  }
}

TEST_CASE("model: the whole Llama's loss gradient matches finite differences (f64), tied and untied") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  for (bool tied : {false, true}) {
    ModelConfig c = tiny_config(tied);
    LlamaForCausalLM model(c, f64_factory(mesh));
    CHECK(model.parameters().size() == size_t(2 + 9 * c.n_layers + (tied ? 0 : 1)));
    Tensor inputs = random_tokens({2, 9}, c.vocab_size, 21), targets = random_tokens({2, 9}, c.vocab_size, 22);
    auto params = model.parameters();
    zero_grads(params);
    double l0 = model_loss(model, inputs, targets, true);
    CHECK(std::abs(l0 - std::log(double(c.vocab_size))) < 3.0);  // near uniform at init
    std::mt19937_64 g(tied ? 5 : 6);
    const double eps = 1e-6;
    for (Parameter* p : params) {
      const Tensor& w = p->value.local;
      for (int k = 0; k < 3; ++k) {
        int64_t i = int64_t(g() % uint64_t(w.numel()));
        double old = w.at<double>(i);
        w.at<double>(i) = old + eps;
        double lp = model_loss(model, inputs, targets, false);
        w.at<double>(i) = old - eps;
        double lm = model_loss(model, inputs, targets, false);
        w.at<double>(i) = old;
        check_close(p->grad.local.at<double>(i), (lp - lm) / (2 * eps),
                    std::string(tied ? "tied " : "") + p->name + "[" + std::to_string(i) + "]");
      }
    }
  }
}

TEST_CASE("model: Hugging Face names, shapes and the FLOP count") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  ModelConfig c = tiny_config();
  ParamFactory f;
  f.mesh = mesh;
  LlamaForCausalLM model(c, f);
  std::vector<std::string> names;
  for (Parameter* p : model.parameters()) names.push_back(p->name + shape_str(p->value.shape()));
  REQUIRE(names.size() == 21);
  CHECK(names[0] == "model.embed_tokens.weight(32, 16)");
  CHECK(names[1] == "model.layers.0.input_layernorm.weight(16,)");
  CHECK(names[2] == "model.layers.0.self_attn.q_proj.weight(16, 16)");
  CHECK(names[3] == "model.layers.0.self_attn.k_proj.weight(8, 16)");
  CHECK(names[5] == "model.layers.0.self_attn.o_proj.weight(16, 16)");
  CHECK(names[6] == "model.layers.0.post_attention_layernorm.weight(16,)");
  CHECK(names[7] == "model.layers.0.mlp.gate_proj.weight(24, 16)");
  CHECK(names[9] == "model.layers.0.mlp.down_proj.weight(16, 24)");
  CHECK(names[19] == "model.norm.weight(16,)");
  CHECK(names[20] == "lm_head.weight(32, 16)");
  // Parameters by hand: per layer 16*16*2 + 8*16*2 + 3*16*24 + 2*16 = 1952; + final norm 16 + two tables.
  CHECK(llama_num_params(c) == 2 * 1952 + 16 + 2 * 32 * 16);
  CHECK(llama_num_params(c, false) == 2 * 1952 + 16 + 32 * 16);
  CHECK(llama_flops_per_token(c, 7) == doctest::Approx(6.0 * (2 * 1952 + 16 + 32 * 16) + 12.0 * 2 * 16 * 7));
  // Norm weights start at one, matrices at the configured std and are parallelism-invariant.
  CHECK(model.model->norm->weight->value.local.at<float>(3) == 1.0f);
  CHECK_FALSE(model.parameters()[1]->weight_decay);
  CHECK(model.parameters()[2]->weight_decay);
}

// Pipeline parallel's two changes to the layers (parallel/module.h): what backward needs is kept per micro-batch
// slot, and under DeferWeightGrads the linear layers leave their weight gradients in a queue. Two micro-batches
// whose forwards run before either backward (the backwards in reverse order, the second with its weight gradients
// deferred and run last) must give the gradients of running them one after the other; and the model split into
// two chunks (keep_chunks on another copy) gives the whole model's logits and gradients.
TEST_CASE("model: micro-batch slots, deferred weight gradients and chunks match sequential runs (f64)") {
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", world_size()}});
  ModelConfig c = tiny_config();
  ParamFactory f = f64_factory(mesh);
  const Tensor x0 = random_tokens({2, 5}, c.vocab_size, 11), x1 = random_tokens({2, 5}, c.vocab_size, 12);
  const Tensor d0 = random_tensor({2, 5, c.vocab_size}, 13), d1 = random_tensor({2, 5, c.vocab_size}, 14);
  auto grads = [](LlamaForCausalLM& m) {
    std::vector<Tensor> g;
    for (Parameter* p : m.parameters()) g.push_back(p->grad.local.clone());
    return g;
  };
  auto max_diff = [](const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i)
      for (int64_t k = 0; k < a[i].numel(); ++k) worst = std::max(worst, std::abs(a[i].at<double>(k) - b[i].at<double>(k)));
    return worst;
  };

  LlamaForCausalLM ref(c, f);  // one micro-batch after the other
  Tensor l0 = ref.call(x0).clone();
  ref.call_backward(d0.clone());
  Tensor l1 = ref.call(x1).clone();
  ref.call_backward(d1.clone());
  const std::vector<Tensor> want = grads(ref);

  LlamaForCausalLM m(c, f);  // both forwards first
  {
    SavedSlot s(0);
    CHECK(max_diff({m.call(x0)}, {l0}) == 0);
  }
  {
    SavedSlot s(1);
    CHECK(max_diff({m.call(x1)}, {l1}) == 0);
  }
  WeightGradQueue q;
  {
    SavedSlot s(1);
    DeferWeightGrads defer(&q);
    m.call_backward(d1.clone());
  }
  CHECK(q.size() == size_t(2 * 7 + 1));  // 7 linears per layer and lm_head
  {
    SavedSlot s(0);
    m.call_backward(d0.clone());
  }
  const std::vector<Tensor> before_w = grads(m);
  for (auto& w : q) w();
  const std::vector<Tensor> got = grads(m);
  CHECK(max_diff(got, want) < 1e-12);
  CHECK(max_diff(before_w, want) > 1e-6);  // the queue held real work

  LlamaForCausalLM a(c, f), b(c, f);  // stage 0: embedding and layer 0; stage 1: layer 1, norm, lm_head
  a.keep_chunks({{0, 0, 1, true, false}});
  b.keep_chunks({{1, 1, 2, false, true}});
  CHECK(a.parameters().size() == 10);
  CHECK(b.parameters().size() == 11);
  CHECK(b.elsewhere().front() == "model.embed_tokens.weight");
  Tensor pos = empty({5}, DType::i64);  // chunks do not default the positions: the trainer sets them once
  for (int64_t t = 0; t < 5; ++t) pos.at<int64_t>(t) = t;
  a.set_positions(pos), b.set_positions(pos);
  Tensor h = a.chunk_forward(0, x0);
  Tensor logits = b.chunk_forward(0, h.clone());
  CHECK(max_diff({logits}, {l0}) == 0);
  Tensor dh = b.chunk_backward(0, d0.clone());
  CHECK_FALSE(a.chunk_backward(0, dh).defined());
  LlamaForCausalLM one(c, f);
  one.call(x0);
  one.call_backward(d0.clone());
  std::vector<Tensor> split = grads(a), whole = grads(one);
  for (Tensor& t : grads(b)) split.push_back(t);
  CHECK(max_diff(split, whole) == 0);
  CHECK_ERROR_CONTAINS(LlamaForCausalLM(tiny_config(true), f).keep_chunks({{0, 0, 1, true, false}}),
                       "model.tie_embeddings = true with parallel.pp > 1");
}
