// The bf16 tensor-core attention kernel (runtime/kernels/cuda/flash_attention.h) against the CPU f32
// attention (attention/local_attention.h) on the same bf16-representable inputs, outputs poisoned with
// NaN: out, dq, dk, dv within 1e-2 relative (norm of the difference over the norm of the reference),
// lse (f32) within 1e-3; a NaN never passes. Covers head dims 64 and 128, causal and full, grouped-query,
// lengths that are not multiples of the 64-row tiles, ring-attention offsets (rows that see no key get
// out = 0, lse = -inf, dq = 0), document masks (doc_start), accumulation into dk and dv, and same bits on a
// rerun. Skips itself when no device is visible.
#include <doctest/doctest.h>

#include <algorithm>
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

// doc_start (B, T) i64 on the device, or null.
const int64_t* doc_ptr(const Tensor* doc) { return doc ? doc->data<int64_t>() : nullptr; }

// Forward into NaN-poisoned out (B, T, H, hd) bf16 and lse (B, H, T) f32 on the device.
std::pair<Tensor, Tensor> flash_forward(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor* doc = nullptr) {
  Tensor out = nan_dev(q.shape(), DType::bf16), lse = nan_dev({c.B, c.H, c.T}, DType::f32);
  int rc = cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                         c.B, c.T, c.S, c.H, c.KV, c.hd, 1.0 / std::sqrt(double(c.hd)), c.causal,
                                         c.q_pos0, c.k_pos0, doc_ptr(doc), stream());
  REQUIRE(rc == 0);
  current_stream(test_device()).synchronize();
  return {out, lse};
}

// Backward into NaN-poisoned dq, and dk, dv that start NaN (overwrite) or as copies of dk0, dv0 (accumulate).
Grads flash_backward(const Case& c, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& out, const Tensor& lse, const Tensor* dk0 = nullptr, const Tensor* dv0 = nullptr,
                     const Tensor* doc = nullptr) {
  const bool accumulate = dk0 != nullptr;
  Grads g{nan_dev(q.shape(), DType::bf16), accumulate ? dk0->clone() : nan_dev(k.shape(), DType::bf16),
          accumulate ? dv0->clone() : nan_dev(k.shape(), DType::bf16)};
  const size_t bytes = cuda::flash_attention_backward_scratch_bytes(c.B, c.T, c.S, c.H, c.KV, c.hd);
  Tensor scratch = nan_dev({int64_t(bytes / sizeof(float)) + 1}, DType::f32);
  int rc = cuda::flash_attention_backward(
      g.dq.data_ptr(), g.dk.data_ptr(), g.dv.data_ptr(), scratch.data_ptr(), dout.data_ptr(), q.data_ptr(),
      k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data<float>(), c.B, c.T, c.S, c.H, c.KV, c.hd,
      1.0 / std::sqrt(double(c.hd)), c.causal, c.q_pos0, c.k_pos0, doc_ptr(doc), accumulate, stream());
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

// (B, T) i64 host document starts for queries at global positions q_pos0 + t: the largest entry of the row's
// `starts` (the last list serves the rows past it) at or before the position, 0 when none is. arbitrary:
// random starts in [0, q_pos0 + t + 1] instead, not ordered along t.
Tensor doc_starts(const Case& c, const std::vector<std::vector<int64_t>>& starts, bool arbitrary) {
  Tensor d = empty({c.B, c.T}, DType::i64);
  std::mt19937_64 g(11);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t pos = c.q_pos0 + t;
      int64_t x = 0;
      if (arbitrary) {
        x = int64_t(g() % uint64_t(pos + 2));
      } else {
        for (int64_t s : starts[size_t(std::min<int64_t>(b, int64_t(starts.size()) - 1))])
          if (s <= pos) x = std::max(x, s);
      }
      d.at<int64_t>(b * c.T + t) = x;
    }
  return d;
}

// Whether query t of row b sees some key.
bool sees_a_key(const Case& c, const Tensor& doc, int64_t b, int64_t t) {
  const int64_t hi = c.causal ? std::clamp<int64_t>(c.q_pos0 + t - c.k_pos0 + 1, 0, c.S) : c.S;
  const int64_t lo = std::clamp<int64_t>(doc.at<int64_t>(b * c.T + t) - c.k_pos0, 0, c.S);
  return lo < hi;
}

