// Decoder layers, the model trunk and the causal-LM head.
#include "models/llama/llama.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>

#include "parallel/loss_parallel.h"
#include "runtime/kernels/ops.h"

namespace mt {

LlamaDecoderLayer::LlamaDecoderLayer(const std::string& name, const ModelConfig& c, const LlamaVariant& v,
                                     const ParamFactory& f, std::shared_ptr<SequenceContext> seq,
                                     std::shared_ptr<MoeContext> moe, int64_t index)
    : Module(name, "LlamaDecoderLayer") {
  const bool g = v.gemma;
  auto norm = [&](const char* n) {
    return add_child(std::make_unique<RMSNorm>(child_name(name, n), c.dim, c.norm_eps, f, g));
  };
  input_layernorm = norm("input_layernorm");
  self_attn =
      add_child(std::make_unique<LlamaAttention>(child_name(name, "self_attn"), c, v, f, std::move(seq), index));
  post_attention_layernorm = norm("post_attention_layernorm");
  if (g) {
    pre_feedforward_layernorm = norm("pre_feedforward_layernorm");
    post_feedforward_layernorm = norm("post_feedforward_layernorm");
  }
  if (c.moe.sparse_layer(index)) {
    int64_t sparse_index = 0;  // among the model's sparse layers
    for (int64_t i = 0; i < index; ++i) sparse_index += c.moe.sparse_layer(i);
    moe_block = add_child(
        std::make_unique<SparseMoeBlock>(child_name(name, v.moe_block), c, v.moe_names, sparse_index, f, moe));
    mlp = moe_block;
  } else {
    mlp = add_child(std::make_unique<LlamaMLP>(child_name(name, "mlp"), c, f, g));
  }
}

Tensor LlamaDecoderLayer::forward(const Tensor& x) {
  if (pre_feedforward_layernorm) {  // Gemma: each branch's output normed before its residual add
    Tensor attn = post_attention_layernorm->call(self_attn->call(input_layernorm->call(x)));  // (B, T, C)
    auto [h, h_normed] = pre_feedforward_layernorm->call_add(attn, x);  // h = x + attn, in attn's storage
    Tensor y = post_feedforward_layernorm->call(mlp->call(h_normed));   // (B, T, C)
    add_(y, h);
    return y;
  }
  Tensor attn = self_attn->call(input_layernorm->call(x));           // (B, T, C) the attention branch
  auto [h, h_normed] = post_attention_layernorm->call_add(attn, x);  // h = x + attn, in attn's storage
  Tensor y = mlp->call(h_normed);                                    // (B, T, C)
  add_(y, h);
  return y;
}

Tensor LlamaDecoderLayer::backward(const Tensor& dy) {
  if (pre_feedforward_layernorm) {
    Tensor dm = mlp->call_backward(post_feedforward_layernorm->call_backward(dy));
    Tensor dh = pre_feedforward_layernorm->call_backward_add(dm, dy);
    return input_layernorm->call_backward_add(self_attn->call_backward(post_attention_layernorm->call_backward(dh)),
                                              dh);
  }
  // dh = dy + d(mlp branch); dx = dh + d(attention branch): each residual add fused into a norm's backward.
  Tensor dh = post_attention_layernorm->call_backward_add(mlp->call_backward(dy), dy);
  return input_layernorm->call_backward_add(self_attn->call_backward(dh), dh);
}

LlamaModel::LlamaModel(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
                       std::shared_ptr<SequenceContext> seq, std::shared_ptr<MoeContext> moe)
    : Module(name, "LlamaModel") {
  embed_tokens = add_child(std::make_unique<Embedding>(child_name(name, "embed_tokens"), c.vocab_size, c.dim, f));
  if (v.gemma) embed_tokens->scale = std::sqrt(double(c.dim));  // Gemma's normalizer
  for (int64_t i = 0; i < c.n_layers; ++i)
    layers.push_back(
        add_child(std::make_unique<LlamaDecoderLayer>(child_name(name, "layers." + std::to_string(i)), c, v, f, seq, moe, i)));
  norm = add_child(std::make_unique<RMSNorm>(child_name(name, "norm"), c.dim, c.norm_eps, f, v.gemma));
  if (c.mtp_layers > 0)
    mtp = add_child(std::make_unique<MtpLayer>(child_name(name, "layers." + std::to_string(c.n_layers)), c, v, f, seq,
                                               moe, c.n_layers));
}

namespace {
// Rows [begin, begin + n) of dim 0 of t, copied: (n, ...).
Tensor rows_of(const Tensor& t, int64_t begin, int64_t n) {
  Shape s = t.shape();
  s[0] = n;
  Tensor out = empty(s, t.dtype(), t.device());
  copy_slice(out, 0, t, begin, n, 0);
  return out;
}
// a and b stacked along dim 0 (their other dims equal).
Tensor stack_rows(const Tensor& a, const Tensor& b) {
  Shape s = a.shape();
  s[0] = a.size(0) + b.size(0);
  Tensor out = empty(s, a.dtype(), a.device());
  copy_slice(out, 0, a, 0, a.size(0), 0);
  copy_slice(out, a.size(0), b, 0, b.size(0), 0);
  return out;
}
}  // namespace

// With multi-token prediction the embedding runs once on the tokens and the next tokens (2B rows), the decoder
// layers on the first B, the MTP module on [its embeddings, the final normed hidden state], and the model's output
// stacks the final normed hidden state and the MTP module's (2B rows: lm_head runs once on both).
Tensor LlamaModel::forward(const Tensor& tokens) {
  if (!recomputing()) mtp_rows_ = mtp && mtp_tokens.defined() ? tokens.size(0) : 0;
  const int64_t B = mtp_rows_;
  if (B == 0) {
    Tensor h = embed_tokens->call(tokens);  // (B, T, C)
    for (auto* layer : layers) h = layer->call(h);
    return norm->call(h);
  }
  Tensor e = embed_tokens->call(stack_rows(tokens, mtp_tokens));  // (2B, T, C)
  Tensor h = rows_of(e, 0, B), e_next = rows_of(e, B, B);          // (B, T, C) each
  for (auto* layer : layers) h = layer->call(h);
  h = norm->call(h);
  const int64_t C = h.size(2);
  Tensor eh = empty({B, h.size(1), 2 * C}, h.dtype(), h.device());  // (B, T, 2C) [e, h]
  copy_slice(eh, 0, e_next, 0, C, 2);
  copy_slice(eh, C, h, 0, C, 2);
  return stack_rows(h, mtp->call(eh));  // (2B, T, C)
}

Tensor LlamaModel::backward(const Tensor& dy) {
  const int64_t B = mtp_rows_;
  if (B == 0) {
    Tensor dh = norm->call_backward(dy);
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) dh = (*it)->call_backward(dh);
    embed_tokens->call_backward(dh);
    return Tensor();
  }
  // dy (2B, T, C): the main rows' gradient, then the MTP module's; the final hidden state gets both.
  Tensor dh = rows_of(dy, 0, B), deh = mtp->call_backward(rows_of(dy, B, B));  // (B, T, C), (B, T, 2C)
  const int64_t C = dh.size(2);
  Tensor de = empty(dh.shape(), dh.dtype(), dh.device()), dh_mtp = empty(dh.shape(), dh.dtype(), dh.device());
  copy_slice(de, 0, deh, 0, C, 2);
  copy_slice(dh_mtp, 0, deh, C, C, 2);
  add_(dh, dh_mtp);
  dh = norm->call_backward(dh);
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) dh = (*it)->call_backward(dh);
  embed_tokens->call_backward(stack_rows(dh, de));
  mtp_rows_ = 0;
  return Tensor();
}

