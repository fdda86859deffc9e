// Loss parallel: softmax cross-entropy over vocab-sharded logits without
// gathering them. Each tp rank holds columns [vocab_begin, vocab_begin + V_local)
// of every row; the row max and the sum of exponentials are all-reduced over
// tp (max, then sum), the target's logit is taken where it lives (a sum over
// tp with zeros elsewhere). Forward and backward in one pass, like the local op.
#pragma once
#include "comm/group.h"
#include "runtime/core/tensor.h"

namespace mt {

// losses (N) are the full per-token losses on every tp rank; dlogits (N, V_local) as the
// local op gives them for this rank's columns (may alias logits; undefined: loss only).
void vocab_parallel_cross_entropy(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                  const Tensor& targets, int64_t vocab_begin, double grad_scale, Group& tp);

}  // namespace mt
