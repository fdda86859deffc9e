// The sparse MoE block: router, dispatch, the experts' grouped GEMMs (here or over the ep group), combine; and
// the balance loss's statistics (moe.h).
#include "models/llama/moe.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <optional>

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
  m.counts.assign(size_t(n_sparse * config.n_experts), 0.0);
  m.seen.assign(size_t(n_sparse), false);
  m.prob_sums = zeros({config.n_experts}, acc, device);
  return m;
}

void MoeContext::record(int64_t layer, int64_t tokens_here, const std::vector<double>& counts, const Tensor& prob_sums,
                        int64_t dropped) {
  // A forward after this slot's sum started (or after a forward with none: evaluation) starts the statistics over.
  Micro* m = &*micro_;
  if (m->sum || m->counts.empty() || m->seen.at(size_t(layer))) m = &fresh_micro();
  const size_t E = size_t(config.n_experts);
  m->seen[size_t(layer)] = true;
  std::copy(counts.begin(), counts.end(), m->counts.begin() + std::ptrdiff_t(size_t(layer) * E));
  add_(m->prob_sums, prob_sums);
  m->dropped += dropped;
  m->rows += tokens_here;
}

void MoeContext::start_sum(Micro& m) {
  if (m.counts.empty()) fresh_micro();  // a stage without sparse layers adds zeros
  std::vector<double> buf = m.counts;
  for (double s : to_f64(m.prob_sums)) buf.push_back(s);
  buf.push_back(double(m.rows));
  buf.push_back(double(m.dropped));
  m.sum = std::make_shared<Sum>();
  m.sum->loss_scale = loss_scale;
  m.sum->buf = from_values(buf, {int64_t(buf.size())}, DType::f64).to(device);
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

Tensor MoeContext::aux_grad_row() {
  Micro& m = *micro_;
  if (!m.sum) start_sum(m);  // an executor that did not call forward_done: summed now
  take(*m.sum);
  return m.sum->grad_row;
}

void MoeContext::take(Sum& s) {
  if (s.taken) return;
  s.taken = true;
  s.work.wait();
  std::erase_if(pending_, [&](const std::shared_ptr<Sum>& p) { return p.get() == &s; });
  const std::vector<double> buf = to_f64(s.buf);
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
  step_.dropped += int64_t(buf.back());
  step_.any = true;
  if (!config.output_router_logits || s.loss_scale <= 0 || R <= 0) return;
  // aux = coef E / R^2 sum_e C_e S_e, entering the loss weighted by the micro-batch's share of the step's tokens
  // (R / n_sparse of them): the loss stays the mean over micro-batches, as the token losses are.
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) aux += C[size_t(e)] * buf[size_t(L * E + e)];
  const double coef = config.router_aux_loss_coef, weight = R / double(L) * s.loss_scale;
  aux *= coef * double(E) / (R * R);
  step_.aux_loss += weight * aux;
  std::vector<double> row(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) row[size_t(e)] = weight * coef * double(E) * C[size_t(e)] / (R * R);
  s.grad_row = from_values(row, {E}, acc).to(device);
}

RouterStepStats MoeContext::take_step_stats() {
  // Sums no backward took (a stage without sparse layers): waited for, counted.
  for (auto pending = pending_; auto& p : pending) take(*p);
  RouterStepStats s = std::move(step_);
  step_ = RouterStepStats{};
  s.dispatch_s = dispatch_s;
  dispatch_s = 0;
  if (!biases.empty()) {
    s.has_bias = true;
    s.bias_min = INFINITY, s.bias_max = -INFINITY;
    for (const Tensor& b : biases)
      for (double v : to_f64(b)) s.bias_min = std::min(s.bias_min, v), s.bias_max = std::max(s.bias_max, v);
  }
  return s;
}