// The emulated device's quick run (gpu_test.h) leaves out the cases above 6M of B H T S hd (the 9-block-deep ones,
// hd 128 at T 130 and above): tests/emu/test_flash_emulated.cpp runs the kernels at those sizes.
bool emulated_skip(const Case& c) { return emulated_quick() && double(c.B * c.H * c.T) * double(c.S * c.hd) > 6e6; }

// A case's sizes and offsets in the message of any failing check in scope.
#define CAPTURE_CASE(c) \
  CAPTURE(c.T);         \
  CAPTURE(c.S);         \
  CAPTURE(c.hd);        \
  CAPTURE(c.causal);    \
  CAPTURE(c.q_pos0);    \
  CAPTURE(c.k_pos0)

// A case's inputs from seeds seed..seed+3: f32 on the host for the reference, the same values in bf16 on the
// device for the kernel.
struct Inputs {
  Tensor q, k, v, dout;
  Tensor qd, kd, vd, doutd;
};
Inputs inputs(const Case& c, uint64_t seed) {
  Inputs in;
  in.q = rnd({c.B, c.T, c.H, c.hd}, seed), in.k = rnd({c.B, c.S, c.KV, c.hd}, seed + 1);
  in.v = rnd({c.B, c.S, c.KV, c.hd}, seed + 2), in.dout = rnd(in.q.shape(), seed + 3);
  in.qd = bf(in.q), in.kd = bf(in.k), in.vd = bf(in.v), in.doutd = bf(in.dout);
  return in;
}

// The CPU f32 attention's forward and backward (its backward from its own forward).
struct Reference {
  Tensor out, lse, dq, dk, dv;
};
Reference reference(const Case& c, const Inputs& in, const AttentionOptions& o) {
  Reference r{empty(in.q.shape(), DType::f32), empty({c.B, c.H, c.T}, DType::f32), empty(in.q.shape(), DType::f32),
              empty(in.k.shape(), DType::f32), empty(in.k.shape(), DType::f32)};
  attention_forward(r.out, r.lse, in.q, in.k, in.v, o);
  attention_backward(r.dq, r.dk, r.dv, in.dout, in.q, in.k, in.v, r.out, r.lse, o);
  return r;
}

// The (row, head) pairs whose query sees no key (sees(b, t) false), and how many of their values are not exactly
// out = 0, lse = -inf, dq = 0.
struct DeadRows {
  int64_t dead = 0, wrong = 0;
};
template <typename Sees>
DeadRows dead_rows(const Case& c, const Tensor& outd, const Tensor& lsed, const Tensor& dqd, Sees&& sees) {
  auto ov = to_f64(outd), lv = to_f64(lsed), qv = to_f64(dqd);
  DeadRows d;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      if (sees(b, t)) continue;
      for (int64_t h = 0; h < c.H; ++h) {
        ++d.dead;
        if (lv[size_t((b * c.H + h) * c.T + t)] != -INFINITY) ++d.wrong;
        for (int64_t x = 0; x < c.hd; ++x) {
          const size_t i = size_t(((b * c.T + t) * c.H + h) * c.hd + x);
          if (ov[i] != 0 || qv[i] != 0) ++d.wrong;
        }
      }
    }
  return d;
}

// The backward accumulating into dk, dv that start as random dk0, dv0 (seeds seed, seed + 1), as ring attention's
// later query chunks do: they must come out as dk0, dv0 plus the reference's. Returns the kernel's gradients.
Grads check_accumulate(const Case& c, const Inputs& in, const Reference& ref, const Tensor& outd, const Tensor& lsed,
                       uint64_t seed, const Tensor* doc = nullptr) {
  Tensor dk0 = rnd(in.k.shape(), seed), dv0 = rnd(in.k.shape(), seed + 1), dk0d = bf(dk0), dv0d = bf(dv0);
  Grads ga = flash_backward(c, in.doutd, in.qd, in.kd, in.vd, outd, lsed, &dk0d, &dv0d, doc);
  Tensor dk_sum = empty(in.k.shape(), DType::f32), dv_sum = empty(in.k.shape(), DType::f32);
  add(dk_sum, dk0, ref.dk);
  add(dv_sum, dv0, ref.dv);
  CHECK_BF16(ga.dk, dk_sum);
  CHECK_BF16(ga.dv, dv_sum);
  return ga;
}

