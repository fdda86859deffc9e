// Softmax cross-entropy fused over each row of logits: one pass for the max,
// one for the sum of exponentials, one writing the gradient
// (softmax - onehot) * grad_scale, so the probabilities are never stored.
#include "runtime/kernels/cpu/isa_level.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                                         int64_t V, double grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;  // (V)
    int32_t tgt = targets[n];
    if (tgt < 0) {  // ignored position
      losses[n] = T(0);
      if (dlogits) std::fill(dlogits + n * V, dlogits + (n + 1) * V, T(0));
      continue;
    }
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(x[v]));
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(double(x[v]) - mx);
    double lse = mx + std::log(se);
    losses[n] = T(lse - double(x[tgt]));
    if (dlogits) {
      T* d = dlogits + n * V;  // may alias x: each element is read before it is written
      for (int64_t v = 0; v < V; ++v) d[v] = T(std::exp(double(x[v]) - lse) * grad_scale);
      d[tgt] -= T(grad_scale);
    }
  }
}

// Vocab-parallel pieces: each rank holds columns [vocab_begin, vocab_begin + V) of every row.
template <typename T> void vocab_shard_max(double* row_max, const T* logits, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[n * V + v]));
    row_max[n] = mx;
  }
}

template <typename T> void vocab_shard_sumexp(double* sumexp, double* target_logit, const T* logits,
                                              const int32_t* targets, const double* row_max, int64_t N, int64_t V,
                                              int64_t vocab_begin) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* x = logits + n * V;
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(double(x[v]) - row_max[n]);
    sumexp[n] = se;
    int64_t t = int64_t(targets[n]) - vocab_begin;
    target_logit[n] = (targets[n] >= 0 && t >= 0 && t < V) ? double(x[t]) : 0.0;
  }
}

template <typename T> void vocab_shard_loss(T* losses, T* dlogits, const T* logits, const int32_t* targets,
                                            const double* row_max, const double* sumexp, const double* target_logit,
                                            int64_t N, int64_t V, int64_t vocab_begin, double grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const bool ignored = targets[n] < 0;
    const double lse = row_max[n] + std::log(sumexp[n]);
    losses[n] = ignored ? T(0) : T(lse - target_logit[n]);
    if (!dlogits) continue;
    const T* x = logits + n * V;
    T* d = dlogits + n * V;
    for (int64_t v = 0; v < V; ++v) d[v] = ignored ? T(0) : T(std::exp(double(x[v]) - lse) * grad_scale);
    int64_t t = int64_t(targets[n]) - vocab_begin;
    if (!ignored && t >= 0 && t < V) d[t] -= T(grad_scale);
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(cross_entropy)
MT_CPU_EXPORT(vocab_shard_max)
MT_CPU_EXPORT(vocab_shard_sumexp)
MT_CPU_EXPORT(vocab_shard_loss)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/cross_entropy.cu: a warp per row
// One read of the logits for the statistics, one pass writing the gradient.
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
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

namespace {
// The losses' operands of both cross-entropies: logits (N, V) or (N, V_local), targets (N) i32, losses (N) in the
// accum dtype, dlogits (if defined) like the logits.
void check_loss_operands(const char* op, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                         const Tensor& targets) {
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V), got {}", op, shape_str(logits.shape()));
  const int64_t N = logits.size(0);
  check_i32(op, targets, N, "targets");
  expect_shape(op, losses, {N}, "losses");
  expect_acc(op, losses, logits.dtype(), "losses");
  if (dlogits.defined()) {
    expect_shape(op, dlogits, logits.shape(), "dlogits");
    same_dtype(op, logits, dlogits, "dlogits");
  }
}
}  // namespace

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, double grad_scale) {
  const char* op = "cross_entropy";
  check_loss_operands(op, losses, dlogits, logits, targets);
  int64_t N = logits.size(0), V = logits.size(1);
  auto check_targets = [&] {  // host targets only
    const int32_t* tg = targets.data<int32_t>();
    for (int64_t n = 0; n < N; ++n)
      MT_CHECK(tg[n] < V, "kernels", "{}: target {} at position {} is >= the vocabulary size {}", op, tg[n], n, V);
  };
  // bf16 on the CPU: softmax and loss in f32 on the widened logits.
  dispatch(
      op, logits,
      MT_CUDA_FN(return cuda::cross_entropy<T>(ptr<float>(losses), ptr<T>(dlogits), ptr<T>(logits),
                                               targets.data<int32_t>(), N, V, grad_scale, stream_of(logits));),
      [&](auto z, const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets) {
        using T = decltype(z);
        check_targets();
        MT_CPU_KERNEL(cross_entropy, T)
        (ptr<T>(losses), ptr<T>(dlogits), ptr<T>(logits), targets.data<int32_t>(), N, V, grad_scale);
      },
      wr(losses), wr(dlogits), rd(logits), rd(targets));
}

