#include "runtime/planner/estimate.h"

#include <algorithm>
#include <cmath>

#include "attention/attention.h"
#include "attention/sequence_shard.h"
#include "models/model.h"
#include "models/moe_cost.h"
#include "parallel/grad_sync.h"
#include "runtime/core/bytes_format.h"
#include "runtime/core/log.h"
#include "runtime/planner/estimate_lora.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/stage.h"

namespace mt {

namespace {

// The run's shape by train's own code (plan_run_shape, with its errors), and the model's view of one rank's
// layout: the same on every stage.
struct EstimateShape {
  RunShape run;
  RankShape rank;
  int world = 1, P = 1, S = 1, tp = 1;  // ranks, stages, ranks of a stage, tp
  int64_t m = 1;                        // micro-batches per step per rank

  EstimateShape(const Config& cfg, int world_size) : run(plan_run_shape(cfg, world_size)), world(world_size) {
    const auto& t = cfg.training;
    const ParallelDims& pd = run.pd;
    P = pd.pp_size(), S = pd.stage_size(), tp = pd.tp();
    m = run.micro_batches();
    rank.micro = run.micro;
    rank.tokens = cp_shard(pd.cp_load_balance, t.seq_len, pd.cp_ring(), 0, pd.cp_ulysses(), 0).size();
    rank.seq_len = t.seq_len;
    rank.tp = tp;
    rank.sequence_parallel = cfg.parallel.sequence_parallel && tp > 1;
    rank.loss_parallel = cfg.parallel.loss_parallel && tp > 1;
    rank.cp_ulysses = pd.cp_ulysses();
    rank.ep = pd.ep();
    rank.elem = double(dtype_size(run.dtype));
    rank.accum = double(dtype_size(accum_dtype(run.dtype)));
    // bf16 on CPU ranks runs each op in f32 on widened copies (runtime/kernels/op.h).
    rank.widened_bf16 = run.dtype == DType::bf16 && cfg.comm.device != "cuda";
    rank.device = cfg.comm.device == "cuda" ? Device::cuda(0) : Device::cpu();
  }
};

// A stage's model laid out on the simulated meshes of its first rank by train's own assembly (assemble_stage):
// deferred parameters, never allocated, in the layouts train gives them. Not movable: the parallelisms keep the
// meshes' groups.
struct StageLayout {
  ParallelDims::Meshes meshes;
  Stage stage;
  bool first = true, last = true;  // the stage holds the embedding; the output projection

