// The mixed-precision policy on the CPU: every op on bf16 tensors against the
// same op in f32 on the same (bf16-representable) inputs, whole-output relative
// error (norm of the difference over the norm of the f32 result) within 1e-2,
// as the CUDA bf16 kernels are held to; statistics and weight gradients stay
// f32; convert rounds to nearest even; AdamW updates the f32 master and
// rewrites the bf16 copy; the dtype rule's errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attention/local_attention.h"
#include "check_error.h"
#include "test_util.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

// Normal values rounded to bf16, held in an f32 tensor (so both paths see the same inputs).
Tensor rnd32(const Shape& s, uint64_t seed, double scale = 1.0) {
  return test::randn(s, seed, DType::f32, scale, true);
}
Tensor as(const Tensor& t, DType d) {
  Tensor r = empty(t.shape(), d);
  convert(r, t);
  return r;
}
Tensor nan_tensor(const Shape& s, DType d) { return test::poisoned(s, d); }
double rel(const Tensor& got, const Tensor& want) { return test::rel_err(got, want); }
constexpr double kTol = 1e-2;
using B = DType;

}  // namespace

TEST_CASE("mixed precision: convert rounds to nearest even, keeps NaN and infinities") {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  std::vector<double> v = {
      1.0, 1.0 + std::ldexp(1.0, -8), 1.0 + 3 * std::ldexp(1.0, -8), -2.5, INFINITY, -INFINITY, std::nan(""), 1e-40};
  Tensor f = from_values(v, {int64_t(v.size())}, DType::f32);
  Tensor b = as(f, DType::bf16);
  auto r = to_f64(b);
  CHECK(r[0] == 1.0);
  CHECK(r[1] == 1.0);
  CHECK(r[2] == 1.0 + std::ldexp(1.0, -6));
  CHECK(r[3] == -2.5);
  CHECK(r[4] == INFINITY);
  CHECK(r[5] == -INFINITY);
  CHECK(std::isnan(r[6]));
  CHECK(std::abs(r[7] - 1e-40) < 1e-41);  // subnormals survive
  // Back to f32 is exact, and f64 <-> f32 goes through once.
  Tensor back = as(b, DType::f32);
  CHECK(to_f64(back)[2] == r[2]);
  CHECK_ERROR_CONTAINS(convert(empty({3}, DType::f32), empty({4}, DType::bf16)),
                       "[kernels] convert: dst (3,) and src (4,) differ in size");
}

TEST_CASE("mixed precision: matmul forward and backward in bf16 with an f32 weight gradient") {
  const int64_t N = 37, C = 48, OC = 29;
  Tensor x = rnd32({N, C}, 1), w = rnd32({OC, C}, 2, 0.2), dy = rnd32({N, OC}, 3);
  Tensor y32 = empty({N, OC}, B::f32), yb = nan_tensor({N, OC}, B::bf16);
  matmul_forward(y32, x, w);
  matmul_forward(yb, as(x, B::bf16), as(w, B::bf16));
  CHECK(yb.dtype() == B::bf16);
  CHECK(rel(yb, y32) < kTol);
  CHECK(rel(yb, y32) > 0);  // really rounded: the outputs are bf16
  // accumulate adds to what is there
  Tensor yb2 = as(y32, B::bf16);
  matmul_forward(yb2, as(x, B::bf16), as(w, B::bf16), true);
  Tensor twice = y32.clone();
  scale_(twice, 2.0);
  CHECK(rel(yb2, twice) < kTol);

  // Backward: dinp bf16, dweight f32 accumulating (starts from a non-zero value).
  Tensor dw0 = rnd32({OC, C}, 4, 0.1);
  Tensor dx32 = empty({N, C}, B::f32), dw32 = dw0.clone();
  matmul_backward(dx32, dw32, dy, x, w);
  Tensor dxb = nan_tensor({N, C}, B::bf16), dwb = dw0.clone();
  matmul_backward(dxb, dwb, as(dy, B::bf16), as(x, B::bf16), as(w, B::bf16));
  CHECK(rel(dxb, dx32) < kTol);
  CHECK(rel(dwb, dw32) < 1e-5);  // f32 accumulation of bf16-exact inputs: only the f32 rounding differs
  {                              // dinp accumulated (beta = 1): the bf16 sum rounded once
    Tensor base = rnd32({N, C}, 90), want = empty({N, C}, B::f32);
    matmul_backward(want, Tensor(), dy, Tensor(), w);
    add_(want, base);
    Tensor got = as(base, B::bf16);
    matmul_backward(got, Tensor(), as(dy, B::bf16), Tensor(), as(w, B::bf16), true);
    CHECK(rel(got, want) < kTol);
  }
  CHECK_ERROR_CONTAINS(
      matmul_backward(Tensor(), empty({OC, C}, B::bf16), as(dy, B::bf16), as(x, B::bf16), as(w, B::bf16)),
      "[kernels] matmul_backward: dweight is bf16; with bf16 activations it must be f32");
}

