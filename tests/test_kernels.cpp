// What the op table (tests/op_cases.cpp, run by test_ops) does not cover: error messages, bit-level
// properties (the fused residual add, the RoPE tables' convention, results independent of the thread count,
// exact sums), the all-ignored cross-entropy batch, and the packing ops. The values and gradients of every op
// on every backend are in the op table; attention in tests/test_attention.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "check_error.h"
#include "runtime/core/stream.h"
#include "runtime/core/tensor.h"
#if MT_CUDA
#include "runtime/kernels/cuda/cuda_ops.h"
#endif
#include "runtime/kernels/ops.h"
#include "test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

// Restores the CPU thread count at the end of a test.
struct ThreadCount {
  int saved = cpu_threads();
  ~ThreadCount() { set_cpu_threads(saved); }
};

Tensor positions_tensor(const std::vector<int64_t>& pos) { return ints(pos, DType::i64); }

// A kernel error message must start with "[kernels]".
#define CHECK_KERNELS_ERROR(expr)                       \
  do {                                                  \
    std::string mt_kmsg_;                               \
    try {                                               \
      (void)(expr);                                     \
    } catch (const mt::Error& e) {                      \
      mt_kmsg_ = e.what();                              \
    }                                                   \
    INFO("expression: " #expr "; message: ", mt_kmsg_); \
    CHECK(mt_kmsg_.rfind("[kernels]", 0) == 0);         \
  } while (0)

}  // namespace

