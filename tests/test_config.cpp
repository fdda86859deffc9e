#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "check_error.h"
#include <spdlog/sinks/stdout_color_sinks.h>

#include "runtime/core/log.h"
#include "attention/attention.h"
#include "parallel/parallel_dims.h"
#include "models/model.h"
#include "models/llama/llama.h"
#include "runtime/train/run_config.h"

using namespace mt;

TEST_CASE("config defaults") {
  Config c = config_from_yaml_string("");
  CHECK(c.parallel.tp == 1);
  CHECK(c.comm.timeout_s == 600);
  CHECK(c.comm.backend == "auto");
  CHECK(c.log.interval == 10);
  CHECK(ParallelDims::from_config(c.parallel, 1).world() == 1);
}

TEST_CASE("a full file parses, and the example config is valid") {
  Config c = config_from_yaml_string(R"(
parallel: {dp_replicate: 2, dp_shard: -1, cp: 1, tp: 2}
comm: {timeout_s: 30.5, backend: mpi, device: cpu, link_gbps: [25, 100]}
log: {level: debug, interval: 5, metrics_file: m.jsonl}
)");
  CHECK(c.parallel.dp_shard == -1);
  CHECK(c.comm.link_gbps == std::vector<double>{25, 100});
  CHECK(c.log.metrics_file == "m.jsonl");
  const ParallelDims pd = ParallelDims::from_config(c.parallel, 8);
  CHECK(pd.dp_replicate() == 2);
  CHECK(pd.dp_shard() == 2);
  CHECK(pd.cp() == 1);
  CHECK(pd.tp() == 2);
  Config ex = load_config(MT_SOURCE_DIR "/configs/check.yaml", {});
  CHECK(ex.parallel.tp == 2);
}

TEST_CASE("unknown keys are named, with the known ones and a suggestion") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timout_s: 3}"),
                       "[config] unknown key 'comm.timout_s' (known keys in 'comm': timeout_s, backend, device, "
                       "link_gbps); did you mean 'timeout_s'?");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("parralel: {tp: 2}"), "unknown key 'parralel'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("parralel: {tp: 2}"), "did you mean 'parallel'?");
  CHECK_ERROR_CONTAINS(
      config_from_yaml_string("zzzzzzzz: 1"),
      "known keys in 'the top level': parallel, comm, log, model, training, data, eval, sample, checkpoint, profile, lora, attention)");
}

TEST_CASE("wrong types name the key, the value and what was expected") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timeout_s: abc}"),
                       "[config] comm.timeout_s: expected a number, got 'abc'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("parallel: {tp: 2.5}"), "parallel.tp: expected an integer, got '2.5'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {link_gbps: 5}"), "comm.link_gbps: expected a list, got '5'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {link_gbps: [1, x]}"),
                       "comm.link_gbps[1]: expected a number, got 'x'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: 5"), "comm: expected a map of keys, got '5'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("5", {"comm.timeout_s=3"}),
                       "the top level: expected a map of keys, got '5'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("[1, 2]", {"comm.timeout_s=3"}),
                       "the top level: expected a map of keys, got a list");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {[a]: 1}"), "comm: keys must be names, got a list");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timeout_s: 1}\ncomm: {timeout_s: 2}"), "duplicate key 'comm'");
}

TEST_CASE("impossible values") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {backend: gloo}"),
                       "comm.backend = 'gloo': expected one of 'auto', 'mpi', 'nccl'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timeout_s: 0}"),
                       "comm.timeout_s = 0: expected a finite number of seconds > 0");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timeout_s: .inf}"), "comm.timeout_s = inf");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {link_gbps: [10, -1]}"), "comm.link_gbps[1] = -1");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("log: {interval: 0}"), "log.interval = 0");
  // The parallel sizes are checked where they are read, on every rank before the mesh (ParallelDims::from_config).
  auto dims = [](const std::string& yaml) {
    return ParallelDims::from_config(config_from_yaml_string(yaml).parallel, 8);
  };
  CHECK_ERROR_CONTAINS(dims("parallel: {tp: 0}"), "parallel.tp = 0: expected a size >= 1");
  CHECK_ERROR_CONTAINS(dims("parallel: {dp_replicate: 1, tp: -1, cp: -1}"),
                       "parallel: only one of dp_replicate, dp_shard, cp, tp may be -1, but cp, tp are");
  CHECK_ERROR_CONTAINS(dims("parallel: {dp_shard: -1}"),
                       "but dp_replicate, dp_shard are (dp_replicate is -1 by default: set it to 1)");
  CHECK_ERROR_CONTAINS(dims("parallel: {cp_ring: -2}"), "parallel.cp_ring = -2: expected a size >= 1");
  Config c = config_from_yaml_string("parallel: {dp_replicate: 2, cp: 2, tp: 2}");
  CHECK_ERROR_CONTAINS(ParallelDims::from_config(c.parallel, 4),
                       "parallel: dp_replicate*dp_shard*cp*tp = 2*1*2*2 = 8 but the job has 4 ranks");
  Config d = config_from_yaml_string("parallel: {dp_replicate: -1, tp: 3}");
  CHECK_ERROR_CONTAINS(ParallelDims::from_config(d.parallel, 8),
                       "the other sizes multiply to 3, which does not divide the job's 8 ranks");
  CHECK_ERROR_CONTAINS(require_divisible("training.batch_size", 10, "dp", 4),
                       "[config] training.batch_size = 10 must be divisible by dp = 4");
  require_divisible("training.batch_size", 12, "dp", 4);  // no throw
  ParallelConfig unchecked;                               // built in code, never validated: resolve checks it too
  unchecked.tp = 0;
  CHECK_ERROR_CONTAINS(ParallelDims::from_config(unchecked, 4), "parallel.tp = 0: expected a size >= 1");
}

