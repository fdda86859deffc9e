#include "runtime/train/pipeline.h"

#include <chrono>
#include <map>
#include <tuple>

#include "comm/comm_counters.h"
#include "runtime/core/fault.h"
#include "models/layers.h"
#include "parallel/style.h"
#include "runtime/core/allocator.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/log.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/metrics.h"
#include "runtime/train/run.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Every message of a step has its own tag: (micro-batch, the boundary's stage, activation or gradient). MPI
// matches by tag, so no two messages between the same ranks can be confused whatever order the two sides post.
int message_tag(const PpSchedule& s, int micro, int stage, bool grad) {
  return (micro * s.stages() + stage) * 2 + (grad ? 1 : 0);
}

// An MoE model's router statistics ride beside each activation and gradient (CausalLM::router_stats_forward): a
// message of their own, issued right after the boundary tensor's on both sides (NCCL pairs a peer's messages in
// issue order), tagged past every boundary tensor's tag.
int stats_tag(const PpSchedule& s, int micro, int stage, bool grad) {
  return message_tag(s, micro, stage, grad) + 2 * s.m * s.stages();
}

struct Transfer {
  Tensor buf;
  Work work;
  Tensor stats;  // (S) f64: the router statistics' message (undefined: none)
  Work stats_work;
};

// One step's actions on this rank, run in order. forward_only: the schedule's forwards and activation transfers
// (evaluation); no backward, no gradient messages.
class PipelineStep {
 public:
  PipelineStep(TrainRun& run, PipelineState& pp, const Batch& batch, double inv_tokens, bool forward_only)
      : run_(run), pp_(pp), s_(pp_.schedule), forward_only_(forward_only), inv_tokens_(inv_tokens),
        stats_numel_(forward_only ? 0 : run.model->router_stats_numel()) {
    const int64_t m = s_.m;
    for (int64_t i = 0; i < m; ++i) mbs_.push_back(local_micro_batch(run, batch, i * run.micro));
  }

  std::vector<Tensor> run() {
    CommTag tag(kPpTag);
    pp_.progress = [this] { poll(); };
    struct ClearProgress {
      PipelineState& pp;
      ~ClearProgress() { pp.progress = nullptr; }
    } clear_progress{pp_};
    const size_t base_bytes = allocator_stats(run_.device).allocated_bytes;
    reset_peak_allocated(run_.device);
    const auto t0 = Clock::now();
    PpStepTimes t;
    int in_flight = 0;
    const std::vector<PpAction>& actions = pp_.issue[forward_only_ ? 1 : 0];
    const size_t last_backward = grad_sync_start(actions);
    // Consecutive transfers form one batch (Group::batch_begin): on NCCL, a send does not complete before its peer
    // receives, and 1F1B's steady state has neighbours that each send before receiving from the other.
    bool in_batch = false;
    auto end_batch = [&] {
      if (in_batch) pp_.group->batch_end();
      in_batch = false;
    };
    for (size_t ai = 0; ai < actions.size(); ++ai) {
      const PpAction& a = actions[ai];
      if (!pp_runs(a, forward_only_)) continue;
      const bool transfer = a.op == PpOp::send_act || a.op == PpOp::send_grad || a.op == PpOp::recv_act ||
                            a.op == PpOp::recv_grad;
      if (transfer && !in_batch) pp_.group->batch_begin(), in_batch = true;
      if (!transfer) end_batch();
      if (ai == last_backward) run_.grad_sync->arm(true);
      run_action(a, t, in_flight);
      if (!in_batch) reap_sends();
    }
    end_batch();
    drain_sends(t);
    t.step_s = since(t0);
    t.peak_bytes = double(allocator_stats(run_.device).peak_allocated_bytes) - double(base_bytes);
    pp_.last = t;
    return std::move(losses_);
  }

 private:
  using Key = std::pair<int, int>;  // (stage, micro-batch)

