// The CUDA backend as a library loaded at run time (docs/ARCHITECTURE.md, "The CUDA backend"). Everything that includes
// a CUDA header or links a CUDA library (the .cu launchers, cuda_runtime.cpp, nvtx.cpp, comm/nccl/nccl_group.cpp; in
// the emulated build tests/emu's runtime, cuBLASLt and NCCL stand-ins) is built into libmeshtrain_cuda.so, whose entry
// mt_cuda_backend_v1() returns this table: a function pointer for every CUDA function of the ground that the rest of
// meshtrain calls (each launcher template once per activation type). A layer above the ground fills a table of its own
// from the same library (comm's NCCL groups: comm/nccl/nccl_table.h), behind its own exported entry that its loader
// finds with cuda_backend_symbol(). The executable links no CUDA library: cuda_loader.cpp loads the library on the
// first CUDA call (dlopen, from the executable's directory, then $MESHTRAIN_CUDA_BACKEND, then the default search path)
// and defines the same functions (cuda_backend.h, stream.h, device.h, the launchers of runtime/kernels) as trampolines
// into the table; the library's own definitions are local to it (a version script), so neither side's calls reach the
// other's copy. What the library needs of the rest (mt::fail, spdlog, Group, the watchdog, the counters) it takes from
// the executable (linked with --export-dynamic), so there is one copy of each.
//
// Private to runtime/core and runtime/kernels, and to the loaders above the ground (cuda_backend_symbol). Change the
// table: bump kCudaBackendAbi.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/core/allocator.h"
#include "runtime/core/dtype.h"

