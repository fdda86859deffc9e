// The CPU kernels' entry points (mt::cpu, cpu_ops.h): each calls the kernel
// compiled for the instruction-set level this process runs at (isa.h). The
// level is detected once from CPUID (GCC's __builtin_cpu_supports, which also
// checks that the OS saves the AVX / AVX-512 registers). Compiled at the
// baseline only, like everything outside the kernel files.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/core/error.h"
#include "runtime/kernels/cpu/cpu_ops.h"
#include "runtime/kernels/cpu/isa.h"

#ifndef MT_CPU_DISPATCH
#define MT_CPU_DISPATCH 0
#endif

namespace mt {

namespace cpu {
namespace isa_base {
#include "runtime/kernels/cpu/cpu_ops_decl.h"
}
#if MT_CPU_DISPATCH
namespace isa_avx2 {
#include "runtime/kernels/cpu/cpu_ops_decl.h"
}
namespace isa_avx512 {
#include "runtime/kernels/cpu/cpu_ops_decl.h"
}
#endif
}  // namespace cpu

namespace {

CpuIsa detect_supported() {
#if MT_CPU_DISPATCH
  __builtin_cpu_init();
  // The levels as the compiler defines them (-march=x86-64-v3 / -v4 may emit any of these instructions).
#if defined(__clang__) || __GNUC__ < 12
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe") &&
                  __builtin_cpu_supports("lzcnt");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
#else
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
  const bool v4 = v3 && __builtin_cpu_supports("x86-64-v4");
#endif
  return v4 ? CpuIsa::avx512 : v3 ? CpuIsa::avx2 : CpuIsa::base;
#else
  return CpuIsa::base;
#endif
}

CpuIsa parse_isa(const char* s) {
  if (!std::strcmp(s, "base")) return CpuIsa::base;
  if (!std::strcmp(s, "avx2")) return CpuIsa::avx2;
  if (!std::strcmp(s, "avx512")) return CpuIsa::avx512;
  fail("kernels", "MT_CPU_ISA={}: expected base, avx2 or avx512", s);
}

std::atomic<int>& current_slot() {
  static std::atomic<int> slot{[] {
    CpuIsa isa = cpu_isa_supported();
    if (const char* env = std::getenv("MT_CPU_ISA"); env && *env) {
      CpuIsa want = parse_isa(env);
      MT_CHECK(int(want) <= int(isa), "kernels", "MT_CPU_ISA={} asks for {}, which this {} lacks (widest: {})", env,
               cpu_isa_name(want), MT_CPU_DISPATCH ? "machine" : "build", cpu_isa_name(isa));
      isa = want;
    }
    return int(isa);
  }()};
  return slot;
}

inline CpuIsa active() { return CpuIsa(current_slot().load(std::memory_order_relaxed)); }

}  // namespace

CpuIsa cpu_isa_supported() {
  static const CpuIsa s = detect_supported();
  return s;
}

CpuIsa cpu_isa() { return active(); }

void set_cpu_isa(CpuIsa isa) {
  MT_CHECK(int(isa) <= int(cpu_isa_supported()), "kernels", "set_cpu_isa: {} is not supported here (widest: {})",
           cpu_isa_name(isa), cpu_isa_name(cpu_isa_supported()));
  current_slot().store(int(isa), std::memory_order_relaxed);
}

const char* cpu_isa_name(CpuIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case CpuIsa::avx512:
      return "x86-64-v4 (AVX-512)";
    case CpuIsa::avx2:
      return "x86-64-v3 (AVX2, FMA)";
    case CpuIsa::base:
      break;
  }
  return MT_CPU_DISPATCH ? "x86-64-v2 (SSE4.2)" : "the build's -march";
#else
  (void)isa;
  return "baseline";
#endif
}

