#include "runtime/train/trainer.h"

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <thread>

#include "attention/sequence_shard.h"
#include "models/llama/parallelize.h"
#include "parallel/loss_parallel.h"
#include "parallel/philox.h"
#include "runtime/core/allocator.h"
#include "runtime/core/log.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/metrics.h"

namespace mt {

namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

DType training_dtype(const Config& c, Device device) {
  if (c.training.dtype == "fp64") {
    MT_CHECK(!device.is_cuda(), "train", "training.dtype = fp64 is for CPU checks; on CUDA use fp32 or bf16");
    return DType::f64;
  }
  return c.training.dtype == "bf16" ? DType::bf16 : DType::f32;
}

int auto_threads(const MpiEnv& env) {
  int hw = int(std::thread::hardware_concurrency());
  return std::max(1, hw / std::max(1, env.local_size()));
}

}  // namespace

ParallelDims parallel_dims(const Config& cfg, int world_size) {
  auto sizes = resolve_mesh_sizes(cfg.parallel, world_size);
  ParallelDims pd;
  pd.dp_replicate = sizes[0], pd.dp_shard = sizes[1], pd.cp = sizes[2], pd.tp = sizes[3];
  pd.sequence_parallel = cfg.parallel.sequence_parallel;
  pd.cp_method = cp_method_from_name(cfg.parallel.cp_method, "parallel.cp_method");
  pd.cp_load_balance = cp_load_balance_from_name(cfg.parallel.cp_load_balance, "parallel.cp_load_balance");
  return pd;
}

MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r) {
  MicroBatch mb;
  Tensor inputs = batch.inputs.slice0(r, r + run.micro), targets = batch.targets.slice0(r, r + run.micro);  // (mb, T)
  Tensor docs;
  if (run.config.data.document_separator >= 0)
    docs = document_starts(inputs, int32_t(run.config.data.document_separator));  // (mb, T) from whole sequences
  if (run.pd.cp > 1) {  // this rank's part of each sequence
    inputs = shard_sequence(inputs, run.shard);
    targets = shard_sequence(targets, run.shard);
    if (docs.defined()) docs = shard_sequence(docs, run.shard);
  }
  mb.inputs = inputs.to(run.device);    // (mb, T_local)
  mb.targets = targets.to(run.device);  // (mb, T_local)
  mb.doc_start = docs;                  // (mb, T_local) host, or undefined
  return mb;
}

