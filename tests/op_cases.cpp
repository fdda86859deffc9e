// The op table (tests/op_cases.h): one entry per op of runtime/kernels/ops.h and per local-attention
// variant. Adding an op is one entry here: its forward, its backward (if it has one), a naive f64
// reference of the forward, and which forward inputs the backward differentiates.
#include "op_cases.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include <doctest/doctest.h>

#include "attention/local_attention.h"
#include "runtime/core/philox.h"
#include "runtime/kernels/ops.h"
#include "test_util.h"

namespace mt::test {

Dims dims_for(Size s) {
  switch (s) {
    case Size::small:
      return {3, 4, 3, 4, 5, 1, 3, 3, 2, 1, 4};
    case Size::normal:
      return {67, 96, 80, 72, 101, 2, 33, 33, 4, 2, 16};
    case Size::perf:
      return {2048, 1024, 1024, 2816, 8192, 4, 512, 512, 8, 4, 64};
  }
  return {};
}

namespace {
uint64_t seed_of(const std::string& s) {  // FNV-1a: the same seed on every platform
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
double round_bf16(double x) { return double(float(bf16(float(x)))); }
}  // namespace

DType OpRun::dtype(Kind k) const {
  switch (k) {
    case Kind::act:
      return act;
    case Kind::acc:
      return accum_dtype(act);
    case Kind::f64:
      return DType::f64;
  }
  return act;
}

const std::vector<double>& OpRun::values_of(const std::string& name, int64_t n, double scale) {
  auto it = values->find(name);
  if (it == values->end())
    it = values->emplace(name, randn_values(size_t(n), seed_of(case_name + "/" + name), scale, true)).first;
  REQUIRE(int64_t(it->second.size()) == n);
  return it->second;
}

Tensor OpRun::in(const std::string& name, const Shape& s, Kind k, double scale) {
  if (reuse && cache.count("in " + name)) return cache.at("in " + name);
  Tensor t = from_values(values_of(name, shape_numel(s), scale), s, dtype(k));
  if (dev.is_cuda()) t = t.to(dev);
  if (reuse) cache["in " + name] = t;
  return t;
}

Tensor OpRun::ints(const std::vector<int64_t>& v, const Shape& s, DType dt, bool host) const {
  Tensor t = from_values(std::vector<double>(v.begin(), v.end()), s, dt);
  return dev.is_cuda() && !host ? t.to(dev) : t;
}

Tensor OpRun::out(const std::string& name, const Shape& s, Kind k) {
  if (reuse && cache.count("out " + name)) return cache.at("out " + name);
  Tensor t = poisoned(s, dtype(k), dev);
  outputs.push_back({name, t});
  if (reuse) cache["out " + name] = t;
  return t;
}

Tensor OpRun::acc(const std::string& name, const Shape& s, Kind k) {
  if (reuse && cache.count("acc " + name)) return cache.at("acc " + name);
  Tensor t = zero_acc ? zeros(s, dtype(k), dev) : from_values(values_of(name, shape_numel(s)), s, dtype(k));
  if (dev.is_cuda() && !zero_acc) t = t.to(dev);
  outputs.push_back({name, t});
  if (reuse) cache["acc " + name] = t;
  return t;
}

Tensor OpRun::inout(const std::string& name, const Shape& s, Kind k, double scale) {
  if (reuse && cache.count("inout " + name)) return cache.at("inout " + name);
  Tensor t = from_values(values_of(name, shape_numel(s), scale), s, dtype(k));
  if (dev.is_cuda()) t = t.to(dev);
  outputs.push_back({name + " (in place)", t});
  if (reuse) cache["inout " + name] = t;
  return t;
}

Results OpRun::results() const {
  Results r;
  for (const auto& [name, t] : outputs) r.push_back({name, to_f64(t)});
  for (const auto& s : scalars) r.push_back(s);
  return r;
}

namespace {

using V = std::vector<double>;

// ---- naive f64 references ----
V ref_matmul(const V& x, const V& w, int64_t N, int64_t C, int64_t OC) {
  V y(size_t(N * OC), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += x[size_t(n * C + c)] * w[size_t(o * C + c)];
      y[size_t(n * OC + o)] = s;
    }
  return y;
}

void ref_rmsnorm(V& y, V& rstd, const V& x, const V& w, int64_t N, int64_t C, double eps) {
  y.assign(x.size(), 0);
  rstd.assign(size_t(N), 0);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += x[size_t(n * C + c)] * x[size_t(n * C + c)];
    rstd[size_t(n)] = 1 / std::sqrt(ss / double(C) + eps);
    for (int64_t c = 0; c < C; ++c) y[size_t(n * C + c)] = x[size_t(n * C + c)] * rstd[size_t(n)] * w[size_t(c)];
  }
}

// Losses and d(grad_scale * sum of losses)/dlogits; targets < 0 ignored.
void ref_cross_entropy(V& loss, V& grad, const V& x, const std::vector<int64_t>& tg, int64_t N, int64_t Vn, double gs) {
  loss.assign(size_t(N), 0.0);
  grad.assign(size_t(N * Vn), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (tg[size_t(n)] < 0) continue;
    double mx = -INFINITY, se = 0;
    for (int64_t v = 0; v < Vn; ++v) mx = std::max(mx, x[size_t(n * Vn + v)]);
    for (int64_t v = 0; v < Vn; ++v) se += std::exp(x[size_t(n * Vn + v)] - mx);
    const double lse = mx + std::log(se);
    loss[size_t(n)] = lse - x[size_t(n * Vn + tg[size_t(n)])];
    for (int64_t v = 0; v < Vn; ++v)
      grad[size_t(n * Vn + v)] = (std::exp(x[size_t(n * Vn + v)] - lse) - (v == tg[size_t(n)] ? 1 : 0)) * gs;
  }
}

// Targets: every 7th ignored, the rest spread over [0, V) with repeats.
std::vector<int64_t> targets_for(int64_t N, int64_t Vn) {
  std::vector<int64_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[size_t(i)] = i % 7 == 3 ? -1 : (i * i + 3 * i + 1) % Vn;
  return t;
}
// Tokens with repeats, some outside a middle shard of the table.
std::vector<int64_t> tokens_for(int64_t N, int64_t Vn) {
  std::vector<int64_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[size_t(i)] = (i * i + 2 * i + 3) % Vn;
  return t;
}

// RoPE tables at positions 3, 5, 7, ... computed in f64 and rounded to bf16, the same numbers on every backend.
void rope_inputs(OpRun& r, const Dims& d, Tensor& cs, Tensor& sn, V& csv, V& snv) {
  std::vector<int64_t> pos(static_cast<size_t>(d.T));
  for (int64_t t = 0; t < d.T; ++t) pos[size_t(t)] = 3 + 2 * t;
  Tensor c64 = empty({d.T, d.hd}, DType::f64), s64 = empty({d.T, d.hd}, DType::f64);
  rope_tables(c64, s64, r.ints(pos, {d.T}, DType::i64, /*host=*/true), 10000.0);
  csv = to_f64(c64), snv = to_f64(s64);
  for (double& x : csv) x = round_bf16(x);
  for (double& x : snv) x = round_bf16(x);
  cs = from_values(csv, {d.T, d.hd}, r.act), sn = from_values(snv, {d.T, d.hd}, r.act);
  if (r.dev.is_cuda()) cs = cs.to(r.dev), sn = sn.to(r.dev);
}

// RoPE's forward (backward: its transpose) on input `in` into `out`, then again in place on `in_place`: the
// forward and backward cases run alike.
void run_rope(OpRun& r, const Dims& d, bool backward, const char* in, const char* out, const char* in_place) {
  Tensor cs, sn;
  V cv, sv;
  rope_inputs(r, d, cs, sn, cv, sv);
  auto rope = backward ? rope_backward : rope_forward;
  Tensor x = r.in(in, {d.B, d.T, d.H, d.hd});
  rope(r.out(out, x.shape()), x, cs, sn);
  Tensor xi = r.inout(in_place, x.shape());
  rope(xi, xi, cs, sn);
}

V ref_rope(const V& x, const V& c, const V& s, int64_t B, int64_t T, int64_t H, int64_t hd) {
  V y(x.size());
  const int64_t half = hd / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const size_t o = size_t(((b * T + t) * H + h) * hd);
        for (int64_t i = 0; i < hd; ++i) {
          const double rot = i < half ? -x[o + size_t(i + half)] : x[o + size_t(i - half)];
          y[o + size_t(i)] = x[o + size_t(i)] * c[size_t(t * hd + i)] + rot * s[size_t(t * hd + i)];
        }
      }
  return y;
}

// ---- local attention variants ----
struct AttnGeom {
  int64_t T, S, hd;
  bool causal;
  int64_t q_pos0, k_pos0;
  bool docs;
  int64_t window = 0;  // a sliding window (0: none)
  double softcap = 0;  // the scores' soft-cap (0: none)
};

// doc_start (B, T): documents start at q_pos0 + T/3 + b and q_pos0 + 2T/3 in row b; 0 before the first.
std::vector<int64_t> doc_starts(const AttnGeom& g, int64_t B) {
  std::vector<int64_t> ds(static_cast<size_t>(B * g.T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < g.T; ++t) {
      const int64_t p = g.q_pos0 + t, s1 = g.q_pos0 + g.T / 3 + b, s2 = g.q_pos0 + 2 * g.T / 3;
      ds[size_t(b * g.T + t)] = p >= s2 ? s2 : p >= s1 ? s1 : 0;
    }
  return ds;
}

// kernel: the bf16 CUDA kernel choice for the case (ops.h set_attention_kernel; the process's default, flash, is
// restored after): automatic runs cuDNN where it loads and takes the call (its stand-in on the emulated device).
OpCase attention_case(const std::string& name, std::function<AttnGeom(const Dims&)> geom,
                      AttentionKernel kernel = AttentionKernel::flash) {
  OpCase c;
  c.name = name;
  struct Scope {  // the kernel choice around one run of the case
    AttentionKernelChoice saved = attention_kernel();
    explicit Scope(AttentionKernel k) { set_attention_kernel({k, false}); }
    ~Scope() { set_attention_kernel(saved); }
  };
  auto options = [geom](OpRun& r, const Dims& d) {
    AttnGeom g = geom(d);
    AttentionOptions o;
    o.causal = g.causal, o.q_pos0 = g.q_pos0, o.k_pos0 = g.k_pos0, o.window = g.window, o.softcap = g.softcap;
    if (g.docs) o.doc_start = r.ints(doc_starts(g, d.B), {d.B, g.T}, DType::i64);
    return std::pair{g, o};
  };
  c.forward = [options, kernel](OpRun& r, const Dims& d) {
    Scope scope(kernel);
    auto [g, o] = options(r, d);
    Tensor q = r.in("q", {d.B, g.T, d.H, g.hd}), k = r.in("k", {d.B, g.S, d.KV, g.hd}),
           v = r.in("v", {d.B, g.S, d.KV, g.hd});
    Tensor out = r.out("out", q.shape()), lse = r.out("lse", {d.B, d.H, g.T}, Kind::acc);
    attention_forward(out, lse, q, k, v, o);
  };
  c.backward = [options, kernel](OpRun& r, const Dims& d) {
    Scope scope(kernel);
    auto [g, o] = options(r, d);
    Tensor q = r.in("q", {d.B, g.T, d.H, g.hd}), k = r.in("k", {d.B, g.S, d.KV, g.hd}),
           v = r.in("v", {d.B, g.S, d.KV, g.hd});
    Tensor dout = r.in("dout", q.shape());
    Tensor out = empty(q.shape(), r.act, r.dev), lse = empty({d.B, d.H, g.T}, accum_dtype(r.act), r.dev);
    attention_forward(out, lse, q, k, v, o);
    Tensor dq = r.out("dq", q.shape()), dk = r.out("dk", k.shape()), dv = r.out("dv", v.shape());
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
    // Accumulating onto a start (ring attention's later query chunks).
    Tensor dq2 = empty(q.shape(), r.act, r.dev), dk2 = r.acc("dk accumulated", k.shape(), Kind::act),
           dv2 = r.acc("dv accumulated", v.shape(), Kind::act);
    attention_backward(dq2, dk2, dv2, dout, q, k, v, out, lse, o, /*accumulate=*/true);
  };
  c.seeds = {{"out", "dout"}};
  c.grads = {{"q", "dq"}, {"k", "dk"}, {"v", "dv"}};
  return c;
}

// ---- mixture of experts: a fixed routing, the same on every backend ----
// E experts (4 at the small size, 8 otherwise), K = 2 per token.
int64_t moe_experts(const Dims& d) { return std::min<int64_t>(d.F, 8); }
constexpr int64_t kMoeK = 2;

// slot (N, K): token t's k-th expert is (3t + 5k + 1) mod E (distinct over k: 5 is odd, E a power of two);
// every 7th (t, k) dropped (-1, as by a capacity). Rows grouped by expert in token order, each group followed
// by one padding row no slot names; M = the routed rows + E.
struct MoeRouting {
  std::vector<int64_t> slot;
  int64_t M = 0;
};
MoeRouting moe_routing(const Dims& d) {
  const int64_t E = moe_experts(d), N = d.N, K = kMoeK;
  std::vector<int64_t> expert(size_t(N * K)), count(size_t(E), 0);
  for (int64_t i = 0; i < N * K; ++i) {
    expert[size_t(i)] = i % 7 == 3 ? -1 : (3 * (i / K) + 5 * (i % K) + 1) % E;
    if (expert[size_t(i)] >= 0) ++count[size_t(expert[size_t(i)])];
  }
  std::vector<int64_t> begin(size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) begin[size_t(e + 1)] = begin[size_t(e)] + count[size_t(e)] + 1;
  MoeRouting r;
  r.slot.assign(size_t(N * K), -1);
  r.M = begin[size_t(E)];
  for (int64_t i = 0; i < N * K; ++i)
    if (expert[size_t(i)] >= 0) r.slot[size_t(i)] = begin[size_t(expert[size_t(i)])]++;
  return r;
}

// Naive router: probs (N, E), the top K of probs + bias (ties to the lower index), their weights.
// n_group > 1: the groups' scores (their best p + bias; sigmoid: the two best summed), the topk_group best kept
// (ties to the lower group), the other experts' selection score 0.
void ref_router(V& w, std::vector<int64_t>& ex, V& p, const V& x, const V* bias, int64_t N, int64_t E, int64_t K,
                bool sigmoid, bool renorm, double scale, int64_t n_group = 1, int64_t topk_group = 1) {
  p.assign(size_t(N * E), 0), w.assign(size_t(N * K), 0), ex.assign(size_t(N * K), -1);
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = &x[size_t(n * E)];
    double* pr = &p[size_t(n * E)];
    double mx = -INFINITY, se = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, xr[e]);
    for (int64_t e = 0; e < E; ++e) se += std::exp(xr[e] - mx);
    for (int64_t e = 0; e < E; ++e) pr[e] = sigmoid ? 1 / (1 + std::exp(-xr[e])) : std::exp(xr[e] - mx) / se;
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[size_t(e)] = e;
    auto sel = [&](int64_t e) { return pr[e] + (bias ? (*bias)[size_t(e)] : 0.0); };
    std::vector<bool> kept(size_t(n_group), n_group == 1);
    if (n_group > 1) {
      const int64_t per = E / n_group;
      std::vector<double> gs(static_cast<size_t>(n_group));
      for (int64_t g = 0; g < n_group; ++g) {
        std::vector<double> v;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) v.push_back(sel(e));
        std::sort(v.rbegin(), v.rend());
        gs[size_t(g)] = sigmoid ? v[0] + v[1] : v[0];
      }
      std::vector<int64_t> go(static_cast<size_t>(n_group));
      for (int64_t g = 0; g < n_group; ++g) go[size_t(g)] = g;
      std::stable_sort(go.begin(), go.end(), [&](int64_t a, int64_t b) { return gs[size_t(a)] > gs[size_t(b)]; });
      for (int64_t k = 0; k < topk_group; ++k) kept[size_t(go[size_t(k)])] = true;
    }
    auto score = [&](int64_t e) { return kept[size_t(e / (E / n_group))] ? sel(e) : 0.0; };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score(a) > score(b); });
    double S = 0;
    for (int64_t k = 0; k < K; ++k) S += pr[order[size_t(k)]];
    for (int64_t k = 0; k < K; ++k) {
      ex[size_t(n * K + k)] = order[size_t(k)];
      w[size_t(n * K + k)] = pr[order[size_t(k)]] * scale / (renorm ? S : 1.0);
    }
  }
}

