// The families built on the Llama architecture, each a designated initialiser below handed to the registry
// (models/model.h) by llama_architecture_families: llama (Llama 1/2/3.x), mistral (Llama's architecture under
// model_type "mistral"), qwen2 (Qwen2 and Qwen2.5: biases on q, k and v), qwen3 (q and k norms), and the mixtures
// of experts mixtral, qwen2_moe and qwen3_moe. Their Hugging Face config.json keys both ways, transformers 4 and 5
// spellings, each model key's name there once in the family's hf_names, are families_hf.cpp's. phi3 (Phi-3) is
// Llama's tree with fused qkv_proj and gate_up_proj in its files (fused_weights) and LongRoPE. gemma2 and
// gemma3_text (Gemma 2 and 3's text models) are the tree with Gemma's changes (LlamaVariant::gemma): (1 + w) norms,
// four per layer, the embedding scaled by sqrt(d), GeGLU, sliding-window layers beside global ones, soft-capping,
// Gemma 3's q/k norms and local RoPE base. deepseek_v2 and deepseek_v3 are the tree with multi-head latent
// attention (models/llama/mla.cpp), shared experts without a gate, group-limited routing and dense first layers.
#include <cmath>
#include <map>

#include "models/llama/families_hf.h"
#include "models/llama/parallelize.h"

using json = nlohmann::json;

