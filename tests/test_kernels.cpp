// CPU kernels (runtime/kernels/ops.h) against naive f64 references written
// here: every forward (f64 and f32), every backward against central finite
// differences of its forward in f64 through a random projection loss
// L = sum(out * R); accumulation semantics, aliasing, vocab shards, ignored
// targets, AdamW's formula, error messages, and independence of the thread
// count. Attention is in tests/test_attention.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "check_error.h"
#include "runtime/core/tensor.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

// Uniform values in [lo, hi): random, never all zeros.
Tensor rand_tensor(const Shape& shape, DType dt, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(size_t(shape_numel(shape)));
  for (double& x : v) x = u(gen);
  return from_values(v, shape, dt);
}

Tensor tokens_tensor(const std::vector<int32_t>& toks) {
  std::vector<double> v(toks.begin(), toks.end());
  return from_values(v, {int64_t(toks.size())}, DType::i32);
}

// |got - want| <= rtol * max(1, |want|) element-wise.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double rtol, const char* what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i]));
    if (!(e <= worst)) {  // also catches NaN
      worst = e;
      at = i;
    }
  }
  INFO(what, ": worst relative error ", worst, " at ", at, " (got ", got[at], ", want ", want[at], ")");
  CHECK(worst <= rtol);
}

double dot(const Tensor& a, const Tensor& b) {
  std::vector<double> x = to_f64(a), y = to_f64(b);
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Central differences of loss() with respect to every element of x (f64), compared with the analytic gradient.
void check_gradient(const Tensor& x, const std::vector<double>& analytic, const std::function<double()>& loss,
                    const char* what, double tol = 1e-6) {
  REQUIRE(x.dtype() == DType::f64);
  REQUIRE(int64_t(analytic.size()) == x.numel());
  const double eps = 1e-6;
  std::vector<double> numeric(analytic.size());
  double* p = x.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    double keep = p[i];
    p[i] = keep + eps;
    double lp = loss();
    p[i] = keep - eps;
    double lm = loss();
    p[i] = keep;
    numeric[size_t(i)] = (lp - lm) / (2 * eps);
  }
  check_close(analytic, numeric, tol, what);
}

// Runs f under 1 and then 2 CPU threads (restoring the previous count).
struct ThreadCount {
  int saved = cpu_threads();
  ~ThreadCount() { set_cpu_threads(saved); }
};

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

}  // namespace

// ---------------------------------------------------------------- cross-entropy, vocab shards, embedding, AdamW, RoPE

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
  ThreadCount keep;
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

// ---------------------------------------------------------------- matmul

namespace {
std::vector<double> ref_matmul(const Tensor& inp, const Tensor& w) {
  int64_t N = inp.size(0), C = inp.size(1), OC = w.size(0);
  std::vector<double> x = to_f64(inp), wv = to_f64(w), y(size_t(N * OC), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += x[size_t(n * C + c)] * wv[size_t(o * C + c)];
      y[size_t(n * OC + o)] = s;
    }
  return y;
}
}  // namespace

TEST_CASE("kernels: matmul forward against a naive product, f32 and f64, accumulate") {
  const int64_t N = 7, C = 13, OC = 5;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor x = rand_tensor({N, C}, dt, 1), w = rand_tensor({OC, C}, dt, 2), y = empty({N, OC}, dt);
    matmul_forward(y, x, w);
    std::vector<double> want = ref_matmul(x, w);
    check_close(to_f64(y), want, dt == DType::f64 ? 1e-12 : 1e-5, "matmul");
    matmul_forward(y, x, w, /*accumulate=*/true);
    for (double& v : want) v *= 2;
    check_close(to_f64(y), want, dt == DType::f64 ? 1e-12 : 1e-5, "matmul accumulate");
  }
}

TEST_CASE("kernels: matmul backward against finite differences; dweight accumulates") {
  const int64_t N = 7, C = 13, OC = 5;
  const DType dt = DType::f64;
  Tensor x = rand_tensor({N, C}, dt, 3), w = rand_tensor({OC, C}, dt, 4), R = rand_tensor({N, OC}, dt, 5);
  Tensor y = empty({N, OC}, dt);
  auto loss = [&] {
    matmul_forward(y, x, w);
    return dot(y, R);
  };
  Tensor dx = empty({N, C}, dt), dw = zeros({OC, C}, dt);
  matmul_backward(dx, dw, R, x, w);
  check_gradient(x, to_f64(dx), loss, "dinp");
  check_gradient(w, to_f64(dw), loss, "dweight");
  // A second call adds to dweight and overwrites dinp.
  std::vector<double> dw1 = to_f64(dw), dx1 = to_f64(dx);
  matmul_backward(dx, dw, R, x, w);
  for (double& v : dw1) v *= 2;
  check_close(to_f64(dw), dw1, 1e-12, "dweight twice");
  check_close(to_f64(dx), dx1, 1e-12, "dinp overwritten");
  // Either gradient may be skipped.
  Tensor dw2 = zeros({OC, C}, dt);
  matmul_backward(Tensor(), dw2, R, x, w);
  std::vector<double> half = to_f64(dw);
  for (double& v : half) v /= 2;
  check_close(to_f64(dw2), half, 1e-12, "only dweight");
  Tensor dx2 = empty({N, C}, dt);
  matmul_backward(dx2, Tensor(), R, Tensor(), w);
  check_close(to_f64(dx2), dx1, 1e-12, "only dinp");
  // accumulate_dinp: the GEMM adds to dinp (linears sharing an input).
  Tensor acc = rand_tensor({N, C}, dt, 77);
  std::vector<double> want = to_f64(acc);
  for (size_t i = 0; i < want.size(); ++i) want[i] += dx1[i];
  matmul_backward(acc, Tensor(), R, Tensor(), w, /*accumulate_dinp=*/true);
  check_close(to_f64(acc), want, 1e-12, "dinp accumulated");
}

TEST_CASE("kernels: matmul checks shapes and dtypes") {
  Tensor x = rand_tensor({7, 13}, DType::f32, 1), w = rand_tensor({5, 12}, DType::f32, 2);
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, DType::f32), x, w), "[kernels] matmul_forward: inp (7, 13)");
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, DType::f32), x, w), "(5, 12)");
  Tensor w2 = rand_tensor({5, 13}, DType::f32, 2);
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 6}, DType::f32), x, w2),
                       "[kernels] matmul_forward: out has shape (7, 6), expected (7, 5)");
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, DType::f64), x, w2), "[kernels] matmul_forward: out is f64");
  Tensor xi = empty({7, 13}, DType::i32), wi = empty({5, 13}, DType::i32);
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, DType::i32), xi, wi), "inp is i32; the CPU backend takes f32, bf16 or f64");
  CHECK_ERROR_CONTAINS(matmul_backward(empty({7, 13}, DType::f64), Tensor(), empty({7, 5}, DType::f32), x, w2),
                       "[kernels] matmul_backward: dinp is f64");
}

// ---------------------------------------------------------------- rmsnorm

