// Local attention (attention/local_attention.h) against the naive
// softmax(q k^T * scale + mask) v in f64: causal and full, grouped-query,
// sizes that are not multiples of the block, position offsets (ring
// attention's chunks), rows that see no key, the log-sum-exp, gradients by
// finite differences, accumulation, thread-count independence and errors; and attention_merge, the log-sum-exp
// merge of two attention results (ring attention), against the same naive attention. copy_slice and the
// sequence split have their own files (test_copy_slice.cpp, test_sequence_shard.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <random>
#include <tuple>
#include <vector>

#include "attention/local_attention.h"
#include "attention/sequence_shard.h"
#include "check_error.h"
#include "test_util.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

Tensor randn_t(const Shape& s, uint64_t seed, DType dt = DType::f64) { return test::randn(s, seed, dt); }
using test::dot;      // the f64 dot product of two tensors, the finite differences' scalar loss
using test::rel_err;  // norm-wise relative error (tests/test_util.h), a NaN fails

// A case's sizes and options in one line, for its failure messages (INFO).
std::string case_str(int64_t T, int64_t S, int64_t KV, int64_t hd, const AttentionOptions& o) {
  return "T=" + std::to_string(T) + " S=" + std::to_string(S) + " KV=" + std::to_string(KV) + " hd=" +
         std::to_string(hd) + " causal=" + std::to_string(o.causal) + " scale=" + std::to_string(o.scale) +
         " q_pos0=" + std::to_string(o.q_pos0) + " k_pos0=" + std::to_string(o.k_pos0);
}

struct Naive {
  Tensor out, lse;
};
// softmax(q k^T * scale + mask) v per (b, h) in f64; kv head of h is h / (H / KV). The mask: causal
// (key position <= query position) and, with o.doc_start, key position >= the query's document start.
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
          if (o.doc_start.defined() && o.k_pos0 + u < o.doc_start.at<int64_t>(b * T + t)) continue;
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

struct NaiveGrads {
  Tensor dq, dk, dv;
};
// The backward of naive_attention by the standard formulas, in f64: P = softmax row (0 where masked),
// dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale.
NaiveGrads naive_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& o) {
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), S = k.size(1), KV = k.size(2);
  double scale = o.scale ? o.scale : 1.0 / std::sqrt(double(hd));
  Naive f = naive_attention(q, k, v, o);
  NaiveGrads g{zeros(q.shape(), DType::f64), zeros(k.shape(), DType::f64), zeros(v.shape(), DType::f64)};
  auto qi = [&](int64_t b, int64_t t, int64_t h, int64_t c) { return ((b * T + t) * H + h) * hd + c; };
  auto ki = [&](int64_t b, int64_t u, int64_t j, int64_t c) { return ((b * S + u) * KV + j) * hd + c; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t j = h / (H / KV);
        const double L = f.lse.at<double>((b * H + h) * T + t);
        if (std::isinf(L)) continue;
        double D = 0;
        for (int64_t c = 0; c < hd; ++c) D += dout.at<double>(qi(b, t, h, c)) * f.out.at<double>(qi(b, t, h, c));
        for (int64_t u = 0; u < S; ++u) {
          if (o.causal && o.k_pos0 + u > o.q_pos0 + t) continue;
          if (o.doc_start.defined() && o.k_pos0 + u < o.doc_start.at<int64_t>(b * T + t)) continue;
          double sc = 0, dp = 0;
          for (int64_t c = 0; c < hd; ++c) {
            sc += q.at<double>(qi(b, t, h, c)) * k.at<double>(ki(b, u, j, c));
            dp += dout.at<double>(qi(b, t, h, c)) * v.at<double>(ki(b, u, j, c));
          }
          const double P = std::exp(sc * scale - L), dS = P * (dp - D) * scale;
          for (int64_t c = 0; c < hd; ++c) {
            g.dv.at<double>(ki(b, u, j, c)) += P * dout.at<double>(qi(b, t, h, c));
            g.dq.at<double>(qi(b, t, h, c)) += dS * k.at<double>(ki(b, u, j, c));
            g.dk.at<double>(ki(b, u, j, c)) += dS * q.at<double>(qi(b, t, h, c));
          }
        }
      }
  return g;
}

