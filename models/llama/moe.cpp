// The sparse MoE block: router, dispatch, the experts' grouped GEMMs (here or over the ep group), combine; and
// the balance loss's statistics (moe.h).
#include "models/llama/moe.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <optional>

#include <spdlog/spdlog.h>

#include "comm/comm_counters.h"
#include "models/llama/llama.h"
#include "models/moe_cost.h"
#include "runtime/kernels/ops.h"

namespace mt {

bool MoeConfig::sparse_layer(int64_t i) const {
  if (n_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), int(i)) != mlp_only_layers.end()) return false;
  return (i + 1) % std::max<int64_t>(decoder_sparse_step, 1) == 0;
}

// ---- MoeContext

MoeContext::Micro& MoeContext::fresh_micro() {
  Micro& m = *micro_;
  m = Micro{};
  const int64_t E = config.n_experts;
  m.stats = zeros({n_sparse * E + E + 2}, DType::f64, device);  // (L E + E + 2)
  m.seen.assign(size_t(n_sparse), false);
  m.prob_sums = zeros({E}, acc, device);
  return m;
}

void MoeContext::record(int64_t layer, int64_t tokens_here, const Tensor& selected, const Tensor& prob_sums,
                        const Tensor& dropped) {
  // A forward after this slot's sum started (or after a forward with none: evaluation) starts the statistics over.
  Micro* m = &*micro_;
  if (m->sum || !m->stats.defined() || m->seen.at(size_t(layer))) m = &fresh_micro();
  m->seen[size_t(layer)] = true;
  add_(m->prob_sums, prob_sums);
  moe_stats_record(m->stats, selected, m->prob_sums, dropped, layer, tokens_here);
}

void MoeContext::start_sum(Micro& m) {
  if (!m.stats.defined()) fresh_micro();  // a stage without sparse layers adds zeros
  m.sum = std::make_shared<Sum>();
  m.sum->loss_scale = loss_scale;
  m.sum->buf = m.stats;  // summed in place: the next forward's record starts a fresh buffer
  if (tokens && tokens->size() > 1) {
    CommTag tag("moe.stats");
    m.sum->work = tokens->all_reduce(m.sum->buf, ReduceOp::sum, /*async=*/true);
  }
  pending_.push_back(m.sum);
}

void MoeContext::forward_done() {
  Micro& m = *micro_;
  // A pipeline stage without sparse layers records nothing, so no forward starts its slot over: the last step's
  // sum (taken) would stand, and the other stages would wait for this rank's zeros in the step's sum.
  if (m.sum && m.sum->taken) fresh_micro();
  if (!m.sum) start_sum(m);
}

Tensor MoeContext::chunk_flow(const Tensor& in, bool last) {
  Micro& m = *micro_;
  // This chunk's records (a record after a finished sum started a fresh buffer; none: zeros), then restarted, so
  // that this rank's next chunk of the micro-batch (interleaved schedules) adds only its own.
  Tensor flow = m.stats.defined() && !m.sum ? m.stats : zeros({stats_numel()}, DType::f64, device);  // (S) f64
  m = Micro{};
  if (in.defined()) moe_stats_add(flow, in);
  if (!last) return flow;
  m.stats = flow;
  start_sum(m);
  return Tensor();
}

Tensor MoeContext::chunk_total(const Tensor& in) {
  Micro& m = *micro_;
  if (!in.defined()) {  // the last stage: its own sum
    MT_CHECK(m.sum && !m.sum->taken, "model", "router statistics: a last stage's backward before its forward's sum");
    wait(*m.sum);
    return m.sum->buf;
  }
  // Every chunk of this rank gets the same total; the first to arrive is the micro-batch's sum.
  if (m.sum && !m.sum->taken) {
    wait(*m.sum);
    return m.sum->buf;
  }
  m = Micro{};
  m.sum = std::make_shared<Sum>();
  m.sum->loss_scale = loss_scale;
  m.sum->buf = in;
  m.sum->waited = true;  // arrived summed
  pending_.push_back(m.sum);
  return in;
}

void MoeContext::wait(Sum& s) {
  if (s.waited) return;
  s.waited = true;
  s.work.wait();
}