LlamaForCausalLM::LlamaForCausalLM(const ModelConfig& c, const ParamFactory& f, const LlamaVariant& v)
    : CausalLM("LlamaForCausalLM", c), variant(v), dtype(f.dtype), device(f.device),
      seq(std::make_shared<SequenceContext>()) {
  seq->theta = c.rope_theta;
  if (v.gemma && c.rope_local_theta > 0) seq->local_theta = c.rope_local_theta;
  if (v.gemma) final_softcap = c.final_softcap;
  seq->rope_scaling = c.rope_scaling;
  seq->max_positions = c.max_seq_len;
  if (c.moe.enabled()) {
    int64_t sparse = 0;  // the multi-token prediction module's layer counts as the layer after the last
    for (int64_t i = 0; i < c.n_layers + c.mtp_layers; ++i) sparse += c.moe.sparse_layer(i);
    moe = std::make_shared<MoeContext>(c.moe, sparse, accum_dtype(f.dtype), f.device);
    if (c.moe.bias_update_rate > 0)  // the selection bias of each sparse layer, zero at the start
      for (int64_t l = 0; l < sparse; ++l) moe->add_bias(c.moe.n_experts);
  }
  model = add_child(std::make_unique<LlamaModel>("model", c, v, f, seq, moe));
  lm_head = add_child(std::make_unique<Linear>("lm_head", c.dim, c.vocab_size, f,
                                               c.tie_embeddings ? model->embed_tokens->weight : nullptr));
  lm_head->fp8_exempt = true;  // training.fp8: the logits' GEMM stays bf16 (torchao's convention, docs/design/fp8.md)
}