TEST_CASE("kernels: bad shapes, dtypes, tokens, targets and steps are errors naming the op and the tensor") {
  const int64_t N = 7, C = 13;
  const DType f = DType::f32, d = DType::f64;
  Tensor x = randn({N, C}, 601, f), w = randn({5, C}, 602, f);
  // matmul
  Tensor w12 = randn({5, 12}, 2, f);
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, f), x, w12), "[kernels] matmul_forward: inp (7, 13)");
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, f), x, w12), "(5, 12)");
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 6}, f), x, w),
                       "[kernels] matmul_forward: out has shape (7, 6), expected (7, 5)");
  CHECK_ERROR_CONTAINS(matmul_forward(empty({7, 5}, d), x, w), "[kernels] matmul_forward: out is f64");
  CHECK_ERROR_CONTAINS(
      matmul_forward(empty({7, 5}, DType::i32), empty({7, 13}, DType::i32), empty({5, 13}, DType::i32)),
      "inp is i32; the CPU backend takes f32, bf16 or f64");
  CHECK_ERROR_CONTAINS(matmul_backward(empty({7, 13}, d), Tensor(), empty({7, 5}, f), x, w),
                       "[kernels] matmul_backward: dinp is f64");
  CHECK_KERNELS_ERROR(matmul_forward(empty({N, 5}, f), x, randn({5, C}, 602, d)));
  CHECK_KERNELS_ERROR(matmul_backward(empty({N, C + 1}, f), Tensor(), empty({N, 5}, f), x, w));
  CHECK_KERNELS_ERROR(matmul_backward(Tensor(), zeros({5, C}, d), empty({N, 5}, f), x, w));
  CHECK_KERNELS_ERROR(matmul_backward(Tensor(), zeros({6, C}, f), empty({N, 5}, f), x, w));
  // rmsnorm and the fused add
  CHECK_ERROR_CONTAINS(rmsnorm_forward(empty({N, C}, d), empty({N + 1}, d), randn({N, C}, 3), randn({C}, 4), 1e-5),
                       "[kernels] rmsnorm_forward: rstd has shape (8,), expected (7,)");
  CHECK_KERNELS_ERROR(rmsnorm_forward(empty({N, C}, f), empty({N}, f), x, empty({C + 1}, f), 1e-5));
  CHECK_KERNELS_ERROR(rmsnorm_forward(empty({N, C}, f), empty({N}, d), x, empty({C}, f), 1e-5));
  CHECK_KERNELS_ERROR(rmsnorm_backward(empty({N, C}, f), zeros({C + 1}, f), x, x, empty({C}, f), empty({N}, f)));
  Tensor a = randn({9, 37}, 1, f);
  CHECK_ERROR_CONTAINS(
      add_rmsnorm_forward(a, empty({9, 37}, f), empty({9}, f), a, empty({9, 38}, f), empty({37}, f), 1e-5),
      "[kernels] add_rmsnorm_forward: b has shape (9, 38), expected (9, 37)");
  CHECK_ERROR_CONTAINS(
      rmsnorm_backward(empty({9, 37}, f), zeros({37}, f), a, a, zeros({37}, f), zeros({9}, f), empty({9, 37}, d)),
      "[kernels] rmsnorm_backward: dresidual is f64");
  // rope
  Tensor cs = empty({5, 8}, f), sn = empty({5, 8}, f);
  CHECK_ERROR_CONTAINS(rope_forward(empty({2, 5, 3, 6}, d), randn({2, 5, 3, 6}, 5), empty({6, 6}, d), empty({5, 6}, d)),
                       "[kernels] rope_forward: cos has shape (6, 6), expected (5, 6)");
  CHECK_ERROR_CONTAINS(rope_tables(empty({2, 5}, d), empty({2, 5}, d), positions_tensor({0, 1}), 1e4),
                       "[kernels] rope_tables: cos must be (P, hd) with an even hd, got (2, 5)");
  CHECK_KERNELS_ERROR(rope_forward(empty({1, 5, 2, 8}, f), empty({1, 5, 2, 8}, f), cs, empty({5, 8}, d)));
  CHECK_KERNELS_ERROR(rope_forward(empty({1, 5, 2, 8}, f), empty({1, 5, 2, 6}, f), cs, sn));
  CHECK_KERNELS_ERROR(rope_backward(empty({1, 4, 2, 8}, f), empty({1, 4, 2, 8}, f), cs, sn));
  CHECK_KERNELS_ERROR(rope_tables(empty({5, 8}, f), empty({4, 8}, f), positions_tensor({0, 1, 2, 3, 4}), 1e4));
  // swiglu
  CHECK_ERROR_CONTAINS(swiglu_forward(empty({N, C}, d), randn({N, C}, 6), empty({N, C + 1}, d)),
                       "[kernels] swiglu_forward: up has shape (7, 14), expected (7, 13)");
  CHECK_KERNELS_ERROR(swiglu_forward(empty({N, C}, f), x, empty({N, C}, d)));
  CHECK_KERNELS_ERROR(swiglu_backward(empty({N, C}, f), empty({N, C + 1}, f), x, x, x));
  // embedding: tokens outside the vocabulary are named with their position
  Tensor table = randn({5, C}, 21, f), eo = empty({7, C}, f);
  CHECK_ERROR_CONTAINS(embedding_forward(eo, ints({0, 1, 2, 11, 0, 0, 0}), table, 4, 11),
                       "[kernels] embedding_forward: token 11 at position 3 is outside the vocabulary [0, 11)");
  CHECK_ERROR_CONTAINS(embedding_forward(eo, ints({0, 1, 2, 3, -1, 0, 0}), table, 4, 11), "token -1 at position 4");
  CHECK_ERROR_CONTAINS(embedding_forward(eo, ints({0, 1}), table, 4, 11),
                       "[kernels] embedding_forward: out has shape (7, 13), expected (2, 13)");
  Tensor tk = ints({0, 1, 2, 3, 4, 5, 6});
  CHECK_KERNELS_ERROR(embedding_forward(empty({N, C + 1}, f), tk, randn({11, C}, 603, f)));
  CHECK_KERNELS_ERROR(
      embedding_forward(empty({N, C}, f), ints({0, 1, 2, 3, 4, 5, 6}, DType::i64), randn({11, C}, 603, f)));
  CHECK_KERNELS_ERROR(embedding_backward(zeros({11, C}, f), empty({N, C}, d), tk));
  CHECK_KERNELS_ERROR(embedding_backward(zeros({11, C + 1}, f), empty({N, C}, f), tk));
  // cross-entropy: a target >= V is named; losses follow the mixed-precision rule
  Tensor lg = randn({N, 11}, 604, f), lg64 = randn({N, 11}, 605);
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(empty({N}, d), Tensor(), lg64, ints({3, 0, 11, 1, 1, 1, 1}), 1.0),
                       "[kernels] cross_entropy: target 11 at position 2 is >= the vocabulary size 11");
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(empty({N}, f), Tensor(), lg64, tk, 1.0),
                       "[kernels] cross_entropy: losses is f32");
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N + 1}, f), Tensor(), lg, tk, 1.0));
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N}, f), empty({N, 12}, f), lg, tk, 1.0));
  CHECK_KERNELS_ERROR(cross_entropy_forward_backward(empty({N}, f), Tensor(), lg, ints({0, 1, 2}), 1.0));
  CHECK_ERROR_CONTAINS(vocab_shard_max(empty({N}, f), lg64), "[kernels] vocab_shard_max: row_max must be (7) f64");
  // element-wise, reductions, dtypes the CPU backend does not take
  CHECK_ERROR_CONTAINS(add(empty({100}, f), randn({100}, 7, f), empty({99}, f)), "[kernels] add: b has shape");
  CHECK_KERNELS_ERROR(add_(empty({N, C}, f), empty({N, C}, d)));
  CHECK_KERNELS_ERROR(add_(empty({N, C}, f), empty({C, N}, f)));
  CHECK_KERNELS_ERROR(sum_squares(empty({3}, DType::i64)));
  CHECK_ERROR_CONTAINS(sum(empty({4}, DType::i32)), "[kernels] sum: t is i32; the CPU backend takes f32, bf16 or f64");
  CHECK_ERROR_CONTAINS(scale_(empty({3}, DType::u16), 2.0), "[kernels] scale_: t is u16");
  // adamw
  Tensor p = randn({5}, 34, f);
  CHECK_ERROR_CONTAINS(adamw_step(p, p, zeros({5}, f), zeros({5}, f), 1e-3, 0.9, 0.95, 1e-8, 0, 0),
                       "[kernels] adamw_step: step is 1-based, got 0");
  CHECK_ERROR_CONTAINS(adamw_step(p, p, zeros({5}, d), zeros({5}, d), 1e-3, 0.9, 0.95, 1e-8, 0, 1),
                       "[kernels] adamw_step: optimizer state is f64 but the parameter is f32");
  CHECK_KERNELS_ERROR(
      adamw_step(empty({5}, f), empty({6}, f), zeros({5}, f), zeros({5}, f), 1e-3, 0.9, 0.95, 1e-8, 0, 1));
  CHECK_KERNELS_ERROR(
      adamw_step(empty({5}, f), empty({5}, d), zeros({5}, f), zeros({5}, f), 1e-3, 0.9, 0.95, 1e-8, 0, 1));
}

