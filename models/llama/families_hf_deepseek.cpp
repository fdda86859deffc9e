// DeepSeek-V2 and V3 in Hugging Face's config.json, both ways (families.cpp's table names them): the latent attention's,
// the router's and the multi-token prediction's keys, transformers' defaults, and what meshtrain refuses, naming the
// file and the key.
#include <algorithm>

#include "models/llama/families_hf_reader.h"

using json = nlohmann::json;

namespace mt::llama_hf {

// DeepSeek-V2/V3: the experts' and the latent attention's keys. n_shared_experts counts shared experts of the
// routed experts' width (meshtrain: one shared MLP of their total width); first_k_dense_replace the dense layers
// at the start (meshtrain: model.moe.mlp_only_layers 0 .. k-1); q_lora_rank null is a plain q_proj.
json n_shared_to_hf(const ModelConfig& m) {
  return m.moe.ffn_dim > 0 ? m.moe.shared_expert_ffn_dim / m.moe.ffn_dim : 0;
}
json first_dense_to_hf(const ModelConfig& m) { return int64_t(m.moe.mlp_only_layers.size()); }
json q_lora_to_hf(const ModelConfig& m) { return m.mla.q_lora_rank > 0 ? json(m.mla.q_lora_rank) : json(nullptr); }
const std::vector<HfName>& kDeepseek() {
  static const std::vector<HfName> v = {{"model.moe.n_experts", "n_routed_experts"},
                                        {"model.moe.ffn_dim", "moe_intermediate_size"},
                                        {"model.moe.norm_topk_prob", "norm_topk_prob"},
                                        {"model.moe.routed_scaling_factor", "routed_scaling_factor"},
                                        {"model.moe.n_group", "n_group"},
                                        {"model.moe.topk_group", "topk_group"},
                                        {"model.moe.shared_expert_ffn_dim", "n_shared_experts", n_shared_to_hf},
                                        {"model.moe.mlp_only_layers", "first_k_dense_replace", first_dense_to_hf},
                                        {"model.mla.q_lora_rank", "q_lora_rank", q_lora_to_hf},
                                        {"model.mla.kv_lora_rank", "kv_lora_rank"},
                                        {"model.mla.qk_nope_head_dim", "qk_nope_head_dim"},
                                        {"model.mla.qk_rope_head_dim", "qk_rope_head_dim"},
                                        {"model.mla.v_head_dim", "v_head_dim"},
                                        {"model.mtp_layers", "num_nextn_predict_layers"},
                                        {"model.mtp_loss_weight", "mtp_loss_weight"}};
  return v;
}

// DeepSeek's config.json: the router's method as DeepseekV3Config / DeepseekV2Config name it, the experts in every
// layer after the dense ones (num_nextn_predict_layers and meshtrain's mtp_loss_weight come from kDeepseek).
json deepseek_to_hf(const ModelFamily& f, const ModelConfig& m) {
  json j = common_to_hf(f, m);
  j["attention_bias"] = false;
  j["moe_layer_freq"] = 1;
  j.erase("rope_parameters");  // DeepSeek's files: transformers 4's spelling
  if (m.type == "deepseek_v3") {
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["rope_interleave"] = m.mla.rope_interleave;
  } else {
    j["scoring_func"] = "softmax";
    j["topk_method"] = m.moe.n_group > 1 ? "group_limited_greedy" : "greedy";
  }
  return j;
}

ModelConfig deepseek_from_hf(const ModelFamily& f, const json& j, const std::string& file) {
  HfReader r{f, j, file};
  const bool v3 = f.type == "deepseek_v3";
  refuse_attention_bias(r, v3 ? "DeepSeek-V3" : "DeepSeek-V2");
  if (r.has("moe_layer_freq") && j["moe_layer_freq"] != json(1))
    r.unsupported("moe_layer_freq", j["moe_layer_freq"], "meshtrain puts the experts in every layer after the "
                  "dense ones (1 only)");
  if (r.has("num_nextn_predict_layers") && j["num_nextn_predict_layers"] != json(0) &&
      !(v3 && j["num_nextn_predict_layers"] == json(1)))
    r.unsupported("num_nextn_predict_layers", j["num_nextn_predict_layers"],
                  v3 ? "one multi-token prediction depth is implemented (0 or 1)"
                     : "DeepSeek-V2 has no multi-token prediction (0 only)");
  const std::string scoring = j.value("scoring_func", std::string(v3 ? "sigmoid" : "softmax"));
  if (scoring != (v3 ? "sigmoid" : "softmax"))
    r.unsupported("scoring_func", j["scoring_func"], v3 ? "DeepSeek-V3 scores by sigmoid" : "DeepSeek-V2 by softmax");
  const std::string method = j.value("topk_method", std::string(v3 ? "noaux_tc" : "greedy"));
  if (v3 ? method != "noaux_tc" : method != "greedy" && method != "group_limited_greedy")
    r.unsupported("topk_method", j["topk_method"],
                  v3 ? "DeepSeek-V3's router is \"noaux_tc\"" : "\"greedy\" or \"group_limited_greedy\"");
  if (r.boolean("model.moe.output_router_logits", false))
    r.unsupported("output_router_logits", j["output_router_logits"],
                  "DeepSeek's auxiliary losses are not implemented (the aux-loss-free bias is: model.moe.bias_update_rate)");
  // The RoPE width first: head_dim repeats it in DeepSeek-V3's files, and the error names the latent attention's key.
  if (r.has("model.mla.qk_rope_head_dim") && r.at("model.mla.qk_rope_head_dim").is_number_integer() &&
      r.at("model.mla.qk_rope_head_dim").get<int64_t>() % 2 != 0)
    r.unsupported("model.mla.qk_rope_head_dim", r.at("model.mla.qk_rope_head_dim"), "RoPE needs an even width");
  ModelConfig c = common_from_hf(r);
  c.type = f.type;
  MlaConfig& a = c.mla;
  a.kv_lora_rank = r.integer("model.mla.kv_lora_rank", 512);
  a.q_lora_rank = r.has("model.mla.q_lora_rank") ? r.integer("model.mla.q_lora_rank", std::nullopt) : 0;
  a.qk_nope_head_dim = r.integer("model.mla.qk_nope_head_dim", 128);
  a.qk_rope_head_dim = r.integer("model.mla.qk_rope_head_dim", 64);
  a.v_head_dim = r.integer("model.mla.v_head_dim", 128);
  a.rope_interleave = r.boolean("rope_interleave", true);
  if (a.qk_rope_head_dim % 2 != 0)
    r.unsupported("model.mla.qk_rope_head_dim", r.at("model.mla.qk_rope_head_dim"), "RoPE needs an even width");
  // head_dim is the RoPE width (DeepseekV3Config writes qk_rope_head_dim there); the heads' keys and values are
  // the model's own.
  c.head_dim = a.qk_rope_head_dim;
  c.n_kv_heads = c.n_heads;
  MoeConfig& e = c.moe;
  e.n_experts = r.integer("model.moe.n_experts", v3 ? 256 : 160);
  e.ffn_dim = r.integer("model.moe.ffn_dim", v3 ? 2048 : 1536);
  e.experts_per_token = r.integer("model.moe.experts_per_token", v3 ? 8 : 6);
  e.norm_topk_prob = r.boolean("model.moe.norm_topk_prob", v3);
  e.router_score = v3 ? "sigmoid" : "softmax";
  e.routed_scaling_factor = r.has("model.moe.routed_scaling_factor")
                                ? r.number(r.at("model.moe.routed_scaling_factor"), "model.moe.routed_scaling_factor")
                                : (v3 ? 2.5 : 1.0);
  e.n_group = r.integer("model.moe.n_group", v3 ? 8 : 1);
  e.topk_group = r.integer("model.moe.topk_group", v3 ? 4 : 1);
  if (!v3 && method == "greedy") e.n_group = e.topk_group = 1;  // V2's plain top-k ignores the groups
  const std::string shared = r.name("model.moe.shared_expert_ffn_dim");
  if (r.has(shared)) {
    MT_CHECK(j[shared].is_number_integer() && j[shared].get<int64_t>() >= 0, "checkpoint",
             "{}: {} = {}: expected an integer >= 0", file, shared, j[shared].dump());
    e.shared_expert_ffn_dim = j[shared].get<int64_t>() * e.ffn_dim;
  } else {
    e.shared_expert_ffn_dim = e.ffn_dim * (v3 ? 1 : 2);
  }
  const std::string dense = r.name("model.moe.mlp_only_layers");
  int64_t first_dense = v3 ? 3 : 0;
  if (r.has(dense)) {
    MT_CHECK(j[dense].is_number_integer() && j[dense].get<int64_t>() >= 0 && j[dense].get<int64_t>() <= c.n_layers,
             "checkpoint", "{}: {} = {}: expected 0 ... {} = {}", file, dense, j[dense].dump(),
             r.name("model.n_layers"), c.n_layers);
    first_dense = j[dense].get<int64_t>();
  }
  for (int64_t i = 0; i < std::min(first_dense, c.n_layers); ++i) e.mlp_only_layers.push_back(int(i));
  e.router_aux_loss_coef = 0;
  c.mtp_layers = r.has("num_nextn_predict_layers") ? j["num_nextn_predict_layers"].get<int64_t>() : 0;
  if (r.has("mtp_loss_weight")) {  // meshtrain's own key (DeepSeek's files do not say the weight they trained with)
    MT_CHECK(j["mtp_loss_weight"].is_number() && j["mtp_loss_weight"].get<double>() >= 0, "checkpoint",
             "{}: mtp_loss_weight = {}: expected a number >= 0", file, j["mtp_loss_weight"].dump());
    c.mtp_loss_weight = j["mtp_loss_weight"].get<double>();
  }
  return c;
}

}  // namespace mt::llama_hf