nlohmann::json LlamaForCausalLM::extra_state() const {
  if (!moe) return nullptr;
  nlohmann::json s = nlohmann::json::object();
  if (!moe->biases.empty()) {
    nlohmann::json b = nlohmann::json::array();
    for (const std::vector<double>& v : moe->bias_values) b.push_back(v);  // the host copy: the same values
    s["router_bias"] = b;
  }
  // Bounded dropless ep's factor now, so that a resumed run does not climb to it again through recomputed steps.
  if (moe->bounded()) s["dropless_bound"] = moe->bound, s["dropless_bound_clean_steps"] = moe->clean_steps;
  return s.empty() ? nlohmann::json(nullptr) : s;
}

void LlamaForCausalLM::load_extra_state(const nlohmann::json& state, const std::string& file) {
  if (moe && moe->bounded() && state.is_object() && state.contains("dropless_bound")) {
    const auto& f = state["dropless_bound"];
    MT_CHECK(f.is_number() && std::isfinite(f.get<double>()) && f.get<double>() > 0, "checkpoint",
             "{}: model_state.dropless_bound must be a positive number", file);
    // Within this run's range: not below its model.moe.dropless_bound, not above E / K (cap = N).
    const double most = double(config.moe.n_experts) / double(config.moe.experts_per_token);
    moe->bound = std::clamp(f.get<double>(), config.moe.dropless_bound, std::max(most, config.moe.dropless_bound));
    moe->clean_steps = state.value("dropless_bound_clean_steps", int64_t(0));
  }
  if (!moe || moe->biases.empty()) return;  // nothing to restore (a bias saved without the rate on is dropped)
  if (state.is_null() || !state.contains("router_bias")) {
    spdlog::warn("{}: no router_bias saved: model.moe.bias_update_rate's selection bias starts again from 0", file);
    return;
  }
  const auto& b = state["router_bias"];
  MT_CHECK(b.is_array() && b.size() == moe->biases.size(), "checkpoint",
           "{}: model_state.router_bias holds {} layers, the model has {} sparse layers", file, b.size(),
           moe->biases.size());
  for (size_t l = 0; l < b.size(); ++l) {
    MT_CHECK(b[l].is_array() && int64_t(b[l].size()) == config.moe.n_experts, "checkpoint",
             "{}: model_state.router_bias[{}] does not hold model.moe.n_experts = {} numbers", file, l,
             config.moe.n_experts);
    moe->set_bias(l, b[l].get<std::vector<double>>());
  }
}