Tensor MoeContext::aux_grad_row() {
  Micro& m = *micro_;
  if (!m.sum) start_sum(m);  // an executor that did not call forward_done: summed now
  Sum& s = *m.sum;
  if (s.grad_done) return s.grad_row;
  s.grad_done = true;
  wait(s);
  // On the device from the summed buffer: no host read in the backward.
  if (!config.output_router_logits || s.loss_scale <= 0) return s.grad_row;
  s.grad_row = empty({config.n_experts}, acc, device);  // (E)
  moe_aux_grad_row(s.grad_row, s.buf, n_sparse, config.router_aux_loss_coef, s.loss_scale);
  return s.grad_row;
}

void MoeContext::parse(Sum& s, const double* buf) {
  s.taken = true;
  const int64_t E = config.n_experts, L = n_sparse;
  const double R = buf[size_t(L * E + E)];  // token rows: tokens x sparse layers, every rank's
  std::vector<double> C(size_t(E), 0.0);
  if (step_.expert_load.empty()) step_.expert_load.assign(size_t(L), std::vector<double>(size_t(E), 0.0));
  if (last_load_.size() != size_t(L * E)) last_load_.assign(size_t(L * E), 0.0);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t e = 0; e < E; ++e) {
      const double c = buf[size_t(l * E + e)];
      C[size_t(e)] += c;
      step_.expert_load[size_t(l)][size_t(e)] += c;
      last_load_[size_t(l * E + e)] += c;
    }
  step_.dropped += int64_t(buf[size_t(L * E + E + 1)]);
  step_.any = true;
  if (!config.output_router_logits || s.loss_scale <= 0 || R <= 0) return;
  // aux = coef E / R^2 sum_e C_e S_e, entering the loss weighted by the micro-batch's share of the step's tokens
  // (R / n_sparse of them): the loss stays the mean over micro-batches, as the token losses are. (Its gradient
  // row, the same formula's derivative, was computed on the device: moe_aux_grad_row.)
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) aux += C[size_t(e)] * buf[size_t(L * E + e)];
  const double coef = config.router_aux_loss_coef, weight = R / double(L) * s.loss_scale;
  aux *= coef * double(E) / (R * R);
  step_.aux_loss += weight * aux;
}

Tensor MoeContext::pending_stats() {
  reading_ = pending_;
  if (reading_.empty()) return Tensor();
  const int64_t S = config.n_experts * (n_sparse + 1) + 2;
  Tensor all = empty({S * int64_t(reading_.size())}, DType::f64, device);  // (sums x S)
  for (size_t i = 0; i < reading_.size(); ++i) {
    wait(*reading_[i]);  // stream-ordered on a device: no host wait
    copy_slice(all, int64_t(i) * S, reading_[i]->buf, 0, S, 0);
  }
  return all;
}

RouterStepStats MoeContext::take_step_stats(const std::vector<double>* values) {
  // Sums no backward took (a stage without sparse layers) are read too.
  std::vector<double> own;
  if (!values) {
    Tensor all = pending_stats();
    if (all.defined()) own = to_f64(all);
    values = &own;
  }
  const size_t S = size_t(config.n_experts * (n_sparse + 1) + 2);
  MT_CHECK(values->size() == S * reading_.size(), "model", "router statistics: {} values read for {} sums of {}",
           values->size(), reading_.size(), S);
  for (size_t i = 0; i < reading_.size(); ++i) parse(*reading_[i], values->data() + i * S);
  std::erase_if(pending_, [](const std::shared_ptr<Sum>& p) { return p->taken; });
  reading_.clear();
  RouterStepStats s = std::move(step_);
  step_ = RouterStepStats{};
  s.dispatch_s = dispatch_s;
  dispatch_s = 0;
  if (!biases.empty()) {  // aux-loss-free balancing: its range from the host copy (no read)
    s.has_bias = true;
    s.bias_min = INFINITY, s.bias_max = -INFINITY;
    for (const std::vector<double>& b : bias_values)
      for (double v : b) s.bias_min = std::min(s.bias_min, v), s.bias_max = std::max(s.bias_max, v);
  }
  return s;
}

