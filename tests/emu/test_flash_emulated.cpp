// The tensor-core flash attention kernels (runtime/kernels/cuda/flash_attention.cu) run on the CPU by the warp
// emulator (cuda_emulator.h) and checked against attention computed in double from the same bf16 inputs:
// out, dq, dk, dv within 1e-2 relative (norm of the difference over the norm of the reference), lse within
// 1e-4, exact zeros and -inf for query rows that see no key, NaN never passes, outputs and shared memory
// poisoned, guard zones around every buffer untouched, same bits on a rerun, and (counting the emulated mma)
// only the (query block, key block) pairs with a visible (query, key) computed. This checks the kernels' logic
// (tiling, tails, causal, ring-offset and document masks, block skipping, grouped-query, the cp.async pipeline,
// the fragment layouts) where no GPU is; tests/gpu/test_gpu_flash.cpp checks the same contract on the hardware.
//   test_flash_emulated            a fast selection of shapes
//   MT_TEST_FULL=1 test_flash_emulated   every shape
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "tests/emu/cuda_emulator.h"
// The kernel source itself, compiled for the emulator.
#include "runtime/kernels/cuda/flash_attention.cu"

#include <algorithm>
#include <random>
#include <string>

namespace {

uint16_t to_bits(double x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(float(x));
  uint16_t u;
  std::memcpy(&u, &b, 2);
  return u;
}
double from_bits(uint16_t u) {
  const uint32_t w = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// A buffer with guard zones on both sides (a pattern the kernels must not overwrite); the interior is
// registered as readable for cp.async.
template <typename T> struct Guarded {
  static constexpr size_t kGuard = 64;
  std::vector<T> all;
  size_t n;
  explicit Guarded(size_t count, T fill) : all(count + 2 * kGuard), n(count) {
    std::memset(all.data(), 0xa5, all.size() * sizeof(T));
    std::fill(all.begin() + kGuard, all.begin() + long(kGuard + n), fill);
  }
  T* data() { return all.data() + kGuard; }
  const T* data() const { return all.data() + kGuard; }
  T& operator[](size_t i) { return all[kGuard + i]; }
  const T& operator[](size_t i) const { return all[kGuard + i]; }
  void allow() const { emu::allow_reads(data(), n * sizeof(T)); }
  bool guards_intact() const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(all.data());
    const size_t g = kGuard * sizeof(T), tail = (kGuard + n) * sizeof(T);
    for (size_t i = 0; i < g; ++i)
      if (p[i] != 0xa5 || p[tail + i] != 0xa5) return false;
    return true;
  }
  std::vector<T> interior() const { return std::vector<T>(data(), data() + n); }
};

Guarded<uint16_t> random_bf16(size_t n, uint64_t seed) {
  Guarded<uint16_t> b(n, 0);
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0, 1);
  for (size_t i = 0; i < n; ++i) b[i] = to_bits(d(g));
  return b;
}

// ||got - want|| / ||want|| over entries; an inf must match exactly, a NaN fails.
double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}
std::vector<double> widen(const Guarded<uint16_t>& b) {
  std::vector<double> r(b.n);
  for (size_t i = 0; i < b.n; ++i) r[i] = from_bits(b[i]);
  return r;
}

struct Case {
  int64_t B, T, S, H, KV, hd;
  bool causal;
  int64_t q_pos0, k_pos0;
  bool fast;  // in the default selection
};

// Document masks: per batch row (the last list serves the rows past it), the global positions where documents
// start; query t's document starts at the largest of them <= q_pos0 + t (0 if none). arbitrary instead: random
// starts in [0, q_pos0 + t + 1], not ordered along t (the kernels must not rely on order), seeded.
struct Docs {
  std::vector<std::vector<int64_t>> starts;
  bool arbitrary = false;
};

std::string name(const Case& c, const Docs* docs = nullptr) {
  std::string n = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " S" + std::to_string(c.S) + " H" +
                  std::to_string(c.H) + " KV" + std::to_string(c.KV) + " hd" + std::to_string(c.hd) +
                  (c.causal ? " causal" : " full") + " q_pos0 " + std::to_string(c.q_pos0) + " k_pos0 " +
                  std::to_string(c.k_pos0);
  if (docs && docs->arbitrary) n += " docs: arbitrary";
  if (docs && !docs->arbitrary) {
    n += " docs:";
    for (const auto& row : docs->starts) {
      n += " {";
      for (int64_t x : row) n += " " + std::to_string(x);
      n += " }";
    }
  }
  return n;
}