// (B, T) i64 document starts for queries at global positions q_pos0 + t: the largest entry of the row's
// `starts` at or before the position, 0 when none is.
Tensor doc_start_tensor(int64_t T, int64_t q_pos0, const std::vector<std::vector<int64_t>>& starts) {
  const int64_t B = int64_t(starts.size());
  Tensor d = empty({B, T}, DType::i64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t s = 0;
      for (int64_t x : starts[size_t(b)])
        if (x <= q_pos0 + t) s = std::max(s, x);
      d.at<int64_t>(b * T + t) = s;
    }
  return d;
}

// lse: -inf exactly where want is; elsewhere the largest |got - want| / max(1, |want|).
double lse_err(const Tensor& got, const Tensor& want, int64_t& mismatched_inf) {
  auto a = to_f64(got), w = to_f64(want);
  REQUIRE(a.size() == w.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(!std::isnan(a[i]));
    if (std::isinf(w[i]) || std::isinf(a[i])) {
      mismatched_inf += !(a[i] == w[i] && w[i] < 0);
      continue;
    }
    worst = std::max(worst, std::abs(a[i] - w[i]) / std::max(1.0, std::abs(w[i])));
  }
  return worst;
}

// Local attention's out and lse, then dq, dk, dv for the output gradient dout; q, k, v and all of these f64.
struct Attended {
  Tensor out, lse, dq, dk, dv;
};
Attended attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const AttentionOptions& o) {
  Attended a;
  a.out = empty(q.shape(), DType::f64), a.lse = empty({q.size(0), q.size(2), q.size(1)}, DType::f64);
  attention_forward(a.out, a.lse, q, k, v, o);
  a.dq = empty(q.shape(), DType::f64), a.dk = empty(k.shape(), DType::f64), a.dv = empty(v.shape(), DType::f64);
  attention_backward(a.dq, a.dk, a.dv, dout, q, k, v, a.out, a.lse, o);
  return a;
}

// The kernel's dq, dk, dv (f64) against central differences of the scalar loss sum(out * R), at `reps`
// random elements of each input.
void check_gradients_fd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& R, const AttentionOptions& o,
                        uint64_t seed, int reps) {
  auto [out, lse, dq, dk, dv] = attend(q, k, v, R, o);
  Tensor o2 = empty(q.shape(), DType::f64), l2 = empty(lse.shape(), DType::f64);
  auto loss = [&] {
    attention_forward(o2, l2, q, k, v, o);
    return dot(o2, R);
  };
  std::mt19937_64 g(seed);
  for (auto [x, dx, name] : {std::tuple{q, dq, "dq"}, {k, dk, "dk"}, {v, dv, "dv"}})
    for (int rep = 0; rep < reps; ++rep) {
      int64_t i = int64_t(g() % uint64_t(x.numel()));
      double num = test::finite_difference_at(x, i, loss), an = dx.at<double>(i);
      INFO(name, "[", i, "] analytic ", an, " numeric ", num);
      CHECK(std::abs(an - num) <= 1e-6 * std::max(1.0, std::abs(num)));
    }
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
      {70, 70, 4, 4, 8, {true, 0, 0, 0, {}}},
      {70, 70, 4, 2, 8, {true, 0, 0, 0, {}}},
      {130, 130, 4, 1, 16, {true, 0, 0, 0, {}}},
      {5, 5, 4, 2, 8, {false, 0, 0, 0, {}}},
      {70, 33, 2, 1, 8, {false, 0.3, 0, 0, {}}},
      {5, 70, 4, 2, 8, {true, 0, 64, 0, {}}},   // a query chunk late in the sequence (ring attention)
      {20, 70, 2, 2, 8, {true, 0, 0, 10, {}}},  // the first 10 queries see no key
  };
  for (const Case& c : cases) {
    INFO(case_str(c.T, c.S, c.KV, c.hd, c.o));
    Tensor q = randn_t({2, c.T, c.H, c.hd}, 1), k = randn_t({2, c.S, c.KV, c.hd}, 2),
           v = randn_t({2, c.S, c.KV, c.hd}, 3);
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
                      from_values(to_f64(k), k.shape(), DType::f32), from_values(to_f64(v), v.shape(), DType::f32),
                      c.o);
    CHECK(rel_err(out32, want.out) < 1e-5);
  }
}