void MoeContext::add_bias(int64_t E) {
  biases.push_back(zeros({E}, acc, device));
  bias_values.emplace_back(size_t(E), 0.0);
}

void MoeContext::set_bias(size_t l, const std::vector<double>& v) {
  const Tensor host = from_values(v, {int64_t(v.size())}, biases.at(l).dtype());  // rounded once, on the host
  std::vector<double>& mirror = bias_values.at(l);
  mirror.resize(v.size());
  for (size_t e = 0; e < v.size(); ++e)  // the rounded values, read from host memory (no device read)
    mirror[e] = host.dtype() == DType::f64 ? host.data<double>()[e] : double(host.data<float>()[e]);
  copy_(biases[l], host.to(biases[l].device()));
}

void MoeContext::update_biases() {
  if (biases.empty() || config.bias_update_rate <= 0 || last_load_.empty()) return;
  const int64_t E = config.n_experts;
  for (size_t l = 0; l < biases.size(); ++l) {
    std::vector<double> b = bias_values[l];
    double mean = 0;
    for (int64_t e = 0; e < E; ++e) mean += last_load_[l * size_t(E) + size_t(e)] / double(E);
    for (int64_t e = 0; e < E; ++e) {
      const double load = last_load_[l * size_t(E) + size_t(e)];
      b[size_t(e)] += config.bias_update_rate * double((mean > load) - (mean < load));
    }
    set_bias(l, b);
  }
  last_load_.assign(last_load_.size(), 0.0);
}

// ---- MoeExperts

MoeExperts::MoeExperts(const std::string& name, int64_t E, int64_t C, int64_t F, const MoeNames& n,
                       const ParamFactory& f)
    : Module(name, "MoeExperts"), n_experts(E), dim(C), ffn_dim(F) {
  auto stacked = [&](const std::string& proj) { return child_name(name, "*." + proj + ".weight"); };
  gate_proj = add_parameter(f.make(stacked(n.gate), {E, F, C}, "normal"));
  up_proj = add_parameter(f.make(stacked(n.up), {E, F, C}, "normal"));
  down_proj = add_parameter(f.make(stacked(n.down), {E, C, F}, "normal"));
}

Tensor MoeExperts::forward(const Tensor& x) {
  const int64_t M = x.size(0), F = gate_proj->compute_local().size(1);
  Tensor g = empty({M, F}, x.dtype(), x.device()), u = empty({M, F}, x.dtype(), x.device());  // (M, F)
  Tensor y = empty({M, dim}, x.dtype(), x.device());                                           // (M, C)
  if (M > 0) {
    grouped_matmul_forward(g, x, gate_proj->compute_local(), offsets);  // rows past the groups: 0
    grouped_matmul_forward(u, x, up_proj->compute_local(), offsets);
    Tensor a = empty({M, F}, x.dtype(), x.device());  // (M, F) silu(g) * u
    swiglu_forward(a, g, u);
    grouped_matmul_forward(y, a, down_proj->compute_local(), offsets);
  }
  x_ = x, gate_ = g, up_ = u, offsets_ = offsets;
  return y;
}

Tensor MoeExperts::backward(const Tensor& dy) {
  const Tensor x = x_, g = gate_, u = up_, cnt = offsets_;
  drop_saved();
  const int64_t M = x.size(0), F = g.size(1);
  Tensor dx = empty({M, dim}, dy.dtype(), dy.device());  // (M, C)
  if (M == 0) return dx;
  Tensor a = empty({M, F}, x.dtype(), x.device());  // recomputed: cheaper to keep g and u only
  swiglu_forward(a, g, u);
  Tensor da = empty({M, F}, dy.dtype(), dy.device());
  grouped_matmul_backward(da, down_proj->grad_or_none(), dy, a, down_proj->compute_local(), cnt);
  Tensor dg = empty({M, F}, dy.dtype(), dy.device()), du = empty({M, F}, dy.dtype(), dy.device());
  swiglu_backward(dg, du, da, g, u);
  grouped_matmul_backward(dx, gate_proj->grad_or_none(), dg, x, gate_proj->compute_local(), cnt);
  Tensor dx_up = empty({M, dim}, dy.dtype(), dy.device());
  grouped_matmul_backward(dx_up, up_proj->grad_or_none(), du, x, up_proj->compute_local(), cnt);
  add_(dx, dx_up);
  return dx;
}

