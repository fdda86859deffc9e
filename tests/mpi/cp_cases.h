// What the context-parallel attention tests share (test_ring_attention.cpp, test_ulysses.cpp): packed
// documents that cross every chunk boundary, the single-rank result each shard is compared with, a shard's
// columns of a (B, H, T) log-sum-exp, and its error.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "../test_util.h"
#include "attention/local_attention.h"
#include "attention/sequence_shard.h"
#include "runtime/kernels/ops.h"

namespace mt::test {

// Tokens (B = 2, T) in [1, 50] with `separator` placed for a sequence cut into chunks of c tokens: row 0:
// documents from c/2 + 1 (crossing into the next chunk) up to T/2 + 1 (spanning chunks of several ranks),
// from there to T - 2, and the last two tokens; row 1: one-token documents at 0 and 1, one from c (a chunk
// boundary), one from T - c - 1 (crossing into the last chunk).
inline Tensor document_tokens(int64_t T, int64_t c, int32_t separator, uint64_t seed) {
  const int64_t B = 2;
  Tensor tok = empty({B, T}, DType::i32);
  std::mt19937_64 g{seed};
  for (int64_t i = 0; i < tok.numel(); ++i) tok.at<int32_t>(i) = int32_t(1 + g() % 50);
  const std::vector<std::vector<int64_t>> seps{{c / 2 + 1, T / 2 + 1, T - 2}, {0, 1, c, T - c - 1}};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p : seps[size_t(b)])
      if (p >= 0 && p < T) tok.at<int32_t>(b * T + p) = separator;
  return tok;
}

// The single-rank result over the whole sequence, in f64.
struct CpReference {
  Tensor q, k, v, dout, doc_start;  // full inputs (f64), doc_start (B, T) i64 or undefined
  Tensor out, lse, dq, dk, dv;
};
// q and dout (B, T, H, hd), k and v (B, T, KV, hd) drawn from seed .. seed + 3; doc_start: the documents' starts
// (undefined: one causal or full sequence).
inline CpReference cp_reference(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t hd, bool causal, double scale,
                                const Tensor& doc_start, uint64_t seed) {
  CpReference r;
  r.q = randn({B, T, H, hd}, seed), r.k = randn({B, T, KV, hd}, seed + 1);
  r.v = randn({B, T, KV, hd}, seed + 2), r.dout = randn({B, T, H, hd}, seed + 3);
  r.doc_start = doc_start;
  AttentionOptions o{causal, scale, 0, 0, r.doc_start};
  r.out = empty(r.q.shape(), DType::f64), r.lse = empty({B, H, T}, DType::f64);
  attention_forward(r.out, r.lse, r.q, r.k, r.v, o);
  r.dq = empty(r.q.shape(), DType::f64), r.dk = empty(r.k.shape(), DType::f64), r.dv = empty(r.v.shape(), DType::f64);
  attention_backward(r.dq, r.dk, r.dv, r.dout, r.q, r.k, r.v, r.out, r.lse, o);
  return r;
}

// The shard's columns of a (B, H, T) lse: (B, H, T_local).
inline Tensor shard_lse(const Tensor& lse, const SequenceShard& sh) {
  Tensor out = empty({lse.size(0), lse.size(1), sh.size()}, lse.dtype());
  for (size_t c = 0; c < sh.chunk_pos.size(); ++c)
    copy_slice(out, int64_t(c) * sh.chunk_len, lse, sh.chunk_pos[c], sh.chunk_len, 2);
  return out;
}

// lse: -inf exactly where want is (counted in mismatched_inf otherwise); elsewhere the largest
// |got - want| / max(1, |want|); NaN if got holds a NaN.
inline double lse_err(const Tensor& got, const Tensor& want, int64_t& mismatched_inf) {
  auto a = to_f64(got), w = to_f64(want);
  REQUIRE(a.size() == w.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return NAN;
    if (std::isinf(w[i]) || std::isinf(a[i])) {
      mismatched_inf += !(a[i] == w[i] && w[i] < 0);
      continue;
    }
    worst = std::max(worst, std::abs(a[i] - w[i]) / std::max(1.0, std::abs(w[i])));
  }
  return worst;
}

}  // namespace mt::test
