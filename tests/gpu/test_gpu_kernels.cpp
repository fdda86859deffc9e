// Every CUDA kernel of the training step against the CPU backend on fresh
// random inputs, outputs poisoned with NaN before each run: fp32 within 1e-5
// relative (norm of the difference over the norm of the reference); a NaN never
// passes. Skips itself when no device is visible.
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "attention/local_attention.h"
#include "gpu_test.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

// Normal values not rounded to bf16: the f32 kernels must not round anything.
Tensor rnd32(const Shape& s, uint64_t seed, double scale = 1.0) { return rnd(s, seed, scale, /*bf16_exact=*/false); }
Tensor nan_like(const Tensor& t, Device d) {
  std::vector<double> v(size_t(t.numel()), std::nan(""));
  return from_values(v, t.shape(), t.dtype()).to(d);
}

}  // namespace

TEST_CASE("gpu kernels: matmul, RMSNorm, RoPE, SwiGLU, embedding, cross-entropy, AdamW, reductions vs CPU") {
  MT_REQUIRE_GPU();
  Device d = gpu();
  const int64_t N = 300, C = 96, OC = 200, V = 301;
  Tensor x = rnd32({N, C}, 1), w = rnd32({OC, C}, 2), dy = rnd32({N, OC}, 3);
  // matmul forward / backward (dweight accumulates onto a non-zero start).
  Tensor y = empty({N, OC}, DType::f32), yd = nan_like(y, d);
  matmul_forward(y, x, w);
  matmul_forward(yd, x.to(d), w.to(d));
  CHECK_F32(yd, y);
  Tensor dx = empty({N, C}, DType::f32), dw = rnd32({OC, C}, 4), dxd = nan_like(dx, d), dwd = dw.to(d);
  matmul_backward(dx, dw, dy, x, w);
  matmul_backward(dxd, dwd, dy.to(d), x.to(d), w.to(d));
  CHECK_F32(dxd, dx);
  CHECK_F32(dwd, dw);
  // RMSNorm
  Tensor g = rnd32({C}, 5), o = empty({N, C}, DType::f32), r = empty({N}, DType::f32);
  Tensor od = nan_like(o, d), rd = nan_like(r, d);
  rmsnorm_forward(o, r, x, g, 1e-5);
  rmsnorm_forward(od, rd, x.to(d), g.to(d), 1e-5);
  CHECK_F32(od, o);
  CHECK_F32(rd, r);
  Tensor dn = rnd32({N, C}, 6), dgw = rnd32({C}, 7), dgwd = dgw.to(d), dnx = empty({N, C}, DType::f32), dnxd = nan_like(dnx, d);
  rmsnorm_backward(dnx, dgw, dn, x, g, r);
  rmsnorm_backward(dnxd, dgwd, dn.to(d), x.to(d), g.to(d), r.to(d));
  CHECK_F32(dnxd, dnx);
  CHECK_F32(dgwd, dgw);
  // RoPE forward and backward
  const int64_t B = 3, T = 17, H = 4, hd = 16;
  Tensor pos = empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = 5 + t;
  Tensor cs = empty({T, hd}, DType::f32), sn = empty({T, hd}, DType::f32);
  rope_tables(cs, sn, pos, 10000);
  Tensor q = rnd32({B, T, H, hd}, 8), qo = empty(q.shape(), DType::f32), qod = nan_like(qo, d);
  rope_forward(qo, q, cs, sn);
  rope_forward(qod, q.to(d), cs.to(d), sn.to(d));
  CHECK_F32(qod, qo);
  rope_backward(qo, q, cs, sn);
  rope_backward(qod, q.to(d), cs.to(d), sn.to(d));
  CHECK_F32(qod, qo);
  // SwiGLU
  Tensor ga = rnd32({N, C}, 9), up = rnd32({N, C}, 10), sw = empty({N, C}, DType::f32), swd = nan_like(sw, d);
  swiglu_forward(sw, ga, up);
  swiglu_forward(swd, ga.to(d), up.to(d));
  CHECK_F32(swd, sw);
  Tensor dga = empty({N, C}, DType::f32), dup = empty({N, C}, DType::f32), dgad = nan_like(dga, d), dupd = nan_like(dup, d);
  swiglu_backward(dga, dup, dn, ga, up);
  swiglu_backward(dgad, dupd, dn.to(d), ga.to(d), up.to(d));
  CHECK_F32(dgad, dga);
  CHECK_F32(dupd, dup);
  // Embedding, with a shard of rows [50, 250)
  Tensor table = rnd32({200, C}, 11), tok = empty({N}, DType::i32);
  for (int64_t i = 0; i < N; ++i) tok.at<int32_t>(i) = int32_t((i * 97) % V);
  Tensor e = empty({N, C}, DType::f32), ed = nan_like(e, d);
  embedding_forward(e, tok, table, 50, V);
  embedding_forward(ed, tok.to(d), table.to(d), 50, V);
  CHECK_F32(ed, e);
  Tensor dt = rnd32({200, C}, 12), dtd = dt.to(d);
  embedding_backward(dt, dn, tok, 50);
  embedding_backward(dtd, dn.to(d), tok.to(d), 50);
  CHECK_F32(dtd, dt);
  // Cross-entropy, with ignored targets, gradient in place of the logits
  Tensor logits = rnd32({N, V}, 13, 3.0), tg = empty({N}, DType::i32);
  for (int64_t i = 0; i < N; ++i) tg.at<int32_t>(i) = i % 7 == 0 ? -1 : int32_t((i * 31) % V);
  Tensor ls = empty({N}, DType::f32), lsd = nan_like(ls, d), lg = logits.clone(), lgd = logits.to(d);
  cross_entropy_forward_backward(ls, lg, lg, tg, 0.01);
  cross_entropy_forward_backward(lsd, lgd, lgd, tg.to(d), 0.01);
  CHECK_F32(lsd, ls);
  CHECK_F32(lgd, lg);
  // add, scale, sum, sum of squares
  Tensor s = empty({N, C}, DType::f32), sd = nan_like(s, d);
  add(s, ga, up);
  add(sd, ga.to(d), up.to(d));
  CHECK_F32(sd, s);
  scale_(s, 0.3);
  scale_(sd, 0.3);
  CHECK_F32(sd, s);
  Tensor big = rnd32({100003}, 14);
  CHECK(sum(big.to(d)) == doctest::Approx(sum(big)).epsilon(1e-9));
  CHECK(sum_squares(big.to(d)) == doctest::Approx(sum_squares(big)).epsilon(1e-9));
  // AdamW, three steps
  Tensor p = rnd32({N, C}, 15), pd = p.to(d), m = zeros({N, C}, DType::f32), v = zeros({N, C}, DType::f32);
  Tensor md = m.to(d), vd = v.to(d);
  for (int step = 1; step <= 3; ++step) {
    Tensor gr = rnd32({N, C}, 100 + uint64_t(step));
    adamw_step(p, gr, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step);
    adamw_step(pd, gr.to(d), md, vd, 1e-2, 0.9, 0.95, 1e-8, 0.1, step);
  }
  CHECK_F32(pd, p);
  CHECK_F32(md, m);
  CHECK_F32(vd, v);
}

