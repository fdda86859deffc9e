// CPU kernels against naive f64 references written here: attention (causal,
// full, grouped-query, position offsets, rows that see no key), cross-entropy
// (ignored targets, aliasing, errors), the vocab-parallel pieces, embedding
// shards, AdamW's formula, RoPE's rotation, and determinism over threads.
// (Layer gradients by finite differences are in tests/mpi/test_model.cpp.)
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>

#include "attention/local_attention.h"
#include "check_error.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

Tensor randn_t(const Shape& s, uint64_t seed, DType dt = DType::f64) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> n(0, 1);
  std::vector<double> v(size_t(shape_numel(s)));
  for (auto& x : v) x = n(g);
  return from_values(v, s, dt);
}

double rel_err(const Tensor& a, const Tensor& b) {
  auto x = to_f64(a), y = to_f64(b);
  REQUIRE(x.size() == y.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    REQUIRE(!std::isnan(x[i]));
    num += (x[i] - y[i]) * (x[i] - y[i]), den += y[i] * y[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct Naive {
  Tensor out, lse;
};
// softmax(q k^T * scale + mask) v per (b, h) in f64; kv head of h is h / (H / KV).
Naive naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), S = k.size(1), KV = k.size(2);
  double scale = o.scale ? o.scale : 1.0 / std::sqrt(double(hd));
  Naive r{zeros({B, T, H, hd}, DType::f64), empty({B, H, T}, DType::f64)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        int64_t j = h / (H / KV);
        std::vector<double> s(size_t(S), -INFINITY);
        double mx = -INFINITY;
        for (int64_t u = 0; u < S; ++u) {
          if (o.causal && o.k_pos0 + u > o.q_pos0 + t) continue;
          double d = 0;
          for (int64_t c = 0; c < hd; ++c)
            d += q.at<double>(((b * T + t) * H + h) * hd + c) * k.at<double>(((b * S + u) * KV + j) * hd + c);
          s[size_t(u)] = d * scale;
          mx = std::max(mx, s[size_t(u)]);
        }
        double l = 0;
        for (int64_t u = 0; u < S; ++u) l += std::isinf(s[size_t(u)]) ? 0 : std::exp(s[size_t(u)] - mx);
        r.lse.at<double>((b * H + h) * T + t) = l > 0 ? mx + std::log(l) : -INFINITY;
        if (l == 0) continue;
        for (int64_t u = 0; u < S; ++u) {
          if (std::isinf(s[size_t(u)])) continue;
          double p = std::exp(s[size_t(u)] - mx) / l;
          for (int64_t c = 0; c < hd; ++c)
            r.out.at<double>(((b * T + t) * H + h) * hd + c) += p * v.at<double>(((b * S + u) * KV + j) * hd + c);
        }
      }
  return r;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.at<double>(i) * b.at<double>(i);
  return s;
}

}  // namespace

TEST_CASE("attention: forward and lse against the naive softmax, causal and full, GQA, offsets") {
  struct Case {
    int64_t T, S, H, KV, hd;
    AttentionOptions o;
  };
  std::vector<Case> cases{
      {70, 70, 4, 4, 8, {true, 0, 0, 0}},   {70, 70, 4, 2, 8, {true, 0, 0, 0}},  {130, 130, 4, 1, 16, {true, 0, 0, 0}},
      {5, 5, 4, 2, 8, {false, 0, 0, 0}},    {70, 33, 2, 1, 8, {false, 0.3, 0, 0}},
      {5, 70, 4, 2, 8, {true, 0, 64, 0}},   // a query chunk late in the sequence (ring attention)
      {20, 70, 2, 2, 8, {true, 0, 0, 10}},  // the first 10 queries see no key
  };
  for (const Case& c : cases) {
    CAPTURE(c.T);
    CAPTURE(c.S);
    CAPTURE(c.KV);
    CAPTURE(c.o.causal);
    CAPTURE(c.o.q_pos0);
    CAPTURE(c.o.k_pos0);
    Tensor q = randn_t({2, c.T, c.H, c.hd}, 1), k = randn_t({2, c.S, c.KV, c.hd}, 2), v = randn_t({2, c.S, c.KV, c.hd}, 3);
    Naive want = naive_attention(q, k, v, c.o);
    Tensor out = empty(q.shape(), DType::f64), lse = empty({2, c.H, c.T}, DType::f64);
    attention_forward(out, lse, q, k, v, c.o);
    CHECK(rel_err(out, want.out) < 1e-12);
    for (int64_t i = 0; i < lse.numel(); ++i) {
      double a = lse.at<double>(i), b = want.lse.at<double>(i);
      if (std::isinf(b)) CHECK((std::isinf(a) && a < 0));
      else CHECK(std::abs(a - b) < 1e-12);
    }
    // f32 within 1e-5 of f64.
    Tensor out32 = empty(q.shape(), DType::f32), lse32 = empty({2, c.H, c.T}, DType::f32);
    attention_forward(out32, lse32, from_values(to_f64(q), q.shape(), DType::f32),
                      from_values(to_f64(k), k.shape(), DType::f32), from_values(to_f64(v), v.shape(), DType::f32), c.o);
    CHECK(rel_err(out32, want.out) < 1e-5);
  }
}