TEST_CASE("kernels: rmsnorm forward against a naive reference") {
  const int64_t N = 7, C = 13;
  const double eps = 1e-5;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor x = rand_tensor({N, C}, dt, 6), w = rand_tensor({C}, dt, 7, 0.5, 1.5);
    Tensor y = empty({N, C}, dt), rstd = empty({N}, dt);
    rmsnorm_forward(y, rstd, x, w, eps);
    std::vector<double> xv = to_f64(x), wv = to_f64(w);
    std::vector<double> want(static_cast<size_t>(N * C)), want_r(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      double ss = 0;
      for (int64_t c = 0; c < C; ++c) ss += xv[size_t(n * C + c)] * xv[size_t(n * C + c)];
      double r = 1 / std::sqrt(ss / double(C) + eps);
      want_r[size_t(n)] = r;
      for (int64_t c = 0; c < C; ++c) want[size_t(n * C + c)] = xv[size_t(n * C + c)] * r * wv[size_t(c)];
    }
    double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    check_close(to_f64(y), want, tol, "rmsnorm out");
    check_close(to_f64(rstd), want_r, tol, "rmsnorm rstd");
  }
}

TEST_CASE("kernels: rmsnorm backward against finite differences; dweight accumulates") {
  const int64_t N = 7, C = 13;
  const DType dt = DType::f64;
  const double eps = 1e-5;
  Tensor x = rand_tensor({N, C}, dt, 8), w = rand_tensor({C}, dt, 9, 0.5, 1.5), R = rand_tensor({N, C}, dt, 10);
  Tensor y = empty({N, C}, dt), rstd = empty({N}, dt);
  auto loss = [&] {
    rmsnorm_forward(y, rstd, x, w, eps);
    return dot(y, R);
  };
  loss();
  Tensor dx = empty({N, C}, dt), dw = zeros({C}, dt);
  rmsnorm_backward(dx, dw, R, x, w, rstd);
  check_gradient(x, to_f64(dx), loss, "rmsnorm dinp");
  check_gradient(w, to_f64(dw), loss, "rmsnorm dweight");
  std::vector<double> twice = to_f64(dw);
  for (double& v : twice) v *= 2;
  loss();
  rmsnorm_backward(dx, dw, R, x, w, rstd);
  check_close(to_f64(dw), twice, 1e-12, "rmsnorm dweight twice");
  CHECK_ERROR_CONTAINS(rmsnorm_forward(y, empty({N + 1}, dt), x, w, eps),
                       "[kernels] rmsnorm_forward: rstd has shape (8,), expected (7,)");
}

TEST_CASE("kernels: the residual add fused into rmsnorm equals add then rmsnorm") {
  const int64_t N = 9, C = 37;
  auto full = [](const Shape& sh, double v, DType d) {
    return from_values(std::vector<double>(size_t(shape_numel(sh)), v), sh, d);
  };
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor a = rand_tensor({N, C}, dt, 11), b = rand_tensor({N, C}, dt, 12), w = rand_tensor({C}, dt, 13, 0.5, 1.5);
    // Unfused: sum = a + b, then the norm.
    Tensor sum = empty({N, C}, dt), y = empty({N, C}, dt), rstd = empty({N}, dt);
    add(sum, a, b);
    rmsnorm_forward(y, rstd, sum, w, 1e-5);
    // Fused, the sum written over a (as the decoder layer does): the same bits.
    Tensor a2 = a.clone(), y2 = full({N, C}, std::nan(""), dt), rstd2 = full({N}, std::nan(""), dt);
    add_rmsnorm_forward(a2, y2, rstd2, a2, b, w, 1e-5);
    CHECK(to_f64(a2) == to_f64(sum));
    CHECK(to_f64(y2) == to_f64(y));
    CHECK(to_f64(rstd2) == to_f64(rstd));
    // Backward with the residual gradient added: equals backward then add (one rounding instead of two).
    Tensor dy = rand_tensor({N, C}, dt, 14), dres = rand_tensor({N, C}, dt, 15);
    Tensor dx = empty({N, C}, dt), dw = zeros({C}, dt), dx2 = full({N, C}, std::nan(""), dt), dw2 = zeros({C}, dt);
    rmsnorm_backward(dx, dw, dy, sum, w, rstd);
    add_(dx, dres);
    rmsnorm_backward(dx2, dw2, dy, sum, w, rstd, dres);
    check_close(to_f64(dx2), to_f64(dx), dt == DType::f64 ? 1e-14 : 1e-6, "dinp + dresidual");
    CHECK(to_f64(dw2) == to_f64(dw));
    // dresidual may alias dinp.
    Tensor dx3 = dres.clone(), dw3 = zeros({C}, dt);
    rmsnorm_backward(dx3, dw3, dy, sum, w, rstd, dx3);
    CHECK(to_f64(dx3) == to_f64(dx2));
  }
  Tensor a = rand_tensor({N, C}, DType::f32, 1);
  CHECK_ERROR_CONTAINS(add_rmsnorm_forward(a, empty({N, C}, DType::f32), empty({N}, DType::f32), a,
                                           empty({N, C + 1}, DType::f32), empty({C}, DType::f32), 1e-5),
                       "[kernels] add_rmsnorm_forward: b has shape (9, 38), expected (9, 37)");
  CHECK_ERROR_CONTAINS(rmsnorm_backward(empty({N, C}, DType::f32), zeros({C}, DType::f32), a, a, zeros({C}, DType::f32),
                                        zeros({N}, DType::f32), empty({N, C}, DType::f64)),
                       "[kernels] rmsnorm_backward: dresidual is f64");
}

// ---------------------------------------------------------------- rope

namespace {
// Hugging Face's tables in precision T (inv_freq and angle in T, as the reference script does).
template <typename T> std::vector<double> ref_rope_table(const std::vector<int64_t>& pos, int64_t hd, double theta,
                                                         bool want_sin) {
  std::vector<double> out(pos.size() * size_t(hd));
  for (size_t p = 0; p < pos.size(); ++p)
    for (int64_t i = 0; i < hd / 2; ++i) {
      T inv = T(1) / T(std::pow(T(theta), T(2 * i) / T(hd)));
      T ang = T(pos[p]) * inv;
      double v = want_sin ? std::sin(double(ang)) : std::cos(double(ang));
      out[p * size_t(hd) + size_t(i)] = out[p * size_t(hd) + size_t(i + hd / 2)] = double(T(v));
    }
  return out;
}

std::vector<double> ref_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = x.size(3), half = hd / 2;
  std::vector<double> xv = to_f64(x), c = to_f64(cos), s = to_f64(sin), y(xv.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        size_t o = size_t(((b * T + t) * H + h) * hd);
        for (int64_t i = 0; i < hd; ++i) {
          double rot = i < half ? -xv[o + size_t(i + half)] : xv[o + size_t(i - half)];
          y[o + size_t(i)] = xv[o + size_t(i)] * c[size_t(t * hd + i)] + rot * s[size_t(t * hd + i)];
        }
      }
  return y;
}