TrainRun make_train_run(const Config& cfg, const MpiEnv& env, bool with_data) {
  TrainRun run;
  run.config = cfg;
  set_cpu_threads(cfg.training.threads > 0 ? cfg.training.threads : auto_threads(env));

  // What each mesh dim means (parallel_dims.h); all four dims exist, size 1 where unused.
  run.pd = parallel_dims(cfg, env.size());
  run.device = rank_device(env, cfg.comm.device);
  run.dtype = training_dtype(cfg, run.device);
  if (run.device.is_cuda() && run.dtype == DType::bf16 && env.rank() == 0) {
    int64_t hd = cfg.model.dim / cfg.model.n_heads;
    if (hd != 64 && hd != 128)
      spdlog::warn("training.dtype = bf16 with head dim {}: the tensor-core attention kernel takes 64 or 128, so "
                   "attention runs the slow fp32 reference kernel",
                   hd);
  }

  // Batch: the global batch never depends on the mesh; each dp rank takes batch_size / dp rows, and each cp
  // rank of those its part of every sequence.
  auto& t = cfg.training;
  run.dp = run.pd.dp();
  require_divisible("training.batch_size", t.batch_size, "dp (dp_replicate x dp_shard)", run.dp);
  run.pd.check_seq_len(t.seq_len);
  run.rows = t.batch_size / run.dp;
  run.micro = t.micro_batch_size > 0 ? t.micro_batch_size : run.rows;
  if (run.rows % run.micro != 0)
    fail("config", "training.micro_batch_size = {} must divide the rows per data-parallel rank, batch_size / dp = {} / {} = {}",
         run.micro, t.batch_size, run.dp, run.rows);

  // Data (every rank reads and validates the files itself: errors before any collective).
  if (with_data) {
    run.train_data = TokenStream(cfg.data.train, cfg.model.vocab_size, "data.train");
    steps_per_epoch(run.train_data, t.batch_size, t.seq_len);  // errors if shorter than one batch
    if (!cfg.data.val.empty() && cfg.eval.interval > 0) {
      run.val_data = TokenStream(cfg.data.val, cfg.model.vocab_size, "data.val");
      steps_per_epoch(run.val_data, t.batch_size, t.seq_len);
    }
  }

  MeshOptions mo;
  mo.device = run.device;
  mo.backend = cfg.comm.backend;
  run.mesh = DeviceMesh::create(run.pd.mesh_dims(), mo);
  run.pd.make_groups(run.mesh);
  run.dp_rank = run.pd.dp_rank(run.mesh);
  run.shard = sequence_shard(run.pd.cp_load_balance, t.seq_len, run.pd.cp, run.pd.cp_rank(run.mesh));

  ParamFactory f{run.mesh, run.dtype, run.device, uint64_t(t.seed), cfg.model.init_std};
  run.model = std::make_unique<LlamaForCausalLM>(cfg.model, f);
  // Tensor (and sequence) parallel: shards the parameters (no communication) and installs the layout hooks;
  // context parallel: attention runs as ring attention over the cp group.
  const DType reduce_dtype = t.grad_reduce_dtype == "bf16" ? DType::bf16 : accum_dtype(run.dtype);
  run.fsdp = parallelize_llama(*run.model, run.mesh, run.pd, cfg.parallel, t.seq_len, reduce_dtype);
  run.model->set_positions(shard_positions(run.shard));
  run.params = run.model->parameters();
  run.opt = std::make_unique<AdamW>(run.params, t);
  GradSyncOptions gs{run.pd.grad_partial_dims(), size_t(t.grad_bucket_mb * double(1 << 20)), reduce_dtype};
  run.grad_sync = std::make_unique<GradSync>(*run.model, run.mesh, gs);
  // Parameters are made whole and then sharded: hand the whole tensors' cached blocks back.
  empty_cache(Device::cpu());
  return run;
}

void token_losses(TrainRun& run, const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                  const Tensor& targets, double grad_scale) {
  if (logits.size(1) == run.config.model.vocab_size) {
    cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale);
  } else {
    // (V, C) sharded by rows on tp: this rank's first vocabulary row
    int64_t vocab_begin = run.model->lm_head->weight->compute_offset()[0];
    vocab_parallel_cross_entropy(losses, dlogits, logits, targets, vocab_begin, grad_scale, run.mesh.group("tp"));
  }
}

void sync_gradients(TrainRun& run) {
  // Each gradient is Partial over the data-parallel dims (and, for sequence-parallel norm weights,
  // over tp: grad_partial_dims); redistributing it to its parameter's placement all-reduces (or
  // reduce-scatters) it. GradSync does that in buckets, or one parameter at a time (grad_bucket_mb: 0).
  run.grad_sync->finish();
}

