// The Llama architecture (Hugging Face's LlamaForCausalLM semantics and names):
//   model.embed_tokens -> model.layers.{i} (pre-norm attention and SwiGLU MLP
//   blocks with residuals) -> model.norm -> lm_head.
// The llama, mistral, qwen2, qwen3 and the mixture-of-experts families mixtral, qwen2_moe and qwen3_moe
// (models/llama/families.cpp) are this code with a LlamaVariant; an MoE family's sparse layers have a
// SparseMoeBlock (models/llama/moe.h) where the others have LlamaMLP.
#pragma once
#include <memory>

#include "attention/attention.h"
#include "models/layers.h"
#include "models/llama/moe.h"
#include "models/model.h"

namespace mt {

// What every attention layer needs to know of the tokens of the current forward, shared by them all:
// their global positions (RoPE) and where the documents of the whole sequences start (packed documents).
// How attention is split over ranks is not here: apply_cp swaps each layer's `attention`.
struct SequenceContext {
  double theta = 10000;
  double local_theta = 0;          // > 0: the sliding layers' RoPE base, plain RoPE (Gemma 3: cos_local, sin_local)
  RopeScalingConfig rope_scaling;  // type "none": plain RoPE
  int64_t seq_len = 0;        // the run's sequence (training.seq_len, set by parallelize): longrope's factors
  int64_t max_positions = 0;  // model.max_seq_len: longrope's attention factor
  Tensor positions;  // (T_local) i64, host: global positions of this rank's tokens
  Tensor cos, sin;   // (T_local, hd) RoPE tables for them
  Tensor cos_local, sin_local;  // (T_local, hd) the sliding layers' (local_theta > 0), else undefined
  // (B, T) i64, host: where each token of the whole sequences starts its document; undefined: one causal
  // sequence. batch counts its changes (the attention implementations cache their shard of it).
  Tensor doc_start;
  uint64_t batch = 0;
  void set_positions(const Tensor& positions, int64_t head_dim, DType dtype, Device device);
  void set_documents(const Tensor& doc_start);
  AttentionCall attention_call() const;
};

// What a family changes in the Llama architecture.
struct LlamaVariant {
  bool qkv_bias = false;  // Qwen2: q_proj, k_proj and v_proj have biases
  bool qk_norm = false;   // Qwen3: an RMSNorm over each head of q and k (q_norm, k_norm) before RoPE
  // Gemma 2 and 3: norms scale by 1 + w, the embedding's output by sqrt(dim), GeGLU (tanh GELU) MLPs, a norm after
  // attention and around the MLP (pre_/post_feedforward_layernorm), the final logits soft-capped.
  bool gemma = false;
  std::string moe_block = "mlp";  // the sparse block's name in a layer (Mixtral: "block_sparse_moe")
  MoeNames moe_names{"gate_proj", "up_proj", "down_proj"};  // an expert's projections (Mixtral: w1, w3, w2)
};

class LlamaAttention : public Module {
 public:
  LlamaAttention(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
                 std::shared_ptr<SequenceContext> seq, int64_t index = 0);
  Linear *q_proj, *k_proj, *v_proj, *o_proj;  // latent attention: q_proj null when q_lora_rank > 0, k_, v_proj null
  RMSNorm *q_norm = nullptr, *k_norm = nullptr;  // (hd) each: Qwen3
  // DeepSeek's multi-head latent attention (model.mla, models/llama/mla.cpp): the latent projections and norms.
  Linear *q_a_proj = nullptr, *q_b_proj = nullptr, *kv_a_proj_with_mqa = nullptr, *kv_b_proj = nullptr;
  RMSNorm *q_a_layernorm = nullptr, *kv_a_layernorm = nullptr;
  MlaConfig mla;     // kv_lora_rank 0: not latent attention
  int64_t head_dim;  // the attention's head width (latent attention: qk_nope_head_dim + qk_rope_head_dim)
  bool sliding = false;  // Gemma: a sliding-window layer (window, and the local RoPE tables when there are)
  int64_t window = 0;    // keys at positions > p - window; 0: the whole causal prefix
  double scale = 0;      // of q . k (0: 1/sqrt(hd)); Gemma: query_pre_attn_scalar^-1/2
  double softcap = 0;    // attention-logit soft-capping; 0: none
  // The attention boundary (attention/attention.h): local by default, swapped by apply_cp.
  std::shared_ptr<const Attention> attention = make_attention();
  // Selective recompute (parallel.recompute.keep: [attention]): in a recomputed subtree this layer keeps the
  // attention's output and log-sum-exp when the rest is dropped, and its forward run again inside backward
  // recomputes q, k, v (projections and RoPE) but reuses them instead of running attention (and, with cp, its
  // communication) again.
  bool keep_attention_output = false;