TEST_CASE("context parallel's two dims: cp with cp_method, or cp_ulysses x cp_ring") {
  auto pd = [](const std::string& yaml, int world) {
    return ParallelDims::from_config(config_from_yaml_string(yaml).parallel, world);
  };
  ParallelDims ring = pd("parallel: {dp_replicate: 1, cp: 4}", 4);
  CHECK(ring.cp_ring() == 4);
  CHECK(ring.cp_ulysses() == 1);
  ParallelDims a2a = pd("parallel: {dp_replicate: 1, cp: 4, cp_method: alltoall}", 4);
  CHECK(a2a.cp_ring() == 1);
  CHECK(a2a.cp_ulysses() == 4);
  CHECK(a2a.cp() == 4);
  ParallelDims two = pd("parallel: {dp_replicate: -1, cp_ulysses: 2, cp_ring: 4}", 16);
  CHECK(two.cp_ulysses() == 2);
  CHECK(two.cp_ring() == 4);
  CHECK(two.dp_replicate() == 2);
  ParallelDims half = pd("parallel: {dp_replicate: 1, cp: 8, cp_ulysses: 2, cp_method: all_gather}", 8);
  CHECK(half.cp_ring() == 4);
  CHECK(half.cp_method == CpMethod::all_gather);
  // Mesh order: dp_replicate, dp_shard, ep, cp_ring, cp_ulysses, tp; the named groups are dp, cp, dp_cp.
  std::vector<std::string> names;
  for (auto& d : two.mesh_dims()) names.push_back(d.name);
  CHECK(names == std::vector<std::string>{"dp_replicate", "dp_shard", "ep", "cp_ring", "cp_ulysses", "tp"});
  auto groups = two.group_names();
  REQUIRE(groups.size() == 4);
  CHECK(groups[1].name == "cp");
  CHECK(groups[1].dims == std::vector<std::string>{"cp_ring", "cp_ulysses"});
  CHECK(groups[2].dims == std::vector<std::string>{"dp_replicate", "dp_shard", "ep", "cp_ring", "cp_ulysses"});
  CHECK(groups[3].name == "loss");
  CHECK(groups[3].dims == groups[2].dims);
  CHECK(two.grad_partial_dims() == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(two.describe().find("cp_ulysses=2") != std::string::npos);
  // head_tail: 2 x cp_ring chunks, each split again over cp_ulysses.
  CHECK(two.seq_multiple() == 16);

  CHECK_ERROR_CONTAINS(pd("parallel: {dp_replicate: 1, cp: 8, cp_ulysses: 2, cp_ring: 2}", 8),
                       "parallel.cp_ulysses x parallel.cp_ring = 2 x 2 = 4, but parallel.cp = 8");
  CHECK_ERROR_CONTAINS(pd("parallel: {dp_replicate: 1, cp: 6, cp_ulysses: 4}", 6),
                       "parallel.cp_ulysses = 4 does not divide parallel.cp = 6");
  CHECK_ERROR_CONTAINS(pd("parallel: {dp_replicate: 1, cp: 4, cp_ring: 2, cp_method: alltoall}", 4),
                       "parallel.cp_method = alltoall puts all of parallel.cp on Ulysses, but parallel.cp_ring = 2");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("parallel: {cp_method: ulysses}"),
                       "parallel.cp_method = 'ulysses': expected one of 'ring', 'all_gather', 'alltoall'");
  CHECK_ERROR_CONTAINS(pd("parallel: {dp_replicate: 1, cp_ulysses: 2, cp_ring: 2}", 8),
                       "= 1*1*4*1 = 4 but the job has 8 ranks");
}