// A rerun of the forward and the backward gives the same bits.
void check_rerun(const Case& c, const Inputs& in, const Tensor& outd, const Tensor& lsed, const Grads& g,
                 const Tensor* doc = nullptr) {
  auto [outd2, lsed2] = flash_forward(c, in.qd, in.kd, in.vd, doc);
  CHECK(same_bits(outd2, outd));
  CHECK(same_bits(lsed2, lsed));
  Grads g2 = flash_backward(c, in.doutd, in.qd, in.kd, in.vd, outd, lsed, nullptr, nullptr, doc);
  CHECK(same_bits(g2.dq, g.dq));
  CHECK(same_bits(g2.dk, g.dk));
  CHECK(same_bits(g2.dv, g.dv));
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
    if (emulated_skip(c)) continue;
    CAPTURE_CASE(c);
    AttentionOptions o;
    o.causal = c.causal, o.q_pos0 = c.q_pos0, o.k_pos0 = c.k_pos0;
    const Inputs in = inputs(c, 1);
    const Reference ref = reference(c, in, o);

    // Forward.
    auto [outd, lsed] = flash_forward(c, in.qd, in.kd, in.vd);
    CHECK_BF16(outd, ref.out);
    CHECK_LSE(lsed, ref.lse);

    // Backward (the reference from its own forward; the kernel from the kernel's).
    Grads g = flash_backward(c, in.doutd, in.qd, in.kd, in.vd, outd, lsed);
    CHECK_BF16(g.dq, ref.dq);
    CHECK_BF16(g.dk, ref.dk);
    CHECK_BF16(g.dv, ref.dv);

    // Rows that see no key: exactly out = 0, lse = -inf, dq = 0.
    const DeadRows dead = dead_rows(c, outd, lsed, g.dq, [&](int64_t, int64_t t) {
      return c.S > 0 && (!c.causal || c.q_pos0 + t - c.k_pos0 + 1 > 0);  // sees key 0
    });
    if (c.k_pos0 > c.q_pos0) CHECK(dead.dead > 0);
    CHECK(dead.wrong == 0);

    // Accumulate: dk, dv += the contribution (ring attention's later query chunks).
    Grads ga = check_accumulate(c, in, ref, outd, lsed, 5);
    CHECK(same_bits(ga.dq, g.dq));

    // Determinism: a rerun gives the same bits (on a GPU; the emulated device's quick run leaves it out: its
    // kernels run in one fixed order).
    if (emulated_quick()) continue;
    check_rerun(c, in, outd, lsed, g);
  }
}