TEST_CASE("kernels: the residual add fused into rmsnorm has the bits of add then rmsnorm") {
  const int64_t N = 9, C = 37;
  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const DType acc = accum_dtype(dt);
    Tensor a = randn({N, C}, 11, dt), b = randn({N, C}, 12, dt), w = randu({C}, 13, dt, 0.5, 1.5);
    // Unfused: sum = a + b, then the norm.
    Tensor s = empty({N, C}, dt), y = empty({N, C}, dt), rstd = empty({N}, acc);
    add(s, a, b);
    rmsnorm_forward(y, rstd, s, w, 1e-5);
    // Fused, the sum written over a (as the decoder layer does).
    Tensor a2 = a.clone(), y2 = poisoned({N, C}, dt), rstd2 = poisoned({N}, acc);
    add_rmsnorm_forward(a2, y2, rstd2, a2, b, w, 1e-5);
    CHECK(to_f64(a2) == to_f64(s));
    CHECK(to_f64(y2) == to_f64(y));
    CHECK(to_f64(rstd2) == to_f64(rstd));
    // Backward with the residual gradient: backward then add, rounded once instead of twice; dweight unchanged.
    Tensor dy = randn({N, C}, 14, dt), dres = randn({N, C}, 15, dt);
    Tensor dx = empty({N, C}, dt), dw = zeros({C}, acc), dx2 = poisoned({N, C}, dt), dw2 = zeros({C}, acc);
    rmsnorm_backward(dx, dw, dy, s, w, rstd);
    add_(dx, dres);
    rmsnorm_backward(dx2, dw2, dy, s, w, rstd, dres);
    CHECK(rel_err(dx2, dx) <= (dt == DType::f64 ? 1e-14 : dt == DType::f32 ? 1e-6 : 1e-2));
    CHECK(to_f64(dw2) == to_f64(dw));
    // dresidual may alias dinp.
    Tensor dx3 = dres.clone(), dw3 = zeros({C}, acc);
    rmsnorm_backward(dx3, dw3, dy, s, w, rstd, dx3);
    CHECK(to_f64(dx3) == to_f64(dx2));
  }
}