// doc_start (B, T) of docs.
std::vector<int64_t> doc_starts(const Case& c, const Docs& docs) {
  std::vector<int64_t> r(size_t(c.B * c.T), 0);
  std::mt19937_64 g(7);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t pos = c.q_pos0 + t;
      int64_t& x = r[size_t(b * c.T + t)];
      if (docs.arbitrary) {
        x = int64_t(g() % uint64_t(pos + 2));
        continue;
      }
      for (int64_t s : docs.starts[size_t(std::min<int64_t>(b, int64_t(docs.starts.size()) - 1))])
        if (s <= pos) x = std::max(x, s);
    }
  return r;
}

// The keys query t of row b sees: [lo, hi), empty when lo >= hi. doc: doc_start (B, T), or null.
std::pair<int64_t, int64_t> seen_keys(const Case& c, const int64_t* doc, int64_t b, int64_t t) {
  const int64_t hi = c.causal ? std::clamp<int64_t>(c.q_pos0 + t - c.k_pos0 + 1, 0, c.S) : c.S;
  const int64_t lo = doc ? std::clamp<int64_t>(doc[b * c.T + t] - c.k_pos0, 0, c.S) : 0;
  return {lo, hi};
}

// (batch, q head, block of `rows` queries, block of `keys` keys) with at least one visible (query, key), blocks
// aligned to their sizes: the work of the kernels, whose warps each compute such pairs (a warp's 16 MT query rows
// against a 64-key block in the forward and dQ kernels, 64 queries against its 16 MT keys in the dK/dV kernel).
int64_t visible_pairs(const Case& c, const int64_t* doc, int64_t rows, int64_t keys) {
  const int64_t n_qb = (c.T + rows - 1) / rows, n_kb = (c.S + keys - 1) / keys;
  int64_t n = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t qb = 0; qb < n_qb; ++qb)
      for (int64_t kb = 0; kb < n_kb; ++kb) {
        bool seen = false;
        for (int64_t t = qb * rows; t < std::min(c.T, qb * rows + rows) && !seen; ++t) {
          const auto [lo, hi] = seen_keys(c, doc, b, t);
          seen = std::max(lo, kb * keys) < std::min(hi, kb * keys + keys);
        }
        n += seen;
      }
  return n * c.H;
}

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

// Attention in double: softmax(scale q k^T) v where query t sees key s iff k_pos0 + s <= q_pos0 + t (causal)
// and doc[b, t] <= k_pos0 + s (doc not null), and its gradients.
Reference reference(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout, double scale, const int64_t* doc) {
  const int64_t B = c.B, T = c.T, S = c.S, H = c.H, KV = c.KV, hd = c.hd, G = H / KV;
  Reference r;
  r.out.assign(q.size(), 0), r.lse.assign(size_t(B * H * T), 0), r.dq.assign(q.size(), 0);
  r.dk.assign(k.size(), 0), r.dv.assign(k.size(), 0);
  auto qi = [&](int64_t b, int64_t t, int64_t h) { return size_t(((b * T + t) * H + h) * hd); };
  auto ki = [&](int64_t b, int64_t s, int64_t j) { return size_t(((b * S + s) * KV + j) * hd); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t j = h / G;
        const auto [lo, hi] = seen_keys(c, doc, b, t);
        if (lo >= hi) {
          r.lse[size_t((b * H + h) * T + t)] = -INFINITY;
          continue;
        }
        std::vector<double> p(static_cast<size_t>(hi - lo));  // p[s - lo]
        double mx = -INFINITY;
        for (int64_t s = lo; s < hi; ++s) {
          double a = 0;
          for (int64_t x = 0; x < hd; ++x) a += q[qi(b, t, h) + size_t(x)] * k[ki(b, s, j) + size_t(x)];
          p[size_t(s - lo)] = a * scale;
          mx = std::max(mx, p[size_t(s - lo)]);
        }
        double l = 0;
        for (auto& x : p) l += (x = std::exp(x - mx));
        r.lse[size_t((b * H + h) * T + t)] = mx + std::log(l);
        for (auto& x : p) x /= l;
        double D = 0;
        for (int64_t x = 0; x < hd; ++x) {
          double o = 0;
          for (int64_t s = lo; s < hi; ++s) o += p[size_t(s - lo)] * v[ki(b, s, j) + size_t(x)];
          r.out[qi(b, t, h) + size_t(x)] = o;
          D += dout[qi(b, t, h) + size_t(x)] * o;
        }
        for (int64_t s = lo; s < hi; ++s) {
          double dp = 0;
          for (int64_t x = 0; x < hd; ++x) dp += dout[qi(b, t, h) + size_t(x)] * v[ki(b, s, j) + size_t(x)];
          const double ds = p[size_t(s - lo)] * (dp - D) * scale;
          for (int64_t x = 0; x < hd; ++x) {
            r.dq[qi(b, t, h) + size_t(x)] += ds * k[ki(b, s, j) + size_t(x)];
            r.dk[ki(b, s, j) + size_t(x)] += ds * q[qi(b, t, h) + size_t(x)];
            r.dv[ki(b, s, j) + size_t(x)] += p[size_t(s - lo)] * dout[qi(b, t, h) + size_t(x)];
          }
        }
      }
  return r;
}