StepResult train_step(TrainRun& run, int64_t step) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  // 1. This rank's rows of the global batch for this step.
  Batch batch = get_batch(run.train_data, step, B, T, run.dp_rank * run.rows, run.rows);  // (rows, T) x2
  // 2. Forward and backward per micro-batch; gradients accumulate in the parameters' grad buffers.
  //    The loss is the sum of token losses over the global token count, so every mesh gives the same number.
  zero_grads(run.params);
  const double inv_tokens = 1.0 / double(B * T);
  const int64_t T_local = run.shard.size();  // T / cp tokens of each sequence on this rank
  std::vector<Tensor> micro_losses;  // read after backward: no host sync inside the micro-batch loop
  for (int64_t r = 0; r < run.rows; r += run.micro) {
    run.grad_sync->arm(r + run.micro >= run.rows);  // the last backward launches the sync
    MicroBatch mb = local_micro_batch(run, batch, r);                    // (mb, T_local) x2, this rank's tokens
    run.model->set_documents(mb.doc_start);
    Tensor logits = run.model->call(mb.inputs);                          // (mb, T_local, V)
    Tensor losses = empty({run.micro * T_local}, accum_dtype(logits.dtype()), run.device);  // (mb*T_local)
    token_losses(run, losses, as_rows(logits), as_rows(logits), mb.targets.reshape({-1}), inv_tokens);
    micro_losses.push_back(losses);
    run.model->call_backward(logits);  // logits now hold dloss/dlogits
  }
  // 3. Gradient sync, the one rule (see sync_gradients): waits for the buckets backward launched.
  sync_gradients(run);
  // 4. The step's loss over the whole batch: every token's loss is on exactly one rank of dp x cp.
  double loss_sum = 0;
  for (const Tensor& l : micro_losses) loss_sum += sum(l);
  Tensor loss_t = from_values({loss_sum}, {1}, DType::f64);
  run.mesh.group(run.pd.loss_group()).all_reduce(loss_t, ReduceOp::sum);
  // 5. Clip by the global norm and update. A non-finite loss or norm skips the update: both are all-reduced,
  //    so every rank decides the same with no extra communication, and a NaN never reaches the weights.
  StepResult res;
  res.loss = loss_t.at<double>(0) * inv_tokens;
  res.grad_norm = grad_norm(run.params);
  res.lr = lr_at(t, step);
  res.skipped = !std::isfinite(res.loss) || !std::isfinite(res.grad_norm);
  if (res.skipped) return res;
  clip_grads(run.params, res.grad_norm, t.grad_clip);
  run.opt->step(res.lr);
  return res;
}

double evaluate(TrainRun& run) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  double loss_sum = 0;
  for (int64_t i = 0; i < run.config.eval.steps; ++i) {
    Batch batch = get_batch(run.val_data, i, B, T, run.dp_rank * run.rows, run.rows);
    for (int64_t r = 0; r < run.rows; r += run.micro) {
      MicroBatch mb = local_micro_batch(run, batch, r);
      run.model->set_documents(mb.doc_start);
      Tensor logits = run.model->call(mb.inputs);  // (mb, T_local, V)
      Tensor losses = empty({mb.targets.numel()}, accum_dtype(logits.dtype()), run.device);
      token_losses(run, losses, Tensor(), as_rows(logits), mb.targets.reshape({-1}), 1.0);
      loss_sum += sum(losses);
    }
  }
  Tensor loss_t = from_values({loss_sum}, {1}, DType::f64);
  run.mesh.group(run.pd.loss_group()).all_reduce(loss_t, ReduceOp::sum);
  return loss_t.at<double>(0) / double(run.config.eval.steps * B * T);
}

std::string generate(LlamaForCausalLM& model, const std::string& prompt, int64_t n, double temperature, uint64_t seed,
                     uint64_t stream, int64_t pad_multiple, int64_t document_separator) {
  // Every rank runs the whole context: no cp split while generating; the training positions, documents
  // and cp settings come back afterwards.
  SequenceContext saved = *model.seq;
  model.seq->cp.group = nullptr;
  struct Restore {
    LlamaForCausalLM& m;
    SequenceContext& s;
    ~Restore() {
      m.seq->cp = s.cp;
      m.seq->doc_start = s.doc_start;
      if (s.positions.defined()) m.set_positions(s.positions);
    }
  } restore{model, saved};
  std::vector<int32_t> toks;
  for (unsigned char ch : prompt) toks.push_back(int32_t(ch) % int32_t(model.config.vocab_size));
  if (toks.empty()) toks.push_back(int32_t('\n') % int32_t(model.config.vocab_size));
  const int64_t V = model.config.vocab_size, ctx_max = model.config.max_seq_len;
  const DTensor& w = model.lm_head->weight->value;  // (V, C), rows sharded on tp under tensor parallel
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    int64_t len = std::min<int64_t>(int64_t(toks.size()), ctx_max);
    // Sequence parallel splits the sequence over tp: pad at the end (causal: the padding does not
    // change the logits before it) to a multiple of tp.
    int64_t padded = (len + pad_multiple - 1) / pad_multiple * pad_multiple;
    Tensor ctx = zeros({1, padded}, DType::i32);
    std::copy(toks.end() - len, toks.end(), ctx.data<int32_t>());
    Tensor pos = empty({padded}, DType::i64);
    for (int64_t t = 0; t < padded; ++t) pos.at<int64_t>(t) = t;
    model.set_positions(pos);
    model.set_documents(document_separator >= 0 ? document_starts(ctx, int32_t(document_separator)) : Tensor());
    Tensor logits = model.call(ctx.to(w.local.device()));  // (1, padded, V or V/tp)
    Tensor last = logits.reshape({padded, -1}).slice0(len - 1, len).clone();  // (1, V_local)
    if (last.size(1) != V) {  // vocab-sharded (loss parallel): gather the row
      Placements pl(size_t(w.mesh.ndim()), Placement::Replicate());
      pl[size_t(w.mesh.dim_index("tp"))] = Placement::Shard(1);
      last = full_tensor(from_local(last, w.mesh, pl, Shape{1, V}));
    }
    std::vector<double> row = to_f64(last);  // (V)
    int32_t next = 0;
    if (temperature <= 0) {
      next = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
    } else {
      double mx = *std::max_element(row.begin(), row.end()), total = 0;
      for (double& x : row) total += (x = std::exp((x - mx) / temperature));
      double u = double(philox::uniform(seed, stream, uint64_t(i))) * total, acc = 0;
      next = int32_t(V - 1);
      for (int64_t v = 0; v < V; ++v)
        if ((acc += row[size_t(v)]) > u) {
          next = int32_t(v);
          break;
        }
    }
    toks.push_back(next);
    out.push_back(char(next & 0xff));
  }
  return out;
}