namespace mt {

class Stream;
class Event;

constexpr uint32_t kCudaBackendAbi = 12;
constexpr const char* kCudaBackendLibrary = "libmeshtrain_cuda.so";

// The launchers of runtime/kernels/cuda taking T = float or mt::bf16 (declared again beside their ops,
// runtime/kernels/cpu/<family>.cpp): X(return type, name, parameters, arguments).
#define MT_CUDA_TEMPLATE_LAUNCHERS(X)                                                                                 \
  X(int, matmul_forward,                                                                                              \
    (T * out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC, bool accumulate, void* stream,         \
     int device),                                                                                                     \
    (out, inp, weight, N, C, OC, accumulate, stream, device))                                                         \
  X(int, matmul_backward,                                                                                             \
    (T * dinp, float* dweight, const T* dout, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC,        \
     void* stream, int device, bool accumulate_dinp),                                                                 \
    (dinp, dweight, dout, inp, weight, N, C, OC, stream, device, accumulate_dinp))                                    \
  X(int, fp8_cast,                                                                                                    \
    (uint8_t * q, float* q_inv, uint8_t* qt, float* qt_inv, float* scratch, const T* x, int64_t R, int64_t K, int fmt, \
     bool rowwise, bool pow2, void* stream),                                                                          \
    (q, q_inv, qt, qt_inv, scratch, x, R, K, fmt, rowwise, pow2, stream))                                             \
  X(int, rmsnorm_forward,                                                                                             \
    (T * out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C, double eps, void* stream),            \
    (out, rstd, inp, weight, N, C, eps, stream))                                                                      \
  X(int, add_rmsnorm_forward,                                                                                         \
    (T * sum, T * out, float* rstd, const T* a, const T* b, const T* weight, int64_t N, int64_t C, double eps,        \
     void* stream),                                                                                                   \
    (sum, out, rstd, a, b, weight, N, C, eps, stream))                                                                \
  X(int, rmsnorm_backward,                                                                                            \
    (T * dinp, float* dweight, float* scratch, const T* dout, const T* inp, const T* weight, const float* rstd,       \
     int64_t N, int64_t C, void* stream, const T* dresidual),                                                         \
    (dinp, dweight, scratch, dout, inp, weight, rstd, N, C, stream, dresidual))                                       \
  X(int, rope_forward,                                                                                                \
    (T * out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd, bool backward,  \
     void* stream),                                                                                                   \
    (out, inp, cos, sin, B, T_, H, hd, backward, stream))                                                             \
  X(int, swiglu_forward, (T * out, const T* gate, const T* up, int64_t n, void* stream), (out, gate, up, n, stream))  \
  X(int, swiglu_backward, (T * dgate, T * dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream),  \
    (dgate, dup, dout, gate, up, n, stream))                                                                          \
  X(int, geglu_forward, (T * out, const T* gate, const T* up, int64_t n, void* stream), (out, gate, up, n, stream))   \
  X(int, geglu_backward, (T * dgate, T * dup, const T* dout, const T* gate, const T* up, int64_t n, void* stream),    \
    (dgate, dup, dout, gate, up, n, stream))                                                                          \
  X(int, softcap_forward, (T * out, const T* inp, double cap, int64_t n, void* stream), (out, inp, cap, n, stream))   \
  X(int, softcap_backward, (T * dinp, const T* dout, const T* out, double cap, int64_t n, void* stream),              \
    (dinp, dout, out, cap, n, stream))                                                                                \
  X(int, embedding_forward,                                                                                           \
    (T * out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local, int64_t C, int64_t row_begin,        \
     void* stream),                                                                                                   \
    (out, tokens, table, N, V_local, C, row_begin, stream))                                                           \
  X(int, embedding_backward,                                                                                          \
    (float* dtable, void* scratch, const T* dout, const int32_t* tokens, int64_t N, int64_t V_local, int64_t C,       \
     int64_t row_begin, void* stream),                                                                                \
    (dtable, scratch, dout, tokens, N, V_local, C, row_begin, stream))                                                \
  X(int, cross_entropy,                                                                                               \
    (float* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N, int64_t V, double grad_scale,     \
     void* stream),                                                                                                   \
    (losses, dlogits, logits, targets, N, V, grad_scale, stream))                                                     \
  X(int, vocab_shard_max, (double* row_max, const T* logits, int64_t N, int64_t V, void* stream),                     \
    (row_max, logits, N, V, stream))                                                                                  \
  X(int, vocab_shard_sumexp,                                                                                          \
    (double* sumexp, double* target_logit, const T* logits, const int32_t* targets, const double* row_max, int64_t N, \
     int64_t V, int64_t vocab_begin, void* stream),                                                                   \
    (sumexp, target_logit, logits, targets, row_max, N, V, vocab_begin, stream))                                      \
  X(int, vocab_shard_loss,                                                                                            \
    (float* losses, T* dlogits, const T* logits, const int32_t* targets, const double* row_max, const double* sumexp, \
     const double* target_logit, int64_t N, int64_t V, int64_t vocab_begin, double grad_scale, void* stream),         \
    (losses, dlogits, logits, targets, row_max, sumexp, target_logit, N, V, vocab_begin, grad_scale, stream))         \
  X(int, add, (T * out, const T* a, const T* b, int64_t n, void* stream), (out, a, b, n, stream))                     \
  X(int, scale, (T * t, double s, int64_t n, void* stream), (t, s, n, stream))                                        \
  X(int, dropout_rows,                                                                                                \
    (T * out, const T* inp, const int64_t* row_ids, int64_t N, int64_t C, uint64_t seed, uint64_t stream,             \
     int64_t col_offset, int64_t cols_global, double p, void* cuda_stream),                                           \
    (out, inp, row_ids, N, C, seed, stream, col_offset, cols_global, p, cuda_stream))                                 \
  X(int, reduce_sum, (double* partials, const T* t, int64_t n, bool squares, void* stream),                           \
    (partials, t, n, squares, stream))                                                                                \
  X(int, bias_add_forward, (T * out, const T* inp, const T* bias, int64_t N, int64_t C, void* stream),                \
    (out, inp, bias, N, C, stream))                                                                                   \
  X(int, bias_add_backward, (float* dbias, const T* dout, int64_t N, int64_t C, void* stream),                        \
    (dbias, dout, N, C, stream))                                                                                      \
  X(int, attention_merge,                                                                                             \
    (float* out, float* lse, const T* part_out, const float* part_lse, int64_t B, int64_t T_, int64_t H, int64_t hd,  \
     void* stream),                                                                                                   \
    (out, lse, part_out, part_lse, B, T_, H, hd, stream))                                                            \
  X(int, router_topk_forward,                                                                                         \
    (float* weights, int32_t* experts, float* probs, const T* logits, const float* bias, int64_t N, int64_t E,        \
     int64_t K, bool sigmoid, bool renormalize, double scale, int64_t n_group, int64_t topk_group, void* stream),     \
    (weights, experts, probs, logits, bias, N, E, K, sigmoid, renormalize, scale, n_group, topk_group, stream))       \
  X(int, router_topk_backward,                                                                                        \
    (T * dlogits, const float* dweights, const float* dprob_row, const float* probs, const int32_t* experts,          \
     int64_t N, int64_t E, int64_t K, bool sigmoid, bool renormalize, double scale, void* stream),                    \
    (dlogits, dweights, dprob_row, probs, experts, N, E, K, sigmoid, renormalize, scale, stream))                     \
  X(int, moe_dispatch_forward,                                                                                        \
    (T * out, const T* inp, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream),                      \
    (out, inp, slot, N, K, C, stream))                                                                                \
  X(int, moe_dispatch_backward,                                                                                       \
    (T * dinp, const T* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream),                    \
    (dinp, dout, slot, N, K, C, stream))                                                                              \
  X(int, moe_combine_forward,                                                                                         \
    (T * out, const T* inp, const float* weights, const int32_t* slot, int64_t N, int64_t K, int64_t C, void* stream),\
    (out, inp, weights, slot, N, K, C, stream))                                                                       \
  X(int, moe_combine_backward,                                                                                        \
    (T * dinp, float* dweights, const T* dout, const T* inp, const float* weights, const int32_t* slot, int64_t N,    \
     int64_t K, int64_t M, int64_t C, void* stream),                                                                  \
    (dinp, dweights, dout, inp, weights, slot, N, K, M, C, stream))                                                  \
  X(int, grouped_matmul_forward_dev,                                                                                  \
    (T * out, const T* inp, const T* weight, const int32_t* offsets, int64_t M, int64_t C, int64_t OC, int64_t G,     \
     void* stream),                                                                                                   \
    (out, inp, weight, offsets, M, C, OC, G, stream))                                                                 \
  X(int, grouped_matmul_backward_dev,                                                                                 \
    (T * dinp, float* dweight, const T* dout, const T* inp, const T* weight, const int32_t* offsets, int64_t M,       \
     int64_t C, int64_t OC, int64_t G, void* stream),                                                                 \
    (dinp, dweight, dout, inp, weight, offsets, M, C, OC, G, stream))

// The other functions of mt::cuda that code outside the library calls (launchers and queries).
#define MT_CUDA_FUNCTIONS(X)                                                                                          \
  X(int, adamw,                                                                                                       \
    (float* param, bf16* param_lowp, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,       \
     double beta2, double eps, double weight_decay, int64_t step, void* stream, const float* hyper),                  \
    (param, param_lowp, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, stream, hyper))                     \
  X(int, attention_forward,                                                                                           \
    (float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t S,         \
     int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0, int64_t k_pos0,                    \
     const int64_t* doc_start, int64_t window, double softcap, void* stream),                                         \
    (out, lse, q, k, v, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start, window, softcap, stream))       \
  X(int, attention_backward,                                                                                          \
    (float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q, const float* k,              \
     const float* v, const float* out, const float* lse, int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV,      \
     int64_t hd, double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const int64_t* doc_start,                 \
     int64_t window, double softcap, bool accumulate, void* stream),                                                  \
    (dq, dk, dv, scratch, dout, q, k, v, out, lse, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start,      \
     window, softcap, accumulate, stream))                                                                            \
  X(int, flash_attention_forward,                                                                                     \
    (void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T, int64_t S, int64_t H,  \
     int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const int64_t* doc_start,     \
     void* stream),                                                                                                   \
    (out, lse, q, k, v, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start, stream))                        \
  X(size_t, flash_attention_backward_scratch_bytes, (int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV,          \
                                                      int64_t hd),                                                    \
    (B, T, S, H, KV, hd))                                                                                             \
  X(int, flash_attention_backward,                                                                                    \
    (void* dq, void* dk, void* dv, void* scratch, const void* dout, const void* q, const void* k, const void* v,      \
     const void* out, const float* lse, int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV, int64_t hd,           \
     double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const int64_t* doc_start, bool accumulate,            \
     void* stream),                                                                                                   \
    (dq, dk, dv, scratch, dout, q, k, v, out, lse, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start,      \
     accumulate, stream))                                                                                             \
  X(std::string, cudnn_load, (bool* ok), (ok))                                                                        \
  X(int, cudnn_attention_forward,                                                                                     \
    (void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T, int64_t S, int64_t H,  \
     int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const int64_t* doc_start,     \
     void* stream),                                                                                                   \
    (out, lse, q, k, v, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start, stream))                        \
  X(int, cudnn_attention_backward,                                                                                    \
    (void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k, const void* v, const void* out,    \
     const float* lse, int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, \
     int64_t q_pos0, int64_t k_pos0, const int64_t* doc_start, bool accumulate, bool deterministic, void* stream),     \
    (dq, dk, dv, dout, q, k, v, out, lse, B, T, S, H, KV, hd, scale, causal, q_pos0, k_pos0, doc_start, accumulate,   \
     deterministic, stream))                                                                                          \
  X(std::string, cudnn_error_string, (int status), (status))                                                          \
  X(int64_t, cudnn_cached_plans, (), ())                                                                              \
  X(int64_t, reduce_partials_count, (int64_t n), (n))                                                                 \
  X(int, sum_partials_into, (double* out, const double* partials, int64_t n, void* stream),                           \
    (out, partials, n, stream))                                                                                       \
  X(int64_t, embedding_backward_scratch_bytes, (int64_t N), (N))                                                      \
  X(int64_t, rmsnorm_backward_scratch, (int64_t N, int64_t C), (N, C))                                                \
  X(int64_t, fp8_cast_scratch, (int64_t R, int64_t K, bool rowwise), (R, K, rowwise))                                 \
  X(int, fp8_matmul,                                                                                                  \
    (void* out, bool out_f32, const uint8_t* a, const float* a_inv, const uint8_t* b, const float* b_inv, int64_t M,  \
     int64_t N, int64_t K, int a_fmt, int b_fmt, bool vec_scales, bool accumulate, void* stream, int device),         \
    (out, out_f32, a, a_inv, b, b_inv, M, N, K, a_fmt, b_fmt, vec_scales, accumulate, stream, device))                \
  X(int, convert, (void* dst, DType dst_type, const void* src, DType src_type, int64_t n, void* stream),              \
    (dst, dst_type, src, src_type, n, stream))                                                                        \
  X(int, copy_2d, (void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, void* stream), \
    (dst, dpitch, src, spitch, width, rows, stream))                                                                  \
  X(int, pack_blocks,                                                                                                 \
    (void* packed, void* t, int64_t outer, int64_t D, size_t inner_bytes, const int64_t* begin, int n, bool unpack,   \
     void* stream),                                                                                                   \
    (packed, t, outer, D, inner_bytes, begin, n, unpack, stream))                                                     \
  X(const char*, error_string, (int code), (code))                                                                    \
  X(int64_t, gemm_cached_algos, (), ())                                                                               \
  X(void*, raw_malloc, (int device, size_t bytes), (device, bytes))                                                   \
  X(void, raw_free, (int device, void* p), (device, p))                                                               \
  X(void, memcpy_async, (void* dst, const void* src, size_t bytes, int kind, int device),                             \
    (dst, src, bytes, kind, device))                                                                                  \
  X(void, memset_zero_async, (void* p, size_t bytes, int device), (p, bytes, device))                                 \
  X(void, stream_sync_current, (int device), (device))                                                                \
  X(void*, pinned_malloc, (size_t bytes), (bytes))                                                                    \
  X(void, pinned_free, (void* p), (p))                                                                                \
  X(std::string, pci_bus_id, (int device), (device))                                                                  \
  X(size_t, device_memory_bytes, (int device), (device))                                                              \
  X(std::string, device_name, (int device), (device))                                                               \
  X(int, moe_route,                                                                                                   \
    (int32_t * slot, int32_t* counts, int32_t* selected, int32_t* offsets, int32_t* dropped, const int32_t* experts,  \
     int64_t n, int64_t E, int64_t capacity, bool padded, void* stream),                                              \
    (slot, counts, selected, offsets, dropped, experts, n, E, capacity, padded, stream))                              \
  X(int, moe_unpad_order,                                                                                             \
    (int32_t * order, int32_t* offsets, const int32_t* counts, int64_t P, int64_t El, int64_t capacity,              \
     void* stream),                                                                                                   \
    (order, offsets, counts, P, El, capacity, stream))                                                                \
  X(int, moe_stats_record,                                                                                            \
    (double* stats, const int32_t* selected, const float* prob_sums, const int32_t* dropped, int64_t L, int64_t E,   \
     int64_t layer, int64_t rows, void* stream),                                                                      \
    (stats, selected, prob_sums, dropped, L, E, layer, rows, stream))                                                 \
  X(int, moe_stats_add, (double* stats, const double* in, int64_t n, void* stream), (stats, in, n, stream))             \
  X(int, moe_aux_grad_row,                                                                                            \
    (float* row, const double* stats, int64_t L, int64_t E, double coef, double loss_scale, void* stream),           \
    (row, stats, L, E, coef, loss_scale, stream))                                                                     \
  X(void, graph_begin, (int device), (device))                                                                        \
  X(void*, graph_end, (int device, std::string* why), (device, why))                                                  \
  X(void, graph_launch, (void* exec, int device), (exec, device))                                                     \
  X(void, graph_destroy, (void* exec), (exec))                                                                        \
  X(bool, graph_capturing, (int device), (device))

// The launcher templates, declared for the table (the same declarations as beside the ops).
namespace cuda {
#define MT_DECLARE_LAUNCHER(R, NAME, PARAMS, ARGS) template <typename T> R NAME PARAMS;
MT_CUDA_TEMPLATE_LAUNCHERS(MT_DECLARE_LAUNCHER)
#undef MT_DECLARE_LAUNCHER
#define MT_DECLARE_FUNCTION(R, NAME, PARAMS, ARGS) R NAME PARAMS;
MT_CUDA_FUNCTIONS(MT_DECLARE_FUNCTION)
#undef MT_DECLARE_FUNCTION

template <typename T> struct LauncherTypes {
#define MT_LAUNCHER_TYPE(R, NAME, PARAMS, ARGS) using NAME = R(*) PARAMS;
  MT_CUDA_TEMPLATE_LAUNCHERS(MT_LAUNCHER_TYPE)
#undef MT_LAUNCHER_TYPE
};
}  // namespace cuda

struct CudaBackend {
  uint32_t abi = kCudaBackendAbi;
  uint32_t size = sizeof(CudaBackend);