void MoeExperts::drop_saved() {
  x_ = Tensor();
  gate_ = Tensor();
  up_ = Tensor();
  offsets_ = Tensor();
}

// ---- SparseMoeBlock

SparseMoeBlock::SparseMoeBlock(const std::string& name, const ModelConfig& c, const MoeNames& names, int64_t index,
                               const ParamFactory& f, std::shared_ptr<MoeContext> ctx)
    : Module(name, "SparseMoeBlock"), sparse_index(index), ctx_(std::move(ctx)) {
  const MoeConfig& m = c.moe;
  gate = add_child(std::make_unique<Linear>(child_name(name, "gate"), c.dim, m.n_experts, f));
  gate->fp8_exempt = true;  // training.fp8: the router stays bf16 (its scores pick experts)
  experts = add_child(std::make_unique<MoeExperts>(child_name(name, "experts"), m.n_experts, c.dim, m.ffn_dim, names, f));
  if (m.shared_expert_ffn_dim > 0) {
    ModelConfig sc = c;
    sc.ffn_dim = m.shared_expert_ffn_dim;
    shared_expert = add_child(std::make_unique<LlamaMLP>(child_name(name, names.shared), sc, f));
    if (names.shared_gate)
      shared_expert_gate = add_child(std::make_unique<Linear>(child_name(name, "shared_expert_gate"), c.dim, 1, f));
    if (shared_expert_gate) shared_expert_gate->fp8_exempt = true;  // a router-like gate: bf16
  }
  if (names.score_bias) {  // a buffer in transformers: loaded and saved with the weights, never trained
    score_bias = add_parameter(f.make(child_name(name, "gate.e_score_correction_bias"), {m.n_experts}, "zeros"));
    score_bias->weight_decay = false;
    freeze(*score_bias);
  }
}

// ---- Bounded dropless expert parallel (moe.h's header)

bool MoeContext::bounded() const {
  return ep && ep->size() > 1 && config.capacity_factor <= 0 && config.dropless_bound > 0;
}

bool MoeContext::bounded_forward() const { return bounded() && loss_scale > 0; }

int64_t MoeContext::bound_cap(int64_t n_tokens) const {
  const double mean = double(n_tokens * config.experts_per_token) / double(config.n_experts);  // rows per expert
  const int64_t cap = std::max<int64_t>(1, int64_t(std::ceil(bound * mean)));
  return std::min(cap, std::max<int64_t>(n_tokens, 1));
}

void MoeContext::raise_bound(int64_t step) {
  // E / K: ceil(f N K / E) = N, the most one rank's tokens can send an expert (top-k picks k distinct experts).
  const double most = double(config.n_experts) / double(config.experts_per_token);
  MT_CHECK(bound < most, "model", "moe: step {} had rows past the dropless bound f = {}, which already gives an "
           "expert every token's row", step, bound);
  const double was = bound;
  clean_steps = 0;
  bound = std::min(bound * 1.5, most);
  spdlog::info("moe: dropless expert parallel: step {} had rows past the bound (f = {:g}); recomputed with f = {:g} "
               "(up to {} rows per expert per rank)", step, was, bound, bound_cap(bound_tokens));
}

void MoeContext::settle_bound(int64_t step) {
  if (bound <= config.dropless_bound || ++clean_steps < kBoundSettleSteps) return;
  clean_steps = 0;
  const double was = bound;
  bound = std::max(config.dropless_bound, bound / 1.5);
  spdlog::info("moe: dropless expert parallel: no rows past the bound for {} steps (to step {}): lowered from f = "
               "{:g} to {:g} (up to {} rows per expert per rank)",
               kBoundSettleSteps, step, was, bound, bound_cap(bound_tokens));
}

