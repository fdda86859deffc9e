// Local attention (attention/local_attention.h) against the naive
// softmax(q k^T * scale + mask) v in f64: causal and full, grouped-query,
// sizes that are not multiples of the block, position offsets (ring
// attention's chunks), rows that see no key, the log-sum-exp, gradients by
// finite differences, accumulation, thread-count independence and errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

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


Tensor as_f32(const Tensor& t) { return from_values(to_f64(t), t.shape(), DType::f32); }

struct ThreadCount {  // restores the thread count at the end of a test
  int saved = cpu_threads();
  ~ThreadCount() { set_cpu_threads(saved); }
};

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

TEST_CASE("attention: every gradient element against finite differences, GQA, batches, block edges") {
  struct Case {
    int64_t B, T, S, H, KV, hd;
    AttentionOptions o;
  };
  // Small sizes keep the exhaustive check fast; 66 crosses a 64-key block edge.
  std::vector<Case> cases{
      {1, 66, 66, 2, 1, 4, {true, 0, 0, 0}},
      {2, 5, 5, 4, 2, 4, {false, 0.7, 0, 0}},
      {2, 5, 70, 2, 1, 4, {true, 0, 64, 0}},
      {2, 9, 12, 4, 2, 4, {true, 0, 0, 4}},  // queries 0..3 see nothing
  };
  for (const Case& c : cases) {
    CAPTURE(c.T);
    CAPTURE(c.S);
    CAPTURE(c.KV);
    CAPTURE(c.o.causal);
    CAPTURE(c.o.k_pos0);
    const int64_t B = c.B;
    Tensor q = randn_t({B, c.T, c.H, c.hd}, 21), k = randn_t({B, c.S, c.KV, c.hd}, 22);
    Tensor v = randn_t({B, c.S, c.KV, c.hd}, 23), R = randn_t({B, c.T, c.H, c.hd}, 24);
    Tensor out = empty(q.shape(), DType::f64), lse = empty({B, c.H, c.T}, DType::f64);
    attention_forward(out, lse, q, k, v, c.o);
    Tensor dq = empty(q.shape(), DType::f64), dk = empty(k.shape(), DType::f64), dv = empty(v.shape(), DType::f64);
    attention_backward(dq, dk, dv, R, q, k, v, out, lse, c.o);
    Tensor o2 = empty(q.shape(), DType::f64), l2 = empty(lse.shape(), DType::f64);
    auto loss = [&] {
      attention_forward(o2, l2, q, k, v, c.o);
      return dot(o2, R);
    };
    for (auto [x, dx, name] : {std::tuple{q, dq, "dq"}, {k, dk, "dk"}, {v, dv, "dv"}}) {
      double worst = 0;
      for (int64_t i = 0; i < x.numel(); ++i) {
        double old = x.at<double>(i);
        x.at<double>(i) = old + 1e-6;
        double lp = loss();
        x.at<double>(i) = old - 1e-6;
        double lm = loss();
        x.at<double>(i) = old;
        double num = (lp - lm) / 2e-6, an = dx.at<double>(i);
        REQUIRE(!std::isnan(an));
        worst = std::max(worst, std::abs(an - num) / std::max(1.0, std::abs(num)));
      }
      INFO(name, " worst relative error ", worst);
      CHECK(worst < 1e-6);
    }
    if (c.o.k_pos0 == 4) {  // rows without keys: out 0, lse -inf, dq 0
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < 4; ++t)
          for (int64_t h = 0; h < c.H; ++h) {
            CHECK(lse.at<double>((b * c.H + h) * c.T + t) == -std::numeric_limits<double>::infinity());
            for (int64_t e = 0; e < c.hd; ++e) {
              CHECK(out.at<double>(((b * c.T + t) * c.H + h) * c.hd + e) == 0.0);
              CHECK(dq.at<double>(((b * c.T + t) * c.H + h) * c.hd + e) == 0.0);
            }
          }
    }
    // accumulate: dk and dv add up, dq is overwritten.
    Tensor dq2 = randn_t(q.shape(), 25), dk2 = dk.clone(), dv2 = dv.clone();
    attention_backward(dq2, dk2, dv2, R, q, k, v, out, lse, c.o, /*accumulate=*/true);
    CHECK(rel_err(dq2, dq) == 0.0);
    Tensor dk_twice = dk.clone(), dv_twice = dv.clone();
    for (int64_t i = 0; i < dk.numel(); ++i) {
      dk_twice.at<double>(i) *= 2;
      dv_twice.at<double>(i) *= 2;
    }
    CHECK(rel_err(dk2, dk_twice) < 1e-15);
    CHECK(rel_err(dv2, dv_twice) < 1e-15);
  }
}