TEST_CASE("heads must split over tp and then over Ulysses; the error names the keys") {
  auto pd = [](const std::string& yaml, int world) {
    return ParallelDims::from_config(config_from_yaml_string(yaml).parallel, world);
  };
  ParallelDims a2a4 = pd("parallel: {dp_replicate: 1, cp: 4, cp_method: alltoall}", 4);
  a2a4.check_heads(8, 8);  // kv heads a multiple of the degree
  a2a4.check_heads(8, 2);  // kv heads a divisor: shared
  a2a4.check_heads(8, 1);
  CHECK_ERROR_CONTAINS(a2a4.check_heads(6, 6),
                       "model.n_heads = 6 over parallel.tp = 1 leaves 6 q heads per rank, which do not divide by "
                       "parallel.cp = 4");
  CHECK_ERROR_CONTAINS(pd("parallel: {dp_replicate: 1, cp: 8, cp_method: alltoall}", 8).check_heads(24, 3),
                       "model.n_kv_heads = 3 over parallel.tp = 1 leaves 3 kv heads per rank, which is neither a "
                       "multiple nor a divisor of parallel.cp = 8");
  ParallelDims tp2 = pd("parallel: {dp_replicate: 1, tp: 2, cp_ulysses: 2, cp_ring: 2}", 8);
  CHECK_ERROR_CONTAINS(tp2.check_heads(6, 2),
                       "model.n_heads = 6 over parallel.tp = 2 leaves 3 q heads per rank, which do not divide by "
                       "parallel.cp_ulysses = 2");
  tp2.check_heads(8, 2);
  CHECK_ERROR_CONTAINS(tp2.check_heads(8, 3), "model.n_kv_heads = 3 must both be divisible by parallel.tp = 2");
}

TEST_CASE("--set overrides any key, lists and nested ints included") {
  Config c =
      config_from_yaml_string("parallel: {tp: 2}", {"parallel.tp=4", "comm.link_gbps=[100,25]", "log.level=warn"});
  CHECK(c.parallel.tp == 4);
  CHECK(c.comm.link_gbps == std::vector<double>{100, 25});
  CHECK(c.log.level == "warn");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"parallel.tp"}),
                       "bad --set 'parallel.tp': expected key.path=value");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"comm.timout_s=3"}), "unknown key 'comm.timout_s' given by --set");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"comm..x=3"}), "empty part in key");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"comm.timeout_s.x=3"}),
                       "comm.timeout_s: expected a number, got a map");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("comm: {timeout_s: 3}", {"comm.timeout_s.x=3"}),
                       "'timeout_s' is not a section");
}

TEST_CASE("a bad value names its origin: the --set that gave it, else the file") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"training.steps=abc"}),
                       "[config] --set training.steps=abc: training.steps: expected an integer, got 'abc'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"training.lr=-1"}),
                       "[config] --set training.lr=-1: training.lr = -1");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {dim: 30}", {"model.n_heads=4"}),
                       "[config] --set model.n_heads=4: model.dim = 30 must be divisible by model.n_heads = 4");
  // A --set of another key does not take the blame: a key named inside a longer one does not count.
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {warmup_steps: -1}", {"training.steps=5"}),
                       "[config] training.warmup_steps = -1");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("", {"log.progress=maybe"}),
                       "--set log.progress=maybe: log.progress = 'maybe': expected one of 'auto', 'on', 'off'");
  CHECK(config_from_yaml_string("", {"log.progress=off"}).log.progress == "off");
  CHECK(config_from_yaml_string("").log.progress == "auto");
}