void LlamaForCausalLM::set_positions(const Tensor& positions) {
  seq->set_positions(positions, config.head_size(), dtype, device);
}

Parameter& LlamaForCausalLM::embedding_weight() {
  MT_CHECK(model->embed_tokens, "model", "the token embedding is on pipeline stage 0, not on this rank's stages");
  return *model->embed_tokens->weight;
}

Parameter& LlamaForCausalLM::output_weight() {
  MT_CHECK(lm_head, "model", "lm_head is on the last pipeline stage, not on this rank's stages");
  return *lm_head->weight;
}

void LlamaForCausalLM::keep_chunks(const std::vector<ModelChunk>& chunks) {
  MT_CHECK(chunks_.empty(), "model", "keep_chunks: the model was already split into pipeline stages");
  MT_CHECK(!config.tie_embeddings, "config",
           "model.tie_embeddings = true with parallel.pp > 1: the embedding (stage 0) and lm_head (the last stage) "
           "would share one weight across stages; untie them or run without pipeline parallel");
  std::vector<bool> keep(model->layers.size(), false);
  bool first = false, last = false;
  for (const ModelChunk& c : chunks) {
    MT_CHECK(c.layer_begin >= 0 && c.layer_begin <= c.layer_end && c.layer_end <= int64_t(keep.size()), "model",
             "stage {}: layers [{}, {}) out of the model's {}", c.stage, c.layer_begin, c.layer_end, keep.size());
    for (int64_t i = c.layer_begin; i < c.layer_end; ++i) keep[size_t(i)] = true;
    first |= c.first, last |= c.last;
  }
  // The modules no chunk runs, in the model's order (the names of what they hold are kept in that order).
  std::vector<Module*> dropped;
  if (!first) dropped.push_back(model->embed_tokens);
  for (size_t i = 0; i < keep.size(); ++i)
    if (!keep[i]) dropped.push_back(model->layers[i]);
  if (!last) dropped.push_back(model->norm), dropped.push_back(lm_head);
  if (!last && model->mtp) dropped.push_back(model->mtp);  // the MTP module runs after the last layer
  const std::set<const Module*> drop(dropped.begin(), dropped.end());
  for (Module* m : dropped)
    for (Module* sub : m->modules()) {
      elsewhere_modules_.push_back(sub->name());
      for (Parameter* p : sub->own_parameters()) {
        if (!is_stacked_param(p->name)) {
          elsewhere_.push_back(p->name);
          continue;
        }
        for (int64_t j = 0; j < p->value.shape().at(0); ++j) elsewhere_.push_back(stacked_param_name(p->name, j));
      }
    }
  std::sort(elsewhere_modules_.begin(), elsewhere_modules_.end());  // matches_elsewhere looks names up
  for (size_t i = 0; i < keep.size(); ++i)
    if (!keep[i]) model->layers[i] = nullptr;
  if (!first) model->embed_tokens = nullptr;
  if (!last) model->norm = nullptr;
  if (!last) model->mtp = nullptr;
  const bool drop_head = !last;
  model->remove_children([&](const Module* m) { return drop.count(m) > 0; });
  remove_children([&](const Module* m) { return drop.count(m) > 0; });
  if (drop_head) lm_head = nullptr;
  chunks_ = chunks;
}