TEST_CASE("attention: backward against finite differences, rows without keys, accumulate") {
  const int64_t B = 1, T = 20, S = 70, H = 2, KV = 1, hd = 8;
  for (AttentionOptions o : {AttentionOptions{true, 0, 0, 0}, AttentionOptions{true, 0, 0, 10},
                             AttentionOptions{true, 0, 64, 0}, AttentionOptions{false, 0, 0, 0}}) {
    CAPTURE(o.q_pos0);
    CAPTURE(o.k_pos0);
    const int64_t Tq = o.k_pos0 == 0 && o.q_pos0 == 0 ? S : T;
    Tensor q = randn_t({B, Tq, H, hd}, 4), k = randn_t({B, S, KV, hd}, 5), v = randn_t({B, S, KV, hd}, 6);
    Tensor R = randn_t({B, Tq, H, hd}, 7);
    Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, Tq}, DType::f64);
    attention_forward(out, lse, q, k, v, o);
    Tensor dq = empty(q.shape(), DType::f64), dk = empty(k.shape(), DType::f64), dv = empty(v.shape(), DType::f64);
    attention_backward(dq, dk, dv, R, q, k, v, out, lse, o);
    auto loss = [&] {
      Tensor o2 = empty(q.shape(), DType::f64), l2 = empty({B, H, Tq}, DType::f64);
      attention_forward(o2, l2, q, k, v, o);
      return dot(o2, R);
    };
    std::mt19937_64 g(8);
    for (auto [x, dx, name] : {std::tuple{q, dq, "dq"}, {k, dk, "dk"}, {v, dv, "dv"}})
      for (int rep = 0; rep < 8; ++rep) {
        int64_t i = int64_t(g() % uint64_t(x.numel()));
        double old = x.at<double>(i);
        x.at<double>(i) = old + 1e-6;
        double lp = loss();
        x.at<double>(i) = old - 1e-6;
        double lm = loss();
        x.at<double>(i) = old;
        double num = (lp - lm) / 2e-6, an = dx.at<double>(i);
        INFO(name << "[" << i << "] analytic " << an << " numeric " << num);
        CHECK(std::abs(an - num) <= 1e-6 * std::max(1.0, std::abs(num)));
      }
    for (int64_t i = 0; i < dq.numel(); ++i) REQUIRE(!std::isnan(dq.at<double>(i)));
    if (o.k_pos0 == 10) {  // queries 0..9 see nothing: output 0, lse -inf, no gradient
      for (int64_t c = 0; c < hd; ++c) CHECK(out.at<double>(c) == 0.0);
      CHECK(std::isinf(lse.at<double>(0)));
      for (int64_t c = 0; c < hd; ++c) CHECK(dq.at<double>(c) == 0.0);
    }
    // accumulate = true adds to dk and dv; dq is overwritten.
    Tensor dk2 = dk.clone(), dv2 = dv.clone(), dq2 = empty(q.shape(), DType::f64);
    attention_backward(dq2, dk2, dv2, R, q, k, v, out, lse, o, true);
    for (int64_t i = 0; i < dk.numel(); ++i) CHECK(dk2.at<double>(i) == doctest::Approx(2 * dk.at<double>(i)));
    CHECK(rel_err(dq2, dq) == 0.0);
  }
}