void MoeContext::update_biases() {
  if (biases.empty() || config.bias_update_rate <= 0 || last_load_.empty()) return;
  const int64_t E = config.n_experts;
  for (size_t l = 0; l < biases.size(); ++l) {
    std::vector<double> b = to_f64(biases[l]);
    double mean = 0;
    for (int64_t e = 0; e < E; ++e) mean += last_load_[l * size_t(E) + size_t(e)] / double(E);
    for (int64_t e = 0; e < E; ++e) {
      const double load = last_load_[l * size_t(E) + size_t(e)];
      b[size_t(e)] += config.bias_update_rate * double((mean > load) - (mean < load));
    }
    Tensor nb = from_values(b, {E}, biases[l].dtype()).to(biases[l].device());
    copy_slice(biases[l], 0, nb, 0, E, 0);
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
    grouped_matmul_forward(g, x, gate_proj->compute_local(), counts);
    grouped_matmul_forward(u, x, up_proj->compute_local(), counts);
    Tensor a = empty({M, F}, x.dtype(), x.device());  // (M, F) silu(g) * u
    swiglu_forward(a, g, u);
    grouped_matmul_forward(y, a, down_proj->compute_local(), counts);
  }
  x_ = x, gate_ = g, up_ = u, counts_ = counts;
  return y;
}

