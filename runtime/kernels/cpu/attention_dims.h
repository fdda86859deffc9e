// The sizes and masks of one local-attention call on the CPU (runtime/kernels/cpu/attention.cpp).
// Plain data: shared by every instruction-set level's kernels, so it has no member functions (an
// inline function here would be compiled at each level and the linker would keep just one copy).
#pragma once
#include <cstdint>

namespace mt::cpu {

struct AttentionDims {
  int64_t B, T, S, H, KV, hd;  // q (B, T, H, hd), k and v (B, S, KV, hd)
  double scale;                // applied to q . k
  bool causal;                 // query at global position q_pos0 + t sees keys at positions <= its own
  int64_t q_pos0, k_pos0;      // global positions of the first query and the first key
  const int64_t* doc_start;    // (B, T) first key position of each query's document, or null: no document mask
  int64_t window;              // > 0: a query at position p sees keys at positions > p - window only (0: none)
  double softcap;              // > 0: scores s -> softcap * tanh(s / softcap) before the softmax (0: none)
};

}  // namespace mt::cpu