  // The action after which the gradient sync is armed: with one chunk per rank and no deferred weight gradients,
  // this rank's last backward completes every gradient of its stage, so the sync's buckets start inside it
  // (overlapped), as without pp; else none (actions.size()).
  size_t grad_sync_start(const std::vector<PpAction>& actions) const {
    size_t last_backward = actions.size();
    const bool fsdp_holds = run_.fsdp && !run_.fsdp->options().reshard_after_forward;  // reduces after the step
    if (!forward_only_ && s_.v == 1 && !fsdp_holds)
      for (size_t i = 0; i < actions.size(); ++i)
        if (actions[i].op == PpOp::backward) last_backward = i;
    return last_backward;
  }

  // One action of the schedule: its compute time into t, and in_flight the forwards whose backward has not run.
  void run_action(const PpAction& a, PpStepTimes& t, int& in_flight) {
    const auto a0 = Clock::now();
    trace::Span span(pp_op_name(a.op), "pipeline");  // the action in the trace
    if (trace::Args* ta = span.args()) ta->stage = a.stage, ta->micro = a.micro, ta->peer = a.peer;
    switch (a.op) {
      case PpOp::recv_act:
        post_recv(acts_in_, a, /*grad=*/false);
        break;
      case PpOp::recv_grad:
        post_recv(grads_in_, a, /*grad=*/true);
        break;
      case PpOp::send_act:
        send(outs_, a, /*grad=*/false);
        break;
      case PpOp::send_grad:
        send(gouts_, a, /*grad=*/true);
        break;
      case PpOp::forward:
        forward(a, t);
        t.compute_s += since(a0);
        t.peak_in_flight = std::max(t.peak_in_flight, ++in_flight);
        break;
      case PpOp::backward:
      case PpOp::backward_input:
        backward(a, t);
        t.compute_s += since(a0);
        --in_flight;
        break;
      case PpOp::backward_weight: {
        auto it = wgrads_.find({a.stage, a.micro});
        MT_CHECK(it != wgrads_.end(), "pipeline", "stage {} micro-batch {}: W before its B", a.stage, a.micro);
        for (auto& f : it->second) f();
        wgrads_.erase(it);
        t.compute_s += since(a0);
        break;
      }
    }
  }

  // The sends still in flight: their buffers must outlive them, and the step ends when the neighbours have them;
  // then nothing may be left over.
  void drain_sends(PpStepTimes& t) {
    const auto w0 = Clock::now();
    trace::Span drain("drain sends", "pipeline");
    for (Transfer& tr : sends_) tr.work.wait(), tr.stats_work.wait();
    t.wait_s += since(w0);
    sends_.clear();
    MT_CHECK(acts_in_.empty() && grads_in_.empty() && outs_.empty() && gouts_.empty() && wgrads_.empty() &&
                 dlogits_.empty() && out_stats_.empty(),
             "pipeline", "the step ended with messages or gradients left over (a schedule bug)");
  }

  size_t chunk_of(int stage) const { return size_t(stage / s_.p); }
  const ModelChunk& chunk(int stage) const { return run_.model->chunks().at(chunk_of(stage)); }
  std::string what(const char* kind, const PpAction& a, int boundary_stage) const {
    return fmt::format("pp {} of stage {}, micro-batch {}, {} pp rank {}", kind, boundary_stage, a.micro,
                       a.op == PpOp::send_act || a.op == PpOp::send_grad ? "to" : "from", a.peer);
  }

  void post_recv(std::map<Key, Transfer>& into, const PpAction& a, bool grad) {
    fault_stop_point("pp transfer");  // the stuck-rank drill's hook (runtime/core/fault.h)
    // An activation comes from stage - 1 into this stage; a gradient from stage + 1.
    const int from_stage = grad ? a.stage + 1 : a.stage - 1;
    Transfer tr;
    tr.buf = empty(act_shape(), pp_.act_dtype, run_.device);
    tr.work = pp_.group->recv(tr.buf, a.peer, true, message_tag(s_, a.micro, grad ? from_stage : a.stage, grad),
                              what(grad ? "gradient" : "activation", a, from_stage));
    if (stats_numel_ > 0) {
      tr.stats = empty({stats_numel_}, DType::f64, run_.device);
      tr.stats_work =
          pp_.group->recv(tr.stats, a.peer, true, stats_tag(s_, a.micro, grad ? from_stage : a.stage, grad),
                          what(grad ? "router statistics' sum" : "router statistics", a, from_stage));
    }
    into[{a.stage, a.micro}] = std::move(tr);
  }