TEST_CASE("attention: backward against finite differences, rows without keys, accumulate") {
  const int64_t B = 1, T = 20, S = 70, H = 2, KV = 1, hd = 8;
  for (AttentionOptions o : {AttentionOptions{true, 0, 0, 0, {}}, AttentionOptions{true, 0, 0, 10, {}},
                             AttentionOptions{true, 0, 64, 0, {}}, AttentionOptions{false, 0, 0, 0, {}}}) {
    CAPTURE(o.q_pos0);
    CAPTURE(o.k_pos0);
    const int64_t Tq = o.k_pos0 == 0 && o.q_pos0 == 0 ? S : T;
    Tensor q = randn_t({B, Tq, H, hd}, 4), k = randn_t({B, S, KV, hd}, 5), v = randn_t({B, S, KV, hd}, 6);
    Tensor R = randn_t({B, Tq, H, hd}, 7);
    auto [out, lse, dq, dk, dv] = attend(q, k, v, R, o);
    check_gradients_fd(q, k, v, R, o, 8, 8);  // 8 random elements of each input
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
      {1, 66, 66, 2, 1, 4, {true, 0, 0, 0, {}}},
      {2, 5, 5, 4, 2, 4, {false, 0.7, 0, 0, {}}},
      {2, 5, 70, 2, 1, 4, {true, 0, 64, 0, {}}},
      {2, 9, 12, 4, 2, 4, {true, 0, 0, 4, {}}},  // queries 0..3 see nothing
  };
  for (const Case& c : cases) {
    INFO(case_str(c.T, c.S, c.KV, c.hd, c.o));
    const int64_t B = c.B;
    Tensor q = randn_t({B, c.T, c.H, c.hd}, 21), k = randn_t({B, c.S, c.KV, c.hd}, 22);
    Tensor v = randn_t({B, c.S, c.KV, c.hd}, 23), R = randn_t({B, c.T, c.H, c.hd}, 24);
    auto [out, lse, dq, dk, dv] = attend(q, k, v, R, c.o);
    Tensor o2 = empty(q.shape(), DType::f64), l2 = empty(lse.shape(), DType::f64);
    auto loss = [&] {
      attention_forward(o2, l2, q, k, v, c.o);
      return dot(o2, R);
    };
    for (auto [x, dx, name] : {std::tuple{q, dq, "dq"}, {k, dk, "dk"}, {v, dv, "dv"}}) {
      double worst = 0;
      const std::vector<double> numeric = test::finite_differences(x, loss);
      for (int64_t i = 0; i < x.numel(); ++i) {
        double num = numeric[size_t(i)], an = dx.at<double>(i);
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
  attention_forward(out, lse, q, k, v, {false, 1.0, 0, 0, {}});
  const double e = std::exp(1.0), p0 = e / (e + 1), p1 = 1 / (e + 1);
  CHECK(lse.at<double>(0) == doctest::Approx(std::log(e + 1)).epsilon(1e-15));
  CHECK(out.at<double>(0) == doctest::Approx(2 * p0 - 6 * p1).epsilon(1e-15));
  CHECK(out.at<double>(1) == doctest::Approx(4 * p0 + 8 * p1).epsilon(1e-15));
  // Causal with the query at position 0: only key 0 is visible.
  attention_forward(out, lse, q, k, v, {true, 1.0, 0, 0, {}});
  CHECK(lse.at<double>(0) == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(out.at<double>(0) == doctest::Approx(2.0).epsilon(1e-15));
  CHECK(out.at<double>(1) == doctest::Approx(4.0).epsilon(1e-15));
}

TEST_CASE("attention: every query masked, and no keys at all") {
  Tensor q = randn_t({1, 5, 2, 4}, 26), k = randn_t({1, 7, 1, 4}, 27), v = randn_t({1, 7, 1, 4}, 28);
  Tensor out = randn_t(q.shape(), 29), lse = empty({1, 2, 5}, DType::f64);
  attention_forward(out, lse, q, k, v, {true, 0, 0, 100, {}});  // the keys lie after every query
  for (int64_t i = 0; i < out.numel(); ++i) CHECK(out.at<double>(i) == 0.0);
  for (int64_t i = 0; i < lse.numel(); ++i) CHECK(lse.at<double>(i) == -std::numeric_limits<double>::infinity());
  Tensor dq = randn_t(q.shape(), 30), dk = randn_t(k.shape(), 31), dv = randn_t(v.shape(), 32);
  attention_backward(dq, dk, dv, randn_t(q.shape(), 33), q, k, v, out, lse, {true, 0, 0, 100, {}});
  for (const Tensor& g : {dq, dk, dv})
    for (int64_t i = 0; i < g.numel(); ++i) CHECK(g.at<double>(i) == 0.0);
  // S = 0.
  Tensor k0 = empty({1, 0, 1, 4}, DType::f64), v0 = empty({1, 0, 1, 4}, DType::f64);
  attention_forward(out, lse, q, k0, v0, {false, 0, 0, 0, {}});
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
  CHECK_ERROR_CONTAINS(attention_forward(out, lse, q, k, v),
                       "[attention] attention_forward: 3 query heads are not a multiple of 2 kv heads");
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
    for (auto [T, S] : {std::pair<int64_t, int64_t>{5, 5}, {70, 70}, {130, 130}})
      dims.push_back({T, S, {causal, 0, 0, 0, {}}});
  dims.push_back({5, 70, {true, 0, 64, 0, {}}});       // ring chunk: queries at 64..68 see keys 0..64+t
  dims.push_back({70, 70, {true, 0, 0, 10, {}}});      // queries 0..9 see nothing
  dims.push_back({70, 130, {false, 0.25, 0, 0, {}}});  // custom scale
  dims.push_back({5, 130, {true, 2.0, 100, 0, {}}});   // custom scale, offset across the second key block
  const int64_t B = 1, H = 4;
  uint64_t seed = 1000;
  for (const Dims& dm : dims)
    for (int64_t KV : {4, 2, 1})
      for (int64_t hd : {8, 16}) {
        INFO(case_str(dm.T, dm.S, KV, hd, dm.o));
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
  const AttentionOptions o{true, 0, 0, 10, {}};  // queries 0..9 see nothing
  Tensor q = randn_t({B, T, H, hd}, 2001), k = randn_t({B, S, KV, hd}, 2002), v = randn_t({B, S, KV, hd}, 2003);
  Tensor R = randn_t({B, T, H, hd}, 2004);
  auto [out, lse, dq, dk, dv] = attend(q, k, v, R, o);

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
      {5, 70, 4, 2, 16, {true, 0, 64, 0, {}}},    // ring chunk
      {20, 70, 4, 4, 16, {true, 0, 0, 10, {}}},   // first 10 queries see nothing
      {70, 70, 4, 1, 8, {true, 0.5, 0, 0, {}}},   // custom scale, crosses the 64-block
      {130, 130, 4, 2, 8, {false, 0, 0, 0, {}}},  // full, three key blocks
  };
  for (const Case& c : cases) {
    INFO(case_str(c.T, c.S, c.KV, c.hd, c.o));
    const int64_t B = 1;
    Tensor q = randn_t({B, c.T, c.H, c.hd}, 3001), k = randn_t({B, c.S, c.KV, c.hd}, 3002);
    Tensor v = randn_t({B, c.S, c.KV, c.hd}, 3003), R = randn_t({B, c.T, c.H, c.hd}, 3004);
    check_gradients_fd(q, k, v, R, c.o, 3005, 10);
  }
}

// ---------------------------------------------------------------- document masks (doc_start)

TEST_CASE("attention: document masks against the naive f64 attention: forward, lse, gradients, f64 and f32") {
  struct Case {
    const char* what;
    int64_t T, S, KV, hd;
    bool causal;
    double scale;
    int64_t q_pos0, k_pos0;
    std::vector<std::vector<int64_t>> starts;  // per batch row: the global positions where documents start
    int64_t keyless_rows;                      // (b, t) rows that see no key (out 0, lse -inf)
  };
  // Boundaries inside 64-row blocks (37, 100, 101, 5, 6, 130) and on them (64); B = 2, H = 4.
  std::vector<Case> cases{
      {"causal, no offsets", 150, 150, 2, 8, true, 0, 0, 0, {{37, 100, 101}, {0, 5, 6, 64, 130}}, 0},
      {"full, no offsets", 150, 150, 2, 8, false, 0, 0, 0, {{37, 100, 101}, {0, 5, 6, 64, 130}}, 0},
      {"causal, KV 1, hd 16, scale 0.5", 150, 150, 1, 16, true, 0.5, 0, 0, {{1, 2, 3, 90}, {149}}, 0},
      // queries 200..349 against keys 100..249: documents from 300 (row 0) and 260 (row 1) see no key
      {"causal, query chunk after the key chunk",
       150,
       150,
       2,
       8,
       true,
       0,
       200,
       100,
       {{150, 230, 300}, {90, 260}},
       50 + 90},
      // queries 100..249 against keys 0..149: the document from 200 sees no key; row 1 sees every key
      {"full, query chunk after the key chunk", 150, 150, 2, 8, false, 0, 100, 0, {{40, 120, 200}, {}}, 50},
      // queries 0..69 against keys 70..139, full: every document starts before the keys, nothing is hidden
      {"full, key chunk after the query chunk", 70, 70, 2, 8, false, 0, 0, 70, {{30, 60}, {0}}, 0},
      // every query of row 1 starts its document after the last key: row 1's dk, dv are zero
      {"causal, a batch row that sees nothing", 100, 70, 2, 8, true, 0, 100, 0, {{20, 65}, {80}}, 100},
  };
  const int64_t B = 2, H = 4;
  uint64_t seed = 5000;
  for (const Case& c : cases) {
    INFO(c.what);
    CAPTURE(c.T);
    CAPTURE(c.S);
    CAPTURE(c.q_pos0);
    CAPTURE(c.k_pos0);
    AttentionOptions o{c.causal, c.scale, c.q_pos0, c.k_pos0, doc_start_tensor(c.T, c.q_pos0, c.starts)};
    Tensor q = randn_t({B, c.T, H, c.hd}, ++seed), k = randn_t({B, c.S, c.KV, c.hd}, ++seed);
    Tensor v = randn_t({B, c.S, c.KV, c.hd}, ++seed), R = randn_t({B, c.T, H, c.hd}, ++seed);
    Naive want = naive_attention(q, k, v, o);
    NaiveGrads wg = naive_attention_backward(R, q, k, v, o);
    // The naive reference has the rows without keys the case says (so the case tests what it claims).
    int64_t keyless = 0;
    for (int64_t i = 0; i < want.lse.numel(); ++i) keyless += std::isinf(want.lse.at<double>(i));
    CHECK(keyless == c.keyless_rows * H);

    for (DType dt : {DType::f64, DType::f32}) {
      INFO("dtype ", dtype_name(dt));
      const double tol = dt == DType::f64 ? 1e-10 : 1e-5;
      auto cast = [&](const Tensor& t) { return dt == DType::f64 ? t.clone() : as_f32(t); };
      Tensor qd = cast(q), kd = cast(k), vd = cast(v), Rd = cast(R);
      Tensor out = empty(q.shape(), dt), lse = empty({B, H, c.T}, dt);
      attention_forward(out, lse, qd, kd, vd, o);
      CHECK(rel_err(out, want.out) < tol);
      int64_t bad_inf = 0;
      CHECK(lse_err(lse, want.lse, bad_inf) < tol);
      CHECK(bad_inf == 0);
      // Garbage in the gradients beforehand: all three are overwritten.
      Tensor dq = cast(randn_t(q.shape(), ++seed)), dk = cast(randn_t(k.shape(), ++seed));
      Tensor dv = cast(randn_t(v.shape(), ++seed));
      attention_backward(dq, dk, dv, Rd, qd, kd, vd, out, lse, o);
      CHECK(rel_err(dq, wg.dq) < tol);
      CHECK(rel_err(dk, wg.dk) < tol);
      CHECK(rel_err(dv, wg.dv) < tol);
      // Rows without keys: out 0, lse -inf, dq 0, exactly.
      auto outv = to_f64(out), lsev = to_f64(lse), dqv = to_f64(dq);
      int64_t zero_rows = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < c.T; ++t) {
            if (!std::isinf(want.lse.at<double>((b * H + h) * c.T + t))) continue;
            bool zero = lsev[size_t((b * H + h) * c.T + t)] == -INFINITY;
            for (int64_t e = 0; e < c.hd; ++e) {
              const size_t i = size_t(((b * c.T + t) * H + h) * c.hd + e);
              zero = zero && outv[i] == 0.0 && dqv[i] == 0.0;
            }
            zero_rows += zero;
          }
      CHECK(zero_rows == c.keyless_rows * H);
      if (c.keyless_rows == c.T) {  // every query of row 1 sees nothing: row 1's key gradients are 0
        auto dkv = to_f64(dk), dvv = to_f64(dv);
        const size_t half = dkv.size() / 2;
        double s = 0;
        for (size_t i = half; i < dkv.size(); ++i) s += std::abs(dkv[i]) + std::abs(dvv[i]);
        CHECK(s == 0.0);
      }
      // accumulate = true adds to dk and dv (whatever they hold) and overwrites dq.
      Tensor dk0 = cast(randn_t(k.shape(), ++seed)), dv0 = cast(randn_t(v.shape(), ++seed));
      Tensor dk2 = dk0.clone(), dv2 = dv0.clone(), dq2 = cast(randn_t(q.shape(), ++seed));
      attention_backward(dq2, dk2, dv2, Rd, qd, kd, vd, out, lse, o, /*accumulate=*/true);
      CHECK(rel_err(dq2, dq) == 0.0);
      Tensor dk_sum = empty(k.shape(), DType::f64), dv_sum = empty(v.shape(), DType::f64);
      auto a = to_f64(dk0), bb = to_f64(dk), x = to_f64(dv0), y = to_f64(dv);
      for (int64_t i = 0; i < dk_sum.numel(); ++i) {
        dk_sum.at<double>(i) = a[size_t(i)] + bb[size_t(i)];
        dv_sum.at<double>(i) = x[size_t(i)] + y[size_t(i)];
      }
      CHECK(rel_err(dk2, dk_sum) < (dt == DType::f64 ? 1e-14 : 1e-6));
      CHECK(rel_err(dv2, dv_sum) < (dt == DType::f64 ? 1e-14 : 1e-6));
    }
  }
}

TEST_CASE("attention: document masks, gradients by finite differences of the kernel's own forward") {
  const int64_t B = 2, T = 150, H = 4, KV = 2, hd = 8;
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    AttentionOptions o{causal, 0, 0, 0, doc_start_tensor(T, 0, {{37, 100}, {5, 6, 70}})};
    Tensor q = randn_t({B, T, H, hd}, 5101), k = randn_t({B, T, KV, hd}, 5102), v = randn_t({B, T, KV, hd}, 5103);
    Tensor R = randn_t({B, T, H, hd}, 5104);
    check_gradients_fd(q, k, v, R, o, 5105, 8);
  }
}

TEST_CASE("attention: document masks: every query starting at 0 is no mask; doc_start errors") {
  const int64_t B = 2, T = 70, H = 4, KV = 2, hd = 8;
  Tensor q = randn_t({B, T, H, hd}, 5201), k = randn_t({B, T, KV, hd}, 5202), v = randn_t({B, T, KV, hd}, 5203);
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, T}, DType::f64);
    Tensor out2 = empty(q.shape(), DType::f64), lse2 = empty({B, H, T}, DType::f64);
    attention_forward(out, lse, q, k, v, {causal, 0, 0, 0, {}});
    attention_forward(out2, lse2, q, k, v, {causal, 0, 0, 0, zeros({B, T}, DType::i64)});
    CHECK(rel_err(out2, out) < 1e-14);
    CHECK(rel_err(lse2, lse) < 1e-14);
  }
  Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, T}, DType::f64);
  CHECK_ERROR_CONTAINS(attention_forward(out, lse, q, k, v, {true, 0, 0, 0, zeros({B, T + 1}, DType::i64)}),
                       "doc_start");
  CHECK_ERROR_CONTAINS(attention_forward(out, lse, q, k, v, {true, 0, 0, 0, zeros({B, T}, DType::i32)}), "doc_start");
}