TEST_CASE("gpu kernels: attention forward and backward vs CPU (causal, full, GQA, offsets)") {
  MT_REQUIRE_GPU();
  Device d = gpu();
  struct Case {
    int64_t T, S, H, KV, hd;
    AttentionOptions o;
  };
  for (const Case& c : std::vector<Case>{{70, 70, 4, 2, 32, {true, 0, 0, 0, {}}},
                                         {33, 33, 4, 4, 64, {false, 0, 0, 0, {}}},
                                         {130, 130, 8, 1, 128, {true, 0, 0, 0, {}}},
                                         {20, 70, 2, 2, 16, {true, 0, 0, 10, {}}},
                                         {5, 70, 4, 2, 16, {true, 0, 64, 0, {}}}}) {
    CAPTURE(c.T);
    CAPTURE(c.hd);
    Tensor q = rnd32({2, c.T, c.H, c.hd}, 1), k = rnd32({2, c.S, c.KV, c.hd}, 2), v = rnd32({2, c.S, c.KV, c.hd}, 3);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({2, c.H, c.T}, DType::f32);
    Tensor outd = nan_like(out, d), lsed = nan_like(lse, d);
    attention_forward(out, lse, q, k, v, c.o);
    attention_forward(outd, lsed, q.to(d), k.to(d), v.to(d), c.o);
    CHECK_F32(outd, out);
    CHECK_F32(lsed, lse);
    Tensor dout = rnd32(q.shape(), 4);
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(k.shape(), DType::f32);
    Tensor dqd = nan_like(dq, d), dkd = nan_like(dk, d), dvd = nan_like(dv, d);
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, c.o);
    attention_backward(dqd, dkd, dvd, dout.to(d), q.to(d), k.to(d), v.to(d), outd, lsed, c.o);
    CHECK_F32(dqd, dq);
    CHECK_F32(dkd, dk);
    CHECK_F32(dvd, dv);
  }
}