namespace {
void check_f64_rows(const char* op, const Tensor& t, const Tensor& logits, int64_t N, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::f64 && t.shape() == Shape{N} && t.device() == logits.device(), "kernels",
           "{}: {} must be ({}) f64 on the logits' device ({})", op, what, N, logits.device().str());
}
}  // namespace

void vocab_shard_max(const Tensor& row_max, const Tensor& logits) {
  const char* op = "vocab_shard_max";
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_f64_rows(op, row_max, logits, N, "row_max");
  dispatch(
      op, logits,
      MT_CUDA_FN(return cuda::vocab_shard_max<T>(ptr<double>(row_max), ptr<T>(logits), N, V, stream_of(logits));),
      [&](auto z, const Tensor& row_max, const Tensor& logits) {
        using T = decltype(z);
        MT_CPU_KERNEL(vocab_shard_max, T)(row_max.data<double>(), ptr<T>(logits), N, V);
      },
      wr(row_max), rd(logits));
}

void vocab_shard_sumexp(const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                        const Tensor& row_max, int64_t vocab_begin) {
  const char* op = "vocab_shard_sumexp";
  check_float(op, logits, "logits");
  MT_CHECK(logits.dim() == 2, "kernels", "{}: logits must be (N, V_local)", op);
  int64_t N = logits.size(0), V = logits.size(1);
  check_i32(op, targets, N, "targets");
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, logits, N, "statistics");
  dispatch(
      op, logits,
      MT_CUDA_FN(return cuda::vocab_shard_sumexp<T>(ptr<double>(sumexp), ptr<double>(target_logit), ptr<T>(logits),
                                                    targets.data<int32_t>(), ptr<double>(row_max), N, V, vocab_begin,
                                                    stream_of(logits));),
      [&](auto z, const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
          const Tensor& row_max) {
        using T = decltype(z);
        MT_CPU_KERNEL(vocab_shard_sumexp, T)
        (sumexp.data<double>(), target_logit.data<double>(), ptr<T>(logits), targets.data<int32_t>(),
         row_max.data<double>(), N, V, vocab_begin);
      },
      wr(sumexp), wr(target_logit), rd(logits), rd(targets), rd(row_max));
}

void vocab_shard_loss(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                      const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, int64_t vocab_begin,
                      double grad_scale) {
  const char* op = "vocab_shard_loss";
  check_loss_operands(op, losses, dlogits, logits, targets);
  int64_t N = logits.size(0), V = logits.size(1);
  for (auto* t : {&sumexp, &target_logit, &row_max}) check_f64_rows(op, *t, logits, N, "statistics");
  dispatch(
      op, logits,
      MT_CUDA_FN(return cuda::vocab_shard_loss<T>(ptr<float>(losses), ptr<T>(dlogits), ptr<T>(logits),
                                                  targets.data<int32_t>(), ptr<double>(row_max), ptr<double>(sumexp),
                                                  ptr<double>(target_logit), N, V, vocab_begin, grad_scale,
                                                  stream_of(logits));),
      [&](auto z, const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
          const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit) {
        using T = decltype(z);
        MT_CPU_KERNEL(vocab_shard_loss, T)
        (ptr<T>(losses), ptr<T>(dlogits), ptr<T>(logits), targets.data<int32_t>(), row_max.data<double>(),
         sumexp.data<double>(), target_logit.data<double>(), N, V, vocab_begin, grad_scale);
      },
      wr(losses), wr(dlogits), rd(logits), rd(targets), rd(row_max), rd(sumexp), rd(target_logit));
}

}  // namespace mt
#endif  // MT_CPU_OPS