// Multi-token prediction under pipeline parallel: stage 0 embeds the tokens and the next tokens (2B rows), every
// stage runs its layers on the first B rows and passes the next tokens' embeddings on beside them (the messages
// hold 2B rows), and the last stage runs the norm, the MTP module on [those embeddings, the normed hidden state]
// and lm_head on both; the gradients travel back the same way.
Tensor LlamaForCausalLM::chunk_forward(size_t k, const Tensor& x) {
  const ModelChunk& c = chunks_.at(k);
  const bool with_mtp = config.mtp_layers > 0 && mtp_targets_.defined() && loss_scale_ > 0;
  if (!recomputing()) chunk_mtp_rows_ = with_mtp ? mtp_targets_.size(0) : 0;
  const int64_t B = chunk_mtp_rows_;
  Tensor h, e_next;  // (B, T, C) each
  if (B == 0) {
    h = c.first ? model->embed_tokens->call(x) : x;
  } else {
    Tensor both = c.first ? model->embed_tokens->call(stack_rows(x, model->mtp_tokens)) : x;  // (2B, T, C)
    h = rows_of(both, 0, B), e_next = rows_of(both, B, B);
  }
  for (int64_t i = c.layer_begin; i < c.layer_end; ++i) h = model->layers[size_t(i)]->call(h);
  if (!c.last) return B == 0 ? h : stack_rows(h, e_next);
  h = model->norm->call(h);
  if (B == 0) {
    model->mtp_tokens = Tensor();
    return soft_cap(lm_head->call(h));  // (B, T, V)
  }
  const int64_t C = h.size(2);
  Tensor eh = empty({B, h.size(1), 2 * C}, h.dtype(), h.device());  // (B, T, 2C) [e, h]
  copy_slice(eh, 0, e_next, 0, C, 2);
  copy_slice(eh, C, h, 0, C, 2);
  return mtp_loss(lm_head->call(stack_rows(h, model->mtp->call(eh))));  // the main rows (B, T, V)
}

Tensor LlamaForCausalLM::chunk_backward(size_t k, const Tensor& dy) {
  const ModelChunk& c = chunks_.at(k);
  const int64_t B = chunk_mtp_rows_;
  Tensor dh, de;  // (B, T, C) each
  if (c.last && B > 0) {
    Tensor all = *mtp_logits_;  // (2B, T, V): dy is its first half
    mtp_logits_ = Tensor();
    Tensor d = lm_head->call_backward(all);  // (2B, T, C)
    dh = rows_of(d, 0, B);
    Tensor deh = model->mtp->call_backward(rows_of(d, B, B));  // (B, T, 2C)
    const int64_t C = dh.size(2);
    Tensor dh_mtp = empty(dh.shape(), dh.dtype(), dh.device());
    de = empty(dh.shape(), dh.dtype(), dh.device());
    copy_slice(de, 0, deh, 0, C, 2);
    copy_slice(dh_mtp, 0, deh, C, C, 2);
    add_(dh, dh_mtp);
    dh = model->norm->call_backward(dh);
  } else if (c.last) {
    dh = model->norm->call_backward(lm_head->call_backward(soft_cap_backward(dy)));
  } else if (B > 0) {
    dh = rows_of(dy, 0, B), de = rows_of(dy, B, B);
  } else {
    dh = dy;
  }
  for (int64_t i = c.layer_end; i-- > c.layer_begin;) dh = model->layers[size_t(i)]->call_backward(dh);
  if (c.first) {
    model->embed_tokens->call_backward(B > 0 ? stack_rows(dh, de) : dh);
    return Tensor();
  }
  return B > 0 ? stack_rows(dh, de) : dh;
}

void LlamaForCausalLM::set_attention(std::shared_ptr<const Attention> a) {
  for (LlamaDecoderLayer* l : model->layers)
    if (l) l->self_attn->attention = a;  // null: another pipeline stage's
  if (model->mtp) model->mtp->self_attn->attention = a;
}

void LlamaForCausalLM::set_mtp_batch(const Tensor& inputs, const Tensor& targets) {
  model->mtp_tokens = inputs;
  mtp_targets_ = targets;
}

std::vector<Tensor> LlamaForCausalLM::take_extra_losses() { return std::exchange(extra_losses_, {}); }

