// Ring attention: attention over a sequence split across the ranks of a
// context-parallel (cp) group, each rank holding its queries, keys and values
// for the positions of its SequenceShard (sequence_shard.h).
//
// Forward: for each rank's K/V block in turn, the local attention kernel on
// every (query chunk, key chunk) pair that some query may see, each returning
// its log-sum-exp; partial results are merged by log-sum-exp in f32 (f64 for
// f64). Per pair, with causal masking: a key chunk wholly before the query
// chunk is full attention, the same chunk is causal, a later one is skipped
// (with head_tail that is what the seed's halves rule gives: earlier ranks'
// blocks are seen by both query chunks through their first key chunk only,
// later ranks' by the second query chunk only). With documents, pairs that no
// query may see are skipped as well.
// Backward recomputes per pair with the final out and lse, accumulating dQ
// locally and dK/dV for the block being visited; dK/dV then go back to their
// owner.
// How K/V move (CpMethod):
//  ring:       K/V shifted to the next rank each step, the shift for step
//              i+1 in flight while step i computes (async Group::ring_shift:
//              non-blocking MPI on CPU ranks, NCCL on its own stream on GPUs).
//              Backward shifts K/V the same way and a dK/dV accumulator travels
//              with them, returning to its owner after N shifts.
//              Bytes per rank and layer: forward (N-1) x local K/V; backward
//              (N-1) x local K/V + N x local dK/dV.
//  all_gather: K/V all-gathered once per layer in forward and again in
//              backward, dK/dV reduce-scattered: (N-1)/N of the whole
//              sequence's K/V each time, and of its dK/dV.
#pragma once
#include "attention/local_attention.h"
#include "attention/sequence_shard.h"
#include "comm/group.h"

namespace mt {

struct RingAttentionOptions {
  bool causal = true;
  double scale = 0;        // 0: 1/sqrt(hd)
  int64_t window = 0;      // sliding window (local_attention.h); 0: none
  double softcap = 0;      // attention-logit soft-capping (local_attention.h); 0: none
  Group* group = nullptr;  // the cp group; null (or size 1): this rank holds the whole sequence
  CpMethod method = CpMethod::ring;
  CpLoadBalance load_balance = CpLoadBalance::head_tail;
  int64_t seq_len = 0;  // the global sequence length T
  // Packed documents: (B, T_local) i64 on the host, the global position where each local query's document
  // starts (document_starts, then shard_sequence). Undefined: no document mask.
  Tensor doc_start;
};

// q (B, T_local, H, hd), k, v (B, T_local, KV, hd): this rank's tokens, in the order of
// sequence_shard(load_balance, seq_len, group size, group rank). out (B, T_local, H, hd) in q's dtype,
// lse (B, H, T_local) in accum_dtype(q), as attention_forward gives for these queries against the whole
// sequence. Collective over the group (every rank calls it with the same shapes and options).
void ring_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const RingAttentionOptions& opt);
// dq (B, T_local, H, hd), dk, dv (B, T_local, KV, hd) overwritten: the gradients of this rank's q, k, v.
// dout, out, lse from the forward. Collective over the group.
void ring_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const RingAttentionOptions& opt);

// The tags its collectives are counted under (comm_counters.h): K/V moving, and the dK/dV going home.
inline constexpr const char* kCpKvTag = "cp.kv";
inline constexpr const char* kCpDkvTag = "cp.dkv";

// The analytic bytes one rank sends per layer (the rule in the header comment), for `plan` and
// `estimate` to set beside what the runtime counts. kv_bytes: this rank's K and V together in the
// activation dtype; dkv_bytes: the same elements in the accum dtype; n: the cp degree.
struct CpLayerBytes {
  double forward = 0, backward = 0;
  int dkv_moves = 0;  // how many times a rank's dK/dV block is sent in backward (N for ring, N-1 for all_gather)
};
CpLayerBytes cp_layer_bytes(CpMethod method, int n, double kv_bytes, double dkv_bytes);

// Sliding windows (window > 0) on the ring: the distances s in 1 .. n-1 at which some rank's queries see a key of
// the rank s before it (sequence_shard's chunks under load_balance, the causal rule and the window); every distance
// without a window. With a window on the ring (window_direct) ring attention sends each rank's own K/V block
// straight to the ranks at the needed distances (ring_shift by s) instead of around the ring, and each dK/dV part
// straight back (by n - s): per layer forward D x K/V, backward D x (K/V + dK/dV), D = the distances' count, against
// a causal ring's (n-1) x K/V and (n-1) x K/V + n x dK/dV. all_gather and Ulysses move what they move without one.
std::vector<int> ring_window_distances(CpLoadBalance load_balance, int64_t seq_len, int n, int64_t window);
bool window_direct(CpMethod method, CpLoadBalance load_balance, int64_t seq_len, int n, int64_t window);
CpLayerBytes cp_window_layer_bytes(int distances, double kv_bytes, double dkv_bytes);

}  // namespace mt
