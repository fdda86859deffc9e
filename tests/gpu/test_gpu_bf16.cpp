// The bf16 CUDA kernels against the CPU backend in f32 on the same
// bf16-representable inputs, outputs poisoned with NaN: within 1e-2 relative
// (norm of the difference over the norm of the reference); statistics and
// weight gradients stay f32. Also the CUDA vocab-parallel pieces in f32 and
// the determinism of the kernels that reduce (same bits on a rerun).
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "gpu_test.h"
#include "runtime/kernels/ops.h"

using namespace mt;

TEST_CASE("gpu bf16: matmul, RMSNorm, RoPE, SwiGLU, embedding, cross-entropy, add, convert, AdamW vs CPU f32") {
  MT_REQUIRE_GPU();
  const int64_t N = 300, C = 96, OC = 200, V = 301;
  Tensor x = rnd({N, C}, 1), w = rnd({OC, C}, 2, 0.2), dy = rnd({N, OC}, 3);
  Tensor y = empty({N, OC}, DType::f32), yd = nan_dev({N, OC}, DType::bf16);
  matmul_forward(y, x, w);
  matmul_forward(yd, bf(x), bf(w));
  CHECK_BF16(yd, y);
  Tensor dx = empty({N, C}, DType::f32), dw = rnd({OC, C}, 4), dxd = nan_dev({N, C}, DType::bf16), dwd = dw.to(gpu());
  matmul_backward(dx, dw, dy, x, w);
  matmul_backward(dxd, dwd, bf(dy), bf(x), bf(w));
  CHECK_BF16(dxd, dx);
  CHECK_F32(dwd, dw);  // fp32 accumulation into the fp32 gradient
  {  // dinp accumulated by the GEMM (beta = 1), as q/k/v and gate/up sum their input gradients
    Tensor base = rnd({N, C}, 42), want = empty({N, C}, DType::f32);
    matmul_backward(want, Tensor(), dy, Tensor(), w);
    add_(want, base);
    Tensor got = bf(base);
    matmul_backward(got, Tensor(), bf(dy), Tensor(), bf(w), true);
    CHECK_BF16(got, want);
  }

  Tensor g = rnd({C}, 5), o = empty({N, C}, DType::f32), r = empty({N}, DType::f32);
  Tensor od = nan_dev({N, C}, DType::bf16), rd = nan_dev({N}, DType::f32);
  rmsnorm_forward(o, r, x, g, 1e-5);
  rmsnorm_forward(od, rd, bf(x), bf(g), 1e-5);
  CHECK_BF16(od, o);
  CHECK_F32(rd, r);
  Tensor dn = rnd({N, C}, 6), dgw = rnd({C}, 7), dgwd = dgw.to(gpu()), dnx = empty({N, C}, DType::f32);
  Tensor dnxd = nan_dev({N, C}, DType::bf16);
  rmsnorm_backward(dnx, dgw, dn, x, g, r);
  rmsnorm_backward(dnxd, dgwd, bf(dn), bf(x), bf(g), rd);
  CHECK_BF16(dnxd, dnx);
  CHECK_F32(dgwd, dgw);
  {  // the residual add fused into the norm, both ways
    Tensor res = rnd({N, C}, 40), dres = rnd({N, C}, 41);
    Tensor s = empty({N, C}, DType::f32), o2 = empty({N, C}, DType::f32), r2 = empty({N}, DType::f32);
    add(s, x, res);
    rmsnorm_forward(o2, r2, s, g, 1e-5);
    Tensor sd = bf(x), o2d = nan_dev({N, C}, DType::bf16), r2d = nan_dev({N}, DType::f32);
    add_rmsnorm_forward(sd, o2d, r2d, sd, bf(res), bf(g), 1e-5);  // the sum over the first operand, in place
    CHECK_BF16(sd, s);
    CHECK_BF16(o2d, o2);
    CHECK(rel(r2d, r2) < 1e-3);
    Tensor dx2 = empty({N, C}, DType::f32), dw2 = zeros({C}, DType::f32);
    rmsnorm_backward(dx2, dw2, dn, s, g, r2);
    add_(dx2, dres);
    Tensor dx2d = bf(dres), dw2d = zeros({C}, DType::f32, gpu());
    rmsnorm_backward(dx2d, dw2d, bf(dn), sd, bf(g), r2d, dx2d);  // dresidual aliasing dinp
    CHECK_BF16(dx2d, dx2);
    CHECK(rel(dw2d, dw2) < 1e-2);
  }

  const int64_t B = 3, T = 17, H = 4, hd = 16;
  Tensor pos = empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = 5 + t;
  Tensor cs = empty({T, hd}, DType::bf16), sn = empty({T, hd}, DType::bf16);
  rope_tables(cs, sn, pos, 10000);
  Tensor cs32 = empty({T, hd}, DType::f32), sn32 = empty({T, hd}, DType::f32);
  convert(cs32, cs);
  convert(sn32, sn);
  Tensor q = rnd({B, T, H, hd}, 8), qo = empty(q.shape(), DType::f32), qod = nan_dev(q.shape(), DType::bf16);
  rope_forward(qo, q, cs32, sn32);
  rope_forward(qod, bf(q), cs.to(gpu()), sn.to(gpu()));
  CHECK_BF16(qod, qo);
  rope_backward(qo, q, cs32, sn32);
  rope_backward(qod, bf(q), cs.to(gpu()), sn.to(gpu()));
  CHECK_BF16(qod, qo);

  Tensor ga = rnd({N, C}, 9, 2.0), up = rnd({N, C}, 10), sw = empty({N, C}, DType::f32);
  Tensor swd = nan_dev({N, C}, DType::bf16);
  swiglu_forward(sw, ga, up);
  swiglu_forward(swd, bf(ga), bf(up));
  CHECK_BF16(swd, sw);
  Tensor dga = empty({N, C}, DType::f32), dup = empty({N, C}, DType::f32);
  Tensor dgad = nan_dev({N, C}, DType::bf16), dupd = nan_dev({N, C}, DType::bf16);
  swiglu_backward(dga, dup, dn, ga, up);
  swiglu_backward(dgad, dupd, bf(dn), bf(ga), bf(up));
  CHECK_BF16(dgad, dga);
  CHECK_BF16(dupd, dup);

  // Embedding on a shard of rows [50, 250); the backward sorts positions by token (deterministic).
  Tensor table = rnd({200, C}, 11), tok = empty({N}, DType::i32);
  for (int64_t i = 0; i < N; ++i) tok.at<int32_t>(i) = int32_t((i * 97) % V);
  Tensor e = empty({N, C}, DType::f32), ed = nan_dev({N, C}, DType::bf16);
  embedding_forward(e, tok, table, 50, V);
  embedding_forward(ed, tok.to(gpu()), bf(table), 50, V);
  CHECK(rel(ed, e) == 0.0);  // a gather of bf16-exact values
  Tensor dt = rnd({200, C}, 12), dtd = dt.to(gpu()), dtd2 = dt.to(gpu());
  embedding_backward(dt, dn, tok, 50);
  embedding_backward(dtd, bf(dn), tok.to(gpu()), 50);
  embedding_backward(dtd2, bf(dn), tok.to(gpu()), 50);
  CHECK_F32(dtd, dt);
  CHECK(equal(dtd.to(Device::cpu()), dtd2.to(Device::cpu())));  // same bits on a rerun

  // Cross-entropy on bf16 logits: f32 losses, bf16 gradient over the logits' buffer.
  Tensor logits = rnd({N, V}, 13, 3.0), tg = empty({N}, DType::i32);
  for (int64_t i = 0; i < N; ++i) tg.at<int32_t>(i) = i % 7 == 0 ? -1 : int32_t((i * 31) % V);
  Tensor ls = empty({N}, DType::f32), lg = logits.clone();
  cross_entropy_forward_backward(ls, lg, lg, tg, 0.01);
  Tensor lsd = nan_dev({N}, DType::f32), lgd = bf(logits);
  cross_entropy_forward_backward(lsd, lgd, lgd, tg.to(gpu()), 0.01);
  CHECK_F32(lsd, ls);
  CHECK_BF16(lgd, lg);

  Tensor s = empty({N, C}, DType::f32), sd = nan_dev({N, C}, DType::bf16);
  add(s, ga, up);
  add(sd, bf(ga), bf(up));
  CHECK_BF16(sd, s);
  CHECK(sum(bf(ga)) == doctest::Approx(sum(ga)).epsilon(1e-9));
  CHECK(sum_squares(bf(ga)) == doctest::Approx(sum_squares(ga)).epsilon(1e-9));
  // The gradient norm's batched form: the same bits as one call per tensor.
  std::vector<Tensor> many = {ga.to(gpu()), bf(up), rnd({100003}, 17).to(gpu()), empty({0}, DType::f32, gpu())};
  std::vector<double> each = sum_squares_each(many);
  for (size_t i = 0; i < many.size(); ++i) CHECK(each[i] == sum_squares(many[i]));

  // convert on the device rounds like the host (nearest even).
  Tensor f = rnd({1000}, 16, 1.0);
  std::vector<double> fine(1000);
  for (size_t i = 0; i < fine.size(); ++i) fine[i] = to_f64(f)[i] * (1.0 + 1e-3 * double(i % 7));
  Tensor f32 = from_values(fine, {1000}, DType::f32), host_b = empty({1000}, DType::bf16), dev_b = nan_dev({1000}, DType::bf16);
  convert(host_b, f32);
  convert(dev_b, f32.to(gpu()));
  CHECK(equal(dev_b.to(Device::cpu()), host_b));

  // AdamW on the f32 master, writing the bf16 copy in the same pass.
  Tensor p = rnd({N, C}, 15), pd = p.to(gpu()), m = zeros({N, C}, DType::f32), v = zeros({N, C}, DType::f32);
  Tensor md = m.to(gpu()), vd = v.to(gpu()), lowd = nan_dev({N, C}, DType::bf16);
  for (int step = 1; step <= 3; ++step) {
    Tensor gr = rnd({N, C}, 100 + uint64_t(step));
    adamw_step(p, gr, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step);
    adamw_step(pd, gr.to(gpu()), md, vd, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, lowd);
  }
  CHECK_F32(pd, p);
  Tensor low_want = empty({N, C}, DType::bf16);
  convert(low_want, pd.to(Device::cpu()));
  CHECK(equal(lowd.to(Device::cpu()), low_want));
}