TEST_CASE("a key's constraints, in its visit() entry: named by path, per element, only when the section is on") {
  // A section checked alone, as code builds it.
  TrainingConfig t;
  config_io::check_section(t, "training");
  t.beta2 = 1;
  CHECK_ERROR_CONTAINS(config_io::check_section(t, "training"), "[config] training.beta2 = 1: expected 0 <= beta < 1");
  t.beta2 = 0.95;
  t.threads = 2000;  // two constraints on one key, in order
  CHECK_ERROR_CONTAINS(config_io::check_section(t, "training"), "training.threads = 2000: expected at most 1024");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("parallel: {recompute: {patterns: [a, ''], keep: [attention]}}"),
                       "parallel.recompute.patterns[1] is empty: expected a module path");
  // RoPE scaling off (type none): its other keys are unused, so unchecked.
  config_from_yaml_string("model: {rope_scaling: {factor: 0.5}}");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {rope_scaling: {type: linear, factor: 0.5}}"),
                       "model.rope_scaling.factor = 0.5: expected a factor >= 1");
  // A dense family's MoE keys are unused; experts on it are refused before any of them is read.
  config_from_yaml_string("model: {moe: {experts_per_token: 0}}");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {moe: {n_experts: 4}}"),
                       "model.moe.n_experts = 4: model.type = llama is dense (the MoE families are mixtral, "
                       "qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {type: mixtral}"),
                       "model.moe.n_experts = 0: expected an expert count >= 1");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {type: mixtral, moe: {n_experts: 4, ffn_dim: 8, "
                                               "experts_per_token: 5}}"),
                       "model.moe.experts_per_token = 5 exceeds model.moe.n_experts = 4");
  // Bounded dropless expert parallel: 0 (exact) or a factor >= 1; below 1 a balanced routing already overflows.
  for (const char* v : {"0", "1", "1.25", "4"})
    CHECK(config_from_yaml_string(fmt::format("model: {{type: mixtral, moe: {{n_experts: 4, ffn_dim: 8, "
                                              "dropless_bound: {}}}}}", v)).model.moe.dropless_bound ==
          std::stod(v));
  for (auto [v, shown] : {std::pair{"0.5", "0.5"}, {"-1", "-1"}, {".nan", "nan"}})
    CHECK_ERROR_CONTAINS(config_from_yaml_string(fmt::format("model: {{type: mixtral, moe: {{n_experts: 4, ffn_dim: "
                                                             "8, dropless_bound: {}}}}}", v)),
                         fmt::format("[config] model.moe.dropless_bound = {}: expected 0 (the exact sizes, read per "
                                     "sparse layer) or a factor >= 1", shown));
  CHECK(MoeConfig{}.dropless_bound == 1.25);
  // A rule across sections: Config::check.
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {seq_len: 512}"),
                       "training.seq_len = 512 exceeds model.max_seq_len = 256");
}

TEST_CASE("a family names its model keys' config.json keys once: hf_key, to_hf and from_hf agree") {
  CHECK(model_family("llama").hf_key("model.dim") == "hidden_size");
  CHECK(model_family("llama").hf_key("model.rope_scaling.factor") == "rope_scaling.factor");
  CHECK(model_family("llama").hf_key("model.moe.router_score") == "model.moe.router_score");  // not in the file
  CHECK(model_family("mixtral").hf_key("model.moe.ffn_dim") == "intermediate_size");
  CHECK(model_family("mixtral").hf_key("model.moe.n_experts") == "num_local_experts");
  CHECK(model_family("qwen2_moe").hf_key("model.moe.ffn_dim") == "moe_intermediate_size");
  CHECK(model_family("qwen2_moe").hf_key("model.moe.n_experts") == "num_experts");
  for (const std::string& type : model_family_names()) {
    const ModelFamily& f = model_family(type);
    ModelConfig m;
    m.type = type;
    if (f.experts) m.moe.n_experts = 4, m.moe.ffn_dim = 96;
    if (type == "qwen2_moe") m.moe.shared_expert_ffn_dim = 64;
    if (type == "deepseek_v2" || type == "deepseek_v3") {  // latent attention, its router, one dense layer first
      m.mla = {.q_lora_rank = type == "deepseek_v3" ? 24 : 0, .kv_lora_rank = 16, .qk_nope_head_dim = 16,
               .qk_rope_head_dim = 8, .v_head_dim = 12};
      m.head_dim = 8, m.n_kv_heads = m.n_heads;
      m.moe.shared_expert_ffn_dim = 96, m.moe.n_group = 2, m.moe.topk_group = 1, m.moe.mlp_only_layers = {0};
      m.moe.router_score = type == "deepseek_v3" ? "sigmoid" : "softmax";
      m.moe.routed_scaling_factor = 2.5, m.moe.router_aux_loss_coef = 0;
      m.rope_scaling = {.type = "yarn", .factor = 4, .original_max_position_embeddings = 64};
      m.rope_scaling.mscale_all_dim = 1;
    }
    if (type == "gemma2" || type == "gemma3_text") {
      m.sliding_window = 16, m.query_pre_attn_scalar = 64, m.attn_softcap = 50, m.final_softcap = 30;
      m.sliding_window_pattern = type == "gemma2" ? 2 : 6;
      if (type == "gemma3_text") m.rope_local_theta = 10000;
    }
    const nlohmann::json j = f.to_hf(m);
    CHECK(j["architectures"][0] == f.architecture);
    for (const HfName& n : f.hf_names) CHECK_MESSAGE(j.contains(n.hf), type << ": " << n.hf);
    ModelConfig back = f.from_hf(j, "config.json");
    back.type = type;
    CHECK_MESSAGE(f.to_hf(back) == j, type);
  }
}

