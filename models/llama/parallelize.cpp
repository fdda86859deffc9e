#include "models/llama/parallelize.h"

#include <spdlog/spdlog.h>

#include "parallel/plan_yaml.h"

namespace mt {

namespace {
// Under pipeline parallel a stage holds part of the model: a pattern that matches only another stage's modules is
// left out here; one that matches no module of any stage stays, for the style's own error.
bool here_or_nowhere(LlamaForCausalLM& model, const std::string& pattern) {
  if (model.chunks().empty()) return true;
  for (Module* m : model.modules())
    if (pattern_matches(pattern, m->name())) return true;
  return !model.matches_elsewhere(pattern);
}
}  // namespace

ParallelPlan llama_tp_plan(bool sp, bool loss_parallel) {
  const Placement R = Placement::Replicate(), S1 = Placement::Shard(1), Slast = Placement::Shard(-1);
  const Placement between = sp ? S1 : R;  // the residual stream's layout
  ParallelPlan plan;
  plan.push_back({"model.embed_tokens", RowwiseParallel{R, between}});
  plan.push_back({"lm_head", ColwiseParallel{between, loss_parallel ? Slast : R}});
  if (sp) plan.push_back({"model.norm", SequenceParallel{}});
  if (sp) plan.push_back({"model.layers.*.input_layernorm", SequenceParallel{}});
  if (sp) plan.push_back({"model.layers.*.self_attn", PrepareModuleInput{{S1}, {R}, false}});
  plan.push_back({"model.layers.*.self_attn.q_proj", ColwiseParallel{}});
  plan.push_back({"model.layers.*.self_attn.k_proj", ColwiseParallel{}});
  plan.push_back({"model.layers.*.self_attn.v_proj", ColwiseParallel{}});
  plan.push_back({"model.layers.*.self_attn.o_proj", RowwiseParallel{std::nullopt, between}});
  if (sp) plan.push_back({"model.layers.*.post_attention_layernorm", SequenceParallel{}});
  if (sp) plan.push_back({"model.layers.*.mlp", PrepareModuleInput{{S1}, {R}, false}});
  plan.push_back({"model.layers.*.mlp.gate_proj", ColwiseParallel{}});
  plan.push_back({"model.layers.*.mlp.up_proj", ColwiseParallel{}});
  plan.push_back({"model.layers.*.mlp.down_proj", RowwiseParallel{std::nullopt, between}});
  return plan;
}

std::vector<CommBytes> llama_tp_step_bytes(const ModelConfig& c, const TpStage& s) {
  if (s.tp <= 1) return {};
  const double act = double(s.micro) * double(s.tokens) * double(c.dim) * s.elem;  // one (b, T, d) activation
  const double n = double(s.tp), per_gs = act * (n - 1) / n, per_ar = 2 * act * (n - 1) / n;
  const double logits_gather = s.elem * double(s.micro) * double(s.tokens) * double(c.vocab_size) * (n - 1) / n;
  const bool gather_logits = s.last && !s.loss_parallel;
  const int64_t m = s.micro_batches, L = s.layers, Ls = s.sparse_layers;
  if (s.sequence_parallel) {
    // Per layer the attention's and the dense MLP's input gathered (forward; its gradient reduce-scattered in
    // backward) and their output reduce-scattered (its gradient gathered). A sparse block runs replicated
    // (apply_moe): its input gathered and its output's slice's gradient gathered, nothing reduce-scattered.
    const int64_t each = m * (4 * L + (s.first ? 1 : 0) + (s.last ? 1 : 0)), rs = each - 2 * m * Ls;
    return {{kLayoutTag, dim::tp, "all_gather", double(each) * per_gs + (gather_logits ? double(m) * logits_gather : 0),
             each + (gather_logits ? m : 0), false},
            {kLayoutTag, dim::tp, "reduce_scatter", double(rs) * per_gs, rs, false}};
  }
  // Without sequence parallel: forward o_proj's and down_proj's all-reduce; backward q, k and v_proj's input
  // gradients (latent attention: one, the attention's input, reduced once by its PrepareModuleInput), gate and
  // up_proj's. A sparse block (replicated) reduces nothing.
  const int64_t attn_bwd = c.mla.enabled() ? 1 : 3;
  const int64_t fwd = m * (2 * L - Ls + (s.first ? 1 : 0)), bwd = m * ((attn_bwd + 2) * L - 2 * Ls + (s.last ? 1 : 0));
  std::vector<CommBytes> out{{kLayoutTag, dim::tp, "all_reduce", double(fwd + bwd) * per_ar, fwd + bwd, false}};
  if (gather_logits) out.push_back({kLayoutTag, dim::tp, "all_gather", double(m) * logits_gather, m, false});
  return out;
}

// Latent attention (DeepSeek): the heads split where they appear (q_b_proj or q_proj, kv_b_proj: Colwise; o_proj
// Rowwise); the latent projections and norms before them run replicated on the whole sequence, their gradients
// partial (each rank's heads' share, summed by the gradient sync: apply_tp), and the attention's input gradient,
// the sum of its children's partial ones, reduced once by the attention's PrepareModuleInput.
void mla_tp_plan(ParallelPlan& plan, const LlamaForCausalLM& model, bool sp) {
  const Placement R = Placement::Replicate(), S1 = Placement::Shard(1);
  std::erase_if(plan, [](const PlanEntry& e) { return e.pattern.rfind("model.layers.*.self_attn", 0) == 0; });
  const std::string a = "model.layers.*.self_attn";
  plan.push_back({a, PrepareModuleInput{{sp ? S1 : R}, {R}, false}});
  plan.push_back({a + (model.config.mla.q_lora_rank > 0 ? ".q_b_proj" : ".q_proj"), ColwiseParallel{}});
  plan.push_back({a + ".kv_b_proj", ColwiseParallel{}});
  plan.push_back({a + ".o_proj", RowwiseParallel{std::nullopt, sp ? S1 : R}});
  if (model.config.mla.q_lora_rank > 0) plan.push_back({a + ".q_a_layernorm", SequenceParallel{}});
  plan.push_back({a + ".kv_a_layernorm", SequenceParallel{}});
}

ParallelPlan llama_variant_tp_plan(const LlamaForCausalLM& model, bool sp, bool loss_parallel) {
  ParallelPlan plan = llama_tp_plan(sp, loss_parallel);
  if (model.config.mla.enabled()) mla_tp_plan(plan, model, sp);
  // Qwen3's per-head q/k norms see this rank's heads only: their weights' gradients are partial over tp.
  if (model.variant.qk_norm)
    for (const char* n : {"q_norm", "k_norm"})
      plan.push_back({std::string("model.layers.*.self_attn.") + n, SequenceParallel{}});
  // Gemma's norms around the MLP see the sequence-sharded residual stream, as post_attention_layernorm does.
  if (model.variant.gemma && sp)
    for (const char* n : {"pre_feedforward_layernorm", "post_feedforward_layernorm"})
      plan.push_back({std::string("model.layers.*.") + n, SequenceParallel{}});
  if (!model.moe) return plan;
  // An MoE model: the dense MLP's entries name its dense layers one by one (the sparse blocks are replicated
  // over tp by apply_moe, not split).
  ParallelPlan out;
  for (const PlanEntry& e : plan) {
    const std::string mlp = "model.layers.*.mlp";
    if (e.pattern.rfind(mlp, 0) != 0) {
      out.push_back(e);
      continue;
    }
    for (int64_t i = 0; i < model.config.n_layers; ++i)
      if (!model.config.moe.sparse_layer(i))
        out.push_back({"model.layers." + std::to_string(i) + e.pattern.substr(std::string("model.layers.*").size()),
                       e.style});
  }
  return out;
}

void apply_tp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd, const ParallelConfig& p) {
  if (pd.tp() == 1) return;
  ParallelPlan plan = p.tp_plan.empty() ? llama_variant_tp_plan(model, p.sequence_parallel, p.loss_parallel)
                                        : plan_from_config(p.tp_plan);
  std::erase_if(plan, [&](const PlanEntry& e) { return !here_or_nowhere(model, e.pattern); });
  parallelize(model, mesh, dim::tp, plan);
  if (p.loss_parallel) model.vocab_group = &mesh.group(dim::tp);  // the MTP rows' vocab-parallel loss
  // The multi-token prediction module's own parts around its decoder layer work on the residual stream's layout:
  // under sequence parallel each rank's tokens, so the norms' and eh_proj's gradients are partial over tp.
  if (MtpLayer* m = model.model->mtp; m && p.sequence_parallel && p.tp_plan.empty())
    for (Module* part : std::initializer_list<Module*>{m->enorm, m->hnorm, m->eh_proj, m->shared_head_norm})
      for (Parameter* q : part->own_parameters()) grad_partial_on(*q, mesh.dim_index(dim::tp));
  // Latent attention's replicated projections before the heads split: their gradients are partial over tp.
  std::vector<LlamaDecoderLayer*> with_mtp = model.model->layers;
  if (model.model->mtp) with_mtp.push_back(model.model->mtp);
  if (model.config.mla.enabled() && p.tp_plan.empty())
    for (LlamaDecoderLayer* l : with_mtp)
      if (l)
        for (Linear* lin : {l->self_attn->q_a_proj, l->self_attn->kv_a_proj_with_mqa})
          if (lin)
            for (Parameter* q : lin->own_parameters()) grad_partial_on(*q, mesh.dim_index(dim::tp));
}