TEST_CASE("gpu: vocab-parallel cross-entropy pieces on the device vs CPU (f32 and bf16)") {
  MT_REQUIRE_GPU();
  const int64_t N = 65, V = 77, begin = 40;
  Tensor logits = rnd({N, V}, 21, 3.0), tg = empty({N}, DType::i32);
  for (int64_t i = 0; i < N; ++i) tg.at<int32_t>(i) = i % 9 == 0 ? -1 : int32_t((i * 13) % 150);
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Tensor mx = empty({N}, DType::f64), se = empty({N}, DType::f64), tl = empty({N}, DType::f64);
    vocab_shard_max(mx, logits);
    vocab_shard_sumexp(se, tl, logits, tg, mx, begin);
    Tensor ls = empty({N}, DType::f32), dl = empty({N, V}, DType::f32);
    vocab_shard_loss(ls, dl, logits, tg, mx, se, tl, begin, 0.5);
    Tensor ld = dt == DType::bf16 ? bf(logits) : logits.to(gpu()), tgd = tg.to(gpu());
    Tensor mxd = nan_dev({N}, DType::f64), sed = nan_dev({N}, DType::f64), tld = nan_dev({N}, DType::f64);
    vocab_shard_max(mxd, ld);
    vocab_shard_sumexp(sed, tld, ld, tgd, mxd, begin);
    Tensor lsd = nan_dev({N}, DType::f32), dld = nan_dev({N, V}, dt);
    vocab_shard_loss(lsd, dld, ld, tgd, mxd, sed, tld, begin, 0.5);
    CHECK(rel(mxd, mx) < 1e-12);
    CHECK(rel(sed, se) < 1e-6);
    CHECK(rel(tld, tl) < 1e-12);
    CHECK_F32(lsd, ls);
    if (dt == DType::bf16) CHECK_BF16(dld, dl);
    else CHECK_F32(dld, dl);
  }
}
