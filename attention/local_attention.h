// Local attention: scaled dot-product attention on this rank's queries and
// keys, forward returning the log-sum-exp of each query row so that ring
// attention can merge partial results. Computed blockwise with an online
// softmax (FlashAttention's recurrence), so memory does not grow with T^2.
// Grouped-query: kv head j serves q heads j*H/KV ... (j+1)*H/KV - 1.
#pragma once
#include "runtime/core/tensor.h"

namespace mt {

struct AttentionOptions {
  bool causal = true;
  double scale = 0;    // 0: 1/sqrt(hd)
  int64_t q_pos0 = 0;  // global position of query 0 (ring attention passes chunk offsets)
  int64_t k_pos0 = 0;  // global position of key 0
  // Packed documents: (B, T) i64 on q's device, the global position where each query's document starts
  // (non-decreasing along each row: documents are runs of positions). A query sees only keys at or after it;
  // with causal masking that is exactly the earlier tokens of its own document. (Without causal masking keys
  // of later documents stay visible: this is a lower bound only.) Undefined: no document mask.
  Tensor doc_start;
  // Sliding window: a query at global position p sees keys at positions > p - window only (transformers'
  // q_idx - kv_idx < sliding_window); 0: none.
  int64_t window = 0;
  // Attention-logit soft-capping (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap) before the
  // softmax; 0: none. The CUDA kernels implement neither yet (refused there, naming them).
  double softcap = 0;
};

// q (B, T, H, hd), k and v (B, S, KV, hd), H divisible by KV. out (B, T, H, hd), lse (B, H, T) in
// q's dtype, f32 for bf16 q (natural log). bf16 on CUDA runs the tensor-core kernel
// (runtime/kernels/cuda/flash_attention.h: head dim 64 or 128; other head dims, or
// MT_REFERENCE_ATTENTION=1, run the f32 kernels on widened copies); bf16 on the CPU runs in f32.
// Causal: query t sees key s iff k_pos0 + s <= q_pos0 + t; with doc_start also iff
// k_pos0 + s >= doc_start[b, t]. A query that sees no key gets out = 0 and lse = -inf. Key blocks that
// no query of a query block sees are skipped, so a document-masked call costs less than a causal one.
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& opt = {});
// Recomputes the probabilities from q, k and lse. dq (B, T, H, hd) overwritten; dk, dv (B, S, KV, hd)
// overwritten unless accumulate (ring attention adds the contributions of several query chunks).
// dout, out (B, T, H, hd); lse (B, H, T) from the forward.
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const AttentionOptions& opt = {}, bool accumulate = false);

}  // namespace mt