Tensor positions_tensor(const std::vector<int64_t>& pos) {
  std::vector<double> v(pos.begin(), pos.end());
  return from_values(v, {int64_t(pos.size())}, DType::i64);
}
}  // namespace

TEST_CASE("kernels: rope tables and forward against a naive reference; in place") {
  const int64_t B = 2, T = 5, H = 3, hd = 6;
  const std::vector<int64_t> pos = {0, 1, 2, 7, 300};
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor cos = empty({T, hd}, dt), sin = empty({T, hd}, dt);
    rope_tables(cos, sin, positions_tensor(pos), 10000.0);
    double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    if (dt == DType::f64) {
      check_close(to_f64(cos), ref_rope_table<double>(pos, hd, 10000.0, false), tol, "cos");
      check_close(to_f64(sin), ref_rope_table<double>(pos, hd, 10000.0, true), tol, "sin");
    } else {
      check_close(to_f64(cos), ref_rope_table<float>(pos, hd, 10000.0, false), tol, "cos");
      check_close(to_f64(sin), ref_rope_table<float>(pos, hd, 10000.0, true), tol, "sin");
    }
    // Position 0 is angle 0; position 1 at frequency 0 is angle 1: values checked by hand.
    CHECK(to_f64(cos)[0] == 1.0);
    CHECK(to_f64(sin)[size_t(hd)] == doctest::Approx(std::sin(1.0)).epsilon(1e-7));
    Tensor x = rand_tensor({B, T, H, hd}, dt, 11), y = empty({B, T, H, hd}, dt);
    rope_forward(y, x, cos, sin);
    std::vector<double> want = ref_rope(x, cos, sin);
    check_close(to_f64(y), want, dt == DType::f64 ? 1e-12 : 1e-5, "rope out");
    Tensor xi = x.clone();
    rope_forward(xi, xi, cos, sin);  // aliasing
    check_close(to_f64(xi), to_f64(y), 0, "rope in place");
  }
}

TEST_CASE("kernels: rope backward against finite differences; in place") {
  const int64_t B = 2, T = 5, H = 3, hd = 6;
  const DType dt = DType::f64;
  Tensor cos = empty({T, hd}, dt), sin = empty({T, hd}, dt);
  rope_tables(cos, sin, positions_tensor({3, 4, 5, 6, 7}), 500.0);
  Tensor x = rand_tensor({B, T, H, hd}, dt, 12), R = rand_tensor({B, T, H, hd}, dt, 13), y = empty(x.shape(), dt);
  auto loss = [&] {
    rope_forward(y, x, cos, sin);
    return dot(y, R);
  };
  Tensor dx = empty(x.shape(), dt);
  rope_backward(dx, R, cos, sin);
  check_gradient(x, to_f64(dx), loss, "rope dinp");
  Tensor di = R.clone();
  rope_backward(di, di, cos, sin);
  check_close(to_f64(di), to_f64(dx), 0, "rope backward in place");
  CHECK_ERROR_CONTAINS(rope_forward(y, x, empty({T + 1, hd}, dt), sin),
                       "[kernels] rope_forward: cos has shape (6, 6), expected (5, 6)");
  CHECK_ERROR_CONTAINS(rope_tables(empty({2, 5}, dt), empty({2, 5}, dt), positions_tensor({0, 1}), 1e4),
                       "[kernels] rope_tables: cos must be (P, hd) with an even hd, got (2, 5)");
}

// ---------------------------------------------------------------- swiglu

TEST_CASE("kernels: swiglu forward against a naive reference and backward against finite differences") {
  const int64_t N = 7, F = 13;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor g = rand_tensor({N, F}, dt, 14, -4, 4), u = rand_tensor({N, F}, dt, 15), y = empty({N, F}, dt);
    swiglu_forward(y, g, u);
    std::vector<double> gv = to_f64(g), uv = to_f64(u), want(gv.size());
    for (size_t i = 0; i < gv.size(); ++i) want[i] = gv[i] / (1 + std::exp(-gv[i])) * uv[i];
    check_close(to_f64(y), want, dt == DType::f64 ? 1e-12 : 1e-5, "swiglu");
  }
  const DType dt = DType::f64;
  Tensor g = rand_tensor({N, F}, dt, 16, -4, 4), u = rand_tensor({N, F}, dt, 17), R = rand_tensor({N, F}, dt, 18);
  Tensor y = empty({N, F}, dt), dg = empty({N, F}, dt), du = empty({N, F}, dt);
  auto loss = [&] {
    swiglu_forward(y, g, u);
    return dot(y, R);
  };
  swiglu_backward(dg, du, R, g, u);
  check_gradient(g, to_f64(dg), loss, "swiglu dgate");
  check_gradient(u, to_f64(du), loss, "swiglu dup");
  CHECK_ERROR_CONTAINS(swiglu_forward(y, g, empty({N, F + 1}, dt)),
                       "[kernels] swiglu_forward: up has shape (7, 14), expected (7, 13)");
}

// ---------------------------------------------------------------- embedding

TEST_CASE("kernels: embedding forward with a vocab shard; out-of-shard tokens give zeros; bad tokens") {
  const int64_t V = 11, C = 13, row_begin = 4, V_local = 5;  // this shard holds rows [4, 9)
  const std::vector<int32_t> toks = {0, 4, 8, 9, 5, 10, 4};
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor table = rand_tensor({V_local, C}, dt, 19), out = rand_tensor({7, C}, dt, 20);
    embedding_forward(out, tokens_tensor(toks), table, row_begin, V);
    std::vector<double> tv = to_f64(table), want(size_t(7 * C), 0.0);
    for (size_t n = 0; n < toks.size(); ++n) {
      int64_t r = toks[n] - row_begin;
      if (r >= 0 && r < V_local)
        for (int64_t c = 0; c < C; ++c) want[n * size_t(C) + size_t(c)] = tv[size_t(r * C + c)];
    }
    check_close(to_f64(out), want, 0, "embedding");
    // Summing the shards' outputs gives the full lookup: the other rows come from other shards.
    CHECK(to_f64(out)[0] == 0);
  }
  Tensor table = rand_tensor({V_local, C}, DType::f32, 21), out = empty({7, C}, DType::f32);
  CHECK_ERROR_CONTAINS(embedding_forward(out, tokens_tensor({0, 1, 2, 11, 0, 0, 0}), table, row_begin, V),
                       "[kernels] embedding_forward: token 11 at position 3 is outside the vocabulary [0, 11)");
  CHECK_ERROR_CONTAINS(embedding_forward(out, tokens_tensor({0, 1, 2, 3, -1, 0, 0}), table, row_begin, V),
                       "token -1 at position 4");
  CHECK_ERROR_CONTAINS(embedding_forward(out, tokens_tensor({0, 1}), table, row_begin, V),
                       "[kernels] embedding_forward: out has shape (7, 13), expected (2, 13)");
}

