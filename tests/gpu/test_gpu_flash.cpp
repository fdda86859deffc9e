// The bf16 tensor-core attention kernel (runtime/kernels/cuda/flash_attention.h) against the CPU f32
// attention (attention/local_attention.h) on the same bf16-representable inputs, outputs poisoned with
// NaN: out, dq, dk, dv within 1e-2 relative (norm of the difference over the norm of the reference),
// lse (f32) within 1e-3; a NaN never passes. Covers head dims 64 and 128, causal and full, grouped-query,
// lengths that are not multiples of the 64-row tiles, ring-attention offsets (rows that see no key get
// out = 0, lse = -inf, dq = 0), accumulation into dk and dv, and same bits on a rerun. Skips itself
// when no device is visible.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "attention/local_attention.h"
#include "gpu_test.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/cuda/flash_attention.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

void* stream() { return current_stream(test_device()).handle(); }
#define CHECK_LSE(got, want) CHECK(rel(got, want) < 1e-3)

struct Case {
  int64_t B, T, S, H, KV, hd;
  bool causal;
  int64_t q_pos0, k_pos0;
};

struct Grads {
  Tensor dq, dk, dv;  // device bf16
};

// Forward into NaN-poisoned out (B, T, H, hd) bf16 and lse (B, H, T) f32 on the device.
std::pair<Tensor, Tensor> flash_forward(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  Tensor out = nan_dev(q.shape(), DType::bf16), lse = nan_dev({c.B, c.H, c.T}, DType::f32);
  int rc = cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                         c.B, c.T, c.S, c.H, c.KV, c.hd, 1.0 / std::sqrt(double(c.hd)), c.causal,
                                         c.q_pos0, c.k_pos0, stream());
  REQUIRE(rc == 0);
  current_stream(test_device()).synchronize();
  return {out, lse};
}

// Backward into NaN-poisoned dq, and dk, dv that start NaN (overwrite) or as copies of dk0, dv0 (accumulate).
Grads flash_backward(const Case& c, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& out, const Tensor& lse, const Tensor* dk0 = nullptr, const Tensor* dv0 = nullptr) {
  const bool accumulate = dk0 != nullptr;
  Grads g{nan_dev(q.shape(), DType::bf16), accumulate ? dk0->clone() : nan_dev(k.shape(), DType::bf16),
          accumulate ? dv0->clone() : nan_dev(k.shape(), DType::bf16)};
  const size_t bytes = cuda::flash_attention_backward_scratch_bytes(c.B, c.T, c.S, c.H, c.KV, c.hd);
  Tensor scratch = nan_dev({int64_t(bytes / sizeof(float)) + 1}, DType::f32);
  int rc = cuda::flash_attention_backward(g.dq.data_ptr(), g.dk.data_ptr(), g.dv.data_ptr(), scratch.data_ptr(),
                                          dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                          lse.data<float>(), c.B, c.T, c.S, c.H, c.KV, c.hd,
                                          1.0 / std::sqrt(double(c.hd)), c.causal, c.q_pos0, c.k_pos0, accumulate,
                                          stream());
  REQUIRE(rc == 0);
  current_stream(test_device()).synchronize();
  return g;
}

// Same bits (bf16 compared as u16; f32 element-wise, where -inf equals -inf and NaN fails).
bool same_bits(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  if (ha.dtype() == DType::bf16) ha = ha.bitcast(DType::u16), hb = hb.bitcast(DType::u16);
  return equal(ha, hb);
}

}  // namespace