Tensor MoeExperts::backward(const Tensor& dy) {
  const Tensor x = x_, g = gate_, u = up_;
  const std::vector<int64_t> cnt = counts_;
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

namespace {

// Rows grouped by expert, in token order within an expert; with a capacity, rows past it dropped (slot -1).
struct Routing {
  std::vector<int64_t> counts;  // (E) rows kept per expert
  std::vector<double> selected;  // (E) rows selected per expert (before the capacity)
  std::vector<int32_t> slot;     // (N, K)
  int64_t dropped = 0;
};

Routing route(const Tensor& experts, int64_t E, double capacity_factor) {
  const std::vector<double> idx = to_f64(experts);  // (N, K)
  const int64_t K = experts.size(1), N = experts.size(0);
  const int64_t cap = capacity_factor > 0
                          ? std::max<int64_t>(1, int64_t(std::ceil(capacity_factor * double(N * K) / double(E))))
                          : INT64_MAX;
  Routing r{std::vector<int64_t>(size_t(E), 0), std::vector<double>(size_t(E), 0.0),
            std::vector<int32_t>(size_t(N * K), -1)};
  std::vector<int64_t> rank(size_t(N * K), -1);  // place of the row within its expert
  for (int64_t i = 0; i < N * K; ++i) {
    const int64_t e = int64_t(idx[size_t(i)]);
    MT_CHECK(e >= 0 && e < E, "model", "router: expert {} out of {}", e, E);
    r.selected[size_t(e)] += 1;
    if (r.counts[size_t(e)] < cap) rank[size_t(i)] = r.counts[size_t(e)]++;
    else ++r.dropped;
  }
  std::vector<int64_t> begin(size_t(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) begin[size_t(e) + 1] = begin[size_t(e)] + r.counts[size_t(e)];
  for (int64_t i = 0; i < N * K; ++i)
    if (rank[size_t(i)] >= 0) r.slot[size_t(i)] = int32_t(begin[size_t(idx[size_t(i)])] + rank[size_t(i)]);
  return r;
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
  // 2. Rows grouped by expert (host: the counts size the GEMMs and the all-to-all anyway).
  Routing r = route(idx, E, mc.capacity_factor);
  if (!recomputing()) {
    Tensor prob_sums = zeros({E}, acc, dev);  // (E) column sums of probs
    bias_add_backward(prob_sums, probs);
    ctx_->record(sparse_index, N, r.selected, prob_sums, r.dropped);
  }
  Tensor slot = i32_tensor(r.slot, {N, K}, dev);  // (N, K)
  int64_t M = 0;
  for (int64_t c : r.counts) M += c;
  Tensor xp = empty({M, C}, x.dtype(), dev);  // (M, C) grouped by expert
  if (M > 0) moe_dispatch_forward(xp, xr, slot);
  Tensor h = run_experts(xp, r.counts);  // (M, C)
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

Exchange plan_exchange(Group& ep, const std::vector<int64_t>& counts, Device dev) {
  const int P = ep.size();
  const int64_t E = int64_t(counts.size()), El = E / P;
  // Each rank tells every other how many rows it sends to each of that rank's experts.
  Tensor mine = empty({E}, DType::i64);
  std::copy(counts.begin(), counts.end(), mine.data<int64_t>());
  Tensor theirs = empty({E}, DType::i64);  // (P, E_local): source s's rows for my expert j
  {
    Tensor d_mine = mine.to(dev), d_theirs = theirs.to(dev);
    CommTag tag(kMoeCountsTag);
    ep.all_to_all(d_theirs, d_mine);
    theirs = d_theirs.to(Device::cpu());
  }
  Exchange x{std::vector<int64_t>(size_t(P), 0), std::vector<int64_t>(size_t(P), 0),
             std::vector<int64_t>(size_t(El), 0), {}};
  const int64_t* n = theirs.data<int64_t>();
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < El; ++j) {
      x.send[size_t(p)] += counts[size_t(p * El + j)];
      x.recv[size_t(p)] += n[p * El + j];
      x.local[size_t(j)] += n[p * El + j];
    }
  std::vector<int64_t> begin(size_t(El), 0);  // expert j's first row, then the next free one
  for (int64_t j = 1; j < El; ++j) begin[size_t(j)] = begin[size_t(j) - 1] + x.local[size_t(j) - 1];
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < El; ++j)
      for (int64_t i = 0; i < n[p * El + j]; ++i) x.order.push_back(int32_t(begin[size_t(j)]++));
  return x;
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

Tensor SparseMoeBlock::run_experts(const Tensor& xp, const std::vector<int64_t>& counts) {
  Group* ep = ctx_->ep;
  if (!ep || ep->size() == 1) {
    experts->counts = counts;
    return experts->call(xp);
  }
  CommTag tag(kMoeDispatchTag);
  const int64_t C = xp.size(1);
  const Device dev = xp.device();
  std::optional<Stopwatch> watch(std::in_place, ctx_->dispatch_s);
  Exchange x = plan_exchange(*ep, counts, dev);
  const int64_t R = int64_t(x.order.size());
  // Rows to their experts' ranks, then by local expert; through the experts; back to source order and home.
  Tensor arrived = empty({R, C}, xp.dtype(), dev);  // (R, C) by source
  ep->all_to_all_v(arrived, xp, times(x.send, C), times(x.recv, C));
  watch.reset();
  Tensor order = i32_tensor(x.order, {R, 1}, dev);
  Tensor grouped = empty({R, C}, xp.dtype(), dev);  // (R, C) by local expert
  if (R > 0) moe_dispatch_forward(grouped, arrived, order);
  experts->counts = x.local;
  Tensor out = experts->call(grouped);              // (R, C) by local expert
  Tensor back = empty({R, C}, xp.dtype(), dev);     // (R, C) by source
  if (R > 0) moe_dispatch_backward(back, out, order);
  Tensor h = empty(xp.shape(), xp.dtype(), dev);    // (M, C) by expert, this rank's rows
  watch.emplace(ctx_->dispatch_s);
  ep->all_to_all_v(h, back, times(x.recv, C), times(x.send, C));
  watch.reset();
  send_ = x.send, recv_ = x.recv, order_ = order;
  return h;
}

Tensor SparseMoeBlock::run_experts_backward(const Tensor& dh) {
  Group* ep = ctx_->ep;
  if (!ep || ep->size() == 1) return experts->call_backward(dh);
  CommTag tag(kMoeDispatchTag);
  const int64_t C = dh.size(1);
  const Device dev = dh.device();
  const std::vector<int64_t> send = send_, recv = recv_;
  const Tensor order = order_;  // (R, 1) the forward's, already on the device
  order_ = Tensor();
  const int64_t R = order.size(0);
  // The same path as forward: gradients to the experts' ranks, through them, and home.
  Tensor arrived = empty({R, C}, dh.dtype(), dev);
  {
    Stopwatch w{ctx_->dispatch_s};
    ep->all_to_all_v(arrived, dh, times(send, C), times(recv, C));
  }
  Tensor grouped = empty({R, C}, dh.dtype(), dev);
  if (R > 0) moe_dispatch_forward(grouped, arrived, order);
  Tensor dg = experts->call_backward(grouped);  // (R, C) by local expert
  Tensor back = empty({R, C}, dh.dtype(), dev);
  if (R > 0) moe_dispatch_backward(back, dg, order);
  Tensor dxp = empty(dh.shape(), dh.dtype(), dev);
  Stopwatch w{ctx_->dispatch_s};
  ep->all_to_all_v(dxp, back, times(recv, C), times(send, C));
  return dxp;
}

}  // namespace mt
