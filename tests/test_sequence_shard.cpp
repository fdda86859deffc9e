// The sequence split of context parallel (attention/sequence_shard.h): each rank's chunk positions for none
// and head_tail, the ranks covering the sequence once, picking a shard's tokens, document starts, and the cp
// method and load-balance names.
#include <doctest/doctest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "attention/sequence_shard.h"
#include "check_error.h"
#include "runtime/kernels/ops.h"
#include "test_util.h"

using namespace mt;

TEST_CASE("sequence_shard: chunk positions for none and head_tail") {
  CHECK(sequence_parts(CpLoadBalance::none, 4) == 4);
  CHECK(sequence_parts(CpLoadBalance::head_tail, 4) == 8);
  CHECK(sequence_parts(CpLoadBalance::head_tail, 1) == 1);  // one rank holds the sequence in order
  CHECK(sequence_parts(CpLoadBalance::none, 1) == 1);
  struct Case {
    CpLoadBalance lb;
    int64_t T;
    int n, rank;
    int64_t chunk_len;
    std::vector<int64_t> chunk_pos;
  };
  const auto none = CpLoadBalance::none, ht = CpLoadBalance::head_tail;
  std::vector<Case> cases{
      {none, 24, 1, 0, 24, {0}},  {none, 24, 4, 0, 6, {0}},   {none, 24, 4, 3, 6, {18}},
      {none, 24, 3, 1, 8, {8}},   {ht, 24, 1, 0, 24, {0}},    {ht, 24, 4, 0, 3, {0, 21}},
      {ht, 24, 4, 1, 3, {3, 18}}, {ht, 24, 4, 3, 3, {9, 12}}, {ht, 24, 2, 1, 6, {6, 12}},
      {ht, 36, 6, 2, 3, {6, 27}}, {ht, 16, 8, 7, 1, {7, 8}},  {ht, 640, 8, 5, 40, {200, 400}},
  };
  for (const Case& c : cases) {
    CAPTURE(cp_load_balance_name(c.lb));
    CAPTURE(c.T);
    CAPTURE(c.n);
    CAPTURE(c.rank);
    SequenceShard sh = sequence_shard(c.lb, c.T, c.n, c.rank);
    CHECK(sh.chunk_len == c.chunk_len);
    CHECK(sh.chunk_pos == c.chunk_pos);
    CHECK(sh.size() == c.T / c.n);
  }
}

TEST_CASE("sequence_shard: the ranks' positions cover the sequence once; shard_positions; errors") {
  for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail})
    for (int n : {1, 2, 3, 4, 6, 8})
      for (int64_t k : {1, 3, 5}) {
        const int64_t T = sequence_parts(lb, n) * k;
        CAPTURE(cp_load_balance_name(lb));
        CAPTURE(n);
        CAPTURE(T);
        std::vector<int> seen(size_t(T), 0);
        for (int r = 0; r < n; ++r) {
          SequenceShard sh = sequence_shard(lb, T, n, r);
          REQUIRE(sh.size() == T / n);
          Tensor pos = shard_positions(sh);
          REQUIRE(pos.dtype() == DType::i64);
          REQUIRE(pos.shape() == Shape{T / n});
          for (int64_t t = 0; t < sh.size(); ++t) {
            const int64_t p = pos.at<int64_t>(t);
            CHECK(p == sh.position(t));
            REQUIRE((p >= 0 && p < T));
            ++seen[size_t(p)];
            if (t > 0 && t % sh.chunk_len != 0) CHECK(p == pos.at<int64_t>(t - 1) + 1);  // chunks are contiguous
          }
          // head_tail: rank r holds chunks r and 2n-1-r; none (and one rank): chunk r.
          const int64_t parts_len = T / sequence_parts(lb, n);
          if (lb == CpLoadBalance::head_tail && n > 1)
            CHECK(sh.chunk_pos == std::vector<int64_t>{r * parts_len, (2 * n - 1 - r) * parts_len});
          else CHECK(sh.chunk_pos == std::vector<int64_t>{r * parts_len});
        }
        int64_t not_once = 0;
        for (int x : seen) not_once += x != 1;
        CHECK(not_once == 0);
      }
  CHECK_ERROR_CONTAINS(sequence_shard(CpLoadBalance::head_tail, 12, 4, 0), "[attention]");  // 12 % 8
  CHECK_ERROR_CONTAINS(sequence_shard(CpLoadBalance::none, 10, 4, 0), "[attention]");
  CHECK_ERROR_CONTAINS(sequence_shard(CpLoadBalance::head_tail, 6, 2, 0), "[attention]");  // 6 % 4
  CHECK(sequence_shard(CpLoadBalance::head_tail, 7, 1, 0).chunk_len == 7);                 // one rank: any length
}