TEST_CASE("gpu flash attention: forward and backward vs CPU f32 (hd 64/128, causal/full, GQA, tails, ring offsets)") {
  MT_REQUIRE_GPU();
  for (const Case& c : std::vector<Case>{
           {2, 100, 100, 4, 2, 64, true, 0, 0},     // causal, GQA 2:1, T not a multiple of 64
           {2, 130, 130, 4, 4, 128, true, 0, 0},    // causal, one kv head per q head, a 2-row tail block
           {1, 130, 130, 4, 2, 128, false, 0, 0},   // full
           {2, 100, 100, 4, 4, 64, false, 0, 0},    // full
           {1, 128, 128, 4, 2, 64, true, 64, 0},    // ring: the queries' chunk after the keys' chunk
           {1, 128, 128, 4, 2, 128, true, 0, 64},   // ring: the keys' chunk after; queries 0..63 see no key
           {1, 70, 150, 4, 1, 128, true, 100, 10},  // T != S, GQA 4:1, tails on both sides
           {1, 200, 64, 2, 2, 64, false, 0, 0},     // more queries than keys
           {1, 520, 520, 4, 1, 128, true, 0, 0},    // 9 blocks deep: both pipeline stages reused many times
       }) {
    CAPTURE(c.T);
    CAPTURE(c.S);
    CAPTURE(c.hd);
    CAPTURE(c.causal);
    CAPTURE(c.q_pos0);
    CAPTURE(c.k_pos0);
    AttentionOptions o;
    o.causal = c.causal, o.q_pos0 = c.q_pos0, o.k_pos0 = c.k_pos0;
    Tensor q = rnd({c.B, c.T, c.H, c.hd}, 1), k = rnd({c.B, c.S, c.KV, c.hd}, 2), v = rnd({c.B, c.S, c.KV, c.hd}, 3);
    Tensor dout = rnd(q.shape(), 4);
    Tensor qd = bf(q), kd = bf(k), vd = bf(v), doutd = bf(dout);

    // Forward.
    Tensor out = empty(q.shape(), DType::f32), lse = empty({c.B, c.H, c.T}, DType::f32);
    attention_forward(out, lse, q, k, v, o);
    auto [outd, lsed] = flash_forward(c, qd, kd, vd);
    CHECK_BF16(outd, out);
    CHECK_LSE(lsed, lse);

    // Backward (the reference from its own forward; the kernel from the kernel's).
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(k.shape(), DType::f32);
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
    Grads g = flash_backward(c, doutd, qd, kd, vd, outd, lsed);
    CHECK_BF16(g.dq, dq);
    CHECK_BF16(g.dk, dk);
    CHECK_BF16(g.dv, dv);

    // Rows that see no key: exactly out = 0, lse = -inf, dq = 0.
    {
      auto ov = to_f64(outd), lv = to_f64(lsed), qv = to_f64(g.dq);
      int64_t dead = 0, wrong = 0;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < c.T; ++t) {
          if (c.S > 0 && (!c.causal || c.q_pos0 + t - c.k_pos0 + 1 > 0)) continue;  // sees key 0
          for (int64_t h = 0; h < c.H; ++h) {
            ++dead;
            if (lv[size_t((b * c.H + h) * c.T + t)] != -INFINITY) ++wrong;
            for (int64_t x = 0; x < c.hd; ++x) {
              const size_t i = size_t(((b * c.T + t) * c.H + h) * c.hd + x);
              if (ov[i] != 0 || qv[i] != 0) ++wrong;
            }
          }
        }
      if (c.k_pos0 > c.q_pos0) CHECK(dead > 0);
      CHECK(wrong == 0);
    }

    // Accumulate: dk, dv += the contribution (ring attention's later query chunks).
    Tensor dk0 = rnd(k.shape(), 5), dv0 = rnd(k.shape(), 6), dk0d = bf(dk0), dv0d = bf(dv0);
    Grads ga = flash_backward(c, doutd, qd, kd, vd, outd, lsed, &dk0d, &dv0d);
    Tensor dk_sum = empty(k.shape(), DType::f32), dv_sum = empty(k.shape(), DType::f32);
    add(dk_sum, dk0, dk);
    add(dv_sum, dv0, dv);
    CHECK_BF16(ga.dk, dk_sum);
    CHECK_BF16(ga.dv, dv_sum);
    CHECK(same_bits(ga.dq, g.dq));

    // Determinism: a rerun gives the same bits.
    auto [outd2, lsed2] = flash_forward(c, qd, kd, vd);
    CHECK(same_bits(outd2, outd));
    CHECK(same_bits(lsed2, lsed));
    Grads g2 = flash_backward(c, doutd, qd, kd, vd, outd, lsed);
    CHECK(same_bits(g2.dq, g.dq));
    CHECK(same_bits(g2.dk, g.dk));
    CHECK(same_bits(g2.dv, g.dv));
  }
}

TEST_CASE("gpu flash attention: unsupported arguments, empty sizes, and the dispatch of local attention") {
  MT_REQUIRE_GPU();
  // Head dims other than 64 and 128, or H not a multiple of KV: -1 before touching any pointer.
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 8, 2, 2, 32, 0.1, true, 0, 0,
                                      stream()) == -1);
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 8, 3, 2, 64, 0.1, true, 0, 0,
                                      stream()) == -1);
  CHECK(cuda::flash_attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                       nullptr, 1, 8, 8, 2, 2, 96, 0.1, true, 0, 0, false, stream()) == -1);
  // Nothing to do: success without a launch.
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 8, 2, 2, 64, 0.1, true, 0, 0,
                                      stream()) == 0);

  // No keys at all (S = 0): every row gets out = 0 and lse = -inf, dq = 0.
  {
    const Case c{1, 70, 0, 2, 1, 64, false, 0, 0};
    Tensor qd = bf(rnd({c.B, c.T, c.H, c.hd}, 7)), kd = empty({c.B, 0, c.KV, c.hd}, DType::bf16, gpu());
    auto [outd, lsed] = flash_forward(c, qd, kd, kd);
    for (double x : to_f64(outd)) CHECK(x == 0);
    for (double x : to_f64(lsed)) CHECK(x == -INFINITY);
    Grads g = flash_backward(c, bf(rnd(qd.shape(), 8)), qd, kd, kd, outd, lsed);
    for (double x : to_f64(g.dq)) CHECK(x == 0);
  }

  // bf16 CUDA attention through attention/local_attention.h runs this kernel: the same bits as a direct call.
  const char* ref = std::getenv("MT_REFERENCE_ATTENTION");
  if (ref && std::string(ref) == "1") return;
  const Case c{1, 96, 96, 4, 2, 128, true, 0, 0};
  Tensor qd = bf(rnd({c.B, c.T, c.H, c.hd}, 9)), kd = bf(rnd({c.B, c.S, c.KV, c.hd}, 10)),
         vd = bf(rnd({c.B, c.S, c.KV, c.hd}, 11));
  auto [outd, lsed] = flash_forward(c, qd, kd, vd);
  Tensor out2 = nan_dev(qd.shape(), DType::bf16), lse2 = nan_dev({c.B, c.H, c.T}, DType::f32);
  attention_forward(out2, lse2, qd, kd, vd, AttentionOptions{});
  CHECK(same_bits(out2, outd));
  CHECK(same_bits(lse2, lsed));
}