void apply_cp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd, int64_t seq_len) {
  if (pd.cp() == 1) return;
  ContextParallel cp;
  if (pd.cp_ring() > 1) cp.ring = &mesh.group(dim::cp_ring);
  if (pd.cp_ulysses() > 1) cp.ulysses = &mesh.group(dim::cp_ulysses);
  cp.method = pd.cp_method;
  cp.load_balance = pd.cp_load_balance;
  cp.seq_len = seq_len;
  model.set_attention(make_attention(cp));
}

namespace {
// An expert's stacked weights hold this rank's experts (Shard(0) over ep): their gradients are summed over the
// data dims but ep, whose ranks hold other experts.
struct ExpertParam : ParamState {
  explicit ExpertParam(int d) : ep_dim(d) {}
  int ep_dim;
  void add_reduced_dims(std::vector<int>& dims) const override { dims.push_back(ep_dim); }
};
}  // namespace

void apply_moe(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd) {
  if (!model.moe) {
    MT_CHECK(pd.ep() == 1, "config", "parallel.ep = {}: model.type = {} has no experts (expert parallel needs an MoE "
             "family: mixtral, qwen2_moe, qwen3_moe)", pd.ep(), model.config.type);
    return;
  }
  MoeContext& ctx = *model.moe;
  if (mesh.group(dim::loss).size() > 1) ctx.tokens = &mesh.group(dim::loss);
  std::vector<SparseMoeBlock*> blocks;
  for (Module* m : model.modules())
    if (auto* b = dynamic_cast<SparseMoeBlock*>(m)) blocks.push_back(b);
  if (pd.ep() > 1) {
    ctx.ep = &mesh.group(dim::ep);
    if (ctx.bounded())
      spdlog::info("moe: dropless expert parallel (parallel.ep = {}, model.moe.capacity_factor = 0) sends each peer "
                   "fixed blocks of f x the mean rows per expert in a training forward (f = model.moe.dropless_bound "
                   "= {:g}), no host sync per sparse layer; a step whose rows overflow them is recomputed with a "
                   "larger f (model.moe.dropless_bound = 0: the exact sizes, read per sparse layer)",
                   pd.ep(), ctx.config.dropless_bound);
    else if (ctx.config.capacity_factor <= 0)
      spdlog::info("moe: dropless expert parallel (parallel.ep = {}, model.moe.capacity_factor = 0) reads each sparse "
                   "layer's row counts on the host once per forward (one host sync per sparse layer and micro-batch); "
                   "a capacity (model.moe.capacity_factor > 0) sends fixed blocks and needs none",
                   pd.ep());
    const int d = mesh.dim_index(dim::ep);
    for (SparseMoeBlock* b : blocks)
      for (Parameter* q : b->experts->own_parameters()) {
        Placements pl = q->value.placements();
        pl[size_t(d)] = Placement::Shard(0);
        relayout_param(*q, pl);
        q->states.push_back(std::make_shared<ExpertParam>(d));
      }
  }
  // Tensor parallel: a sparse block runs whole on every tp rank (its weights replicated), on the whole sequence
  // under sequence parallel: gathered in, its gradient sliced back; the output sliced, its gradient gathered.
  if (pd.tp() > 1 && pd.sequence_parallel) {
    const int t = mesh.dim_index(dim::tp);
    const Placement R = Placement::Replicate(), S1 = Placement::Shard(1);
    for (SparseMoeBlock* b : blocks) {
      prepare_input(*b, mesh, t, S1, R, R);
      prepare_output(*b, mesh, t, R, S1);
    }
  }
}