namespace {

// Sequence lengths must be multiples of this (tp under sequence parallel).
int64_t sequence_pad(const TrainRun& run) {
  int tp = run.mesh.size(run.mesh.dim_index("tp"));
  return run.config.parallel.sequence_parallel ? tp : 1;
}

// One line for the terminal: control bytes shown as escapes.
std::string printable(const std::string& s) {  // NOLINT
  std::string r;
  for (unsigned char c : s) {
    if (c == '\n') r += "\\n";
    else if (c == '\t') r += "\\t";
    else if (c < 32 || c == 127) r += fmt::format("\\x{:02x}", c);
    else r.push_back(char(c));
  }
  return r;
}

// What a resumed run may not change silently: the data, the seed, the model and the schedule (training.steps may
// grow: a run is extended by resuming it with more steps). "key: X in the checkpoint, Y now" per difference.
std::vector<std::string> config_changes(const Config& was, const Config& now) {
  std::vector<std::string> d;
  auto cmp = [&](const char* key, const auto& a, const auto& b) {
    if (a != b) d.push_back(fmt::format("{}: {} in the checkpoint, {} now", key, a, b));
  };
  cmp("data.train", was.data.train, now.data.train);
  cmp("training.seed", was.training.seed, now.training.seed);
  const ModelConfig &a = was.model, &b = now.model;
  cmp("model.dim", a.dim, b.dim);
  cmp("model.n_layers", a.n_layers, b.n_layers);
  cmp("model.n_heads", a.n_heads, b.n_heads);
  cmp("model.n_kv_heads", a.n_kv_heads, b.n_kv_heads);
  cmp("model.ffn_dim", a.ffn_dim, b.ffn_dim);
  cmp("model.vocab_size", a.vocab_size, b.vocab_size);
  cmp("model.norm_eps", a.norm_eps, b.norm_eps);
  cmp("model.rope_theta", a.rope_theta, b.rope_theta);
  cmp("model.max_seq_len", a.max_seq_len, b.max_seq_len);
  cmp("model.tie_embeddings", a.tie_embeddings, b.tie_embeddings);
  cmp("training.schedule", was.training.schedule, now.training.schedule);
  cmp("training.lr", was.training.lr, now.training.lr);
  cmp("training.warmup_steps", was.training.warmup_steps, now.training.warmup_steps);
  cmp("training.lr_min", was.training.lr_min, now.training.lr_min);
  return d;
}

// checkpoint.dir must take files before the first step, not fail at the first checkpoint after hours of training.
// Rank 0 tries; every rank gets its answer, so all stop together with the same message.
void check_checkpoint_dir_writable(const std::string& dir, const MpiEnv& env) {
  if (dir.empty()) return;
  char why[256] = {0};
  if (env.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::filesystem::path probe = std::filesystem::path(dir) / fmt::format(".write_test.{}", ::getpid());
    if (ec) {
      std::snprintf(why, sizeof why, "%s", ec.message().c_str());
    } else {
      FILE* f = std::fopen(probe.c_str(), "w");
      if (!f || std::fputs("ok\n", f) < 0) std::snprintf(why, sizeof why, "%s", std::strerror(errno));
      if (f && std::fclose(f) != 0 && !why[0]) std::snprintf(why, sizeof why, "%s", std::strerror(errno));
      std::filesystem::remove(probe, ec);
    }
  }
  MT_MPI_CHECK(MPI_Bcast(why, int(sizeof why), MPI_CHAR, 0, MPI_COMM_WORLD));
  MT_CHECK(!why[0], "checkpoint", "checkpoint.dir = {} is not writable: {}", dir, why);
}

}  // namespace