TEST_CASE("mixed precision: RMSNorm keeps rstd and dweight in f32") {
  const int64_t N = 33, C = 40;
  Tensor x = rnd32({N, C}, 5), w = rnd32({C}, 6, 0.5), dy = rnd32({N, C}, 7);
  Tensor y32 = empty({N, C}, B::f32), r32 = empty({N}, B::f32);
  rmsnorm_forward(y32, r32, x, w, 1e-5);
  Tensor yb = nan_tensor({N, C}, B::bf16), rb = nan_tensor({N}, B::f32);
  rmsnorm_forward(yb, rb, as(x, B::bf16), as(w, B::bf16), 1e-5);
  CHECK(rel(yb, y32) < kTol);
  CHECK(rel(rb, r32) < 1e-6);
  Tensor dx32 = empty({N, C}, B::f32), dw32 = zeros({C}, B::f32);
  rmsnorm_backward(dx32, dw32, dy, x, w, r32);
  Tensor dxb = nan_tensor({N, C}, B::bf16), dwb = zeros({C}, B::f32);
  rmsnorm_backward(dxb, dwb, as(dy, B::bf16), as(x, B::bf16), as(w, B::bf16), rb);
  CHECK(rel(dxb, dx32) < kTol);
  CHECK(rel(dwb, dw32) < 1e-5);
  CHECK_ERROR_CONTAINS(
      rmsnorm_forward(empty({N, C}, B::bf16), empty({N}, B::bf16), as(x, B::bf16), as(w, B::bf16), 1e-5),
      "[kernels] rmsnorm_forward: rstd is bf16; with bf16 activations it must be f32");
}

TEST_CASE("mixed precision: the residual add fused into RMSNorm, in bf16") {
  const int64_t N = 33, C = 40;
  Tensor a = rnd32({N, C}, 15), b = rnd32({N, C}, 16), w = rnd32({C}, 17, 0.5), dy = rnd32({N, C}, 18),
         dres = rnd32({N, C}, 19);
  // f32 reference: add, norm; backward then add.
  Tensor s32 = empty({N, C}, B::f32), y32 = empty({N, C}, B::f32), r32 = empty({N}, B::f32);
  add(s32, a, b);
  rmsnorm_forward(y32, r32, s32, w, 1e-5);
  Tensor dx32 = empty({N, C}, B::f32), dw32 = zeros({C}, B::f32);
  rmsnorm_backward(dx32, dw32, dy, s32, w, r32);
  add_(dx32, dres);
  // bf16 fused: the sum rounded as add() rounds it (the same bits as the unfused bf16 add).
  Tensor ab = as(a, B::bf16), sb_unfused = empty({N, C}, B::bf16);
  add(sb_unfused, ab, as(b, B::bf16));
  Tensor yb = nan_tensor({N, C}, B::bf16), rb = nan_tensor({N}, B::f32);
  add_rmsnorm_forward(ab, yb, rb, ab, as(b, B::bf16), as(w, B::bf16), 1e-5);
  CHECK(to_f64(ab) == to_f64(sb_unfused));
  CHECK(rel(ab, s32) < kTol);
  CHECK(rel(yb, y32) < kTol);
  CHECK(rel(rb, r32) < 1e-3);
  Tensor dxb = nan_tensor({N, C}, B::bf16), dwb = zeros({C}, B::f32);
  rmsnorm_backward(dxb, dwb, as(dy, B::bf16), ab, as(w, B::bf16), rb, as(dres, B::bf16));
  CHECK(rel(dxb, dx32) < kTol);
  CHECK(rel(dwb, dw32) < kTol);
}

