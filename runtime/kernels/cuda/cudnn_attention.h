// Attention through cuDNN's fused attention (docs/design/cudnn-attention.md): bf16 q, k, v, out, gradients; f32
// log-sum-exp. cuDNN is loaded at run time (dlopen), never linked: a build or a machine without it runs the own
// flash kernel. Plain C++, in libmeshtrain_cuda.so; reached through the table (cuda_table.h, MT_CUDA_FUNCTIONS).
//
// Return codes: 0 done; kCudnnDeclined when cuDNN is not loaded or takes no plan for the shape (the caller runs
// the flash kernel instead, attention.kernel: auto); any other value is a cudnnStatus_t (cudnn_error_string).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mt::cuda {

constexpr int kCudnnDeclined = -2;

// Loads cuDNN once per process (search order: the emulated build's stand-in, $CUDNN_PATH/{lib,lib64,.}, the
// toolkit's library folder, an installed PyTorch's nvidia/cudnn/lib, the loader's default path) and creates a
// handle on the current device. ok: loaded. Returns "cuDNN 9.19.0 (path)" when ok, else why not (tried paths).
std::string cudnn_load(bool* ok);

// q (B, T, H, hd), k and v (B, S, KV, hd), out (B, T, H, hd): bf16, row-major contiguous, 16-byte aligned;
// lse (B, H, T) f32. Causal: query t sees key s iff k_pos0 + s <= q_pos0 + t; cuDNN's graph adds
// q_pos0 - k_pos0 to the row index, so this needs q_pos0 >= k_pos0 (every query sees key 0; the caller falls back
// otherwise). doc_start: null, or (B, T) i64 on the device, 8-byte aligned (packed documents): query t of row b also
// sees key s only if k_pos0 + s >= doc_start[b * T + t], a per-query lower bound in the graph's mask (B*T values, not a
// dense mask); taken with causal and q_pos0 == k_pos0 only (every query then sees its own key). One plan per (shape,
// causal, documents), cached; workspace from the caching allocator.
int cudnn_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T,
                            int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                            int64_t k_pos0, const int64_t* doc_start, void* stream);
// dq overwritten; dk, dv overwritten or (accumulate) added to (through a bf16 temporary). deterministic: only
// engines without cuDNN's NONDETERMINISTIC numerical note (kCudnnDeclined if none).
int cudnn_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                             const void* v, const void* out, const float* lse, int64_t B, int64_t T, int64_t S,
                             int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                             int64_t k_pos0, const int64_t* doc_start, bool accumulate, bool deterministic,
                             void* stream);
// cudnnGetErrorString for a status (and the library's last error message when it has one).
std::string cudnn_error_string(int status);
// Plans built so far (forward and backward): a test sees the cache work.
int64_t cudnn_cached_plans();

}  // namespace mt::cuda