TEST_CASE("kernels: cross-entropy: value, gradient, ignored targets, aliasing, errors") {
  const int64_t N = 7, V = 11;
  Tensor logits = randn_t({N, V}, 9);
  Tensor targets = from_values({3, 0, 10, -1, 5, 5, 1}, {N}, DType::i32);
  Tensor losses = empty({N}, DType::f64), d = empty({N, V}, DType::f64);
  cross_entropy_forward_backward(losses, d, logits, targets, 0.5);
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY, se = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits.at<double>(n * V + v));
    for (int64_t v = 0; v < V; ++v) se += std::exp(logits.at<double>(n * V + v) - mx);
    int32_t t = targets.at<int32_t>(n);
    if (t < 0) {
      CHECK(losses.at<double>(n) == 0.0);
      for (int64_t v = 0; v < V; ++v) CHECK(d.at<double>(n * V + v) == 0.0);
      continue;
    }
    CHECK(losses.at<double>(n) == doctest::Approx(mx + std::log(se) - logits.at<double>(n * V + t)).epsilon(1e-12));
    for (int64_t v = 0; v < V; ++v) {
      double p = std::exp(logits.at<double>(n * V + v) - mx) / se;
      CHECK(d.at<double>(n * V + v) == doctest::Approx(0.5 * (p - (v == t))).epsilon(1e-12));
    }
  }
  // In place: the logits become their gradient; without dlogits only the losses.
  Tensor inplace = logits.clone(), l2 = empty({N}, DType::f64), l3 = empty({N}, DType::f64);
  cross_entropy_forward_backward(l2, inplace, inplace, targets, 0.5);
  CHECK(rel_err(inplace, d) == 0.0);
  cross_entropy_forward_backward(l3, Tensor(), logits, targets, 0.5);
  CHECK(rel_err(l3, losses) == 0.0);
  Tensor bad = from_values({3, 0, 11, 1, 1, 1, 1}, {N}, DType::i32);
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(l3, Tensor(), logits, bad, 1.0),
                       "target 11 at position 2 is >= the vocabulary size 11");
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(empty({N}, DType::f32), Tensor(), logits, targets, 1.0),
                       "[kernels] cross_entropy: losses is f32");
}

TEST_CASE("kernels: the vocab-parallel pieces over two shards give the full cross-entropy") {
  const int64_t N = 7, V = 11, split = 6;
  Tensor logits = randn_t({N, V}, 10);
  Tensor targets = from_values({3, 0, 10, -1, 5, 6, 1}, {N}, DType::i32);
  Tensor want = empty({N}, DType::f64), dwant = empty({N, V}, DType::f64);
  cross_entropy_forward_backward(want, dwant, logits, targets, 0.25);
  Tensor parts[2] = {empty({N, split}, DType::f64), empty({N, V - split}, DType::f64)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      (v < split ? parts[0].at<double>(n * split + v) : parts[1].at<double>(n * (V - split) + v - split)) =
          logits.at<double>(n * V + v);
  // What the all-reduces do, by hand: max, then sums.
  Tensor mx[2] = {empty({N}, DType::f64), empty({N}, DType::f64)};
  for (int s = 0; s < 2; ++s) vocab_shard_max(mx[s], parts[s]);
  Tensor gmax = empty({N}, DType::f64);
  for (int64_t n = 0; n < N; ++n) gmax.at<double>(n) = std::max(mx[0].at<double>(n), mx[1].at<double>(n));
  Tensor se[2], tl[2];
  for (int s = 0; s < 2; ++s) {
    se[s] = empty({N}, DType::f64), tl[s] = empty({N}, DType::f64);
    vocab_shard_sumexp(se[s], tl[s], parts[s], targets, gmax, s ? split : 0);
  }
  Tensor gse = empty({N}, DType::f64), gtl = empty({N}, DType::f64);
  for (int64_t n = 0; n < N; ++n) {
    gse.at<double>(n) = se[0].at<double>(n) + se[1].at<double>(n);
    gtl.at<double>(n) = tl[0].at<double>(n) + tl[1].at<double>(n);
  }
  for (int s = 0; s < 2; ++s) {
    Tensor l = empty({N}, DType::f64);
    vocab_shard_loss(l, parts[s], parts[s], targets, gmax, gse, gtl, s ? split : 0, 0.25);
    CHECK(rel_err(l, want) < 1e-14);
    int64_t w = s ? V - split : split;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < w; ++v)
        CHECK(parts[s].at<double>(n * w + v) == doctest::Approx(dwant.at<double>(n * V + v + (s ? split : 0))));
  }
}