  // The received boundary tensor (and, with router statistics, stats: theirs).
  Tensor take(std::map<Key, Transfer>& from, const PpAction& a, PpStepTimes& t, Tensor* stats = nullptr) {
    auto it = from.find({a.stage, a.micro});
    MT_CHECK(it != from.end(), "pipeline", "stage {} micro-batch {}: no receive was posted for its input", a.stage,
             a.micro);
    const auto w0 = Clock::now();
    it->second.work.wait();
    it->second.stats_work.wait();
    t.wait_s += since(w0);
    t.compute_s -= since(w0);  // the caller counts the whole action as compute
    Tensor b = it->second.buf;
    if (stats) *stats = it->second.stats;
    from.erase(it);
    return b;
  }

  void send(std::map<Key, Tensor>& from, const PpAction& a, bool grad) {
    auto it = from.find({a.stage, a.micro});
    MT_CHECK(it != from.end(), "pipeline", "stage {} micro-batch {}: nothing to send", a.stage, a.micro);
    Transfer tr;
    tr.buf = it->second;
    MT_CHECK(tr.buf.shape() == act_shape(), "pipeline",
             "stage {} micro-batch {}: the {} has shape {} but the schedule's messages are {}", a.stage, a.micro,
             grad ? "gradient" : "activation", shape_str(tr.buf.shape()), shape_str(act_shape()));
    tr.work = pp_.group->send(tr.buf, a.peer, true, message_tag(s_, a.micro, grad ? a.stage : a.stage + 1, grad),
                              what(grad ? "gradient" : "activation", a, a.stage));
    from.erase(it);
    if (stats_numel_ > 0) {
      auto st = out_stats_.find({a.stage, a.micro, grad});
      MT_CHECK(st != out_stats_.end(), "pipeline", "stage {} micro-batch {}: no router statistics to send", a.stage,
               a.micro);
      tr.stats = st->second;
      tr.stats_work =
          pp_.group->send(tr.stats, a.peer, true, stats_tag(s_, a.micro, grad ? a.stage : a.stage + 1, grad),
                          what(grad ? "router statistics' sum" : "router statistics", a, a.stage));
      out_stats_.erase(st);
    }
    sends_.push_back(std::move(tr));
  }

  // Tests every transfer in flight (between layers): on transports that advance a message only inside MPI calls,
  // this keeps the neighbours' messages moving while this rank computes.
  void poll() {
    CommTag tag(kPpTag);
    for (auto& [k, tr] : acts_in_) tr.work.test(), tr.stats_work.test();
    for (auto& [k, tr] : grads_in_) tr.work.test(), tr.stats_work.test();
    for (Transfer& tr : sends_) tr.work.test(), tr.stats_work.test();
  }

  // Completed sends release their buffers (and testing lets MPI progress the others).
  void reap_sends() {
    std::erase_if(sends_, [](Transfer& tr) { return tr.work.test() && tr.stats_work.test(); });
  }

  // The messages between stages: (mb, T_local, C); a training step of a model with multi-token prediction carries
  // the next tokens' embeddings (from stage 0 to the MTP module on the last stage) as mb more rows.
  Shape act_shape() const {
    Shape s = pp_.act_shape;
    if (!forward_only_ && run_.model->wants_mtp()) s[0] *= 2;
    return s;
  }

  void set_micro(int micro) {
    run_.model->set_documents(mbs_[size_t(micro)].doc_start);
    set_lora_dropout_rows(mbs_[size_t(micro)].row_ids);
  }

