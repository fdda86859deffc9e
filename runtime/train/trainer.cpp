#include "runtime/train/trainer.h"

#include <sched.h>

#include <cmath>
#include <optional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "attention/sequence_shard.h"
#include "comm/control.h"
#include "models/layers.h"
#include "models/model.h"
#include "parallel/loss_parallel.h"
#include "parallel/philox.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"
#include "runtime/core/log.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/agree.h"
#include "runtime/train/metrics.h"
#include "runtime/core/fault.h"
#include "runtime/core/trace.h"

namespace mt {

DType training_dtype(const Config& c, Device device) {
  if (c.training.dtype == "fp64") {
    MT_CHECK(!device.is_cuda(), "train", "training.dtype = fp64 is for CPU checks; on CUDA use fp32 or bf16");
    return DType::f64;
  }
  return c.training.dtype == "bf16" ? DType::bf16 : DType::f32;
}

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
// rank holds at the least, with their gradients and AdamW's two moments (16 B each in f32), against the memory
// it has. Counted in double from the family's parameter count (one and two layers, extrapolated, so that no count
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
  const double bytes = params / shards * 16;
  if (bytes <= memory) return;
  const std::string from = m.init_from.empty() ? std::string()
                                                : fmt::format(" (model.init_from's config.json: num_hidden_layers, "
                                                              "hidden_size, intermediate_size, vocab_size)");
  fail("config",
       "the model does not fit in this rank's memory: model.n_layers = {}, model.dim = {}, model.ffn_dim = {}, "
       "model.vocab_size = {}{} make {:.3g} parameters, at least {:.3g} GiB per rank with their gradients and "
       "AdamW's two moments (16 B each, spread over parallel.pp x tp x dp_shard x ep = {:g} ranks), but a rank has "
       "{:.3g} GiB (the host's available memory, or its cgroup's limit, shared by the ranks of a node, or "
       "training.memory_limit_mb): make the model smaller or shard it over more ranks",
       m.n_layers, m.dim, m.ffn_dim, m.vocab_size, from, params, bytes / double(1 << 30), shards,
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

double sum_of(const std::vector<double>& v, int64_t first, int64_t count) {
  double s = 0;
  for (int64_t k = 0; k < count; ++k) s += v[size_t(first + k)];
  return s;
}

}  // namespace

PipelineState plan_run_shape(TrainRun& run, int world_size) {
  const Config& cfg = run.config;
  const auto& t = cfg.training;
  // What each mesh dim means (parallel_dims.h); every dim exists, size 1 where unused.
  run.pd = ParallelDims::from_config(cfg.parallel, world_size);
  // Batch: the global batch never depends on the mesh; each dp rank takes batch_size / dp rows, and each cp
  // rank of those its part of every sequence.
  run.dp = run.pd.dp();
  require_divisible("training.batch_size", t.batch_size, "dp (dp_replicate x dp_shard)", run.dp);
  run.pd.check_seq_len(t.seq_len);
  run.rows = t.batch_size / run.dp;
  run.micro = t.micro_batch_size > 0 ? t.micro_batch_size : run.rows;
  if (run.rows % run.micro != 0)
    fail("config",
         "training.micro_batch_size = {} must divide the rows per data-parallel rank, batch_size / dp = {} / {} = {}",
         run.micro, t.batch_size, run.dp, run.rows);
  // Pipeline parallel's schedule and stage split.
  return plan_pipeline(run, run.rows / run.micro);
}

MicroBatch local_micro_batch(const TrainRun& run, const Batch& batch, int64_t r) {
  MicroBatch mb;
  Tensor inputs = batch.inputs.slice0(r, r + run.micro), targets = batch.targets.slice0(r, r + run.micro);  // (mb, T)
  Tensor docs;
  if (run.config.data.document_separator >= 0)
    docs = document_starts(inputs, int32_t(run.config.data.document_separator));  // (mb, T) from whole sequences
  if (run.pd.cp() > 1) {  // this rank's part of each sequence; the attention shards doc_start itself
    inputs = shard_sequence(inputs, run.shard);
    targets = shard_sequence(targets, run.shard);
  }
  mb.inputs = inputs.to(run.device);    // (mb, T_local)
  mb.targets = targets.to(run.device);  // (mb, T_local)
  mb.doc_start = docs;                  // (mb, T) host, whole sequences, or undefined
  return mb;
}

TrainRun make_train_run(const Config& cfg, const MpiEnv& env, bool with_data) {
  TrainRun run;
  run.config = cfg;
  auto& t = cfg.training;
  PipelineState pipeline;
  // The memory of the job's tightest rank, agreed first: the model's size is checked against it before anything
  // is built, with the same message on every rank.
  double memory = rank_memory_bytes(env, cfg.training.memory_limit_mb);
  if (env.size() > 1)
    control_all_reduce(MPI_COMM_WORLD, &memory, 1, MPI_DOUBLE, MPI_MIN, "the ranks' memory before the model");
  // Everything before the mesh is checked by each rank alone; an error every rank has alike is printed once.
  run_agreed(env, "the run's setup", [&] {
    check_model_fits(cfg, memory);
    // Training only: estimate and plan --search may plan such a run.
    // Under pp the router statistics' sum is issued beside the pipeline's sends and receives; NCCL runs both in issue
    // order on the device, where a stage may wait in the sum for a peer that waits in a send: refused until it is
    // ruled out on a GPU (MPI's non-blocking calls do not order them).
    if (cfg.model.moe.n_experts > 0 && cfg.parallel.pp > 1 && cfg.comm.device == "cuda" && cfg.comm.backend != "mpi")
      fail("config",
           "model.type = {} with parallel.pp = {} on comm.device = cuda and comm.backend = {}: an MoE model's router "
           "statistics are summed beside the pipeline's NCCL sends, whose order is not yet proved free of a hang; "
           "use parallel.pp = 1 (ep, dp, tp, cp all work) or comm.backend = mpi",
           cfg.model.type, cfg.parallel.pp, cfg.comm.backend);
    set_cpu_threads(cfg.training.threads > 0 ? cfg.training.threads : auto_threads(env));
    set_host_memory_limit(size_t(cfg.training.memory_limit_mb * double(1 << 20)), "training.memory_limit_mb");

    pipeline = plan_run_shape(run, env.size());
    // The sizes the parallelisms split, checked again when they are applied: here every rank fails alike before
    // any collective, and the message is printed once.
    run.pd.check_seq_len(t.seq_len);
    run.pd.check_heads(cfg.model.n_heads, cfg.model.n_kv_heads);
    run.device = rank_device(env, cfg.comm.device);
    run.dtype = training_dtype(cfg, run.device);
    if (run.device.is_cuda() && run.dtype == DType::bf16 && env.rank() == 0) {
      int64_t hd = cfg.model.head_size();
      if (hd != 64 && hd != 128)
        spdlog::warn(
            "training.dtype = bf16 with head dim {}: the tensor-core attention kernel takes 64 or 128, so "
            "attention runs the slow fp32 reference kernel",
            hd);
    }

    // Data (every rank reads and validates the files itself: errors before any collective).
    if (with_data) {
      run.train_data = TokenStream(cfg.data.train, cfg.model.vocab_size, "data.train");
      steps_per_epoch(run.train_data, t.batch_size, t.seq_len);  // errors if shorter than one batch
      run.train_data.check_packing(t.seq_len);
      if (!cfg.data.val.empty() && cfg.eval.interval > 0) {
        run.val_data = TokenStream(cfg.data.val, cfg.model.vocab_size, "data.val");
        steps_per_epoch(run.val_data, t.batch_size, t.seq_len);
        run.val_data.check_packing(t.seq_len);
      }
    }
  });

  MeshOptions mo;
  mo.device = run.device;
  mo.backend = cfg.comm.backend;
  auto meshes = run.pd.make_meshes(mo);
  run.mesh = meshes.stage;
  run.world_mesh = meshes.world;
  run.dp_rank = run.pd.dp_rank(run.mesh);
  run.shard = cp_shard(run.pd.cp_load_balance, t.seq_len, run.pd.cp_ring(), run.pd.cp_ring_rank(run.mesh),
                       run.pd.cp_ulysses(), run.pd.cp_ulysses_rank(run.mesh));

  const size_t before_model = allocator_stats(Device::cpu()).allocated_bytes;
  reset_peak_allocated(Device::cpu());
  ParamFactory f{run.mesh, run.dtype, run.device, uint64_t(t.seed), cfg.model.init_std};
  f.deferred = true;  // sharded creation: each rank allocates and draws only its part, after the plan
  const ModelFamily& family = family_of(cfg.model);
  run.model = family.build(cfg.model, f);
  // How the step runs, chosen once: the local loop, or this rank's stages of the pipeline (which drops the other
  // stages' modules here, before any parameter has storage).
  run.executor = make_step_executor(run, std::move(pipeline));
  // The family's parallelisms composed: tensor (and sequence) parallel shards the parameters (no communication) and
  // installs the layout hooks; context parallel swaps the attention; recompute; fully_shard.
  const DType reduce_dtype = t.grad_reduce_dtype == "bf16" ? DType::bf16 : accum_dtype(run.dtype);
  run.fsdp = family.parallelize(*run.model, run.mesh, run.pd, cfg.parallel, t.seq_len, reduce_dtype);
  // An MoE model's router statistics pool every sparse layer: under pipeline parallel, over the stages too (the
  // pp and data dims of the world; made on every rank, collectively).
  if (cfg.model.moe.enabled() && run.pd.pp_size() > 1) {
    std::string dims = dim::pp;
    for (const DimSpec& d : run.pd.dims)
      if (d.data) dims += std::string(",") + d.name;
    run.model->set_router_stats_group(&run.world_mesh.group(dims));
  }
  run.model->set_positions(shard_positions(run.shard));
  run.params = run.model->parameters();
  run.executor->install(*run.model);
  run.opt = std::make_unique<AdamW>(run.params, t);
  GradSyncOptions gs{run.pd.grad_partial_dims(), size_t(t.grad_bucket_mb * double(1 << 20)), reduce_dtype};
  run.grad_sync = std::make_unique<GradSync>(*run.model, run.mesh, gs);
  run.create_peak_bytes = allocator_stats(Device::cpu()).peak_allocated_bytes - before_model;
  // Creation made nothing whole (sharded creation); hand any temporaries' cached blocks back.
  empty_cache(Device::cpu());
  return run;
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
  Batch batch = [&] {
    trace::Span span("data", "data");
    return get_batch(run.train_data, step, B, T, run.dp_rank * run.rows, run.rows);  // (rows, T) x2
  }();
  fault_slow_rank();  // MT_FAULT_SLOW_RANK: the slow-rank drill's injected delay
  // 2. Forward and backward per micro-batch, by the run's executor (the local loop, or this rank's actions of the
  //    pipeline's schedule); gradients accumulate in the parameters' grad buffers and the last backward launches
  //    the gradient sync. The loss is the sum of token losses over the global count of trained targets (every
  //    target, or the ones the loss mask keeps: each rank counts the whole batch's alone), so every mesh and every
  //    micro-batch size gives the same number.
  zero_grads(run.params);
  const int64_t trained = trained_targets(run.train_data, step, B, T);
  const double inv_tokens = trained > 0 ? 1.0 / double(trained) : 0.0;
  // (micro * T_local) each, read after backward: no host sync inside the micro-batch loop
  const std::vector<Tensor> micro_losses = [&] {
    trace::Span span("forward and backward", "phase");
    return run.executor->forward_backward(run, batch, inv_tokens);
  }();
  std::optional<trace::Span> phase;  // the step's phases in the trace (issue 40)
  phase.emplace("grad sync, loss and norm", "phase");
  // 3. Gradient sync, the one rule (see sync_gradients): waits for the buckets backward launched.
  NvtxRange range("grad sync, loss and norm, optimizer");
  sync_gradients(run);
  // 4. The step's loss over the whole batch (every token's loss is on exactly one rank of dp x cp) and the
  //    gradient norm's squares, summed and all-reduced on the device: stats (1 + k) f64 holds the loss sum,
  //    then one entry per group of gradients sharded alike.
  const int64_t norm_groups = grad_norm_slots(run.params);
  Tensor stats = zeros({1 + norm_groups}, DType::f64, run.device);
  for (const Tensor& l : micro_losses) sum_into(stats, 0, l);
  run.mesh.group(run.pd.loss_group()).all_reduce(stats.view(0, {1}), ReduceOp::sum);
  grad_norm_squares(stats, 1, run.params);
  // 5. Clip by the global norm and update. The host reads loss and norm here, the step's one host sync: the
  //    non-finite rule and the clip scale decide on the host. A non-finite loss or norm skips the update: both
  //    are all-reduced, so every rank decides the same with no extra communication, and a NaN never reaches
  //    the weights.
  //    Under pipeline parallel each stage holds its part of both: the executor sums them over the stages.
  const std::vector<double> host = to_f64(stats);
  const std::vector<double> sums = run.executor->sum_over_stages({host[0], sum_of(host, 1, norm_groups)});
  StepResult res;
  res.trained_tokens = trained;
  res.router = run.model->take_router_stats();  // the same on every rank: its statistics were summed
  res.loss = sums[0] * inv_tokens + res.router.aux_loss;
  res.grad_norm = std::sqrt(sums[1]);
  res.lr = lr_at(t, step);
  res.skipped = !std::isfinite(res.loss) || !std::isfinite(res.grad_norm);
  if (res.skipped) return res;
  if (trained == 0) return res;  // every target masked: nothing to learn from, no update (weight decay included)
  phase.reset();
  phase.emplace("optimizer", "phase");
  clip_grads(run.params, res.grad_norm, t.grad_clip);
  run.opt->step(res.lr);
  run.model->after_step();
  return res;
}

double evaluate(TrainRun& run) {
  const auto& t = run.config.training;
  const int64_t B = t.batch_size, T = t.seq_len;
  Tensor loss_sum = zeros({1}, DType::f64, run.device);  // (1) summed on the device, read once
  int64_t trained = 0;  // the trained targets of every evaluated batch, all ranks (counted here alone)
  for (int64_t i = 0; i < run.config.eval.steps; ++i) trained += trained_targets(run.val_data, i, B, T);
  for (int64_t i = 0; i < run.config.eval.steps; ++i) {
    Batch batch = get_batch(run.val_data, i, B, T, run.dp_rank * run.rows, run.rows);
    run.executor->forward_loss(loss_sum, run, batch);
  }
  run.mesh.group(run.pd.loss_group()).all_reduce(loss_sum, ReduceOp::sum);
  // Under pipeline parallel only the last stage has losses.
  const double total = run.executor->sum_over_stages({to_f64(loss_sum)[0]})[0];
  return trained > 0 ? total / double(trained) : std::nan("");
}

std::vector<int32_t> generate(CausalLM& model, const StepExecutor& executor, std::vector<int32_t> toks, int64_t n,
                              double temperature, uint64_t seed, uint64_t stream, int64_t pad_multiple,
                              int64_t document_separator, int32_t stop_id) {
  // Every rank runs the whole context: no cp split while generating; the training positions, documents
  // and cp settings come back afterwards.
  struct Restore {
    CausalLM& m;
    Tensor positions, documents;
    std::shared_ptr<const Attention> a;
    ~Restore() {
      m.set_attention(a);
      m.set_documents(documents);
      if (positions.defined()) m.set_positions(positions);
    }
  } restore{model, model.positions(), model.documents(), model.attention()};
  model.set_attention(make_attention());
  const int64_t V = model.config.vocab_size, ctx_max = model.config.max_seq_len;
  for (int32_t& t : toks) t = int32_t(int64_t(t) % V);
  if (toks.empty()) toks.push_back(int32_t(int64_t('\n') % V));
  const bool has_output = model.has_output();
  std::vector<int32_t> out;
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
    const Tensor logits = executor.sample_logits(model, ctx);  // (1, padded, V or V/tp) where the output is
    int32_t next = 0;
    if (has_output) {
      const DTensor& w = model.output_weight().value;  // (V, C), rows sharded on tp under tensor parallel
      Tensor last = logits.reshape({padded, -1}).slice0(len - 1, len).clone();  // (1, V_local)
      if (last.size(1) != V) {  // vocab-sharded (loss parallel): gather the row
        Placements pl(size_t(w.mesh.ndim()), Placement::Replicate());
        pl[size_t(w.mesh.dim_index(dim::tp))] = Placement::Shard(1);
        last = full_tensor(from_local(last, w.mesh, pl, Shape{1, V}));
      }
      std::vector<double> row = to_f64(last);  // (V)
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
    }
    next = executor.share_token(next);  // the output's rank's token on every rank
    toks.push_back(next);
    out.push_back(next);
    if (next == stop_id) break;
  }
  return out;
}