// Router top-k: softmax with a per-row probs gradient, or sigmoid with a selection bias, renormalised and scaled.
OpCase router_case(const std::string& name, bool sigmoid, bool renorm, double scale, bool with_bias,
                   bool with_dprob_row, bool grouped = false) {
  OpCase c;
  c.name = name;
  // Grouped (DeepSeek): groups of 2 experts, half of them kept.
  auto groups = [=](int64_t E) {
    const int64_t g = grouped && E % 2 == 0 && E >= 4 ? E / 2 : 1;
    return std::pair<int64_t, int64_t>{g, std::max<int64_t>(1, g / 2)};
  };
  auto fwd = [=](OpRun& r, const Dims& d, bool outputs) {
    const int64_t N = d.N, E = moe_experts(d), K = kMoeK;
    Tensor x = r.in("logits", {N, E}, Kind::act, 2.0);
    Tensor bias = with_bias ? r.in("bias", {E}, Kind::acc, 0.1) : Tensor();
    Tensor w = outputs ? r.out("weights", {N, K}, Kind::acc) : empty({N, K}, accum_dtype(r.act), r.dev);
    Tensor p = outputs ? r.out("probs", {N, E}, Kind::acc) : empty({N, E}, accum_dtype(r.act), r.dev);
    Tensor ex = r.ints(std::vector<int64_t>(size_t(N * K), -7), {N, K}, DType::i32);
    const auto [ng, tg] = groups(E);
    router_topk_forward(w, ex, p, x, bias, sigmoid, renorm, scale, ng, tg);
    return std::tuple{w, ex, p, x};
  };
  c.forward = [=](OpRun& r, const Dims& d) {
    auto [w, ex, p, x] = fwd(r, d, true);
    r.outputs.push_back({"experts", ex});
    // The seed of dprob_row: probs summed over the rows (the gradient is the same for every row).
    const int64_t E = moe_experts(d);
    V pv = to_f64(p), colsum(size_t(E), 0.0);
    for (size_t i = 0; i < pv.size(); ++i) colsum[i % size_t(E)] += pv[i];
    r.outputs.push_back({"probs summed over rows", from_values(colsum, {E}, DType::f64)});
  };
  c.reference = [=](OpRun& r, const Dims& d) {
    const int64_t N = d.N, E = moe_experts(d), K = kMoeK;
    V w, p;
    std::vector<int64_t> ex;
    const V* bias = with_bias ? &r.values_of("bias", E, 0.1) : nullptr;
    const auto [ng, tg] = groups(E);
    ref_router(w, ex, p, r.values_of("logits", N * E, 2.0), bias, N, E, K, sigmoid, renorm, scale, ng, tg);
    return Results{{"weights", w}, {"probs", p}, {"experts", V(ex.begin(), ex.end())}};
  };
  c.backward = [=](OpRun& r, const Dims& d) {
    const int64_t N = d.N, E = moe_experts(d), K = kMoeK;
    auto [w, ex, p, x] = fwd(r, d, false);
    Tensor dw = r.in("dweights", {N, K}, Kind::acc);
    Tensor dpr = with_dprob_row ? r.in("dprob_row", {E}, Kind::acc) : Tensor();
    router_topk_backward(r.out("dlogits", {N, E}), dw, dpr, p, w, ex, sigmoid, renorm, scale);
  };
  c.seeds = {{"weights", "dweights"}};
  if (with_dprob_row) c.seeds.push_back({"probs summed over rows", "dprob_row"});
  c.grads = {{"logits", "dlogits"}};
  return c;
}


// ---- mixture of experts with the routing on the device (moe_route, moe_unpad_order, the router statistics, the
// grouped GEMM with device offsets) ----

// An i32 output of the case: -7 to start, so an element the op skips shows.
Tensor i32_out(OpRun& r, const std::string& name, const Shape& s) {
  Tensor t = from_values(std::vector<double>(size_t(shape_numel(s)), -7.0), s, DType::i32);
  if (r.dev.is_cuda()) t = t.to(r.dev);
  r.outputs.push_back({name, t});
  return t;
}