TEST_CASE("gpu kernels: f32 attention with document masks vs CPU (causal, full, GQA, offsets, rows that see nothing)") {
  MT_REQUIRE_GPU();
  Device d = gpu();
  struct Case {
    int64_t T, S, H, KV, hd;
    bool causal;
    int64_t q_pos0, k_pos0;
    std::vector<std::vector<int64_t>> starts;  // per batch row: where documents start (global positions)
  };
  for (const Case& c : std::vector<Case>{{70, 70, 4, 2, 32, true, 0, 0, {{10, 40, 69}, {64}}},
                                         {33, 50, 4, 4, 64, false, 0, 0, {{5, 20}, {32}}},
                                         {130, 130, 8, 1, 128, true, 0, 0, {{63, 64, 65, 128}, {1}}},
                                         {20, 70, 2, 2, 16, true, 100, 30, {{40, 105, 110}, {0}}},
                                         {40, 70, 4, 2, 16, true, 70, 0, {{30, 75}, {69, 71}}}}) {
    CAPTURE(c.T);
    CAPTURE(c.hd);
    CAPTURE(c.causal);
    const int64_t B = 2;
    // doc_start (B, T): the largest start at or before the query's position, 0 when none is.
    Tensor doc = empty({B, c.T}, DType::i64);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < c.T; ++t) {
        int64_t x = 0;
        for (int64_t s : c.starts[size_t(b)])
          if (s <= c.q_pos0 + t) x = std::max(x, s);
        doc.at<int64_t>(b * c.T + t) = x;
      }
    AttentionOptions o{c.causal, 0, c.q_pos0, c.k_pos0, doc}, od = o;
    od.doc_start = doc.to(d);
    Tensor q = rnd32({B, c.T, c.H, c.hd}, 1), k = rnd32({B, c.S, c.KV, c.hd}, 2), v = rnd32({B, c.S, c.KV, c.hd}, 3);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({B, c.H, c.T}, DType::f32);
    Tensor outd = nan_like(out, d), lsed = nan_like(lse, d);
    attention_forward(out, lse, q, k, v, o);
    attention_forward(outd, lsed, q.to(d), k.to(d), v.to(d), od);
    CHECK_F32(outd, out);
    CHECK_F32(lsed, lse);  // -inf (rows that see no key) must match exactly
    Tensor dout = rnd32(q.shape(), 4);
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(k.shape(), DType::f32);
    Tensor dqd = nan_like(dq, d), dkd = nan_like(dk, d), dvd = nan_like(dv, d);
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
    attention_backward(dqd, dkd, dvd, dout.to(d), q.to(d), k.to(d), v.to(d), outd, lsed, od);
    CHECK_F32(dqd, dq);
    CHECK_F32(dkd, dk);
    CHECK_F32(dvd, dv);
    // Accumulate onto a non-zero start (ring attention's later query chunks).
    Tensor dk0 = rnd32(k.shape(), 5), dv0 = rnd32(k.shape(), 6), dk0d = dk0.to(d), dv0d = dv0.to(d);
    attention_backward(dq, dk0, dv0, dout, q, k, v, out, lse, o, true);
    attention_backward(dqd, dk0d, dv0d, dout.to(d), q.to(d), k.to(d), v.to(d), outd, lsed, od, true);
    CHECK_F32(dk0d, dk0);
    CHECK_F32(dv0d, dv0);
  }
}