TEST_CASE("mixed precision: RoPE, SwiGLU, add, scale, sums in bf16") {
  const int64_t Bt = 2, T = 9, H = 3, hd = 8;
  Tensor x = rnd32({Bt, T, H, hd}, 8);
  Tensor pos = empty({T}, B::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = t + 3;
  Tensor c32 = empty({T, hd}, B::f32), s32 = empty({T, hd}, B::f32), cb = empty({T, hd}, B::bf16),
         sb = empty({T, hd}, B::bf16);
  rope_tables(c32, s32, pos, 10000.0);
  rope_tables(cb, sb, pos, 10000.0);
  CHECK(equal(cb, as(c32, B::bf16)));  // computed in f32, then rounded (Hugging Face's order)
  for (bool bwd : {false, true}) {
    Tensor o32 = empty(x.shape(), B::f32), ob = nan_tensor(x.shape(), B::bf16);
    if (bwd) {
      rope_backward(o32, x, as(cb, B::f32), as(sb, B::f32));
      rope_backward(ob, as(x, B::bf16), cb, sb);
    } else {
      rope_forward(o32, x, as(cb, B::f32), as(sb, B::f32));
      rope_forward(ob, as(x, B::bf16), cb, sb);
    }
    CHECK(rel(ob, o32) < kTol);
  }
  const int64_t n = 301;
  Tensor g = rnd32({n}, 9, 2.0), u = rnd32({n}, 10), d = rnd32({n}, 11);
  Tensor h32 = empty({n}, B::f32), hb = nan_tensor({n}, B::bf16);
  swiglu_forward(h32, g, u);
  swiglu_forward(hb, as(g, B::bf16), as(u, B::bf16));
  CHECK(rel(hb, h32) < kTol);
  Tensor dg32 = empty({n}, B::f32), du32 = empty({n}, B::f32), dgb = nan_tensor({n}, B::bf16),
         dub = nan_tensor({n}, B::bf16);
  swiglu_backward(dg32, du32, d, g, u);
  swiglu_backward(dgb, dub, as(d, B::bf16), as(g, B::bf16), as(u, B::bf16));
  CHECK(rel(dgb, dg32) < kTol);
  CHECK(rel(dub, du32) < kTol);
  Tensor a32 = empty({n}, B::f32), ab = nan_tensor({n}, B::bf16);
  add(a32, g, u);
  add(ab, as(g, B::bf16), as(u, B::bf16));
  CHECK(rel(ab, a32) < kTol);
  Tensor sc = as(g, B::bf16);
  scale_(sc, 0.3);
  Tensor sc32 = g.clone();
  scale_(sc32, 0.3);
  CHECK(rel(sc, sc32) < kTol);
  CHECK(std::abs(sum(as(g, B::bf16)) - sum(g)) < 1e-9);  // bf16-exact inputs: the same sum
  CHECK(std::abs(sum_squares(as(g, B::bf16)) - sum_squares(g)) < 1e-9);
}

TEST_CASE("mixed precision: embedding gathers exactly and scatters into an f32 table gradient") {
  const int64_t V = 11, C = 6;
  Tensor table = rnd32({V, C}, 12);
  std::vector<double> tk = {3, 0, 3, 10, 7, 3};
  Tensor tokens = from_values(tk, {6}, B::i32);
  Tensor ob = nan_tensor({6, C}, B::bf16), o32 = empty({6, C}, B::f32);
  embedding_forward(ob, tokens, as(table, B::bf16));
  embedding_forward(o32, tokens, table);
  CHECK(equal(as(ob, B::f32), o32));  // a gather of bf16-exact values is exact
  Tensor dy = rnd32({6, C}, 13);
  Tensor d32 = zeros({V, C}, B::f32), db = zeros({V, C}, B::f32);
  embedding_backward(d32, dy, tokens);
  embedding_backward(db, as(dy, B::bf16), tokens);
  CHECK(equal(db, d32));
  CHECK_ERROR_CONTAINS(embedding_backward(zeros({V, C}, B::bf16), as(dy, B::bf16), tokens),
                       "[kernels] embedding_backward: dtable is bf16; with bf16 activations it must be f32");
}

TEST_CASE("mixed precision: cross-entropy on bf16 logits gives f32 losses and bf16 gradients") {
  const int64_t N = 17, V = 50;
  Tensor logits = rnd32({N, V}, 14, 3.0);
  std::vector<double> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = double((i * 7) % V);
  tg[4] = -1;  // ignored
  Tensor targets = from_values(tg, {N}, B::i32);
  Tensor l32 = empty({N}, B::f32), d32 = empty({N, V}, B::f32);
  cross_entropy_forward_backward(l32, d32, logits, targets, 0.1);
  Tensor lb = nan_tensor({N}, B::f32), lg = as(logits, B::bf16);
  cross_entropy_forward_backward(lb, lg, lg, targets, 0.1);  // gradient over the logits' buffer
  CHECK(rel(lb, l32) < 1e-6);                                // the softmax and loss are f32 on the same values
  CHECK(rel(lg, d32) < kTol);
  CHECK(to_f64(lb)[4] == 0.0);
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(empty({N}, B::bf16), Tensor(), as(logits, B::bf16), targets, 1.0),
                       "[kernels] cross_entropy: losses is bf16; with bf16 activations it must be f32");

  // Vocab-parallel pieces on two shards of bf16 logits add up to the full f32 loss.
  const int64_t half = V / 2;
  std::vector<Tensor> parts;
  Tensor row_max = empty({N}, B::f64), mx[2];
  for (int s = 0; s < 2; ++s) {
    // columns [s*half, (s+1)*half) as a contiguous (N, half) tensor
    Tensor cols = empty({N, half}, B::f32);
    auto all = to_f64(logits);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < half; ++j) cols.at<float>(i * half + j) = float(all[size_t(i * V + s * half + j)]);
    parts.push_back(as(cols, B::bf16));
    mx[s] = empty({N}, B::f64);
    vocab_shard_max(mx[s], parts.back());
  }
  for (int64_t i = 0; i < N; ++i) row_max.at<double>(i) = std::max(mx[0].at<double>(i), mx[1].at<double>(i));
  Tensor se = zeros({N}, B::f64), tl = zeros({N}, B::f64);
  for (int s = 0; s < 2; ++s) {
    Tensor se_s = empty({N}, B::f64), tl_s = empty({N}, B::f64);
    vocab_shard_sumexp(se_s, tl_s, parts[size_t(s)], targets, row_max, s * half);
    for (int64_t i = 0; i < N; ++i) se.at<double>(i) += se_s.at<double>(i), tl.at<double>(i) += tl_s.at<double>(i);
  }
  Tensor lv = nan_tensor({N}, B::f32);
  vocab_shard_loss(lv, Tensor(), parts[0], targets, row_max, se, tl, 0, 0.1);
  CHECK(rel(lv, l32) < 1e-6);
}