std::map<std::string, std::string> LlamaForCausalLM::file_copies() const {
  if (config.mtp_layers == 0) return {};
  const std::string mtp = "model.layers." + std::to_string(config.n_layers) + ".";
  return {{mtp + "embed_tokens.weight", "model.embed_tokens.weight"},
          {mtp + "shared_head.head.weight", config.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"}};
}

// The MTP rows' cross-entropy against the tokens after next, weighted by model.mtp_loss_weight and the step's
// token scale (the paper's 1/T: the main loss's count), its gradient left in those rows for backward.
Tensor LlamaForCausalLM::mtp_loss(const Tensor& logits) {
  const int64_t B = logits.size(0) / 2, T = logits.size(1), Vl = logits.size(2);
  MT_CHECK(mtp_targets_.defined() && mtp_targets_.size(0) == B && mtp_targets_.size(1) == T, "model",
           "multi-token prediction: targets for {} x {} tokens expected", B, T);
  Tensor z = logits.view(B * T * Vl, {B * T, Vl});  // the MTP rows
  Tensor losses = empty({B * T}, accum_dtype(logits.dtype()), logits.device());  // (B*T)
  const double w = config.mtp_loss_weight * loss_scale_;
  if (Vl == config.vocab_size) {
    cross_entropy_forward_backward(losses, z, z, mtp_targets_.reshape({-1}), w);
  } else {
    MT_CHECK(vocab_group, "model", "multi-token prediction: vocab-sharded logits without their tp group");
    vocab_parallel_cross_entropy(losses, z, z, mtp_targets_.reshape({-1}), lm_head->weight->compute_offset()[0], w,
                                 *vocab_group);
  }
  scale_(losses, config.mtp_loss_weight);
  extra_losses_.push_back(losses);
  mtp_logits_ = logits;
  model->mtp_tokens = Tensor();
  mtp_targets_ = Tensor();
  return logits.view(0, {B, T, Vl});
}

Tensor LlamaForCausalLM::forward(const Tensor& tokens) {
  int64_t T = tokens.size(1);
  // Whole sequences get positions 0 ... T-1 by default; a cp rank's part must have been given its global
  // positions (never reset silently).
  MT_CHECK(!attention()->splits_sequence() || (seq->positions.defined() && seq->positions.numel() == T),
           "model",
           "context parallel: the input holds {} tokens per sequence but positions were set for {}: each cp "
           "rank's tokens need their global positions (set_positions)",
           T, seq->positions.defined() ? seq->positions.numel() : 0);
  if (!seq->positions.defined() || seq->positions.numel() != T) {
    Tensor pos = empty({T}, DType::i64);
    for (int64_t t = 0; t < T; ++t) pos.at<int64_t>(t) = t;
    set_positions(pos);
  }
  const bool with_mtp = model->mtp && model->mtp_tokens.defined() && loss_scale_ > 0;
  if (!with_mtp) model->mtp_tokens = Tensor();  // a forward without backward runs the main rows only
  Tensor logits = lm_head->call(model->call(tokens));  // (B, T, V), with MTP (2B, T, V)
  if (with_mtp) return mtp_loss(logits);
  return soft_cap(logits);
}

Tensor LlamaForCausalLM::backward(const Tensor& dlogits) {
  if (mtp_logits_->defined()) {  // dlogits is the first half of them: both halves hold their gradients now
    Tensor all = *mtp_logits_;
    mtp_logits_ = Tensor();
    return model->call_backward(lm_head->call_backward(all));
  }
  return model->call_backward(lm_head->call_backward(soft_cap_backward(dlogits)));
}

Tensor LlamaForCausalLM::soft_cap(const Tensor& logits) {
  if (final_softcap > 0) {  // (B, T, V), V/tp under loss parallel: element-wise, so any vocab split
    softcap_forward(logits, logits, final_softcap);
    capped_ = logits.clone();  // the loss writes its gradient over the logits it is given
  }
  return logits;
}

Tensor LlamaForCausalLM::soft_cap_backward(const Tensor& dlogits) {
  if (final_softcap > 0) {
    softcap_backward(dlogits, dlogits, capped_, final_softcap);
    capped_ = Tensor();
  }
  return dlogits;
}

}  // namespace mt