  StageLayout(const Config& cfg, const EstimateShape& rs, int pp_rank)
      : meshes(rs.run.pd.simulate_meshes(pp_rank * rs.S)),
        stage(assemble_stage(cfg, rs.run, meshes.stage, Device::cpu(), pp_rank)) {
    first = stage.model->has_input(), last = stage.model->has_output();
  }
  StageLayout(const StageLayout&) = delete;
};

// The parameters' local elements on a rank: all of them, and those that train (LoRA freezes the base).
struct StateElements {
  double all = 0, trainable = 0;
};

// The model state: the bytes `train` allocates for each parameter's local shape (log_model_state's count): master
// value, gradient and AdamW's two moments in the master dtype, and the bf16 copy, each its own allocation; a frozen
// parameter (LoRA's base) its weights alone (frozen_param_bytes); and the gradient buckets' flat buffers.
StateElements add_state_memory(StageEstimate& st, const Config& cfg, const EstimateShape& rs, const StageLayout& lay) {
  const DType dtype = rs.run.dtype;
  const ParamStateBytes b = param_state_bytes(dtype), fb = frozen_param_bytes(dtype);
  const std::vector<int> coord0(size_t(lay.meshes.stage.ndim()), 0);
  StateElements n;
  double master = 0, grads = 0, moments = 0, copies = 0, frozen = 0;  // each tensor its own allocation
  auto add = [&](const ParamStateBytes& per, double e, double& weights, double& copy) {
    weights += rs.rank.alloc(e * per.master);
    grads += rs.rank.alloc(e * per.grad);
    for (double m : per.optimizer) moments += rs.rank.alloc(e * m);
    copy += rs.rank.alloc(e * per.copy);
  };
  for (Parameter* p : lay.stage.model->parameters()) {
    const double e = double(shape_numel(p->value.spec.local_shape(coord0)));
    n.all += e;
    if (p->frozen) {
      add(fb, e, frozen, frozen);
      continue;
    }
    n.trainable += e;
    add(b, e, master, copies);
  }
  st.state_bytes = master + grads + moments + copies + frozen;
  const std::string master_name(dtype_name(accum_dtype(dtype)));
  // LoRA freezes the base; without it a model may still hold a frozen parameter (DeepSeek-V3's router bias).
  const bool lora = cfg.lora.enabled(), frozen_any = n.trainable < n.all;
  st.memory.push_back({std::string(lora ? "trainable " : "") + "parameters (master " + master_name + ")", master,
                       fmt::format("{:.0f} {}elements of this rank's layouts ({:.0f} B each for weights, gradient, "
                                   "AdamW m and v{} in all)",
                                   n.trainable, lora ? "trainable " : "", b.total(),
                                   dtype == DType::bf16 ? " and the bf16 copy" : "")});
  if (copies > 0) st.memory.push_back({"compute copies (bf16)", copies, "rounded from the masters after each update"});
  if (frozen_any)
    st.memory.push_back({lora ? "frozen base (LoRA: weights only)" : "frozen parameters (weights only)", frozen,
                         fmt::format("{:.0f} frozen elements ({:.0f} B each: {}; no gradient, no optimizer state)",
                                     n.all - n.trainable, fb.total(),
                                     fb.copy > 0 ? "master and compute copy" : "the weights")});
  st.memory.push_back({"gradients", grads, "the " + std::string(lora ? "trainable " : "") + "parameters' layouts, " +
                                               master_name});
  st.memory.push_back({"optimizer moments (AdamW m and v)", moments, master_name});
  const double buckets = rs.rank.alloc(double(lay.stage.grad_sync->bucket_buffer_bytes()));  // a flat buffer each
  if (buckets > 0) st.memory.push_back({"gradient buckets", buckets, lay.stage.grad_sync->describe()});
  return n;
}

// What the activations leave beside a stage's first module (the embedding) in the two phases it runs.
struct HeldAtInput {
  double forward = 0;   // a forward starts: the micro-batches in flight before it (pp)
  double backward = 0;  // a backward reaches it: the other micro-batches in flight (pp), the logits (train_step
                        // holds them through call_backward) and the token ids
};

// The activations at the peak: the micro-batches in flight from this rank's own order of actions (memory depends
// on nothing else). After a forward a (chunk, micro-batch) holds a chunk's share of the activations until its
// backward; under zb1p, between its input-gradient B and its W, what the model defers (ActivationBytes::deferred).
HeldAtInput add_activation_memory(StageEstimate& st, const Config& cfg, const EstimateShape& rs, const StageLayout& lay,
                                  const ActivationBytes& a, int stage) {
  const double micro_saved = a.total();
  const int v = rs.P > 1 ? cfg.parallel.pp_virtual : 1;
  const double per_chunk = micro_saved / v, deferred_per_micro = a.deferred / v;
  int in_flight = 1, held_max = 1;
  double act_peak = micro_saved;
  HeldAtInput held{0, a.input + a.logits};
  if (rs.P > 1) {
    int full = 0, deferred = 0;
    act_peak = 0, in_flight = 0;
    for (const PpAction& x : rs.run.pipeline.schedule.ranks[size_t(stage)]) {
      if (x.op == PpOp::forward)
        held.forward = std::max(held.forward, full * per_chunk + deferred * deferred_per_micro), ++full;
      if (x.op == PpOp::backward) --full;
      if (x.op == PpOp::backward_input) --full, ++deferred;
      if (x.op == PpOp::backward_weight) --deferred;
      const double now = full * per_chunk + deferred * deferred_per_micro;
      if (now > act_peak) act_peak = now, in_flight = full, held_max = deferred;
      if (x.op == PpOp::backward || x.op == PpOp::backward_input)
        held.backward = std::max(held.backward, now + a.input + a.logits);
    }
  }
  const bool first = lay.first, last = lay.last;
  st.activation_bytes = act_peak;
  st.memory.push_back(
      {fmt::format(
           "activations ({} layer(s){}{}; {} {} in flight{})", a.layers_here, first ? ", embedding" : "",
           last ? ", head and logits" : "", in_flight, v > 1 ? "chunk micro-batches" : "micro-batch(es)",
           rs.P > 1 && rs.run.pipeline.schedule.kind == "zb1p" ? fmt::format(", {} waiting for their W", held_max) : ""),
       st.activation_bytes,
       fmt::format("per micro-batch of {} x {} tokens: {} (layers {}, {:.2f} MiB a layer under the "
                   "recompute policy{}{})",
                   rs.run.micro, rs.rank.tokens, format_bytes(micro_saved), format_bytes(a.layers),
                   a.layers_here ? a.layers / double(a.layers_here) / double(1 << 20) : 0.0,
                   last ? ", head " + format_bytes(a.head) : std::string(),
                   last ? ", logits and losses " + format_bytes(a.logits) : std::string())});
  return held;
}

// What fully_shard holds around one unit, every tensor its own allocation (parallel/fully_shard.cpp): in forward
// its weights unpacked beside the flat gather they came from, then beside the next unit's gather (its slot and
// flat buffer); in backward the same, then the weights beside their full-size gradients with the unit before it
// being gathered; in its reduce (the weights freed first) the gradients not yet packed, each with its
// reduce-dtype copy when that differs, and the flat buffer `all`, then `own`. Only the trainable parameters have
// gradients (the gradient slot: LoRA's frozen base has none, and a unit of only frozen ones reduces nothing).
struct UnitBytes {
  double forward = 0, backward = 0, reduce = 0;
};
UnitBytes unit_bytes(const EstimateShape& rs, const FullyShard& fsdp, size_t i) {
  const double n = rs.run.pd.dp_shard();
  const std::vector<int64_t> slots = fsdp.unit_slots();
  const double gslot = double(fsdp.unit_grad_slots()[i]);
  const std::vector<int64_t> params = fsdp.unit_param_elements()[i], trained = fsdp.unit_grad_param_elements()[i];
  const double pb = double(dtype_size(fsdp.options().param_dtype)), a = rs.rank.accum;
  const double rb = double(dtype_size(fsdp.options().reduce_dtype));
  auto A = [&](double b) { return rs.rank.alloc(b); };
  auto gather = [&](size_t j) { return A(double(slots[j]) * pb) + A(n * double(slots[j]) * pb); };
  double weights = 0, grads = 0, copy = 0;
  for (int64_t e : params) weights += A(double(e) * pb);
  for (int64_t e : trained) {
    grads += A(double(e) * a);
    if (rb != a) copy = std::max(copy, A(double(e) * rb));
  }
  double prev = 0, next = 0;  // the nearest units with parameters: the prefetches
  for (size_t j = i; j-- > 0;)
    if (slots[j] > 0) {
      prev = gather(j);
      break;
    }
  for (size_t j = i + 1; j < slots.size(); ++j)
    if (slots[j] > 0) {
      next = gather(j);
      break;
    }
  const double slot = double(slots[i]), unpack = A(n * slot * pb) + weights;
  return {std::max(unpack, weights + next), std::max(unpack, weights + grads + prev),
          gslot > 0 ? prev + A(n * gslot * rb) + std::max(grads + copy, A(gslot * rb)) : 0.0};
}

// A moment of the step that may be its peak: the bytes beside the model state, and where.
struct Candidate {
  double bytes = 0;
  std::string where;
};

// The moments of the step whose bytes beside the model state may be the most: the first backward (every
// micro-batch in flight held, a layer's gradients in flight), the loss, the embedding's forward and backward;
// with fully_shard its last two units' backward and reduce (the logits still held: train_step keeps them until
// call_backward returns) and its first unit's forward, backward and reduce (the embedding's: without pp it runs
// backward when only the logits and token ids are left, under pp's 1F1B beside other micro-batches in flight).
// Without resharding every unit stays gathered through the step.
std::vector<Candidate> peak_candidates(const StageEstimate& st, const EstimateShape& rs, const StageLayout& lay,
                                       const ActivationBytes& a, const HeldAtInput& held) {
  const double act = st.activation_bytes, temps = a.backward_peak + a.recompute_transient;
  std::vector<Candidate> c;
  c.push_back({act + temps, lay.last ? "the first backward after the loss (every micro-batch in flight held, the "
                                       "logits as dloss/dlogits)"
                                     : "the first backward of the step (every micro-batch in flight held)"});
  if (a.loss > 0) c.push_back({act + a.loss, "the loss (its f32 logits and dlogits beside the activations)"});
  if (a.input_forward > 0 && !lay.stage.fsdp)
    c.push_back({held.forward + a.input_forward, "the embedding's forward (its table widened to f32)"});
  if (!lay.stage.fsdp) return c;
  const FullyShard& fsdp = *lay.stage.fsdp;
  const size_t k = fsdp.unit_slots().size();
  if (!fsdp.options().reshard_after_forward) {
    const double pb = double(dtype_size(fsdp.options().param_dtype)), n = rs.run.pd.dp_shard();
    double units = 0, most = 0;  // most: the largest unit's gradients (trainable parameters only)
    for (int64_t slot : fsdp.unit_slots()) units += double(slot) * n * pb;
    for (int64_t slot : fsdp.unit_grad_slots()) most = std::max(most, double(slot) * n);
    c.push_back({act + temps + units + most * rs.rank.accum,
                 "the first backward, every fully_shard unit gathered, the largest unit's gradients"});
    return c;
  }
  for (size_t i = k >= 2 ? k - 2 : 0; i < k; ++i) {
    const UnitBytes u = unit_bytes(rs, fsdp, i);
    c.push_back({act + temps + u.backward, fmt::format("fully_shard unit {}'s backward (gathered, its full-size "
                                                       "gradients, the unit before it being gathered)",
                                                       i)});
    c.push_back({act + u.reduce, fmt::format("fully_shard unit {}'s reduce (its gradients packed into the flat "
                                             "buffer, every micro-batch in flight held)",
                                             i)});
  }
  if (k > 0 && lay.first) {
    const UnitBytes u = unit_bytes(rs, fsdp, 0);
    c.push_back({held.forward + u.forward + a.input_forward, "fully_shard unit 0's forward (the embedding)"});
    c.push_back({held.backward + std::max(u.backward, u.reduce), "fully_shard unit 0's backward and reduce"});
  }
  return c;
}

// Bytes per step, by group and kind: each parallelism's analytic count, from the function beside its code.
void add_comm(StageEstimate& st, std::vector<std::string>& notes, const Config& cfg, const EstimateShape& rs,
              const StageLayout& lay, const ActivationBytes& a, int stage) {
  const ParallelDims& pd = rs.run.pd;
  const ModelConfig& mc = cfg.model;
  const int64_t m = rs.m, L = a.layers_here;
  std::vector<CommBytes> parts;
  auto append = [&](std::vector<CommBytes> more) { parts.insert(parts.end(), more.begin(), more.end()); };
  if (rs.tp > 1 && cfg.parallel.tp_plan.empty()) {
    TpStage s;
    s.tp = rs.tp, s.sequence_parallel = rs.rank.sequence_parallel, s.loss_parallel = rs.rank.loss_parallel;
    s.micro_batches = m, s.layers = L, s.sparse_layers = a.sparse_layers, s.first = lay.first, s.last = lay.last;
    s.micro = rs.run.micro, s.tokens = rs.rank.tokens, s.elem = rs.rank.elem;
    append(family_of(mc).tp_step_bytes(mc, s));
  } else if (rs.tp > 1) {
    notes.push_back("parallel.tp_plan (a custom tensor-parallel plan): its bytes are not modelled");
  }
  if (pd.cp() > 1) {
    // Latent attention's kernel takes q, k and the zero-padded v at dn + dr (mla.cpp): the ring's K/V are that wide.
    const int64_t hd = mc.mla.enabled() ? mc.mla.qk_head_dim() : mc.head_size();
    const AttentionShape as{rs.run.micro, rs.rank.tokens, mc.n_heads / rs.tp, mc.n_kv_heads / rs.tp,
                            hd,           rs.rank.elem,   rs.rank.accum};
    append(cp_step_bytes(pd.cp_method, pd.cp_ring(), pd.cp_ulysses(), as, m * L));
  }
  if (lay.stage.fsdp) append(fsdp_step_collectives(*lay.stage.fsdp, pd.dp_shard(), m, rs.P > 1));
  append(lay.stage.grad_sync->step_bytes());
  // Under pp an MoE model's router statistics ride beside every boundary tensor, a message of their own
  // (pipeline.cpp), and only the last stage sums them over its loss group.
  if (rs.P > 1) {
    std::vector<CommBytes> pp = pp_step_bytes(rs.run.pipeline.schedule, stage, a.boundary, kPpTag);
    if (mc.moe.enabled()) {
      const double stats = double(moe_sparse_layers(mc) * mc.moe.n_experts + mc.moe.n_experts + 2) * 8;  // (S) f64
      for (CommBytes& c : pp) {
        if (c.kind == std::string("send")) c.bytes += double(c.calls) * stats;  // the counters count sent bytes
        c.calls *= 2;
      }
    }
    append(std::move(pp));
  }
  if (mc.moe.enabled()) {
    // The sparse layers' exchanges over ep (uniform routing) and the balance statistics over the loss group.
    MoeStage ms;
    ms.ep = pd.ep();
    ms.loss_ranks = rs.P > 1 && stage != rs.P - 1 ? 1 : lay.meshes.stage.group(dim::loss).size();
    ms.micro_batches = m, ms.sparse_layers = a.sparse_layers, ms.sparse_recomputed = a.sparse_recomputed;
    ms.micro = rs.run.micro, ms.tokens = rs.rank.tokens, ms.elem = rs.rank.elem;
    append(moe_step_bytes(mc, ms));
  }
  for (const CommBytes& c : parts) {
    if (c.calls <= 0) continue;
    // The group under the name the counters use (a set of dims made first under another name keeps that one).
    const std::string name = c.group == dim::pp                 ? c.group
                             : c.group.rfind(dim::pp + std::string(","), 0) == 0 ? lay.meshes.world.group(c.group).name()
                                                                                  : lay.meshes.stage.group(c.group).name();
    st.comm.push_back({c.tag, name, c.kind, c.bytes, c.calls, 0, c.overlapped, ""});
  }
}

// FLOPs per step on this rank (the model's per-token count over the rank's tokens; recompute adds the forwards it
// repeats) and the bytes the memory-bound ops move (the model's, and AdamW over the local trainable parameters:
// master, gradient, m and v read, three written, and the copy: about 30 B per element). Under LoRA the frozen
// base's weight gradients are not computed (4 of the 6 FLOPs a weight and token: forward and input gradient) and
// the adapters add 6 a weight. Returns the GEMM FLOPs (the rest is attention's).
double add_work(StageEstimate& st, const Config& cfg, const EstimateShape& rs, const StageLayout& lay,
                const StageFlops& f, int64_t layers, const StateElements& elements) {
  const bool last = lay.last;
  const double tokens = double(rs.rank.micro) * double(rs.rank.tokens) * double(rs.m);  // over the step
  double gemm = f.layer_gemm * double(layers) * tokens + (last ? f.head * tokens : 0);
  if (cfg.lora.enabled()) gemm = gemm * 4.0 / 6.0 + 6.0 * adapter_tp_elements(*lay.stage.model, lay.meshes.stage) * tokens;
  double attn = f.layer_attention * double(layers) * tokens;
  // A recomputed attention kernel repeats its forward: a third of its work.
  gemm += f.recomputed_gemm * tokens;
  attn += f.layer_attention / 3.0 * double(f.recomputed_attention) * tokens;
  st.flops = gemm + attn;
  // Forward, and twice that in backward.
  st.memory_traffic = 3.0 * f.traffic_layer * double(layers) * tokens + (last ? 3.0 * f.traffic_head * tokens : 0) +
                      30.0 * elements.trainable;
  return gemm;
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

// Time: compute from FLOPs at the cluster's efficiencies; each collective on its group's link; the bubble.
void add_time(StageEstimate& st, const Config& cfg, const EstimateShape& rs, const StageLayout& lay, const StageFlops& f,
              int64_t layers, double gemm, const ClusterSpec& cluster) {
  const auto& t = cfg.training;
  const int world = rs.world;
  // A rank's share of its node: a GPU each, or on CPU ranks the cores they share (cluster.h's rank_share).
  const int on_node = std::min(world, cluster.devices_per_node);
  const double peak = rank_peak_flops(cluster, t.dtype, on_node, int(t.threads));
  const double bandwidth = rank_memory_bandwidth(cluster, on_node, int(t.threads));
  // Attention at the calibration's own count (cluster.h): causal forward 4 B T S H hd / 2, backward 2.5x.
  const double attn_counted = f.attention_causal * double(rs.rank.micro) * double(rs.rank.tokens) *
                              (1.0 + kAttentionBackwardFactor) * double(rs.m) *
                              (double(layers) + double(f.recomputed_attention) / 3.0);
  st.compute_s = gemm / (peak * cluster.gemm_efficiency) + attn_counted / (peak * cluster.attention_efficiency) +
                 st.memory_traffic / bandwidth;
  // Overlapped collectives hide behind compute while it lasts, where something else moves the bytes: a GPU's
  // copy engines and NCCL's own kernels. CPU ranks (cores_per_node > 0) move them on the cores that compute,
  // and MPI advances a transfer only inside its calls: nothing is hidden there.
  double hidden_budget = cluster.cores_per_node == 0 ? st.compute_s : 0.0;
  // The compute between two of the rank's calls, each call a point where its group waits for all its members.
  int64_t calls = 0;
  for (const CommPart& c : st.comm)
    if (!(c.group == dim::pp && c.kind == "recv")) calls += c.calls;
  const double segment_s = st.compute_s / double(std::max<int64_t>(1, calls));
  const bool sync = oversubscribed(cluster, on_node, int(t.threads));
  for (CommPart& c : st.comm) {
    if (c.group == dim::pp && c.kind == "recv") continue;  // its time is the sender's
    // pp's group is the world mesh's (the stage's mesh is below it); a send is one message step each call.
    // (and the router statistics' group of pp and the data dims).
    const bool world = c.group == dim::pp || c.group.rfind(dim::pp + std::string(","), 0) == 0;
    time_part(c, world ? lay.meshes.world : lay.meshes.stage, cluster, sync, segment_s);
    if (!c.overlapped) {
      st.exposed_comm_s += c.seconds;
    } else {
      const double hidden = std::min(c.seconds, hidden_budget);
      hidden_budget -= hidden;
      st.exposed_comm_s += c.seconds - hidden;
    }
  }
  if (rs.P > 1) {
    const PpSchedule& s = rs.run.pipeline.schedule;
    const double fb = pp_bubble_formula(s.kind, s.p, s.v, s.m);
    // CPU ranks of several stages sharing a node's cores k times over: a stage idle in the bubble leaves its
    // cores to the others. The step is then at least the node's work on all its cores (compute_s is counted at
    // the shared rate) and at least the pipeline's critical path at a core per thread ((compute + comm) / k
    // x (1 + f)); with a core per thread (k = 1) or a node per stage, the bubble is the formula's.
    const double k = rs.S < on_node ? core_oversubscription(cluster, on_node, int(t.threads)) : 1.0;
    st.bubble_s = (st.compute_s + st.exposed_comm_s) * std::max(0.0, (1 + fb) / k - 1);
  }
  st.step_s = st.compute_s + st.exposed_comm_s + st.bubble_s;
}

// The run's step: its slowest stage; tokens per second and MFU over the world's peak.
void add_run_time(Estimate& e, const ClusterSpec& cluster) {
  const auto& t = e.config.training;
  const int world = e.world, on_node = std::min(world, cluster.devices_per_node);
  for (const StageEstimate& s : e.stages) e.step_s = std::max(e.step_s, s.step_s);
  const double tokens = double(t.batch_size * t.seq_len);
  e.tokens_per_s = tokens / e.step_s;
  const double peak = rank_peak_flops(cluster, t.dtype, on_node, int(t.threads));
  e.mfu =
      family_of(e.config.model).flops_per_token(e.config.model, t.seq_len) * e.tokens_per_s / (peak * double(world));
  // Threads of several ranks on fewer cores: each rank's threads meet at every op's end, and a thread the
  // scheduler has not run holds up the others; the rank_share figure assumes no such wait.
  if (t.threads > 1 && oversubscribed(cluster, on_node, int(t.threads)))
    e.notes.push_back(fmt::format(
        "training.threads = {} x {} ranks on a node of {} cores: the ranks' threads outnumber the cores and wait "
        "on each other through the scheduler, which the time does not model (2 ranks x 2 threads on 2 cores "
        "measured 1.8-2.8x the estimate: docs/PERFORMANCE.md); set training.threads to at most cores / ranks ({})",
        t.threads, on_node, cluster.cores_per_node, std::max(1, cluster.cores_per_node / on_node)));
}

// One micro-batch's activations on the stage: the model's count, and LoRA's adapters' (estimate_lora.h).
ActivationBytes stage_activations(const EstimateShape& rs, const StageLayout& lay) {
  ActivationBytes a = lay.stage.model->activation_bytes(rs.rank);
  a.layers += lora_saved_bytes(*lay.stage.model, rs.rank);
  return a;
}

// A stage's memory by part and its peak (the sum of the parts), in rs.rank's bytes per tensor. Returns the
// parameters' local elements.
StateElements add_memory(StageEstimate& st, const Config& cfg, const EstimateShape& rs, const StageLayout& lay,
                          int stage) {
  const StateElements elements = add_state_memory(st, cfg, rs, lay);
  const ActivationBytes a = stage_activations(rs, lay);
  const HeldAtInput held = add_activation_memory(st, cfg, rs, lay, a, stage);
  Candidate peak;
  for (Candidate& c : peak_candidates(st, rs, lay, a, held))
    if (c.bytes > peak.bytes) peak = std::move(c);
  // The temporaries are what the peak's moment holds beside the state and the activations at their most (the
  // moment may hold fewer activations: the part is then smaller than its own temporaries).
  st.memory.push_back(
      {"temporaries at the peak", std::max(0.0, peak.bytes - st.activation_bytes),
       fmt::format(
           "largest: a backward's {}{}{}", format_bytes(a.backward_peak + a.recompute_transient),
           a.loss > 0 ? ", the loss's " + format_bytes(a.loss) : std::string(),
           a.input_forward > 0 ? ", the embedding forward's " + format_bytes(a.input_forward) : std::string())});
  st.peak_bytes = 0;
  for (auto& p : st.memory) st.peak_bytes += p.bytes;
  st.peak_where = peak.where;
  return elements;
}

// The rank's process: its floor, train's set-up and, on CPU ranks, the pages its tensors touch at the peak (the
// same moment counted in 4 KiB pages: a 2 MiB granule's unwritten tail is not resident). GPU ranks keep their
// tensors in device memory.
void add_process_memory(StageEstimate& st, const Config& cfg, EstimateShape& rs, const StageLayout& lay, int stage,
                        const std::optional<ClusterSpec>& cluster) {
  const double mib = double(1 << 20);
  st.floor_bytes = (cluster && cluster->rank_floor_mb > 0 ? cluster->rank_floor_mb : kDefaultRankFloorMib) * mib;
  st.setup_bytes = kTrainSetupMib * mib;
  if (!rs.rank.device.is_cuda()) {
    StageEstimate pages;
    rs.rank.resident = true;
    add_memory(pages, cfg, rs, lay, stage);
    rs.rank.resident = false;
    st.resident_bytes = pages.peak_bytes;
  }
  st.process_bytes = st.floor_bytes + st.setup_bytes + st.resident_bytes;
}

// One stage: its layout, memory by part, bytes by collective, work, and (with a cluster) time.
StageEstimate estimate_stage(const Config& cfg, EstimateShape& rs, int stage, const std::optional<ClusterSpec>& cluster,
                             std::vector<std::string>& notes) {
  StageEstimate st;
  st.pp_rank = stage;
  st.world_rank = stage * rs.S;
  const StageLayout lay(cfg, rs, stage);
  const StateElements elements = add_memory(st, cfg, rs, lay, stage);
  for (Parameter* p : lay.stage.model->parameters()) {
    const double n = double(shape_numel(p->value.spec.global_shape));
    st.params += n, st.trainable_params += p->frozen ? 0 : n;
  }
  add_process_memory(st, cfg, rs, lay, stage, cluster);
  const ActivationBytes a = stage_activations(rs, lay);
  add_comm(st, notes, cfg, rs, lay, a, stage);
  const StageFlops f = lay.stage.model->stage_flops(rs.rank);
  const double gemm = add_work(st, cfg, rs, lay, f, a.layers_here, elements);
  if (cluster) add_time(st, cfg, rs, lay, f, a.layers_here, gemm, *cluster);
  return st;
}

}  // namespace

Estimate estimate_run(const Config& cfg, int world, const std::optional<ClusterSpec>& cluster) {
  MT_CHECK(world >= 1, "estimate", "--world {}: expected >= 1 ranks", world);
  Estimate e;
  e.config = cfg;
  e.world = world;
  e.cluster = cluster;
  family_of(cfg.model).check(cfg.model, cfg.training.seq_len);
  // The estimate builds every layer's description (tens of KiB each, and time that grows faster than the layers):
  // a mistyped layer count must be an error, not a machine out of memory. Published models have under 200 layers.
  constexpr int64_t kMaxLayers = 4096;
  MT_CHECK(cfg.model.n_layers <= kMaxLayers, "config",
           "model.n_layers = {} (num_hidden_layers in a config.json): estimate and plan --search describe every layer "
           "and take at most {} (a mistyped count?)",
           cfg.model.n_layers, kMaxLayers);
  EstimateShape rs(cfg, world);  // train's checks, with its errors
  e.pd = rs.run.pd;
  if (const MlaConfig& m = cfg.model.mla; m.enabled() && m.v_head_dim != m.qk_head_dim()) {
    // MFU's FLOPs are the model's (P V at v_head_dim); the kernel runs it on values zero-padded to dn + dr
    // (models/llama/mla.cpp), which the time counts.
    const ModelConfig& mc = cfg.model;
    const double model = family_of(mc).flops_per_token(mc, cfg.training.seq_len);
    const double padded = 6.0 * double(mc.n_heads) * double(m.qk_head_dim() - m.v_head_dim) *
                          double(cfg.training.seq_len) * double(mc.n_layers);
    e.notes.push_back(fmt::format(
        "latent attention: the model's FLOPs (MFU's) count P V at v_head_dim = {}: {:.4g} a token; the attention "
        "kernel runs it on values zero-padded to qk_nope_head_dim + qk_rope_head_dim = {}: {:.4g} a token ({:+.1f}%), "
        "which the compute time counts",
        m.v_head_dim, model, m.qk_head_dim(), model + padded, 100 * padded / model));
  }
  e.micro = rs.run.micro;
  e.micro_batches = rs.m;
  for (int stage = 0; stage < rs.P; ++stage) e.stages.push_back(estimate_stage(cfg, rs, stage, cluster, e.notes));
  if (cluster) add_run_time(e, *cluster);
  return e;
}

std::string estimate_table(const Estimate& e) {
  const auto& c = e.config;
  const ModelFamily& family = family_of(c.model);
  // An MoE model: its total parameters and those a token runs through (what FLOPs and MFU count).
  const std::string params =
      c.model.moe.enabled()
          ? fmt::format("{} parameters total, {} active: {} of {} experts a token, {} per rank over ep = {}",
                        family.num_params(c.model, true), family.active_params(c.model, true),
                        c.model.moe.experts_per_token, c.model.moe.n_experts,
                        c.model.moe.n_experts / std::max(1, e.pd.ep()), e.pd.ep())
          : fmt::format("{} parameters", family.num_params(c.model, true));
  std::string out = fmt::format(
      "estimate: {} ({}) on {} ranks: {}\n  batch {} x {} tokens, {} micro-batch(es) of {} per "
      "data-parallel rank, {}\n",
      c.model.type, params, e.world, e.pd.describe(), c.training.batch_size, c.training.seq_len, e.micro_batches,
      e.micro, c.training.dtype);
  if (c.lora.enabled()) out += lora_line(e);
  for (const StageEstimate& s : e.stages) {
    out += fmt::format("\n{}rank {} (memory by part, per rank):\n",
                       e.pd.pp_size() > 1 ? fmt::format("pp stage {}: ", s.pp_rank) : "", s.world_rank);
    for (const MemoryPart& p : s.memory)
      out += fmt::format("  {:<58} {:>12}  {}\n", p.name, format_bytes(p.bytes), p.note);
    out += fmt::format("  {:<58} {:>12}  at {}\n", "peak", format_bytes(s.peak_bytes), s.peak_where);
    out += fmt::format("  {:<58} {:>12}  {} floor{} + {} train's set-up + {} of tensors' pages at the peak\n",
                       "process (resident, per rank)", format_bytes(s.process_bytes), format_bytes(s.floor_bytes),
                       e.cluster && e.cluster->rank_floor_mb > 0 ? " (the cluster's rank_floor_mb)" : " (default)",
                       format_bytes(s.setup_bytes), format_bytes(s.resident_bytes));
    if (e.cluster)
      out += fmt::format("  device memory {:.0f} GiB: {}\n", e.cluster->device_memory_gib,
                         s.peak_bytes <= e.cluster->device_memory_gib * double(1 << 30) ? "fits" : "DOES NOT FIT");
    out += "  bytes sent per step:\n";
    for (const CommPart& p : s.comm)
      out += fmt::format(
          "    {:<12} {:<12} {:<15} {:>12} in {:>6} call(s){}\n", p.tag, p.group, p.kind, format_bytes(p.bytes),
          p.calls,
          !e.cluster ? std::string()
          : p.link.empty()
              ? std::string("  timed with the sends")  // pp's recv: the sender's time
              : fmt::format(
                    "  {:.3f} ms on the {} link{}{}", 1e3 * p.seconds, p.link,
                    p.sync_seconds > 0 ? fmt::format(" ({:.3f} ms of it members' sync)", 1e3 * p.sync_seconds) : "",
                    !p.overlapped                   ? " (exposed)"
                    : e.cluster->cores_per_node > 0 ? " (async, exposed on CPU ranks)"
                                                    : " (overlapped with compute)"));
    if (e.cluster)
      out += fmt::format(
          "  time: compute {:.3f} ms ({:.3g} TFLOP), exposed communication {:.3f} ms, bubble {:.3f} ms: "
          "step {:.3f} ms\n",
          1e3 * s.compute_s, s.flops / 1e12, 1e3 * s.exposed_comm_s, 1e3 * s.bubble_s, 1e3 * s.step_s);
  }
  if (e.cluster)
    out += fmt::format("\nstep {:.3f} s, {:.0f} tokens/s, {:.0f} tokens/s per rank, MFU {:.1f}%{} (cluster {})\n",
                       e.step_s, e.tokens_per_s, e.tokens_per_s / e.world, 100 * e.mfu,
                       c.model.moe.enabled() ? " of the active parameters' FLOPs" : "", e.cluster->name);
  else out += "\n(no --cluster: time is not estimated)\n";
  for (const std::string& n : e.notes) out += "note: " + n + "\n";
  return out;
}

nlohmann::json estimate_json(const Estimate& e) {
  nlohmann::json j;
  j["world"] = e.world;
  j["mesh"] = e.pd.describe();
  j["micro_batches"] = e.micro_batches;
  j["micro_batch_size"] = e.micro;
  double all = 0, trainable = 0;
  for (const StageEstimate& s : e.stages) all += s.params, trainable += s.trainable_params;
  j["params"] = all;  // the stages' parameters (summed under pp), and those that train (fewer under LoRA)
  j["params_trainable"] = trainable;
  if (e.config.model.moe.enabled()) {
    const ModelFamily& family = family_of(e.config.model);
    j["params_total"] = family.num_params(e.config.model, true);
    j["params_active"] = family.active_params(e.config.model, true);
    j["experts_per_rank"] = e.config.model.moe.n_experts / std::max(1, e.pd.ep());
    j["flops_per_token"] = family.flops_per_token(e.config.model, e.config.training.seq_len);
  }
  for (const StageEstimate& s : e.stages) {
    nlohmann::json r = {{"pp_rank", s.pp_rank},
                        {"world_rank", s.world_rank},
                        {"state_bytes", s.state_bytes},
                        {"activation_bytes", s.activation_bytes},
                        {"peak_bytes", s.peak_bytes},
                        {"peak_where", s.peak_where},
                        {"process_bytes", s.process_bytes},
                        {"rank_floor_bytes", s.floor_bytes},
                        {"setup_bytes", s.setup_bytes},
                        {"resident_bytes", s.resident_bytes}};
    for (const MemoryPart& p : s.memory)
      r["memory"].push_back({{"part", p.name}, {"bytes", p.bytes}, {"note", p.note}});
    for (const CommPart& p : s.comm)
      r["comm"].push_back({{"tag", p.tag},
                           {"group", p.group},
                           {"kind", p.kind},
                           {"bytes", p.bytes},
                           {"calls", p.calls},
                           {"seconds", p.seconds},
                           {"sync_seconds", p.sync_seconds},
                           {"overlapped", p.overlapped},
                           {"link", p.link}});
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