namespace {
// Hugging Face's tables in precision T (inv_freq and angle in T, as the reference script computes them).
template <typename T>
std::vector<double> ref_rope_table(const std::vector<int64_t>& pos, int64_t hd, double theta, bool want_sin) {
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
}  // namespace

TEST_CASE("kernels: rope tables follow Hugging Face: angles in the table's precision, the halves repeated") {
  const int64_t hd = 6;
  const std::vector<int64_t> pos = {0, 1, 2, 7, 300};
  const int64_t T = int64_t(pos.size());
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor cos = poisoned({T, hd}, dt), sin = poisoned({T, hd}, dt);
    rope_tables(cos, sin, positions_tensor(pos), 10000.0);
    const double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    if (dt == DType::f64) {
      CHECK(max_rel_err(to_f64(cos), ref_rope_table<double>(pos, hd, 10000.0, false)) <= tol);
      CHECK(max_rel_err(to_f64(sin), ref_rope_table<double>(pos, hd, 10000.0, true)) <= tol);
    } else {
      CHECK(max_rel_err(to_f64(cos), ref_rope_table<float>(pos, hd, 10000.0, false)) <= tol);
      CHECK(max_rel_err(to_f64(sin), ref_rope_table<float>(pos, hd, 10000.0, true)) <= tol);
    }
    // Position 0 is angle 0; position 1 at frequency 0 is angle 1: values by hand.
    CHECK(to_f64(cos)[0] == 1.0);
    CHECK(to_f64(sin)[size_t(hd)] == doctest::Approx(std::sin(1.0)).epsilon(1e-7));
    for (int64_t t = 0; t < T; ++t)  // the two halves are identical
      for (int64_t i = 0; i < hd / 2; ++i) {
        CHECK(to_f64(cos)[size_t(t * hd + i)] == to_f64(cos)[size_t(t * hd + i + hd / 2)]);
        CHECK(to_f64(sin)[size_t(t * hd + i)] == to_f64(sin)[size_t(t * hd + i + hd / 2)]);
      }
  }
}

TEST_CASE("kernels: cross-entropy on an all-ignored batch gives zero losses and a zero gradient") {
  const int64_t N = 3, V = 11;
  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Tensor lg = randn({N, V}, 701, dt), losses = poisoned({N}, accum_dtype(dt));
    cross_entropy_forward_backward(losses, lg, lg, ints({-1, -100, -1}), 2.0);  // the gradient over the logits
    for (double l : to_f64(losses)) CHECK(l == 0.0);
    for (double g : to_f64(lg)) CHECK(g == 0.0);
  }
  // Target V - 1 is fine, V is an error.
  Tensor lg = randn({N, V}, 702, DType::f32), l = poisoned({N}, DType::f32);
  cross_entropy_forward_backward(l, Tensor(), lg, ints({10, 0, 10}), 1.0);
  for (double v : to_f64(l)) CHECK((std::isfinite(v) && v > 0));  // every loss written
  CHECK_ERROR_CONTAINS(cross_entropy_forward_backward(l, Tensor(), lg, ints({0, 11, 0}), 1.0),
                       ">= the vocabulary size");
}

TEST_CASE("kernels: CPU results do not depend on the thread count") {
  ThreadCount keep;
  const int64_t N = 257, C = 96, OC = 130;
  Tensor x = randu({N, C}, 35, DType::f32), w = randu({OC, C}, 36, DType::f32);
  Tensor nw = randu({C}, 37, DType::f32), dy = randu({N, OC}, 38, DType::f32), dyn = randu({N, C}, 39, DType::f32);
  Tensor tok = empty({1000}, DType::i32), dye = randu({1000, 70}, 24, DType::f32),
         big = randu({100003}, 30, DType::f32);
  for (int64_t i = 0; i < 1000; ++i) tok.at<int32_t>(i) = int32_t((i * 7) % 37);
  auto run = [&](int threads) {
    set_cpu_threads(threads);
    CHECK(cpu_threads() == threads);
    Tensor y = empty({N, OC}, DType::f32), dx = empty({N, C}, DType::f32), dw = zeros({OC, C}, DType::f32);
    matmul_forward(y, x, w);
    matmul_backward(dx, dw, dy, x, w);
    Tensor o = empty({N, C}, DType::f32), rs = empty({N}, DType::f32), dxn = empty({N, C}, DType::f32);
    Tensor dwn = zeros({C}, DType::f32);
    rmsnorm_forward(o, rs, x, nw, 1e-5);
    rmsnorm_backward(dxn, dwn, dyn, x, nw, rs);
    Tensor losses = empty({N}, DType::f32), dl = empty({N, OC}, DType::f32), tg = empty({N}, DType::i32);
    for (int64_t i = 0; i < N; ++i) tg.at<int32_t>(i) = int32_t((i * 13) % OC);
    cross_entropy_forward_backward(losses, dl, y, tg, 0.01);
    Tensor dt = zeros({37, 70}, DType::f32);
    embedding_backward(dt, dye, tok);
    std::vector<std::vector<double>> r;
    for (const Tensor& t : {y, dx, dw, o, rs, dxn, dwn, losses, dl, dt}) r.push_back(to_f64(t));
    r.push_back({sum(big), sum_squares(big)});
    return r;
  };
  auto one = run(1), two = run(2);
  for (size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(max_rel_err(two[i], one[i]) <= 1e-6);
  }
  // Deterministic whatever the thread count: rmsnorm's dweight, the embedding scatter, the sums.
  CHECK(one[6] == two[6]);
  CHECK(one[9] == two[9]);
  CHECK(one[10] == two[10]);
}