TEST_CASE("shard_sequence: picks the shard's tokens in local order, (B, T) and (B, T, H, hd)") {
  const int64_t B = 2, T = 24, H = 3, hd = 2;
  // Values encode (b, t, e): b * 1000 + t * 10 + e.
  Tensor x4 = empty({B, T, H, hd}, DType::f64), x2 = empty({B, T}, DType::i64), x3 = empty({B, T, 5}, DType::f32);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < H * hd; ++e) x4.at<double>((b * T + t) * H * hd + e) = double(b * 1000 + t * 10 + e);
      for (int64_t e = 0; e < 5; ++e) x3.at<float>((b * T + t) * 5 + e) = float(b * 1000 + t * 10 + e);
      x2.at<int64_t>(b * T + t) = b * 1000 + t * 10;
    }
  for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail})
    for (int n : {1, 2, 3, 4})
      for (int r = 0; r < n; ++r) {
        CAPTURE(cp_load_balance_name(lb));
        CAPTURE(n);
        CAPTURE(r);
        SequenceShard sh = sequence_shard(lb, T, n, r);
        const int64_t Tl = sh.size();
        Tensor y4 = shard_sequence(x4, sh), y2 = shard_sequence(x2, sh), y3 = shard_sequence(x3, sh);
        REQUIRE(y4.shape() == Shape{B, Tl, H, hd});
        REQUIRE(y2.shape() == Shape{B, Tl});
        REQUIRE(y3.shape() == Shape{B, Tl, 5});
        CHECK(y4.dtype() == DType::f64);
        CHECK(y2.dtype() == DType::i64);
        CHECK(y3.dtype() == DType::f32);
        int64_t wrong = 0;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < Tl; ++t) {
            const int64_t p = sh.position(t);
            for (int64_t e = 0; e < H * hd; ++e)
              wrong += y4.at<double>((b * Tl + t) * H * hd + e) != double(b * 1000 + p * 10 + e);
            for (int64_t e = 0; e < 5; ++e) wrong += y3.at<float>((b * Tl + t) * 5 + e) != float(b * 1000 + p * 10 + e);
            wrong += y2.at<int64_t>(b * Tl + t) != b * 1000 + p * 10;
          }
        CHECK(wrong == 0);
        // A copy: writing it leaves the source alone.
        y2.at<int64_t>(0) = -5;
        CHECK(x2.at<int64_t>(0) == 0);
      }
}

TEST_CASE("document_starts: hand-made rows") {
  const int32_t sep = 7;
  struct Case {
    const char* what;
    std::vector<int32_t> tokens;
    std::vector<int64_t> starts;
  };
  std::vector<Case> cases{
      {"separator at 0 and in the middle", {7, 1, 2, 7, 3, 4, 5, 6}, {0, 0, 0, 3, 3, 3, 3, 3}},
      {"tokens before the first separator start at 0", {1, 2, 7, 3, 4, 5, 6, 1}, {0, 0, 2, 2, 2, 2, 2, 2}},
      {"consecutive separators", {1, 7, 7, 7, 2, 3, 7, 4}, {0, 1, 2, 3, 3, 3, 6, 6}},
      {"no separator", {1, 2, 3, 4, 5, 6, 0, 8}, {0, 0, 0, 0, 0, 0, 0, 0}},
      {"separator last", {1, 2, 3, 4, 5, 6, 0, 7}, {0, 0, 0, 0, 0, 0, 0, 7}},
      {"all separators", {7, 7, 7, 7, 7, 7, 7, 7}, {0, 1, 2, 3, 4, 5, 6, 7}},
  };
  // Each row alone, then all rows as one batch (rows are independent).
  const int64_t T = 8, B = int64_t(cases.size());
  Tensor all = empty({B, T}, DType::i32);
  for (int64_t b = 0; b < B; ++b) {
    const Case& c = cases[size_t(b)];
    INFO(c.what);
    Tensor tok = empty({1, T}, DType::i32);
    for (int64_t t = 0; t < T; ++t) all.at<int32_t>(b * T + t) = tok.at<int32_t>(t) = c.tokens[size_t(t)];
    Tensor d = document_starts(tok, sep);
    REQUIRE(d.shape() == Shape{1, T});
    REQUIRE(d.dtype() == DType::i64);
    std::vector<int64_t> got(d.data<int64_t>(), d.data<int64_t>() + T);
    CHECK(got == c.starts);
  }
  Tensor d = document_starts(all, sep);
  REQUIRE(d.shape() == Shape{B, T});
  for (int64_t b = 0; b < B; ++b) {
    INFO(cases[size_t(b)].what);
    std::vector<int64_t> got(d.data<int64_t>() + b * T, d.data<int64_t>() + (b + 1) * T);
    CHECK(got == cases[size_t(b)].starts);
  }
  // Another separator value: 7 is then an ordinary token.
  Tensor d1 = document_starts(all, 1);
  std::vector<int64_t> row0(d1.data<int64_t>(), d1.data<int64_t>() + T);
  CHECK(row0 == std::vector<int64_t>{0, 1, 1, 1, 1, 1, 1, 1});
}