TEST_CASE(
    "gpu flash attention: document masks vs CPU f32 (starts in and on the edges of tiles, rows that see nothing)") {
  MT_REQUIRE_GPU();
  struct DocCase {
    Case c;
    std::vector<std::vector<int64_t>> starts;
    bool arbitrary;
  };
  for (const DocCase& dc : std::vector<DocCase>{
           // Starts inside tiles, on tile edges, a one-token document at the end; row 1 one document from 100.
           {{2, 200, 200, 4, 2, 64, true, 0, 0}, {{30, 64, 128, 150, 199}, {100}}, false},
           // Ring: keys 0..127 before queries 128..223; row 0's queries from 140 start after every key.
           {{2, 96, 128, 4, 2, 128, true, 128, 0}, {{40, 140, 200}, {100}}, false},
           // Full attention with offsets: queries from 150 see nothing.
           {{1, 100, 130, 4, 1, 128, false, 100, 0}, {{64, 120, 150}}, false},
           // Keys after the queries; tiny documents around the tile edges.
           {{1, 130, 130, 4, 2, 64, true, 0, 64}, {{1, 63, 64, 65, 127, 128, 129, 150}}, false},
           // 9 blocks deep, documents of 97 tokens.
           {{1, 520, 520, 4, 1, 128, true, 0, 0}, {{97, 194, 291, 388, 485}}, false},
           // Starts in any order.
           {{2, 150, 150, 4, 2, 64, true, 0, 0}, {}, true},
           {{1, 150, 150, 2, 1, 128, false, 0, 0}, {}, true},
       }) {
    const Case& c = dc.c;
    if (emulated_skip(c)) continue;
    CAPTURE_CASE(c);
    CAPTURE(dc.arbitrary);
    Tensor doc = doc_starts(c, dc.starts, dc.arbitrary), docd = doc.to(gpu());
    AttentionOptions o;
    o.causal = c.causal, o.q_pos0 = c.q_pos0, o.k_pos0 = c.k_pos0, o.doc_start = doc;
    const Inputs in = inputs(c, 21);
    const Reference ref = reference(c, in, o);

    auto [outd, lsed] = flash_forward(c, in.qd, in.kd, in.vd, &docd);
    CHECK_BF16(outd, ref.out);
    CHECK_LSE(lsed, ref.lse);
    Grads g = flash_backward(c, in.doutd, in.qd, in.kd, in.vd, outd, lsed, nullptr, nullptr, &docd);
    CHECK_BF16(g.dq, ref.dq);
    CHECK_BF16(g.dk, ref.dk);
    CHECK_BF16(g.dv, ref.dv);

    // Rows that see no key: exactly out = 0, lse = -inf, dq = 0.
    CHECK(dead_rows(c, outd, lsed, g.dq, [&](int64_t b, int64_t t) { return sees_a_key(c, doc, b, t); }).wrong == 0);

    // Accumulate, and the same bits on a rerun.
    check_accumulate(c, in, ref, outd, lsed, 25, &docd);
    if (!emulated_quick()) check_rerun(c, in, outd, lsed, g, &docd);  // not in the emulated quick run, as above

    // Through local attention (doc_start on the device): the same bits as the direct calls.
    const char* reference_only = std::getenv("MT_REFERENCE_ATTENTION");
    if (!(reference_only && std::string(reference_only) == "1")) {
      AttentionOptions od = o;
      od.doc_start = docd;
      Tensor out3 = nan_dev(in.qd.shape(), DType::bf16), lse3 = nan_dev({c.B, c.H, c.T}, DType::f32);
      attention_forward(out3, lse3, in.qd, in.kd, in.vd, od);
      CHECK(same_bits(out3, outd));
      CHECK(same_bits(lse3, lsed));
      Tensor dq3 = nan_dev(in.qd.shape(), DType::bf16), dk3 = nan_dev(in.kd.shape(), DType::bf16),
             dv3 = nan_dev(in.kd.shape(), DType::bf16);
      attention_backward(dq3, dk3, dv3, in.doutd, in.qd, in.kd, in.vd, outd, lsed, od);
      CHECK(same_bits(dq3, g.dq));
      CHECK(same_bits(dk3, g.dk));
      CHECK(same_bits(dv3, g.dv));
    }
  }

  // bf16 with a head dim the tensor-core kernel does not take: the f32 CUDA kernels on widened copies.
  {
    const Case c{2, 100, 100, 4, 2, 32, true, 0, 0};
    Tensor doc = doc_starts(c, {{30, 64, 99}, {70}}, false);
    AttentionOptions o;
    o.doc_start = doc;
    Tensor q = rnd({c.B, c.T, c.H, c.hd}, 31), k = rnd({c.B, c.S, c.KV, c.hd}, 32), v = rnd({c.B, c.S, c.KV, c.hd}, 33);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({c.B, c.H, c.T}, DType::f32);
    attention_forward(out, lse, q, k, v, o);
    AttentionOptions od = o;
    od.doc_start = doc.to(gpu());
    Tensor outd = nan_dev(q.shape(), DType::bf16), lsed = nan_dev({c.B, c.H, c.T}, DType::f32);
    attention_forward(outd, lsed, bf(q), bf(k), bf(v), od);
    CHECK_BF16(outd, out);
    CHECK_LSE(lsed, lse);
  }
}

TEST_CASE("gpu flash attention: unsupported arguments, empty sizes, and the dispatch of local attention") {
  MT_REQUIRE_GPU();
  // Head dims other than 64 and 128, or H not a multiple of KV: -1 before touching any pointer.
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 8, 2, 2, 32, 0.1, true, 0, 0,
                                      nullptr, stream()) == -1);
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 8, 8, 3, 2, 64, 0.1, true, 0, 0,
                                      nullptr, stream()) == -1);
  CHECK(cuda::flash_attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                       nullptr, 1, 8, 8, 2, 2, 96, 0.1, true, 0, 0, nullptr, false, stream()) == -1);
  // Nothing to do: success without a launch.
  CHECK(cuda::flash_attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 8, 2, 2, 64, 0.1, true, 0, 0,
                                      nullptr, stream()) == 0);

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