  void forward(const PpAction& a, PpStepTimes& t) {
    const ModelChunk& c = chunk(a.stage);
    Tensor stats_in;                                                                        // (S) f64 or undefined
    Tensor x = c.first ? mbs_[size_t(a.micro)].inputs : take(acts_in_, a, t, &stats_in);  // (mb, T_local) or boundary
    SavedSlot slot(a.micro);
    set_micro(a.micro);
    if (const MicroBatch& mb = mbs_[size_t(a.micro)]; !forward_only_ && mb.mtp_inputs.defined())
      run_.model->set_mtp_batch(mb.mtp_inputs, mb.mtp_targets);
    Tensor y = [&] {
      NvtxRange range("forward");
      return run_.model->chunk_forward(chunk_of(a.stage), x);
    }();
    if (forward_only_) run_.model->release_saved();  // no backward follows
    // The router statistics so far travel on with the activation; the last stage starts their sum (MoE).
    if (stats_numel_ > 0) {
      Tensor flow = run_.model->router_stats_forward(stats_in, c.last);
      if (!c.last) out_stats_[{a.stage, a.micro, false}] = flow;
    }
    if (!c.last) {
      outs_[{a.stage, a.micro}] = y;
      return;
    }
    // The loss on the last stage; the logits become dloss/dlogits for the backward.
    const MicroBatch& mb = mbs_[size_t(a.micro)];
    Tensor losses = empty({mb.targets.numel()}, accum_dtype(y.dtype()), run_.device);  // (mb*T_local)
    NvtxRange range("loss");
    token_losses(run_, losses, forward_only_ ? Tensor() : as_rows(y), as_rows(y), mb.targets.reshape({-1}),
                 inv_tokens_);
    losses_.push_back(losses);
    for (Tensor& l : run_.model->take_extra_losses()) losses_.push_back(l);  // multi-token prediction's
    if (!forward_only_) dlogits_[{a.stage, a.micro}] = y;
  }

  void backward(const PpAction& a, PpStepTimes& t) {
    const ModelChunk& c = chunk(a.stage);
    Tensor dy;
    Tensor total;  // (S) f64: the router statistics' sum, arrived with the gradient (undefined: the last stage's own)
    if (c.last) {
      auto it = dlogits_.find({a.stage, a.micro});
      MT_CHECK(it != dlogits_.end(), "pipeline", "stage {} micro-batch {}: backward before forward", a.stage, a.micro);
      dy = it->second;
      dlogits_.erase(it);
    } else {
      dy = take(grads_in_, a, t, &total);
    }
    SavedSlot slot(a.micro);
    set_micro(a.micro);
    // Before the backward, whose first sparse layer needs the micro-batch's summed statistics (MoE).
    if (stats_numel_ > 0) {
      total = run_.model->router_stats_backward(total);
      if (!c.first) out_stats_[{a.stage, a.micro, true}] = total;
    }
    NvtxRange range("backward");
    Tensor dx;
    if (a.op == PpOp::backward_input) {
      DeferWeightGrads defer(&wgrads_[{a.stage, a.micro}]);
      dx = run_.model->chunk_backward(chunk_of(a.stage), dy);
    } else {
      dx = run_.model->chunk_backward(chunk_of(a.stage), dy);
    }
    if (!c.first) gouts_[{a.stage, a.micro}] = dx;
  }

  TrainRun& run_;
  PipelineState& pp_;
  const PpSchedule& s_;
  bool forward_only_;
  double inv_tokens_;
  std::vector<MicroBatch> mbs_;
  std::map<Key, Transfer> acts_in_, grads_in_;  // posted receives
  std::map<Key, Tensor> outs_, gouts_;          // forward outputs and input gradients waiting for their send
  std::map<Key, Tensor> dlogits_;               // last stage: dloss/dlogits until the backward
  std::map<Key, WeightGradQueue> wgrads_;       // zb1p: deferred weight gradients until W
  std::vector<Transfer> sends_;                 // in flight
  int64_t stats_numel_;                         // an MoE model's router statistics per message (0: none)
  std::map<std::tuple<int, int, bool>, Tensor> out_stats_;  // (stage, micro, gradient): statistics to send
  std::vector<Tensor> losses_;
};

