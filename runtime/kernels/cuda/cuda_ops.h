// The CUDA backend of runtime/kernels/ops.h (fp32 for now): launchers over raw
// device pointers, outputs first, then inputs, sizes and the stream
// (a cudaStream_t passed as void*). Private to runtime/kernels; ops.cpp checks
// shapes and dispatches here. Compiled by nvcc: no fmt or spdlog in here.
#pragma once
#include <cstdint>

namespace mt::cuda {

// Returns a cudaError_t / cublasStatus_t code (0 = success) for the caller to check.
int matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC, bool accumulate,
                   void* stream, int device);
int matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int64_t N,
                    int64_t C, int64_t OC, void* stream, int device);
int rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, double eps,
                    void* stream);
// scratch: (ceil(N / 256), C) floats for deterministic partial sums of dweight.
int rmsnorm_backward(float* dinp, float* dweight, float* scratch, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t N, int64_t C, void* stream);
int64_t rmsnorm_backward_scratch(int64_t N, int64_t C);
int rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H,
                 int64_t hd, bool backward, void* stream);
int swiglu_forward(float* out, const float* gate, const float* up, int64_t n, void* stream);
int swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n,
                    void* stream);
int embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t V_local, int64_t C,
                      int64_t row_begin, void* stream);
int embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N, int64_t V_local, int64_t C,
                       int64_t row_begin, void* stream);
int cross_entropy(float* losses, float* dlogits, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                  double grad_scale, void* stream);
int add(float* out, const float* a, const float* b, int64_t n, void* stream);
int scale(float* t, double s, int64_t n, void* stream);
// partials: reduce_partials_count(n) doubles; the caller sums them on the host in order.
int64_t reduce_partials_count(int64_t n);
int reduce_sum(double* partials, const float* t, int64_t n, bool squares, void* stream);
int adamw(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1, double beta2,
          double eps, double weight_decay, int64_t step, void* stream);
// Blockwise attention in fp32 (a correct reference kernel; the tensor-core one is issue 6's).
int attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t T,
                      int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                      int64_t k_pos0, void* stream);
// scratch: B*H*T floats (the row dots of dout and out).
int attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* q,
                       const float* k, const float* v, const float* out, const float* lse, int64_t B, int64_t T,
                       int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                       int64_t k_pos0, bool accumulate, void* stream);

}  // namespace mt::cuda
