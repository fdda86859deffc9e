// How a sequence is split over the context-parallel (cp) ranks, and the
// per-token facts that travel with a rank's part of it: global positions
// (for RoPE and the causal rule) and document starts (for packed documents).
//
// With Ulysses (cp_ulysses) each cp_ring rank's part is split again, in order,
// over the Ulysses ranks (cp_shard).
//
// Load balancing: with causal attention a contiguous split gives the last rank
// the most work (its queries see every earlier key). head_tail cuts the
// sequence into 2N chunks and gives rank r chunks r and 2N-1-r, so every rank
// holds one early and one late chunk and does the same work. none keeps the
// contiguous split (for full attention, or to compare).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/parallel_dims.h"
#include "runtime/core/tensor.h"

namespace mt {

// The tokens that cp rank `rank` of `n` holds of a length-T sequence: equal chunks, each a
// contiguous run of global positions, in ascending order; the rank's local sequence is their
// concatenation.
struct SequenceShard {
  int64_t chunk_len = 0;
  std::vector<int64_t> chunk_pos;  // global position of each chunk's first token, ascending
  int64_t size() const { return chunk_len * int64_t(chunk_pos.size()); }
  // Global position of local token t.
  int64_t position(int64_t t) const { return chunk_pos[size_t(t / chunk_len)] + t % chunk_len; }
};
// How many equal parts T must split into: n (none, or one rank) or 2n (head_tail).
int64_t sequence_parts(CpLoadBalance lb, int n);
// Throws "[attention] ..." when T is not a multiple of sequence_parts (callers check the config first,
// naming the keys).
SequenceShard sequence_shard(CpLoadBalance lb, int64_t T, int n, int rank);

// Part `rank` of n of shard s: its local tokens [rank L/n, (rank+1) L/n), L = s.size() (a multiple of n).
SequenceShard sub_shard(const SequenceShard& s, int n, int rank);
// 2-D context parallel: the tokens of cp_ring rank ring_rank (sequence_shard) split again over the cp_ulysses
// ranks, in order, so that an all-to-all over cp_ulysses gathers the ring rank's part in its local order.
SequenceShard cp_shard(CpLoadBalance lb, int64_t T, int ring, int ring_rank, int ulysses, int ulysses_rank);

// (T_local) i64 on the host: the global position of each local token.
Tensor shard_positions(const SequenceShard& shard);
// x (B, T, ...) the whole sequence -> (B, T_local, ...) the shard's tokens in local order (a copy, on
// x's device).
Tensor shard_sequence(const Tensor& x, const SequenceShard& shard);

// Packed documents. tokens (B, T) i32 on the host, whole sequences. Returns (B, T) i64: for each token
// the global position where its document starts, a document being the tokens from one separator (which
// starts it) up to the next; the tokens before a row's first separator form a document starting at 0.
Tensor document_starts(const Tensor& tokens, int32_t separator);

}  // namespace mt
