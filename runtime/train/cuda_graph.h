// training.cuda_graph: the step as two CUDA graphs (docs/design/cuda-graphs.md). After two eager warm-up steps
// (cuBLASLt and cuDNN plans, NCCL communicators, the optimizer state and the gradient buckets made), the step is
// captured once and replayed every step after:
//   graph 1: zeroed gradients, forward and backward of every micro-batch, the gradient sync, the loss and the
//            gradient norm's squares summed and all-reduced (the micro-batches' tokens copied into the graph's
//            input tensors before each replay);
//   the step's one host sync: loss and norm read; the non-finite rule and the clip scale decided on the host;
//   graph 2: clipping and AdamW, their scalars (learning rate, bias corrections, clip scale) copied from pinned
//            host memory at the start of each replay, so one graph serves every step of the schedule.
// A step's bits are the eager step's. What the graphs cannot hold is named once and the run steps eagerly.
#pragma once
#include <memory>
#include <string>

#include "runtime/train/step.h"

namespace mt {

struct StepGraphs;

// Why this run cannot step through CUDA graphs ("" when it can): not a CUDA device, pipeline parallel, MoE, ...
std::string cuda_graph_refusal(const TrainRun& run);
// training.cuda_graph on: the graphs' state (captured at the third step), or null with the reason logged once.
std::shared_ptr<StepGraphs> make_step_graphs(const TrainRun& run);
// One step through the graphs (eager while warming up, or when this step's trained-token count differs from the
// captured step's: the loss scale is a kernel argument).
StepResult graph_train_step(TrainRun& run, StepGraphs& graphs, int64_t step);

}  // namespace mt
