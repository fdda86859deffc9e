#include "runtime/train/run.h"

#include <algorithm>

#include <sched.h>

#include <fstream>
#include <thread>

#include "comm/world.h"
#include "runtime/train/cuda_graph.h"
#include "models/layers.h"
#include "parallel/loss_parallel.h"
#include "runtime/core/allocator.h"
#include "runtime/core/log.h"
#include "runtime/core/startup.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/agree.h"
#include "runtime/train/run_context.h"

namespace mt {

namespace {

// Host memory this rank may use: MemAvailable, or the cgroup's limit less its usage when lower, shared by the ranks
// of this node; training.memory_limit_mb when set and lower. 0 when unknown (no check).
double rank_memory_bytes(const MpiEnv& env, double limit_mb) {
  double avail = 0;
  std::ifstream mi("/proc/meminfo");
  for (std::string key; mi >> key;) {
    double kb = 0;
    mi >> kb;
    if (key == "MemAvailable:") avail = kb * 1024;
    mi.ignore(256, '\n');
  }
  auto read_num = [](const char* path) {
    std::ifstream f(path);
    double v = -1;
    if (!(f >> v)) v = -1;  // "max" or missing: no limit
    return v;
  };
  for (auto [lim, used] : {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                           std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                     "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const double l = read_num(lim), u = read_num(used);
    if (l > 0 && l < 1e18) {
      const double left = std::max(0.0, l - std::max(0.0, u));
      avail = avail > 0 ? std::min(avail, left) : left;
    }
  }
  double per_rank = avail / double(std::max(1, env.local_size()));
  if (limit_mb > 0) per_rank = per_rank > 0 ? std::min(per_rank, limit_mb * double(1 << 20)) : limit_mb * double(1 << 20);
  return per_rank;
}

// Before anything of the model exists (a billion layers must not run the machine out of memory): the parameters a
// rank holds at the least, with their gradients and the optimizer's state (param_state_bytes in f32), against the
// memory it has. Counted in double from the family's parameter count (one and two layers, extrapolated, so that no count
// overflows), spread over every dim that can shard a parameter. `memory` is the job's smallest (the same on every
// rank, so the error is printed once).
void check_model_fits(const Config& cfg, double memory) {
  if (memory <= 0) return;
  const ModelConfig& m = cfg.model;
  const ModelFamily& family = family_of(m);
  ModelConfig one = m, two = m;
  one.n_layers = 1, two.n_layers = 2;
  one.moe.mlp_only_layers.clear(), two.moe.mlp_only_layers.clear();
  const double p1 = double(family.num_params(one, true)), p2 = double(family.num_params(two, true));
  const double params = p1 + (p2 - p1) * double(std::max<int64_t>(m.n_layers - 1, 0));
  const auto& p = cfg.parallel;
  const double shards =
      double(std::max(1, p.pp)) * std::max(1, p.tp) * std::max(1, p.dp_shard) * std::max(1, p.ep);
  const double per_param = param_state_bytes(DType::f32).total();  // f32 master, gradient, optimizer state
  const double bytes = params / shards * per_param;
  if (bytes <= memory) return;
  const std::string from = m.init_from.empty() ? std::string()
                                                : fmt::format(" (model.init_from's config.json: num_hidden_layers, "
                                                              "hidden_size, intermediate_size, vocab_size)");
  fail("config",
       "the model does not fit in this rank's memory: model.n_layers = {}, model.dim = {}, model.ffn_dim = {}, "
       "model.vocab_size = {}{} make {:.3g} parameters, at least {:.3g} GiB per rank with their gradients and "
       "AdamW's two moments ({:g} B each, spread over parallel.pp x tp x dp_shard x ep = {:g} ranks), but a rank has "
       "{:.3g} GiB (the host's available memory, or its cgroup's limit, shared by the ranks of a node, or "
       "training.memory_limit_mb): make the model smaller or shard it over more ranks",
       m.n_layers, m.dim, m.ffn_dim, m.vocab_size, from, params, bytes / double(1 << 30), per_param, shards,
       memory / double(1 << 30));
}

// training.threads 0: the cores this process may run on. A launcher that binds (Slurm's --cpus-per-task, mpirun
// --bind-to) gives each rank its own set; one that does not gives every rank all the node's cores, shared by the
// ranks on the node.
int auto_threads(const MpiEnv& env) {
  const int hw = int(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  const int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : hw;
  if (allowed > 0 && allowed < hw) return allowed;
  return std::max(1, hw / std::max(1, env.local_size()));
}

// Everything before the mesh, checked by each rank alone (an error every rank has alike is printed once): the
// model against the job's tightest rank's memory, the threads and the memory cap, the run's shape, the device and
// the data.
void set_up_run(TrainRun& run, const MpiEnv& env, bool with_data, double memory) {
  const Config& cfg = run.config;
  const auto& t = cfg.training;
  run_agreed(env, "the run's setup", [&] {
    check_model_fits(cfg, memory);
    set_cpu_threads(t.threads > 0 ? t.threads : auto_threads(env));
    set_host_memory_limit(size_t(t.memory_limit_mb * double(1 << 20)), "training.memory_limit_mb");
    static_cast<RunShape&>(run) = plan_run_shape(cfg, env.size());
    run.device = rank_device(env, cfg.comm.device);
    // The attention kernel (cuDNN loaded here when it may be used): an impossible attention.kernel = cudnn is an
    // error now, before any collective.
    set_attention_kernel({parse_attention_kernel(cfg.attention.kernel), cfg.attention.deterministic});
    MT_CHECK(cfg.attention.kernel != "cudnn" || !run.device.is_cuda() || run.dtype == DType::bf16, "config",
             "attention.kernel = cudnn takes bf16 activations: training.dtype is {} on {}", dtype_name(run.dtype),
             run.device.str());
    check_attention_kernel(run.device, cfg.model.attention_head_dim(),
                           cfg.data.document_separator >= 0 && run.pd.cp() > 1);
    // Not when cuDNN's attention is loaded: it runs first (any head dim it takes), and a call it declines says so.
    if (const std::string slow = slow_attention_warning(run.device, run.dtype, cfg.model.attention_head_dim());
        !slow.empty() && env.rank() == 0 && attention_kernel().kernel == AttentionKernel::flash)
      spdlog::warn("{}", slow);
    // Data (every rank reads and validates the files itself: errors before any collective).
    if (with_data) {
      run.train_data = TokenStream(cfg.data.train, cfg.model.vocab_size, "data.train");
      const int64_t per_epoch = steps_per_epoch(run.train_data, t.batch_size, t.seq_len);  // errors if < one batch
      run.train_data.check_packing(t.seq_len);
      // Known now, before any step: masks that keep nothing would skip every step (a single empty batch is only
      // skipped, see train_step).
      run.train_data.check_trained(
          per_epoch, fmt::format("any of the {} batch(es) of an epoch", per_epoch), t.batch_size, t.seq_len,
          "no step has anything to train on (no assistant token in the data? prepare_data --chat says how many it "
          "trains; --train-on-prompt trains every token)");
      if (!cfg.data.val.empty() && cfg.eval.interval > 0) {
        run.val_data = TokenStream(cfg.data.val, cfg.model.vocab_size, "data.val");
        run.val_data.check_not_empty(fmt::format(
            "evaluation is on (eval.interval = {}): set data.val: '' or eval.interval: 0 to train without it",
            cfg.eval.interval));
        steps_per_epoch(run.val_data, t.batch_size, t.seq_len);
        run.val_data.check_packing(t.seq_len);
        run.val_data.check_trained(
            cfg.eval.steps, fmt::format("the {} batch(es) evaluated (eval.steps)", cfg.eval.steps), t.batch_size,
            t.seq_len, "the validation loss would have no target to average (no assistant token in them?)");
      }
    }
  });
}

}  // namespace

TrainRun make_train_run(const Config& cfg, const MpiEnv& env, bool with_data, bool init_later) {
  TrainRun run;
  run.config = cfg;
  // The memory of the job's tightest rank, agreed first: the model's size is checked against it before anything
  // is built, with the same message on every rank.
  double memory = rank_memory_bytes(env, cfg.training.memory_limit_mb);
  if (env.size() > 1) memory = world::all_reduce(memory, ReduceOp::min, "the ranks' memory before the model");
  set_up_run(run, env, with_data, memory);

  run.init_later = init_later;
  auto meshes = run.pd.make_meshes({.device = run.device, .backend = cfg.comm.backend});
  run.mesh = meshes.stage;
  run.world_mesh = meshes.world;
  startup::mark("mesh");  // the checks, the data files and the mesh's groups
  run.dp_rank = run.pd.dp_rank(run.mesh);
  run.shard = cp_shard(run.pd.cp_load_balance, cfg.training.seq_len, run.pd.cp_ring(), run.pd.cp_ring_rank(run.mesh),
                       run.pd.cp_ulysses(), run.pd.cp_ulysses_rank(run.mesh));

  const size_t before_model = allocator_stats(Device::cpu()).allocated_bytes;
  reset_peak_allocated(Device::cpu());
  static_cast<Stage&>(run) = assemble_stage(cfg, run, run.mesh, run.device, run.pd.pp_rank(run.world_mesh));
  run.model->set_positions(shard_positions(run.shard));
  run.params = run.model->parameters();
  run.trainable = trainable(run.params);
  // How the step runs, chosen once: the local loop, or this rank's stages of the pipeline.
  run.executor = make_step_executor(run, run.pipeline);
  if (with_data) run.graphs = make_step_graphs(run);
  run.executor->install(*run.model);
  run.opt = std::make_unique<AdamW>(run.trainable, cfg.training);
  run.create_peak_bytes = allocator_stats(Device::cpu()).peak_allocated_bytes - before_model;
  // Creation made nothing whole (sharded creation); hand any temporaries' cached blocks back.
  empty_cache(Device::cpu());
  startup::mark("model");  // built, parallelized, its optimizer
  return run;
}

MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r) {
  if (run.capture_micro) return run.capture_micro->at(size_t(r / run.micro));  // a CUDA graph's inputs
  MicroBatch mb;
  Tensor inputs = batch.inputs.slice0(r, r + run.micro), targets = batch.targets.slice0(r, r + run.micro);  // (mb, T)
  Tensor docs;
  if (run.config.data.document_separator >= 0)
    docs = document_starts(inputs, int32_t(run.config.data.document_separator));  // (mb, T) from whole sequences
  Tensor mtp_in, mtp_tgt;
  if (run.model->wants_mtp()) {
    // Position i: the next token t_{i+1} (its input) and t_{i+2} (its target); the last position's input is its
    // target's token (any token would do: its loss is not taken and no earlier position sees it).
    const int64_t n = inputs.size(0), T = inputs.size(1);
    mtp_in = empty({n, T}, DType::i32), mtp_tgt = empty({n, T}, DType::i32);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int32_t last = targets.at<int32_t>(b * T + T - 1);
        mtp_in.at<int32_t>(b * T + t) = t + 1 < T ? inputs.at<int32_t>(b * T + t + 1) : std::max(last, 0);
        mtp_tgt.at<int32_t>(b * T + t) = t + 1 < T ? targets.at<int32_t>(b * T + t + 1) : -1;
      }
  }
  if (run.pd.cp() > 1) {  // this rank's part of each sequence; the attention shards doc_start itself
    inputs = shard_sequence(inputs, run.shard);
    targets = shard_sequence(targets, run.shard);
    if (mtp_in.defined()) mtp_in = shard_sequence(mtp_in, run.shard), mtp_tgt = shard_sequence(mtp_tgt, run.shard);
  }
  if (mtp_in.defined()) mb.mtp_inputs = mtp_in.to(run.device), mb.mtp_targets = mtp_tgt.to(run.device);
  mb.inputs = inputs.to(run.device);    // (mb, T_local)
  mb.targets = targets.to(run.device);  // (mb, T_local)
  mb.doc_start = docs;                  // (mb, T) host, whole sequences, or undefined
  if (run.config.lora.enabled() && run.config.lora.dropout > 0) {
    // LoRA dropout's keys: global batch row x seq_len + global position, whatever the mesh (models/lora.h).
    const int64_t T_local = run.shard.size(), T = run.config.training.seq_len, row0 = run.dp_rank * run.rows + r;
    Tensor ids = empty({run.micro * T_local}, DType::i64);  // (mb * T_local)
    for (int64_t b = 0; b < run.micro; ++b)
      for (int64_t t = 0; t < T_local; ++t) ids.at<int64_t>(b * T_local + t) = (row0 + b) * T + run.shard.position(t);
    mb.row_ids = ids.to(run.device);
  }
  return mb;
}

void token_losses(TrainRun& run, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                  const Tensor& targets, double grad_scale) {
  if (logits.size(1) == run.config.model.vocab_size) {
    cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale);
  } else {
    // (V, C) sharded by rows on tp: this rank's first vocabulary row
    int64_t vocab_begin = run.model->output_weight().compute_offset()[0];
    vocab_parallel_cross_entropy(losses, dlogits, logits, targets, vocab_begin, grad_scale, run.mesh.group(dim::tp));
  }
}

// Sequence lengths must be multiples of this (tp under sequence parallel).
int64_t sequence_pad(const TrainRun& run) {
  int tp = run.mesh.size(run.mesh.dim_index(dim::tp));
  return run.config.parallel.sequence_parallel ? tp : 1;
}

}  // namespace mt