TEST_CASE("gemma2 and gemma3_text: config.json's keys, transformers' defaults, and bad input naming the key") {
  const nlohmann::json g2 = {{"model_type", "gemma2"}, {"hidden_size", 32},        {"intermediate_size", 64},
                             {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                             {"head_dim", 16},         {"vocab_size", 256000}};
  ModelConfig c = model_family("gemma2").from_hf(g2, "config.json");
  // Gemma2Config's defaults: window 4096, caps 50 and 30, query_pre_attn_scalar 256, tied, layers 0 and 2 slide.
  CHECK(c.sliding_window == 4096);
  CHECK(c.attn_softcap == 50);
  CHECK(c.final_softcap == 30);
  CHECK(c.query_pre_attn_scalar == 256);
  CHECK(c.tie_embeddings);
  CHECK((c.sliding_layer(0) && !c.sliding_layer(1) && c.sliding_layer(2) && !c.sliding_layer(3)));
  CHECK(model_family("gemma2").to_hf(c)["layer_types"] ==
        nlohmann::json({"sliding_attention", "full_attention", "sliding_attention", "full_attention"}));
  nlohmann::json g3 = g2;
  g3["model_type"] = "gemma3_text";
  g3["vocab_size"] = 262208;  // Gemma 3's vocabulary
  g3["num_hidden_layers"] = 7;
  c = model_family("gemma3_text").from_hf(g3, "config.json");
  CHECK(c.vocab_size == 262208);
  CHECK(c.sliding_window_pattern == 6);
  CHECK(c.rope_theta == 1e6);
  CHECK(c.rope_local_theta == 10000);
  CHECK(c.attn_softcap == 0);
  CHECK((c.sliding_layer(4) && !c.sliding_layer(5) && c.sliding_layer(6)));
  nlohmann::json bad = g2;
  bad["sliding_window"] = 0;
  CHECK_ERROR_CONTAINS(model_family("gemma2").from_hf(bad, "g/config.json"),
                       "g/config.json: sliding_window = 0: expected an integer >= 1");
  bad["sliding_window"] = nullptr;
  CHECK_ERROR_CONTAINS(model_family("gemma2").from_hf(bad, "g/config.json"),
                       "g/config.json: sliding_window = null: gemma2 needs the window of its sliding layers");
  bad = g3;
  bad["layer_types"] = {"full_attention", "full_attention", "full_attention", "full_attention",
                        "full_attention", "full_attention", "full_attention"};
  CHECK_ERROR_CONTAINS(model_family("gemma3_text").from_hf(bad, "config.json"),
                       "layer 0 is \"full_attention\" where sliding_window_pattern (6) gives \"sliding_attention\"");
  bad = g2;
  bad["hidden_activation"] = "gelu";
  CHECK_ERROR_CONTAINS(model_family("gemma2").from_hf(bad, "config.json"), "hidden_activation = \"gelu\"");
  // The YAML: a window of 0 names the key; Gemma's keys are Gemma's.
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {type: gemma2, sliding_window_pattern: 2}"),
                       "model.sliding_window = 0: model.type = gemma2 needs the window of its sliding layers");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {type: gemma2, sliding_window: 8}"),
                       "model.sliding_window_pattern = 0: gemma2 alternates sliding and global layers");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {type: llama, attn_softcap: 50}"),
                       "model.attn_softcap = 50: model.type = llama has no such key");
  config_from_yaml_string(
      "model: {type: gemma2, sliding_window: 8, sliding_window_pattern: 2}\n"
      "training: {seq_len: 64}");  // a window shorter than the sequence: Gemma's own
  // estimate's FLOPs: a sliding layer's keys per query are T times its causal pairs' share of a causal layer's.
  ModelConfig m;
  m.type = "gemma2", m.n_layers = 2, m.sliding_window = 8, m.sliding_window_pattern = 2;
  CHECK(llama_attention_keys(m, 64, 1) == 64);                                                       // global
  CHECK(llama_attention_keys(m, 64, 0) == doctest::Approx(64.0 * (8 * 64 - 28) / (64 * 65 / 2.0)));  // sliding
  m.sliding_window = 100;
  CHECK(llama_attention_keys(m, 64, 0) == 64);  // a window over the sequence is causal
}

TEST_CASE("attention's slow kernel is attention's to say") {
  CHECK(slow_attention_warning(Device::cuda(0), DType::bf16, 96) ==
        "training.dtype = bf16 with head dim 96: the tensor-core attention kernel takes 64 or 128, so attention runs "
        "the slow fp32 reference kernel");
  CHECK(slow_attention_warning(Device::cuda(0), DType::bf16, 128).empty());
  CHECK(slow_attention_warning(Device::cuda(0), DType::f32, 96).empty());
  CHECK(slow_attention_warning(Device::cpu(), DType::bf16, 96).empty());
}

TEST_CASE("nearest_name: a typo's nearest name, nothing for an unrelated word") {
  std::vector<std::string> subs{"check", "layout", "train", "plan", "generate"};
  CHECK(nearest_name("trian", subs) == "train");
  CHECK(nearest_name("genrate", subs) == "generate");
  CHECK(nearest_name("xyzzy", subs) == "");
}