int run_train_command(RunContext& ctx) {
  const Config& cfg = ctx.config;
  const MpiEnv& env = *ctx.env;
  TrainRun run = make_train_run(cfg, env);
  const auto& t = cfg.training;

  check_checkpoint_dir_writable(cfg.checkpoint.dir, env);

  // Where to start: a checkpoint to resume, else Hugging Face weights, else the random init.
  // resume: auto tries the newest complete checkpoint first and falls back to older ones when it cannot be read.
  std::vector<std::string> candidates;
  const bool resume_auto = cfg.checkpoint.resume == "auto";
  if (!cfg.checkpoint.dir.empty() && cfg.checkpoint.resume != "never") {
    if (resume_auto) {
      candidates = checkpoints_in(cfg.checkpoint.dir);
      std::reverse(candidates.begin(), candidates.end());  // newest first
    } else {
      candidates.push_back(cfg.checkpoint.resume);
      MT_CHECK(std::filesystem::exists(std::filesystem::path(cfg.checkpoint.resume) / "meta.json"), "checkpoint",
               "checkpoint.resume = {}: not a complete checkpoint (no meta.json)", cfg.checkpoint.resume);
    }
  }
  std::string resume_from;
  for (size_t i = 0; i < candidates.size() && resume_from.empty(); ++i) {
    const std::string& c = candidates[i];
    // Every rank reads the same files and fails the same way: they fall back together.
    auto fall_back = [&](const Error& e) {
      if (!resume_auto || i + 1 == candidates.size()) return false;
      if (env.rank() == 0)
        spdlog::warn("cannot resume from {}, it is damaged: {}; resume: auto falls back to {}", c, e.what(),
                     candidates[i + 1]);
      return true;
    };
    Config was;
    try {
      was = checkpoint_config(c);
    } catch (const Error& e) {
      if (fall_back(e)) continue;
      throw;
    }
    auto changes = config_changes(was, cfg);
    if (!changes.empty()) {
      std::string list = fmt::format("{}", fmt::join(changes, "; "));
      MT_CHECK(cfg.checkpoint.allow_config_change, "checkpoint",
               "resuming from {} with a different config: {} (set checkpoint.allow_config_change: true to resume "
               "anyway, or checkpoint.resume: never to start over)",
               c, list);
      if (env.rank() == 0) spdlog::warn("resuming from {} with a different config: {}", c, list);
    }
    try {
      TrainProgress p = load_checkpoint(c, *run.model, run.opt.get());
      run.start_step = p.step;
      resume_from = c;
    } catch (const Error& e) {
      if (fall_back(e)) continue;
      throw;
    }
  }
  if (!resume_from.empty()) {
    if (env.rank() == 0) spdlog::info("resumed from {} at step {}", resume_from, run.start_step);
  } else if (!cfg.model.init_from.empty()) {
    load_hf_weights(cfg.model.init_from, *run.model);
    if (env.rank() == 0) spdlog::info("initialised from {}", cfg.model.init_from);
  }

  const double flops_per_token = llama_flops_per_token(cfg.model, t.seq_len);
  const double peak = run.device.is_cuda() ? 989e12 : cpu_peak_flops();
  if (env.rank() == 0) {
    spdlog::info("model: {} parameters ({} without embeddings), {:.2f} MFLOP/token; mesh {}; batch {} x {} tokens, "
                 "{} rows per dp rank, micro-batch {}; {} threads per rank, CPU GEMM peak {:.1f} GFLOP/s",
                 llama_num_params(cfg.model), llama_num_params(cfg.model, false), flops_per_token / 1e6,
                 mesh_str(run.mesh.dims()) + " (" + run.pd.describe() + ")", t.batch_size, t.seq_len, run.rows, run.micro, cpu_threads(),
                 peak / 1e9);
    spdlog::info("data: {} train tokens in {} shard(s), {} steps per epoch", run.train_data.size(),
                 run.train_data.shards().size(), steps_per_epoch(run.train_data, t.batch_size, t.seq_len));
  }
  if (env.rank() == 0 && run.grad_sync) spdlog::info("gradient sync: {}", run.grad_sync->describe());
  {
    // The memory that does not depend on the batch: what peak memory is compared against.
    size_t state = 0;
    for (Parameter* p : run.params) {
      state += p->value.local.nbytes() + p->grad.local.nbytes() + (p->compute.defined() ? p->compute.nbytes() : 0);
      const auto& s = run.opt->state().at(p->name);
      state += s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
    }
    // The expected count from the layouts alone: rank 0 holds the first (largest) chunk of every sharded dim,
    // and with fully_shard 1/dp_shard of each sharded parameter's tp part.
    const double per_element = run.dtype == DType::bf16 ? 18 : double(4 * dtype_size(run.dtype));
    double elements = 0;
    for (Parameter* p : run.params) {
      Shape s = p->value.shape();
      for (int m = 0; m < run.mesh.ndim(); ++m) {
        const Placement& pl = p->value.placements()[size_t(m)];
        if (pl.is_shard()) s[size_t(pl.dim)] = (s[size_t(pl.dim)] + run.mesh.size(m) - 1) / run.mesh.size(m);
      }
      elements += double(shape_numel(s));
    }
    const double expected = elements * per_element;
    if (env.rank() == 0) {
      spdlog::info("model state on rank 0: {:.3f} MiB ({} B per parameter element: {}weights, gradient, AdamW m and v); "
                   "expected {:.3f} MiB = {} B x {:.0f} elements{}: {}",
                   double(state) / (1 << 20), per_element, run.dtype == DType::bf16 ? "bf16 copy, f32 master " : "",
                   expected / (1 << 20), per_element, elements,
                   run.fsdp ? " (the rank's shards and the replicated small parameters)" : "",
                   double(state) == expected ? "equal" : "DIFFERENT");
      if (run.fsdp) spdlog::info("fully_shard over dp_shard = {}: {}", run.pd.dp_shard, run.fsdp->describe());
    }
  }
  if (env.rank() == 0 && run.dtype == DType::bf16)
    spdlog::info("mixed precision: bf16 compute{}, f32 master weights, gradients, optimizer state, statistics and loss; "
                 "gradients reduced in {}",
                 run.device.is_cuda() ? "" : " (emulated in f32 on the CPU: a check, not fast)", t.grad_reduce_dtype);
  if (env.rank() == 0)
    spdlog::info("memory after setup: {:.0f} MiB resident (model, optimizer state, data, MPI)",
                 peak_memory_bytes(Device::cpu()) / (1 << 20));
  MetricsLogger log(env.rank(), env.size(), cfg.log.metrics_file, t.steps, cfg.log.interval, flops_per_token, peak,
                    run.device);
  // Slurm sends SIGTERM (or a --signal of the user's choice) before the time limit: checkpoint and stop.
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);

  auto checkpoint = [&](int64_t next_step) {
    if (cfg.checkpoint.dir.empty()) return;
    Batch pos = get_batch(run.train_data, next_step, t.batch_size, t.seq_len, 0, 0);
    TrainProgress p{next_step, pos.epoch, pos.offset, uint64_t(t.seed)};
    std::string dir = save_checkpoint(cfg.checkpoint.dir, p, *run.model, *run.opt, cfg, run.mesh, cfg.checkpoint.keep);
    log.note(fmt::format("checkpoint step {} -> {}", next_step, dir));
  };

  int64_t skipped = 0, skipped_in_a_row = 0;  // non-finite steps (not applied): in all, and the current run of them
  for (int64_t step = run.start_step; step < t.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    StepResult r = train_step(run, step);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r.skipped) {
      ++skipped, ++skipped_in_a_row;
      MT_CHECK(t.nonfinite == "skip", "train",
               "step {}: the loss is {} and the grad norm {}: not finite, the update was not applied and the run "
               "stops (training.nonfinite = stop; lower training.lr, or nonfinite: skip to go on)",
               step, r.loss, r.grad_norm);
      MT_CHECK(skipped_in_a_row < t.max_nonfinite_steps, "train",
               "step {}: the loss is {} and the grad norm {}: {} non-finite steps in a row "
               "(training.max_nonfinite_steps = {}), none applied: the run stops (lower training.lr?)",
               step, r.loss, r.grad_norm, skipped_in_a_row, t.max_nonfinite_steps);
      if (env.rank() == 0)
        spdlog::warn("step {}: the loss is {} and the grad norm {}: not finite, the update is skipped ({} in a row, "
                     "{} in all)", step, r.loss, r.grad_norm, skipped_in_a_row, skipped);
    } else {
      skipped_in_a_row = 0;
    }
    log.step({step, r.loss, r.lr, r.grad_norm, dt, t.batch_size * t.seq_len, skipped});
    bool last = step + 1 == t.steps;
    if (cfg.eval.interval > 0 && run.val_data.size() > 0 && ((step + 1) % cfg.eval.interval == 0 || last))
      log.eval(step, evaluate(run));
    if (cfg.sample.interval > 0 && cfg.sample.tokens > 0 && ((step + 1) % cfg.sample.interval == 0 || last)) {
      std::string text = generate(*run.model, cfg.sample.prompt, cfg.sample.tokens, cfg.sample.temperature,
                                  uint64_t(t.seed), uint64_t(step), sequence_pad(run), cfg.data.document_separator);
      log.sample(step, printable(cfg.sample.prompt + text));
    }
    // A stop signal on any rank stops every rank at the same step boundary.
    int stop = g_stop_signal.load();
    MT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &stop, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    bool at_interval = cfg.checkpoint.interval > 0 && (step + 1) % cfg.checkpoint.interval == 0;
    if (at_interval || last || stop) checkpoint(step + 1);
    if (stop) {
      log.note(fmt::format("signal {} received: stopped after step {} with a checkpoint", stop, step + 1));
      return 0;
    }
  }
  return 0;
}