TEST_CASE("kernels: embedding backward scatters in order, accumulates, matches finite differences") {
  const int64_t C = 13, row_begin = 2, V_local = 6;
  const std::vector<int32_t> toks = {2, 3, 2, 9, 7, 0, 2};  // repeats; 9 and 0 are outside the shard
  const DType dt = DType::f64;
  Tensor table = rand_tensor({V_local, C}, dt, 22), R = rand_tensor({7, C}, dt, 23), out = empty({7, C}, dt);
  Tensor tk = tokens_tensor(toks);
  auto loss = [&] {
    embedding_forward(out, tk, table, row_begin, 10);
    return dot(out, R);
  };
  Tensor dtab = zeros({V_local, C}, dt);
  embedding_backward(dtab, R, tk, row_begin);
  check_gradient(table, to_f64(dtab), loss, "embedding dtable");
  std::vector<double> twice = to_f64(dtab);
  for (double& v : twice) v *= 2;
  embedding_backward(dtab, R, tk, row_begin);
  check_close(to_f64(dtab), twice, 1e-15, "embedding dtable twice");
  // f32: same result for any thread count (fixed order per row).
  ThreadCount keep;
  Tensor big_tok = empty({1000}, DType::i32);
  for (int64_t i = 0; i < 1000; ++i) big_tok.at<int32_t>(i) = int32_t((i * 7) % 37);
  Tensor dy = rand_tensor({1000, 70}, DType::f32, 24);
  Tensor a = zeros({37, 70}, DType::f32), b = zeros({37, 70}, DType::f32);
  set_cpu_threads(1);
  embedding_backward(a, dy, big_tok);
  set_cpu_threads(2);
  embedding_backward(b, dy, big_tok);
  CHECK(equal(a, b));
}

// ---------------------------------------------------------------- cross-entropy

namespace {
// Losses and d(sum losses * grad_scale)/dlogits of a naive softmax in f64.
void ref_cross_entropy(const Tensor& logits, const std::vector<int32_t>& tg, double grad_scale, std::vector<double>& loss,
                       std::vector<double>& grad) {
  int64_t N = logits.size(0), V = logits.size(1);
  std::vector<double> x = to_f64(logits);
  loss.assign(size_t(N), 0.0);
  grad.assign(size_t(N * V), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (tg[size_t(n)] < 0) continue;
    double mx = -INFINITY, se = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, x[size_t(n * V + v)]);
    for (int64_t v = 0; v < V; ++v) se += std::exp(x[size_t(n * V + v)] - mx);
    double lse = mx + std::log(se);
    loss[size_t(n)] = lse - x[size_t(n * V + tg[size_t(n)])];
    for (int64_t v = 0; v < V; ++v)
      grad[size_t(n * V + v)] = (std::exp(x[size_t(n * V + v)] - lse) - (v == tg[size_t(n)] ? 1 : 0)) * grad_scale;
  }
}
}  // namespace

TEST_CASE("kernels: cross-entropy losses and gradient; ignored targets; dlogits aliasing logits") {
  const int64_t N = 7, V = 13;
  const std::vector<int32_t> tg = {3, -1, 0, 12, 5, -100, 7};
  const double gs = 1.0 / 5;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor logits = rand_tensor({N, V}, dt, 25, -5, 5), losses = empty({N}, dt), dl = empty({N, V}, dt);
    std::vector<double> want_l, want_g;
    ref_cross_entropy(logits, tg, gs, want_l, want_g);
    cross_entropy_forward_backward(losses, dl, logits, tokens_tensor(tg), gs);
    double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    check_close(to_f64(losses), want_l, tol, "ce losses");
    check_close(to_f64(dl), want_g, tol, "ce dlogits");
    CHECK(to_f64(losses)[1] == 0);
    // Loss only.
    Tensor l2 = empty({N}, dt);
    cross_entropy_forward_backward(l2, Tensor(), logits, tokens_tensor(tg), gs);
    check_close(to_f64(l2), to_f64(losses), 0, "ce loss only");
    // In place: the logits become their gradient.
    Tensor alias = logits.clone();
    cross_entropy_forward_backward(l2, alias, alias, tokens_tensor(tg), gs);
    check_close(to_f64(alias), to_f64(dl), 0, "ce in place");
    check_close(to_f64(l2), to_f64(losses), 0, "ce in place losses");
  }
  // Finite differences of sum(losses) * grad_scale.
  const DType dt = DType::f64;
  Tensor logits = rand_tensor({N, V}, dt, 26, -3, 3), losses = empty({N}, dt), dl = empty({N, V}, dt);
  Tensor tt = tokens_tensor(tg);
  cross_entropy_forward_backward(losses, dl, logits, tt, gs);
  auto loss = [&] {
    Tensor l = empty({N}, dt);
    cross_entropy_forward_backward(l, Tensor(), logits, tt, gs);
    return sum(l) * gs;
  };
  check_gradient(logits, to_f64(dl), loss, "ce dlogits");
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(losses, dl, logits, tokens_tensor({0, 1, 13, 0, 0, 0, 0}), gs),
                       "[kernels] cross_entropy: target 13 at position 2 is >= the vocabulary size 13");
}

TEST_CASE("kernels: vocab-parallel cross-entropy pieces add up to the full loss") {
  const int64_t N = 7, V = 13;
  const std::vector<int32_t> tg = {3, -1, 0, 12, 5, 6, 7};
  const double gs = 0.5;
  const DType dt = DType::f64;
  Tensor logits = rand_tensor({N, V}, dt, 27, -5, 5), tt = tokens_tensor(tg);
  std::vector<double> want_l, want_g;
  ref_cross_entropy(logits, tg, gs, want_l, want_g);
  const std::vector<int64_t> cuts = {0, 5, 6, 13};  // three shards, one of a single column
  std::vector<Tensor> shards;
  for (size_t s = 0; s + 1 < cuts.size(); ++s) {
    Tensor sh = empty({N, cuts[s + 1] - cuts[s]}, dt);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = cuts[s]; v < cuts[s + 1]; ++v)
        sh.at<double>(n * sh.size(1) + v - cuts[s]) = logits.at<double>(n * V + v);
    shards.push_back(sh);
  }
  // The all-reduces (max, then sums), done by hand.
  std::vector<double> gmax(size_t(N), -INFINITY), gse(size_t(N), 0), gtl(size_t(N), 0);
  for (auto& sh : shards) {
    Tensor m = empty({N}, DType::f64);
    vocab_shard_max(m, sh);
    for (int64_t n = 0; n < N; ++n) gmax[size_t(n)] = std::max(gmax[size_t(n)], m.at<double>(n));
  }
  Tensor row_max = from_values(gmax, {N}, DType::f64);
  for (size_t s = 0; s < shards.size(); ++s) {
    Tensor se = empty({N}, DType::f64), tl = empty({N}, DType::f64);
    vocab_shard_sumexp(se, tl, shards[s], tt, row_max, cuts[s]);
    for (int64_t n = 0; n < N; ++n) {
      gse[size_t(n)] += se.at<double>(n);
      gtl[size_t(n)] += tl.at<double>(n);
    }
  }
  Tensor sumexp = from_values(gse, {N}, DType::f64), target_logit = from_values(gtl, {N}, DType::f64);
  for (size_t s = 0; s < shards.size(); ++s) {
    Tensor losses = empty({N}, dt);
    Tensor sh = shards[s].clone();
    vocab_shard_loss(losses, sh, sh, tt, row_max, sumexp, target_logit, cuts[s], gs);  // dlogits aliasing logits
    check_close(to_f64(losses), want_l, 1e-12, "shard losses");
    int64_t w = cuts[s + 1] - cuts[s];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < w; ++v)
        CHECK(sh.at<double>(n * w + v) == doctest::Approx(want_g[size_t(n * V + cuts[s] + v)]).epsilon(1e-12));
  }
  CHECK_ERROR_CONTAINS(vocab_shard_max(empty({N}, DType::f32), logits), "[kernels] vocab_shard_max: row_max must be (7) f64");
}