TEST_CASE("files: missing, unparsable with line, and errors name the file") {
  CHECK_ERROR_CONTAINS(load_config("/nonexistent/x.yaml", {}), "cannot read config file '/nonexistent/x.yaml'");
  std::string path = "/tmp/meshtrain_test_config.yaml";
  {
    std::ofstream f(path);
    f << "comm:\n  timeout_s: 5\n  backend: mpi: x\n";
  }
  CHECK_ERROR_CONTAINS(load_config(path, {}), path + ": YAML error at line 3, column 15: illegal map value");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("a: 1\n b: 2\n"), "YAML error at line 2");
  {
    std::ofstream f(path);
    f << "comm:\n  timeout_s: five\n";
  }
  CHECK_ERROR_CONTAINS(load_config(path, {}), "[config] " + path + ": comm.timeout_s: expected a number, got 'five'");
  std::remove(path.c_str());
}

TEST_CASE("canonical YAML round-trips to the same hash; different configs hash differently") {
  Config a = config_from_yaml_string("comm: {link_gbps: [1.5, 2]}\nlog: {metrics_file: 'a b'}");
  Config b = config_from_yaml_string(config_to_yaml(a));
  CHECK(config_hash(a) == config_hash(b));
  CHECK(config_to_yaml(a) == config_to_yaml(b));
  Config c = config_from_yaml_string("", {"comm.timeout_s=31"});
  CHECK(config_hash(c) != config_hash(config_from_yaml_string("")));
  const Config defaults;  // a named value: GCC 12 warns (falsely) of uninitialised strings in a Config{} temporary
  Config d = config_from_yaml_string(config_to_yaml(defaults));
  CHECK(config_hash(d) == config_hash(defaults));
}

TEST_CASE("a written file loads back, with --set on top") {
  std::string path = "/tmp/meshtrain_test_config_roundtrip.yaml";
  Config a = config_from_yaml_string("parallel: {dp_replicate: 2, tp: 2}\ncomm: {link_gbps: [50, 400]}");
  {
    std::ofstream f(path);
    f << config_to_yaml(a);
  }
  CHECK(config_hash(load_config(path, {})) == config_hash(a));
  Config b = load_config(path, {"parallel.tp=1", "comm.link_gbps=[]"});
  CHECK(b.parallel.tp == 1);
  CHECK(b.parallel.dp_replicate == 2);
  CHECK(b.comm.link_gbps.empty());
  std::remove(path.c_str());
}

TEST_CASE("sizes that would overflow when multiplied are refused before any code multiplies them") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {dim: 4611686018427387904}"),
                       "model.dim x model.vocab_size = 4611686018427387904 x 256: the product overflows 64 bits");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {dim: 64, ffn_dim: 4611686018427387904}"),
                       "model.dim x model.ffn_dim = 64 x 4611686018427387904: the product overflows");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {batch_size: 1152921504606846976, seq_len: 32}"),
                       "training.batch_size x training.seq_len = 1152921504606846976 x 32: the product overflows");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {batch_size: 4398046511104, seq_len: 256}"),
                       "training.batch_size x training.seq_len x model.dim = 4398046511104 x 256 x 256");
  config_from_yaml_string(
      "model: {dim: 8192, vocab_size: 65536, ffn_dim: 28672, n_layers: 80, n_heads: 64, "
      "n_kv_heads: 8, max_seq_len: 8192}\ntraining: {batch_size: 1024, seq_len: 8192}");
}

TEST_CASE("training.fp8: the recipes, and bf16 required") {
  CHECK(config_from_yaml_string("").training.fp8 == "none");
  CHECK(config_from_yaml_string("training: {dtype: bf16, fp8: tensorwise}").training.fp8 == "tensorwise");
  CHECK(config_from_yaml_string("training: {dtype: bf16, fp8: rowwise}").training.fp8 == "rowwise");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {fp8: tensorwise}"),
                       "training.fp8 = tensorwise needs training.dtype = bf16");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {dtype: fp64, fp8: rowwise}"),
                       "got training.dtype = fp64");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {dtype: bf16, fp8: blockwise}"), "training.fp8 = 'blockwise'");
}

TEST_CASE("threads, non-finite steps, resume without a dir") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {threads: 100000}"),
                       "training.threads = 100000: expected at most 1024 threads per rank");
  CHECK(config_from_yaml_string("").training.nonfinite == "stop");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {nonfinite: ignore}"),
                       "training.nonfinite = 'ignore': expected one of 'stop', 'skip'");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {nonfinite: skip, max_nonfinite_steps: 0}"),
                       "training.max_nonfinite_steps = 0");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("checkpoint: {resume: runs/x/step_00000010}"),
                       "checkpoint.resume = runs/x/step_00000010 but checkpoint.dir is empty");
  config_from_yaml_string("checkpoint: {resume: never}");
  CHECK(!config_from_yaml_string("").checkpoint.allow_config_change);
}