 protected:
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override;

 private:
  AttentionCall attention_call() const;  // the batch's, with this layer's scale, window and soft-cap
  Tensor mla_forward(const Tensor& x);   // models/llama/mla.cpp
  Tensor mla_backward(const Tensor& dy);
  bool local_rope() const { return sliding && seq_->cos_local.defined(); }
  std::shared_ptr<SequenceContext> seq_;
  // Per micro-batch (module.h):
  Saved<AttentionSaved> saved_;  // what the attention's backward needs, in its layout
  Saved<Tensor> out_;            // (B, T, H, hd): the attention's output, o_proj's input
  Saved<int64_t> kv_heads_;      // KV of the last forward (this rank's)
};

class LlamaMLP : public Module {
 public:
  LlamaMLP(const std::string& name, const ModelConfig& c, const ParamFactory& f, bool gelu = false);
  Linear *gate_proj, *up_proj, *down_proj;
  bool gelu;  // GeGLU with the tanh GELU (Gemma) instead of SwiGLU

 protected:
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override {
    gate_ = Tensor();
    up_ = Tensor();
  }

 private:
  Saved<Tensor> gate_, up_;  // (B, T, F), per micro-batch
};

class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
                    std::shared_ptr<SequenceContext> seq, std::shared_ptr<MoeContext> moe = nullptr,
                    int64_t index = 0);
  RMSNorm* input_layernorm;
  LlamaAttention* self_attn;
  RMSNorm* post_attention_layernorm;              // Llama: before the MLP; Gemma: on the attention's output
  RMSNorm* pre_feedforward_layernorm = nullptr;   // Gemma: before the MLP
  RMSNorm* post_feedforward_layernorm = nullptr;  // Gemma: on the MLP's output
  Module* mlp;                          // LlamaMLP, or the sparse block of an MoE layer
  SparseMoeBlock* moe_block = nullptr;  // the sparse block, or null

 protected:
  // h = x + attn(norm(x)); y = h + mlp(norm(h)). Gemma: h = x + norm(attn(norm(x))); y = h + norm(mlp(norm(h))).
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
};

// DeepSeek-V3's multi-token prediction module ("model.layers.{L}", DeepSeek's names; models/llama/mtp.cpp): a decoder
// layer of index L = n_layers with, before it, x = eh_proj([enorm(e), hnorm(h)]) of the next token's embedding e and
// the model's final normed hidden state h, and after it shared_head.norm. The embedding and the lm_head are the
// model's own modules, run once on both the main rows and these (LlamaModel's forward).
class MtpLayer : public LlamaDecoderLayer {
 public:
  MtpLayer(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
           std::shared_ptr<SequenceContext> seq, std::shared_ptr<MoeContext> moe, int64_t index);
  RMSNorm *enorm, *hnorm, *shared_head_norm;
  Linear* eh_proj;  // (C, 2C)

 protected:
  Tensor forward(const Tensor& eh) override;  // (B, T, 2C) [e, h] -> (B, T, C) shared_head.norm's output
  Tensor backward(const Tensor& dy) override;  // -> (B, T, 2C) [de, dh]
};