// ---------------------------------------------------------------- attention_merge (with the naive attention above)

TEST_CASE("attention_merge: two or three disjoint key sets merge to attention over all keys") {
  const int64_t B = 2, T = 150, S = 150, H = 4, KV = 2, hd = 8;
  Tensor q = randn_t({B, T, H, hd}, 5301), k = randn_t({B, S, KV, hd}, 5302), v = randn_t({B, S, KV, hd}, 5303);
  // Key splits: [0, 70) + [70, 150) and [0, 70) + [70, 130) + [130, 150).
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 70, 150}, std::vector<int64_t>{0, 70, 130, 150}})
    for (bool causal : {true, false})
      for (bool docs : {false, true})
        for (DType dt : {DType::f64, DType::f32})
          for (bool reversed : {false, true}) {
            CAPTURE(cuts.size() - 1);
            CAPTURE(causal);
            CAPTURE(docs);
            CAPTURE(dtype_name(dt));
            CAPTURE(reversed);
            // With documents: row 0 queries from 140 start their document at 1000, after every key (-inf in
            // every part); row 1 queries from 100 start at 100 (-inf in the parts before it).
            AttentionOptions all{causal, 0, 0, 0, {}};
            if (docs) {
              all.doc_start = doc_start_tensor(T, 0, {{20, 100}, {100}});
              for (int64_t t = 140; t < T; ++t) all.doc_start.at<int64_t>(t) = 1000;
            }
            auto cast = [&](const Tensor& t) { return dt == DType::f64 ? t.clone() : as_f32(t); };
            Tensor qd = cast(q), kd = cast(k), vd = cast(v);
            Tensor want_out = empty(q.shape(), dt), want_lse = empty({B, H, T}, dt);
            attention_forward(want_out, want_lse, qd, kd, vd, all);
            // Each part: its keys, with k_pos0 at the part's start.
            std::vector<std::pair<Tensor, Tensor>> parts;
            for (size_t p = 0; p + 1 < cuts.size(); ++p) {
              const int64_t s0 = cuts[p], n = cuts[p + 1] - s0;
              Tensor kp = empty({B, n, KV, hd}, dt), vp = empty({B, n, KV, hd}, dt);
              copy_slice(kp, 0, kd, s0, n, 1);
              copy_slice(vp, 0, vd, s0, n, 1);
              AttentionOptions o = all;
              o.k_pos0 = s0;
              Tensor po = empty(q.shape(), dt), pl = empty({B, H, T}, dt);
              attention_forward(po, pl, qd, kp, vp, o);
              parts.emplace_back(po, pl);
            }
            if (reversed) std::reverse(parts.begin(), parts.end());
            Tensor out = parts[0].first.clone(), lse = parts[0].second.clone();
            for (size_t p = 1; p < parts.size(); ++p) attention_merge(out, lse, parts[p].first, parts[p].second);
            CHECK(rel_err(out, want_out) < (dt == DType::f64 ? 1e-13 : 1e-6));
            int64_t bad_inf = 0;
            CHECK(lse_err(lse, want_lse, bad_inf) < (dt == DType::f64 ? 1e-13 : 1e-6));
            CHECK(bad_inf == 0);
            // The rows whose document starts after every key stay out 0, lse -inf.
            if (docs) {
              auto ov = to_f64(out), lv = to_f64(lse);
              int64_t nonzero = 0;
              for (int64_t h = 0; h < H; ++h)
                for (int64_t t = 140; t < T; ++t) {
                  nonzero += lv[size_t(h * T + t)] != -INFINITY;
                  for (int64_t e = 0; e < hd; ++e) nonzero += ov[size_t((t * H + h) * hd + e)] != 0.0;
                }
              CHECK(nonzero == 0);
            }
          }
}