// The mma instructions the kernels compute for the visible pairs of doc (visible_pairs), with the m tiles per warp
// the launchers choose (tiling): a warp's 16 MT rows against 64 keys cost MT hd / 2 mma per product (forward: Q K^T,
// P V; dQ: S, dP, dS K), its 16 MT keys against 64 queries MT hd / 2 per product too (S^T, dP^T, P^T dO, dS^T Q).
int64_t fwd_mma(const Case& c, const int64_t* doc) {
  const int mt = c.hd == 64 ? mt::cuda::tiling<64>().fwd : mt::cuda::tiling<128>().fwd;
  return visible_pairs(c, doc, 16 * mt, 64) * 2 * (mt * c.hd / 2);
}
int64_t bwd_mma(const Case& c, const int64_t* doc) {
  const auto t = c.hd == 64 ? mt::cuda::tiling<64>() : mt::cuda::tiling<128>();
  return visible_pairs(c, doc, 16 * t.dq, 64) * 3 * (t.dq * c.hd / 2) +
         visible_pairs(c, doc, 64, 16 * t.dkdv) * 4 * (t.dkdv * c.hd / 2);
}

void check_case(const Case& c, const Docs* docs = nullptr) {
  INFO(name(c, docs));
  const size_t nq = size_t(c.B * c.T * c.H * c.hd), nk = size_t(c.B * c.S * c.KV * c.hd), nl = size_t(c.B * c.H * c.T);
  const double scale = 1.0 / std::sqrt(double(c.hd));
  auto q = random_bf16(nq, 1), k = random_bf16(nk, 2), v = random_bf16(nk, 3), dout = random_bf16(nq, 4);
  auto dk0 = random_bf16(nk, 5), dv0 = random_bf16(nk, 6);
  Guarded<int64_t> doc_buf(docs ? size_t(c.B * c.T) : 0, 0);
  if (docs) {
    const std::vector<int64_t> ds = doc_starts(c, *docs);
    std::copy(ds.begin(), ds.end(), doc_buf.data());
  }
  const int64_t* doc = docs ? doc_buf.data() : nullptr;  // the kernels read it directly (not through cp.async)
  const Reference ref = reference(c, widen(q), widen(k), widen(v), widen(dout), scale, doc);

  constexpr uint16_t kNaN = 0x7fc0;
  Guarded<uint16_t> out(nq, kNaN), out2(nq, kNaN), dq(nq, kNaN), dk(nk, kNaN), dv(nk, kNaN), dq2(nq, kNaN);
  Guarded<float> lse(nl, NAN), lse2(nl, NAN);
  Guarded<float> scratch(mt::cuda::flash_attention_backward_scratch_bytes(c.B, c.T, c.S, c.H, c.KV, c.hd) / 4, NAN);
  Guarded<uint16_t> dka = dk0, dva = dv0;  // accumulate onto these
  emu::clear_reads();
  for (const auto* b : {&q, &k, &v, &dout, &out}) b->allow();

  using namespace mt::cuda;
  const long long mma0 = emu::mma_count.load();
  REQUIRE(flash_attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), c.B, c.T, c.S, c.H, c.KV, c.hd,
                                  scale, c.causal, c.q_pos0, c.k_pos0, doc, nullptr) == 0);
  const long long mma1 = emu::mma_count.load();
  REQUIRE(flash_attention_forward(out2.data(), lse2.data(), q.data(), k.data(), v.data(), c.B, c.T, c.S, c.H, c.KV,
                                  c.hd, scale, c.causal, c.q_pos0, c.k_pos0, doc, nullptr) == 0);
  CHECK(out.interior() == out2.interior());
  CHECK(std::memcmp(lse.data(), lse2.data(), nl * sizeof(float)) == 0);
  lse.allow();
  const long long mma2 = emu::mma_count.load();
  REQUIRE(flash_attention_backward(dq.data(), dk.data(), dv.data(), scratch.data(), dout.data(), q.data(), k.data(),
                                   v.data(), out.data(), lse.data(), c.B, c.T, c.S, c.H, c.KV, c.hd, scale, c.causal,
                                   c.q_pos0, c.k_pos0, doc, false, nullptr) == 0);
  const long long mma3 = emu::mma_count.load();
  REQUIRE(flash_attention_backward(dq2.data(), dka.data(), dva.data(), scratch.data(), dout.data(), q.data(), k.data(),
                                   v.data(), out.data(), lse.data(), c.B, c.T, c.S, c.H, c.KV, c.hd, scale, c.causal,
                                   c.q_pos0, c.k_pos0, doc, true, nullptr) == 0);

  // Block skipping: exactly the (warp rows, key block) pairs with a visible (query, key) are computed. With
  // document starts not ordered along t, blocks between visible ones may be visited (masked): at least the
  // visible pairs then, at most those of the same call without the document mask.
  if (!docs || !docs->arbitrary) {
    CHECK(mma1 - mma0 == fwd_mma(c, doc));
    CHECK(mma3 - mma2 == bwd_mma(c, doc));
  } else {
    CHECK(mma1 - mma0 >= fwd_mma(c, doc));
    CHECK(mma1 - mma0 <= fwd_mma(c, nullptr));
    CHECK(mma3 - mma2 >= bwd_mma(c, doc));
    CHECK(mma3 - mma2 <= bwd_mma(c, nullptr));
  }
  if (docs && !docs->arbitrary) CHECK(fwd_mma(c, doc) < fwd_mma(c, nullptr));  // the mask saves work

  const std::vector<double> lse_got(lse.data(), lse.data() + nl);
  std::vector<double> dka_want(nk), dva_want(nk);
  for (size_t i = 0; i < nk; ++i)
    dka_want[i] = from_bits(dk0[i]) + ref.dk[i], dva_want[i] = from_bits(dv0[i]) + ref.dv[i];
  CHECK(rel_err(widen(out), ref.out) < 1e-2);
  CHECK(rel_err(lse_got, ref.lse) < 1e-4);
  CHECK(rel_err(widen(dq), ref.dq) < 1e-2);
  CHECK(rel_err(widen(dk), ref.dk) < 1e-2);
  CHECK(rel_err(widen(dv), ref.dv) < 1e-2);
  CHECK(rel_err(widen(dka), dka_want) < 1e-2);
  CHECK(rel_err(widen(dva), dva_want) < 1e-2);
  CHECK(dq.interior() == dq2.interior());  // deterministic: the same bits on a rerun

  // Rows that see no key: out = 0 and dq = 0 exactly, lse = -inf.
  int wrong = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      if (const auto [lo, hi] = seen_keys(c, doc, b, t); lo < hi) continue;
      for (int64_t h = 0; h < c.H; ++h) {
        wrong += lse[size_t((b * c.H + h) * c.T + t)] != -INFINITY;
        for (int64_t x = 0; x < c.hd; ++x) {
          const size_t i = size_t(((b * c.T + t) * c.H + h) * c.hd + x);
          wrong += out[i] != 0 || dq[i] != 0;
        }
      }
    }
  CHECK(wrong == 0);
  for (const auto* b : {&out, &out2, &dq, &dq2, &dk, &dv, &dka, &dva}) CHECK(b->guards_intact());
  for (const auto* b : {&lse, &lse2, &scratch}) CHECK(b->guards_intact());
  CHECK(doc_buf.guards_intact());
}