TEST_CASE("kernels: embedding shards, out-of-vocabulary tokens, deterministic backward") {
  const int64_t N = 9, V = 11, C = 5;
  Tensor table = randn_t({V, C}, 11);
  Tensor tokens = from_values({0, 3, 10, 3, 7, 5, 4, 3, 9}, {N}, DType::i32);
  Tensor full = empty({N, C}, DType::f64);
  embedding_forward(full, tokens, table, 0, V);
  // A shard of rows [4, 8): its lookups are the full ones for its rows, zeros elsewhere.
  Tensor shard = table.slice0(4, 8).clone(), part = empty({N, C}, DType::f64);
  embedding_forward(part, tokens, shard, 4, V);
  for (int64_t n = 0; n < N; ++n) {
    int32_t t = tokens.at<int32_t>(n);
    for (int64_t c = 0; c < C; ++c) {
      CHECK(full.at<double>(n * C + c) == table.at<double>(t * C + c));
      CHECK(part.at<double>(n * C + c) == (t >= 4 && t < 8 ? table.at<double>(t * C + c) : 0.0));
    }
  }
  Tensor bad = from_values({0, 3, 11, 3, 7, 5, 4, 3, 9}, {N}, DType::i32);
  CHECK_ERROR_CONTAINS(embedding_forward(full, bad, table, 0, V), "token 11 at position 2 is outside the vocabulary");
  // Backward: the transpose, accumulating; the same bits with 1 and 2 threads.
  Tensor dy = randn_t({N, C}, 12, DType::f32), d1 = zeros({V, C}, DType::f32), d2 = zeros({V, C}, DType::f32);
  set_cpu_threads(1);
  embedding_backward(d1, dy, tokens, 0);
  set_cpu_threads(2);
  embedding_backward(d2, dy, tokens, 0);
  CHECK(equal(d1, d2));
  for (int64_t c = 0; c < C; ++c)  // token 3 appears at positions 1, 3 and 7
    CHECK(d1.at<float>(3 * C + c) == doctest::Approx(dy.at<float>(1 * C + c) + dy.at<float>(3 * C + c) + dy.at<float>(7 * C + c)));
  embedding_backward(d2, dy, tokens, 0);
  CHECK(d2.at<float>(3 * C) == doctest::Approx(2 * d1.at<float>(3 * C)));
  Tensor x = randn_t({5000, 7}, 13, DType::f32);
  set_cpu_threads(1);
  double s1 = sum_squares(x);
  set_cpu_threads(2);
  CHECK(s1 == sum_squares(x));
  set_cpu_threads(1);
}

TEST_CASE("kernels: AdamW follows torch.optim.AdamW's formula; RoPE rotates pairs") {
  Tensor p = from_values({0.5, -1.0, 2.0}, {3}, DType::f64), m = zeros({3}, DType::f64), v = zeros({3}, DType::f64);
  std::vector<double> P{0.5, -1.0, 2.0}, M(3, 0), Vv(3, 0);
  const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int step = 1; step <= 3; ++step) {
    Tensor g = from_values({0.1 * step, -0.2, 0.3 / step}, {3}, DType::f64);
    adamw_step(p, g, m, v, lr, b1, b2, eps, wd, step);
    for (int i = 0; i < 3; ++i) {
      double gi = g.at<double>(i);
      P[size_t(i)] *= 1 - lr * wd;
      M[size_t(i)] = b1 * M[size_t(i)] + (1 - b1) * gi;
      Vv[size_t(i)] = b2 * Vv[size_t(i)] + (1 - b2) * gi * gi;
      P[size_t(i)] -= lr / (1 - std::pow(b1, step)) * M[size_t(i)] /
                      (std::sqrt(Vv[size_t(i)]) / std::sqrt(1 - std::pow(b2, step)) + eps);
      CHECK(p.at<double>(i) == doctest::Approx(P[size_t(i)]).epsilon(1e-14));
    }
  }
  // RoPE: pair (x_i, x_{i+hd/2}) rotated by pos * theta^(-2i/hd).
  const int64_t T = 5, hd = 8;
  Tensor pos = empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = 3 + 2 * t;
  Tensor cs = empty({T, hd}, DType::f64), sn = empty({T, hd}, DType::f64);
  rope_tables(cs, sn, pos, 500.0);
  Tensor x = randn_t({1, T, 2, hd}, 14), y = empty(x.shape(), DType::f64);
  rope_forward(y, x, cs, sn);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        double a = double(pos.at<int64_t>(t)) * std::pow(500.0, -2.0 * double(i) / double(hd));
        int64_t o = (t * 2 + h) * hd;
        double x1 = x.at<double>(o + i), x2 = x.at<double>(o + i + hd / 2);
        CHECK(y.at<double>(o + i) == doctest::Approx(x1 * std::cos(a) - x2 * std::sin(a)));
        CHECK(y.at<double>(o + i + hd / 2) == doctest::Approx(x2 * std::cos(a) + x1 * std::sin(a)));
      }
  // The backward is the transpose: <rope(x), r> == <x, rope_backward(r)>.
  Tensor r = randn_t(x.shape(), 15), dx = empty(x.shape(), DType::f64);
  rope_backward(dx, r, cs, sn);
  CHECK(dot(y, r) == doctest::Approx(dot(x, dx)).epsilon(1e-12));
}
