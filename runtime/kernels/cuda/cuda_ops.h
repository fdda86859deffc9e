// The CUDA backend of runtime/kernels/ops.h: launchers over raw device
// pointers, outputs first, then inputs, sizes and the stream (a cudaStream_t
// passed as void*). Private to runtime/kernels; ops.cpp checks shapes and
// dispatches here. Compiled by nvcc: no fmt or spdlog in here.
//
// T is the activation and parameter type: float (fp32 runs, TF32 off) or
// mt::bf16 (mixed precision, computed as __nv_bfloat16 with fp32 math).
// Whatever T is, the mixed-precision policy keeps these in fp32 (float*):
// weight gradients (dweight, dtable), norms' statistics (rstd), losses, the
// master weights and the optimizer state. Every launcher returns a
// cudaError_t / cublasStatus_t code (0 = success) for the caller to check,
// and opens an NVTX range named after the op.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/core/dtype.h"

namespace mt::cuda {

// The launchers' codes: a cudaError_t, or kCublasErrorBase + a cublasStatus_t from the GEMMs.
constexpr int kCublasErrorBase = 100000;
// "CUDA error 700 cudaErrorIllegalAddress: an illegal memory access was encountered", or the cuBLAS status's
// name and text, for a launcher's non-zero code.
const char* error_string(int code);

// ---- GEMMs (cuBLASLt, fp32 accumulate; the algorithm is chosen once per shape and cached) ----
// out (N, OC) = inp (N, C) @ weight (OC, C)^T, or += if accumulate.
template <typename T> int matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC,
                                         bool accumulate, void* stream, int device);
// dinp (N, C) = (or += with accumulate_dinp) dout (N, OC) @ weight (OC, C) (if dinp);
// dweight (OC, C) f32 += dout^T @ inp (if dweight).
template <typename T> int matmul_backward(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight,
                                          int64_t N, int64_t C, int64_t OC, void* stream, int device,
                                          bool accumulate_dinp = false);
// Shapes whose algorithm is cached, on every device so far (for tests and logs).
int64_t gemm_cached_algos();

// ---- RMSNorm ----
// out (N, C), rstd (N) f32, inp (N, C), weight (C); a warp per row, statistics in fp32.
template <typename T>
int rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C, double eps, void* stream);
// sum (N, C) = a + b rounded to T (sum may alias a or b), then out = rmsnorm(sum): the residual add fused.
template <typename T> int add_rmsnorm_forward(T* sum, T* out, float* rstd, const T* a, const T* b, const T* weight,
                                              int64_t N, int64_t C, double eps, void* stream);
// scratch: rmsnorm_backward_scratch(N, C) floats for deterministic partial sums of dweight (C) f32.
// dresidual (N, C) or null: added to dinp before its one rounding (may alias dinp).
template <typename T> int rmsnorm_backward(T* dinp, float* dweight, float* scratch, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int64_t N, int64_t C, void* stream,
                                           const T* dresidual = nullptr);
int64_t rmsnorm_backward_scratch(int64_t N, int64_t C);

// ---- RoPE (backward: the transpose), SwiGLU ----
template <typename T> int rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_,
                                       int64_t H, int64_t hd, bool backward, void* stream);
template <typename T> int swiglu_forward(T* out, const T* gate, const T* up, int64_t n, void* stream);
template <typename T>
int swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream);

// ---- Embedding: forward gathers rows; backward scatters in token order (deterministic, no atomics) ----
template <typename T> int embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                            int64_t C, int64_t row_begin, void* stream);
// scratch: embedding_backward_scratch_bytes(N) bytes (a stable sort of the positions by token).
template <typename T> int embedding_backward(float* dtable, void* scratch, const T* dout, const int32_t* tokens,
                                             int64_t N, int64_t V_local, int64_t C, int64_t row_begin, void* stream);
int64_t embedding_backward_scratch_bytes(int64_t N);

// ---- Softmax cross-entropy: one read of the logits for the statistics, one pass writing the gradient ----
template <typename T> int cross_entropy(float* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                        int64_t V, double grad_scale, void* stream);
// Vocab-parallel pieces (see ops.h); the statistics are (N) f64 on the device.
template <typename T> int vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V, void* stream);
template <typename T> int vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                             const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                             int64_t vocab_begin, void* stream);
template <typename T> int vocab_shard_loss(float* losses, T* dlogits, const T* logits, const int32_t* targets,
                                           const double* row_max, const double* sumexp, const double* target_logit,
                                           int64_t N, int64_t V, int64_t vocab_begin, double grad_scale, void* stream);

// ---- Element-wise, conversion, reductions ----
template <typename T> int add(T* out, const T* a, const T* b, int64_t n, void* stream);
template <typename T> int scale(T* t, double s, int64_t n, void* stream);
// dst <- src converted (f32 <-> bf16, round to nearest even), n elements.
int convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, void* stream);
// partials: reduce_partials_count(n) doubles; the caller sums them in order (deterministic).
int64_t reduce_partials_count(int64_t n);
template <typename T> int reduce_sum(double* partials, const T* t, int64_t n, bool squares, void* stream);

// ---- AdamW on fp32 master weights; param_lowp (may be null) gets the updated weights rounded to bf16 ----
int adamw(float* param, bf16* param_lowp, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
          double beta2, double eps, double weight_decay, int64_t step, void* stream);

// ---- Attention in fp32 (one thread per row: the correctness reference for fp32 runs; bf16 runs use
// the tensor-core kernel of flash_attention.h) ----
// doc_start: (B, T) i64 on the device, the global position where each query's document starts (query t of row
// b sees no key before doc_start[b * T + t] - k_pos0), or null: no document mask.
int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, const int64_t* doc_start, void* stream);
// scratch: B*H*T floats (the row dots of dout and out).
int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, const int64_t* doc_start, bool accumulate, void* stream);

// ---- Copies and the attention merge (context parallel) ----
// rows rows of width bytes, from src (row pitch spitch bytes) to dst (pitch dpitch), device to device.
int copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, void* stream);
// out (B, T, H, hd) f32, lse (B, H, T) f32 merged with part_out (B, T, H, hd) T and part_lse (B, H, T) f32 by
// log-sum-exp (ops.h attention_merge).
template <typename T> int attention_merge(float* out, float* lse, const T* part_out, const float* part_lse, int64_t B,
                                          int64_t T_, int64_t H, int64_t hd, void* stream);
// The blocks of a split of a row-major (outer, D, inner) tensor t along D at begin[0] = 0 < ... < begin[n] = D,
// stored one after the other in packed, each contiguous (block j starts at outer * inner * begin[j]):
// packed <- blocks of t, or with unpack t <- blocks of packed. inner in bytes; any n (launches of up to 64 blocks).
int pack_blocks(void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes, const int64_t* begin, int n,
                bool unpack, void* stream);
// out[0] += (partials[0] + ... + partials[n-1]), summed in that order by one thread: the same bits as the host
// summing reduce_sum's partials, without reading them on the host.
int sum_partials_into(double* out, const double* partials, int64_t n, void* stream);

}  // namespace mt::cuda