// experts (N, 2) of E = 8: skewed towards expert 1 (every third token's first choice), expert 6 never chosen
// (an empty group), the rest spread.
std::vector<int64_t> route_experts(const Dims& d) {
  const int64_t E = 8;
  std::vector<int64_t> ex(size_t(d.N * kMoeK));
  for (int64_t t = 0; t < d.N; ++t)
    for (int64_t k = 0; k < kMoeK; ++k) {
      int64_t e = k == 0 && t % 3 == 0 ? 1 : (7 * t + 3 * k) % E;
      ex[size_t(t * kMoeK + k)] = e == 6 ? 5 : e;
    }
  return ex;
}

// The naive routing: expert by expert, its (t, k) in order, the first `cap` kept.
V ref_route(const std::vector<int64_t>& ex, int64_t E, int64_t cap, bool padded, V& counts, V& selected, V& offsets,
            double& dropped) {
  V slot(ex.size(), -1.0);
  counts.assign(size_t(E), 0.0), selected.assign(size_t(E), 0.0), offsets.assign(size_t(E + 1), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (size_t i = 0; i < ex.size(); ++i)
      if (ex[i] == e) selected[size_t(e)] += 1, counts[size_t(e)] += cap <= 0 || selected[size_t(e)] <= double(cap);
  for (int64_t e = 0; e < E; ++e) offsets[size_t(e + 1)] = offsets[size_t(e)] + counts[size_t(e)];
  dropped = 0;
  for (int64_t e = 0; e < E; ++e) dropped += selected[size_t(e)] - counts[size_t(e)];
  for (int64_t e = 0; e < E; ++e) {
    int64_t place = 0;
    for (size_t i = 0; i < ex.size(); ++i) {
      if (ex[i] != e) continue;
      if (cap <= 0 || place < cap) slot[i] = double((padded ? e * cap : int64_t(offsets[size_t(e)])) + place);
      ++place;
    }
  }
  return slot;
}

// The grouped GEMM's device offsets over M = N + 5 rows: an empty group, one of more than a 64-row tile (at the
// normal size), one of 1 row, one of 3, and 2 rows past the groups.
std::vector<int64_t> gmm_offsets(const Dims& d) {
  const int64_t M = d.N + 5;
  return {0, 0, M - 6, M - 5, M - 2};
}

void add_moe_device_cases(std::vector<OpCase>& cases) {
  {  // moe_route: dropless, with a capacity of 10 (expert 1 drops rows), and padded blocks of 10 (expert parallel)
    OpCase c;
    c.name = "moe_route";
    c.tol_f32 = c.tol_bf16 = 0;  // integers: exact on every backend
    const int64_t E = 8, cap = 10;
    c.forward = [=](OpRun& r, const Dims& d) {
      const Tensor ex = r.ints(route_experts(d), {d.N, kMoeK}, DType::i32);
      for (auto [tag, capacity, padded] : {std::tuple{"dropless", int64_t(0), false},
                                           std::tuple{"capacity", cap, false}, std::tuple{"padded", cap, true}}) {
        const std::string t = std::string(" ") + tag;
        Tensor slot = i32_out(r, "slot" + t, {d.N, kMoeK}), counts = i32_out(r, "counts" + t, {E}),
               selected = i32_out(r, "selected" + t, {E}), offsets = i32_out(r, "offsets" + t, {E + 1}),
               dropped = i32_out(r, "dropped" + t, {1});
        moe_route(slot, counts, selected, offsets, dropped, ex, capacity, padded);
      }
    };
    c.reference = [=](OpRun&, const Dims& d) {
      Results res;
      for (auto [tag, capacity, padded] : {std::tuple{"dropless", int64_t(0), false},
                                           std::tuple{"capacity", cap, false}, std::tuple{"padded", cap, true}}) {
        const std::string t = std::string(" ") + tag;
        V counts, selected, offsets;
        double dropped = 0;
        V slot = ref_route(route_experts(d), E, capacity, padded, counts, selected, offsets, dropped);
        res.push_back({"slot" + t, slot});
        res.push_back({"counts" + t, counts});
        res.push_back({"selected" + t, selected});
        res.push_back({"offsets" + t, offsets});
        res.push_back({"dropped" + t, {dropped}});
      }
      return res;
    };
    cases.push_back(c);
  }
  {  // moe_unpad_order: 3 sources x 4 local experts x blocks of 5 rows, some empty, some full
    OpCase c;
    c.name = "moe_unpad_order";
    c.tol_f32 = c.tol_bf16 = 0;
    const int64_t P = 3, El = 4, cap = 5;
    const std::vector<int64_t> n = {2, 0, 5, 1, 5, 3, 0, 0, 1, 4, 2, 5};  // (P, El)
    c.forward = [=](OpRun& r, const Dims&) {
      moe_unpad_order(i32_out(r, "order", {P * El * cap, 1}), i32_out(r, "offsets", {El + 1}),
                      r.ints(n, {P, El}, DType::i32), cap);
    };
    c.reference = [=](OpRun&, const Dims&) {
      V order(size_t(P * El * cap), -1.0), offsets(size_t(El + 1), 0.0);
      for (int64_t j = 0; j < El; ++j) {
        offsets[size_t(j + 1)] = offsets[size_t(j)];
        for (int64_t p = 0; p < P; ++p) {
          for (int64_t i = 0; i < n[size_t(p * El + j)]; ++i)
            order[size_t((p * El + j) * cap + i)] = offsets[size_t(j + 1)] + double(i);
          offsets[size_t(j + 1)] += double(n[size_t(p * El + j)]);
        }
      }
      return Results{{"order", order}, {"offsets", offsets}};
    };
    cases.push_back(c);
  }
  {  // the router statistics on the device: two layers recorded into a running buffer, another stage's added (pp),
     // then the gradient row
    OpCase c;
    c.name = "moe_stats";
    const int64_t E = 8, L = 3;
    c.forward = [=](OpRun& r, const Dims&) {
      Tensor stats = r.inout("stats", {L * E + E + 2}, Kind::f64);
      const std::vector<int64_t> sel0 = {3, 0, 7, 1, 1, 9, 2, 4}, sel2 = {0, 0, 1, 12, 5, 5, 2, 2};
      moe_stats_record(stats, r.ints(sel0, {E}, DType::i32), r.in("prob sums", {E}, Kind::acc),
                       r.ints({2}, {1}, DType::i32), 0, 100);
      moe_stats_record(stats, r.ints(sel2, {E}, DType::i32), Tensor(), r.ints({5}, {1}, DType::i32), 2, 60);
      moe_stats_add(stats, r.in("arrived", {L * E + E + 2}, Kind::f64));
      moe_aux_grad_row(r.out("row", {E}, Kind::acc), stats, L, 0.02, 1.0 / 512);
    };
    c.reference = [=](OpRun& r, const Dims&) {
      V st = r.values_of("stats", L * E + E + 2);
      const V& ps = r.values_of("prob sums", E);
      const std::vector<int64_t> sel0 = {3, 0, 7, 1, 1, 9, 2, 4}, sel2 = {0, 0, 1, 12, 5, 5, 2, 2};
      for (int64_t e = 0; e < E; ++e)
        st[size_t(e)] = double(sel0[size_t(e)]), st[size_t(2 * E + e)] = double(sel2[size_t(e)]),
                  st[size_t(L * E + e)] = ps[size_t(e)];
      st[size_t(L * E + E)] += 160, st[size_t(L * E + E + 1)] += 7;
      const V& arrived = r.values_of("arrived", L * E + E + 2);
      for (size_t i = 0; i < st.size(); ++i) st[i] += arrived[i];
      const double R = st[size_t(L * E + E)];
      V row(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) {
        double C = 0;
        for (int64_t l = 0; l < L; ++l) C += st[size_t(l * E + e)];
        row[size_t(e)] = R / double(L) / 512 * 0.02 * double(E) * C / (R * R);
      }
      return Results{{"stats (in place)", st}, {"row", row}};
    };
    cases.push_back(c);
  }
  {  // grouped GEMM with device offsets: an empty group, a group over a tile, groups of 1 and 3 rows, a tail
    OpCase c;
    c.name = "grouped_matmul offsets";
    const int64_t G = 4;
    c.forward = [=](OpRun& r, const Dims& d) {
      const int64_t M = d.N + 5;
      grouped_matmul_forward(r.out("y", {M, d.OC}), r.in("x", {M, d.C}), r.in("w", {G, d.OC, d.C}, Kind::act, 0.2),
                             r.ints(gmm_offsets(d), {G + 1}, DType::i32));
    };
    c.reference = [=](OpRun& r, const Dims& d) {
      const int64_t M = d.N + 5;
      const std::vector<int64_t> o = gmm_offsets(d);
      const V &x = r.values_of("x", M * d.C), &w = r.values_of("w", G * d.OC * d.C, 0.2);
      V y(size_t(M * d.OC), 0.0);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t b = o[size_t(g)], n = o[size_t(g + 1)] - b;
        V xg(x.begin() + b * d.C, x.begin() + (b + n) * d.C),
            wg(w.begin() + g * d.OC * d.C, w.begin() + (g + 1) * d.OC * d.C), yg = ref_matmul(xg, wg, n, d.C, d.OC);
        std::copy(yg.begin(), yg.end(), y.begin() + b * d.OC);
      }
      return Results{{"y", y}};
    };
    c.backward = [=](OpRun& r, const Dims& d) {
      const int64_t M = d.N + 5;
      Tensor x = r.in("x", {M, d.C}), w = r.in("w", {G, d.OC, d.C}, Kind::act, 0.2), dy = r.in("dy", {M, d.OC});
      const Tensor o = r.ints(gmm_offsets(d), {G + 1}, DType::i32);
      grouped_matmul_backward(r.out("dx", {M, d.C}), r.acc("dw", {G, d.OC, d.C}), dy, x, w, o);
      grouped_matmul_backward(Tensor(), r.acc("dw only", {G, d.OC, d.C}), dy, x, w, o);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"w", "dw"}};
    cases.push_back(c);
  }
}