std::vector<Module*> apply_recompute_llama(LlamaForCausalLM& model, const RecomputeConfig& c) {
  RecomputePolicy policy;
  // The blocks whose parents call them through Module::call (the norms and linears are called through fused
  // variants, and recomputing a single GEMM saves nothing).
  policy.types = {"LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "SparseMoeBlock"};
  policy.keep["attention"] = {[](const Module& m) { return dynamic_cast<const LlamaAttention*>(&m) != nullptr; },
                              [](Module& m) { static_cast<LlamaAttention&>(m).keep_attention_output = true; }};
  std::vector<std::string> patterns = c.patterns;
  std::erase_if(patterns, [&](const std::string& pat) { return !here_or_nowhere(model, pat); });
  if (patterns.empty() && !c.patterns.empty()) return {};  // every pattern is another stage's
  return apply_recompute(model, RecomputeOptions{patterns, c.every, c.keep}, policy);
}

std::unique_ptr<FullyShard> apply_fsdp(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                       const FsdpConfig& c, DType reduce_dtype) {
  if (pd.dp_shard() == 1) return nullptr;
  FullyShardOptions o;
  o.mesh_dim = dim::dp_shard;
  o.min_weight_size = c.min_weight_size;
  o.reshard_after_forward = c.reshard_after_forward;
  // Units: each decoder layer, the embedding, the final norm with lm_head (torchtitan's); a tied embedding
  // shares its weight with lm_head, so they are one unit.
  o.units = c.patterns;
  if (o.units.empty())
    o.units = model.config.tie_embeddings
                  ? std::vector<std::string>{"model.layers.*", "model.embed_tokens+model.norm+lm_head"}
                  : std::vector<std::string>{"model.embed_tokens", "model.layers.*", "model.norm+lm_head"};
  // A unit 'a+b' keeps the parts this stage holds (pipeline parallel); a unit none of whose parts is here goes.
  std::vector<std::string> units;
  for (const std::string& u : o.units) {
    std::string kept;
    size_t start = 0;
    while (start <= u.size()) {
      size_t plus = u.find('+', start);
      std::string part = u.substr(start, plus == std::string::npos ? std::string::npos : plus - start);
      if (here_or_nowhere(model, part)) kept += (kept.empty() ? "" : "+") + part;
      if (plus == std::string::npos) break;
      start = plus + 1;
    }
    if (!kept.empty()) units.push_back(kept);
  }
  o.units = units;
  o.param_dtype = model.dtype;
  o.reduce_dtype = c.reduce_dtype.empty() ? reduce_dtype : (c.reduce_dtype == "bf16" ? DType::bf16 : DType::f32);
  if (o.param_dtype == DType::f64) o.reduce_dtype = DType::f64;  // f64 checks reduce in f64
  return fully_shard(model, mesh, o);
}

std::unique_ptr<FullyShard> parallelize_llama(LlamaForCausalLM& model, const DeviceMesh& mesh, const ParallelDims& pd,
                                              const ParallelConfig& p, int64_t seq_len, DType reduce_dtype) {
  pd.check_seq_len(seq_len);
  pd.check_heads(model.config.n_heads, model.config.n_kv_heads);
  apply_tp(model, mesh, pd, p);
  apply_moe(model, mesh, pd);
  apply_cp(model, mesh, pd, seq_len);
  apply_recompute_llama(model, p.recompute);
  auto fsdp = apply_fsdp(model, mesh, pd, p.fsdp, reduce_dtype);
  // Sharded creation (ParamFactory::deferred): storage now, in the final layout, each rank its own elements. On a
  // simulated mesh (meshtrain estimate) nothing is allocated: the layouts are what is read.
  if (!mesh.simulated())
    for (Parameter* q : model.parameters()) materialize(*q);
  return fsdp;
}

}  // namespace mt
