#include "runtime/train/run_config.h"

#include <climits>
#include <cmath>
#include <filesystem>
#include <functional>

#include <fmt/ranges.h>

#include "models/model.h"
#include "runtime/io/config_reader.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

// The model, training, data, eval, sample and checkpoint sections (mesh-dependent
// checks, such as the batch being divisible by dp, happen when the mesh exists).
void validate_training(const Config& c) {
  auto& m = c.model;
  check_model_config(m, c.training.seq_len);
  // Expert parallel splits the experts evenly.
  if (c.parallel.ep > 1 && m.moe.n_experts > 0 && m.moe.n_experts % c.parallel.ep != 0)
    fail("config", "model.moe.n_experts = {} is not divisible by parallel.ep = {}: each ep rank holds n_experts / ep",
         m.moe.n_experts, c.parallel.ep);
  if (c.parallel.ep > 1 && m.moe.n_experts == 0)
    fail("config", "parallel.ep = {}: model.type = {} has no experts (model.moe.n_experts = 0)", c.parallel.ep,
         m.type);

  auto& t = c.training;
  require_at_least("training.steps", t.steps, 0, "a step count");
  require_at_least("training.batch_size", t.batch_size, 1, "a number of sequences");
  require_at_least("training.seq_len", t.seq_len, 1, "a length");
  require_at_least("training.micro_batch_size", t.micro_batch_size, 0, "a number of sequences");
  // The step's activations: (batch x seq_len) rows of dim, ffn_dim and vocab_size (any mesh holds at most these).
  require_product_fits({{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}});
  require_product_fits({{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.dim", m.dim}});
  require_product_fits(
      {{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits(
      {{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.vocab_size", m.vocab_size}});
  if (t.seq_len > m.max_seq_len)
    fail("config", "training.seq_len = {} exceeds model.max_seq_len = {}", t.seq_len, m.max_seq_len);
  require_at_least("training.lr", t.lr, 0, "a learning rate");
  require_at_least("training.lr_min", t.lr_min, 0, "a learning rate");
  require_one_of("training.schedule", t.schedule, {"constant", "cosine"});
  require_at_least("training.warmup_steps", t.warmup_steps, 0, "a step count");
  require_at_least("training.weight_decay", t.weight_decay, 0, "a decay");
  for (auto [key, b] : {std::pair{"training.beta1", t.beta1}, {"training.beta2", t.beta2}})
    if (!(b >= 0 && b < 1)) fail("config", "{} = {}: expected 0 <= beta < 1", key, b);
  if (!(t.eps > 0) || !std::isfinite(t.eps)) fail("config", "training.eps = {}: expected > 0", t.eps);
  require_at_least("training.grad_clip", t.grad_clip, 0, "a norm (0 = off)");
  require_one_of("training.dtype", t.dtype, {"fp32", "fp64", "bf16"});
  require_one_of("training.grad_reduce_dtype", t.grad_reduce_dtype, {"fp32", "bf16"});
  require_one_of("parallel.cp_method", c.parallel.cp_method, {"ring", "all_gather", "alltoall"});
  if (c.parallel.fsdp.min_weight_size < 0)
    fail("config", "parallel.fsdp.min_weight_size = {}: expected a number of elements >= 0",
         c.parallel.fsdp.min_weight_size);
  require_one_of("parallel.fsdp.param_dtype", c.parallel.fsdp.param_dtype, {"", "fp32", "bf16", "fp64"});
  require_one_of("parallel.fsdp.reduce_dtype", c.parallel.fsdp.reduce_dtype, {"", "fp32", "bf16"});
  if (!c.parallel.fsdp.param_dtype.empty() && c.parallel.fsdp.param_dtype != t.dtype)
    fail("config",
         "parallel.fsdp.param_dtype = {} differs from training.dtype = {}: parameters are gathered in the "
         "dtype the model computes in; set training.dtype instead",
         c.parallel.fsdp.param_dtype, t.dtype);
  require_one_of("parallel.cp_load_balance", c.parallel.cp_load_balance, {"head_tail", "none"});
  const RecomputeConfig& rc = c.parallel.recompute;
  for (size_t i = 0; i < rc.patterns.size(); ++i)
    if (rc.patterns[i].empty()) fail("config", "parallel.recompute.patterns[{}] is empty: expected a module path", i);
  if (rc.every < 1)
    fail("config", "parallel.recompute.every = {}: expected every N-th matched module, N >= 1", rc.every);
  for (size_t i = 0; i < rc.keep.size(); ++i)
    require_one_of(fmt::format("parallel.recompute.keep[{}]", i), rc.keep[i], {"attention"});
  if (!rc.keep.empty() && rc.patterns.empty())
    fail("config", "parallel.recompute.keep is set but parallel.recompute.patterns is empty: nothing is recomputed");
  if (c.data.document_separator != -1 &&
      (c.data.document_separator < 0 || c.data.document_separator >= c.model.vocab_size))
    fail("config", "data.document_separator = {}: expected a token id in [0, model.vocab_size = {}), or -1 (off)",
         c.data.document_separator, c.model.vocab_size);
  require_at_least("training.grad_bucket_mb", t.grad_bucket_mb, 0, "a size in MiB (0 = per parameter)");
  require_at_least("training.threads", t.threads, 0, "a thread count (0 = auto)");
  if (t.threads > 1024) fail("config", "training.threads = {}: expected at most 1024 threads per rank", t.threads);
  require_one_of("training.nonfinite", t.nonfinite, {"stop", "skip"});
  require_at_least("training.max_nonfinite_steps", t.max_nonfinite_steps, 1, "a step count");

  require_at_least("eval.interval", c.eval.interval, 0, "a step count (0 = never)");
  require_at_least("eval.steps", c.eval.steps, 1, "a batch count");
  require_at_least("sample.interval", c.sample.interval, 0, "a step count (0 = never)");
  require_at_least("sample.tokens", c.sample.tokens, 0, "a token count");
  require_at_least("sample.temperature", c.sample.temperature, 0, "a temperature");
  require_at_least("checkpoint.interval", double(c.checkpoint.interval.steps), 0, "a step count (0 = at the end only)");
  require_at_least("checkpoint.interval_s", c.checkpoint.interval_s, 0, "seconds (0 = by steps only)");
  require_at_least("checkpoint.mtbf_s", c.checkpoint.mtbf_s, 0, "seconds");
  if (c.checkpoint.interval.automatic && !(c.checkpoint.mtbf_s > 0))
    fail("config", "checkpoint.interval = auto needs checkpoint.mtbf_s, the job's mean time between failures in "
                   "seconds (e.g. 3600): the interval is sqrt(2 x save cost x mtbf_s)");
  if (c.checkpoint.interval.automatic && c.checkpoint.interval_s > 0)
    fail("config", "checkpoint.interval = auto and checkpoint.interval_s = {} both choose the interval: set one",
         c.checkpoint.interval_s);
  require_at_least("checkpoint.keep", c.checkpoint.keep, 0, "a count (0 = all)");
  if (!c.profile.steps.empty()) {
    MT_CHECK(c.profile.steps.size() == 2 && c.profile.steps[0] >= 1 && c.profile.steps[1] >= c.profile.steps[0],
             "config", "profile.steps = [{}]: expected [first, last], 1-based steps with first <= last",
             fmt::format("{}", fmt::join(c.profile.steps, ", ")));
    MT_CHECK(!c.profile.dir.empty(), "config", "profile.steps is set but profile.dir is empty: where do traces go?");
  }
  require_at_least("profile.straggler_threshold", c.profile.straggler_threshold, 0, "a fraction");
  require_at_least("profile.straggler_steps", c.profile.straggler_steps, 1, "a step count");
  require_at_least("training.memory_limit_mb", c.training.memory_limit_mb, 0, "MiB (0 = no cap)");
  require_at_least("checkpoint.writers", double(c.checkpoint.writers), 0, "a count of ranks (0 = every rank)");
  if (c.checkpoint.resume.empty())
    fail("config", "checkpoint.resume is empty: expected auto, never or a checkpoint directory");
  if (c.checkpoint.dir.empty() && c.checkpoint.resume != "auto" && c.checkpoint.resume != "never")
    fail("config",
         "checkpoint.resume = {} but checkpoint.dir is empty: a resumed run needs a checkpoint.dir to "
         "write its own checkpoints into",
         c.checkpoint.resume);
}

void validate(const Config& c) {
  if (!(c.comm.timeout_s > 0) || !std::isfinite(c.comm.timeout_s))
    fail("config", "comm.timeout_s = {}: expected a finite number of seconds > 0", c.comm.timeout_s);
  require_one_of("comm.backend", c.comm.backend, {"auto", "mpi", "nccl"});
  require_one_of("comm.device", c.comm.device, {"cpu", "cuda"});
  for (size_t i = 0; i < c.comm.link_gbps.size(); ++i)
    if (!(c.comm.link_gbps[i] > 0) || !std::isfinite(c.comm.link_gbps[i]))
      fail("config", "comm.link_gbps[{}] = {}: expected a finite bandwidth in GB/s > 0", i, c.comm.link_gbps[i]);
  require_one_of("log.level", c.log.level, {"", "trace", "debug", "info", "warn", "error", "off"});
  if (c.log.interval < 1) fail("config", "log.interval = {}: expected a number of steps >= 1", c.log.interval);
  require_one_of("log.progress", c.log.progress, {"auto", "on", "off"});
  validate_training(c);
}

// Every plain key of a section as (path, value as text): the model keys the YAML gave, compared with the file's.
struct Flatten {
  std::string prefix;
  std::vector<std::pair<std::string, std::string>> out;
  template <class T> void operator()(const char* key, T& field, const char*) {
    if constexpr (config_io::is_section_v<T>) {
      Flatten inner{prefix + key + ".", {}};
      field.visit(inner);
      out.insert(out.end(), inner.out.begin(), inner.out.end());
    } else {
      out.push_back({prefix + key, fmt::format("{}", field)});
    }
  }
};

// The Hugging Face key a model key is read from (config.json's spelling, for messages).
std::string hf_key(const std::string& key) {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"model.type", "model_type"},
      {"model.dim", "hidden_size"},
      {"model.n_layers", "num_hidden_layers"},
      {"model.n_heads", "num_attention_heads"},
      {"model.n_kv_heads", "num_key_value_heads"},
      {"model.head_dim", "head_dim"},
      {"model.ffn_dim", "intermediate_size"},
      {"model.vocab_size", "vocab_size"},
      {"model.norm_eps", "rms_norm_eps"},
      {"model.rope_theta", "rope_theta"},
      {"model.max_seq_len", "max_position_embeddings"},
      {"model.tie_embeddings", "tie_word_embeddings"},
      {"model.sliding_window", "sliding_window"},
      {"model.moe.n_experts", "num_local_experts / num_experts"},
      {"model.moe.experts_per_token", "num_experts_per_tok"},
      {"model.moe.ffn_dim", "moe_intermediate_size (mixtral: intermediate_size)"},
      {"model.moe.shared_expert_ffn_dim", "shared_expert_intermediate_size"},
      {"model.moe.norm_topk_prob", "norm_topk_prob"},
      {"model.moe.decoder_sparse_step", "decoder_sparse_step"},
      {"model.moe.mlp_only_layers", "mlp_only_layers"}};
  for (auto& [k, h] : names)
    if (k == key) return h;
  if (key.rfind("model.rope_scaling.", 0) == 0) return "rope_scaling." + key.substr(19);
  return key;
}

// With model.init_from naming a Hugging Face directory (a config.json beside the weights), the model is the file's;
// what the YAML gives must agree with it. init_from and init_std stay the YAML's (init_std only matters without
// weights).
void model_from_init(Config& c, const std::set<std::string>& given) {
  const std::string file = init_from_config_json(c.model.init_from);
  if (file.empty()) return;
  ModelConfig theirs = model_config_from_hf(file);
  theirs.init_from = c.model.init_from;
  theirs.init_std = c.model.init_std;
  // How an MoE model is trained, not what it is: the YAML's keys win over the file's (transformers' users set
  // output_router_logits and router_aux_loss_coef per run too).
  MoeConfig& tm = theirs.moe;
  const MoeConfig& om = c.model.moe;
  for (auto [key, set] : std::initializer_list<std::pair<const char*, std::function<void()>>>{
           {"model.moe.output_router_logits", [&] { tm.output_router_logits = om.output_router_logits; }},
           {"model.moe.router_aux_loss_coef", [&] { tm.router_aux_loss_coef = om.router_aux_loss_coef; }},
           {"model.moe.bias_update_rate", [&] { tm.bias_update_rate = om.bias_update_rate; }},
           {"model.moe.capacity_factor", [&] { tm.capacity_factor = om.capacity_factor; }}})
    if (given.count(key)) set();
  Flatten ours_flat, theirs_flat;
  c.model.visit(ours_flat);
  theirs.visit(theirs_flat);
  for (size_t i = 0; i < ours_flat.out.size(); ++i) {
    const std::string path = "model." + ours_flat.out[i].first;
    if (!given.count(path) || ours_flat.out[i].second == theirs_flat.out[i].second) continue;
    fail("config", "{} = {} but model.init_from's {} says {} = {}: leave the key out (the file gives it) or make "
         "them agree",
         path, ours_flat.out[i].second, file, hf_key(path), theirs_flat.out[i].second);
  }
  c.model = theirs;
}

void finish(Config& c, const std::set<std::string>& given) {
  model_from_init(c, given);
  validate(c);
}

// A run's own config file: a model.init_from that does not exist is named before the model keys it would have
// given are checked (a config stored in a checkpoint may name a directory that has gone since).
void finish_run(Config& c, const std::set<std::string>& given) {
  std::error_code ec;
  if (!c.model.init_from.empty() && !fs::exists(c.model.init_from, ec))
    fail("config", "model.init_from = {}: no such file or directory", c.model.init_from);
  finish(c, given);
}

}  // namespace

std::string init_from_config_json(const std::string& init_from) {
  if (init_from.empty()) return "";
  std::error_code ec;
  fs::path p(init_from);
  fs::path dir = fs::is_directory(p, ec) ? p : p.parent_path();
  fs::path cfg = (dir.empty() ? fs::path(".") : dir) / "config.json";
  return fs::is_regular_file(cfg, ec) ? cfg.string() : "";
}

Config config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides) {
  return config_io::from_node<Config>(config_io::load_yaml_string(yaml), overrides, "", finish);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  // Errors name the file, or the --set that gave the bad value.
  return config_io::from_node<Config>(config_io::load_yaml_file(path), overrides, path, finish_run);
}

std::string config_to_yaml(const Config& c) { return config_io::to_yaml(c); }

uint64_t config_hash(const Config& c) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : config_to_yaml(c)) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace mt