// Shapes: tails (T, S not multiples of 64), GQA groups 1-4, both head dims, ring-attention offsets (a shard of
// queries after, before or overlapping the keys), rows that see no key, empty T or S.
const Case kCases[] = {
    {1, 100, 100, 4, 2, 64, true, 0, 0, true},     // causal, GQA 2, tails
    {1, 130, 130, 2, 2, 128, true, 0, 0, false},   // hd 128, 3 blocks
    {1, 130, 130, 4, 2, 128, false, 0, 0, false},  // full attention
    {1, 100, 70, 2, 1, 64, false, 0, 0, true},     // full, S < T, GQA 2
    {1, 128, 128, 2, 1, 64, true, 64, 0, false},   // ring: queries after the keys start
    {1, 128, 128, 2, 2, 128, true, 0, 64, true},   // ring: keys start later, the first 64 rows see nothing
    {2, 70, 150, 2, 1, 64, true, 100, 10, false},  // B 2, S > T
    {1, 1, 5, 2, 2, 64, true, 0, 3, true},         // one query, sees no key
    {1, 65, 0, 2, 1, 64, true, 0, 0, true},        // no keys
    {1, 0, 65, 2, 1, 64, true, 0, 0, true},        // no queries: dk, dv zero
    {1, 200, 200, 4, 1, 64, true, 0, 0, false},    // GQA 4, 4 blocks
    {1, 64, 192, 2, 1, 128, true, 128, 0, false},  // ring: the last shard
    {1, 1, 1, 1, 1, 128, false, 0, 0, true},       // smallest
    {1, 3, 5, 2, 1, 64, false, 0, 0, true},       {1, 150, 40, 2, 2, 128, true, 0, 30, false},  // S < T with offset
    {2, 90, 90, 2, 2, 64, true, 5, 100, true},                                                  // every row masked
};