TEST_CASE("kernels: sum and sum_squares are exact on small integer values, views and empty tensors") {
  ThreadCount keep;
  const int64_t n = 100003;
  std::mt19937_64 gen(401);
  std::uniform_int_distribution<int> dist(-8, 8);
  std::vector<double> vals(static_cast<size_t>(n));
  int64_t s = 0, ss = 0;
  for (double& v : vals) {
    int x = dist(gen);
    v = x;
    s += x;
    ss += int64_t(x) * x;
  }
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Tensor t = from_values(vals, {n}, dt);
    for (int th : {1, 2, 3}) {
      CAPTURE(th);
      set_cpu_threads(th);
      CHECK(sum(t) == double(s));
      CHECK(sum_squares(t) == double(ss));
    }
    CHECK(sum(t.view(0, {7, 13})) == std::accumulate(vals.begin(), vals.begin() + 91, 0.0));
    CHECK(sum_squares(empty({0}, dt)) == 0);
    Tensor small = from_values({1, -2, 3, 4, -5}, {5}, dt);
    CHECK(sum(small) == 1.0);
    CHECK(sum_squares(small) == 55.0);
  }
}

TEST_CASE("kernels: pack_blocks and unpack_blocks against copy_slice, uneven and empty blocks, any dtype") {
  struct Case {
    Shape shape;
    int dim;
    std::vector<int64_t> lens;
  };
  std::vector<Case> cases = {{{6, 5}, 0, {2, 2, 2}},       {{3, 7, 4}, 1, {3, 3, 1}}, {{3, 7, 4}, 1, {4, 3, 0, 0}},
                             {{2, 3, 5}, 2, {2, 0, 3}},    {{4, 5, 3}, 0, {0, 4}},    {{1, 9, 2}, 1, {9}},
                             {{5, 2, 3, 2}, 2, {1, 1, 1}}, {{2, 0, 3}, 2, {2, 1}}};
  uint64_t seed = 11;
  for (const Case& c : cases)
    for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::u16, DType::f64}) {
      CAPTURE(shape_str(c.shape));
      CAPTURE(c.dim);
      CAPTURE(dtype_name(dt));
      Tensor src = randu(c.shape, ++seed, dt == DType::u16 ? DType::f32 : dt, -100, 100);
      if (dt == DType::u16) {  // any bit patterns: the copy does not look at values
        Tensor u = empty(c.shape, DType::u16);
        for (int64_t i = 0; i < u.numel(); ++i) u.at<uint16_t>(i) = uint16_t(i * 7919 + 13);
        src = u;
      }
      // The reference: block j is copy_slice of the dim's piece j, the blocks one after the other.
      Tensor want = zeros({src.numel()}, src.dtype());
      int64_t off = 0, begin = 0;
      for (int64_t len : c.lens) {
        Shape bs = c.shape;
        bs[size_t(c.dim)] = len;
        copy_slice(want.view(off, bs), 0, src, begin, len, c.dim);
        off += shape_numel(bs), begin += len;
      }
      Tensor packed = empty({src.numel()}, src.dtype());
      if (packed.numel() > 0) std::memset(packed.data_ptr(), 0xff, packed.nbytes());  // every byte rewritten
      pack_blocks(packed, src, c.dim, c.lens);
      CHECK(equal(packed.bitcast(dt == DType::bf16 || dt == DType::u16 ? DType::u16 : dt),
                  want.bitcast(dt == DType::bf16 || dt == DType::u16 ? DType::u16 : dt)));
      Tensor back = empty(c.shape, src.dtype());
      if (back.numel() > 0) std::memset(back.data_ptr(), 0xff, back.nbytes());
      unpack_blocks(back, packed, c.dim, c.lens);
      CHECK(std::memcmp(back.data_ptr(), src.data_ptr(), src.nbytes()) == 0);
    }
  Tensor t = zeros({4, 6}, DType::f32), p = zeros({24}, DType::f32);
  CHECK_ERROR_CONTAINS(pack_blocks(p, t, 1, {3, 2}), "[kernels] pack_blocks: blocks of 5 elements along dim 1");
  CHECK_ERROR_CONTAINS(unpack_blocks(t, zeros({23}, DType::f32), 0, {4}), "unpack_blocks");
  CHECK_ERROR_CONTAINS(pack_blocks(p, t, 2, {6}), "dim 2");
  CHECK_ERROR_CONTAINS(pack_blocks(p, t, 1, {7, -1}), "length -1");
}