TEST_CASE("attention: lse and out by hand for one query and two keys") {
  // q = (1, 0), keys (1, 0) and (0, 1), scale 1: scores 1 and 0.
  Tensor q = from_values({1, 0}, {1, 1, 1, 2}, DType::f64);
  Tensor k = from_values({1, 0, 0, 1}, {1, 2, 1, 2}, DType::f64);
  Tensor v = from_values({2, 4, -6, 8}, {1, 2, 1, 2}, DType::f64);
  Tensor out = empty({1, 1, 1, 2}, DType::f64), lse = empty({1, 1, 1}, DType::f64);
  attention_forward(out, lse, q, k, v, {false, 1.0, 0, 0});
  const double e = std::exp(1.0), p0 = e / (e + 1), p1 = 1 / (e + 1);
  CHECK(lse.at<double>(0) == doctest::Approx(std::log(e + 1)).epsilon(1e-15));
  CHECK(out.at<double>(0) == doctest::Approx(2 * p0 - 6 * p1).epsilon(1e-15));
  CHECK(out.at<double>(1) == doctest::Approx(4 * p0 + 8 * p1).epsilon(1e-15));
  // Causal with the query at position 0: only key 0 is visible.
  attention_forward(out, lse, q, k, v, {true, 1.0, 0, 0});
  CHECK(lse.at<double>(0) == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(out.at<double>(0) == doctest::Approx(2.0).epsilon(1e-15));
  CHECK(out.at<double>(1) == doctest::Approx(4.0).epsilon(1e-15));
}

TEST_CASE("attention: every query masked, and no keys at all") {
  Tensor q = randn_t({1, 5, 2, 4}, 26), k = randn_t({1, 7, 1, 4}, 27), v = randn_t({1, 7, 1, 4}, 28);
  Tensor out = randn_t(q.shape(), 29), lse = empty({1, 2, 5}, DType::f64);
  attention_forward(out, lse, q, k, v, {true, 0, 0, 100});  // the keys lie after every query
  for (int64_t i = 0; i < out.numel(); ++i) CHECK(out.at<double>(i) == 0.0);
  for (int64_t i = 0; i < lse.numel(); ++i) CHECK(lse.at<double>(i) == -std::numeric_limits<double>::infinity());
  Tensor dq = randn_t(q.shape(), 30), dk = randn_t(k.shape(), 31), dv = randn_t(v.shape(), 32);
  attention_backward(dq, dk, dv, randn_t(q.shape(), 33), q, k, v, out, lse, {true, 0, 0, 100});
  for (const Tensor& g : {dq, dk, dv})
    for (int64_t i = 0; i < g.numel(); ++i) CHECK(g.at<double>(i) == 0.0);
  // S = 0.
  Tensor k0 = empty({1, 0, 1, 4}, DType::f64), v0 = empty({1, 0, 1, 4}, DType::f64);
  attention_forward(out, lse, q, k0, v0, {false, 0, 0, 0});
  for (int64_t i = 0; i < out.numel(); ++i) CHECK(out.at<double>(i) == 0.0);
  CHECK(lse.at<double>(0) == -std::numeric_limits<double>::infinity());
}

TEST_CASE("attention: f32 results do not depend on the thread count") {
  ThreadCount keep;
  const int64_t B = 2, T = 150, H = 4, KV = 2, hd = 16;
  Tensor q = as_f32(randn_t({B, T, H, hd}, 34)), k = as_f32(randn_t({B, T, KV, hd}, 35));
  Tensor v = as_f32(randn_t({B, T, KV, hd}, 36)), R = as_f32(randn_t({B, T, H, hd}, 37));
  auto run = [&](int threads) {
    set_cpu_threads(threads);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({B, H, T}, DType::f32);
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
    attention_forward(out, lse, q, k, v);
    attention_backward(dq, dk, dv, R, q, k, v, out, lse);
    return std::vector<Tensor>{out, lse, dq, dk, dv};
  };
  std::vector<Tensor> one = run(1), two = run(2);
  for (size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(rel_err(two[i], one[i]) < 1e-6);
  }
  // f32 gradients against f64 ones.
  Tensor qd = randn_t({B, T, H, hd}, 34), kd = randn_t({B, T, KV, hd}, 35), vd = randn_t({B, T, KV, hd}, 36);
  Tensor Rd = randn_t({B, T, H, hd}, 37);
  Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, T}, DType::f64);
  Tensor dq = empty(q.shape(), DType::f64), dk = empty(k.shape(), DType::f64), dv = empty(v.shape(), DType::f64);
  attention_forward(out, lse, qd, kd, vd);
  attention_backward(dq, dk, dv, Rd, qd, kd, vd, out, lse);
  CHECK(rel_err(one[1], lse) < 1e-6);
  CHECK(rel_err(one[2], dq) < 1e-5);
  CHECK(rel_err(one[3], dk) < 1e-5);
  CHECK(rel_err(one[4], dv) < 1e-5);
}