// Hooks on the stage's decoder layers (post_forward, post_backward) that call pp.progress when set.
void install_pp_progress(CausalLM& model, PipelineState& pp) {
  PipelineState* state = &pp;
  auto call = [state](Module&) {
    if (state->progress) state->progress();
  };
  for (Module* m : model.modules())
    if (pattern_matches("model.layers.*", m->name())) {
      m->post_forward.push_back(call);
      m->post_backward.push_back(call);
    }
}

}  // namespace

PipelineState plan_pipeline(const Config& cfg, const ParallelDims& pd, int64_t micro, int64_t micro_batches) {
  const auto& p = cfg.parallel;
  const auto& c = cfg.model;
  PipelineState st;
  const int pp = pd.pp_size();
  if (pp == 1) {
    MT_CHECK(p.pp_virtual == 1, "config", "parallel.pp_virtual = {} needs parallel.pp > 1", p.pp_virtual);
    MT_CHECK(p.pp_layers.empty(), "config", "parallel.pp_layers is given but parallel.pp = 1 (one stage)");
    build_pp_schedule(p.pp_schedule, 1, 1, 1);  // the name is checked even unused (the error lists the kinds)
    return st;
  }
  MT_CHECK(micro_batches >= pp, "config",
           "parallel.pp = {} needs at least {} micro-batches per step, but training.batch_size / dp / "
           "training.micro_batch_size = {} / {} / {} = {}: lower training.micro_batch_size (or raise batch_size)",
           pp, pp, cfg.training.batch_size, pd.dp(), micro, micro_batches);
  MT_CHECK(!(p.pp_schedule == "zb1p" && pd.dp_shard() > 1), "config",
           "parallel.pp_schedule = zb1p with parallel.dp_shard = {}: fully_shard reduce-scatters a unit's gradients "
           "right after its backward, before zb1p's deferred weight gradients exist; use 1f1b or "
           "interleaved_1f1b with dp_shard, or dp_replicate with zb1p",
           pd.dp_shard());
  MT_CHECK(!c.tie_embeddings, "config",
           "model.tie_embeddings = true with parallel.pp = {}: the embedding (stage 0) and lm_head (the last stage) "
           "would share one weight across stages; untie them or run without pipeline parallel",
           pp);
  st.schedule = build_pp_schedule(p.pp_schedule, pp, p.pp_virtual, int(micro_batches));
  // The embedding and lm_head counted in decoder layers by their FLOPs: lm_head's 6 V d per token against a
  // layer's share of the model's; the embedding is a lookup.
  const ModelFamily& family = family_of(c);
  const double lm_head = 6.0 * double(c.vocab_size) * double(c.dim);
  const double per_layer =
      std::max(1.0, (family.flops_per_token(c, cfg.training.seq_len) - lm_head) / double(c.n_layers));
  st.split = pp_layer_split(c.n_layers, pp * p.pp_virtual, 0.0, lm_head / per_layer, p.pp_layers);
  return st;
}

std::vector<PpStepTimes> gather_pp_times(const PipelineState& pp) {
  constexpr int64_t k = 5;
  Tensor mine = empty({k}, DType::f64);
  const PpStepTimes& t = pp.last;
  const double v[k] = {t.step_s, t.compute_s, t.wait_s, double(t.peak_in_flight), t.peak_bytes};
  for (int64_t i = 0; i < k; ++i) mine.at<double>(i) = v[i];
  const int n = pp.group->size();
  Tensor all = empty({k * n}, DType::f64, pp.act_device);
  pp.group->all_gather(all, mine.to(pp.act_device));
  const std::vector<double> h = to_f64(all);
  std::vector<PpStepTimes> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const double* x = &h[size_t(r * k)];
    out[size_t(r)] = {x[0], x[1], x[2], int(x[3]), x[4]};
  }
  return out;
}