TEST_CASE("kernels: sum_into and sum_squares_into have the bits of the host sums and read nothing back") {
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    CAPTURE(dtype_name(dt));
    Tensor a = randu({1000, 37}, 5, dt), b = randu({3, 111}, 6, dt), e = zeros({0}, dt);
    Tensor out = zeros({3}, DType::f64);
    const std::vector<int64_t> slots{2, 1, 2, 1};
    const std::vector<Tensor> squared{a, b, b, e};
    const int64_t before = host_sync_count();
    sum_into(out, 0, a);
    sum_into(out, 0, b);
    sum_squares_into(out, slots, squared);
    CHECK(host_sync_count() == before);  // left where the tensors live: no host read
    // The host sums added in the same order, slot by slot: the same bits.
    const int64_t reads = host_sync_count();
    double want[3] = {0, 0, 0};
    want[0] += sum(a);
    want[0] += sum(b);
    for (size_t i = 0; i < slots.size(); ++i) want[slots[i]] += sum_squares(squared[i]);
    CHECK(host_sync_count() == reads + 6);  // each host sum is one host read
    for (int64_t k = 0; k < 3; ++k) CHECK(out.at<double>(k) == want[k]);
  }
  CHECK_ERROR_CONTAINS(sum_into(zeros({2}, DType::f32), 0, zeros({3}, DType::f32)), "out must be a 1-d f64 tensor");
  CHECK_ERROR_CONTAINS(sum_into(zeros({2}, DType::f64), 2, zeros({3}, DType::f32)), "slot 2 outside");
  CHECK_ERROR_CONTAINS(sum_squares_into(zeros({2}, DType::f64), {0}, {}), "1 slots for 0 tensors");
}

TEST_CASE("kernels: the host-sync counter counts each host read of a tensor's values once") {
  Tensor a = randu({10, 10}, 3, DType::f32), b = randu({7}, 4, DType::f32);
  const int64_t c0 = host_sync_count();
  (void)to_f64(a);
  CHECK(host_sync_count() == c0 + 1);
  (void)sum_squares_each({a, b, a});
  CHECK(host_sync_count() == c0 + 2);  // one read for the whole call, as on a device
  (void)sum_squares_each({});
  CHECK(host_sync_count() == c0 + 2);
  Tensor p = empty({100}, DType::f32);
  pack_blocks(p, a, 1, {5, 5});
  copy_slice(a, 0, a.view(0, {10, 10}).clone(), 0, 10, 1);
  add_(a, a);
  CHECK(host_sync_count() == c0 + 2);  // ops that write tensors wait for nothing
}

#if MT_CUDA
// A launcher's failure code names itself: CUDA errors and the GEMMs' cuBLAS statuses (offset by
// kCublasErrorBase) read differently, so a message from a GPU run says which library failed and how.
TEST_CASE("kernels: CUDA and cuBLAS failure codes are named") {
  std::string cuda_err = cuda::error_string(700);
  CHECK(cuda_err.find("CUDA error 700 cudaErrorIllegalAddress") != std::string::npos);
  std::string blas_err = cuda::error_string(cuda::kCublasErrorBase + 15);
  CHECK(blas_err.find("cuBLAS status 15 CUBLAS_STATUS_NOT_SUPPORTED") != std::string::npos);
  CHECK(std::string(cuda::error_string(-1)).find("arguments the kernel does not take") != std::string::npos);
}
#endif