// ---- FP8 (ops.h fp8_cast / fp8_matmul): the CPU is the bit-exact reference, so every backend reads bf16 inputs
// (f32 and f64 runs too) and the results are decoded codes, inverse scales and GEMM outputs, compared at ~0. ----
V decoded(const Tensor& codes, Fp8Format f) {
  Tensor h = codes.to(Device::cpu());
  V v(size_t(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) v[size_t(i)] = double(fp8::decode(h.data<uint8_t>()[i], f));
  return v;
}
// Rows scaled by 2^(r % 7 - 3) (rowwise scales differ), and a few values pushed to bf16's large end (amax).
V fp8_inputs(OpRun& r, const std::string& name, int64_t R, int64_t K) {
  V v = r.values_of(name, R * K);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < K; ++c) v[size_t(i * K + c)] = round_bf16(v[size_t(i * K + c)] * std::ldexp(1.0, int(i % 7) - 3));
  v[5] = round_bf16(v[5] * 300.0);
  return v;
}
OpCase fp8_cast_case(const std::string& name, Fp8Format fmt, bool rowwise) {
  OpCase c;
  c.name = name;
  c.tol_f32 = c.tol_bf16 = 1e-12;  // the codes and scales are the CPU's to the bit
  constexpr int64_t R = 48, K = 80;
  c.forward = [=](OpRun& r, const Dims&) {
    const DType xt = r.act == DType::bf16 ? DType::bf16 : DType::f32;  // bf16-exact values either way
    Tensor x = from_values(fp8_inputs(r, "x", R, K), {R, K}, xt).to(r.dev);
    Tensor q = empty({R, K}, DType::u8, r.dev), qt = empty({K, R}, DType::u8, r.dev);
    Tensor qi = empty({rowwise ? R : 1}, DType::f32, r.dev), qti = empty({rowwise ? K : 1}, DType::f32, r.dev);
    fp8_cast(q, qi, qt, qti, x, fmt, rowwise, rowwise);
    r.scalars.push_back({"q", decoded(q, fmt)});
    r.scalars.push_back({"qt", decoded(qt, fmt)});
    r.scalars.push_back({"q_inv", to_f64(qi)});
    r.scalars.push_back({"qt_inv", to_f64(qti)});
    if (r.check) {  // q only: the same codes and scale as with the pair
      Tensor q1 = empty({R, K}, DType::u8, r.dev), qi1 = empty({rowwise ? R : 1}, DType::f32, r.dev);
      fp8_cast(q1, qi1, Tensor(), Tensor(), x, fmt, rowwise, rowwise);
      CHECK(decoded(q1, fmt) == decoded(q, fmt));
      CHECK(to_f64(qi1) == to_f64(qi));
    }
  };
  c.reference = [=](OpRun& r, const Dims&) {  // the recipe written out: amax, scale, quantize, per row or column
    const V x = fp8_inputs(r, "x", R, K);
    auto amax = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
      double m = 0;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = c0; j < c1; ++j) m = std::max(m, std::fabs(x[size_t(i * K + j)]));
      return float(m);
    };
    V q(size_t(R * K)), qt(size_t(R * K)), qi, qti;
    for (int64_t i = 0; i < R; ++i) {
      const float s = fp8::scale_from_amax(rowwise ? amax(i, i + 1, 0, K) : amax(0, R, 0, K), fmt, rowwise);
      if (rowwise || i == 0) qi.push_back(double(1.0f / s));
      for (int64_t j = 0; j < K; ++j) q[size_t(i * K + j)] = fp8::decode(fp8::quantize(float(x[size_t(i * K + j)]), s, fmt), fmt);
    }
    for (int64_t j = 0; j < K; ++j) {
      const float s = fp8::scale_from_amax(rowwise ? amax(0, R, j, j + 1) : amax(0, R, 0, K), fmt, rowwise);
      if (rowwise || j == 0) qti.push_back(double(1.0f / s));
      for (int64_t i = 0; i < R; ++i) qt[size_t(j * R + i)] = fp8::decode(fp8::quantize(float(x[size_t(i * K + j)]), s, fmt), fmt);
    }
    return Results{{"q", q}, {"qt", qt}, {"q_inv", qi}, {"qt_inv", qti}};
  };
  return c;
}
// Codes drawn at random (no NaN), scales random positive; a (M, K) . b (N, K)^T.
std::vector<uint8_t> fp8_codes(OpRun& r, const std::string& name, int64_t n, Fp8Format f) {
  const V& v = r.values_of(name, n);
  std::vector<uint8_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint8_t code = uint8_t(int64_t(std::fabs(v[size_t(i)]) * 1e4) % 256);
    const float d = fp8::decode(code, f);
    if (!std::isfinite(d) || std::fabs(d) > 64) code &= 0x9f;  // NaN, inf or huge: a smaller exponent
    out[size_t(i)] = code;
  }
  return out;
}
Tensor u8_tensor(const std::vector<uint8_t>& codes, const Shape& s, Device dev) {
  Tensor h = empty(s, DType::u8);
  std::copy(codes.begin(), codes.end(), h.data<uint8_t>());
  return h.to(dev);
}
V fp8_scales(OpRun& r, const std::string& name, int64_t n) {
  V v = r.values_of(name, n);
  for (double& x : v) x = double(float(std::ldexp(1.0 + 0.25 * std::fabs(x), -6)));
  return v;
}
OpCase fp8_matmul_case(const std::string& name, Fp8Format af, Fp8Format bf, bool vec) {
  OpCase c;
  c.name = name;
  c.tol_f32 = 1e-12;  // the CPU's sum order is the emulated cuBLASLt's: the same bits; a GPU's f32 accumulation
  c.tol_bf16 = 1e-12;  // differs (docs/design/fp8.md), only a GPU run can say by how much
  constexpr int64_t M = 48, N = 32, K = 64;
  c.forward = [=](OpRun& r, const Dims&) {
    Tensor a = u8_tensor(fp8_codes(r, "a", M * K, af), {M, K}, r.dev);
    Tensor b = u8_tensor(fp8_codes(r, "b", N * K, bf), {N, K}, r.dev);
    Tensor ai = from_values(fp8_scales(r, "ai", vec ? M : 1), {vec ? M : 1}, DType::f32).to(r.dev);
    Tensor bi = from_values(fp8_scales(r, "bi", vec ? N : 1), {vec ? N : 1}, DType::f32).to(r.dev);
    Tensor y = empty({M, N}, DType::bf16, r.dev);
    fp8_matmul(y, a, ai, b, bi, af, bf);
    r.scalars.push_back({"y", to_f64(y)});
    Tensor acc = from_values(fp8_scales(r, "acc", M * N), {M, N}, DType::f32).to(r.dev);
    fp8_matmul(acc, a, ai, b, bi, af, bf, /*accumulate=*/true);
    r.scalars.push_back({"y f32 accumulated", to_f64(acc)});
  };
  c.reference = [=](OpRun& r, const Dims&) {
    const auto a = fp8_codes(r, "a", M * K, af), b = fp8_codes(r, "b", N * K, bf);
    const V ai = fp8_scales(r, "ai", vec ? M : 1), bi = fp8_scales(r, "bi", vec ? N : 1),
            start = fp8_scales(r, "acc", M * N);
    V y(size_t(M * N)), ya(size_t(M * N));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;  // exact: products of FP8 values, few enough to sum without rounding in f64
        for (int64_t l = 0; l < K; ++l)
          s += double(fp8::decode(a[size_t(i * K + l)], af)) * double(fp8::decode(b[size_t(j * K + l)], bf));
        const float v = float(s) * float(bi[vec ? size_t(j) : 0]) * float(ai[vec ? size_t(i) : 0]);
        y[size_t(i * N + j)] = double(float(bf16(v)));
        ya[size_t(i * N + j)] = double(v + float(start[size_t(i * N + j)]));
      }
    return Results{{"y", y}, {"y f32 accumulated", ya}};
  };
  return c;
}
}  // namespace