TEST_CASE("attention: shape and dtype errors") {
  Tensor q = randn_t({1, 5, 3, 4}, 38), k = randn_t({1, 5, 2, 4}, 39), v = randn_t({1, 5, 2, 4}, 40);
  Tensor out = empty(q.shape(), DType::f64), lse = empty({1, 3, 5}, DType::f64);
  CHECK_ERROR_CONTAINS(attention_forward(out, lse, q, k, v), "[attention] attention_forward: 3 query heads are not a multiple of 2 kv heads");
  Tensor q4 = randn_t({1, 5, 4, 4}, 41), out4 = empty(q4.shape(), DType::f64);
  CHECK_ERROR_CONTAINS(attention_forward(out4, empty({1, 4, 6}, DType::f64), q4, k, v),
                       "[attention] attention_forward: lse has shape (1, 4, 6), expected (1, 4, 5)");
  CHECK_ERROR_CONTAINS(attention_forward(out4, empty({1, 4, 5}, DType::f64), q4, k, randn_t({1, 6, 2, 4}, 42)),
                       "[attention] attention_forward: k (1, 5, 2, 4) and v (1, 6, 2, 4) do not match q (1, 5, 4, 4)");
  CHECK_ERROR_CONTAINS(attention_forward(out4, empty({1, 4, 5}, DType::f64), q4, as_f32(k), as_f32(v)),
                       "[attention] attention_forward: operands mix f64 and f32");
  Tensor lse4 = empty({1, 4, 5}, DType::f64);
  attention_forward(out4, lse4, q4, k, v);
  CHECK_ERROR_CONTAINS(attention_backward(empty(q4.shape(), DType::f64), empty({1, 5, 2, 3}, DType::f64),
                                          empty(k.shape(), DType::f64), out4, q4, k, v, out4, lse4),
                       "[attention] attention_backward: gradient shapes");
}

// ---------------------------------------------------------------- the full grid, f32 rows without keys