namespace cpu {

// One call to the kernel of the active level; the argument is the call, template arguments included.
#if MT_CPU_DISPATCH
#define MT_CPU_CALL(...)              \
  switch (active()) {                 \
    case CpuIsa::avx512:              \
      return isa_avx512::__VA_ARGS__; \
    case CpuIsa::avx2:                \
      return isa_avx2::__VA_ARGS__;   \
    case CpuIsa::base:                \
      break;                          \
  }                                   \
  return isa_base::__VA_ARGS__
#else
#define MT_CPU_CALL(...) return isa_base::__VA_ARGS__
#endif

template <typename T>
void matmul_forward(T* out, const T* inp, const T* weight, int64_t N, int64_t C, int64_t OC, bool accumulate) {
  MT_CPU_CALL(matmul_forward<T>(out, inp, weight, N, C, OC, accumulate));
}
template <typename T> void matmul_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t N,
                                           int64_t C, int64_t OC, bool accumulate_dinp) {
  MT_CPU_CALL(matmul_backward<T>(dinp, dweight, dout, inp, weight, N, C, OC, accumulate_dinp));
}
template <typename T> void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  MT_CPU_CALL(gemm<T>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, const AttentionDims& d) {
  MT_CPU_CALL(attention_forward<T>(out, lse, q, k, v, d));
}
template <typename T> void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                                              const T* out, const T* lse, const AttentionDims& d, bool accumulate) {
  MT_CPU_CALL(attention_backward<T>(dq, dk, dv, dout, q, k, v, out, lse, d, accumulate));
}
template <typename T> void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                           double eps, T* sum, const T* residual) {
  MT_CPU_CALL(rmsnorm_forward<T>(out, rstd, inp, weight, N, C, eps, sum, residual));
}
template <typename T> void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                                            const T* rstd, int64_t N, int64_t C, const T* dresidual) {
  MT_CPU_CALL(rmsnorm_backward<T>(dinp, dweight, dout, inp, weight, rstd, N, C, dresidual));
}
template <typename T> void rope_tables(T* cos, T* sin, const int64_t* positions, int64_t P, int64_t hd, double theta) {
  MT_CPU_CALL(rope_tables<T>(cos, sin, positions, P, hd, theta));
}
template <typename T>
void rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  MT_CPU_CALL(rope_forward<T>(out, inp, cos, sin, B, T_, H, hd));
}
template <typename T>
void rope_backward(T* dinp, const T* dout, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  MT_CPU_CALL(rope_backward<T>(dinp, dout, cos, sin, B, T_, H, hd));
}
template <typename T> void swiglu_forward(T* out, const T* gate, const T* up, int64_t n) {
  MT_CPU_CALL(swiglu_forward<T>(out, gate, up, n));
}
template <typename T> void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  MT_CPU_CALL(swiglu_backward<T>(dgate, dup, dout, gate, up, n));
}
template <typename T> void embedding_forward(T* out, const int32_t* tokens, const T* table, int64_t N, int64_t V_local,
                                             int64_t C, int64_t row_begin) {
  MT_CPU_CALL(embedding_forward<T>(out, tokens, table, N, V_local, C, row_begin));
}
template <typename T> void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int64_t N,
                                              int64_t V_local, int64_t C, int64_t row_begin) {
  MT_CPU_CALL(embedding_backward<T>(dtable, dout, tokens, N, V_local, C, row_begin));
}
template <typename T> void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                         int64_t V, double grad_scale) {
  MT_CPU_CALL(cross_entropy<T>(losses, dlogits, logits, targets, N, V, grad_scale));
}
template <typename T> void vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V) {
  MT_CPU_CALL(vocab_shard_max<T>(row_max, logits, N, V));
}
template <typename T> void vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                              const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                              int64_t vocab_begin) {
  MT_CPU_CALL(vocab_shard_sumexp<T>(sumexp, target_logit, logits, targets, row_max, N, V, vocab_begin));
}
template <typename T> void vocab_shard_loss(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                                            const double* row_max, const double* sumexp, const double* target_logit,
                                            int64_t N, int64_t V, int64_t vocab_begin, double grad_scale) {
  MT_CPU_CALL(vocab_shard_loss<T>(losses, dlogits, logits, targets, row_max, sumexp, target_logit, N, V, vocab_begin,
                                  grad_scale));
}
template <typename T> void add(T* out, const T* a, const T* b, int64_t n) { MT_CPU_CALL(add<T>(out, a, b, n)); }
template <typename T> void scale(T* t, double s, int64_t n) { MT_CPU_CALL(scale<T>(t, s, n)); }
template <typename T> double sum_squares(const T* t, int64_t n) { MT_CPU_CALL(sum_squares<T>(t, n)); }
template <typename T> double sum(const T* t, int64_t n) { MT_CPU_CALL(sum<T>(t, n)); }
template <typename T, typename S> void adamw(T* param, const T* grad, S* m, S* v, int64_t n, double lr, double beta1,
                                             double beta2, double eps, double weight_decay, int64_t step) {
  MT_CPU_CALL(adamw<T, S>(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step));
}
#undef MT_CPU_CALL

#define MT_CPU_INSTANTIATE(T)                                                                                      \
  template void matmul_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool);                        \
  template void matmul_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, bool);         \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*,     \
                        int64_t);                                                                                  \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&);                  \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const T*,      \
                                      const AttentionDims&, bool);                                                 \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double, T*, const T*);            \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t, const T*);   \
  template void rope_tables<T>(T*, T*, const int64_t*, int64_t, int64_t, double);                                  \
  template void rope_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t);             \
  template void rope_backward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t);            \
  template void swiglu_forward<T>(T*, const T*, const T*, int64_t);                                                \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t);                                 \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t, int64_t);            \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t);           \
  template void cross_entropy<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, double);                      \
  template void vocab_shard_max<T>(double*, const T*, int64_t, int64_t);                                           \
  template void vocab_shard_sumexp<T>(double*, double*, const T*, const int32_t*, const double*, int64_t, int64_t, \
                                      int64_t);                                                                    \
  template void vocab_shard_loss<T>(T*, T*, const T*, const int32_t*, const double*, const double*, const double*, \
                                    int64_t, int64_t, int64_t, double);                                            \
  template void add<T>(T*, const T*, const T*, int64_t);                                                           \
  template void scale<T>(T*, double, int64_t);                                                                     \
  template double sum_squares<T>(const T*, int64_t);                                                               \
  template double sum<T>(const T*, int64_t);                                                                       \
  template void adamw<T, T>(T*, const T*, T*, T*, int64_t, double, double, double, double, double, int64_t);
MT_CPU_INSTANTIATE(float)
MT_CPU_INSTANTIATE(double)
#undef MT_CPU_INSTANTIATE

}  // namespace cpu
}  // namespace mt