TEST_CASE("cp method and load balance names") {
  CHECK(cp_method_from_name("ring", "parallel.cp_method") == CpMethod::ring);
  CHECK(cp_method_from_name("all_gather", "parallel.cp_method") == CpMethod::all_gather);
  CHECK(cp_load_balance_from_name("none", "parallel.cp_load_balance") == CpLoadBalance::none);
  CHECK(cp_load_balance_from_name("head_tail", "parallel.cp_load_balance") == CpLoadBalance::head_tail);
  for (CpMethod m : {CpMethod::ring, CpMethod::all_gather}) CHECK(cp_method_from_name(cp_method_name(m), "k") == m);
  for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail})
    CHECK(cp_load_balance_from_name(cp_load_balance_name(lb), "k") == lb);
  CHECK(cp_method_name(CpMethod::all_gather) == "all_gather");
  CHECK(cp_load_balance_name(CpLoadBalance::head_tail) == "head_tail");
  for (const char* bad : {"Ring", "", "allgather", "none", "head_tail"}) {
    CAPTURE(bad);
    CHECK_ERROR_CONTAINS(cp_method_from_name(bad, "parallel.cp_method"), "parallel.cp_method");
    CHECK_ERROR_CONTAINS(cp_method_from_name(bad, "parallel.cp_method"), "all_gather");
  }
  for (const char* bad : {"None", "", "headtail", "ring", "zigzag"}) {
    CAPTURE(bad);
    CHECK_ERROR_CONTAINS(cp_load_balance_from_name(bad, "parallel.cp_load_balance"), "parallel.cp_load_balance");
    CHECK_ERROR_CONTAINS(cp_load_balance_from_name(bad, "parallel.cp_load_balance"), "head_tail");
  }
}

TEST_CASE("cp_shard: a cp_ring rank's tokens split again, in order, over cp_ulysses") {
  const auto none = CpLoadBalance::none, ht = CpLoadBalance::head_tail;
  // head_tail over 2 ring ranks of 32 tokens: ring rank 1 holds [8, 16) [16, 24); over 2 Ulysses ranks
  // each takes one chunk; over 4, half a chunk each.
  SequenceShard a = cp_shard(ht, 32, 2, 1, 2, 1);
  CHECK(a.chunk_len == 8);
  CHECK(a.chunk_pos == std::vector<int64_t>{16});
  SequenceShard b = cp_shard(ht, 32, 2, 0, 4, 1);  // ring rank 0: [0, 8) [24, 32) -> rank 1 of 4: [4, 8)
  CHECK(b.chunk_len == 4);
  CHECK(b.chunk_pos == std::vector<int64_t>{4});
  SequenceShard c = cp_shard(ht, 24, 2, 0, 4, 1);  // [0, 6) [18, 24) in runs of 3 -> rank 1 of 4: [3, 6)
  CHECK(c.chunk_len == 3);
  CHECK(c.chunk_pos == std::vector<int64_t>{3});
  // A part that crosses the ring rank's chunk boundary: ring rank 0 of 2 holds [0, 12) [36, 48); its second of
  // 3 parts is local [8, 16) = [8, 12) [36, 40), in runs of gcd(12, 8) = 4.
  SequenceShard d = cp_shard(ht, 48, 2, 0, 3, 1);
  CHECK(d.chunk_len == 4);
  CHECK(d.chunk_pos == std::vector<int64_t>{8, 36});
  SequenceShard e = cp_shard(none, 24, 1, 0, 4, 3);  // Ulysses alone: contiguous quarters
  CHECK(e.chunk_len == 6);
  CHECK(e.chunk_pos == std::vector<int64_t>{18});
  // Every (ring, ulysses) split covers the sequence exactly once, and the Ulysses parts of a ring rank, in
  // Ulysses order, are the ring rank's tokens in its local order.
  for (CpLoadBalance lb : {none, ht})
    for (auto [r, u] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}, {2, 4}, {4, 2}, {3, 2}, {1, 8}}) {
      const int64_t T = 48;
      CAPTURE(r);
      CAPTURE(u);
      std::multiset<int64_t> seen;
      for (int i = 0; i < r; ++i) {
        SequenceShard ring = sequence_shard(lb, T, r, i);
        std::vector<int64_t> order;
        for (int j = 0; j < u; ++j) {
          SequenceShard s = cp_shard(lb, T, r, i, u, j);
          CHECK(s.size() == T / (r * u));
          for (int64_t t = 0; t < s.size(); ++t) order.push_back(s.position(t)), seen.insert(s.position(t));
        }
        for (int64_t t = 0; t < ring.size(); ++t) CHECK(order[size_t(t)] == ring.position(t));
      }
      CHECK(seen.size() == size_t(T));
      CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == size_t(T));
    }
  CHECK_ERROR_CONTAINS(sub_shard(sequence_shard(ht, 24, 2, 0), 5, 0), "12 tokens do not split into 5 equal parts");
}