namespace {

// Rows kept per expert with a capacity (moe.capacity_factor > 0), from this rank's routed rows; 0: dropless.
int64_t capacity_of(const MoeConfig& mc, int64_t routed, int64_t E) {
  if (mc.capacity_factor <= 0) return 0;
  return std::max<int64_t>(1, int64_t(std::ceil(mc.capacity_factor * double(routed) / double(E))));
}

Tensor i32_tensor(const std::vector<int32_t>& v, const Shape& shape, Device d) {
  Tensor t = empty(shape, DType::i32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t.to(d);
}

Tensor identity_slot(int64_t n, Device d) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = int32_t(i);
  return i32_tensor(v, {n, 1}, d);
}

// sigmoid(gate) of each row (N, 1) through the router op (one expert, sigmoid scores): weights and probs alike.
Tensor sigmoid_rows(const Tensor& logits, Tensor& idx) {
  const int64_t N = logits.size(0);
  const DType acc = accum_dtype(logits.dtype());
  Tensor w = empty({N, 1}, acc, logits.device()), p = empty({N, 1}, acc, logits.device());
  idx = empty({N, 1}, DType::i32, logits.device());
  router_topk_forward(w, idx, p, logits, Tensor(), /*sigmoid=*/true, /*renormalize=*/false);
  return w;
}

}  // namespace

Tensor SparseMoeBlock::forward(const Tensor& x) {
  const MoeConfig& mc = ctx_->config;
  const Tensor xr = as_rows(x);  // (N, C)
  const int64_t N = xr.size(0), C = xr.size(1), E = mc.n_experts, K = mc.experts_per_token;
  const DType acc = accum_dtype(x.dtype());
  const Device dev = x.device();
  // 1. Router: probs (N, E) and the top-k weights (N, K) in f32 (f64 for f64 runs), as transformers computes them.
  Tensor logits = gate->call(xr);  // (N, E)
  Tensor probs = empty({N, E}, acc, dev), w = empty({N, K}, acc, dev), idx = empty({N, K}, DType::i32, dev);
  // The selection bias: DeepSeek-V3's e_score_correction_bias (in the router's dtype), plus the aux-loss-free
  // balancing's when it is on.
  Tensor bias = ctx_->biases.empty() ? Tensor() : ctx_->biases[size_t(sparse_index)];
  if (score_bias) {
    Tensor b = empty({E}, acc, dev);  // (E)
    convert(b, score_bias->compute_local());
    if (bias.defined()) add_(b, bias);
    bias = b;
  }
  router_topk_forward(w, idx, probs, logits, bias, mc.router_score == "sigmoid", mc.norm_topk_prob,
                      mc.routed_scaling_factor, mc.n_group, mc.topk_group);
  // 2. Rows grouped by expert on the device: the counts never reach the host, the buffers are sized by their upper
  //    bound (dropless: N K rows exactly; a capacity: at most E x capacity) and the GEMMs read the groups' offsets.
  //    Expert parallel with a capacity lays the rows out in fixed blocks of `capacity` per expert (padded).
  //    Bounded dropless expert parallel (a training forward) sends such blocks too, of the bound's rows.
  const bool bounded = ctx_->bounded_forward();
  if (bounded) ctx_->bound_tokens = N;
  const int64_t cap = bounded ? ctx_->bound_cap(N) : capacity_of(mc, N * K, E);
  const bool padded = cap > 0 && ctx_->ep && ctx_->ep->size() > 1;
  Tensor slot = empty({N, K}, DType::i32, dev), counts = empty({E}, DType::i32, dev),        // (N, K), (E)
      selected = empty({E}, DType::i32, dev), offsets = empty({E + 1}, DType::i32, dev),     // (E), (E + 1)
      dropped = empty({1}, DType::i32, dev);                                                 // (1)
  moe_route(slot, counts, selected, offsets, dropped, idx, cap, padded);
  if (!recomputing()) {
    Tensor prob_sums = zeros({E}, acc, dev);  // (E) column sums of probs
    bias_add_backward(prob_sums, probs);
    ctx_->record(sparse_index, N, selected, prob_sums, dropped);
  }
  const int64_t M = padded ? E * cap : cap > 0 ? std::min(N * K, E * cap) : N * K;
  Tensor xp = empty({M, C}, x.dtype(), dev);  // (M, C) grouped by expert (padded: E blocks of cap rows)
  if (M > 0) moe_dispatch_forward(xp, xr, slot);
  Tensor h = run_experts(xp, counts, offsets, cap);  // (M, C)
  Tensor y = empty({N, C}, x.dtype(), dev);
  moe_combine_forward(y, h, w, slot);
  // 3. The shared expert, gated per token (qwen2_moe).
  if (shared_expert && !shared_expert_gate) {  // DeepSeek: added as it is
    add_(y, as_rows(shared_expert->call(x)));
  } else if (shared_expert) {
    Tensor s = shared_expert->call(x);  // (B, T, C)
    Tensor sidx;
    Tensor sw = sigmoid_rows(shared_expert_gate->call(xr), sidx);  // (N, 1)
    Tensor ys = empty({N, C}, x.dtype(), dev), ident = identity_slot(N, dev);  // (N, C), (N, 1)
    moe_combine_forward(ys, as_rows(s), sw, ident);
    add_(y, ys);
    shared_out_ = s, shared_w_ = sw, shared_slot_ = ident;
  }
  probs_ = probs, weights_ = w, experts_idx_ = idx, slot_ = slot, h_ = h, in_shape_ = x.shape();
  return y.reshape(x.shape());
}