// Document masks (packed sequences): document starts inside a tile and on tile edges, one-token documents,
// rows whose document starts after every key (they see nothing), tiles that see no key at all, causal and full,
// GQA, both head dims, ring-attention offsets, starts in any order.
const std::pair<Case, Docs> kDocCases[] = {
    // Starts inside tile 0, on the edge of tile 1, inside it, and a one-token document at the end (the tail
    // tile): tile 1 skips key block 0, tile 2 skips key block 0.
    {{1, 130, 130, 2, 1, 64, true, 0, 0, true}, {{{30, 64, 100, 129}}}},
    // Ring: the keys are the chunk before the queries (positions 0..127, queries 128..223). Row 0: queries
    // 128..139 see keys 40..127, queries 140.. start their document after every key: see nothing (query
    // block 1 computes no key block). Row 1: one document from 100.
    {{2, 96, 128, 2, 1, 64, true, 128, 0, true}, {{{40, 140, 200}, {100}}}},
    // Full attention, hd 128, offsets: queries at 100..169 see keys from their document's start on; from 150
    // on, none.
    {{1, 70, 130, 1, 1, 128, false, 100, 0, true}, {{{64, 120, 150}}}},
    // MT_TEST_FULL only.
    {{1, 130, 130, 4, 1, 128, true, 0, 0, false}, {{{1, 63, 64, 65, 127, 128, 129}}}},  // GQA 4, tiny documents
    {{1, 192, 128, 2, 2, 64, true, 0, 64, false}, {{{10, 70, 128}}}},                   // keys after the queries
    {{2, 150, 150, 2, 1, 64, true, 0, 0, false}, {{}, true}},                           // starts in any order
    {{2, 90, 100, 4, 2, 128, true, 80, 0, false}, {{{0}, {100, 150}}}},  // row 1: queries from 100 see nothing
    {{1, 70, 130, 2, 1, 64, false, 0, 0, false}, {{{5, 64, 69}}}},       // full, S > T
};

}  // namespace

TEST_CASE("flash attention kernels, emulated, against attention in double") {
  const bool full = std::getenv("MT_TEST_FULL") != nullptr;
  for (const Case& c : kCases) {
    if (!full && !c.fast) continue;
    check_case(c);
  }
  for (const auto& [c, docs] : kDocCases) {
    if (!full && !c.fast) continue;
    check_case(c, &docs);
  }
  MESSAGE("mma instructions emulated: " << emu::mma_count.load() << ", largest shared memory " << emu::max_smem.load()
                                        << " bytes");
}

TEST_CASE("flash attention launchers refuse what the kernels do not take") {
  using namespace mt::cuda;
  std::vector<uint16_t> buf(1024 + 8);
  std::vector<float> f(64);
  void* p = buf.data();
  CHECK(flash_attention_forward(p, f.data(), p, p, p, 1, 4, 4, 2, 1, 96, 0.1, true, 0, 0, nullptr, nullptr) ==
        -1);  // hd
  CHECK(flash_attention_forward(p, f.data(), p, p, p, 1, 4, 4, 3, 2, 64, 0.1, true, 0, 0, nullptr, nullptr) ==
        -1);                                                     // H % KV
  void* odd = reinterpret_cast<unsigned char*>(buf.data()) + 2;  // not 16-byte aligned
  CHECK(flash_attention_forward(odd, f.data(), p, p, p, 1, 4, 4, 2, 1, 64, 0.1, true, 0, 0, nullptr, nullptr) == -1);
  CHECK(flash_attention_forward(p, f.data(), p, p, p, 1, int64_t(65536) * 64 + 1, 4, 2, 1, 64, 0.1, true, 0, 0, nullptr,
                                nullptr) == -1);  // grid.y
}
