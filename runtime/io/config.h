// The run's configuration sections: YAML into typed structs. Each section is a plain struct with defaults whose
// visit() lists its keys once, each with its doc and its constraints; that one list drives reading
// (runtime/io/config_reader.h, with unknown-key and type errors naming the key path), checking (check_section
// below), writing the canonical YAML, and the hash that ranks compare. Adding a key is one line in visit(). The
// whole run's Config (these sections and the model's, models/model_config.h) is runtime/train/run_config.h.
#pragma once
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/core/error.h"

namespace mt {

// The name in names nearest to word (edit distance) when it is near enough to be a typo of it, else "":
// unknown config keys, subcommands and options are answered with "did you mean ...?".
std::string nearest_name(const std::string& word, const std::vector<std::string>& names);
// "[config] training.batch_size = 10 must be divisible by dp = 4"
void require_divisible(const std::string& key, int64_t value, const std::string& by_key, int64_t by);
// "[config] key = value: expected what >= min" unless min <= value (finite).
void require_at_least(const std::string& key, double value, double min, const char* what);
// "[config] key = 'value': expected one of 'a', 'b'".
void require_one_of(const std::string& key, const std::string& value, std::initializer_list<const char*> allowed);
// "[config] key is empty: expected what".
void require_non_empty(const std::string& key, const std::string& value, const char* what);
// Sizes multiplied into tensor sizes (elements, then bytes) must not overflow 64 bits: checked before any code
// multiplies them. factors: (key, value) pairs, each already >= 1.
void require_product_fits(std::initializer_list<std::pair<const char*, int64_t>> factors);

// A step count that may instead be "auto" (checkpoint.interval: chosen from the measured save cost and
// checkpoint.mtbf_s).
struct StepsOrAuto {
  int64_t steps = 0;
  bool automatic = false;
  bool operator==(const StepsOrAuto&) const = default;
};

// ---- A key's constraints, beside its definition ----
// visit() entries take them after the doc: v("steps", steps, "optimizer steps", at_least(0, "a step count")).
// check_section applies each to its key's value once the config is complete, naming the key path; a constraint
// that does not take a whole list applies to each element ("key[i]"). A section's rules across its keys are its
// check() member, run after its keys'; a section whose enabled() is false (off) has nothing checked.

// "key = value: expected what >= min" (require_at_least: the value as a number).
struct AtLeast {
  double min;
  const char* what;
  void operator()(const std::string& key, double v) const { require_at_least(key, v, min, what); }
  void operator()(const std::string& key, const StepsOrAuto& v) const {
    require_at_least(key, double(v.steps), min, what);
  }
};
inline AtLeast at_least(double min, const char* what) { return {min, what}; }

// "key = 'value': expected one of 'a', 'b'". The names live as long as the visit() call that lists them.
struct OneOf {
  std::initializer_list<const char*> allowed;
  void operator()(const std::string& key, const std::string& v) const { require_one_of(key, v, allowed); }
};
inline OneOf one_of(std::initializer_list<const char*> allowed) { return {allowed}; }

// "key is empty: expected what".
struct NonEmpty {
  const char* what;
  void operator()(const std::string& key, const std::string& v) const { require_non_empty(key, v, what); }
};
inline NonEmpty non_empty(const char* what) { return {what}; }

// "key = value: <text>" unless ok(value), for what at_least cannot say ("expected > 0"). ok takes one concrete
// type: the key's, or its elements' for a rule on each element of a list.
template <class Pred> struct Expect {
  Pred ok;
  std::string text;
  template <class T>
    requires std::is_invocable_r_v<bool, const Pred&, const T&>
  void operator()(const std::string& key, const T& v) const {
    if (!ok(v)) fail("config", "{} = {}: {}", key, v, text);
  }
};
template <class Pred> Expect<Pred> expect(Pred ok, std::string text) { return {std::move(ok), std::move(text)}; }
// "key = value: expected > 0" unless finite and > 0.
inline auto positive() {
  return expect([](double x) { return x > 0 && std::isfinite(x); }, "expected > 0");
}

// One entry of a tensor-parallel plan written in YAML: a module-path pattern and a style with
// PyTorch's keyword names. Layouts are placements on the tp dim: "Shard(1)", "S(-1)", "Replicate", "R";
// "" keeps the style's default.
struct TpPlanEntryConfig {
  std::string pattern;
  std::string style;
  std::string input_layouts, output_layouts, desired_input_layouts, desired_output_layouts;
  std::string use_local_output;  // "" (the style's default), "true" or "false"
  template <class V> void visit(V& v) {
    v("pattern", pattern, "module path pattern ('*' one segment, '**' any number)");
    v("style", style,
      "ColwiseParallel | RowwiseParallel | SequenceParallel | PrepareModuleInput | PrepareModuleOutput | "
      "PrepareModuleInputOutput");
    v("input_layouts", input_layouts, "placement of the input on tp ('' = the style's default)");
    v("output_layouts", output_layouts, "placement of the output on tp");
    v("desired_input_layouts", desired_input_layouts, "PrepareModuleInput*: the input's placement for the module");
    v("desired_output_layouts", desired_output_layouts,
      "PrepareModuleOutput*: the output's placement after the module");
    v("use_local_output", use_local_output,
      "PrepareModuleInput: '' | true | false: false (the default) hands the "
      "module's children a distributed input, whose partial gradients are "
      "summed before one reduction");
  }
};

// Fully sharded data parallel (parallel.dp_shard > 1): which modules form units and how parameters are laid out.
struct FsdpConfig {
  int64_t min_weight_size = int64_t(1) << 18;
  std::vector<std::string>
      patterns;  // units ([] = the model's default: each decoder layer, the embedding, norm+lm_head)
  bool reshard_after_forward = true;
  std::string param_dtype;   // "" = training.dtype (the dtype parameters are gathered and computed in)
  std::string reduce_dtype;  // "" = training.grad_reduce_dtype
  template <class V> void visit(V& v) {
    v("min_weight_size", min_weight_size, "parameters with at most this many elements stay replicated",
      expect([](int64_t n) { return n >= 0; }, "expected a number of elements >= 0"));
    v("patterns", patterns,
      "the units: module patterns, each match a unit; 'a+b' puts the matches of a and b "
      "in one unit ([] = each decoder layer, the embedding, the final norm with lm_head)");
    v("reshard_after_forward", reshard_after_forward,
      "free a unit's gathered parameters after its forward "
      "(false: keep them until its backward: less traffic, more memory)");
    v("param_dtype", param_dtype, "'' | fp32 | bf16 | fp64: must be training.dtype ('' = that)",
      one_of({"", "fp32", "bf16", "fp64"}));
    v("reduce_dtype", reduce_dtype, "'' | fp32 | bf16: gradients reduce-scattered in ('' = training.grad_reduce_dtype)",
      one_of({"", "fp32", "bf16"}));
  }
};

// Activation recompute (parallel/recompute.h): matched modules keep only their input in forward and run their
// forward again inside backward. Default off (no patterns).
struct RecomputeConfig {
  std::vector<std::string> patterns;
  int every = 1;
  std::vector<std::string> keep;
  template <class V> void visit(V& v) {
    v("patterns", patterns,
      "module paths to recompute, e.g. [\"model.layers.*\"] ('*' one segment, '**' any "
      "number; empty: off)",
      non_empty("a module path"));
    v("every", every, "recompute every N-th matched module in forward order (1: all)",
      expect([](int n) { return n >= 1; }, "expected every N-th matched module, N >= 1"));
    v("keep", keep,
      "what recomputed modules keep besides their input: [attention] (its output and log-sum-exp: "
      "attention and its cp communication are not repeated)",
      one_of({"attention"}));
  }
  void check() const;  // keep needs patterns
};

struct ParallelConfig {
  int pp = 1;                          // pipeline parallel: stages of consecutive layers, the outermost dim
  std::string pp_schedule = "1f1b";    // gpipe | 1f1b | interleaved_1f1b | zb1p
  int pp_virtual = 1;                  // model chunks per pp rank (interleaved_1f1b)
  std::vector<int> pp_layers;          // decoder layers per stage (pp x pp_virtual entries); empty: balanced
  int dp_replicate = -1;  // replicated data parallel; by default whatever the other dims leave
  int dp_shard = 1;       // fully sharded data parallel
  int ep = 1;             // expert parallel (MoE models): experts split, rows of the batch too
  int cp = 1;             // context parallel: cp_ulysses x cp_ring
  int cp_ring = 0;        // 0: derived from cp and cp_method (parallel/parallel_dims.h)
  int cp_ulysses = 0;
  int tp = 1;             // tensor (and sequence) parallel, innermost
  bool sequence_parallel = true;
  bool loss_parallel = true;
  std::string cp_method = "ring";
  std::string cp_load_balance = "head_tail";
  std::vector<TpPlanEntryConfig> tp_plan;
  RecomputeConfig recompute;
  FsdpConfig fsdp;
  template <class V> void visit(V& v) {
    v("pp", pp, "pipeline-parallel degree: stages of consecutive decoder layers, the outermost mesh dim");
    v("pp_schedule", pp_schedule,
      "with pp > 1: gpipe | 1f1b | interleaved_1f1b | zb1p (the micro-batches are training.micro_batch_size)");
    v("pp_virtual", pp_virtual, "with pp_schedule interleaved_1f1b: model chunks (virtual stages) per pp rank");
    v("pp_layers", pp_layers,
      "decoder layers per stage, pp x pp_virtual entries summing to model.n_layers (empty: balanced by FLOPs, the "
      "embedding and lm_head counted)");
    v("dp_replicate", dp_replicate, "replicated data-parallel degree (-1: the remaining ranks)");
    v("dp_shard", dp_shard, "fully sharded data-parallel degree (-1: the remaining ranks)");
    v("ep", ep,
      "expert-parallel degree (MoE models): each rank holds model.moe.n_experts / ep experts; its ranks see other "
      "batch rows, data parallel for the dense parameters");
    v("cp", cp, "context-parallel degree, cp_ulysses x cp_ring (-1: the remaining ranks)");
    v("cp_ring", cp_ring,
      "2-D context parallel: the ring (or all_gather) degree, the outer cp dim (0: cp with ring and all_gather, "
      "1 with alltoall)");
    v("cp_ulysses", cp_ulysses,
      "2-D context parallel: the Ulysses (all-to-all over heads) degree, the inner cp dim (0: cp with alltoall, "
      "1 otherwise)");
    v("tp", tp, "tensor-parallel degree (-1: the remaining ranks)");
    v("sequence_parallel", sequence_parallel, "with tp > 1: norms and residuals sharded along the sequence");
    v("loss_parallel", loss_parallel, "with tp > 1: cross-entropy on vocab-sharded logits, never gathered");
    v("cp_method", cp_method,
      "with cp > 1: ring (K/V passed around the cp ranks, overlapped with compute) | "
      "all_gather (K/V gathered once per layer, dK/dV reduce-scattered) | "
      "alltoall (Ulysses: q, k, v all-to-all from sequence- to head-sharded, attention over the whole sequence); "
      "with cp_ring and cp_ulysses set, the ring dim's method",
      one_of({"ring", "all_gather", "alltoall"}));
    v("cp_load_balance", cp_load_balance,
      "with cp > 1: head_tail (2 cp chunks, rank r holds r and 2 cp - 1 - r: "
      "equal causal work) | none (contiguous)",
      one_of({"head_tail", "none"}));
    v("tp_plan", tp_plan, "tensor-parallel plan (empty: the model's default plan)");
    v("recompute", recompute, "activation recompute by module pattern (default off)");
    v("fsdp", fsdp, "fully sharded data parallel (with dp_shard > 1)");
  }
};

struct CommConfig {
  double timeout_s = 600;
  std::string backend = "auto";
  std::string device = "cpu";
  std::vector<double> link_gbps;
  template <class V> void visit(V& v) {
    v("timeout_s", timeout_s, "seconds before a stuck collective aborts the job",
      expect([](double s) { return s > 0 && std::isfinite(s); }, "expected a finite number of seconds > 0"));
    v("backend", backend, "auto | mpi | nccl (auto: nccl for cuda when built and each rank has its own GPU)",
      one_of({"auto", "mpi", "nccl"}));
    v("device", device, "cpu | cuda", one_of({"cpu", "cuda"}));
    v("link_gbps", link_gbps, "link bandwidth per mesh dim in GB/s, outermost first (empty: defaults)",
      expect([](double g) { return g > 0 && std::isfinite(g); }, "expected a finite bandwidth in GB/s > 0"));
  }
};

// The kernel of bf16 attention on CUDA (docs/design/cudnn-attention.md); ignored on CPU ranks.
struct AttentionConfig {
  std::string kernel = "auto";
  bool deterministic = false;
  template <class V> void visit(V& v) {
    v("kernel", kernel,
      "auto | cudnn | flash: bf16 attention on CUDA through cuDNN's fused attention (loaded at run time: "
      "$CUDNN_PATH, the toolkit's lib folder or an installed PyTorch's) or the own flash kernel (auto: cuDNN where it "
      "loads and takes the call, else flash, said once; cudnn: an error where it cannot)",
      one_of({"auto", "cudnn", "flash"}));
    v("deterministic", deterministic,
      "cuDNN's backward only from engines without its nondeterministic note (the flash kernel is deterministic)");
  }
};

struct LogConfig {
  std::string level;  // empty: info on rank 0, warn elsewhere
  int interval = 10;
  std::string metrics_file;
  std::string progress = "auto";
  std::string peak_cache = "auto";
  template <class V> void visit(V& v) {
    v("level", level, "'' | trace | debug | info | warn | error | off",
      one_of({"", "trace", "debug", "info", "warn", "error", "off"}));
    v("interval", interval, "steps between progress lines",
      expect([](int n) { return n >= 1; }, "expected a number of steps >= 1"));
    v("metrics_file", metrics_file, "JSON-lines metrics file ('' = none)");
    v("progress", progress,
      "auto | on | off: the redrawn progress bar on rank 0's stdout (auto: only when that "
      "reaches a person's terminal, never a file or a batch log)",
      one_of({"auto", "on", "off"}));
    v("peak_cache", peak_cache,
      "auto | off | a folder: where the CPU GEMM peak MFU is measured against is kept per machine (auto: "
      "$XDG_CACHE_HOME/meshtrain, else ~/.cache/meshtrain; off: probed at every start)",
      non_empty("a folder, auto or off"));
  }
};

// Traces and the slow rank: profile.steps [first, last] (1-based global steps, inclusive; empty: no trace; a range
// past training.steps is cut there, one starting past it is an error) written to profile.dir as Chrome trace JSON per
// rank and merged; the slow-rank check runs every step.
struct ProfileConfig {
  std::vector<int> steps;
  std::string dir;
  int64_t max_events = 1000000;
  double straggler_threshold = 0.2;
  int straggler_steps = 5;
  template <class V> void visit(V& v) {
    v("steps", steps,
      "[first, last]: the steps (1-based, inclusive) traced in the Chrome trace event format (Perfetto, "
      "chrome://tracing); empty: none",
      expect([](const std::vector<int>& s) { return s.empty() || (s.size() == 2 && s[0] >= 1 && s[1] >= s[0]); },
             "expected [first, last], 1-based steps with first <= last"));
    v("dir", dir, "where each rank writes trace_rank{R}.json and rank 0 the merged trace.json");
    v("max_events", max_events,
      "the most events a rank keeps of the range (each about 250 B of memory, 160 B of file): once a rank "
      "holds this many the range ends after that step, said in the log",
      at_least(1, "a number of events"));
    v("straggler_threshold", straggler_threshold,
      "a rank whose compute time per step is above its peers' median by more than this fraction is slow "
      "(0: no slow-rank check)",
      at_least(0, "a fraction"));
    v("straggler_steps", straggler_steps, "slow steps in a row before the rank is named in the log",
      at_least(1, "a step count"));
  }
  void check() const;  // steps need a dir
};

struct TrainingConfig {
  int64_t steps = 1000;
  int64_t batch_size = 8;  // global, in sequences
  int64_t seq_len = 256;
  int64_t micro_batch_size = 0;  // per data-parallel rank; 0: batch_size / dp (no accumulation)
  double lr = 1e-3;
  std::string schedule = "cosine";
  int64_t warmup_steps = 100;
  double lr_min = 1e-4;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;
  int64_t seed = 0;
  std::string dtype = "fp32";
  std::string grad_reduce_dtype = "fp32";
  std::string fp8 = "none";
  double grad_bucket_mb = 25;
  int threads = 0;
  double memory_limit_mb = 0;  // host memory this rank's tensors may hold; 0: no cap
  std::string nonfinite = "stop";
  int64_t max_nonfinite_steps = 5;
  bool cuda_graph = false;
  template <class V> void visit(V& v) {
    const auto beta = expect([](double b) { return b >= 0 && b < 1; }, "expected 0 <= beta < 1");
    v("steps", steps, "optimizer steps", at_least(0, "a step count"));
    v("batch_size", batch_size, "global batch in sequences (independent of the mesh)",
      at_least(1, "a number of sequences"));
    v("seq_len", seq_len, "tokens per sequence", at_least(1, "a length"));
    v("micro_batch_size", micro_batch_size, "sequences per forward/backward on a rank (0: all of the rank's share)",
      at_least(0, "a number of sequences"));
    v("lr", lr, "peak learning rate", at_least(0, "a learning rate"));
    v("schedule", schedule, "constant | cosine (both with linear warmup)", one_of({"constant", "cosine"}));
    v("warmup_steps", warmup_steps, "steps of linear warmup", at_least(0, "a step count"));
    v("lr_min", lr_min, "learning rate at the end of the cosine", at_least(0, "a learning rate"));
    v("weight_decay", weight_decay, "AdamW decoupled weight decay (2-D weights only)", at_least(0, "a decay"));
    v("beta1", beta1, "AdamW beta1", beta);
    v("beta2", beta2, "AdamW beta2", beta);
    v("eps", eps, "AdamW epsilon (outside the square root)", positive());
    v("grad_clip", grad_clip, "clip the global gradient norm to this (0 = off)", at_least(0, "a norm (0 = off)"));
    v("seed", seed, "seed of the parameter init and of sampling");
    v("dtype", dtype,
      "fp32 | bf16 (mixed precision: bf16 compute, f32 master weights, optimizer state, norms' statistics, softmax "
      "and loss; on the CPU bf16 is emulated in f32 for checks) | fp64 (CPU, for checks)",
      one_of({"fp32", "fp64", "bf16"}));
    v("grad_reduce_dtype", grad_reduce_dtype,
      "fp32 | bf16: the dtype gradients are all-reduced in across data-parallel ranks (bf16 halves the bytes)",
      one_of({"fp32", "bf16"}));
    v("fp8", fp8,
      "none | tensorwise | rowwise: the Linears' GEMMs in FP8 (docs/design/fp8.md; needs dtype bf16): "
      "tensorwise: one amax-based scale per tensor, E4M3 activations and weights, E5M2 gradients; rowwise: a scale "
      "per row along the contraction dim, powers of two, E4M3 throughout (torchao's recipes). Embedding, lm_head, "
      "routers, MoE experts and LoRA adapters stay bf16; on the CPU FP8 is emulated bit-exactly, for checks",
      one_of({"none", "tensorwise", "rowwise"}));
    v("grad_bucket_mb", grad_bucket_mb,
      "gradients are synced in buckets of about this many MiB, each launched as soon as backward has produced it "
      "(0: one collective per parameter)",
      at_least(0, "a size in MiB (0 = per parameter)"));
    v("threads", threads, "CPU threads per rank (0: the node's cores / ranks on the node; at most 1024)",
      at_least(0, "a thread count (0 = auto)"),
      expect([](int n) { return n <= 1024; }, "expected at most 1024 threads per rank"));
    v("memory_limit_mb", memory_limit_mb,
      "host memory this rank's tensors may hold, in MiB (0: no cap): an allocation past it is an error naming this "
      "key, not a kill by the kernel",
      at_least(0, "MiB (0 = no cap)"));
    v("nonfinite", nonfinite,
      "a step whose loss or gradient norm is not finite is never applied: stop (end the "
      "run naming the step) | skip (count it in the metrics and go on)",
      one_of({"stop", "skip"}));
    v("max_nonfinite_steps", max_nonfinite_steps,
      "with nonfinite: skip, stop after this many non-finite steps in a row", at_least(1, "a step count"));
    v("cuda_graph", cuda_graph,
      "on CUDA ranks, each step replays two CUDA graphs captured after warm-up (forward, backward, gradient sync and "
      "the loss; clipping and AdamW) around the step's one host sync; a run the graphs cannot hold runs as without, "
      "saying why");
  }
  void check() const;  // the step's rows x seq_len fit in 64 bits
};

struct DataConfig {
  std::string train = "data/fortunes/fortunes_train_*.bin";
  std::string val = "data/fortunes/fortunes_val_*.bin";
  int64_t document_separator = -1;
  std::string tokenizer;
  template <class V> void visit(V& v) {
    v("train", train, "glob of llm.c token shards for training (relative to the working directory)");
    v("val", val, "glob of validation shards ('' = no validation)");
    v("document_separator", document_separator,
      "token id that starts a document: attention stays inside "
      "documents (-1 = off: plain causal attention over the sequence)");
    v("tokenizer", tokenizer,
      "the tokenizer of the shards (a tokenizer.json, tokenizer.model or a directory holding one), used to encode "
      "sample.prompt and decode samples ('' = model.init_from's, when it has one; else bytes)");
  }
};

struct EvalConfig {
  int64_t interval = 100;
  int64_t steps = 4;
  template <class V> void visit(V& v) {
    v("interval", interval, "steps between validation evaluations (0 = never)",
      at_least(0, "a step count (0 = never)"));
    v("steps", steps, "validation batches per evaluation", at_least(1, "a batch count"));
  }
};

struct SampleConfig {
  int64_t interval = 200;
  std::string prompt = "The ";
  int64_t tokens = 64;
  double temperature = 0.8;
  template <class V> void visit(V& v) {
    v("interval", interval, "steps between generated samples (0 = never)", at_least(0, "a step count (0 = never)"));
    v("prompt", prompt, "text the samples continue");
    v("tokens", tokens, "tokens generated per sample", at_least(0, "a token count"));
    v("temperature", temperature, "sampling temperature (0 = greedy)", at_least(0, "a temperature"));
  }
};

// In-memory checkpoints (runtime/train/memory_checkpoint.h): every `interval` steps each rank's state in a
// shared-memory segment of its machine, and a copy on a peer rank's. Default off.
struct MemoryCheckpointConfig {
  StepsOrAuto interval;
  bool peer = true;
  bool on() const { return interval.automatic || interval.steps > 0; }
  template <class V> void visit(V& v) {
    v("interval", interval,
      "steps between in-memory checkpoints (0 = off), or auto: with checkpoint.mtbf_s every sqrt(2 x save cost x "
      "mtbf_s) seconds (Young/Daly), else every step when a save costs under 2% of the step, else the fewest steps "
      "that keep it under 2% (the cost measured over the first saves). Each rank copies its shards, "
      "optimizer state and step into a checksummed segment in /dev/shm, kept until the next one is whole; a resume "
      "loads them before the disk",
      at_least(0, "a step count (0 = off) or auto"));
    v("peer", peer,
      "also keep each rank's segment on a peer rank (the next node's rank of the same local index; on one machine "
      "the next rank), sent over the world group: a rank whose segment is lost loads its peer's copy");
  }
};

struct CheckpointConfig {
  std::string dir;
  StepsOrAuto interval;
  double interval_s = 0;
  double mtbf_s = 0;
  bool async = false;
  int64_t keep = 2;
  std::string resume = "auto";
  bool allow_config_change = false;
  int64_t writers = 0;
  MemoryCheckpointConfig memory;
  template <class V> void visit(V& v) {
    v("dir", dir, "checkpoint directory ('' = no checkpoints)");
    v("interval", interval,
      "steps between checkpoints (0 = only at the end), or auto: every sqrt(2 x save cost x checkpoint.mtbf_s) "
      "seconds (Young/Daly), the save's cost measured by a first save after step 2",
      at_least(0, "a step count (0 = at the end only)"));
    v("interval_s", interval_s, "seconds between checkpoints, by rank 0's clock (0 = by steps only)",
      at_least(0, "seconds (0 = by steps only)"));
    v("mtbf_s", mtbf_s, "the job's mean time between failures in seconds, for interval: auto and memory.interval: auto", at_least(0, "seconds"));
    v("async", async,
      "write checkpoints while training goes on: each writer's tensors are copied to host memory at the save step "
      "(the only stall), a thread writes and syncs them, and the directory is completed at a later step");
    v("keep", keep, "newest checkpoints kept (0 = all)", at_least(0, "a count (0 = all)"));
    v("resume", resume, "auto (latest complete checkpoint in dir) | never | a step_XXXXXXXX directory",
      non_empty("auto, never or a checkpoint directory"));
    v("allow_config_change", allow_config_change,
      "resume even when the data path, seed, model or schedule "
      "differ from the checkpoint's (they are reported either way)");
    v("writers", writers,
      "ranks that write a checkpoint's files, one file each for the model and the optimizer (0 = every rank; "
      "1 = one model.safetensors and one optimizer.safetensors)",
      at_least(0, "a count of ranks (0 = every rank)"));
    v("memory", memory, "in-memory checkpoints in /dev/shm and on a peer rank, beside the disk's (default off)");
  }
  // interval auto needs mtbf_s and no interval_s; a resumed run needs a dir; memory needs a dir (its name and its
  // fallback) and resume: auto
  void check() const;
};

namespace config_io {

// A section is anything with visit(); probe it with a visitor that accepts any key.
struct ProbeVisitor {
  template <class F, class... C> void operator()(const char*, F&, const char*, const C&...) {}
};
template <class T> constexpr bool is_section_v = requires(T& t, ProbeVisitor& p) { t.visit(p); };
// A list of sections (parallel.tp_plan).
template <class T> constexpr bool is_section_list_v = false;
template <class T> constexpr bool is_section_list_v<std::vector<T>> = is_section_v<T>;

inline std::string join_path(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

template <class S> void check_section(const S& section, const std::string& path);

// One constraint on a key's value, or on each element of a list when it does not take the whole list.
template <class T, class C> void check_value(const std::string& key, const T& value, const C& constraint) {
  if constexpr (std::is_invocable_v<const C&, const std::string&, const T&>) {
    constraint(key, value);
  } else {
    for (size_t i = 0; i < value.size(); ++i) constraint(fmt::format("{}[{}]", key, i), value[i]);
  }
}

struct Checker {
  std::string path;
  template <class T, class... C> void operator()(const char* key, T& field, const char*, const C&... constraints) {
    const std::string p = join_path(path, key);
    (check_value(p, field, constraints), ...);
    if constexpr (is_section_v<T>) {
      check_section(field, p);
    } else if constexpr (is_section_list_v<T>) {
      for (size_t i = 0; i < field.size(); ++i) check_section(field[i], fmt::format("{}[{}]", p, i));
    }
  }
};

// A section's keys' constraints in visit() order, nested sections included, then its check(); errors name the
// key paths under `path` ("" for the root).
template <class S> void check_section(const S& section, const std::string& path) {
  if constexpr (requires { section.enabled(); })
    if (!section.enabled()) return;
  Checker c{path};
  const_cast<S&>(section).visit(c);
  if constexpr (requires { section.check(); }) section.check();
}

template <class F> struct KeyVisitor {
  std::string path;
  F& fn;
  template <class T, class... C> void operator()(const char* key, T& field, const char*, const C&...) {
    const std::string p = join_path(path, key);
    if constexpr (is_section_v<T>) {
      KeyVisitor inner{p, fn};
      field.visit(inner);
    } else {
      fn(p, std::as_const(field));
    }
  }
};

// fn(key path, value) for every plain key of a section in visit() order, nested sections' keys under their paths.
template <class S, class F> void for_each_key(const S& section, const std::string& path, F&& fn) {
  KeyVisitor<F> v{path, fn};
  const_cast<S&>(section).visit(v);
}

}  // namespace config_io

}  // namespace mt
