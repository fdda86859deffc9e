#include "runtime/planner/estimate.h"

#include <algorithm>
#include <cmath>

#include "attention/attention.h"
#include "attention/ring_attention.h"
#include "attention/sequence_shard.h"
#include "comm/comm_counters.h"
#include "models/llama/llama.h"
#include "models/model.h"
#include "parallel/grad_sync.h"
#include "parallel/style.h"
#include "runtime/core/allocator.h"
#include "runtime/core/log.h"
#include "runtime/train/trainer.h"

namespace mt {

namespace {

std::string mib(double b) { return fmt::format("{:.2f} MiB", b / double(1 << 20)); }
std::string gib(double b) { return fmt::format("{:.2f} GiB", b / double(1 << 30)); }
std::string human(double b) { return b >= double(1 << 30) ? gib(b) : mib(b); }

// The sizes one micro-batch's activations are made of on a rank (models/llama/*.cpp's tensors, after the
// parallelisms' splits).
struct Dims {
  double B = 1, T = 1, Tsp = 1, C = 1, H = 1, KV = 1, hd = 1, F = 1, Vl = 1;  // Vl: the logits' local vocabulary
  double e = 4, a = 4;  // bytes of the compute dtype and of its accumulation dtype
  int ulysses = 1;
};

// The bytes a tensor takes from the run's allocator (its rounding: runtime/core/allocator.h).
struct Alloc {
  Device device = Device::cpu();
  double operator()(double bytes) const { return bytes <= 0 ? 0 : double(allocation_bytes(device, size_t(bytes))); }
};

// What one decoder layer keeps for backward, tensor by tensor, with the recompute flags the policy set on it.
struct LayerSaved {
  double total = 0;  // held from its forward to its backward
  double whole = 0;  // the same without recompute (what a recomputed layer holds again inside its backward)
};
LayerSaved layer_saved(const Dims& d, const LlamaDecoderLayer* l, const Alloc& A) {
  // input_layernorm and post_attention_layernorm each keep their input (the residual stream, sequence-sharded
  // under sequence parallel) and rstd (B*T_sp, accumulation dtype).
  const double norms = 2 * A(d.e * d.B * d.Tsp * d.C) + 2 * A(d.a * d.B * d.Tsp);
  // The attention: its input after the hooks (whole sequence per tp rank: q/k/v_proj's saved input), q, k, v
  // (AttentionSaved, RoPE applied in place), the output (o_proj's input; Ulysses keeps it in both layouts) and
  // the log-sum-exp (B, H, T).
  const double attn_in = A(d.e * d.B * d.T * d.C);
  const double qkv = A(d.e * d.B * d.T * d.H * d.hd) + 2 * A(d.e * d.B * d.T * d.KV * d.hd);
  const double out = A(d.e * d.B * d.T * d.H * d.hd) * (d.ulysses > 1 ? 2 : 1), lse = A(d.a * d.B * d.H * d.T);
  // The MLP: its input after the hooks, gate and up (B, T, F), and the SwiGLU output (down_proj's input).
  const double mlp_in = A(d.e * d.B * d.T * d.C), mlp = 3 * A(d.e * d.B * d.T * d.F);
  LayerSaved s;
  s.whole = norms + attn_in + qkv + out + lse + mlp_in + mlp;
  const bool keep = l->self_attn->keep_attention_output;
  if (l->recompute) {
    // Only the layer's input (the residual stream), and with keep: [attention] its output and lse.
    s.total = A(d.e * d.B * d.Tsp * d.C) + (keep ? out + lse : 0);
    return s;
  }
  s.total = norms;
  s.total += l->self_attn->recompute ? attn_in + (keep ? out + lse : 0) : attn_in + qkv + out + lse;
  s.total += l->mlp->recompute ? mlp_in : mlp_in + mlp;
  return s;
}

// The collective time of a part on the link of its group (the group's members' nodes).
// sync: the node's cores are oversubscribed; segment_s: the rank's work between two of its blocking calls (the
// link's sync wait grows with it).
void time_part(CommPart& c, const DeviceMesh& mesh, const ClusterSpec& cl, bool sync, double segment_s) {
  Group& g = mesh.group(c.group);
  const LinkSpec& l = link_for(cl, g.world_ranks());
  c.link = inside_one_node(cl, g.world_ranks()) ? "node" : "network";
  c.sync_seconds = sync && g.size() > 1 ? double(c.calls) * l.sync_seconds(segment_s) : 0;
  // The parts marked overlapped are those the runtime issues non-blocking.
  c.seconds = calls_seconds(l, c.kind, c.bytes, g.size(), c.calls, c.overlapped) + c.sync_seconds;
}

}  // namespace

Estimate estimate_run(const Config& cfg, int world, const std::optional<ClusterSpec>& cluster) {
  MT_CHECK(world >= 1, "estimate", "--world {}: expected >= 1 ranks", world);
  Estimate e;
  e.config = cfg;
  e.world = world;
  e.cluster = cluster;
  const auto& t = cfg.training;
  const ModelConfig& mc = cfg.model;
  const ModelFamily& family = family_of(mc);
  family.check(mc, t.seq_len);

  // 1. The run's shape, by train's own code and with its errors.
  TrainRun run;
  run.config = cfg;
  PipelineState pipeline = plan_run_shape(run, world);
  run.dtype = training_dtype(cfg, cfg.comm.device == "cuda" ? Device::cuda(0) : Device::cpu());
  e.pd = run.pd;
  e.micro = run.micro;
  e.micro_batches = run.rows / run.micro;
  const ParallelDims& pd = run.pd;
  const int P = pd.pp_size(), S = pd.stage_size(), tp = pd.tp();
  const int64_t m = e.micro_batches;
  const DType reduce_dtype = t.grad_reduce_dtype == "bf16" ? DType::bf16 : accum_dtype(run.dtype);
  const bool sp = cfg.parallel.sequence_parallel && tp > 1;

  for (int stage = 0; stage < P; ++stage) {
    StageEstimate st;
    st.pp_rank = stage;
    st.world_rank = stage * S;
    // 2. The stage's model laid out on the simulated meshes of its first rank: deferred parameters, never
    // allocated, in the layouts train gives them.
    ParallelDims::Meshes meshes = pd.simulate_meshes(st.world_rank);
    const DeviceMesh& mesh = meshes.stage;
    ParamFactory f{mesh, run.dtype, Device::cpu(), uint64_t(t.seed), mc.init_std};
    f.deferred = true;
    std::unique_ptr<CausalLM> model = family.build(mc, f);
    if (P > 1) model->keep_chunks(pp_rank_chunks(pipeline.split, P, cfg.parallel.pp_virtual, stage));
    std::unique_ptr<FullyShard> fsdp = family.parallelize(*model, mesh, pd, cfg.parallel, t.seq_len, reduce_dtype);
    GradSyncOptions gso{pd.grad_partial_dims(), size_t(t.grad_bucket_mb * double(1 << 20)), reduce_dtype};
    GradSync grad_sync(*model, mesh, gso);
    const std::vector<Parameter*> params = model->parameters();

    // 3. Memory. The model state: the bytes `train` allocates for each parameter's local shape (log_model_state's
    // count): master value, gradient and AdamW's two moments in the master dtype, and the bf16 copy.
    const double per_element = run.dtype == DType::bf16 ? 18 : double(4 * dtype_size(run.dtype));
    const Alloc A{cfg.comm.device == "cuda" ? Device::cuda(0) : Device::cpu()};
    const std::vector<int> coord0(size_t(mesh.ndim()), 0);
    double elements = 0;
    st.state_bytes = 0;
    double one = 0, copies = 0;  // one master-dtype tensor per parameter; the bf16 copies
    for (Parameter* p : params) {
      // Master value, gradient and the two moments in the master dtype, the bf16 copy: each its own allocation.
      const double n = double(shape_numel(p->value.spec.local_shape(coord0)));
      const double master = double(dtype_size(accum_dtype(run.dtype)));
      elements += n;
      one += A(n * master);
      copies += run.dtype == DType::bf16 ? A(n * 2) : 0;
    }
    st.state_bytes = 4 * one + copies;
    const std::string master_name(dtype_name(accum_dtype(run.dtype)));
    st.memory.push_back({"parameters (master " + master_name + ")", one,
                         fmt::format("{:.0f} elements of this rank's layouts ({:.0f} B each for weights, gradient, "
                                     "AdamW m and v{} in all)",
                                     elements, per_element, run.dtype == DType::bf16 ? " and the bf16 copy" : "")});
    if (copies > 0) st.memory.push_back({"compute copies (bf16)", copies, "rounded from the masters after each update"});
    st.memory.push_back({"gradients", one, "the parameters' layouts, " + master_name});
    st.memory.push_back({"optimizer moments (AdamW m and v)", 2 * one, master_name});
    const double buckets = A(double(grad_sync.bucket_buffer_bytes()));  // one flat buffer per bucket (about)
    if (buckets > 0) st.memory.push_back({"gradient buckets", buckets, grad_sync.describe()});

    // One micro-batch's activations on this rank.
    Dims d;
    d.e = double(dtype_size(run.dtype));
    d.a = double(dtype_size(accum_dtype(run.dtype)));
    d.B = double(run.micro);
    SequenceShard shard = cp_shard(pd.cp_load_balance, t.seq_len, pd.cp_ring(), 0, pd.cp_ulysses(), 0);
    d.T = double(shard.size());
    d.Tsp = sp ? d.T / tp : d.T;
    d.C = double(mc.dim);
    d.H = double(mc.n_heads / tp);
    d.KV = double(mc.n_kv_heads / tp);
    d.hd = double(mc.head_size());
    d.F = double(mc.ffn_dim / tp);
    d.Vl = double(cfg.parallel.loss_parallel && tp > 1 ? mc.vocab_size / tp : mc.vocab_size);
    d.ulysses = pd.cp_ulysses();
    auto* llama = dynamic_cast<LlamaForCausalLM*>(model.get());
    MT_CHECK(llama, "estimate", "model.type {}: the activation model is written for the Llama architecture", mc.type);
    double micro_saved = 0, recompute_transient = 0, layers_saved = 0;
    int64_t layers_here = 0;
    for (LlamaDecoderLayer* l : llama->model->layers) {
      if (!l) continue;
      const LayerSaved s = layer_saved(d, l, A);
      micro_saved += s.total;
      layers_saved += s.total;
      if (l->recompute || l->self_attn->recompute || l->mlp->recompute)
        recompute_transient = std::max(recompute_transient, s.whole - s.total);
      ++layers_here;
    }
    const bool first = model->has_input(), last = model->has_output();
    if (first) micro_saved += A(4 * d.B * d.T);  // the embedding keeps its token ids
    double logits = 0, head_saved = 0;
    if (last) {
      // The final norm's input and rstd, lm_head's input (whole sequence per tp rank), released by their
      // backwards; the logits (B, T, V/tp), which become dloss/dlogits in place, and the per-token losses, held
      // through the whole backward.
      head_saved = A(d.e * d.B * d.Tsp * d.C) + A(d.a * d.B * d.Tsp) + A(d.e * d.B * d.T * d.C);
      logits = A(d.e * d.B * d.T * d.Vl) + A(d.a * d.B * d.T);
      micro_saved += head_saved + logits;
    }
    // Micro-batches in flight, from this rank's own order of actions (memory depends on nothing else): after a
    // forward a (chunk, micro-batch) holds a chunk's share of the activations (micro_saved / v) until its
    // backward; under zb1p, between its input-gradient B and its W, each linear's input and output gradient
    // (DeferWeightGrads: per layer 4 C + (2 H + 2 KV) hd + 3 F of the (B, T) tokens, and lm_head's input and
    // dlogits). The peak of the walk.
    const int v = P > 1 ? cfg.parallel.pp_virtual : 1;
    const double per_chunk = micro_saved / v;
    const double deferred_per_micro =
        ((4 * A(d.e * d.B * d.T * d.C) + 2 * A(d.e * d.B * d.T * d.H * d.hd) + 2 * A(d.e * d.B * d.T * d.KV * d.hd) +
          3 * A(d.e * d.B * d.T * d.F)) * double(layers_here) +
         (last ? A(d.e * d.B * d.T * d.C) + A(d.e * d.B * d.T * d.Vl) : 0)) / v;
    int in_flight = 1, held_max = 1;
    double act_peak = micro_saved;
    if (P > 1) {
      int full = 0, deferred = 0;
      act_peak = 0, in_flight = 0;
      for (const PpAction& a : pipeline.schedule.ranks[size_t(stage)]) {
        if (a.op == PpOp::forward) ++full;
        if (a.op == PpOp::backward) --full;
        if (a.op == PpOp::backward_input) --full, ++deferred;
        if (a.op == PpOp::backward_weight) --deferred;
        const double now = full * per_chunk + deferred * deferred_per_micro;
        if (now > act_peak) act_peak = now, in_flight = full, held_max = deferred;
      }
    }
    st.activation_bytes = act_peak;
    st.memory.push_back({fmt::format("activations ({} layer(s){}{}; {} {} in flight{})", layers_here,
                                     first ? ", embedding" : "", last ? ", head and logits" : "", in_flight,
                                     v > 1 ? "chunk micro-batches" : "micro-batch(es)",
                                     P > 1 && pipeline.schedule.kind == "zb1p"
                                         ? fmt::format(", {} waiting for their W", held_max)
                                         : ""),
                         st.activation_bytes,
                         fmt::format("per micro-batch of {} x {} tokens: {} (layers {}, {:.2f} MiB a layer under the "
                                     "recompute policy{}{})",
                                     run.micro, int64_t(d.T), human(micro_saved), human(layers_saved),
                                     layers_here ? layers_saved / double(layers_here) / double(1 << 20) : 0.0,
                                     last ? ", head " + human(head_saved) : std::string(),
                                     last ? ", logits and losses " + human(logits) : std::string())});
    // The step's largest temporaries beside them: a layer's backward gradients (dgate, dup and dh of the MLP, or
    // dq, dk, dv and dout of attention, with the gathered and the residual gradients), or a recomputed layer's
    // activations made again inside its backward.
    // Two candidates: lm_head's backward (every saved tensor still held, its input gradient made), and the last
    // layer's MLP or attention backward (the head's saved tensors released by then: dh, dgate, dup or dq, dk, dv
    // beside the incoming residual gradient).
    const double residual_grad = A(d.e * d.B * d.Tsp * d.C);
    const double head_grads = last ? A(d.e * d.B * d.T * d.C) + (sp ? residual_grad : 0) : 0;
    // bf16 on CPU ranks runs each op in f32 on widened copies (runtime/kernels/op.h): SwiGLU's backward then also
    // holds f32 copies of dh, gate and up and f32 buffers for dgate and dup.
    const bool cpu_bf16 = run.dtype == DType::bf16 && cfg.comm.device != "cuda";
    const double widened = cpu_bf16 ? 5 * A(4 * d.B * d.T * d.F) : 0;
    const double mlp_grads = 3 * A(d.e * d.B * d.T * d.F) + residual_grad - head_saved + widened;
    const double attn_grads =
        2 * A(d.e * d.B * d.T * d.H * d.hd) + 2 * A(d.e * d.B * d.T * d.KV * d.hd) + residual_grad - head_saved;
    const double transient = std::max({head_grads, mlp_grads, attn_grads, 0.0}) + recompute_transient;
    st.memory.push_back({"backward temporaries", transient, "a layer's gradients in flight (and a recomputed layer)"});
    // fully_shard around the first backwards: the unit whose backward runs gathered (its parameters unpacked, one
    // tensor each) with its full-size gradients, and the gather of the unit before it in flight (one flat
    // buffer); the larger of the last unit's and the one before it's. Without resharding every unit stays gathered.
    if (fsdp) {
      const int n = pd.dp_shard();
      const std::vector<int64_t> slots = fsdp->unit_slots();  // forward order
      const double pb = double(dtype_size(fsdp->options().param_dtype));
      const size_t k = slots.size();
      auto whole = [&](size_t i) { return double(slots[i]) * n; };  // a unit's gathered elements
      auto in_backward = [&](size_t i) { return whole(i) * (pb + d.a) + (i > 0 ? A(whole(i - 1) * pb) : 0); };
      double units = k == 0 ? 0 : in_backward(k - 1);
      if (k >= 2) units = std::max(units, in_backward(k - 2));
      if (!fsdp->options().reshard_after_forward) {
        units = 0;
        double most = 0;
        for (size_t i = 0; i < k; ++i) units += whole(i) * pb, most = std::max(most, whole(i));
        units += most * d.a;
      }
      st.memory.push_back({"fully_shard units", units,
                           fsdp->options().reshard_after_forward
                               ? "the unit in backward gathered with its full-size gradients, the one before it "
                                 "being gathered"
                               : "every unit gathered, the largest unit's full-size gradients"});
    }
    double total = 0;
    for (auto& p : st.memory) total += p.bytes;
    st.peak_bytes = total;
    st.peak_where = last ? "the first backward after the loss (every micro-batch in flight held, the logits "
                           "as dloss/dlogits)"
                         : "the first backward of the step (every micro-batch in flight held)";

    // 4. Bytes per step, by group and kind: each parallelism's analytic count (declared beside its code).
    const double act_bytes = d.B * d.T * d.C * d.e;  // one whole (b, T_local, d) activation
    auto add = [&](const std::string& tag, const std::string& group, const std::string& kind, double bytes,
                   int64_t calls, bool overlapped) {
      // The group under the name the counters use (a set of dims made first under another name keeps that one).
      const std::string name = group == dim::pp ? group : mesh.group(group).name();
      if (calls > 0) st.comm.push_back({tag, name, kind, bytes, calls, 0, overlapped, ""});
    };
    const int64_t L = layers_here;
    if (tp > 1 && cfg.parallel.tp_plan.empty()) {
      // The default plan's layout changes, per micro-batch (style.cpp's hooks on the modules of this stage).
      const double n = double(tp), per_gs = act_bytes * (n - 1) / n, per_ar = 2 * act_bytes * (n - 1) / n;
      const double logits_gather = d.e * d.B * d.T * double(mc.vocab_size) * (n - 1) / n;
      const bool gather_logits = last && !cfg.parallel.loss_parallel;
      if (sp) {
        // Sequence parallel: around each layer's attention and MLP an all-gather in (a reduce-scatter of its
        // gradient back) and a reduce-scatter out (an all-gather back): 4 of each per layer and direction pair,
        // plus the embedding's reduce-scatter and lm_head's all-gather (llama_tp_sp_bytes counts the same).
        const int64_t each = m * (4 * L + (first ? 1 : 0) + (last ? 1 : 0));
        add(kLayoutTag, dim::tp, "all_gather", double(each) * per_gs + (gather_logits ? double(m) * logits_gather : 0),
            each + (gather_logits ? m : 0), false);
        add(kLayoutTag, dim::tp, "reduce_scatter", double(each) * per_gs, each, false);
      } else {
        // Replicated activations: forward all-reduces after o_proj, down_proj and the embedding; backward
        // all-reduces of the input gradients of q, k, v, gate, up and lm_head.
        const int64_t fwd = m * (2 * L + (first ? 1 : 0)), bwd = m * (5 * L + (last ? 1 : 0));
        add(kLayoutTag, dim::tp, "all_reduce", double(fwd + bwd) * per_ar, fwd + bwd, false);
        if (gather_logits) add(kLayoutTag, dim::tp, "all_gather", double(m) * logits_gather, m, false);
      }
    } else if (tp > 1) {
      e.notes.push_back("parallel.tp_plan (a custom tensor-parallel plan): its bytes are not modelled");
    }
    if (pd.cp() > 1) {
      if (pd.cp_ulysses() > 1) {
        // Per layer and direction two all-to-alls (q, k, v to heads; the output back).
        const CpLayerBytes u = ulysses_layer_bytes(pd.cp_ulysses(), run.micro, shard.size(), int64_t(d.H),
                                                   int64_t(d.KV), int64_t(d.hd), d.e);
        add(kCpA2aTag, dim::cp_ulysses, "all_to_all", double(m * L) * (u.forward + u.backward), 4 * m * L, false);
      }
      if (pd.cp_ring() > 1) {
        const int R = pd.cp_ring();
        const double kv_heads = std::max(1.0, d.KV / pd.cp_ulysses());
        const double kv_elems = 2.0 * d.B * d.T * pd.cp_ulysses() * kv_heads * d.hd;
        const double kv = kv_elems * d.e, dkv = kv_elems * d.a;
        const CpLayerBytes c = cp_layer_bytes(pd.cp_method, R, kv, dkv);
        // K/V go around (or are gathered) in forward and again in backward; dK/dV come back.
        if (pd.cp_method == CpMethod::ring) {
          add(kCpKvTag, dim::cp_ring, "ring_shift", double(m * L) * 2 * c.forward, 2 * m * L * (R - 1), true);
          add(kCpDkvTag, dim::cp_ring, "ring_shift", double(m * L) * (c.backward - c.forward),
              m * L * c.dkv_moves, true);
        } else {
          add(kCpKvTag, dim::cp_ring, "all_gather", double(m * L) * 2 * c.forward, 2 * m * L, false);
          add(kCpDkvTag, dim::cp_ring, "reduce_scatter", double(m * L) * (c.backward - c.forward), m * L, false);
        }
      }
    }
    if (fsdp) {
      const int n = pd.dp_shard();
      const FsdpStepBytes fb = fsdp_step_bytes(*fsdp, n);
      const bool hold = P > 1 && !fsdp->options().reshard_after_forward;  // once per step under pp
      const double times = hold ? 1.0 : double(m);
      const double rs = double(n - 1) * double(fsdp->slot_elements()) * double(dtype_size(reduce_dtype));
      const int64_t units = int64_t(fsdp->unit_slots().size());
      add(kFsdpGatherTag, dim::dp_shard, "all_gather", times * (fb.forward + fb.backward - rs),
          int64_t(times) * units * (fsdp->options().reshard_after_forward ? 2 : 1), true);
      add(kFsdpReduceTag, dim::dp_shard, "reduce_scatter", times * rs, int64_t(times) * units, true);
    }
    for (auto& [group, bytes, buckets] : grad_sync.bucket_bytes_by_group())
      add(kGradReduceTag, group, "all_reduce", double(bytes), buckets, true);
    if (P > 1) {
      const PpSchedule& s = pipeline.schedule;
      const double msg = d.B * d.Tsp * d.C * d.e;
      int64_t sends = 0;
      for (int stg = stage; stg < s.stages(); stg += s.p) sends += s.m * ((stg < s.stages() - 1) + (stg > 0));
      add(kPpTag, dim::pp, "send", double(sends) * msg, sends, true);
      add(kPpTag, dim::pp, "recv", 0, sends, true);  // as many receives (counted with no bytes)
    }

    // 5. Time: compute from FLOPs at the cluster's efficiencies; each collective on its group's link.
    const double tokens = d.B * d.T * double(m);  // this rank's tokens of each sequence, over the step
    const double lm = 6.0 * double(mc.vocab_size) * d.C / (tp > 1 ? tp : 1);
    const double total_flops = family.flops_per_token(mc, t.seq_len);
    const double attn_flops_layer = 12.0 * double(mc.n_heads * mc.head_size()) * double(t.seq_len) / tp;
    const double gemm_flops_layer = (total_flops - 6.0 * double(mc.vocab_size) * d.C) / double(mc.n_layers) / tp -
                                    attn_flops_layer;
    double gemm = gemm_flops_layer * double(layers_here) * tokens + (last ? lm * tokens : 0);
    double attn = attn_flops_layer * double(layers_here) * tokens;
    // Recompute runs forwards again (2 FLOPs a weight and token): a recomputed layer or attention repeats q, k, v and
    // o and, unless keep: [attention] kept the output, the attention kernel (a third of its work); a recomputed MLP
    // gate, up and down.
    const double proj_fwd =
        2.0 * double(mc.dim) * double(2 * mc.n_heads + 2 * mc.n_kv_heads) * double(mc.head_size()) / tp;
    const double mlp_fwd = 2.0 * 3.0 * double(mc.dim) * double(mc.ffn_dim) / tp;
    double recomputed_gemm = 0, recomputed_attn = 0;  // FLOPs per token; layers' attention kernels
    for (LlamaDecoderLayer* l : llama->model->layers) {
      if (!l) continue;
      const bool attn_again = l->recompute || l->self_attn->recompute, mlp_again = l->recompute || l->mlp->recompute;
      recomputed_gemm += (attn_again ? proj_fwd : 0) + (mlp_again ? mlp_fwd : 0);
      recomputed_attn += attn_again && !l->self_attn->keep_attention_output;
    }
    gemm += recomputed_gemm * tokens;
    attn += attn_flops_layer / 3.0 * recomputed_attn * tokens;
    st.flops = gemm + attn;
    // Memory-bound work, as bytes moved through device memory per step: each layer's norms, residual adds,
    // RoPE and SwiGLU (about 6 C + 2 (H + 2 KV) hd + 4 F elements read or written per token in forward, twice that
    // in backward), the loss over the logits (read, exponentiated, written: 3 V_local per token), and AdamW over the
    // local parameters (master, gradient, m and v read, three written, and the copy: about 30 B per element).
    const double per_token_layer = d.e * (6 * d.C * (d.Tsp / d.T) + 2 * (d.H + 2 * d.KV) * d.hd + 4 * d.F);
    st.memory_traffic = 3.0 * per_token_layer * double(layers_here) * tokens +
                        (last ? 3.0 * d.e * d.Vl * tokens : 0) + 30.0 * elements;
    if (cluster) {
      // A rank's share of its node: a GPU each, or on CPU ranks the cores they share (cluster.h's rank_share).
      const int on_node = std::min(world, cluster->devices_per_node);
      const double peak = rank_peak_flops(*cluster, cfg.training.dtype, on_node, int(t.threads));
      const double bandwidth = rank_memory_bandwidth(*cluster, on_node, int(t.threads));
      // Attention at the calibration's own count (cluster.h): causal forward 4 B T S H hd / 2, backward 2.5x.
      const double attn_counted =
          0.5 * 4.0 * d.B * d.T * double(t.seq_len) * d.H * d.hd * (1.0 + kAttentionBackwardFactor) *
          double(m) * (double(layers_here) + recomputed_attn / 3.0);
      st.compute_s = gemm / (peak * cluster->gemm_efficiency) + attn_counted / (peak * cluster->attention_efficiency) +
                     st.memory_traffic / bandwidth;
      // Overlapped collectives hide behind compute while it lasts, where something else moves the bytes: a GPU's
      // copy engines and NCCL's own kernels. CPU ranks (cores_per_node > 0) move them on the cores that compute,
      // and MPI advances a transfer only inside its calls: nothing is hidden there.
      double hidden_budget = cluster->cores_per_node == 0 ? st.compute_s : 0.0;
      // The compute between two of the rank's calls, each call a point where its group waits for all its members.
      int64_t calls = 0;
      for (const CommPart& c : st.comm)
        if (!(c.group == dim::pp && c.kind == "recv")) calls += c.calls;
      const double segment_s = st.compute_s / double(std::max<int64_t>(1, calls));
      const bool sync = oversubscribed(*cluster, on_node, int(t.threads));
      for (CommPart& c : st.comm) {
        if (c.group == dim::pp && c.kind == "recv") continue;  // its time is the sender's
        // pp's group is the world mesh's (the stage's mesh is below it); a send is one message step each call.
        time_part(c, c.group == dim::pp ? meshes.world : mesh, *cluster, sync, segment_s);
        if (!c.overlapped) {
          st.exposed_comm_s += c.seconds;
        } else {
          const double hidden = std::min(c.seconds, hidden_budget);
          hidden_budget -= hidden;
          st.exposed_comm_s += c.seconds - hidden;
        }
      }
      if (P > 1) {
        const PpSchedule& s = pipeline.schedule;
        const double f = pp_bubble_formula(s.kind, s.p, s.v, s.m);
        // CPU ranks of several stages sharing a node's cores k times over: a stage idle in the bubble leaves its
        // cores to the others. The step is then at least the node's work on all its cores (compute_s is counted at
        // the shared rate) and at least the pipeline's critical path at a core per thread ((compute + comm) / k
        // x (1 + f)); with a core per thread (k = 1) or a node per stage, the bubble is the formula's.
        const double k = S < on_node ? core_oversubscription(*cluster, on_node, int(t.threads)) : 1.0;
        st.bubble_s = (st.compute_s + st.exposed_comm_s) * std::max(0.0, (1 + f) / k - 1);
      }
      st.step_s = st.compute_s + st.exposed_comm_s + st.bubble_s;
    }
    e.stages.push_back(std::move(st));
  }
  if (cluster) {
    for (const StageEstimate& s : e.stages) e.step_s = std::max(e.step_s, s.step_s);
    const double tokens = double(t.batch_size * t.seq_len);
    e.tokens_per_s = tokens / e.step_s;
    const double peak = rank_peak_flops(*cluster, cfg.training.dtype, std::min(world, cluster->devices_per_node),
                                        int(t.threads));
    e.mfu = family.flops_per_token(mc, t.seq_len) * e.tokens_per_s / (peak * double(world));
    // Threads of several ranks on fewer cores: each rank's threads meet at every op's end, and a thread the
    // scheduler has not run holds up the others; the rank_share figure assumes no such wait.
    const int on_node = std::min(world, cluster->devices_per_node);
    if (t.threads > 1 && oversubscribed(*cluster, on_node, int(t.threads)))
      e.notes.push_back(fmt::format(
          "training.threads = {} x {} ranks on a node of {} cores: the ranks' threads outnumber the cores and wait "
          "on each other through the scheduler, which the time does not model (2 ranks x 2 threads on 2 cores "
          "measured 1.8-2.8x the estimate: docs/PERFORMANCE.md); set training.threads to at most cores / ranks ({})",
          t.threads, on_node, cluster->cores_per_node, std::max(1, cluster->cores_per_node / on_node)));
  }
  return e;
}

std::string estimate_table(const Estimate& e) {
  const auto& c = e.config;
  std::string out = fmt::format(
      "estimate: {} ({} parameters) on {} ranks: {}\n  batch {} x {} tokens, {} micro-batch(es) of {} per "
      "data-parallel rank, {}\n",
      c.model.type, family_of(c.model).num_params(c.model, true), e.world, e.pd.describe(), c.training.batch_size,
      c.training.seq_len, e.micro_batches, e.micro, c.training.dtype);
  for (const StageEstimate& s : e.stages) {
    out += fmt::format("\n{}rank {} (memory by part, per rank):\n",
                       e.pd.pp_size() > 1 ? fmt::format("pp stage {}: ", s.pp_rank) : "", s.world_rank);
    for (const MemoryPart& p : s.memory) out += fmt::format("  {:<58} {:>12}  {}\n", p.name, human(p.bytes), p.note);
    out += fmt::format("  {:<58} {:>12}  at {}\n", "peak", human(s.peak_bytes), s.peak_where);
    if (e.cluster)
      out += fmt::format("  device memory {:.0f} GiB: {}\n", e.cluster->device_memory_gib,
                         s.peak_bytes <= e.cluster->device_memory_gib * double(1 << 30) ? "fits" : "DOES NOT FIT");
    out += "  bytes sent per step:\n";
    for (const CommPart& p : s.comm)
      out += fmt::format("    {:<12} {:<12} {:<15} {:>12} in {:>6} call(s){}\n", p.tag, p.group, p.kind, human(p.bytes),
                         p.calls,
                         !e.cluster       ? std::string()
                         : p.link.empty() ? std::string("  timed with the sends")  // pp's recv: the sender's time
                                          : fmt::format("  {:.3f} ms on the {} link{}{}", 1e3 * p.seconds, p.link,
                                                 p.sync_seconds > 0
                                                     ? fmt::format(" ({:.3f} ms of it members' sync)", 1e3 * p.sync_seconds)
                                                     : "",
                                                 !p.overlapped                    ? " (exposed)"
                                                 : e.cluster->cores_per_node > 0 ? " (async, exposed on CPU ranks)"
                                                                                  : " (overlapped with compute)"));
    if (e.cluster)
      out += fmt::format("  time: compute {:.3f} ms ({:.3g} TFLOP), exposed communication {:.3f} ms, bubble {:.3f} ms: "
                         "step {:.3f} ms\n",
                         1e3 * s.compute_s, s.flops / 1e12, 1e3 * s.exposed_comm_s, 1e3 * s.bubble_s, 1e3 * s.step_s);
  }
  if (e.cluster)
    out += fmt::format("\nstep {:.3f} s, {:.0f} tokens/s, {:.0f} tokens/s per rank, MFU {:.1f}% (cluster {})\n", e.step_s,
                       e.tokens_per_s, e.tokens_per_s / e.world, 100 * e.mfu, e.cluster->name);
  else
    out += "\n(no --cluster: time is not estimated)\n";
  for (const std::string& n : e.notes) out += "note: " + n + "\n";
  return out;
}

nlohmann::json estimate_json(const Estimate& e) {
  nlohmann::json j;
  j["world"] = e.world;
  j["mesh"] = e.pd.describe();
  j["micro_batches"] = e.micro_batches;
  j["micro_batch_size"] = e.micro;
  for (const StageEstimate& s : e.stages) {
    nlohmann::json r;
    r["pp_rank"] = s.pp_rank;
    r["world_rank"] = s.world_rank;
    for (const MemoryPart& p : s.memory) r["memory"].push_back({{"part", p.name}, {"bytes", p.bytes}, {"note", p.note}});
    r["state_bytes"] = s.state_bytes;
    r["activation_bytes"] = s.activation_bytes;
    r["peak_bytes"] = s.peak_bytes;
    r["peak_where"] = s.peak_where;
    for (const CommPart& p : s.comm)
      r["comm"].push_back({{"tag", p.tag}, {"group", p.group}, {"kind", p.kind}, {"bytes", p.bytes},
                           {"calls", p.calls}, {"seconds", p.seconds}, {"sync_seconds", p.sync_seconds}, {"overlapped", p.overlapped}, {"link", p.link}});
    r["flops"] = s.flops;
    if (e.cluster) {
      r["compute_s"] = s.compute_s;
      r["exposed_comm_s"] = s.exposed_comm_s;
      r["bubble_s"] = s.bubble_s;
      r["step_s"] = s.step_s;
    }
    j["stages"].push_back(r);
  }
  if (e.cluster) {
    j["cluster"] = e.cluster->name;
    j["step_s"] = e.step_s;
    j["tokens_per_s"] = e.tokens_per_s;
    j["mfu"] = e.mfu;
  }
  j["notes"] = e.notes;
  return j;
}

}  // namespace mt