TEST_CASE("attention: forward grid: causal/full x KV 4, 2, 1 x T 5, 70, 130 x hd 8, 16, f64 and f32, out and lse") {
  struct Dims {
    int64_t T, S;
    AttentionOptions o;
  };
  std::vector<Dims> dims;
  for (bool causal : {true, false})
    for (auto [T, S] : {std::pair<int64_t, int64_t>{5, 5}, {70, 70}, {130, 130}}) dims.push_back({T, S, {causal, 0, 0, 0}});
  dims.push_back({5, 70, {true, 0, 64, 0}});    // ring chunk: queries at 64..68 see keys 0..64+t
  dims.push_back({70, 70, {true, 0, 0, 10}});   // queries 0..9 see nothing
  dims.push_back({70, 130, {false, 0.25, 0, 0}});  // custom scale
  dims.push_back({5, 130, {true, 2.0, 100, 0}});   // custom scale, offset across the second key block
  const int64_t B = 1, H = 4;
  uint64_t seed = 1000;
  for (const Dims& dm : dims)
    for (int64_t KV : {4, 2, 1})
      for (int64_t hd : {8, 16}) {
        CAPTURE(dm.T);
        CAPTURE(dm.S);
        CAPTURE(KV);
        CAPTURE(hd);
        CAPTURE(dm.o.causal);
        CAPTURE(dm.o.scale);
        CAPTURE(dm.o.q_pos0);
        CAPTURE(dm.o.k_pos0);
        Tensor q = randn_t({B, dm.T, H, hd}, ++seed), k = randn_t({B, dm.S, KV, hd}, ++seed);
        Tensor v = randn_t({B, dm.S, KV, hd}, ++seed);
        Naive want = naive_attention(q, k, v, dm.o);
        Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, dm.T}, DType::f64);
        attention_forward(out, lse, q, k, v, dm.o);
        CHECK(rel_err(out, want.out) < 1e-12);
        Tensor out32 = empty(q.shape(), DType::f32), lse32 = empty({B, H, dm.T}, DType::f32);
        attention_forward(out32, lse32, as_f32(q), as_f32(k), as_f32(v), dm.o);
        CHECK(out32.dtype() == DType::f32);
        CHECK(rel_err(out32, want.out) < 1e-5);
        // lse: -inf exactly where the naive one is, close elsewhere (f64 and f32).
        double worst = 0, worst32 = 0;
        int64_t mismatched_inf = 0;
        for (int64_t i = 0; i < lse.numel(); ++i) {
          double w = want.lse.at<double>(i), a = lse.at<double>(i), a32 = double(lse32.at<float>(i));
          if (std::isinf(w)) {
            mismatched_inf += !(std::isinf(a) && a < 0) + !(std::isinf(a32) && a32 < 0);
            continue;
          }
          worst = std::max(worst, std::abs(a - w) / std::max(1.0, std::abs(w)));
          worst32 = std::max(worst32, std::abs(a32 - w) / std::max(1.0, std::abs(w)));
        }
        CHECK(mismatched_inf == 0);
        CHECK(worst < 1e-12);
        CHECK(worst32 < 1e-5);
      }
}

TEST_CASE("attention: rows without keys in f32: out 0, lse -inf, zero dq, no NaN; f32 gradients match f64") {
  const int64_t B = 2, T = 20, S = 70, H = 4, KV = 2, hd = 16;
  const AttentionOptions o{true, 0, 0, 10};  // queries 0..9 see nothing
  Tensor q = randn_t({B, T, H, hd}, 2001), k = randn_t({B, S, KV, hd}, 2002), v = randn_t({B, S, KV, hd}, 2003);
  Tensor R = randn_t({B, T, H, hd}, 2004);
  Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, T}, DType::f64);
  attention_forward(out, lse, q, k, v, o);
  Tensor dq = empty(q.shape(), DType::f64), dk = empty(k.shape(), DType::f64), dv = empty(v.shape(), DType::f64);
  attention_backward(dq, dk, dv, R, q, k, v, out, lse, o);

  Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v), R32 = as_f32(R);
  Tensor out32 = empty(q.shape(), DType::f32), lse32 = empty({B, H, T}, DType::f32);
  attention_forward(out32, lse32, q32, k32, v32, o);
  // Garbage in the gradients beforehand: dq is overwritten, dk/dv too without accumulate.
  Tensor dq32 = as_f32(randn_t(q.shape(), 2005)), dk32 = as_f32(randn_t(k.shape(), 2006));
  Tensor dv32 = as_f32(randn_t(v.shape(), 2007));
  attention_backward(dq32, dk32, dv32, R32, q32, k32, v32, out32, lse32, o);
  for (const Tensor& t : {out32, dq32, dk32, dv32})
    for (int64_t i = 0; i < t.numel(); ++i) REQUIRE(!std::isnan(t.at<float>(i)));
  for (const Tensor& t : {out, dq, dk, dv})
    for (int64_t i = 0; i < t.numel(); ++i) REQUIRE(!std::isnan(t.at<double>(i)));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        float l = lse32.at<float>((b * H + h) * T + t);
        REQUIRE(!std::isnan(l));
        if (t < 10) {
          CHECK(l == -std::numeric_limits<float>::infinity());
          for (int64_t e = 0; e < hd; ++e) {
            CHECK(out32.at<float>(((b * T + t) * H + h) * hd + e) == 0.0f);
            CHECK(dq32.at<float>(((b * T + t) * H + h) * hd + e) == 0.0f);
          }
        } else {
          CHECK(std::isfinite(l));
        }
      }
  // Keys 10+T-1 = 29 and later are seen by no query: zero dk, dv.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 30; s < S; ++s)
      for (int64_t e = 0; e < KV * hd; ++e) {
        CHECK(dk32.at<float>((b * S + s) * KV * hd + e) == 0.0f);
        CHECK(dv32.at<float>((b * S + s) * KV * hd + e) == 0.0f);
      }
  CHECK(rel_err(out32, out) < 1e-5);
  CHECK(rel_err(dq32, dq) < 1e-5);
  CHECK(rel_err(dk32, dk) < 1e-5);
  CHECK(rel_err(dv32, dv) < 1e-5);
  // f32 accumulate adds to dk/dv, overwrites dq.
  Tensor dq32b = as_f32(randn_t(q.shape(), 2008)), dk32b = dk32.clone(), dv32b = dv32.clone();
  attention_backward(dq32b, dk32b, dv32b, R32, q32, k32, v32, out32, lse32, o, true);
  CHECK(rel_err(dq32b, dq32) == 0.0);
  for (int64_t i = 0; i < dk32.numel(); ++i) {
    CHECK(dk32b.at<float>(i) == doctest::Approx(2.0 * dk32.at<float>(i)).epsilon(1e-6));
    CHECK(dv32b.at<float>(i) == doctest::Approx(2.0 * dv32.at<float>(i)).epsilon(1e-6));
  }
}