// ---------------------------------------------------------------- element-wise and reductions

TEST_CASE("kernels: add, add_, scale_, sum_squares, sum against naive loops") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 3 * 4096 + 77;  // several reduction chunks and a ragged tail
    Tensor a = rand_tensor({n}, dt, 28), b = rand_tensor({n}, dt, 29), out = empty({n}, dt);
    std::vector<double> av = to_f64(a), bv = to_f64(b);
    std::vector<double> want(av.size());
    add(out, a, b);
    for (size_t i = 0; i < want.size(); ++i) want[i] = av[i] + bv[i];
    double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    check_close(to_f64(out), want, tol, "add");
    Tensor c = a.clone();
    add(c, c, b);  // out aliasing a
    check_close(to_f64(c), want, tol, "add aliased");
    Tensor d = a.clone();
    add_(d, b);
    check_close(to_f64(d), want, tol, "add_");
    scale_(d, -0.25);
    for (double& v : want) v *= -0.25;
    check_close(to_f64(d), want, tol, "scale_");
    double ss = 0, s = 0;
    for (double v : av) {
      ss += v * v;
      s += v;
    }
    CHECK(sum_squares(a) == doctest::Approx(ss).epsilon(1e-12));
    CHECK(sum(a) == doctest::Approx(s).epsilon(1e-10));
    CHECK(sum(a.view(0, {7, 13})) == doctest::Approx(std::accumulate(av.begin(), av.begin() + 91, 0.0)).epsilon(1e-12));
    CHECK(sum_squares(empty({0}, dt)) == 0);
    CHECK_ERROR_CONTAINS(add(out, a, empty({n - 1}, dt)), "[kernels] add: b has shape");
  }
}

TEST_CASE("kernels: sums give the same bits for any thread count") {
  ThreadCount keep;
  Tensor a = rand_tensor({100003}, DType::f32, 30);
  set_cpu_threads(1);
  double s1 = sum(a), q1 = sum_squares(a);
  set_cpu_threads(2);
  CHECK(cpu_threads() == 2);
  double s2 = sum(a), q2 = sum_squares(a);
  CHECK(s1 == s2);
  CHECK(q1 == q2);
}

// ---------------------------------------------------------------- AdamW

TEST_CASE("kernels: adamw follows torch.optim.AdamW for two steps") {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 13;
    Tensor p = rand_tensor({n}, dt, 31), m = zeros({n}, dt), v = zeros({n}, dt);
    Tensor g1 = rand_tensor({n}, dt, 32), g2 = rand_tensor({n}, dt, 33);
    std::vector<double> P = to_f64(p), M(size_t(n), 0.0), Vv(size_t(n), 0.0);
    for (int step = 1; step <= 2; ++step) {
      std::vector<double> G = to_f64(step == 1 ? g1 : g2);
      for (int64_t i = 0; i < n; ++i) {
        size_t k = size_t(i);
        P[k] -= lr * wd * P[k];  // decoupled weight decay first
        M[k] = b1 * M[k] + (1 - b1) * G[k];
        Vv[k] = b2 * Vv[k] + (1 - b2) * G[k] * G[k];
        double mhat = M[k] / (1 - std::pow(b1, step)), vhat = Vv[k] / (1 - std::pow(b2, step));
        P[k] -= lr * mhat / (std::sqrt(vhat) + eps);
      }
      adamw_step(p, step == 1 ? g1 : g2, m, v, lr, b1, b2, eps, wd, step);
    }
    double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    check_close(to_f64(p), P, tol, "adamw param");
    check_close(to_f64(m), M, tol, "adamw m");
    check_close(to_f64(v), Vv, tol, "adamw v");
  }
  Tensor p = rand_tensor({5}, DType::f32, 34);
  CHECK_ERROR_CONTAINS(adamw_step(p, p, zeros({5}, DType::f32), zeros({5}, DType::f32), 1e-3, 0.9, 0.95, 1e-8, 0, 0),
                       "[kernels] adamw_step: step is 1-based, got 0");
  CHECK_ERROR_CONTAINS(adamw_step(p, p, zeros({5}, DType::f64), zeros({5}, DType::f64), 1e-3, 0.9, 0.95, 1e-8, 0, 1),
                       "[kernels] adamw_step: optimizer state is f64 but the parameter is f32");
}

// ---------------------------------------------------------------- threads

TEST_CASE("kernels: f32 results do not depend on the thread count") {
  ThreadCount keep;
  const int64_t N = 257, C = 96, OC = 130;
  Tensor x = rand_tensor({N, C}, DType::f32, 35), w = rand_tensor({OC, C}, DType::f32, 36);
  Tensor nw = rand_tensor({C}, DType::f32, 37), dy = rand_tensor({N, OC}, DType::f32, 38);
  Tensor dyn = rand_tensor({N, C}, DType::f32, 39);
  auto run = [&](int threads) {
    set_cpu_threads(threads);
    std::vector<std::vector<double>> r;
    Tensor y = empty({N, OC}, DType::f32), dx = empty({N, C}, DType::f32), dw = zeros({OC, C}, DType::f32);
    matmul_forward(y, x, w);
    matmul_backward(dx, dw, dy, x, w);
    Tensor o = empty({N, C}, DType::f32), rs = empty({N}, DType::f32), dxn = empty({N, C}, DType::f32);
    Tensor dwn = zeros({C}, DType::f32);
    rmsnorm_forward(o, rs, x, nw, 1e-5);
    rmsnorm_backward(dxn, dwn, dyn, x, nw, rs);
    Tensor losses = empty({N}, DType::f32), dl = empty({N, OC}, DType::f32);
    Tensor tg = empty({N}, DType::i32);
    for (int64_t i = 0; i < N; ++i) tg.at<int32_t>(i) = int32_t((i * 13) % OC);
    cross_entropy_forward_backward(losses, dl, y, tg, 0.01);
    for (const Tensor& t : {y, dx, dw, o, rs, dxn, dwn, losses, dl}) r.push_back(to_f64(t));
    return r;
  };
  auto one = run(1), two = run(2);
  for (size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    check_close(two[i], one[i], 1e-6, "1 vs 2 threads");
  }
  // rmsnorm's dweight is deterministic whatever the thread count.
  CHECK(one[6] == two[6]);
}