std::vector<int32_t> TextCodec::encode(const std::string& text) const {
  if (tokenizer) return tokenizer->encode(text);
  std::vector<int32_t> ids;
  for (unsigned char ch : text) ids.push_back(int32_t(int64_t(ch) % vocab_size));
  return ids;
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
  if (!tokenizer) {
    std::string s;
    for (int32_t id : ids) s.push_back(char(id & 0xff));
    return s;
  }
  std::string s;
  std::vector<int32_t> run;
  for (int32_t id : ids) {
    if (id >= 0 && id < tokenizer->vocab_size()) {
      run.push_back(id);
      continue;
    }
    s += tokenizer->decode(run) + "\xef\xbf\xbd";  // U+FFFD: a row of the model past its tokenizer
    run.clear();
  }
  return s + tokenizer->decode(run);
}

std::string TextCodec::describe() const { return tokenizer ? tokenizer->describe() : "bytes"; }

std::string tokenizer_file_in(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return "";
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (fs::is_regular_file(fs::path(dir) / name, ec)) return (fs::path(dir) / name).string();
  return "";
}

TextCodec text_codec(const Config& cfg, const std::string& path, const std::string& fallback_dir) {
  namespace fs = std::filesystem;
  TextCodec c;
  c.vocab_size = cfg.model.vocab_size;
  std::string file = !path.empty() ? path : cfg.data.tokenizer;
  std::string key = !path.empty() ? "--tokenizer" : "data.tokenizer";
  if (file.empty() && !cfg.model.init_from.empty()) {
    std::error_code ec;
    const fs::path init(cfg.model.init_from);
    file = tokenizer_file_in((fs::is_directory(init, ec) ? init : init.parent_path()).string());
    key = "model.init_from's tokenizer";
  }
  if (file.empty()) {
    file = tokenizer_file_in(fallback_dir);
    key = "the checkpoint's tokenizer";
  }
  if (file.empty()) return c;
  c.tokenizer = Tokenizer::load(file);
  c.file = file;
  MT_CHECK(c.tokenizer->vocab_size() <= cfg.model.vocab_size, "config",
           "{} = {}: the tokenizer has {} ids but model.vocab_size = {}: it is not this model's tokenizer", key, file,
           c.tokenizer->vocab_size(), cfg.model.vocab_size);
  return c;
}

// Sequence lengths must be multiples of this (tp under sequence parallel).
int64_t sequence_pad(const TrainRun& run) {
  int tp = run.mesh.size(run.mesh.dim_index(dim::tp));
  return run.config.parallel.sequence_parallel ? tp : 1;
}

}  // namespace mt
