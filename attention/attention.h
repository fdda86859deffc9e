// The one boundary a model calls attention through: q, k and v of this rank's
// tokens in, the output out, plus what the batch carries (document starts).
// Which implementation runs behind it is chosen by apply_cp (the model's
// parallelize): local attention when this rank holds whole sequences, ring or
// all_gather attention over cp_ring, Ulysses over cp_ulysses, or both (2-D:
// Ulysses inside, ring outside). A model never knows which.
//
// Implementations are stateless and shared by every layer; what a layer's
// backward needs is kept in its AttentionSaved, in the implementation's own
// layout (Ulysses keeps head-sharded q, k, v, out and lse over the whole
// sequence, so its backward exchanges only dout and the gradients).
//
// Ulysses (DeepSpeed-Ulysses, Megatron's a2a): with U ranks in cp_ulysses each
// holding T_u tokens of H heads, one all-to-all moves q, k, v to (U T_u tokens,
// H/U heads); attention (with documents, and over cp_ring when 2-D) runs on
// the rank's heads; one all-to-all moves the output back. Backward mirrors it:
// dout in, dq, dk, dv back. Grouped-query: with KV >= U kv heads each rank gets
// KV/U of them; with KV < U (U a multiple of KV) each rank gets the one kv head
// its q heads use, and the U/KV ranks sharing it return gradients that are
// summed. Bytes per rank and layer (all_to_all convention: (U-1)/U of the
// input): forward (U-1) T_u B hd (2 H/U + 2 KV_u) elements, backward the same,
// KV_u = max(1, KV/U).
#pragma once
#include <memory>
#include <string>

#include "attention/ring_attention.h"
#include "comm/comm_bytes.h"
#include "comm/group.h"

namespace mt {

// What the batch carries for the attention of one forward.
struct AttentionCall {
  bool causal = true;
  double scale = 0;  // 0: 1/sqrt(hd)
  int64_t window = 0;  // sliding window (local_attention.h): keys at positions > p - window; 0: none
  double softcap = 0;  // attention-logit soft-capping (local_attention.h); 0: none
  // (B, T) i64 on the host: for every token of the whole sequences the global position where its document
  // starts (document_starts); the same on every rank of a cp group. Undefined: no document mask.
  Tensor doc_start;
  // Changes whenever doc_start does: implementations cache what they derive from it (their shard of it).
  uint64_t batch = 0;
};

// What a layer's backward needs, in the implementation's layout.
struct AttentionSaved {
  Tensor q, k, v, out, lse;
  void clear() { q = k = v = out = lse = Tensor(); }
};

// How context parallel splits attention. Groups null (or of one rank): that part is not split.
struct ContextParallel {
  Group* ring = nullptr;     // cp_ring: ring or all_gather attention over the sequence's parts
  Group* ulysses = nullptr;  // cp_ulysses: all-to-all over heads, inside the ring
  CpMethod method = CpMethod::ring;
  CpLoadBalance load_balance = CpLoadBalance::head_tail;
  int64_t seq_len = 0;  // the global sequence length T
  int ring_size() const { return ring ? ring->size() : 1; }
  int ulysses_size() const { return ulysses ? ulysses->size() : 1; }
};

class Attention {
 public:
  virtual ~Attention() = default;
  virtual std::string describe() const = 0;  // "local", "ring over cp_ring (4 ranks, head_tail)", ...
  // Whether q, k, v are this rank's part of each sequence (context parallel) rather than whole sequences.
  virtual bool splits_sequence() const { return true; }
  // q (B, T, H, hd), k, v (B, T, KV, hd): this rank's tokens in the model's layout. Returns out (B, T, H, hd)
  // in q's dtype; s holds what backward needs. Collective over the cp groups (same shapes on every rank).
  virtual Tensor forward(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionCall& c) const = 0;
  // dout (B, T, H, hd) -> dq (B, T, H, hd), dk, dv (B, T, KV, hd), overwritten, in the model's layout.
  virtual void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const AttentionSaved& s, const AttentionCall& c) const = 0;
  // Selective recompute: s kept out and lse but dropped q, k, v; puts them back from the model's q, k, v
  // (Ulysses repeats their all-to-all, not the kernel).
  virtual void resave_inputs(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionCall& c) const = 0;
  // The forward's log-sum-exp (B, H, T) in the model's layout (Ulysses: an all-to-all; for tests and tools).
  virtual Tensor lse(const AttentionSaved& s) const = 0;
};

// Local attention when cp is 1, ring/all_gather over cp.ring, Ulysses over cp.ulysses (with ring inside when
// both). Throws "[attention] ..." when the heads do not split over the Ulysses group (configs are checked
// before, naming the keys: ParallelDims::check_heads).
std::shared_ptr<const Attention> make_attention(const ContextParallel& cp = {});

// Why attention runs slowly in dtype on device with heads of head_dim, as a warning for the run's log; "" when it
// runs at speed. bf16 on CUDA takes the tensor-core kernel only at head dim 64 or 128 (local_attention.h).
std::string slow_attention_warning(const Device& device, DType dtype, int64_t head_dim);

// Tag of Ulysses' all-to-alls (comm_counters.h); ring's are kCpKvTag and kCpDkvTag.
inline constexpr const char* kCpA2aTag = "cp.a2a";

// The analytic bytes one rank sends per layer under Ulysses (the rule above): B, T_u (this rank's tokens), H and
// KV (heads on this rank, after tp), hd, elem (bytes per activation element), U.
CpLayerBytes ulysses_layer_bytes(int u, int64_t B, int64_t T_u, int64_t H, int64_t KV, int64_t hd, double elem);

// One rank's attention per layer after tp's head split and cp's sequence split.
struct AttentionShape {
  int64_t B = 1, T = 1;           // sequences; this rank's tokens of each
  int64_t H = 1, KV = 1, hd = 1;  // q and kv heads on this rank (after tp), head dim
  double elem = 4, accum = 4;     // bytes of the activations and of dK/dV's accumulation dtype
};
// Context parallel's bytes per layer on one rank: Ulysses' all-to-alls over `ulysses`, then the ring part's K/V
// (and dK/dV) over `ring` (the rule of each, cp_layer_bytes and ulysses_layer_bytes).
struct CpBytes {
  CpLayerBytes ulysses, ring;
  double kv = 0, dkv = 0;  // the K/V block a ring rank moves, in the activation and in the accumulation dtype
  int64_t kv_heads = 0;    // kv heads of that block (per Ulysses rank)
};
CpBytes cp_bytes(CpMethod method, int ring, int ulysses, const AttentionShape& s);
// The step's collectives (comm_bytes.h) for `layer_calls` layer forwards and backwards (micro-batches x layers).
std::vector<CommBytes> cp_step_bytes(CpMethod method, int ring, int ulysses, const AttentionShape& s,
                                     int64_t layer_calls);

}  // namespace mt