void add_generate_options(CLI::App* app, GenerateArgs& a) {
  app->add_option("--checkpoint", a.checkpoint, "checkpoint directory (step_XXXXXXXX) or a checkpoint.dir")->required();
  app->add_option("--prompt", a.prompt, "text to continue")->capture_default_str();
  app->add_option("--tokens", a.tokens, "tokens to generate")->capture_default_str();
  app->add_option("--temperature", a.temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  app->add_option("--seed", a.seed, "sampling seed")->capture_default_str();
}

int run_generate_command(RunContext& ctx, const GenerateArgs& a) {
  std::string path = a.checkpoint;
  if (!std::filesystem::exists(std::filesystem::path(path) / "meta.json")) {
    auto latest = latest_checkpoint(path);
    MT_CHECK(latest.has_value(), "checkpoint", "--checkpoint {}: neither a checkpoint nor a directory holding one",
             path);
    path = *latest;
  }
  Config cfg = checkpoint_config(path);
  cfg.parallel = ParallelConfig{};  // generation runs on whatever ranks it is given, replicated
  cfg.comm = ctx.config.comm;
  TrainRun run = make_train_run(cfg, *ctx.env, false);
  load_checkpoint(path, *run.model, nullptr);
  std::string text = generate(*run.model, a.prompt, a.tokens, a.temperature, uint64_t(a.seed), 0, sequence_pad(run),
                              cfg.data.document_separator);
  if (ctx.env->rank() == 0) {
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  }
  return 0;
}

}  // namespace mt
