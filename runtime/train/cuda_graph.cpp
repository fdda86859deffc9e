// training.cuda_graph (cuda_graph.h): the step as two CUDA graphs around its one host sync.
#include "runtime/train/cuda_graph.h"

#include <spdlog/spdlog.h>

#include <cmath>

#include "comm/watchdog.h"
#include "models/lora.h"
#include "models/model.h"
#include "runtime/core/allocator.h"
#include "runtime/core/fault.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"
#include "runtime/core/trace.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/step_executor.h"

namespace mt {

namespace {
// Eager steps before the capture: the first makes what a step makes once (the optimizer's state, cuBLASLt's and
// cuDNN's plans and workspaces, NCCL's communicators, the gradient buckets); the second runs with all of it, so
// that the captured step is a steady one.
constexpr int64_t kWarmupSteps = 2;
}  // namespace

struct StepGraphs {
  int device = 0;
  int64_t eager_steps = 0;
  double inv_tokens = 0;          // the captured step's loss scale (a kernel argument in graph 1)
  std::vector<MicroBatch> micro;  // graph 1's input tensors, one per micro-batch: each step's tokens copied in
  Tensor stats;                   // (1 + norm groups) f64: graph 1's loss sum and gradient norm squares
  std::vector<Tensor> losses;     // graph 1's per-token losses: held, as everything the graph writes
  CudaGraph forward_backward, update;
  float* scalars_host = nullptr;  // (params, 4) pinned: each parameter's AdamW scalars (adamw_step's hyper)
  Tensor scalars;                 // (params, 4) f32 on the device: graph 2 copies the pinned ones in first
  bool said_eager = false;
  StepGraphs() = default;
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;
  ~StepGraphs() {
    if (scalars_host) pinned_free(scalars_host);
  }
};

std::string cuda_graph_refusal(const TrainRun& run) {
  const Config& c = run.config;
  if (!run.device.is_cuda()) return "the ranks are not on CUDA devices (comm.device)";
  if (run.pd.pp_size() > 1)
    return "pipeline parallel (parallel.pp > 1) moves activations between stages by the schedule's point-to-point "
           "transfers, posted and tested from the host";
  if (c.model.moe.n_experts > 0)
    return "MoE layers (model.moe) keep their routing statistics' per-micro-batch bookkeeping on the host (and "
           "dropless expert parallel reads each layer's counts)";
  if (c.lora.enabled() && c.lora.dropout > 0)
    return "LoRA dropout's masks (lora.dropout > 0) are keyed by the step number on the host";
  if (c.data.document_separator >= 0)
    return "packed documents (data.document_separator) give attention bounds computed on the host for each batch";
  if (run.model->wants_mtp()) return "multi-token prediction's inputs (model.mtp_layers) are built on the host";
  if (kprof::enabled()) return "MT_PROFILE_KERNELS times each op with events the host reads";
  for (const MeshDim& d : run.mesh.dims()) {
    const Group& g = run.mesh.group(d.name);
    if (g.size() > 1 && g.backend() != "nccl")
      return "the mesh's " + d.name + " group runs on the " + std::string(g.backend()) +
             " backend, which stages collectives through the host (NCCL's are recorded in the graph)";
  }
  return "";
}

std::shared_ptr<StepGraphs> make_step_graphs(const TrainRun& run) {
  if (!run.config.training.cuda_graph) return nullptr;
  if (const std::string why = cuda_graph_refusal(run); !why.empty()) {
    spdlog::warn("training.cuda_graph: the steps run without CUDA graphs: {}", why);
    return nullptr;
  }
  auto g = std::make_shared<StepGraphs>();
  g->device = run.device.index;
  spdlog::info("training.cuda_graph: {} eager warm-up steps, then each step replays two CUDA graphs (forward, "
               "backward, gradient sync, loss and norm; clipping and AdamW)",
               kWarmupSteps);
  return g;
}

namespace {

// The captured work of graph 1: train_step's steps 2 to 4 (step.cpp), on the graph's input tensors.
void record_forward_backward(TrainRun& run, StepGraphs& g, const Batch& batch) {
  zero_grads(run.trainable);
  run.capture_micro = &g.micro;  // local_micro_batch hands the executor the graph's inputs
  g.losses = run.executor->forward_backward(run, batch, g.inv_tokens);
  run.capture_micro = nullptr;
  sync_gradients(run);
  const int64_t norm_groups = grad_norm_slots(run.trainable);
  g.stats = zeros({1 + norm_groups}, DType::f64, run.device);
  for (const Tensor& l : g.losses) sum_into(g.stats, 0, l);
  run.mesh.group(run.pd.loss_group()).all_reduce(g.stats.view(0, {1}), ReduceOp::sum);
  grad_norm_squares(g.stats, 1, run.trainable);
}

// The captured work of graph 2: clip_grads and AdamW::step, every scalar read from g.scalars.
void record_update(TrainRun& run, StepGraphs& g) {
  const auto& params = run.opt->params();
  const int64_t P = int64_t(params.size());
  copy_(g.scalars, from_blob(g.scalars_host, {P, 4}, DType::f32));  // pinned: read at each replay
  const TrainingConfig& t = run.config.training;
  for (int64_t i = 0; i < P; ++i) {
    Parameter* p = params[size_t(i)];
    AdamW::State& s = run.opt->state().at(p->name);
    adamw_step(p->value.local, p->grad.local, s.exp_avg, s.exp_avg_sq, /*lr=*/0, t.beta1, t.beta2, t.eps, 0,
               /*step=*/1, compute_copy(*p), g.scalars.view(i * 4, {4}));
  }
}

// Captures `record` as a graph: the host may not wait for the device meanwhile, and nothing of it runs.
template <typename F> CudaGraph capture(TrainRun& run, const char* what, F&& record) {
  static thread_local std::string why;
  why = fmt::format("the capture of the step's CUDA graph ({}; training.cuda_graph)", what);
  forbid_host_sync(why.c_str());
  CudaGraph::begin_capture(run.device.index);
  try {
    record();
  } catch (...) {
    forbid_host_sync(nullptr);
    run.capture_micro = nullptr;
    try {
      (void)CudaGraph::end_capture(run.device.index);  // discarded: the error says what broke it
    } catch (...) {
    }
    throw;
  }
  forbid_host_sync(nullptr);
  return CudaGraph::end_capture(run.device.index);
}

// AdamW's scalars of step `step` (1-based) for each parameter, as adamw_step computes them from lr, and the clip
// scale as clip_grads applies it (1: no clipping).
void write_scalars(const TrainRun& run, const StepGraphs& g, double lr, int64_t step, double grad_norm) {
  const TrainingConfig& t = run.config.training;
  const double coef = t.grad_clip > 0 ? t.grad_clip / (grad_norm + 1e-6) : 1.0;
  const float clip = coef < 1 ? float(coef) : 1.0f;
  const float step_size = float(lr / (1.0 - std::pow(t.beta1, double(step))));
  const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(t.beta2, double(step))));
  const auto& params = run.opt->params();
  for (size_t i = 0; i < params.size(); ++i) {
    const double wd = params[i]->weight_decay ? t.weight_decay : 0.0;
    float* row = g.scalars_host + 4 * i;
    row[0] = float(1.0 - lr * wd), row[1] = step_size, row[2] = bc2_sqrt, row[3] = clip;
  }
}

}  // namespace