TEST_CASE("attention: backward by finite differences at random elements: GQA, hd 16, custom scale, offsets") {
  struct Case {
    int64_t T, S, H, KV, hd;
    AttentionOptions o;
  };
  std::vector<Case> cases{
      {5, 70, 4, 2, 16, {true, 0, 64, 0}},     // ring chunk
      {20, 70, 4, 4, 16, {true, 0, 0, 10}},    // first 10 queries see nothing
      {70, 70, 4, 1, 8, {true, 0.5, 0, 0}},    // custom scale, crosses the 64-block
      {130, 130, 4, 2, 8, {false, 0, 0, 0}},   // full, three key blocks
  };
  for (const Case& c : cases) {
    CAPTURE(c.T);
    CAPTURE(c.S);
    CAPTURE(c.KV);
    CAPTURE(c.o.scale);
    CAPTURE(c.o.q_pos0);
    CAPTURE(c.o.k_pos0);
    const int64_t B = 1;
    Tensor q = randn_t({B, c.T, c.H, c.hd}, 3001), k = randn_t({B, c.S, c.KV, c.hd}, 3002);
    Tensor v = randn_t({B, c.S, c.KV, c.hd}, 3003), R = randn_t({B, c.T, c.H, c.hd}, 3004);
    Tensor out = empty(q.shape(), DType::f64), lse = empty({B, c.H, c.T}, DType::f64);
    attention_forward(out, lse, q, k, v, c.o);
    Tensor dq = empty(q.shape(), DType::f64), dk = empty(k.shape(), DType::f64), dv = empty(v.shape(), DType::f64);
    attention_backward(dq, dk, dv, R, q, k, v, out, lse, c.o);
    Tensor o2 = empty(q.shape(), DType::f64), l2 = empty(lse.shape(), DType::f64);
    auto loss = [&] {
      attention_forward(o2, l2, q, k, v, c.o);
      return dot(o2, R);
    };
    std::mt19937_64 g(3005);
    for (auto [x, dx, name] : {std::tuple{q, dq, "dq"}, {k, dk, "dk"}, {v, dv, "dv"}})
      for (int rep = 0; rep < 10; ++rep) {
        int64_t i = int64_t(g() % uint64_t(x.numel()));
        double keep = x.at<double>(i);
        x.at<double>(i) = keep + 1e-6;
        double lp = loss();
        x.at<double>(i) = keep - 1e-6;
        double lm = loss();
        x.at<double>(i) = keep;
        double num = (lp - lm) / 2e-6, an = dx.at<double>(i);
        INFO(name, "[", i, "] analytic ", an, " numeric ", num);
        CHECK(std::abs(an - num) <= 1e-6 * std::max(1.0, std::abs(num)));
      }
  }
}