TEST_CASE("kernels: CPU kernels reject other dtypes") {
  Tensor a = empty({4}, DType::i32);
  CHECK_ERROR_CONTAINS(sum(a), "[kernels] sum: t is i32; the CPU backend takes f32, bf16 or f64");
  CHECK_ERROR_CONTAINS(scale_(empty({3}, DType::u16), 2.0), "[kernels] scale_: t is u16");
}

// ---------------------------------------------------------------- normal inputs, whole-output errors, f32 backward

namespace {
// ||got - want|| / ||want|| over the whole output (NaN counts as infinite error).
double whole_rel(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Normal values in dtype dt (the references read them back with to_f64, so rounding to f32 is not an error).
Tensor normal_t(const Shape& s, DType dt, uint64_t seed) { return randn_t(s, seed, dt); }

// A kernel error message must start with "[kernels]".
#define CHECK_KERNELS_ERROR(expr)                                        \
  do {                                                                   \
    std::string mt_kmsg_;                                                \
    try {                                                                \
      (void)(expr);                                                      \
    } catch (const mt::Error& e) {                                       \
      mt_kmsg_ = e.what();                                               \
    }                                                                    \
    INFO("expression: " #expr "; message: ", mt_kmsg_);                  \
    CHECK(mt_kmsg_.rfind("[kernels]", 0) == 0);                          \
  } while (0)
}  // namespace

TEST_CASE("kernels: every forward on normal inputs against f64 references, whole-output relative error") {
  const int64_t N = 7, C = 13, OC = 5, V = 11, F = 13, B = 2, T = 5, H = 3, hd = 8;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    // matmul
    Tensor x = normal_t({N, C}, dt, 101), w = normal_t({OC, C}, dt, 102), y = empty({N, OC}, dt);
    matmul_forward(y, x, w);
    CHECK(whole_rel(to_f64(y), ref_matmul(x, w)) < tol);
    // rmsnorm
    Tensor nw = normal_t({C}, dt, 103), ny = empty({N, C}, dt), rs = empty({N}, dt);
    rmsnorm_forward(ny, rs, x, nw, 1e-6);
    {
      std::vector<double> xv = to_f64(x), wv = to_f64(nw), want(static_cast<size_t>(N * C)), want_r(static_cast<size_t>(N));
      for (int64_t n = 0; n < N; ++n) {
        double ss = 0;
        for (int64_t c = 0; c < C; ++c) ss += xv[size_t(n * C + c)] * xv[size_t(n * C + c)];
        want_r[size_t(n)] = 1 / std::sqrt(ss / double(C) + 1e-6);
        for (int64_t c = 0; c < C; ++c) want[size_t(n * C + c)] = xv[size_t(n * C + c)] * want_r[size_t(n)] * wv[size_t(c)];
      }
      CHECK(whole_rel(to_f64(ny), want) < tol);
      CHECK(whole_rel(to_f64(rs), want_r) < tol);
    }
    // rope tables: cos/sin of pos * theta^(-2i/hd), repeated twice along hd (computed in f64 here)
    const std::vector<int64_t> pos = {0, 1, 5, 64, 1000};
    Tensor cs = empty({T, hd}, dt), sn = empty({T, hd}, dt);
    rope_tables(cs, sn, positions_tensor(pos), 10000.0);
    {
      std::vector<double> wc(size_t(T * hd)), ws(size_t(T * hd));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < hd; ++i) {
          double a = double(pos[size_t(t)]) * std::pow(10000.0, -2.0 * double(i % (hd / 2)) / double(hd));
          wc[size_t(t * hd + i)] = std::cos(a);
          ws[size_t(t * hd + i)] = std::sin(a);
        }
      CHECK(whole_rel(to_f64(cs), wc) < tol);
      CHECK(whole_rel(to_f64(sn), ws) < tol);
      for (int64_t t = 0; t < T; ++t)  // the two halves are identical
        for (int64_t i = 0; i < hd / 2; ++i) {
          CHECK(cs.dtype() == dt);
          CHECK(to_f64(cs)[size_t(t * hd + i)] == to_f64(cs)[size_t(t * hd + i + hd / 2)]);
          CHECK(to_f64(sn)[size_t(t * hd + i)] == to_f64(sn)[size_t(t * hd + i + hd / 2)]);
        }
    }
    Tensor rx = normal_t({B, T, H, hd}, dt, 104), ry = empty(rx.shape(), dt);
    rope_forward(ry, rx, cs, sn);
    CHECK(whole_rel(to_f64(ry), ref_rope(rx, cs, sn)) < tol);
    // swiglu
    Tensor g = normal_t({N, F}, dt, 105), u = normal_t({N, F}, dt, 106), sy = empty({N, F}, dt);
    swiglu_forward(sy, g, u);
    {
      std::vector<double> gv = to_f64(g), uv = to_f64(u), want(gv.size());
      for (size_t i = 0; i < gv.size(); ++i) want[i] = gv[i] / (1 + std::exp(-gv[i])) * uv[i];
      CHECK(whole_rel(to_f64(sy), want) < tol);
    }
    // embedding (exact copies)
    Tensor table = normal_t({V, C}, dt, 107), ey = empty({N, C}, dt);
    std::vector<int32_t> toks = {10, 0, 3, 3, 7, 1, 10};
    embedding_forward(ey, tokens_tensor(toks), table, 0, V);
    {
      std::vector<double> tv = to_f64(table), want(size_t(N * C));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) want[size_t(n * C + c)] = tv[size_t(toks[size_t(n)] * C + c)];
      CHECK(to_f64(ey) == want);
    }
    // cross-entropy
    Tensor logits = normal_t({N, V}, dt, 108), losses = empty({N}, dt), dl = empty({N, V}, dt);
    std::vector<int32_t> tg = {0, 10, 5, -1, 3, 3, 9};
    cross_entropy_forward_backward(losses, dl, logits, tokens_tensor(tg), 0.125);
    {
      std::vector<double> wl, wg;
      ref_cross_entropy(logits, tg, 0.125, wl, wg);
      CHECK(whole_rel(to_f64(losses), wl) < tol);
      CHECK(whole_rel(to_f64(dl), wg) < tol);
    }
    // add, scale_, sum, sum_squares
    Tensor a = normal_t({N, C}, dt, 109), b = normal_t({N, C}, dt, 110), ab = empty({N, C}, dt);
    add(ab, a, b);
    std::vector<double> av = to_f64(a), bv = to_f64(b), want(av.size());
    for (size_t i = 0; i < av.size(); ++i) want[i] = (av[i] + bv[i]) * 1.5;
    scale_(ab, 1.5);
    CHECK(whole_rel(to_f64(ab), want) < tol);
    double s = 0, ss = 0;
    for (double v : av) s += v, ss += v * v;
    CHECK(std::abs(sum(a) - s) <= 1e-12 * std::sqrt(ss));
    CHECK(std::abs(sum_squares(a) - ss) <= 1e-12 * ss);
  }
}