TEST_CASE("an unknown log level is an error that can still be reported (it used to leave no logger)") {
  auto before = spdlog::default_logger();
  spdlog::drop("meshtrain");
  spdlog::set_default_logger(spdlog::stderr_color_mt("meshtrain"));
  CHECK_ERROR_CONTAINS(init_logging(0, "bogus"), "bad log level 'bogus'");
  CHECK(spdlog::default_logger() != nullptr);
  spdlog::drop("meshtrain");
  spdlog::set_default_logger(before);
}

// ---- The model families' config.json readers (models/model.h) ----

namespace {

// A config.json in a fresh directory; returns the file's path.
std::string write_hf_config(const std::string& name, const std::string& json) {
  const std::string dir = "/tmp/mt_test_hf_" + name + "_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << json;
  return dir + "/config.json";
}

const char* kLlama3 = R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128256, "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0, "tie_word_embeddings": true, "max_position_embeddings": 131072,
  "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}})";

}  // namespace

TEST_CASE("config.json: Llama 3.2's rope_scaling (transformers 4) and rope_parameters (5) give the same model") {
  const ModelConfig v4 = model_config_from_hf(write_hf_config("v4", kLlama3));
  CHECK(v4.type == "llama");
  CHECK(v4.vocab_size == 128256);
  CHECK(v4.rope_theta == 500000.0);
  CHECK(v4.rope_scaling.type == "llama3");
  CHECK(v4.rope_scaling.factor == 32.0);
  CHECK(v4.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(v4.head_dim == 0);  // hidden_size / num_attention_heads
  const ModelConfig v5 = model_config_from_hf(write_hf_config("v5", R"({"model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})"));
  CHECK(v5.rope_theta == v4.rope_theta);
  CHECK(v5.rope_scaling == v4.rope_scaling);
  // Written back, read again: the same model (both spellings are written).
  const nlohmann::json j = family_of(v4).to_hf(v4);
  CHECK(j["rope_scaling"]["rope_type"] == "llama3");
  CHECK(j["rope_parameters"]["rope_theta"] == 500000.0);
  const ModelConfig back = model_config_from_hf(write_hf_config("back", j.dump()));
  CHECK(back.rope_scaling == v4.rope_scaling);
  CHECK(back.vocab_size == v4.vocab_size);
}

TEST_CASE("config.json: Mistral's and Qwen2's windows, Qwen2's biases counted, refusals named") {
  const char* mistral = R"({"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 32000, "head_dim": 32})";
  const ModelConfig m = model_config_from_hf(write_hf_config("mistral", mistral));
  CHECK(m.type == "mistral");
  CHECK(m.sliding_window == 4096);  // MistralConfig's default when the key is absent
  CHECK(m.head_dim == 32);          // not hidden_size / num_attention_heads = 16
  CHECK(m.head_size() == 32);
  const ModelConfig q = model_config_from_hf(write_hf_config("qwen2", R"({"model_type": "qwen2", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "vocab_size": 151936, "use_sliding_window": false, "sliding_window": 32768, "tie_word_embeddings": true})"));
  CHECK(q.type == "qwen2");
  CHECK(q.sliding_window == 0);  // only use_sliding_window turns it on
  ModelConfig plain = q;
  plain.type = "llama";
  // Qwen2's q/k/v biases: (n_heads + 2 n_kv_heads) x head_dim per layer.
  CHECK(family_of(q).num_params(q, true) - family_of(plain).num_params(plain, true) == 2 * (4 + 2 * 2) * 16);
  CHECK_ERROR_CONTAINS(model_config_from_hf(write_hf_config("gpt2", R"({"model_type": "gpt2", "n_embd": 64})")),
                       "model_type = 'gpt2': meshtrain implements llama, mistral, qwen2");
  CHECK_ERROR_CONTAINS(
      model_config_from_hf(write_hf_config("yarn", R"({"model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})")),
      "rope_scaling.rope_type = \"yarn\"");
  CHECK_ERROR_CONTAINS(
      model_config_from_hf(write_hf_config("both", R"({"model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})")),
      "rope_scaling and rope_parameters describe different RoPE scaling");
}