  // device.h, stream.h: the methods take the object (its layout is stream.h's, the same on both sides).
  int (*device_count)();
  void (*set_device)(int device);
  void (*device_synchronize)();
  void (*stream_create)(Stream* out, int device, bool non_blocking);
  void (*stream_release)(Stream* s);  // destroys an owned stream; s is left a borrowed alias
  void (*stream_synchronize)(const Stream* s);
  void (*event_create)(Event* out, bool timing);
  void (*event_release)(Event* e);  // destroys the event; e is left empty
  void (*event_record)(Event* e, const Stream* s);
  void (*event_wait_on)(const Event* e, const Stream* s);
  bool (*event_query)(const Event* e);
  void (*event_synchronize)(const Event* e);
  float (*event_elapsed_ms)(const Event* start, const Event* end);
  const Stream* (*current_stream)(int device);
  void (*set_current_stream)(int device, Stream* s);  // moves *s in
  // kernel_profile.h
  void (*nvtx_push)(const char* name);
  void (*nvtx_pop)();
  // The caching allocator (cuda_backend.h, mt::detail).
  void* (*caching_alloc)(int device, size_t bytes);
  void (*caching_free)(int device, void* p, size_t bytes);
  AllocatorStats (*allocator_stats)(int device);
  void (*reset_peak)(int device);
  void (*empty_cache)(int device);

#define MT_LAUNCHER_FIELDS(R, NAME, PARAMS, ARGS) \
  cuda::LauncherTypes<float>::NAME NAME##_f32;    \
  cuda::LauncherTypes<bf16>::NAME NAME##_bf16;
  MT_CUDA_TEMPLATE_LAUNCHERS(MT_LAUNCHER_FIELDS)
#undef MT_LAUNCHER_FIELDS
#define MT_FUNCTION_FIELD(R, NAME, PARAMS, ARGS) R(*NAME) PARAMS;
  MT_CUDA_FUNCTIONS(MT_FUNCTION_FIELD)
#undef MT_FUNCTION_FIELD
};

// The loaded backend: loads it on the first call; throws "[cuda] cannot load the CUDA backend ..." when it cannot.
const CudaBackend& cuda_backend();
// Null when not loaded yet (nothing is loaded by asking).
const CudaBackend* cuda_backend_if_loaded();
// Why the backend cannot be loaded: cuda_backend_error() in device.h (it loads it if not yet tried).

// The loaded library's exported symbol `name` (loads it, throwing as cuda_backend() does when it cannot); null
// when the library has none: how a layer above the ground finds its own table in the same library.
void* cuda_backend_symbol(const char* name);

}  // namespace mt

extern "C" {
// The library's one exported entry.
const mt::CudaBackend* mt_cuda_backend_v1();
}