TEST_CASE("attention_merge: by hand, -inf on either side and both, bf16 parts") {
  // One row, hd 2. out/lse = (1, 2) at log 1 = 0; part = (3, -2) at log 3: weights 1/4 and 3/4.
  Tensor out = from_values({1, 2}, {1, 1, 1, 2}, DType::f64), lse = from_values({0}, {1, 1, 1}, DType::f64);
  attention_merge(out, lse, from_values({3, -2}, {1, 1, 1, 2}, DType::f64),
                  from_values({std::log(3.0)}, {1, 1, 1}, DType::f64));
  CHECK(out.at<double>(0) == doctest::Approx(0.25 * 1 + 0.75 * 3).epsilon(1e-15));
  CHECK(out.at<double>(1) == doctest::Approx(0.25 * 2 + 0.75 * -2).epsilon(1e-15));
  CHECK(lse.at<double>(0) == doctest::Approx(std::log(4.0)).epsilon(1e-15));
  // Two rows (T = 2): row 0 has -inf in out/lse, row 1 -inf in the part; then both -inf.
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor o = from_values({0, 0, 5, 6}, {1, 2, 1, 2}, dt), l = from_values({-inf, 1.5}, {1, 1, 2}, dt);
    Tensor po = from_values({7, 8, 0, 0}, {1, 2, 1, 2}, dt), pl = from_values({-0.5, -inf}, {1, 1, 2}, dt);
    attention_merge(o, l, po, pl);
    CHECK(to_f64(o) == std::vector<double>{7, 8, 5, 6});
    CHECK(to_f64(l) == std::vector<double>{-0.5, 1.5});
    Tensor o2 = zeros({1, 2, 1, 2}, dt), l2 = from_values({-inf, -inf}, {1, 1, 2}, dt);
    attention_merge(o2, l2, zeros({1, 2, 1, 2}, dt), from_values({-inf, -inf}, {1, 1, 2}, dt));
    CHECK(to_f64(o2) == std::vector<double>{0, 0, 0, 0});
    CHECK(to_f64(l2) == std::vector<double>{-inf, -inf});
  }
  // bf16 part_out with f32 out/lse: the same as merging the part's values widened to f32.
  Tensor q = randn_t({2, 5, 4, 8}, 5401), part = randn_t({2, 5, 4, 8}, 5402);
  Tensor l = randn_t({2, 4, 5}, 5403), pl = randn_t({2, 4, 5}, 5404);
  Tensor part16 = from_values(to_f64(part), part.shape(), DType::bf16);
  Tensor o_a = as_f32(q), l_a = as_f32(l), o_b = as_f32(q), l_b = as_f32(l);
  attention_merge(o_a, l_a, part16, as_f32(pl));
  attention_merge(o_b, l_b, as_f32(part16), as_f32(pl));
  CHECK(rel_err(o_a, o_b) < 1e-7);
  CHECK(rel_err(l_a, l_b) < 1e-7);
}