StepResult graph_train_step(TrainRun& run, StepGraphs& g, int64_t step) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  if (g.eager_steps < kWarmupSteps) {
    ++g.eager_steps;
    return train_step(run, step);
  }
  // 1. This rank's rows, and the loss scale: a step whose scale is not the captured one runs eagerly.
  Batch batch = [&] {
    trace::Span span("data", "data");
    return get_batch(run.train_data, step, B, T, run.dp_rank * run.rows, run.rows);  // (rows, T) x2
  }();
  const int64_t trained = trained_targets(run.train_data, step, B, T);
  const double inv_tokens = trained > 0 ? 1.0 / double(trained) : 0.0;
  if (g.forward_backward.defined() && inv_tokens != g.inv_tokens) {
    if (!g.said_eager)
      spdlog::info("training.cuda_graph: step {} trains {} targets, the captured step {}: such steps run eagerly (the "
                   "loss scale is an argument of the graph's kernels; said once)",
                   step + 1, trained, std::llround(1.0 / g.inv_tokens));
    g.said_eager = true;
    return train_step(run, step);
  }
  fault_slow_rank();
  // 2. The tokens into graph 1's input tensors (the first time, these tensors become them).
  {
    trace::Span span("data", "data");
    for (int64_t r = 0, i = 0; r < run.rows; r += run.micro, ++i) {
      MicroBatch mb = local_micro_batch(run, batch, r);  // (mb, T_local) x2 on the device
      if (size_t(i) >= g.micro.size()) {
        g.micro.push_back(mb);
        continue;
      }
      copy_(g.micro[size_t(i)].inputs, mb.inputs);
      copy_(g.micro[size_t(i)].targets, mb.targets);
    }
  }
  // 3. Graph 1 (captured at the first step here): forward, backward, gradient sync, loss and norm squares.
  std::optional<trace::Span> phase;
  phase.emplace("forward, backward, grad sync (CUDA graph)", "phase");
  if (!g.forward_backward.defined()) {
    g.inv_tokens = inv_tokens;
    g.forward_backward = capture(run, "forward, backward, gradient sync", [&] { record_forward_backward(run, g, batch); });
    spdlog::info("training.cuda_graph: captured the step's forward, backward and gradient sync at step {}", step + 1);
  }
  std::vector<double> host;
  {
    // A peer that never joins a collective inside the graph leaves the host waiting below: the watchdog's.
    WatchdogScope watch("the step's CUDA graph (forward, backward, gradient sync)",
                        fmt::format("cuda:{}", run.device.index));
    g.forward_backward.replay();
    host = to_f64(g.stats);  // the step's one host sync, as in train_step
  }

  // 4. Loss, norm and the non-finite rule, as train_step decides them.
  const int64_t norm_groups = int64_t(host.size()) - 1;
  double norm_sq = 0;
  for (int64_t k = 1; k <= norm_groups; ++k) norm_sq += host[size_t(k)];
  const std::vector<double> sums = run.executor->sum_over_stages({host[0], norm_sq});
  StepResult res;
  res.trained_tokens = trained;
  res.router = run.model->take_router_stats();
  res.loss = sums[0] * inv_tokens + res.router.aux_loss;
  res.grad_norm = std::sqrt(sums[1]);
  res.lr = lr_at(t, step);
  res.skipped = !std::isfinite(res.loss) || !std::isfinite(res.grad_norm);
  if (res.skipped || trained == 0) return res;
  // 5. Graph 2: clipping and AdamW with this step's scalars.
  phase.reset();
  phase.emplace("optimizer (CUDA graph)", "phase");
  if (!g.update.defined()) {
    const int64_t P = int64_t(run.opt->params().size());
    g.scalars_host = static_cast<float*>(pinned_alloc(size_t(P) * 4 * sizeof(float)));
    g.scalars = empty({P, 4}, DType::f32, run.device);
    g.update = capture(run, "clipping and AdamW", [&] { record_update(run, g); });
  }
  write_scalars(run, g, res.lr, run.opt->steps_taken() + 1, res.grad_norm);
  g.update.replay();
  run.opt->set_steps_taken(run.opt->steps_taken() + 1);
  run.model->after_step();
  return res;
}

}  // namespace mt