// "model": embeddings, layers, final norm (and the multi-token prediction module).
class LlamaModel : public Module {
 public:
  LlamaModel(const std::string& name, const ModelConfig& c, const LlamaVariant& v, const ParamFactory& f,
             std::shared_ptr<SequenceContext> seq, std::shared_ptr<MoeContext> moe);
  // Under pipeline parallel a stage holds some of them (the others null).
  Embedding* embed_tokens;
  std::vector<LlamaDecoderLayer*> layers;  // by global index
  RMSNorm* norm;
  MtpLayer* mtp = nullptr;  // model.mtp_layers 1
  // The next forward's multi-token prediction input tokens (B, T) i32 (the next tokens), or undefined: without it
  // the model's output is the normed hidden state (B, T, C); with it that and, below, the MTP rows: (2B, T, C).
  Tensor mtp_tokens;
  friend class LlamaForCausalLM;

 protected:
  Tensor forward(const Tensor& tokens) override;  // (B, T) i32 -> (B, T, C), with MTP (2B, T, C)
  Tensor backward(const Tensor& dy) override;

 private:
  Saved<int64_t> mtp_rows_;  // B of a forward with MTP rows, else 0
};

// The root (name ""): LlamaModel "model" and "lm_head". forward gives logits (B, T, V).
class LlamaForCausalLM : public CausalLM {
 public:
  LlamaForCausalLM(const ModelConfig& c, const ParamFactory& f, const LlamaVariant& v = {});
  LlamaVariant variant;
  LlamaModel* model;
  Linear* lm_head;  // null on a pipeline stage other than the last
  DType dtype;      // the compute dtype and device (ParamFactory's)
  Device device;
  std::shared_ptr<SequenceContext> seq;
  std::shared_ptr<MoeContext> moe;  // null: a dense model
  double final_softcap = 0;         // Gemma 2: logits z -> cap tanh(z / cap); 0: none
  void set_positions(const Tensor& positions) override;
  void set_loss_scale(double inv_tokens) override {
    if (moe) moe->loss_scale = inv_tokens;
    loss_scale_ = inv_tokens;
  }
  void set_mtp_batch(const Tensor& inputs, const Tensor& targets) override;
  bool wants_mtp() const override { return config.mtp_layers > 0; }  // on every pipeline stage
  std::vector<Tensor> take_extra_losses() override;
  std::map<std::string, std::string> file_copies() const override;
  Group* vocab_group = nullptr;  // tp under loss parallel: the MTP rows' vocab-parallel cross-entropy
  void forward_done() override {
    if (moe) moe->forward_done();
  }
  int64_t router_stats_numel() const override { return moe ? moe->stats_numel() : 0; }
  Tensor router_stats_forward(const Tensor& in, bool last) override {
    return moe ? moe->chunk_flow(in, last) : Tensor();
  }
  Tensor router_stats_backward(const Tensor& in) override { return moe ? moe->chunk_total(in) : Tensor(); }
  Tensor pending_router_stats() override { return moe ? moe->pending_stats() : Tensor(); }
  RouterStepStats take_router_stats(const std::vector<double>* values = nullptr) override {
    if (!moe) return RouterStepStats{};
    RouterStepStats r = moe->take_step_stats(values);
    if (moe->bounded()) r.dropless_bound = moe->bound;
    return r;
  }
  bool redo_overflowed_step(int64_t step, const RouterStepStats& r) override {
    if (!moe || !moe->bounded()) return false;
    if (r.dropped <= 0) {
      moe->settle_bound(step + 1);
      return false;
    }
    moe->raise_bound(step + 1);
    return true;
  }
  void after_step() override {
    if (moe) moe->update_biases();
  }
  nlohmann::json extra_state() const override;  // {"router_bias": (sparse layers, E)} with bias_update_rate
  void load_extra_state(const nlohmann::json& state, const std::string& file) override;
  void set_attention(std::shared_ptr<const Attention> a) override;
  const std::shared_ptr<const Attention>& attention() const override {
    for (LlamaDecoderLayer* l : model->layers)
      if (l) return l->self_attn->attention;
    MT_CHECK(false, "model", "no decoder layer on this rank");
    return model->layers.at(0)->self_attn->attention;
  }
  Tensor positions() const override { return seq->positions; }
  void set_documents(const Tensor& doc_start) override { seq->set_documents(doc_start); }
  Tensor documents() const override { return seq->doc_start; }
  Parameter& embedding_weight() override;
  Parameter& output_weight() override;
  void keep_chunks(const std::vector<ModelChunk>& chunks) override;
  Tensor chunk_forward(size_t k, const Tensor& x) override;
  Tensor chunk_backward(size_t k, const Tensor& dy) override;
  ActivationBytes activation_bytes(const RankShape& s) const override;  // models/llama/cost.cpp
  StageFlops stage_flops(const RankShape& s) const override;