std::vector<OpCase> op_cases() {
  std::vector<OpCase> cases;
  const double eps = 1e-5;

  {  // matmul: out = inp @ weight^T, accumulate; dinp overwritten or accumulated, dweight accumulated
    OpCase c;
    c.name = "matmul";
    c.forward = [](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), w = r.in("w", {d.OC, d.C}, Kind::act, 0.2);
      matmul_forward(r.out("y", {d.N, d.OC}), x, w);
      matmul_forward(r.acc("y accumulated", {d.N, d.OC}, Kind::act), x, w, /*accumulate=*/true);
    };
    c.reference = [](OpRun& r, const Dims& d) {
      V y = ref_matmul(r.values_of("x", d.N * d.C), r.values_of("w", d.OC * d.C), d.N, d.C, d.OC), ya = y;
      const V& start = r.values_of("y accumulated", d.N * d.OC);
      for (size_t i = 0; i < ya.size(); ++i) ya[i] += start[i];
      return Results{{"y", y}, {"y accumulated", ya}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), w = r.in("w", {d.OC, d.C}, Kind::act, 0.2), dy = r.in("dy", {d.N, d.OC});
      matmul_backward(r.out("dx", {d.N, d.C}), r.acc("dw", {d.OC, d.C}), dy, x, w);
      matmul_backward(r.acc("dx accumulated", {d.N, d.C}, Kind::act), Tensor(), dy, Tensor(), w,
                      /*accumulate_dinp=*/true);
      matmul_backward(Tensor(), r.acc("dw only", {d.OC, d.C}), dy, x, w);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"w", "dw"}};
    cases.push_back(c);
  }
  {  // RMSNorm; the backward with and without the residual gradient (aliasing dinp)
    OpCase c;
    c.name = "rmsnorm";
    c.forward = [eps](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), w = r.in("w", {d.C});
      rmsnorm_forward(r.out("y", {d.N, d.C}), r.out("rstd", {d.N}, Kind::acc), x, w, eps);
    };
    c.reference = [eps](OpRun& r, const Dims& d) {
      V y, rs;
      ref_rmsnorm(y, rs, r.values_of("x", d.N * d.C), r.values_of("w", d.C), d.N, d.C, eps);
      return Results{{"y", y}, {"rstd", rs}};
    };
    c.backward = [eps](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), w = r.in("w", {d.C}), dy = r.in("dy", {d.N, d.C});
      Tensor y = empty({d.N, d.C}, r.act, r.dev), rstd = empty({d.N}, accum_dtype(r.act), r.dev);
      rmsnorm_forward(y, rstd, x, w, eps);
      rmsnorm_backward(r.out("dx", {d.N, d.C}), r.acc("dw", {d.C}), dy, x, w, rstd);
      Tensor dres = r.inout("dresidual", {d.N, d.C});
      rmsnorm_backward(dres, r.acc("dw with residual", {d.C}), dy, x, w, rstd, dres);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"w", "dw"}};
    cases.push_back(c);
  }
  {  // RMSNorm on rows wide enough for CUDA's fused backward (C a multiple of 32 packs: 512 = 2 bf16 or 4 f32 packs
     // a lane), over a row count no block size divides; the backward with and without the residual gradient
    OpCase c;
    c.name = "rmsnorm wide";
    auto wide = [](const Dims& d) { return std::pair<int64_t, int64_t>{2 * d.N + 17, 512}; };
    c.forward = [eps, wide](OpRun& r, const Dims& d) {
      const auto [N, C] = wide(d);
      Tensor x = r.in("x", {N, C}), w = r.in("w", {C});
      rmsnorm_forward(r.out("y", {N, C}), r.out("rstd", {N}, Kind::acc), x, w, eps);
    };
    c.reference = [eps, wide](OpRun& r, const Dims& d) {
      const auto [N, C] = wide(d);
      V y, rs;
      ref_rmsnorm(y, rs, r.values_of("x", N * C), r.values_of("w", C), N, C, eps);
      return Results{{"y", y}, {"rstd", rs}};
    };
    c.backward = [eps, wide](OpRun& r, const Dims& d) {
      const auto [N, C] = wide(d);
      Tensor x = r.in("x", {N, C}), w = r.in("w", {C}), dy = r.in("dy", {N, C});
      Tensor y = empty({N, C}, r.act, r.dev), rstd = empty({N}, accum_dtype(r.act), r.dev);
      rmsnorm_forward(y, rstd, x, w, eps);
      rmsnorm_backward(r.out("dx", {N, C}), r.acc("dw", {C}), dy, x, w, rstd);
      Tensor dres = r.inout("dresidual", {N, C});
      rmsnorm_backward(dres, r.acc("dw with residual", {C}), dy, x, w, rstd, dres);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"w", "dw"}};
    cases.push_back(c);
  }
  {  // the residual add fused in front of the norm, the sum written over a
    OpCase c;
    c.name = "add_rmsnorm";
    c.forward = [eps](OpRun& r, const Dims& d) {
      Tensor a = r.inout("a", {d.N, d.C}), b = r.in("b", {d.N, d.C}), w = r.in("w", {d.C});
      add_rmsnorm_forward(a, r.out("y", {d.N, d.C}), r.out("rstd", {d.N}, Kind::acc), a, b, w, eps);
    };
    c.reference = [eps](OpRun& r, const Dims& d) {
      V s = r.values_of("a", d.N * d.C);
      const V& b = r.values_of("b", d.N * d.C);
      for (size_t i = 0; i < s.size(); ++i) s[i] += b[i];
      V y, rs;
      ref_rmsnorm(y, rs, s, r.values_of("w", d.C), d.N, d.C, eps);
      return Results{{"a (in place)", s}, {"y", y}, {"rstd", rs}};
    };
    cases.push_back(c);
  }
  {  // RoPE tables: cos/sin of pos * theta^(-2i/hd), the halves repeated; computed on the host in cos's dtype
    OpCase c;
    c.name = "rope_tables";
    c.cpu_only = true;
    c.tol_bf16 = 2e-2;  // the angles are computed in bf16: pos * inv_freq loses ~pos * 2^-9 radians
    auto pos = [](const Dims& d) {
      std::vector<int64_t> p(static_cast<size_t>(d.T));
      for (int64_t t = 0; t < d.T; ++t) p[size_t(t)] = t;
      return p;
    };
    c.forward = [pos](OpRun& r, const Dims& d) {
      rope_tables(r.out("cos", {d.T, d.hd}), r.out("sin", {d.T, d.hd}), r.ints(pos(d), {d.T}, DType::i64, true), 500.0);
    };
    c.reference = [pos](OpRun&, const Dims& d) {
      V cs(size_t(d.T * d.hd)), sn(cs.size());
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t i = 0; i < d.hd; ++i) {
          const double a = double(pos(d)[size_t(t)]) * std::pow(500.0, -2.0 * double(i % (d.hd / 2)) / double(d.hd));
          cs[size_t(t * d.hd + i)] = std::cos(a), sn[size_t(t * d.hd + i)] = std::sin(a);
        }
      return Results{{"cos", cs}, {"sin", sn}};
    };
    cases.push_back(c);
  }
  {  // RoPE forward (also in place) and its transpose
    OpCase c;
    c.name = "rope";
    c.forward = [](OpRun& r, const Dims& d) { run_rope(r, d, false, "x", "y", "x2"); };
    c.reference = [](OpRun& r, const Dims& d) {
      Tensor cs, sn;
      V cv, sv;
      rope_inputs(r, d, cs, sn, cv, sv);
      const int64_t n = d.B * d.T * d.H * d.hd;
      return Results{{"y", ref_rope(r.values_of("x", n), cv, sv, d.B, d.T, d.H, d.hd)},
                     {"x2 (in place)", ref_rope(r.values_of("x2", n), cv, sv, d.B, d.T, d.H, d.hd)}};
    };
    c.backward = [](OpRun& r, const Dims& d) { run_rope(r, d, true, "dy", "dx", "dy2"); };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}};
    cases.push_back(c);
  }
  {  // SwiGLU: silu(gate) * up
    OpCase c;
    c.name = "swiglu";
    c.forward = [](OpRun& r, const Dims& d) {
      swiglu_forward(r.out("y", {d.N, d.F}), r.in("gate", {d.N, d.F}, Kind::act, 2.0), r.in("up", {d.N, d.F}));
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const V &g = r.values_of("gate", d.N * d.F), &u = r.values_of("up", d.N * d.F);
      V y(g.size());
      for (size_t i = 0; i < g.size(); ++i) y[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      return Results{{"y", y}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      Tensor g = r.in("gate", {d.N, d.F}, Kind::act, 2.0), u = r.in("up", {d.N, d.F}), dy = r.in("dy", {d.N, d.F});
      swiglu_backward(r.out("dgate", g.shape()), r.out("dup", g.shape()), dy, g, u);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"gate", "dgate"}, {"up", "dup"}};
    cases.push_back(c);
  }
  {  // GeGLU (Gemma): gelu with the tanh approximation times up
    OpCase c;
    c.name = "geglu";
    c.forward = [](OpRun& r, const Dims& d) {
      geglu_forward(r.out("y", {d.N, d.F}), r.in("gate", {d.N, d.F}, Kind::act, 2.0), r.in("up", {d.N, d.F}));
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const V &g = r.values_of("gate", d.N * d.F), &u = r.values_of("up", d.N * d.F);
      V y(g.size());
      for (size_t i = 0; i < g.size(); ++i)
        y[i] = 0.5 * g[i] * (1 + std::tanh(std::sqrt(2 / M_PI) * (g[i] + 0.044715 * g[i] * g[i] * g[i]))) * u[i];
      return Results{{"y", y}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      Tensor g = r.in("gate", {d.N, d.F}, Kind::act, 2.0), u = r.in("up", {d.N, d.F}), dy = r.in("dy", {d.N, d.F});
      geglu_backward(r.out("dgate", g.shape()), r.out("dup", g.shape()), dy, g, u);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"gate", "dgate"}, {"up", "dup"}};
    cases.push_back(c);
  }
  {  // Soft-capping (Gemma 2's final logits): cap tanh(x / cap), the backward from the output
    OpCase c;
    c.name = "softcap";
    constexpr double cap = 1.5;
    c.forward = [](OpRun& r, const Dims& d) {
      softcap_forward(r.out("y", {d.N, d.F}), r.in("x", {d.N, d.F}, Kind::act, 3.0), cap);
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const V& x = r.values_of("x", d.N * d.F);
      V y(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = cap * std::tanh(x[i] / cap);
      return Results{{"y", y}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.F}, Kind::act, 3.0), dy = r.in("dy", {d.N, d.F});
      Tensor y = empty(x.shape(), r.act, r.dev);
      softcap_forward(y, x, cap);
      softcap_backward(r.out("dx", x.shape()), dy, y, cap);
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}};
    cases.push_back(c);
  }
  {  // Embedding on a vocab shard of rows [V/4, V/4 + V/2): other tokens give zeros; the backward scatters
    OpCase c;
    c.name = "embedding";
    auto shard = [](const Dims& d) { return std::pair{d.V / 4, std::max<int64_t>(d.V / 2, 1)}; };
    auto gather = [shard](OpRun& r, const Dims& d) {  // the naive lookup
      auto [begin, rows] = shard(d);
      const V& tab = r.values_of("table", rows * d.C);
      V y(size_t(d.N * d.C), 0.0);
      auto tok = tokens_for(d.N, d.V);
      for (int64_t n = 0; n < d.N; ++n)
        if (tok[size_t(n)] >= begin && tok[size_t(n)] < begin + rows)
          for (int64_t e = 0; e < d.C; ++e) y[size_t(n * d.C + e)] = tab[size_t((tok[size_t(n)] - begin) * d.C + e)];
      return y;
    };
    c.forward = [shard, gather](OpRun& r, const Dims& d) {
      auto [begin, rows] = shard(d);
      Tensor tok = r.ints(tokens_for(d.N, d.V), {d.N}, DType::i32), y = r.out("y", {d.N, d.C});
      embedding_forward(y, tok, r.in("table", {rows, d.C}), begin, d.V);
      if (r.check) CHECK(to_f64(y) == gather(r, d));  // a gather of bf16-exact values: exact on every backend
    };
    c.reference = [gather](OpRun& r, const Dims& d) { return Results{{"y", gather(r, d)}}; };
    c.backward = [shard](OpRun& r, const Dims& d) {
      auto [begin, rows] = shard(d);
      Tensor tok = r.ints(tokens_for(d.N, d.V), {d.N}, DType::i32), dy = r.in("dy", {d.N, d.C});
      Tensor dt = r.acc("dtable", {rows, d.C});
      Tensor again = dt.clone();
      embedding_backward(dt, dy, tok, begin);
      if (r.check) {  // deterministic: the same bits on a rerun
        embedding_backward(again, dy, tok, begin);
        CHECK(equal(dt.to(Device::cpu()), again.to(Device::cpu())));  // equal() compares host tensors
      }
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"table", "dtable"}};
    cases.push_back(c);
  }
  {  // Fused softmax cross-entropy: losses only, and losses with the gradient written over the logits
    OpCase c;
    c.name = "cross_entropy";
    auto gs = [](const Dims&) { return 0.5; };
    c.forward = [gs](OpRun& r, const Dims& d) {
      Tensor tg = r.ints(targets_for(d.N, d.V), {d.N}, DType::i32);
      cross_entropy_forward_backward(r.out("losses", {d.N}, Kind::acc), Tensor(),
                                     r.in("logits", {d.N, d.V}, Kind::act, 3.0), tg, gs(d));
      Tensor lg = r.inout("logits", {d.N, d.V}, Kind::act, 3.0);
      cross_entropy_forward_backward(r.out("losses with gradient", {d.N}, Kind::acc), lg, lg, tg, gs(d));
      // A vocabulary a multiple of 8: the CUDA kernel's 16-byte loads (V above is odd: one element at a time).
      if (const int64_t v8 = d.V / 8 * 8; v8 > 0) {
        Tensor l8 = r.inout("logits8", {d.N, v8}, Kind::act, 3.0);
        cross_entropy_forward_backward(r.out("losses, V a multiple of 8", {d.N}, Kind::acc), l8, l8,
                                       r.ints(targets_for(d.N, v8), {d.N}, DType::i32), gs(d));
      }
    };
    c.reference = [gs](OpRun& r, const Dims& d) {
      V l, g;
      ref_cross_entropy(l, g, r.values_of("logits", d.N * d.V), targets_for(d.N, d.V), d.N, d.V, gs(d));
      Results res{{"losses", l}, {"logits (in place)", g}, {"losses with gradient", l}};
      if (const int64_t v8 = d.V / 8 * 8; v8 > 0) {
        V l8, g8;
        ref_cross_entropy(l8, g8, r.values_of("logits8", d.N * v8), targets_for(d.N, v8), d.N, v8, gs(d));
        res.push_back({"logits8 (in place)", g8});
        res.push_back({"losses, V a multiple of 8", l8});
      }
      return res;
    };
    c.backward = [gs](OpRun& r, const Dims& d) {
      Tensor tg = r.ints(targets_for(d.N, d.V), {d.N}, DType::i32), lg = r.in("logits", {d.N, d.V}, Kind::act, 3.0);
      cross_entropy_forward_backward(empty({d.N}, accum_dtype(r.act), r.dev), r.out("dlogits", lg.shape()), lg, tg,
                                     gs(d));
    };
    c.seeds = {{"losses", "", 0.5}};  // d(grad_scale * sum of losses)
    c.grads = {{"logits", "dlogits"}};
    cases.push_back(c);
  }
  {  // Vocab-parallel cross-entropy over three shards (one a single column), the all-reduces done on the host
    OpCase c;
    c.name = "vocab_parallel";
    c.forward = [](OpRun& r, const Dims& d) {
      const std::vector<int64_t> cut = {0, d.V / 2, d.V / 2 + 1, d.V};
      const V& x = r.values_of("logits", d.N * d.V, 3.0);
      Tensor tg = r.ints(targets_for(d.N, d.V), {d.N}, DType::i32);
      std::vector<Tensor> sh;
      V gmax(size_t(d.N), -INFINITY), gse(size_t(d.N), 0), gtl(size_t(d.N), 0);
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        const int64_t w = cut[s + 1] - cut[s];
        V part(static_cast<size_t>(d.N * w));
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t v = 0; v < w; ++v) part[size_t(n * w + v)] = x[size_t(n * d.V + cut[s] + v)];
        sh.push_back(from_values(part, {d.N, w}, r.act).to(r.dev));
        Tensor mx = r.out("row_max " + std::to_string(s), {d.N}, Kind::f64);
        vocab_shard_max(mx, sh.back());
        V m = to_f64(mx);
        for (int64_t n = 0; n < d.N; ++n) gmax[size_t(n)] = std::max(gmax[size_t(n)], m[size_t(n)]);
      }
      Tensor row_max = from_values(gmax, {d.N}, DType::f64).to(r.dev);
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        Tensor se = r.out("sumexp " + std::to_string(s), {d.N}, Kind::f64),
               tl = r.out("target_logit " + std::to_string(s), {d.N}, Kind::f64);
        vocab_shard_sumexp(se, tl, sh[s], tg, row_max, cut[s]);
        V a = to_f64(se), b = to_f64(tl);
        for (int64_t n = 0; n < d.N; ++n) gse[size_t(n)] += a[size_t(n)], gtl[size_t(n)] += b[size_t(n)];
      }
      Tensor sumexp = from_values(gse, {d.N}, DType::f64).to(r.dev),
             tlog = from_values(gtl, {d.N}, DType::f64).to(r.dev);
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        r.outputs.push_back({"dlogits " + std::to_string(s), sh[s]});  // the gradient over the shard's logits
        vocab_shard_loss(r.out("losses " + std::to_string(s), {d.N}, Kind::acc), sh[s], sh[s], tg, row_max, sumexp,
                         tlog, cut[s], 0.5);
      }
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const std::vector<int64_t> cut = {0, d.V / 2, d.V / 2 + 1, d.V};
      const V& x = r.values_of("logits", d.N * d.V, 3.0);
      auto tg = targets_for(d.N, d.V);
      V l, g;
      ref_cross_entropy(l, g, x, tg, d.N, d.V, 0.5);
      V gmax(size_t(d.N), -INFINITY);
      Results res;
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        V m(size_t(d.N), -INFINITY);
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t v = cut[s]; v < cut[s + 1]; ++v) m[size_t(n)] = std::max(m[size_t(n)], x[size_t(n * d.V + v)]);
        for (int64_t n = 0; n < d.N; ++n) gmax[size_t(n)] = std::max(gmax[size_t(n)], m[size_t(n)]);
        res.push_back({"row_max " + std::to_string(s), m});
      }
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        V se(size_t(d.N), 0), tl(size_t(d.N), 0);
        for (int64_t n = 0; n < d.N; ++n) {
          for (int64_t v = cut[s]; v < cut[s + 1]; ++v)
            se[size_t(n)] += std::exp(x[size_t(n * d.V + v)] - gmax[size_t(n)]);
          const int64_t t = tg[size_t(n)];
          if (t >= cut[s] && t < cut[s + 1]) tl[size_t(n)] = x[size_t(n * d.V + t)];
        }
        res.push_back({"sumexp " + std::to_string(s), se});
        res.push_back({"target_logit " + std::to_string(s), tl});
      }
      for (size_t s = 0; s + 1 < cut.size(); ++s) {
        const int64_t w = cut[s + 1] - cut[s];
        V part(static_cast<size_t>(d.N * w));
        for (int64_t n = 0; n < d.N; ++n)
          for (int64_t v = 0; v < w; ++v) part[size_t(n * w + v)] = g[size_t(n * d.V + cut[s] + v)];
        res.push_back({"dlogits " + std::to_string(s), part});
        res.push_back({"losses " + std::to_string(s), l});
      }
      // The order the forward registers them in: maxima, then sums, then (gradient, losses) per shard.
      return res;
    };
    cases.push_back(c);
  }
  {  // add (out of place and accumulating), then scale_
    OpCase c;
    c.name = "add_scale";
    c.forward = [](OpRun& r, const Dims& d) {
      const int64_t n = 3 * 4096 + 77;  // several reduction chunks and a ragged tail on every backend
      (void)d;
      Tensor a = r.in("a", {n}), b = r.in("b", {n});
      add(r.out("a + b", {n}), a, b);
      Tensor c2 = r.inout("c", {n});
      add_(c2, b);
      scale_(c2, -0.25);
    };
    c.reference = [](OpRun& r, const Dims&) {
      const int64_t n = 3 * 4096 + 77;
      const V &a = r.values_of("a", n), &b = r.values_of("b", n), &c2 = r.values_of("c", n);
      V s(a.size()), t(a.size());
      for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i], t[i] = (c2[i] + b[i]) * -0.25;
      return Results{{"a + b", s}, {"c (in place)", t}};
    };
    cases.push_back(c);
  }
  {  // dropout keyed by (row id, column): LoRA's lora_dropout, the same mask on every layout; also in place
    OpCase c;
    c.name = "dropout_rows";
    static const double p = 0.3;
    auto ids = [](const Dims& d) {  // rows' global indices: not contiguous (a cp shard's head and tail)
      std::vector<int64_t> v;
      for (int64_t n = 0; n < d.N; ++n) v.push_back(n % 2 ? 1000 + n : 7 * n);
      return v;
    };
    c.forward = [ids](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C});
      Tensor rows = r.ints(ids(d), {d.N}, DType::i64);
      dropout_rows(r.out("y", {d.N, d.C}), x, rows, 42, 9, 0, d.C, p);
      // The columns in two parts, each with its offset, give the whole's mask (a Rowwise layer's shards).
      const int64_t h = d.C / 2;
      Tensor xl = r.in("xl", {d.N, h}), xr = r.in("xr", {d.N, d.C - h});
      dropout_rows(r.out("yl", {d.N, h}), xl, rows, 42, 9, 0, d.C, p);
      Tensor yr = r.inout("xr", {d.N, d.C - h});
      dropout_rows(yr, yr, rows, 42, 9, h, d.C, p);
      (void)xr;
    };
    c.reference = [ids](OpRun& r, const Dims& d) {
      const V& x = r.values_of("x", d.N * d.C);
      const int64_t h = d.C / 2;
      const V &xl = r.values_of("xl", d.N * h), &xr = r.values_of("xr", d.N * (d.C - h));
      const std::vector<int64_t> rows = ids(d);
      auto keep = [&](int64_t n, int64_t col) {
        return philox::uniform(42, 9, uint64_t(rows[size_t(n)]) * uint64_t(d.C) + uint64_t(col)) >= float(p);
      };
      const double k = 1.0 / (1.0 - p);
      V y(x.size()), yl(xl.size()), yr(xr.size());
      for (int64_t n = 0; n < d.N; ++n) {
        for (int64_t col = 0; col < d.C; ++col) y[size_t(n * d.C + col)] = keep(n, col) ? x[size_t(n * d.C + col)] * k : 0;
        for (int64_t col = 0; col < h; ++col) yl[size_t(n * h + col)] = keep(n, col) ? xl[size_t(n * h + col)] * k : 0;
        for (int64_t col = h; col < d.C; ++col) {
          const size_t i = size_t(n * (d.C - h) + col - h);
          yr[i] = keep(n, col) ? xr[i] * k : 0;
        }
      }
      return Results{{"y", y}, {"yl", yl}, {"xr (in place)", yr}};
    };
    cases.push_back(c);
  }
  {  // bias add (Qwen2's q/k/v biases), also in place; the backward sums dout's columns in a fixed order
    OpCase c;
    c.name = "bias_add";
    c.forward = [](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), b = r.in("b", {d.C});
      bias_add_forward(r.out("y", {d.N, d.C}), x, b);
      Tensor xi = r.inout("x2", {d.N, d.C});
      bias_add_forward(xi, xi, b);
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const V &x = r.values_of("x", d.N * d.C), &x2 = r.values_of("x2", d.N * d.C), &b = r.values_of("b", d.C);
      V y(x.size()), y2(x.size());
      for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] + b[i % size_t(d.C)], y2[i] = x2[i] + b[i % size_t(d.C)];
      return Results{{"y", y}, {"x2 (in place)", y2}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      Tensor dy = r.in("dy", {d.N, d.C}), db = r.acc("db", {d.C});
      Tensor again = db.clone();
      bias_add_backward(db, dy);
      if (r.check) {  // deterministic: the same bits on a rerun, and on the CPU with one thread
        const int threads = cpu_threads();
        if (!r.dev.is_cuda()) set_cpu_threads(1);
        bias_add_backward(again, dy);
        set_cpu_threads(threads);
        CHECK(to_f64(again) == to_f64(db));
      }
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"b", "db"}};
    cases.push_back(c);
  }
  {  // convert from f32 values that are not bf16-exact: rounding to nearest even, the same bits on every device
    OpCase c;
    c.name = "convert";
    auto src_values = [](OpRun& r, const Dims& d) {
      V v = r.values_of("src", d.N * d.C);
      for (size_t i = 0; i < v.size(); ++i) v[i] = double(float(v[i] * (1.0 + 1e-3 * double(i % 7))));
      return v;
    };
    c.forward = [src_values](OpRun& r, const Dims& d) {
      V v = src_values(r, d);
      Tensor src = from_values(v, {d.N, d.C}, DType::f32).to(r.dev), dst = r.out("dst", {d.N, d.C});
      convert(dst, src);
      if (r.check) {  // exact: the host's rounding (the bf16 type of runtime/core/dtype.h) or no rounding
        V want = v;
        if (r.act == DType::bf16)
          for (double& x : want) x = round_bf16(x);
        CHECK(to_f64(dst) == want);
      }
    };
    c.reference = [src_values](OpRun& r, const Dims& d) { return Results{{"dst", src_values(r, d)}}; };
    cases.push_back(c);
  }
  {  // sum, sum_squares and the batched sum_squares_each (the same bits as one call per tensor)
    OpCase c;
    c.name = "sum";
    c.tol_f32 = c.tol_bf16 = 1e-9;  // bf16-exact inputs summed in f64 on every backend: only the order differs
    c.forward = [](OpRun& r, const Dims& d) {
      const int64_t big = 100003;
      Tensor a = r.in("a", {d.N, d.C}), b = r.in("b", {big});
      r.scalar("sum a", sum(a));
      r.scalar("sum b", sum(b));
      r.scalar("sum_squares a", sum_squares(a));
      r.scalar("sum_squares b", sum_squares(b));
      std::vector<Tensor> many = {a, b, empty({0}, r.act, r.dev)};
      std::vector<double> each = sum_squares_each(many);
      REQUIRE(each.size() == 3);
      for (size_t i = 0; i < each.size(); ++i) r.scalar("sum_squares_each " + std::to_string(i), each[i]);
      if (r.check)
        for (size_t i = 0; i < many.size(); ++i) CHECK(each[i] == sum_squares(many[i]));
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const V &a = r.values_of("a", d.N * d.C), &b = r.values_of("b", 100003);
      double sa = 0, sb = 0, qa = 0, qb = 0;
      for (double x : a) sa += x, qa += x * x;
      for (double x : b) sb += x, qb += x * x;
      return Results{{"sum a", {sa}},
                     {"sum b", {sb}},
                     {"sum_squares a", {qa}},
                     {"sum_squares b", {qb}},
                     {"sum_squares_each 0", {qa}},
                     {"sum_squares_each 1", {qb}},
                     {"sum_squares_each 2", {0.0}}};
    };
    cases.push_back(c);
  }
  {  // AdamW, three steps on the master copy (acc dtype); with bf16 activations the bf16 copy in the same pass
    OpCase c;
    c.name = "adamw";
    c.tol_f32 = 1e-5;
    struct H {
      double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    };
    c.forward = [](OpRun& r, const Dims& d) {
      const H h;
      const Shape s = {d.N, d.C};
      Tensor p = r.inout("param", s, Kind::acc), m = r.out("m", s, Kind::acc), v = r.out("v", s, Kind::acc);
      fill_zero_(m), fill_zero_(v);  // (zeros on the device: the state starts at zero)
      Tensor low = r.act == DType::bf16 ? r.out("param bf16", s, Kind::act) : Tensor();
      for (int step = 1; step <= 3; ++step)
        adamw_step(p, r.in("grad " + std::to_string(step), s, Kind::acc), m, v, h.lr, h.b1, h.b2, h.eps, h.wd, step,
                   low);
      if (r.check && low.defined()) {  // the bf16 copy is the master rounded to nearest even
        V want = to_f64(p);
        for (double& x : want) x = round_bf16(x);
        CHECK(to_f64(low) == want);
      }
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const H h;
      const int64_t n = d.N * d.C;
      V P = r.values_of("param", n), M(size_t(n), 0), Vv(size_t(n), 0);
      for (int step = 1; step <= 3; ++step) {
        const V& G = r.values_of("grad " + std::to_string(step), n);
        for (size_t i = 0; i < P.size(); ++i) {
          P[i] -= h.lr * h.wd * P[i];  // decoupled weight decay first
          M[i] = h.b1 * M[i] + (1 - h.b1) * G[i];
          Vv[i] = h.b2 * Vv[i] + (1 - h.b2) * G[i] * G[i];
          P[i] -= h.lr * (M[i] / (1 - std::pow(h.b1, step))) / (std::sqrt(Vv[i] / (1 - std::pow(h.b2, step))) + h.eps);
        }
      }
      return Results{{"param (in place)", P}, {"m", M}, {"v", Vv}};
    };
    cases.push_back(c);
  }
  {  // copy_slice along dims 0, 1 and 3 of a (B, T, H, hd) tensor into a wider one
    OpCase c;
    c.name = "copy_slice";
    c.forward = [](OpRun& r, const Dims& d) {
      Tensor src = r.in("src", {d.B + 1, d.T, d.H, d.hd});
      copy_slice(r.inout("dst1", {d.B + 1, d.T + 3, d.H, d.hd}), 2, src, 1, d.T - 1, 1);
      copy_slice(r.inout("dst0", {d.B + 2, d.T, d.H, d.hd}), 1, src, 0, d.B + 1, 0);
      copy_slice(r.inout("dst3", {d.B + 1, d.T, d.H, d.hd + 2}), 0, src, 2, d.hd - 2, 3);
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const Shape ss = {d.B + 1, d.T, d.H, d.hd};
      const V& src = r.values_of("src", shape_numel(ss));
      Results res;
      // dst[..., db + i, ...] = src[..., sb + i, ...] along dim `dim`, in row-major index arithmetic.
      auto run = [&](const std::string& name, Shape ds, int64_t db, int64_t sb, int64_t n, int dim) {
        V dst = r.values_of(name, shape_numel(ds));
        int64_t rows = 1, inner = 1;
        for (int k = 0; k < dim; ++k) rows *= ds[size_t(k)];
        for (size_t k = size_t(dim) + 1; k < ds.size(); ++k) inner *= ds[k];
        for (int64_t row = 0; row < rows; ++row)
          for (int64_t i = 0; i < n; ++i)
            for (int64_t e = 0; e < inner; ++e)
              dst[size_t((row * ds[size_t(dim)] + db + i) * inner + e)] =
                  src[size_t((row * ss[size_t(dim)] + sb + i) * inner + e)];
        res.push_back({name + " (in place)", dst});
      };
      run("dst1", {d.B + 1, d.T + 3, d.H, d.hd}, 2, 1, d.T - 1, 1);
      run("dst0", {d.B + 2, d.T, d.H, d.hd}, 1, 0, d.B + 1, 0);
      run("dst3", {d.B + 1, d.T, d.H, d.hd + 2}, 0, 2, d.hd - 2, 3);
      return res;
    };
    cases.push_back(c);
  }
  {  // the log-sum-exp merge of two partial attention results, with rows of -inf on one side and on both
    OpCase c;
    c.name = "attention_merge";
    auto lses = [](OpRun& r, const Dims& d) {
      const int64_t n = d.B * d.H * d.T;
      V a = r.values_of("lse", n), b = r.values_of("part_lse", n);
      for (int64_t i = 0; i < n; ++i) {
        if (i % 5 == 1) a[size_t(i)] = -INFINITY;
        if (i % 5 == 2) b[size_t(i)] = -INFINITY;
        if (i % 5 == 3) a[size_t(i)] = b[size_t(i)] = -INFINITY;
      }
      return std::pair{a, b};
    };
    auto outs = [](OpRun& r, const Dims& d, const std::string& name, const V& l) {
      V o = r.values_of(name, d.B * d.T * d.H * d.hd);
      for (int64_t b = 0; b < d.B; ++b)  // rows that saw no key hold zeros
        for (int64_t h = 0; h < d.H; ++h)
          for (int64_t t = 0; t < d.T; ++t)
            if (std::isinf(l[size_t((b * d.H + h) * d.T + t)]))
              for (int64_t e = 0; e < d.hd; ++e) o[size_t(((b * d.T + t) * d.H + h) * d.hd + e)] = 0;
      return o;
    };
    c.forward = [lses, outs](OpRun& r, const Dims& d) {
      auto [la, lb] = lses(r, d);
      const Shape so = {d.B, d.T, d.H, d.hd}, sl = {d.B, d.H, d.T};
      auto make = [&](const V& v, const Shape& s, Kind k) {
        Tensor t = from_values(v, s, r.dtype(k));
        return r.dev.is_cuda() ? t.to(r.dev) : t;
      };
      Tensor out = make(outs(r, d, "out", la), so, Kind::acc), lse = make(la, sl, Kind::acc);
      r.outputs.push_back({"out", out});
      r.outputs.push_back({"lse", lse});
      attention_merge(out, lse, make(outs(r, d, "part_out", lb), so, Kind::act), make(lb, sl, Kind::acc));
    };
    c.reference = [lses, outs](OpRun& r, const Dims& d) {
      auto [la, lb] = lses(r, d);
      V o = outs(r, d, "out", la), po = outs(r, d, "part_out", lb), l(la.size());
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t h = 0; h < d.H; ++h)
          for (int64_t t = 0; t < d.T; ++t) {
            const size_t k = size_t((b * d.H + h) * d.T + t);
            const double m = std::max(la[k], lb[k]);
            l[k] = std::isinf(m) ? m : m + std::log(std::exp(la[k] - m) + std::exp(lb[k] - m));
            const double wa = std::isinf(la[k]) ? 0 : std::exp(la[k] - l[k]),
                         wb = std::isinf(lb[k]) ? 0 : std::exp(lb[k] - l[k]);
            for (int64_t e = 0; e < d.hd; ++e) {
              const size_t i = size_t(((b * d.T + t) * d.H + h) * d.hd + e);
              o[i] = wa * o[i] + wb * po[i];
            }
          }
      return Results{{"out", o}, {"lse", l}};
    };
    cases.push_back(c);
  }

  // Mixture of experts: the router (softmax and sigmoid), dispatch and combine on a fixed routing with dropped
  // slots and padding rows, the grouped GEMM with an empty group.
  cases.push_back(router_case("router_topk softmax", false, false, 1.0, false, true));
  cases.push_back(router_case("router_topk sigmoid", true, true, 2.5, true, false));
  cases.push_back(router_case("router_topk sigmoid grouped", true, true, 2.5, true, false, true));
  cases.push_back(router_case("router_topk softmax grouped", false, true, 1.5, false, false, true));
  {  // dispatch: out rows slot[t,k] = x row t, the padding rows left as they are; backward sums the K rows
    OpCase c;
    c.name = "moe_dispatch";
    c.forward = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      Tensor out = r.inout("out", {rt.M, d.C});
      moe_dispatch_forward(out, r.in("x", {d.N, d.C}), r.ints(rt.slot, {d.N, kMoeK}, DType::i32));
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      V out = r.values_of("out", rt.M * d.C);
      const V& x = r.values_of("x", d.N * d.C);
      for (int64_t i = 0; i < d.N * kMoeK; ++i)
        if (rt.slot[size_t(i)] >= 0)
          std::copy_n(&x[size_t(i / kMoeK * d.C)], d.C, &out[size_t(rt.slot[size_t(i)] * d.C)]);
      return Results{{"out (in place)", out}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      moe_dispatch_backward(r.out("dx", {d.N, d.C}), r.in("dout", {rt.M, d.C}),
                            r.ints(rt.slot, {d.N, kMoeK}, DType::i32));
    };
    c.seeds = {{"out (in place)", "dout"}};
    c.grads = {{"x", "dx"}};
    cases.push_back(c);
  }
  {  // combine: y row t = sum_k weights[t,k] * x row slot[t,k]; backward dx (padding rows 0) and dweights
    OpCase c;
    c.name = "moe_combine";
    c.forward = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      moe_combine_forward(r.out("y", {d.N, d.C}), r.in("x", {rt.M, d.C}), r.in("weights", {d.N, kMoeK}, Kind::acc),
                          r.ints(rt.slot, {d.N, kMoeK}, DType::i32));
    };
    c.reference = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      const V &x = r.values_of("x", rt.M * d.C), &w = r.values_of("weights", d.N * kMoeK);
      V y(size_t(d.N * d.C), 0.0);
      for (int64_t i = 0; i < d.N * kMoeK; ++i)
        if (rt.slot[size_t(i)] >= 0)
          for (int64_t e = 0; e < d.C; ++e)
            y[size_t(i / kMoeK * d.C + e)] += w[size_t(i)] * x[size_t(rt.slot[size_t(i)] * d.C + e)];
      return Results{{"y", y}};
    };
    c.backward = [](OpRun& r, const Dims& d) {
      const MoeRouting rt = moe_routing(d);
      moe_combine_backward(r.out("dx", {rt.M, d.C}), r.out("dweights", {d.N, kMoeK}, Kind::acc), r.in("dy", {d.N, d.C}),
                           r.in("x", {rt.M, d.C}), r.in("weights", {d.N, kMoeK}, Kind::acc),
                           r.ints(rt.slot, {d.N, kMoeK}, DType::i32));
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"weights", "dweights"}};
    cases.push_back(c);
  }
  {  // grouped GEMM: 4 groups of rows, one empty; dweight accumulated, also without dinp
    OpCase c;
    c.name = "grouped_matmul";
    auto counts = [](const Dims& d) { return std::vector<int64_t>{d.N / 2, 0, d.N - d.N / 2 - d.N / 4, d.N / 4}; };
    const int64_t G = 4;
    c.forward = [=](OpRun& r, const Dims& d) {
      grouped_matmul_forward(r.out("y", {d.N, d.OC}), r.in("x", {d.N, d.C}), r.in("w", {G, d.OC, d.C}, Kind::act, 0.2),
                             counts(d));
    };
    c.reference = [=](OpRun& r, const Dims& d) {
      const V &x = r.values_of("x", d.N * d.C), &w = r.values_of("w", G * d.OC * d.C, 0.2);
      V y;
      int64_t b = 0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t n = counts(d)[size_t(g)];
        V xg(x.begin() + b * d.C, x.begin() + (b + n) * d.C),
            wg(w.begin() + g * d.OC * d.C, w.begin() + (g + 1) * d.OC * d.C), yg = ref_matmul(xg, wg, n, d.C, d.OC);
        y.insert(y.end(), yg.begin(), yg.end());
        b += n;
      }
      return Results{{"y", y}};
    };
    c.backward = [=](OpRun& r, const Dims& d) {
      Tensor x = r.in("x", {d.N, d.C}), w = r.in("w", {G, d.OC, d.C}, Kind::act, 0.2), dy = r.in("dy", {d.N, d.OC});
      grouped_matmul_backward(r.out("dx", {d.N, d.C}), r.acc("dw", {G, d.OC, d.C}), dy, x, w, counts(d));
      grouped_matmul_backward(Tensor(), r.acc("dw only", {G, d.OC, d.C}), dy, x, w, counts(d));
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx"}, {"w", "dw"}};
    cases.push_back(c);
  }

  add_moe_device_cases(cases);

  // Local attention: causal with grouped-query heads, full with more keys than queries, chunk offsets (rows
  // that see no key: out 0, lse -inf), document masks, and head dim 64 (the bf16 tensor-core kernel on CUDA).
  cases.push_back(
      attention_case("attention causal", [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, true, 0, 0, false}; }));
  cases.push_back(
      attention_case("attention full", [](const Dims& d) { return AttnGeom{d.T, d.S + 2, d.hd, false, 0, 0, false}; }));
  cases.push_back(attention_case("attention offsets", [](const Dims& d) {
    return AttnGeom{std::max<int64_t>(d.T / 2, 2), d.S, d.hd, true, 0, 1, false};
  }));
  cases.push_back(attention_case("attention doc_start causal",
                                 [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, true, 0, 0, true}; }));
  cases.push_back(attention_case("attention doc_start offsets", [](const Dims& d) {
    return AttnGeom{std::max<int64_t>(d.T / 2, 2), d.S, d.hd, true, d.S - d.T / 2, 0, true};
  }));
  cases.push_back(attention_case("attention doc_start full",
                                 [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, false, 0, 0, true}; }));
  cases.push_back(attention_case(
      "attention hd 64", [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd < 16 ? d.hd : 64, true, 0, 0, false}; }));
  // The same through attention.kernel auto: bf16 on CUDA through cuDNN where it loads (the emulated device's
  // stand-in interprets its graph): causal GQA, a ring block's offsets (queries after their keys), documents.
  const auto cudnn = AttentionKernel::automatic;
  cases.push_back(attention_case(
      "attention cudnn causal", [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, true, 0, 0, false}; }, cudnn));
  cases.push_back(attention_case(
      "attention cudnn offsets",
      [](const Dims& d) { return AttnGeom{std::max<int64_t>(d.T / 2, 2), d.S, d.hd, true, d.S - d.T / 2, 0, false}; },
      cudnn));
  cases.push_back(attention_case(
      "attention cudnn doc_start", [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, true, 0, 0, true}; }, cudnn));
  // Gemma's sliding window and soft-capped scores (the CPU kernel's; on CUDA the fp32 kernel's, bf16 on widened
  // copies): a window of a quarter of the sequence, then with chunk offsets, documents and the soft-cap at a scale
  // tanh bends.
  OpCase w = attention_case("attention window", [](const Dims& d) {
    return AttnGeom{d.T, d.S, d.hd, true, 0, 0, false, std::max<int64_t>(2, d.T / 4)};
  });
  cases.push_back(w);
  OpCase ws = attention_case("attention window softcap offsets doc_start", [](const Dims& d) {
    return AttnGeom{std::max<int64_t>(d.T / 2, 2), d.S, d.hd, true, d.S - d.T / 2, 0, true,
                    std::max<int64_t>(3, d.T / 3), 0.5};
  });
  cases.push_back(ws);
  OpCase sc = attention_case("attention softcap full",
                             [](const Dims& d) { return AttnGeom{d.T, d.S, d.hd, false, 0, 0, false, 0, 0.3}; });
  cases.push_back(sc);
  cases.push_back(fp8_cast_case("fp8_cast tensorwise e4m3", Fp8Format::e4m3, false));
  cases.push_back(fp8_cast_case("fp8_cast tensorwise e5m2", Fp8Format::e5m2, false));
  cases.push_back(fp8_cast_case("fp8_cast rowwise e4m3", Fp8Format::e4m3, true));
  cases.push_back(fp8_matmul_case("fp8_matmul e4m3 x e4m3", Fp8Format::e4m3, Fp8Format::e4m3, false));
  cases.push_back(fp8_matmul_case("fp8_matmul e5m2 x e4m3", Fp8Format::e5m2, Fp8Format::e4m3, false));
  cases.push_back(fp8_matmul_case("fp8_matmul rowwise", Fp8Format::e4m3, Fp8Format::e4m3, true));
  return cases;
}

}  // namespace mt::test