TEST_CASE("config.json: Phi-3's LongRoPE (the context at the top level, \"su\" its old name), written back the same") {
  // Phi-3-mini-128k's keys, smaller: head_dim 8, so four factors each.
  const std::string phi3 = R"({"model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 32064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "pad_token_id": 32000,
    "rope_scaling": {"type": "su", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.0, 2.0, 4.0, 8.0]}})";
  const ModelConfig c = model_config_from_hf(write_hf_config("phi3", phi3));
  CHECK(c.type == "phi3");
  CHECK(c.norm_eps == 1e-5);  // Phi3Config's default
  CHECK(c.sliding_window == 262144);
  CHECK(c.rope_scaling.type == "longrope");
  CHECK(c.rope_scaling.original_max_position_embeddings == 4096);
  CHECK(c.rope_scaling.long_factor == std::vector<double>{1.0, 2.0, 4.0, 8.0});
  CHECK(c.rope_scaling.longrope_attention_factor(c.max_seq_len) ==
        doctest::Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))).epsilon(1e-15));
  const nlohmann::json j = family_of(c).to_hf(c);
  CHECK(j["rope_scaling"].size() == 3);  // type, short_factor, long_factor: what Phi3Config (transformers 4) accepts
  CHECK(j["original_max_position_embeddings"] == 4096);
  CHECK(j["rope_parameters"]["rope_type"] == "longrope");
  CHECK(model_config_from_hf(write_hf_config("phi3_back", j.dump())).rope_scaling == c.rope_scaling);
  std::string bad = phi3;
  bad.replace(bad.find("[1.0, 1.1, 1.2, 1.3]"), 20, "[1.0, 1.1]");
  CHECK_ERROR_CONTAINS(model_config_from_hf(write_hf_config("phi3_bad", bad)),
                       "rope_scaling.short_factor has 2 values: LongRoPE needs one per frequency, head_dim / 2 = 4");
  CHECK_ERROR_CONTAINS(
      model_config_from_hf(write_hf_config("llama_longrope", R"({"model_type": "llama", "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]}})")),
      "rope_scaling.rope_type = \"longrope\"");
  const std::string lists = "short_factor: [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], long_factor: [1, 1, 1, 1, "
                            "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]";
  CHECK(config_from_yaml_string("model: {type: phi3, rope_scaling: {type: longrope, " + lists + "}}").model.type ==
        "phi3");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {rope_scaling: {type: longrope, " + lists + "}}"),
                       "model.rope_scaling.type = longrope: model.type = llama has no LongRoPE (phi3 has)");
}

TEST_CASE("model.init_from's config.json gives the model keys; a key the YAML gives must agree") {
  const std::string file = write_hf_config("init", kLlama3);
  const std::string dir = std::filesystem::path(file).parent_path().string();
  const Config c = config_from_yaml_string("model: {init_from: " + dir + "}\ntraining: {seq_len: 64}\n");
  CHECK(c.model.vocab_size == 128256);
  CHECK(c.model.tie_embeddings);
  CHECK(c.model.rope_scaling.type == "llama3");
  CHECK(c.model.init_from == dir);
  const Config same = config_from_yaml_string("model: {init_from: " + dir + ", dim: 64, vocab_size: 128256}\n");
  CHECK(same.model.dim == 64);
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {init_from: " + dir + ", n_layers: 3}\n"),
                       "model.n_layers = 3 but model.init_from's " + file + " says num_hidden_layers = 2");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("model: {init_from: " + dir + ", rope_scaling: {factor: 8}}\n"),
                       "model.rope_scaling.factor = 8 but model.init_from's " + file +
                           " says rope_scaling.factor = 32");
  CHECK_ERROR_CONTAINS(load_config("", {"model.init_from=/nonexistent/dir"}), "model.init_from = /nonexistent/dir: no such file or directory");
}

TEST_CASE("profile.steps against training.steps, the last step of any run of the config") {
  CHECK_ERROR_CONTAINS(config_from_yaml_string("training: {steps: 5}\nprofile: {steps: [50, 60], dir: tr}\n"),
                       "profile.steps = [50, 60] starts after training.steps = 5");
  // A range ending after it is cut there by the run (RunTrace), not refused; one starting at it is traced.
  CHECK(config_from_yaml_string("training: {steps: 5}\nprofile: {steps: [4, 100], dir: tr}\n").profile.steps[1] == 100);
  CHECK(config_from_yaml_string("training: {steps: 5}\nprofile: {steps: [5, 5], dir: tr}\n").profile.steps[0] == 5);
  CHECK_ERROR_CONTAINS(config_from_yaml_string("profile: {max_events: 0}"), "profile.max_events = 0");
}

TEST_CASE("attention: kernel and deterministic, the kernel one of auto, cudnn, flash") {
  const Config c = config_from_yaml_string("attention: {kernel: cudnn, deterministic: true}");
  CHECK(c.attention.kernel == "cudnn");
  CHECK(c.attention.deterministic);
  CHECK(config_from_yaml_string("").attention.kernel == "auto");
  CHECK_ERROR_CONTAINS(config_from_yaml_string("attention: {kernel: cudnnn}"),
                       "attention.kernel = 'cudnnn': expected one of 'auto', 'cudnn', 'flash'");
}