 protected:
  Tensor forward(const Tensor& tokens) override;
  Tensor backward(const Tensor& dlogits) override;

 private:
  Tensor soft_cap(const Tensor& logits);  // final_softcap on the logits (B, T, V) in place (none: as they are)
  Tensor soft_cap_backward(const Tensor& dlogits);
  Saved<Tensor> capped_;  // (B, T, V) the soft-capped logits (the loss overwrites its own)
  // Multi-token prediction: the targets of the next forward's MTP rows, the whole logits (2B, T, V) whose second
  // half holds the MTP loss's gradient after forward, and the weighted token losses not yet taken.
  double loss_scale_ = 0;
  Tensor mtp_targets_;
  Saved<Tensor> mtp_logits_;
  Saved<int64_t> chunk_mtp_rows_;  // pipeline parallel: B of a chunk's forward with MTP rows, else 0
  std::vector<Tensor> extra_losses_;
  Tensor mtp_loss(const Tensor& logits);  // (2B, T, V') -> the main rows (B, T, V'); the MTP rows' loss taken
};

// The model's counts (models/llama/cost.cpp).
// 6*N + 12*L*d*T FLOPs per token (N = active parameters without embeddings): the
// forward and backward GEMMs, and QK^T and PV at full (not causal-halved) cost. Latent attention (model.mla):
// QK^T at qk_nope_head_dim + qk_rope_head_dim and PV at v_head_dim per head, the model's FLOPs (the padded values'
// extra work, which runs, is llama_attention_flops_per_key's `executed` count, not the model's).
double llama_flops_per_token(const ModelConfig& c, int64_t seq_len, const LlamaVariant& v = {});
// QK^T's and PV's forward and backward FLOPs per token and key of every layer: 6 H (d_qk + d_v). `executed`: what
// the kernels run, latent attention's values zero-padded to d_qk (models/llama/mla.cpp); else the model's d_v.
double llama_attention_flops_per_key(const ModelConfig& c, bool executed);
// The keys per query layer `layer`'s attention FLOPs count: seq_len (the PaLM count: not causal-halved), or for a
// sliding-window layer (Gemma) seq_len times its causal pairs' share of a causal layer's.
double llama_attention_keys(const ModelConfig& c, int64_t seq_len, int64_t layer);
int64_t llama_num_params(const ModelConfig& c, bool with_embeddings = true, const LlamaVariant& v = {});
// What one token runs through: an MoE layer's k experts instead of all (the dense count for a dense model).
int64_t llama_active_params(const ModelConfig& c, bool with_embeddings = true, const LlamaVariant& v = {});
// One layer's MLP: dense, or the sparse block's (router, experts: all or, `active`, the k a token runs; the shared
// expert, its gate where the variant has one, DeepSeek-V3's selection bias).
int64_t llama_mlp_params(const ModelConfig& c, int64_t layer, bool active, const LlamaVariant& v = {});
// One layer's attention parameters (`all`), and of them those every tp rank holds whole and runs on the whole
// sequence (`tp_replicated`: latent attention's q_a_proj, kv_a_proj_with_mqa and their norms; 0 otherwise).
struct LlamaAttentionParams {
  int64_t all = 0, tp_replicated = 0;
};
LlamaAttentionParams llama_attention_params(const ModelConfig& c, const LlamaVariant& v = {});

}  // namespace mt
