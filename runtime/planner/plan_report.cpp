// What `meshtrain plan` prints of a built run (plan_report.h).
#include "runtime/planner/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "attention/attention.h"
#include "attention/sequence_shard.h"
#include "models/layers.h"
#include "models/moe_cost.h"
#include "runtime/core/bytes_format.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/step.h"

namespace mt {

namespace {

// The model, its experts over ep (an MoE model), and the mesh with what each dim means.
void print_model_and_mesh(const TrainRun& run, int tp) {
  const Config& cfg = run.config;
  const DeviceMesh& mesh = run.mesh;
  const ModelFamily& family = family_of(cfg.model);
  std::printf("model: %s (%s), %lld parameters\n", family.type.c_str(), family.architecture.c_str(),
              (long long)family.num_params(cfg.model, true));
  if (const MoeConfig& moe = cfg.model.moe; moe.enabled()) {
    // An MoE model: its experts over ep, and the parameters a token runs through beside the total.
    const int ep = run.pd.ep();
    std::printf(
        "mixture of experts: %lld of %lld layers sparse, %lld experts (ffn %lld) each, top %lld%s; "
        "%lld experts per rank (E/ep = %lld/%d)\n",
        (long long)moe_sparse_layers(cfg.model), (long long)cfg.model.n_layers, (long long)moe.n_experts,
        (long long)moe.ffn_dim, (long long)moe.experts_per_token,
        moe.shared_expert_ffn_dim > 0 ? fmt::format(", a shared expert (ffn {})", moe.shared_expert_ffn_dim).c_str()
                                      : "",
        (long long)(moe.n_experts / ep), (long long)moe.n_experts, ep);
    std::printf("parameters: %lld total, %lld active (a token's k experts; FLOPs and MFU count these)\n",
                (long long)family.num_params(cfg.model, true), (long long)family.active_params(cfg.model, true));
  }
  std::printf("mesh %s (%d ranks): %s; tp plan: %s\n\n", mesh_str(mesh.dims()).c_str(), mesh.size(),
              run.pd.describe().c_str(),
              tp == 1 ? "none (tp = 1)" : (cfg.parallel.tp_plan.empty() ? "the model's default" : "parallel.tp_plan"));
}

// Context parallel: each cp rank's chunks of the sequence, and each cp_ulysses rank's heads inside attention.
void print_cp_split(const Config& cfg, const ParallelDims& pd, int tp) {
  // Each cp rank's tokens of every sequence (the same on every dp and tp coordinate): the cp_ring part, then
  // split again in order over cp_ulysses.
  std::printf(
      "sequence (%lld tokens) over cp = %d (cp_ring %d, %s, %s; cp_ulysses %d): each rank's chunks of "
      "global positions\n",
      (long long)cfg.training.seq_len, pd.cp(), pd.cp_ring(), cp_method_name(pd.cp_method).c_str(),
      cp_load_balance_name(pd.cp_load_balance).c_str(), pd.cp_ulysses());
  for (int r = 0; r < pd.cp_ring(); ++r)
    for (int u = 0; u < pd.cp_ulysses(); ++u) {
      SequenceShard sh = cp_shard(pd.cp_load_balance, cfg.training.seq_len, pd.cp_ring(), r, pd.cp_ulysses(), u);
      std::string chunks;
      for (int64_t p0 : sh.chunk_pos)
        chunks += fmt::format("{}[{}, {})", chunks.empty() ? "" : " ", p0, p0 + sh.chunk_len);
      std::printf("  cp_ring %d cp_ulysses %d: %s (%lld tokens)\n", r, u, chunks.c_str(), (long long)sh.size());
    }
  if (pd.cp_ulysses() > 1) {
    // Inside attention each cp_ulysses rank holds the cp_ring part's tokens of some heads (after tp's split).
    const int U = pd.cp_ulysses();
    const int64_t H = cfg.model.n_heads / tp, KV = cfg.model.n_kv_heads / tp, Hu = H / U;
    std::printf("attention heads over cp_ulysses = %d (of %lld q and %lld kv heads per tp rank):", U, (long long)H,
                (long long)KV);
    for (int u = 0; u < U; ++u) {
      const int64_t kv0 = int64_t(u) * KV / U, kvn = std::max<int64_t>(1, KV / U);
      std::printf("%s rank %d q [%lld, %lld) kv [%lld, %lld)", u ? ";" : "", u, (long long)(u * Hu),
                  (long long)((u + 1) * Hu), (long long)kv0, (long long)(kv0 + kvn));
    }
    std::printf("%s\n", KV < U ? " (a kv head shared by several ranks: their gradients are summed)" : "");
  }
  std::printf("\n");
}

// Every parameter's placements over the mesh and its local shape on each tp rank.
void print_parameters(const TrainRun& run, int tp_dim, int tp) {
  const DeviceMesh& mesh = run.mesh;
  std::printf("parameters: placements over (%s), local shape on each tp rank\n",
              [&] {
                std::string s;
                for (auto& d : mesh.dims()) s += (s.empty() ? "" : ", ") + d.name;
                return s;
              }()
                  .c_str());
  for (Parameter* p : run.params) {
    std::string pl, shapes;    // placements, local shapes
    pl = p->value.spec.str();  // with [k] marks where several mesh dims split one tensor dim
    std::vector<int> coord = mesh.coordinate();
    for (int r = 0; r < tp; ++r) {
      coord[size_t(tp_dim)] = r;
      shapes += (r ? " " : "") + shape_str(p->value.spec.local_shape(coord));
    }
    std::string grad = p->partial_dims().empty() ? "" : "  (gradient partial over tp)";
    std::printf("  %-48s %-14s [%s] %s%s\n", p->name.c_str(), shape_str(p->value.shape()).c_str(), pl.c_str(),
                shapes.c_str(), grad.c_str());
  }
}

// fully_shard's options, units, and its decision for each parameter with the reason.
void print_fsdp(const TrainRun& run) {
  std::printf("\nfully_shard over dp_shard = %d (min_weight_size %lld, reshard_after_forward %s): %s\n  units:",
              run.pd.dp_shard(), (long long)run.fsdp->options().min_weight_size,
              run.fsdp->options().reshard_after_forward ? "true" : "false", run.fsdp->describe().c_str());
  for (auto& u : run.fsdp->unit_names()) std::printf(" %s", u.c_str());
  std::printf("\n");
  for (const FsdpDecision& d : run.fsdp->decisions())
    std::printf("  %-48s %s%s\n", d.param.c_str(),
                d.tensor_dim < 0 ? "replicated: "
                                 : fmt::format("Shard({}){}: ", d.tensor_dim, d.with_tp ? " with tp" : "").c_str(),
                d.reason.c_str());
}

// Every module's layout hooks on its input and output.
void print_module_hooks(const TrainRun& run) {
  std::printf("\nmodule layouts (activations: Shard(0) over the data-parallel dims, Shard(1) over cp)\n");
  int shown = 0;
  for (Module* m : run.model->modules()) {
    for (auto& h : m->input_hooks) std::printf("  %s: input %s\n", m->name().c_str(), h.what.c_str()), ++shown;
    for (auto& h : m->output_hooks) std::printf("  %s: output %s\n", m->name().c_str(), h.what.c_str()), ++shown;
  }
  if (!shown) std::printf("  (none: every module sees its whole input)\n");
}

// Pipeline parallel: one stage boundary's tensor, and the bytes a pp rank sends in a step (pp_step_bytes' sends).
double pp_message_bytes(const PipelineState& pp) {
  return double(shape_numel(pp.act_shape)) * double(dtype_size(pp.act_dtype));
}
double pp_rank_bytes(const PipelineState& pp, int pp_rank) {
  return pp_step_bytes(pp.schedule, pp_rank, pp_message_bytes(pp), kPpTag).at(0).bytes;
}

// Pipeline parallel: the stages (their layers and pp ranks), the bubble the schedule gives, and each rank's
// actions in order.
void print_pipeline(const TrainRun& run, const PipelineState& pp) {
  const Config& cfg = run.config;
  const PpSchedule& s = pp.schedule;
  std::printf("\npipeline: pp = %d, %d stages (pp_virtual %d), schedule %s over %d micro-batches of %lld sequences\n",
              s.p, s.stages(), s.v, s.kind.c_str(), s.m, (long long)run.micro);
  int64_t begin = 0;
  for (int st = 0; st < s.stages(); ++st) {
    const int64_t n = pp.split[size_t(st)];
    std::printf("  stage %d on pp rank %d: %s%s [%lld, %lld)%s\n", st, s.rank_of(st),
                st == 0 ? "model.embed_tokens, " : "", n == 1 ? "decoder layer" : "decoder layers", (long long)begin,
                (long long)(begin + n), st == s.stages() - 1 ? ", model.norm, lm_head and the loss" : "");
    begin += n;
  }
  std::printf("  split: %s\n",
              cfg.parallel.pp_layers.empty() ? "balanced (lm_head counted by its FLOPs)" : "parallel.pp_layers");
  const PpSimulation sim = simulate_pp_schedule(s);
  std::printf(
      "  bubble (idle / compute per rank): %.3f by the formula, %.3f simulated with equal stages (F 1, B 2%s)\n",
      pp_bubble_formula(s.kind, s.p, s.v, s.m), sim.bubble(), s.kind == "zb1p" ? ", as B 1 + W 1" : "");
  std::printf("  boundary message: %s %s = %s each\n", shape_str(pp.act_shape).c_str(),
              std::string(dtype_name(pp.act_dtype)).c_str(), format_mib(pp_message_bytes(pp), 3).c_str());
  std::printf("  timeline (each pp rank's actions in order: F forward, B backward%s; sends and receives left out):\n%s",
              s.kind == "zb1p" ? ", Bi input gradient, W weight gradient" : "", pp_schedule_str(s).c_str());
}

// A batch of rows sequences of random tokens (inputs and targets), drawn from gen.
Batch random_batch(int64_t rows, int64_t seq_len, int64_t vocab, std::mt19937& gen) {
  Batch batch;
  batch.inputs = empty({rows, seq_len}, DType::i32), batch.targets = empty({rows, seq_len}, DType::i32);
  for (int64_t i = 0; i < batch.inputs.numel(); ++i) {
    batch.inputs.at<int32_t>(i) = int32_t(gen() % uint32_t(vocab));
    batch.targets.at<int32_t>(i) = int32_t(gen() % uint32_t(vocab));
  }
  return batch;
}

// This rank's part of one micro-batch: forward, the token losses and backward, each phase counted.
void measure_micro_batch(TrainRun& run, const Batch& batch, MeasuredStep& c) {
  MicroBatch mb = local_micro_batch(run, batch, 0);
  run.model->set_documents(mb.doc_start);
  zero_grads(run.params);
  reset_comm_counters();
  // A training forward (an MoE model's balance loss on, and bounded dropless ep's fixed blocks), as train_step's.
  run.model->set_loss_scale(1.0);
  Tensor logits = run.model->call(mb.inputs);
  c.forward = comm_counters();
  Tensor losses = empty({mb.targets.numel()}, accum_dtype(logits.dtype()), run.device);
  Tensor rows = as_rows(logits);
  token_losses(run, losses, rows, rows, mb.targets.reshape({-1}), 1.0);
  reset_comm_counters();
  run.model->call_backward(logits);
  c.backward = comm_counters();
  run.model->set_loss_scale(0);
}

// "forward 1.234 MiB  (tp all_gather: 0.5 MiB x4, ...)": a phase's total and its collectives.
void print_phase(const char* what, const char* key, const CommCounters& c) {
  std::printf("  %-22s %s", what, format_mib(double(c.total()), 3).c_str());
  std::string parts;
  for (auto& [k, n] : c.by_collective())
    parts += fmt::format("{}{}: {} x{}", parts.empty() ? "" : ", ", k, format_mib(double(n.bytes), 3), n.calls);
  std::printf("%s%s%s\n", parts.empty() ? "" : "  (", parts.c_str(), parts.empty() ? "" : ")");
  // Each (tag, group, kind) exactly, for scripts:
  // "    bytes[forward] tag=cp.kv group=cp kind=ring_shift calls=4 bytes=..."
  for (auto& [entry, n] : c.entries) {
    const auto& [tag, group, kind] = entry;
    std::printf("    bytes[%s] tag=%s group=%s kind=%s calls=%lld bytes=%lld\n", key, tag.empty() ? "-" : tag.c_str(),
                group.c_str(), kind.c_str(), (long long)n.calls, (long long)n.bytes);
  }
}

// Under pipeline parallel: this stage's bytes over the whole step, and the pp sends against their formula.
void print_pp_bytes(const PipelineState& pp, const MeasuredStep& c) {
  std::printf("\nbytes sent by pp rank %d (world rank 0) in one step of %d micro-batches (measured by the runtime):\n",
              pp.rank, pp.schedule.m);
  print_phase("forward and backward", "step", c.forward);
  print_phase("gradient sync", "sync", c.sync);
  const double measured = double(c.forward.bytes(kPpTag, dim::pp)), analytic = pp_rank_bytes(pp, pp.rank);
  std::printf("\npp bytes per rank: measured %s, analytic m x boundary x (activations + gradients sent) = %s (%s)\n",
              format_mib(measured, 3).c_str(), format_mib(analytic, 3).c_str(),
              measured == analytic ? "equal" : "DIFFERENT");
  for (int r = 0; r < pp.schedule.p; ++r)
    std::printf("  pp rank %d: %s per step\n", r, format_mib(pp_rank_bytes(pp, r), 3).c_str());
  std::printf(
      "(the other parallelisms' bytes above are this stage's over the whole step; their per-micro-batch "
      "analytic counts are printed without pipeline parallel)\n");
}

// Tensor + sequence parallel with the family's default plan: the layout collectives against tp_step_bytes.
void print_tp_bytes(const TrainRun& run, const MeasuredStep& c) {
  const Config& cfg = run.config;
  const int tp = run.pd.tp();
  const std::string tp_group = dim::tp;
  // Per direction: the step's reduce-scatters (a forward all-gather's backward is one, and the other way round),
  // and a sparse layer's third all-gather each way (its replicated block: input gathered, its output's slice's
  // gradient gathered, nothing reduce-scattered).
  TpStage st;
  st.tp = tp, st.sequence_parallel = true, st.loss_parallel = cfg.parallel.loss_parallel;
  st.layers = cfg.model.n_layers, st.sparse_layers = moe_sparse_layers(cfg.model), st.micro = run.micro;
  st.tokens = run.shard.size(), st.elem = double(dtype_size(run.dtype));
  const double one = double(tp - 1) / tp * double(run.micro) * double(run.shard.size()) * double(cfg.model.dim) *
                     double(dtype_size(run.dtype));
  double analytic = double(st.sparse_layers) * one;
  for (const CommBytes& x : family_of(cfg.model).tp_step_bytes(cfg.model, st))
    if (x.kind == "reduce_scatter") analytic += x.bytes;
  double f = double(c.forward.bytes(kLayoutTag, tp_group)), b = double(c.backward.bytes(kLayoutTag, tp_group));
  std::printf(
      "\nanalytic tp bytes per direction: (4 x %lld layers - %lld sparse + 2) x (%d-1)/%d x %lld x %lld x %lld x %zu "
      "B = %s\n",
      (long long)cfg.model.n_layers, (long long)st.sparse_layers, tp, tp, (long long)run.micro,
      (long long)run.shard.size(), (long long)cfg.model.dim, dtype_size(run.dtype), format_mib(analytic, 3).c_str());
  bool same = f == analytic && b == analytic;
  std::printf("tp activations: measured %s analytic (forward %s, backward %s)\n",
              same ? "=" : "!=", format_mib(f, 3).c_str(), format_mib(b, 3).c_str());
}

// Context parallel: Ulysses' all-to-alls and the ring's K/V and dK/dV against cp_bytes.
void print_cp_bytes(const TrainRun& run, const MeasuredStep& c) {
  const Config& cfg = run.config;
  const ParallelDims& pd = run.pd;
  const int tp = pd.tp();
  // Per layer: Ulysses moves this rank's q, k, v (micro, T_u, heads after tp, hd) to head shards and the output
  // back (ulysses_layer_bytes); the ring then moves the K/V of the ring part (micro, T_u U, KV_u, hd).
  const int R = pd.cp_ring(), U = pd.cp_ulysses();
  // Latent attention: q, k and the zero-padded v at dn + dr (models/llama/mla.cpp).
  const int64_t hd = cfg.model.mla.enabled() ? cfg.model.mla.qk_head_dim() : cfg.model.head_size(),
                H = cfg.model.n_heads / tp, KV = cfg.model.n_kv_heads / tp;
  const double L = double(cfg.model.n_layers), elem = double(dtype_size(run.dtype));
  const CpBytes cb = cp_bytes(
      pd.cp_method, R, U, {run.micro, run.shard.size(), H, KV, hd, elem, double(dtype_size(accum_dtype(run.dtype)))});
  if (U > 1) {
    const CpLayerBytes& per_layer = cb.ulysses;
    const double f = double(c.forward.bytes(kCpA2aTag)), b = double(c.backward.bytes(kCpA2aTag));
    const double f_an = L * per_layer.forward, b_an = L * per_layer.backward;
    std::printf(
        "\ncp_ulysses (alltoall) bytes per rank: forward measured %s, analytic %lld layers x (%d-1) x %lld x %lld "
        "x %lld x (2 x %lld + 2 x %lld) heads x %.0f B = %s (%s)\n",
        format_mib(f, 3).c_str(), (long long)cfg.model.n_layers, U, (long long)run.micro, (long long)run.shard.size(),
        (long long)hd, (long long)(H / U), (long long)std::max<int64_t>(1, KV / U), elem, format_mib(f_an, 3).c_str(),
        f == f_an ? "equal" : "DIFFERENT");
    std::printf("cp_ulysses (alltoall) bytes per rank: backward measured %s, analytic the same = %s (%s)\n",
                format_mib(b, 3).c_str(), format_mib(b_an, 3).c_str(), b == b_an ? "equal" : "DIFFERENT");
  }
  if (R > 1) {
    const CpLayerBytes& per_layer = cb.ring;
    const double kv = cb.kv, dkv = cb.dkv;
    // Sliding-window layers (Gemma) whose window leaves ring distances out send their block straight to the
    // distances needed (ring_attention.h: cp_window_layer_bytes); the other layers go around the ring.
    double f_an = 0, b_an = 0;
    int64_t windowed = 0;
    int distances = 0;
    for (int64_t i = 0; i < cfg.model.n_layers; ++i) {
      const int64_t w = cfg.model.sliding_layer(i) ? cfg.model.sliding_window : 0;
      CpLayerBytes lb = per_layer;
      if (window_direct(pd.cp_method, pd.cp_load_balance, cfg.training.seq_len, R, w)) {
        distances = int(ring_window_distances(pd.cp_load_balance, cfg.training.seq_len, R, w).size());
        lb = cp_window_layer_bytes(distances, kv, dkv);
        ++windowed;
      }
      f_an += lb.forward, b_an += lb.backward;
    }
    if (windowed > 0)
      std::printf(
          "\ncp_ring: %lld sliding-window layer(s) send K/V straight to %d of the %d-1 ring distances: "
          "forward %d x K/V, backward %d x (K/V + dK/dV) each\n",
          (long long)windowed, distances, R, distances, distances);
    const double f = double(c.forward.bytes(kCpKvTag) + c.forward.bytes(kCpDkvTag)),
                 b = double(c.backward.bytes(kCpKvTag) + c.backward.bytes(kCpDkvTag));
    std::printf(
        "\ncp_ring (%s) bytes per rank: forward measured %s, analytic %lld layers x (%d-1) x K/V %s = %s (%s)\n",
        cp_method_name(pd.cp_method).c_str(), format_mib(f, 3).c_str(), (long long)cfg.model.n_layers, R,
        format_mib(kv, 3).c_str(), format_mib(f_an, 3).c_str(), f == f_an ? "equal" : "DIFFERENT");
    std::printf(
        "cp_ring bytes per rank: backward measured %s, analytic %lld layers x ((%d-1) x K/V + %d x dK/dV %s) = %s "
        "(%s)\n",
        format_mib(b, 3).c_str(), (long long)cfg.model.n_layers, R, per_layer.dkv_moves, format_mib(dkv, 3).c_str(),
        format_mib(b_an, 3).c_str(), b == b_an ? "equal" : "DIFFERENT");
  }
}

// Expert parallel: the dispatch's all-to-all-v and the counts against moe_layer_bytes, and the routing measured.
void print_moe_bytes(const TrainRun& run, const MeasuredStep& c) {
  const RouterStepStats& router = c.router;
  const Config& cfg = run.config;
  const MoeConfig& moe = cfg.model.moe;
  const ParallelDims& pd = run.pd;
  // Expert parallel: per sparse layer and micro-batch, the counts' all-to-all, then the rows there and back in
  // forward and their gradients in backward (all-to-all-v). The rows leaving depend on the routing: the formula
  // is uniform routing's, (ep-1)/ep of the M = B T k rows; the counted bytes are this rank's actual ones.
  const int ep = pd.ep();
  const double elem = double(dtype_size(run.dtype));
  const int64_t S = moe_sparse_layers(cfg.model), T = run.shard.size();
  const MoeLayerBytes lb = moe_layer_bytes(cfg.model, ep, run.micro, T, elem);
  // Fixed blocks (a capacity, or bounded dropless: model.moe.dropless_bound): M = E x cap rows, padding included,
  // whatever the routing; exact dropless: the routed rows, uniform routing's share leaving.
  const bool blocks = ep > 1 && (moe.capacity_factor > 0 || moe.dropless_bound > 0);
  std::printf(
      "\nmoe dispatch over ep = %d, per sparse layer and micro-batch: M = %s = %.0f rows, "
      "each all-to-all%s M x (%d-1)/%d x %lld x %.0f B = %s; counts %lld x 4 B (i32) x (%d-1)/%d = %.0f B\n",
      ep,
      blocks ? fmt::format("{} experts x cap", moe.n_experts).c_str()
             : fmt::format("{} x {} x {}", run.micro, T, moe.experts_per_token).c_str(),
      lb.rows, blocks ? " (fixed blocks)" : "-v (uniform routing)", ep, ep, (long long)cfg.model.dim, elem,
      format_mib(lb.exchange, 3).c_str(), (long long)moe.n_experts, ep, ep, lb.counts);
  for (const char* phase : {"forward", "backward"}) {
    const CommCounters& cc = phase[0] == 'f' ? c.forward : c.backward;
    const double got = double(cc.bytes(kMoeDispatchTag, "", "all_to_all"));
    const int64_t calls = cc.calls(kMoeDispatchTag, "", "all_to_all");
    const double an = 2.0 * double(S) * lb.exchange;
    std::printf(
        "moe dispatch bytes per rank: %s measured %s in %lld calls, analytic %lld sparse layers x 2 x %s = "
        "%s (measured / analytic %.3f: the routing's)\n",
        phase, format_mib(got, 3).c_str(), (long long)calls, (long long)S, format_mib(lb.exchange, 3).c_str(),
        format_mib(an, 3).c_str(), an > 0 ? got / an : 0.0);
  }
  const double counts = double(c.forward.bytes(kMoeCountsTag)), counts_an = double(S) * lb.counts;
  std::printf("moe counts bytes per rank: forward measured %.0f B, analytic %lld x %.0f B = %.0f B (%s)\n", counts,
              (long long)S, lb.counts, counts_an, counts == counts_an ? "equal" : "DIFFERENT");
  // The routing measured: rows per expert, summed over the loss group's ranks (each holds the same random
  // micro-batch here), for scripts to evaluate the formula on it.
  for (size_t l = 0; l < router.expert_load.size(); ++l) {
    std::string loads;
    for (double x : router.expert_load[l]) loads += fmt::format(" {:.0f}", x);
    std::printf("    moe_load[%zu]%s\n", l, loads.c_str());
  }
}

// fully_shard: the parameter gathers and the gradient reduce-scatters against fsdp_step_bytes.
void print_fsdp_bytes(const TrainRun& run, const MeasuredStep& c) {
  const int N = run.pd.dp_shard();
  const double slot = double(run.fsdp->slot_elements());
  const double grad_slot = double(run.fsdp->grad_slot_elements());  // the trainable parameters' (LoRA: adapters)
  const double pb = double(dtype_size(run.fsdp->options().param_dtype)),
               rb = double(dtype_size(run.fsdp->options().reduce_dtype));
  const bool reshard = run.fsdp->options().reshard_after_forward;
  const FsdpStepBytes an = fsdp_step_bytes(*run.fsdp, N);
  double f = double(c.forward.bytes("fsdp.")), b = double(c.backward.bytes("fsdp."));
  std::printf("\nfsdp bytes per rank: forward measured %s, analytic (%d-1) x %.0f elements x %.0f B = %s (%s)\n",
              format_mib(f, 3).c_str(), N, slot, pb, format_mib(an.forward, 3).c_str(),
              f == an.forward ? "equal" : "DIFFERENT");
  std::printf("fsdp bytes per rank: backward measured %s, analytic %s(%d-1) x %.0f x %.0f B reduce-scatter = %s (%s)\n",
              format_mib(b, 3).c_str(),
              reshard ? fmt::format("({}-1) x {:.0f} x {:.0f} B gather + ", N, slot, pb).c_str() : "", N, grad_slot, rb,
              format_mib(an.backward, 3).c_str(), b == an.backward ? "equal" : "DIFFERENT");
}

}  // namespace

void print_plan_layouts(const TrainRun& run) {
  const int tp_dim = run.pd.index(dim::tp);
  const int tp = run.mesh.size(tp_dim);
  print_model_and_mesh(run, tp);
  if (run.pd.cp() > 1) print_cp_split(run.config, run.pd, tp);
  print_parameters(run, tp_dim, tp);
  if (run.fsdp) print_fsdp(run);
  print_module_hooks(run);
  if (const PipelineState* pp = run.executor->pipeline()) print_pipeline(run, *pp);
}

MeasuredStep measure_plan_step(TrainRun& run) {
  const Config& cfg = run.config;
  std::mt19937 gen(1234);
  MeasuredStep c;
  if (run.executor->pipeline()) {
    // The schedule runs every micro-batch, forward and backward interleaved: counted as one phase.
    const Batch batch = random_batch(run.rows, cfg.training.seq_len, cfg.model.vocab_size, gen);
    zero_grads(run.params);
    reset_comm_counters();
    run.executor->forward_backward(run, batch, 1.0);
    c.forward = comm_counters();
  } else {
    measure_micro_batch(run, random_batch(run.micro, cfg.training.seq_len, cfg.model.vocab_size, gen), c);
  }
  reset_comm_counters();
  sync_gradients(run);
  c.sync = comm_counters();
  c.router = run.model->take_router_stats();
  return c;
}

void print_plan_bytes(const TrainRun& run, const MeasuredStep& c) {
  const Config& cfg = run.config;
  const ParallelDims& pd = run.pd;
  if (const PipelineState* pp = run.executor->pipeline()) return print_pp_bytes(*pp, c);
  std::printf(
      "\nbytes sent per rank in one micro-batch of %lld x %lld tokens (%lld on this rank; measured by the "
      "runtime):\n",
      (long long)run.micro, (long long)cfg.training.seq_len, (long long)run.shard.size());
  print_phase("forward", "forward", c.forward);
  print_phase("backward", "backward", c.backward);
  print_phase("gradient sync", "sync", c.sync);
  if (pd.tp() > 1 && cfg.parallel.sequence_parallel && cfg.parallel.tp_plan.empty()) print_tp_bytes(run, c);
  if (pd.cp() > 1) print_cp_bytes(run, c);
  if (cfg.model.moe.enabled() && pd.ep() > 1) print_moe_bytes(run, c);
  if (run.fsdp) print_fsdp_bytes(run, c);
  if (run.grad_sync) {
    const double an = double(run.grad_sync->bucket_bytes_per_rank()), m = double(c.sync.bytes(kGradReduceTag));
    std::printf("\ngradient buckets: measured %s, analytic 2 (n-1)/n x each bucket = %s (%s)\n",
                format_mib(m, 3).c_str(), format_mib(an, 3).c_str(), m == an ? "equal" : "DIFFERENT");
  }
  std::printf(
      "(the vocab-parallel loss adds 2 all-reduces over tp, of %lld row maxima and of twice as many sums, not "
      "counted above)\n",
      (long long)(run.micro * cfg.training.seq_len));
}

}  // namespace mt
