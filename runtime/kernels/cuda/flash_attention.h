// bf16 attention on tensor cores (FlashAttention-2 style; the structure is described at the top of
// flash_attention.cu). Plain C++: included by g++-compiled code, so bf16 buffers are void* and the
// stream is a cudaStream_t passed as void*. Launchers take outputs first, then inputs, sizes, options
// and the stream; they return 0 on success, a cudaError_t value on a CUDA error, and -1 for arguments
// the kernel does not take (head dim other than 64 or 128, H not a multiple of KV, negative sizes,
// T or S above 2^30, buffers not 16-byte aligned).
#pragma once
#include <cstddef>
#include <cstdint>

namespace mt::cuda {

// q (B, T, H, hd) bf16, k and v (B, S, KV, hd) bf16, row-major contiguous; H % KV == 0 (grouped-query:
// kv head j serves q heads j*H/KV .. (j+1)*H/KV-1). out (B, T, H, hd) bf16; lse (B, H, T) f32 natural-log
// log-sum-exp of the scaled scores of each query row. Causal: query t sees key s iff k_pos0 + s <= q_pos0 + t
// (global positions, as ring attention passes them). A query row that sees no key gets out = 0 and
// lse = -inf. Not causal: every query sees every key. scale is the softmax scale (1/sqrt(hd) usually).
// doc_start: null, or (B, T) i64 on the device (8-byte aligned), the global position where each query's
// document starts: query t of row b then also sees key s only if doc_start[b * T + t] <= k_pos0 + s (packed
// documents; the values need not be ordered along t).
// Blocks of keys fully masked for a block of 64 queries (causally or by the document mask) are skipped.
int flash_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T,
                            int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                            int64_t k_pos0, const int64_t* doc_start, void* stream);

// Bytes of device scratch flash_attention_backward needs: the row dots D = rowsum(dout * out), (B, H, T) f32,
// then per block of 64 queries the bounds of their document starts, (B, ceil(T / 64), 2) i32.
size_t flash_attention_backward_scratch_bytes(int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV, int64_t hd);

// dq (B, T, H, hd) bf16 overwritten; dk, dv (B, S, KV, hd) bf16 overwritten, or, if accumulate, added to
// (dk += contribution, computed in fp32 and rounded once). dout, out (B, T, H, hd) bf16 and lse (B, H, T) f32
// from the forward; the probabilities are recomputed from q, k and lse. Deterministic (no atomics): the same
// inputs give the same bits. scratch: flash_attention_backward_scratch_bytes(...) bytes, float-aligned. doc_start:
// as in the forward (the same one).
int flash_attention_backward(void* dq, void* dk, void* dv, void* scratch, const void* dout, const void* q,
                             const void* k, const void* v, const void* out, const float* lse, int64_t B, int64_t T,
                             int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                             int64_t k_pos0, const int64_t* doc_start, bool accumulate, void* stream);

}  // namespace mt::cuda
