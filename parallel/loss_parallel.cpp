#include "parallel/loss_parallel.h"

#include "runtime/kernels/ops.h"

namespace mt {

void vocab_parallel_cross_entropy(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                  const Tensor& targets, int64_t vocab_begin, double grad_scale, Group& tp) {
  const int64_t N = logits.size(0);
  Tensor row_max = empty({N}, DType::f64, logits.device());  // (N)
  vocab_shard_max(row_max, logits);
  tp.all_reduce(row_max, ReduceOp::max);
  Tensor stats = empty({2, N}, DType::f64, logits.device());  // (2, N): sum of exponentials, target logit
  Tensor sumexp = stats.slice0(0, 1).reshape({N}), target_logit = stats.slice0(1, 2).reshape({N});
  vocab_shard_sumexp(sumexp, target_logit, logits, targets, row_max, vocab_begin);
  tp.all_reduce(stats, ReduceOp::sum);  // one all-reduce for both
  vocab_shard_loss(losses, dlogits, logits, targets, row_max, sumexp, target_logit, vocab_begin, grad_scale);
}

}  // namespace mt