Tensor SparseMoeBlock::backward(const Tensor& dy) {
  const MoeConfig& mc = ctx_->config;
  const Tensor dyr = as_rows(dy);  // (N, C)
  const int64_t N = dyr.size(0), C = dyr.size(1), E = mc.n_experts;
  const DType acc = accum_dtype(dy.dtype());
  const Device dev = dy.device();
  const Tensor w = weights_, slot = slot_;
  // 1. Combine's transpose: the experts' output gradients (M, C) and the routing weights' (N, K); then the experts'
  //    output is released (nothing else holds it) before their backward.
  Tensor dh = empty(h_->shape(), dy.dtype(), dev), dw = empty(w.shape(), acc, dev);
  moe_combine_backward(dh, dw, dyr, h_, w, slot);
  h_ = Tensor();
  // 2. Through the experts and back to the tokens.
  Tensor dxp = run_experts_backward(dh);  // (M, C)
  Tensor dx = empty({N, C}, dy.dtype(), dev);
  moe_dispatch_backward(dx, dxp, slot);
  // 3. The router: the weights' gradient and the balance loss's (one row for every token).
  Tensor dlogits = empty({N, E}, dy.dtype(), dev);
  router_topk_backward(dlogits, dw, ctx_->aux_grad_row(), probs_, w, experts_idx_,
                       mc.router_score == "sigmoid", mc.norm_topk_prob, mc.routed_scaling_factor);
  add_(dx, gate->call_backward(dlogits));
  // 4. The shared expert and its gate.
  if (shared_expert && !shared_expert_gate) {
    add_(dx, as_rows(shared_expert->call_backward(dy)));
  } else if (shared_expert) {
    const Tensor s = shared_out_, sw = shared_w_, ident = shared_slot_;
    Tensor ds = empty({N, C}, dy.dtype(), dev), dsw = empty({N, 1}, acc, dev);
    moe_combine_backward(ds, dsw, dyr, as_rows(s), sw, ident);
    Tensor dgl = empty({N, 1}, dy.dtype(), dev), sidx = zeros({N, 1}, DType::i32).to(dev);
    router_topk_backward(dgl, dsw, Tensor(), sw, sw, sidx, /*sigmoid=*/true, /*renormalize=*/false);
    add_(dx, shared_expert_gate->call_backward(dgl));
    add_(dx, as_rows(shared_expert->call_backward(ds.reshape(s.shape()))));
  }
  drop_saved();
  return dx.reshape(in_shape_);
}

void SparseMoeBlock::drop_saved() {
  probs_ = Tensor(), weights_ = Tensor(), experts_idx_ = Tensor(), slot_ = Tensor(), h_ = Tensor();
  shared_out_ = Tensor(), shared_w_ = Tensor(), shared_slot_ = Tensor(), order_ = Tensor();
  local_offsets_ = Tensor();
}