TEST_CASE("kernels: f32 backward agrees with the f64 backward (whole-output relative error < 1e-5)") {
  const int64_t N = 7, C = 13, OC = 5, F = 13, B = 2, T = 5, H = 3, hd = 8, V = 11;
  auto both = [](const Shape& s, uint64_t seed) { return std::pair{normal_t(s, DType::f64, seed), normal_t(s, DType::f32, seed)}; };
  // matmul
  {
    auto [x, x32] = both({N, C}, 201);
    auto [w, w32] = both({OC, C}, 202);
    auto [dy, dy32] = both({N, OC}, 203);
    Tensor dx = empty({N, C}, DType::f64), dw = zeros({OC, C}, DType::f64);
    Tensor dx32 = empty({N, C}, DType::f32), dw32 = zeros({OC, C}, DType::f32);
    matmul_backward(dx, dw, dy, x, w);
    matmul_backward(dx32, dw32, dy32, x32, w32);
    CHECK(whole_rel(to_f64(dx32), to_f64(dx)) < 1e-5);
    CHECK(whole_rel(to_f64(dw32), to_f64(dw)) < 1e-5);
    // f32: dweight accumulates, dinp is overwritten.
    std::vector<double> dw1 = to_f64(dw32), dx1 = to_f64(dx32);
    matmul_backward(dx32, dw32, dy32, x32, w32);
    for (double& v : dw1) v *= 2;
    CHECK(whole_rel(to_f64(dw32), dw1) < 1e-6);
    CHECK(to_f64(dx32) == dx1);
  }
  // rmsnorm
  {
    auto [x, x32] = both({N, C}, 204);
    auto [w, w32] = both({C}, 205);
    auto [dy, dy32] = both({N, C}, 206);
    Tensor y = empty({N, C}, DType::f64), r = empty({N}, DType::f64), y32 = empty({N, C}, DType::f32),
           r32 = empty({N}, DType::f32);
    rmsnorm_forward(y, r, x, w, 1e-5);
    rmsnorm_forward(y32, r32, x32, w32, 1e-5);
    Tensor dx = empty({N, C}, DType::f64), dw = zeros({C}, DType::f64);
    Tensor dx32 = empty({N, C}, DType::f32), dw32 = zeros({C}, DType::f32);
    rmsnorm_backward(dx, dw, dy, x, w, r);
    rmsnorm_backward(dx32, dw32, dy32, x32, w32, r32);
    CHECK(whole_rel(to_f64(dx32), to_f64(dx)) < 1e-5);
    CHECK(whole_rel(to_f64(dw32), to_f64(dw)) < 1e-5);
  }
  // rope
  {
    Tensor cs = empty({T, hd}, DType::f64), sn = empty({T, hd}, DType::f64);
    Tensor cs32 = empty({T, hd}, DType::f32), sn32 = empty({T, hd}, DType::f32);
    rope_tables(cs, sn, positions_tensor({2, 3, 4, 5, 6}), 10000.0);
    rope_tables(cs32, sn32, positions_tensor({2, 3, 4, 5, 6}), 10000.0);
    auto [dy, dy32] = both({B, T, H, hd}, 207);
    Tensor dx = empty(dy.shape(), DType::f64);
    rope_backward(dx, dy, cs, sn);
    rope_backward(dy32, dy32, cs32, sn32);  // in place
    CHECK(whole_rel(to_f64(dy32), to_f64(dx)) < 1e-5);
  }
  // swiglu
  {
    auto [g, g32] = both({N, F}, 208);
    auto [u, u32] = both({N, F}, 209);
    auto [dy, dy32] = both({N, F}, 210);
    Tensor dg = empty({N, F}, DType::f64), du = empty({N, F}, DType::f64);
    Tensor dg32 = empty({N, F}, DType::f32), du32 = empty({N, F}, DType::f32);
    swiglu_backward(dg, du, dy, g, u);
    swiglu_backward(dg32, du32, dy32, g32, u32);
    CHECK(whole_rel(to_f64(dg32), to_f64(dg)) < 1e-5);
    CHECK(whole_rel(to_f64(du32), to_f64(du)) < 1e-5);
  }
  // embedding
  {
    auto [dy, dy32] = both({N, C}, 211);
    Tensor tk = tokens_tensor({4, 9, 4, 0, 5, 4, 10});
    Tensor dt = zeros({6, C}, DType::f64), dt32 = zeros({6, C}, DType::f32);  // rows [4, 10)
    embedding_backward(dt, dy, tk, 4);
    embedding_backward(dt32, dy32, tk, 4);
    CHECK(whole_rel(to_f64(dt32), to_f64(dt)) < 1e-6);
    (void)V;
  }
}

TEST_CASE("kernels: embedding backward is the transpose of embedding forward on a vocab shard") {
  const int64_t N = 9, C = 7, V = 11, row_begin = 3, V_local = 5;
  Tensor table = randn_t({V_local, C}, 301), R = randn_t({N, C}, 302), out = empty({N, C}, DType::f64);
  Tensor tk = tokens_tensor({0, 3, 7, 8, 10, 3, 5, 2, 4});
  embedding_forward(out, tk, table, row_begin, V);
  Tensor dtab = randn_t({V_local, C}, 303);
  std::vector<double> before = to_f64(dtab);
  embedding_backward(dtab, R, tk, row_begin);  // accumulates onto random values
  std::vector<double> after = to_f64(dtab), delta(after.size());
  for (size_t i = 0; i < after.size(); ++i) delta[i] = after[i] - before[i];
  // <emb(table), R> == <table, emb^T(R)>
  std::vector<double> tv = to_f64(table);
  double rhs = 0;
  for (size_t i = 0; i < tv.size(); ++i) rhs += tv[i] * delta[i];
  CHECK(dot(out, R) == doctest::Approx(rhs).epsilon(1e-12));
  // Rows 5 and 6 (tokens 8 and 9 relative 5, 6): token 8 appears once, token 9 never.
  for (int64_t c = 0; c < C; ++c) {
    CHECK(delta[size_t(4 * C + c)] == doctest::Approx(R.at<double>(2 * C + c)));            // token 7 -> row 4
    CHECK(delta[size_t(0 * C + c)] == doctest::Approx(R.at<double>(1 * C + c) + R.at<double>(5 * C + c)));  // token 3
  }
}

TEST_CASE("kernels: sum and sum_squares are exact on small integer values, any thread count") {
  ThreadCount keep;
  const int64_t n = 100003;
  std::mt19937_64 gen(401);
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<double> vals(static_cast<size_t>(n));
  int64_t s = 0, ss = 0;
  for (double& v : vals) {
    int x = d(gen);
    v = x;
    s += x;
    ss += int64_t(x) * x;
  }
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    Tensor t = from_values(vals, {n}, dt);
    for (int th : {1, 2, 3}) {
      CAPTURE(th);
      set_cpu_threads(th);
      CHECK(sum(t) == double(s));
      CHECK(sum_squares(t) == double(ss));
    }
    Tensor small = from_values({1, -2, 3, 4, -5}, {5}, dt);
    CHECK(sum(small) == 1.0);
    CHECK(sum_squares(small) == 55.0);
  }
}