namespace {

// The run's StepExecutor under pipeline parallel: owns the plan and runs a PipelineStep per step.
class PipelineExecutor final : public StepExecutor {
 public:
  PipelineExecutor(TrainRun& run, PipelineState plan)
      : pp_(std::move(plan)), log_every_(std::max<int64_t>(1, run.config.log.interval)) {
    // This rank's stages: the other stages' modules are destroyed before any parameter has storage.
    pp_.rank = run.pd.pp_rank(run.world_mesh);
    pp_.group = &run.world_mesh.group(dim::pp);
    const int64_t seq_split = run.config.parallel.sequence_parallel && run.pd.tp() > 1 ? run.pd.tp() : 1;
    pp_.seq_split = seq_split;
    pp_.act_shape = {run.micro, run.shard.size() / seq_split, run.config.model.dim};  // (mb, T_local, C)
    pp_.act_dtype = run.dtype;
    pp_.act_device = run.device;
    // NCCL's batches block until the peers post their halves (pp_batches_deadlock): where the schedule's own lists
    // would wait on each other there (interleaved_1f1b), the transfers are re-placed in lockstep, every rank alike;
    // lists that would still hang are refused here rather than in the first step.
    const PpSchedule& s = pp_.schedule;
    for (int forward_only : {0, 1}) {
      pp_.issue[forward_only] = s.ranks[size_t(pp_.rank)];
      if (pp_.group->backend() != "nccl") continue;
      const std::string why = pp_batches_deadlock(s, forward_only);
      if (why.empty()) continue;
      const PpSchedule lockstep = pp_lockstep_lists(s, forward_only);
      const std::string still = pp_batches_deadlock(lockstep, forward_only);
      MT_CHECK(still.empty(), "config",
               "parallel.pp_schedule = {} (pp {}, pp_virtual {}, {} micro-batches) would hang on NCCL{}: {}; use "
               "1f1b, gpipe or zb1p there, or comm.backend = mpi",
               s.kind, s.p, s.v, s.m, forward_only ? " in evaluation" : "", still);
      pp_.issue[forward_only] = lockstep.ranks[size_t(pp_.rank)];
      if (!forward_only)
        MT_LOG_INFO("pipeline: {}'s transfers placed in lockstep for NCCL (its own lists would wait on each other "
                 "there: {})",
                 s.kind, why);
    }
  }

  void install(CausalLM& model) override { install_pp_progress(model, pp_); }

  std::vector<Tensor> forward_backward(TrainRun& run, const Batch& batch, double inv_tokens) override {
    // The gradient sync waits for the last of this rank's actions (PipelineStep arms it at the last backward
    // when that one completes the stage's gradients).
    run.grad_sync->arm(false);
    run.model->set_loss_scale(inv_tokens);  // the balance loss weighs like the token losses
    // fully_shard without resharding: each unit gathered once and reduce-scattered once per step, not once per
    // micro-batch.
    const bool hold = run.fsdp && !run.fsdp->options().reshard_after_forward;
    if (hold) run.fsdp->hold();
    std::vector<Tensor> losses = PipelineStep(run, pp_, batch, inv_tokens, false).run();
    run.model->set_loss_scale(0);
    if (hold) run.fsdp->release();
    return losses;
  }

  void forward_loss(const Tensor& loss_sum, TrainRun& run, const Batch& batch) override {
    for (const Tensor& l : PipelineStep(run, pp_, batch, 1.0, true).run()) sum_into(loss_sum, 0, l);
  }

  std::vector<double> sum_over_stages(const std::vector<double>& v) const override {
    Tensor t = empty({int64_t(v.size())}, DType::f64);
    for (size_t i = 0; i < v.size(); ++i) t.at<double>(int64_t(i)) = v[i];
    Tensor d = t.to(pp_.act_device);
    pp_.group->all_reduce(d, ReduceOp::sum);
    return to_f64(d);
  }