// ---- The experts here, or over the ep group

namespace {

// Expert parallel's exchange plan: rows by (source rank, local expert) arrive one source after another; the
// experts want them by (local expert, source). order (R, 1): the expert-major row of each arrived row.
struct Exchange {
  std::vector<int64_t> send, recv;  // rows per peer
  std::vector<int64_t> local;       // (E_local) rows per local expert, every source's
  std::vector<int32_t> order;
};

// Dropless: the sizes depend on the routing, so the host reads them: this rank's counts (E) and, after the counts'
// all-to-all on the device, every source's for the local experts, in one read (the layer's one host sync).
Exchange plan_exchange(Group& ep, const Tensor& counts) {
  const int P = ep.size();
  const int64_t E = counts.numel(), El = E / P;
  Tensor both = empty({2 * E}, DType::i32, counts.device());  // (2 E): mine, then (P, E_local) source s's for my j
  copy_slice(both, 0, counts, 0, E, 0);
  {
    CommTag tag(kMoeCountsTag);
    ep.all_to_all(both.view(E, {E}), counts);
  }
  const std::vector<double> host = to_f64(both);
  const double *mine = host.data(), *n = host.data() + E;
  Exchange x{std::vector<int64_t>(size_t(P), 0), std::vector<int64_t>(size_t(P), 0),
             std::vector<int64_t>(size_t(El), 0), {}};
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < El; ++j) {
      x.send[size_t(p)] += int64_t(mine[p * El + j]);
      x.recv[size_t(p)] += int64_t(n[p * El + j]);
      x.local[size_t(j)] += int64_t(n[p * El + j]);
    }
  std::vector<int64_t> begin(size_t(El), 0);  // expert j's first row, then the next free one
  for (int64_t j = 1; j < El; ++j) begin[size_t(j)] = begin[size_t(j) - 1] + x.local[size_t(j) - 1];
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < El; ++j)
      for (int64_t i = 0; i < int64_t(n[p * El + j]); ++i) x.order.push_back(int32_t(begin[size_t(j)]++));
  return x;
}

// The groups' first rows (G + 1) i32 on the device from host counts.
Tensor offsets_of(const std::vector<int64_t>& counts, Device d) {
  std::vector<int32_t> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) o[g + 1] = o[g] + int32_t(counts[g]);
  return i32_tensor(o, {int64_t(o.size())}, d);
}

std::vector<int64_t> times(std::vector<int64_t> v, int64_t k) {
  for (int64_t& x : v) x *= k;
  return v;
}

// Adds the wall time of its scope to a counter (the step's all-to-all share in the metrics).
struct Stopwatch {
  double& total;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Stopwatch() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

}  // namespace