TEST_CASE("kernels: MoE router top-k, combine and grouped GEMM against finite differences and per-group matmul") {
  const int64_t N = 5, E = 6, K = 2, C = 4;
  for (bool sigmoid : {false, true})
    for (bool renorm : {false, true}) {
      CAPTURE(sigmoid);
      CAPTURE(renorm);
      Tensor logits = randn({N, E}, 11), bias = randn({E}, 12, DType::f64, 0.1), dw = randn({N, K}, 13);
      Tensor dprow = randn({E}, 14);
      Tensor w = poisoned({N, K}, DType::f64), p = poisoned({N, E}, DType::f64), ex = ints(std::vector<int64_t>(N * K));
      ex = ex.reshape({N, K});
      const double scale = 2.5;
      router_topk_forward(w, ex, p, logits, bias, sigmoid, renorm, scale);
      // The selection is fixed for small perturbations: the loss is <weights, dw> + sum_rows <probs, dprob_row>.
      auto loss = [&] {
        Tensor w2 = empty({N, K}, DType::f64), p2 = empty({N, E}, DType::f64), e2 = empty({N, K}, DType::i32);
        router_topk_forward(w2, e2, p2, logits, bias, sigmoid, renorm, scale);
        REQUIRE(equal(e2, ex));
        double s = dot(w2, dw);
        for (int64_t n = 0; n < N; ++n) s += dot(p2.slice0(n, n + 1).reshape({E}), dprow);
        return s;
      };
      Tensor dl = poisoned({N, E}, DType::f64);
      router_topk_backward(dl, dw, dprow, p, w, ex, sigmoid, renorm, scale);
      CHECK(rel_err(dl, finite_differences(logits, loss)) < 1e-7);
    }
  // combine: dweights and dinp against finite differences; one slot dropped, one routed row unnamed.
  const int64_t M = N * K;
  std::vector<int64_t> sl(size_t(N * K));
  for (int64_t i = 0; i < N * K; ++i) sl[size_t(i)] = (i * 3) % M;
  sl[3] = -1;
  Tensor slot = ints(sl).reshape({N, K});
  Tensor inp = randn({M, C}, 21), wts = randn({N, K}, 22), dout = randn({N, C}, 23);
  auto closs = [&] {
    Tensor o = empty({N, C}, DType::f64);
    moe_combine_forward(o, inp, wts, slot);
    return dot(o, dout);
  };
  Tensor dinp = poisoned({M, C}, DType::f64), dwts = poisoned({N, K}, DType::f64);
  moe_combine_backward(dinp, dwts, dout, inp, wts, slot);
  CHECK(rel_err(dwts, finite_differences(wts, closs)) < 1e-8);
  CHECK(rel_err(dinp, finite_differences(inp, closs)) < 1e-8);
  // grouped GEMM: each group equals a matmul on its rows, an empty group included.
  const std::vector<int64_t> counts{3, 0, 5, 2};
  const int64_t G = 4, OC = 3;
  Tensor x = randn({M, C}, 31, DType::f32), wg = randn({G, OC, C}, 32, DType::f32), y = poisoned({M, OC}, DType::f32);
  grouped_matmul_forward(y, x, wg, counts);
  Tensor dy = randn({M, OC}, 33, DType::f32), dx = poisoned({M, C}, DType::f32), dwg = zeros({G, OC, C}, DType::f32);
  grouped_matmul_backward(dx, dwg, dy, x, wg, counts);
  int64_t b = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t e = b + counts[size_t(g)];
    Tensor wv = wg.view(g * OC * C, {OC, C}), dwv = zeros({OC, C}, DType::f32);
    if (e > b) {
      Tensor yr = empty({e - b, OC}, DType::f32), dxr = empty({e - b, C}, DType::f32);
      matmul_forward(yr, x.slice0(b, e), wv);
      matmul_backward(dxr, dwv, dy.slice0(b, e), x.slice0(b, e), wv);
      CHECK(equal(yr, y.slice0(b, e)));
      CHECK(equal(dxr, dx.slice0(b, e)));
    }
    CHECK(equal(dwv, dwg.view(g * OC * C, {OC, C})));
    b = e;
  }
}