TEST_CASE("kernels: adamw three steps against torch.optim.AdamW's formula on normal values") {
  const double lr = 3e-3, b1 = 0.8, b2 = 0.99, eps = 1e-6, wd = 0.05;
  const int64_t n = 13;
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor p = normal_t({n}, dt, 501), m = zeros({n}, dt), v = zeros({n}, dt);
    std::vector<double> P = to_f64(p), M(size_t(n), 0.0), Vv(size_t(n), 0.0);
    for (int step = 1; step <= 3; ++step) {
      Tensor g = normal_t({n}, dt, 510 + uint64_t(step));
      std::vector<double> G = to_f64(g);
      for (size_t i = 0; i < size_t(n); ++i) {
        P[i] *= 1 - lr * wd;
        M[i] = b1 * M[i] + (1 - b1) * G[i];
        Vv[i] = b2 * Vv[i] + (1 - b2) * G[i] * G[i];
        P[i] -= lr / (1 - std::pow(b1, step)) * M[i] / (std::sqrt(Vv[i]) / std::sqrt(1 - std::pow(b2, step)) + eps);
      }
      adamw_step(p, g, m, v, lr, b1, b2, eps, wd, step);
      const double tol = dt == DType::f64 ? 1e-12 : 1e-5;  // f32: FMA contraction (-march) changes the last bits
      CHECK(whole_rel(to_f64(p), P) < tol);
      CHECK(whole_rel(to_f64(m), M) < tol);
      CHECK(whole_rel(to_f64(v), Vv) < tol);
    }
  }
}

TEST_CASE("kernels: shape and dtype mismatches are errors starting with [kernels]") {
  const int64_t N = 7, C = 13;
  const DType f = DType::f32, d = DType::f64;
  Tensor x = randn_t({N, C}, 601, f), w = randn_t({5, C}, 602, f);
  // matmul
  CHECK_KERNELS_ERROR(matmul_forward(empty({N, 5}, f), x, randn_t({5, C}, 602, d)));
  CHECK_KERNELS_ERROR(matmul_forward(empty({N, 4}, f), x, w));
  CHECK_KERNELS_ERROR(matmul_backward(empty({N, C + 1}, f), Tensor(), empty({N, 5}, f), x, w));
  CHECK_KERNELS_ERROR(matmul_backward(Tensor(), zeros({5, C}, d), empty({N, 5}, f), x, w));
  CHECK_KERNELS_ERROR(matmul_backward(Tensor(), zeros({6, C}, f), empty({N, 5}, f), x, w));
  // rmsnorm
  CHECK_KERNELS_ERROR(rmsnorm_forward(empty({N, C}, f), empty({N}, f), x, empty({C + 1}, f), 1e-5));
  CHECK_KERNELS_ERROR(rmsnorm_forward(empty({N, C}, f), empty({N}, d), x, empty({C}, f), 1e-5));
  CHECK_KERNELS_ERROR(rmsnorm_backward(empty({N, C}, f), zeros({C + 1}, f), x, x, empty({C}, f), empty({N}, f)));
  // rope
  Tensor cs = empty({5, 8}, f), sn = empty({5, 8}, f);
  CHECK_KERNELS_ERROR(rope_forward(empty({1, 5, 2, 8}, f), empty({1, 5, 2, 8}, f), cs, empty({5, 8}, d)));
  CHECK_KERNELS_ERROR(rope_forward(empty({1, 5, 2, 8}, f), empty({1, 5, 2, 6}, f), cs, sn));
  CHECK_KERNELS_ERROR(rope_backward(empty({1, 4, 2, 8}, f), empty({1, 4, 2, 8}, f), cs, sn));
  CHECK_KERNELS_ERROR(rope_tables(empty({5, 8}, f), empty({4, 8}, f), positions_tensor({0, 1, 2, 3, 4}), 1e4));
  // swiglu
  CHECK_KERNELS_ERROR(swiglu_forward(empty({N, C}, f), x, empty({N, C}, d)));
  CHECK_KERNELS_ERROR(swiglu_backward(empty({N, C}, f), empty({N, C + 1}, f), x, x, x));
  // embedding
  Tensor tk = tokens_tensor({0, 1, 2, 3, 4, 5, 6});
  CHECK_KERNELS_ERROR(embedding_forward(empty({N, C + 1}, f), tk, randn_t({11, C}, 603, f)));
  CHECK_KERNELS_ERROR(embedding_forward(empty({N, C}, f), from_values({0, 1, 2, 3, 4, 5, 6}, {N}, DType::i64),
                                        randn_t({11, C}, 603, f)));
  CHECK_KERNELS_ERROR(embedding_backward(zeros({11, C}, f), empty({N, C}, d), tk));
  CHECK_KERNELS_ERROR(embedding_backward(zeros({11, C + 1}, f), empty({N, C}, f), tk));
  // cross-entropy
  Tensor lg = randn_t({N, 11}, 604, f);
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N + 1}, f), Tensor(), lg, tk, 1.0));
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N}, f), empty({N, 12}, f), lg, tk, 1.0));
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N}, f), Tensor(), lg, tokens_tensor({0, 1, 2}), 1.0));
  // element-wise, reductions, adamw
  CHECK_KERNELS_ERROR(add_(empty({N, C}, f), empty({N, C}, d)));
  CHECK_KERNELS_ERROR(add_(empty({N, C}, f), empty({C, N}, f)));
  CHECK_KERNELS_ERROR(sum_squares(empty({3}, DType::i64)));
  CHECK_KERNELS_ERROR(adamw_step(empty({5}, f), empty({6}, f), zeros({5}, f), zeros({5}, f), 1e-3, 0.9, 0.95, 1e-8, 0, 1));
  CHECK_KERNELS_ERROR(adamw_step(empty({5}, f), empty({5}, d), zeros({5}, f), zeros({5}, f), 1e-3, 0.9, 0.95, 1e-8, 0, 1));
}

TEST_CASE("kernels: cross-entropy on an all-ignored batch and in place with f32") {
  const int64_t N = 3, V = 11;
  Tensor lg = randn_t({N, V}, 701, DType::f32), losses = randn_t({N}, 702, DType::f32);
  Tensor tg = tokens_tensor({-1, -100, -1});
  Tensor alias = lg.clone();
  cross_entropy_forward_backward(losses, alias, alias, tg, 2.0);
  for (int64_t i = 0; i < N; ++i) CHECK(losses.at<float>(i) == 0.0f);
  for (int64_t i = 0; i < N * V; ++i) CHECK(alias.at<float>(i) == 0.0f);
  // target V - 1 is fine, V is the error naming ">= the vocabulary size".
  Tensor l = empty({N}, DType::f32);
  cross_entropy_forward_backward(l, Tensor(), lg, tokens_tensor({10, 0, 10}), 1.0);
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(l, Tensor(), lg, tokens_tensor({0, 11, 0}), 1.0),
                       ">= the vocabulary size");
}