Tensor SparseMoeBlock::run_experts(const Tensor& xp, const Tensor& counts, const Tensor& offsets, int64_t cap) {
  Group* ep = ctx_->ep;
  if (!ep || ep->size() == 1) {
    experts->offsets = offsets;
    return experts->call(xp);
  }
  CommTag tag(kMoeDispatchTag);
  const int64_t C = xp.size(1), E = counts.numel(), P = ep->size(), El = E / P;
  const Device dev = xp.device();
  std::optional<Stopwatch> watch(std::in_place, ctx_->dispatch_s);
  if (cap > 0) {
    // A capacity (or the dropless bound): every rank sends each peer El blocks of cap rows (padding included), so
    // the sizes are known without asking; the counts travel on the device and the receiver's order skips the
    // padding. (Every ep rank routes as many rows, the micro-batches being equal over the batch dims, so every
    // rank's cap is the same.)
    Tensor theirs = empty({E}, DType::i32, dev);  // (P, E_local): source p's kept rows for my expert j
    {
      CommTag ctag(kMoeCountsTag);
      ep->all_to_all(theirs, counts);
    }
    const int64_t R = E * cap;  // (P, E_local, cap) arrived rows
    Tensor order = empty({R, 1}, DType::i32, dev), local = empty({El + 1}, DType::i32, dev);
    moe_unpad_order(order, local, theirs.reshape({P, El}), cap);
    Tensor arrived = empty({R, C}, xp.dtype(), dev);  // (R, C) by source, padded
    ep->all_to_all(arrived, xp);
    watch.reset();
    Tensor grouped = empty({R, C}, xp.dtype(), dev);  // (R, C) by local expert, then the unused rows
    moe_dispatch_forward(grouped, arrived, order);
    experts->offsets = local;
    Tensor out = experts->call(grouped);
    Tensor back = empty({R, C}, xp.dtype(), dev);  // (R, C) by source, padding rows 0
    moe_dispatch_backward(back, out, order);
    Tensor h = empty(xp.shape(), xp.dtype(), dev);  // (E cap, C) this rank's rows, padded by expert
    watch.emplace(ctx_->dispatch_s);
    ep->all_to_all(h, back);
    watch.reset();
    order_ = order, local_offsets_ = local;
    return h;
  }
  // Dropless, exact (dropless_bound 0, or an evaluation): the sizes read on the host (one sync per sparse layer;
  // moe.md).
  Exchange x = plan_exchange(*ep, counts);
  const int64_t R = int64_t(x.order.size());
  // Rows to their experts' ranks, then by local expert; through the experts; back to source order and home.
  Tensor arrived = empty({R, C}, xp.dtype(), dev);  // (R, C) by source
  ep->all_to_all_v(arrived, xp, times(x.send, C), times(x.recv, C));
  watch.reset();
  Tensor order = i32_tensor(x.order, {R, 1}, dev);
  Tensor grouped = empty({R, C}, xp.dtype(), dev);  // (R, C) by local expert
  if (R > 0) moe_dispatch_forward(grouped, arrived, order);
  experts->offsets = offsets_of(x.local, dev);
  Tensor out = experts->call(grouped);              // (R, C) by local expert
  Tensor back = empty({R, C}, xp.dtype(), dev);     // (R, C) by source
  if (R > 0) moe_dispatch_backward(back, out, order);
  Tensor h = empty(xp.shape(), xp.dtype(), dev);    // (M, C) by expert, this rank's rows
  watch.emplace(ctx_->dispatch_s);
  ep->all_to_all_v(h, back, times(x.recv, C), times(x.send, C));
  watch.reset();
  send_ = x.send, recv_ = x.recv, order_ = order, local_offsets_ = Tensor();
  return h;
}

Tensor SparseMoeBlock::run_experts_backward(const Tensor& dh) {
  Group* ep = ctx_->ep;
  if (!ep || ep->size() == 1) return experts->call_backward(dh);
  CommTag tag(kMoeDispatchTag);
  const int64_t C = dh.size(1);
  const Device dev = dh.device();
  const bool padded = local_offsets_->defined();
  const std::vector<int64_t> send = send_, recv = recv_;
  const Tensor order = order_;  // (R, 1) the forward's, already on the device
  order_ = Tensor(), local_offsets_ = Tensor();
  const int64_t R = order.size(0);
  // The same path as forward: gradients to the experts' ranks, through them, and home.
  Tensor arrived = empty({R, C}, dh.dtype(), dev);
  {
    Stopwatch w{ctx_->dispatch_s};
    if (padded) ep->all_to_all(arrived, dh);
    else ep->all_to_all_v(arrived, dh, times(send, C), times(recv, C));
  }
  Tensor grouped = empty({R, C}, dh.dtype(), dev);
  if (R > 0) moe_dispatch_forward(grouped, arrived, order);
  Tensor dg = experts->call_backward(grouped);  // (R, C) by local expert
  Tensor back = empty({R, C}, dh.dtype(), dev);
  if (R > 0) moe_dispatch_backward(back, dg, order);
  Tensor dxp = empty(dh.shape(), dh.dtype(), dev);
  Stopwatch w{ctx_->dispatch_s};
  if (padded) ep->all_to_all(dxp, back);
  else ep->all_to_all_v(dxp, back, times(recv, C), times(send, C));
  return dxp;
}

}  // namespace mt