TEST_CASE("mixed precision: attention in bf16 returns an f32 log-sum-exp") {
  const int64_t Bt = 2, T = 70, H = 4, KV = 2, hd = 16;
  Tensor q = rnd32({Bt, T, H, hd}, 15), k = rnd32({Bt, T, KV, hd}, 16), v = rnd32({Bt, T, KV, hd}, 17),
         dout = rnd32({Bt, T, H, hd}, 18);
  for (bool causal : {true, false}) {
    AttentionOptions o;
    o.causal = causal;
    Tensor out32 = empty(q.shape(), B::f32), lse32 = empty({Bt, H, T}, B::f32);
    attention_forward(out32, lse32, q, k, v, o);
    Tensor outb = nan_tensor(q.shape(), B::bf16), lseb = nan_tensor({Bt, H, T}, B::f32);
    attention_forward(outb, lseb, as(q, B::bf16), as(k, B::bf16), as(v, B::bf16), o);
    CHECK(rel(outb, out32) < kTol);
    CHECK(rel(lseb, lse32) < 1e-6);
    Tensor dq32 = empty(q.shape(), B::f32), dk32 = empty(k.shape(), B::f32), dv32 = empty(k.shape(), B::f32);
    attention_backward(dq32, dk32, dv32, dout, q, k, v, out32, lse32, o);
    Tensor dqb = nan_tensor(q.shape(), B::bf16), dkb = nan_tensor(k.shape(), B::bf16),
           dvb = nan_tensor(k.shape(), B::bf16);
    attention_backward(dqb, dkb, dvb, as(dout, B::bf16), as(q, B::bf16), as(k, B::bf16), as(v, B::bf16), outb, lseb, o);
    CHECK(rel(dqb, dq32) < kTol);
    CHECK(rel(dkb, dk32) < kTol);
    CHECK(rel(dvb, dv32) < kTol);
  }
  CHECK_ERROR_CONTAINS(attention_forward(empty(q.shape(), B::bf16), empty({Bt, H, T}, B::bf16), as(q, B::bf16),
                                         as(k, B::bf16), as(v, B::bf16)),
                       "[attention] attention_forward: lse is bf16; with bf16 q it must be f32");
}

TEST_CASE("mixed precision: AdamW updates the f32 master and rewrites the bf16 copy") {
  const int64_t n = 1000;
  Tensor p = rnd32({n}, 19), g = rnd32({n}, 20, 0.01), m = zeros({n}, B::f32), v = zeros({n}, B::f32);
  Tensor p_ref = p.clone(), m_ref = zeros({n}, B::f32), v_ref = zeros({n}, B::f32);
  Tensor low = nan_tensor({n}, B::bf16);
  for (int64_t step = 1; step <= 3; ++step) {
    adamw_step(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, low);
    adamw_step(p_ref, g, m_ref, v_ref, 1e-2, 0.9, 0.95, 1e-8, 0.1, step);
  }
  CHECK(equal(p, p_ref));             // the master follows the plain f32 update exactly
  CHECK(equal(low, as(p, B::bf16)));  // and the compute copy is its rounding
  CHECK_ERROR_CONTAINS(adamw_step(as(p, B::bf16), as(g, B::bf16), m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1),
                       "[kernels] adamw_step: the parameter updated is the f32 master copy, got bf16");
}