  Tensor sample_logits(CausalLM& model, const Tensor& ctx) const override {
    // Each stage in turn (blocking transfers in stage order: no cycle), the boundary (1, T/tp under sequence
    // parallel, C) in the compute dtype.
    const int64_t T = ctx.size(1);
    Tensor h = ctx.to(pp_.act_device);
    for (size_t k = 0; k < model.chunks().size(); ++k) {
      const ModelChunk& c = model.chunks()[k];
      if (!c.first) {
        h = empty(pp_.sample_shape(T), pp_.act_dtype, pp_.act_device);
        pp_.group->recv(h, pp_.schedule.rank_of(c.stage - 1), false, 0, "pp sample's activation");
      }
      h = model.chunk_forward(k, h);
      model.release_saved();
      if (!c.last) pp_.group->send(h, pp_.schedule.rank_of(c.stage + 1), false, 0, "pp sample's activation");
    }
    return model.has_output() ? h : Tensor();  // (1, T, V or V/tp) on the last stage
  }

  int32_t share_token(int32_t token) const override {
    // The last stage's token to every stage.
    Tensor t = zeros({1}, DType::i32);
    t.at<int32_t>(0) = token;
    Tensor d = t.to(pp_.act_device);
    pp_.group->broadcast(d, pp_.schedule.rank_of(pp_.schedule.stages() - 1));
    return to_f64(d)[0] >= 0 ? int32_t(to_f64(d)[0]) : 0;
  }

  Group* stage_group() const override { return pp_.group; }
  const PipelineState* pipeline() const override { return &pp_; }

  std::string describe() const override {
    const PpSchedule& s = pp_.schedule;
    std::string split;
    for (int n : pp_.split) split += (split.empty() ? "" : ", ") + std::to_string(n);
    return fmt::format("pipeline: {} stages on pp = {} (pp_virtual {}), decoder layers per stage [{}]; schedule {} "
                       "over {} micro-batches of {}: bubble {:.3f} by its formula; boundary {} {} per message",
                       s.stages(), s.p, s.v, split, s.kind, s.m, pp_.act_shape[0],
                       pp_bubble_formula(s.kind, s.p, s.v, s.m), shape_str(pp_.act_shape), dtype_name(pp_.act_dtype));
  }

  // Every pp rank's timers of the step (gathered over pp), as a metrics record; the bubble on the console at the
  // log interval.
  void log_step(MetricsLogger& log, int64_t step) override {
    const std::vector<PpStepTimes> all = gather_pp_times(pp_);
    const PpSchedule& s = pp_.schedule;
    nlohmann::json j;
    j["step"] = step + 1;
    j["pp_schedule"] = s.kind;
    double bubble = 0, peak = 0;
    for (const PpStepTimes& t : all) {
      j["pp_step_s"].push_back(t.step_s);
      j["pp_compute_s"].push_back(t.compute_s);
      j["pp_wait_s"].push_back(t.wait_s);
      j["pp_bubble"].push_back(t.bubble());
      j["pp_in_flight"].push_back(t.peak_in_flight);
      j["pp_peak_bytes"].push_back(t.peak_bytes);
      bubble += t.bubble() / double(all.size());
      peak = std::max(peak, t.peak_bytes);
    }
    j["pp_bubble_formula"] = pp_bubble_formula(s.kind, s.p, s.v, s.m);
    log.record(j);
    if ((step + 1) % log_every_ == 0)
      log.note(fmt::format("pipeline step {}: bubble {:.3f} (mean over {} stages; {} formula {:.3f}), peak "
                           "activations {:.2f} MiB, up to {} micro-batches in flight",
                           step + 1, bubble, all.size(), s.kind, pp_bubble_formula(s.kind, s.p, s.v, s.m),
                           peak / (1 << 20), all.front().peak_in_flight));
  }

 private:
  PipelineState pp_;   // the plan, this rank's place in it, and the last step's timers
  int64_t log_every_;  // log.interval: the console's bubble line
};

}  // namespace

std::unique_ptr<StepExecutor> make_pipeline_executor(TrainRun& run, PipelineState plan) {
  return std::make_unique<PipelineExecutor>(run, std::move(plan));
}

}  // namespace mt
