// One training step, readable top to bottom in train_step (batch, forward and backward by the executor, gradient
// sync, loss and norm, clip and update), and evaluation.
#pragma once
#include <cstdint>

#include "runtime/train/run.h"

namespace mt {

struct StepResult {
  double loss = 0, grad_norm = 0, lr = 0;
  RouterStepStats router;      // an MoE model's routing in the step (global); the balance loss is part of loss
  bool skipped = false;        // the loss or grad norm was not finite: the update was not applied
  int64_t trained_tokens = 0;  // the global batch's trained targets (all of them without a loss mask; 0: no update)
};
StepResult train_step(TrainRun& run, int64_t step);

// Brings every gradient to its parameter's placement through run.grad_sync: buckets, or one redistribute per
// parameter with grad_bucket_mb 0; both reduce in training.grad_reduce_dtype.
void sync_gradients(TrainRun& run);

// Mean loss of the trained targets over eval.steps validation batches (collective over dp; NaN when the masks
// keep none).
double evaluate(TrainRun& run);

}  // namespace mt
