#include "attention/sequence_shard.h"

#include <utility>

#include "runtime/core/error.h"
#include "runtime/kernels/ops.h"

namespace mt {

// One rank holds the whole sequence in order, whatever the balancing.
int64_t sequence_parts(CpLoadBalance lb, int n) { return lb == CpLoadBalance::head_tail && n > 1 ? 2 * int64_t(n) : n; }

SequenceShard sequence_shard(CpLoadBalance lb, int64_t T, int n, int rank) {
  const int64_t parts = sequence_parts(lb, n);
  MT_CHECK(n >= 1 && rank >= 0 && rank < n, "attention", "sequence_shard: rank {} of {}", rank, n);
  MT_CHECK(T % parts == 0, "attention",
           "sequence_shard: a sequence of {} tokens does not split into {} equal chunks "
           "({} over {} ranks)",
           T, parts, cp_load_balance_name(lb), n);
  SequenceShard s;
  s.chunk_len = T / parts;
  if (parts == 2 * int64_t(n)) s.chunk_pos = {rank * s.chunk_len, (parts - 1 - rank) * s.chunk_len};
  else s.chunk_pos = {rank * s.chunk_len};
  return s;
}

SequenceShard sub_shard(const SequenceShard& s, int n, int rank) {
  MT_CHECK(n >= 1 && rank >= 0 && rank < n, "attention", "sub_shard: rank {} of {}", rank, n);
  MT_CHECK(s.size() % n == 0, "attention", "sub_shard: {} tokens do not split into {} equal parts", s.size(), n);
  const int64_t len = s.size() / n;
  // Runs of g tokens: g divides both the chunk length and the part, so each run lies inside one chunk.
  int64_t g = s.chunk_len, b = len;
  while (b) g = std::exchange(b, g % b);
  SequenceShard out;
  out.chunk_len = g;
  for (int64_t t = rank * len; t < (rank + 1) * len; t += g) out.chunk_pos.push_back(s.position(t));
  return out;
}

SequenceShard cp_shard(CpLoadBalance lb, int64_t T, int ring, int ring_rank, int ulysses, int ulysses_rank) {
  return sub_shard(sequence_shard(lb, T, ring, ring_rank), ulysses, ulysses_rank);
}

Tensor shard_positions(const SequenceShard& shard) {
  Tensor pos = empty({shard.size()}, DType::i64);
  for (int64_t t = 0; t < shard.size(); ++t) pos.at<int64_t>(t) = shard.position(t);
  return pos;
}

Tensor shard_sequence(const Tensor& x, const SequenceShard& shard) {
  MT_CHECK(x.dim() >= 2, "attention", "shard_sequence: expected (B, T, ...), got {}", shape_str(x.shape()));
  Shape s = x.shape();
  s[1] = shard.size();
  Tensor out = empty(s, x.dtype(), x.device());
  for (size_t c = 0; c < shard.chunk_pos.size(); ++c)
    copy_slice(out, int64_t(c) * shard.chunk_len, x, shard.chunk_pos[c], shard.chunk_len, 1);
  return out;
}

Tensor document_starts(const Tensor& tokens, int32_t separator) {
  MT_CHECK(tokens.dim() == 2 && tokens.dtype() == DType::i32 && !tokens.device().is_cuda(), "attention",
           "document_starts: expected (B, T) i32 tokens on the host, got {} {}", shape_str(tokens.shape()),
           dtype_name(tokens.dtype()));
  const int64_t B = tokens.size(0), T = tokens.size(1);
  Tensor starts = empty({B, T}, DType::i64);
  const int32_t* tok = tokens.data<int32_t>();
  int64_t* st = starts.data<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (tok[b * T + t] == separator) start = t;
      st[b * T + t] = start;
    }
  }
  return starts;
}

}  // namespace mt
