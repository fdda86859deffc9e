// The CPU kernels' declarations, included inside a namespace (no include guard):
// once in mt::cpu by cpu_ops.h (the entry points, which dispatch on the
// instruction-set level), and once per level in dispatch.cpp
// (mt::cpu::isa_base, isa_avx2, isa_avx512: the kernel files compiled for
// that level). Only declarations, and no #include: <cstdint> comes first.

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC, bool accumulate);
template <typename T> void matmul_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t N,
                                           int64_t C, int64_t OC, bool accumulate_dinp = false);
// General strided GEMM, row-major (gemm.h): C = alpha op(A) op(B) + beta C.
template <typename T> void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Local attention, blockwise (attention.cpp): out (B, T, H, hd), lse (B, H, T); backward writes (or with
// accumulate adds to) dq (B, T, H, hd), dk and dv (B, S, KV, hd). H a multiple of KV (grouped-query).
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionDims& d);
template <typename T> void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                                              const T* out, const T* lse, const AttentionDims& d, bool accumulate);

// residual != nullptr: sum = inp + residual first (sum may alias either), then the norm of sum.
template <typename T> void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                           double eps, T* sum = nullptr, const T* residual = nullptr);
// dresidual != nullptr: added to dinp (may alias it).
template <typename T> void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                                            const T* rstd, int64_t N, int64_t C, const T* dresidual = nullptr);

template <typename T> void rope_tables(T* cos, T* sin, const int64_t* positions, int64_t P, int64_t hd, double theta);
template <typename T>
void rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd);
template <typename T>
void rope_backward(T* dinp, const T* dout, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd);

template <typename T> void swiglu_forward(T* out, const T* gate, const T* up, int64_t n);
template <typename T> void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n);

template <typename T> void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                             int64_t C, int64_t row_begin);
template <typename T> void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N,
                                              int64_t V_local, int64_t C, int64_t row_begin);

template <typename T> void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                         int64_t V, double grad_scale);

template <typename T> void vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V);
template <typename T> void vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                              const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                              int64_t vocab_begin);
template <typename T> void vocab_shard_loss(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                                            const double* row_max, const double* sumexp, const double* target_logit,
                                            int64_t N, int64_t V, int64_t vocab_begin, double grad_scale);

template <typename T> void add(T* out, const T* a, const T* b, int64_t n);
template <typename T> void scale(T* t, double s, int64_t n);
template <typename T> double sum_squares(const T* t, int64_t n);
template <typename T> double sum(const T* t, int64_t n);

template <typename T, typename S> void adamw(T* param, const T* grad, S* m, S* v, int64_t n, double lr, double beta1,
                                             double beta2, double eps, double weight_decay, int64_t step);