namespace mt {

namespace {

bool is_deepseek(const ModelConfig& c) { return c.type == "deepseek_v2" || c.type == "deepseek_v3"; }

LlamaVariant variant_of(const ModelConfig& c) {
  LlamaVariant v;
  v.qkv_bias = c.type == "qwen2" || c.type == "qwen2_moe";
  v.qk_norm = c.type == "qwen3" || c.type == "qwen3_moe" || c.type == "gemma3_text";
  v.gemma = c.type == "gemma2" || c.type == "gemma3_text";
  if (c.type == "mixtral") v.moe_block = "block_sparse_moe", v.moe_names = {"w1", "w3", "w2"};
  if (is_deepseek(c)) {  // shared_experts without a gate; V3's selection bias from its files
    v.moe_names.shared = "shared_experts";
    v.moe_names.shared_gate = false;
    v.moe_names.score_bias = c.type == "deepseek_v3";
  }
  return v;
}

std::unique_ptr<CausalLM> build(const ModelConfig& c, const ParamFactory& f) {
  return std::make_unique<LlamaForCausalLM>(c, f, variant_of(c));
}

LlamaForCausalLM& as_llama(CausalLM& m) {
  auto* l = dynamic_cast<LlamaForCausalLM*>(&m);
  MT_CHECK(l, "model", "{}: not a model of the Llama architecture", m.type());
  return *l;
}

std::unique_ptr<FullyShard> parallelize(CausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                        const ParallelConfig& p, int64_t seq_len, DType reduce_dtype) {
  as_llama(model).seq->seq_len = seq_len;  // LongRoPE picks its factors by the run's sequence
  return parallelize_llama(as_llama(model), mesh, pd, p, seq_len, reduce_dtype);
}

double flops(const ModelConfig& c, int64_t seq_len) { return llama_flops_per_token(c, seq_len, variant_of(c)); }
int64_t num_params(const ModelConfig& c, bool with_embeddings) {
  return llama_num_params(c, with_embeddings, variant_of(c));
}
int64_t active_params(const ModelConfig& c, bool with_embeddings) {
  return llama_active_params(c, with_embeddings, variant_of(c));
}

bool is_gemma(const ModelConfig& c) { return c.type == "gemma2" || c.type == "gemma3_text"; }

// Gemma's keys: a window for the sliding layers, Gemma 2's fixed alternation; another family has none of them.
void check_gemma(const ModelConfig& c) {
  if (!is_gemma(c)) {
    const std::pair<const char*, double> keys[] = {{"query_pre_attn_scalar", c.query_pre_attn_scalar},
                                                   {"attn_softcap", c.attn_softcap},
                                                   {"final_softcap", c.final_softcap},
                                                   {"sliding_window_pattern", double(c.sliding_window_pattern)},
                                                   {"rope_local_theta", c.rope_local_theta}};
    for (const auto& [key, v] : keys)
      if (v != 0)
        fail("config", "model.{} = {}: model.type = {} has no such key (gemma2 and gemma3_text have)", key, v, c.type);
    return;
  }
  if (c.sliding_window < 1)
    fail("config",
         "model.sliding_window = {}: model.type = {} needs the window of its sliding layers (>= 1; Hugging Face's "
         "sliding_window)",
         c.sliding_window, c.type);
  if (c.type == "gemma2" && c.sliding_window_pattern != 2)
    fail("config",
         "model.sliding_window_pattern = {}: gemma2 alternates sliding and global layers (layer i slides when i is "
         "even): set it to 2",
         c.sliding_window_pattern);
  if (c.type == "gemma3_text" && c.sliding_window_pattern < 1)
    fail("config", "model.sliding_window_pattern = {}: gemma3_text needs its period (>= 1; Gemma 3's 6)",
         c.sliding_window_pattern);
  if (c.rope_local_theta > 0 && c.type != "gemma3_text")
    fail("config", "model.rope_local_theta = {}: model.type = {} has one RoPE base (gemma3_text has two)",
         c.rope_local_theta, c.type);
  if (c.moe.enabled()) fail("config", "model.moe.n_experts = {}: model.type = {} is dense", c.moe.n_experts, c.type);
}

// DeepSeek's keys: latent attention in its families only, group-limited routing and YaRN likewise.
void check_deepseek(const ModelConfig& c) {
  if (c.mtp_layers > 0 && c.type != "deepseek_v3")
    fail("config", "model.mtp_layers = {}: model.type = {} has no multi-token prediction (deepseek_v3 has)",
         c.mtp_layers, c.type);
  if (!is_deepseek(c)) {
    if (c.mla.enabled())
      fail("config", "model.mla.kv_lora_rank = {}: model.type = {} has no latent attention (deepseek_v2 and "
           "deepseek_v3 have)", c.mla.kv_lora_rank, c.type);
    if (c.moe.enabled() && (c.moe.n_group > 1 || c.moe.topk_group > 1))
      fail("config", "model.moe.n_group = {}: model.type = {} has no group-limited routing (deepseek has)",
           c.moe.n_group, c.type);
    if (c.rope_scaling.type == "yarn")
      fail("config", "model.rope_scaling.type = yarn: model.type = {} has no YaRN here (deepseek_v2 and "
           "deepseek_v3 have)", c.type);
    return;
  }
  if (!c.mla.enabled())
    fail("config", "model.mla.kv_lora_rank = 0: model.type = {} needs its latent attention (>= 1; Hugging Face's "
         "kv_lora_rank)", c.type);
  const std::string want = c.type == "deepseek_v3" ? "sigmoid" : "softmax";
  if (c.moe.router_score != want)
    fail("config", "model.moe.router_score = {}: {} scores by {}", c.moe.router_score, c.type, want);
}

void check(const ModelConfig& c, int64_t seq_len) {
  check_gemma(c);
  // Outside Gemma meshtrain attends to the whole (causal) sequence: a window shorter than it would be a different
  // model.
  if (!is_gemma(c) && c.sliding_window > 0 && c.sliding_window < seq_len)
    fail("config",
         "model.sliding_window = {} is shorter than training.seq_len = {}: meshtrain attends to the whole sequence, "
         "so the window must cover it (or be 0: none)",
         c.sliding_window, seq_len);
  if (c.sliding_window > 0 && c.type != "mistral" && c.type != "qwen2" && c.type != "mixtral" && c.type != "phi3" &&
      !is_gemma(c))
    fail("config", "model.sliding_window = {}: model.type = {} has no sliding window", c.sliding_window, c.type);
  if (c.rope_scaling.type == "longrope" && c.type != "phi3")
    fail("config", "model.rope_scaling.type = longrope: model.type = {} has no LongRoPE (phi3 has)", c.type);
  if (c.moe.enabled() && c.moe.shared_expert_ffn_dim > 0 && c.type != "qwen2_moe" && !is_deepseek(c))
    fail("config",
         "model.moe.shared_expert_ffn_dim = {}: model.type = {} has no shared expert (qwen2_moe and deepseek have)",
         c.moe.shared_expert_ffn_dim, c.type);
  check_deepseek(c);
}

ParallelPlan tp_plan(bool sp, bool lp) { return llama_tp_plan(sp, lp); }

// What tells one family of the architecture from another (ModelFamily's members of the same names).
struct LlamaFamily {
  const char* type;
  const char* architecture;
  bool experts = false;
  std::vector<HfName> hf_names;
  json (*write_hf)(const ModelFamily& f, const ModelConfig& c);
  ModelConfig (*read_hf)(const ModelFamily& f, const json& j, const std::string& file);
  std::vector<FusedWeight> fused_weights = {};
};

// A family: the architecture's code with the family's own entries.
ModelFamily on_llama(LlamaFamily own) {
  return {.type = own.type,
          .architecture = own.architecture,
          .experts = own.experts,
          .layers = "model.layers.*",
          .build = build,
          .parallelize = parallelize,
          .tp_plan = tp_plan,
          .tp_step_bytes = llama_tp_step_bytes,
          .flops_per_token = flops,
          .num_params = num_params,
          .active_params = active_params,
          .check = check,
          .hf_names = std::move(own.hf_names),
          .write_hf = own.write_hf,
          .read_hf = own.read_hf,
          .fused_weights = std::move(own.fused_weights)};
}

}  // namespace

std::vector<ModelFamily> llama_architecture_families() {
  using namespace llama_hf;
  return {
      on_llama({.type = "llama",
                .architecture = "LlamaForCausalLM",
                .hf_names = names({}),
                .write_hf = llama_to_hf,
                .read_hf = llama_from_hf}),
      on_llama({.type = "mistral",
                .architecture = "MistralForCausalLM",
                .hf_names = names({kWindow()}),
                .write_hf = mistral_to_hf,
                .read_hf = mistral_from_hf}),
      on_llama({.type = "qwen2",
                .architecture = "Qwen2ForCausalLM",
                .hf_names = names({kWindow()}),
                .write_hf = qwen_to_hf,
                .read_hf = qwen2_from_hf}),
      on_llama({.type = "qwen3",
                .architecture = "Qwen3ForCausalLM",
                .hf_names = names({kWindow()}),
                .write_hf = qwen3_to_hf,
                .read_hf = qwen3_from_hf}),
      on_llama({.type = "mixtral",
                .architecture = "MixtralForCausalLM",
                .experts = true,
                .hf_names = names({kWindow(), kMixtralMoe(), kRouter()}),
                .write_hf = mixtral_to_hf,
                .read_hf = mixtral_from_hf}),
      on_llama({.type = "qwen2_moe",
                .architecture = "Qwen2MoeForCausalLM",
                .experts = true,
                .hf_names = names({kWindow(), kQwenMoe(), kRouter(), kSharedExpert()}),
                .write_hf = qwen_to_hf,
                .read_hf = qwen2_moe_from_hf}),
      on_llama({.type = "qwen3_moe",
                .architecture = "Qwen3MoeForCausalLM",
                .experts = true,
                .hf_names = names({kWindow(), kQwenMoe(), kRouter()}),
                .write_hf = qwen3_to_hf,
                .read_hf = qwen3_moe_from_hf}),
      on_llama({.type = "phi3",
                .architecture = "Phi3ForCausalLM",
                .hf_names = names({kWindow()}),
                .write_hf = phi3_to_hf,
                .read_hf = phi3_from_hf,
                .fused_weights = {{"self_attn.qkv_proj.weight",
                                   {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}},
                                  {"mlp.gate_up_proj.weight", {"mlp.gate_proj.weight", "mlp.up_proj.weight"}}}}),
      on_llama({.type = "gemma2",
                .architecture = "Gemma2ForCausalLM",
                .hf_names = names({kWindow(), kGemma()}),
                .write_hf = gemma_to_hf,
                .read_hf = gemma_from_hf}),
      on_llama({.type = "gemma3_text",
                .architecture = "Gemma3ForCausalLM",
                .hf_names = names({kWindow(), kGemma(), kGemma3()}),
                .write_hf = gemma_to_hf,
                .read_hf = gemma_from_hf}),
      on_llama({.type = "deepseek_v2",
                .architecture = "DeepseekV2ForCausalLM",
                .experts = true,
                .hf_names = names({kDeepseek(), kRouter()}),
                .write_hf = deepseek_to_hf,
                .read_hf = deepseek_from_hf}),
      on_llama({.type = "deepseek_v3",
                .architecture = "DeepseekV3ForCausalLM",
                .experts = true,
                .hf_names = names({kDeepseek(), kRouter()}),
                .write_hf = deepseek_to_hf,
                .read_hf = deepseek_from_hf}),
  };
}

}  // namespace mt
