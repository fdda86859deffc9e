// Pipeline schedules as action lists, their check and their simulation (pipeline_schedule.h).
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <set>
#include <tuple>

#include "parallel/parallel_dims.h"
#include "runtime/core/error.h"

namespace mt {

const char* pp_op_name(PpOp op) {
  switch (op) {
    case PpOp::forward: return "F";
    case PpOp::backward: return "B";
    case PpOp::backward_input: return "Bi";
    case PpOp::backward_weight: return "W";
    case PpOp::send_act: return "send_act";
    case PpOp::recv_act: return "recv_act";
    case PpOp::send_grad: return "send_grad";
    case PpOp::recv_grad: return "recv_grad";
  }
  return "?";
}

const std::vector<std::string>& pp_schedule_kinds() {
  static const std::vector<std::string> k = {"gpipe", "1f1b", "interleaved_1f1b", "zb1p"};
  return k;
}

namespace {

bool is_compute(PpOp op) {
  return op == PpOp::forward || op == PpOp::backward || op == PpOp::backward_input || op == PpOp::backward_weight;
}
bool is_send(const PpAction& a) { return a.op == PpOp::send_act || a.op == PpOp::send_grad; }

std::string action_str(const PpAction& a) {
  if (is_compute(a.op)) return fmt::format("{}(stage {}, micro {})", pp_op_name(a.op), a.stage, a.micro);
  return fmt::format("{}(stage {}, micro {}, peer rank {})", pp_op_name(a.op), a.stage, a.micro, a.peer);
}

// A message: an activation leaving stage `from` forward, or a gradient leaving it backward.
using MsgKey = std::tuple<bool, int, int>;  // (gradient?, sending stage, micro)
MsgKey sent_key(const PpAction& a) { return {a.op == PpOp::send_grad, a.stage, a.micro}; }
MsgKey wanted_key(const PpAction& a) {
  // recv_act at stage s takes stage s-1's activation; recv_grad at stage s takes stage s+1's gradient.
  return a.op == PpOp::recv_act ? MsgKey{false, a.stage - 1, a.micro} : MsgKey{true, a.stage + 1, a.micro};
}

// The forward of a micro-batch on a stage with its receive before and its send after.
void emit_forward(const PpSchedule& s, std::vector<PpAction>& out, int stage, int micro) {
  if (stage > 0) out.push_back({PpOp::recv_act, stage, micro, s.rank_of(stage - 1)});
  out.push_back({PpOp::forward, stage, micro});
  if (stage < s.stages() - 1) out.push_back({PpOp::send_act, stage, micro, s.rank_of(stage + 1)});
}
void emit_backward(const PpSchedule& s, std::vector<PpAction>& out, int stage, int micro, PpOp op) {
  if (stage < s.stages() - 1) out.push_back({PpOp::recv_grad, stage, micro, s.rank_of(stage + 1)});
  out.push_back({op, stage, micro});
  if (stage > 0) out.push_back({PpOp::send_grad, stage, micro, s.rank_of(stage - 1)});
}

void build_gpipe(PpSchedule& s) {
  for (int r = 0; r < s.p; ++r) {
    for (int mb = 0; mb < s.m; ++mb) emit_forward(s, s.ranks[size_t(r)], r, mb);
    for (int mb = 0; mb < s.m; ++mb) emit_backward(s, s.ranks[size_t(r)], r, mb, PpOp::backward);
  }
}

// 1F1B (PipeDream-flush): rank r runs p-1-r forwards ahead, then alternates one forward and one backward, then
// drains the backwards; at most p-r micro-batches' activations are held.
void build_1f1b(PpSchedule& s) {
  for (int r = 0; r < s.p; ++r) {
    auto& out = s.ranks[size_t(r)];
    const int warmup = std::min(s.p - 1 - r, s.m);
    for (int mb = 0; mb < warmup; ++mb) emit_forward(s, out, r, mb);
    for (int i = 0; i < s.m - warmup; ++i) {
      emit_forward(s, out, r, warmup + i);
      emit_backward(s, out, r, i, PpOp::backward);
    }
    for (int mb = s.m - warmup; mb < s.m; ++mb) emit_backward(s, out, r, mb, PpOp::backward);
  }
}

// Interleaved 1F1B (Megatron-LM's): each rank holds v chunks (stages r, r+p, ...); forwards go through the chunks
// in rounds of p micro-batches, backwards through them in reverse; the warm-up is 2(p-1-r) + (v-1)p forwards.
void build_interleaved(PpSchedule& s) {
  const int total = s.m * s.v;
  for (int r = 0; r < s.p; ++r) {
    auto& out = s.ranks[size_t(r)];
    auto fwd = [&](int k) {
      const int chunk = (k / s.p) % s.v, micro = (k / (s.p * s.v)) * s.p + k % s.p;
      emit_forward(s, out, chunk * s.p + r, micro);
    };
    auto bwd = [&](int k) {
      const int chunk = s.v - 1 - (k / s.p) % s.v, micro = (k / (s.p * s.v)) * s.p + k % s.p;
      emit_backward(s, out, chunk * s.p + r, micro, PpOp::backward);
    };
    const int warmup = std::min(2 * (s.p - 1 - r) + (s.v - 1) * s.p, total);
    for (int k = 0; k < warmup; ++k) fwd(k);
    for (int i = 0; i < total - warmup; ++i) {
      fwd(warmup + i);
      bwd(i);
    }
    for (int k = total - warmup; k < total; ++k) bwd(k);
  }
}

// Zero bubble H1 (Qi et al. 2024): 1F1B's order of forwards and input-gradient backwards (Bi), with each weight
// gradient (W) deferred to where its rank would otherwise wait for a message, as long as the rank holds at most p
// micro-batches' activations (1F1B's peak, rank 0's); the rest run at the end. Built by simulating the step with
// unit costs (F = Bi = W = 1), the earliest rank first, and recording what each rank ran.
class Zb1pBuilder {
 public:
  explicit Zb1pBuilder(PpSchedule& s) : s_(s), ranks_(size_t(s.p)) {
    for (int r = 0; r < s_.p; ++r) queue_1f1b(r);
  }

  void build() {
    for (int r; (r = earliest_rank()) >= 0;) act(r);
    for (int r = 0; r < s_.p; ++r)
      MT_CHECK(ranks_[size_t(r)].order.empty(), "pipeline", "zb1p: rank {} could not place all its actions", r);
  }

 private:
  struct Rank {
    std::deque<PpAction> order;      // F and Bi in 1F1B order, not yet run
    std::deque<PpAction> pending_w;  // W whose Bi has run
    double t = 0;
    int in_flight = 0;  // forwards run whose W has not
    bool blocked = false;
  };

  // Rank r's forwards and input-gradient backwards in 1F1B's order: p-1-r forwards ahead, then alternating.
  void queue_1f1b(int r) {
    const int warmup = std::min(s_.p - 1 - r, s_.m);
    auto& q = ranks_[size_t(r)].order;
    for (int mb = 0; mb < warmup; ++mb) q.push_back({PpOp::forward, r, mb});
    for (int i = 0; i < s_.m - warmup; ++i) {
      q.push_back({PpOp::forward, r, warmup + i});
      q.push_back({PpOp::backward_input, r, i});
    }
    for (int mb = s_.m - warmup; mb < s_.m; ++mb) q.push_back({PpOp::backward_input, r, mb});
  }

  // The message an action waits for: a forward's activation from the stage before, a Bi's gradient from the
  // stage after; none on the first and last stage.
  std::optional<MsgKey> input_of(const PpAction& a) const {
    if (a.op == PpOp::forward && a.stage > 0) return MsgKey{false, a.stage - 1, a.micro};
    if (a.op == PpOp::backward_input && a.stage < s_.stages() - 1) return MsgKey{true, a.stage + 1, a.micro};
    return std::nullopt;
  }

  // The earliest rank that can act (not blocked, something left), or -1 when every rank is done.
  int earliest_rank() const {
    int r = -1;
    for (int i = 0; i < s_.p; ++i) {
      const Rank& k = ranks_[size_t(i)];
      if (k.blocked || (k.order.empty() && k.pending_w.empty())) continue;
      if (r < 0 || k.t < ranks_[size_t(r)].t) r = i;
    }
    return r;
  }

  // Rank r runs its oldest deferred W.
  void run_w(int r) {
    Rank& k = ranks_[size_t(r)];
    PpAction w = k.pending_w.front();
    k.pending_w.pop_front();
    s_.ranks[size_t(r)].push_back(w);
    k.t += 1;
    --k.in_flight;
  }

  // Rank r's next move: a deferred W where memory or a wait calls for one, else its next F or Bi when the input
  // has arrived, else it waits (until the message lands, or blocked until it is sent).
  void act(int r) {
    Rank& k = ranks_[size_t(r)];
    if (k.order.empty()) {  // the drain: every deferred W
      run_w(r);
      return;
    }
    const PpAction a = k.order.front();
    const auto in = input_of(a);
    auto it = in ? arrived_.find(*in) : arrived_.end();
    const bool ready = !in || (it != arrived_.end() && it->second <= k.t);
    if (a.op == PpOp::forward && k.in_flight >= s_.p && !k.pending_w.empty()) {
      run_w(r);  // 1F1B's memory: free one micro-batch's activations before taking another
      return;
    }
    if (!ready) {
      if (!k.pending_w.empty()) {
        run_w(r);  // fill the wait with a deferred weight gradient
      } else if (it != arrived_.end()) {
        k.t = it->second;  // sent, still on its way: wait for it
      } else {
        k.blocked = true;  // not sent yet: woken by the send
      }
      return;
    }
    k.order.pop_front();
    run(r, a);
  }

  // Rank r runs F or Bi: emitted with its transfers, its output's arrival time recorded and its receiver woken.
  void run(int r, const PpAction& a) {
    Rank& k = ranks_[size_t(r)];
    auto& out = s_.ranks[size_t(r)];
    if (a.op == PpOp::forward) {
      emit_forward(s_, out, a.stage, a.micro);
      ++k.in_flight;
      k.t += 1;
      if (a.stage < s_.stages() - 1) arrived_[{false, a.stage, a.micro}] = k.t;
      if (a.stage < s_.stages() - 1) ranks_[size_t(s_.rank_of(a.stage + 1))].blocked = false;
    } else {
      emit_backward(s_, out, a.stage, a.micro, PpOp::backward_input);
      k.pending_w.push_back({PpOp::backward_weight, a.stage, a.micro});
      k.t += 1;
      if (a.stage > 0) arrived_[{true, a.stage, a.micro}] = k.t;
      if (a.stage > 0) ranks_[size_t(s_.rank_of(a.stage - 1))].blocked = false;
    }
  }

  PpSchedule& s_;
  std::vector<Rank> ranks_;
  std::map<MsgKey, double> arrived_;  // message -> time it can be received
};

void build_zb1p(PpSchedule& s) { Zb1pBuilder(s).build(); }

}  // namespace

PpSchedule build_pp_schedule(const std::string& kind, int p, int v, int m) {
  const auto& kinds = pp_schedule_kinds();
  if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end())
    fail("config", "parallel.pp_schedule = '{}': expected one of gpipe, 1f1b, interleaved_1f1b, zb1p", kind);
  MT_CHECK(p >= 1, "config", "parallel.pp = {}: expected >= 1", p);
  MT_CHECK(v >= 1, "config", "parallel.pp_virtual = {}: expected >= 1", v);
  MT_CHECK(m >= 1, "config", "{} micro-batches: expected >= 1 (training.micro_batch_size)", m);
  if (v > 1 && kind != "interleaved_1f1b")
    fail("config", "parallel.pp_virtual = {} needs parallel.pp_schedule = interleaved_1f1b (it is {})", v, kind);
  if (kind == "interleaved_1f1b") {
    MT_CHECK(v >= 2, "config", "parallel.pp_schedule = interleaved_1f1b needs parallel.pp_virtual >= 2 (it is {})", v);
    if (m % p != 0)
      fail("config",
           "parallel.pp_schedule = interleaved_1f1b runs micro-batches in rounds of pp: {} micro-batches (the rows "
           "per data-parallel rank / training.micro_batch_size) must be a multiple of parallel.pp = {}",
           m, p);
  }
  // Built and checked once per (kind, p, v, m): `plan --search` estimates thousands of plans over a few schedules.
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, int>, PpSchedule> built;
  const auto key = std::make_tuple(kind, p, v, m);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = built.find(key); it != built.end()) return it->second;
  }
  PpSchedule s;
  s.kind = kind, s.p = p, s.v = v, s.m = m;
  s.ranks.resize(size_t(p));
  if (kind == "gpipe") build_gpipe(s);
  else if (kind == "1f1b") build_1f1b(s);
  else if (kind == "interleaved_1f1b") build_interleaved(s);
  else build_zb1p(s);
  check_pp_schedule(s);
  std::lock_guard<std::mutex> lock(mu);
  built.emplace(key, s);
  return s;
}

void check_pp_schedule(const PpSchedule& s) {
  const int S = s.stages();
  const bool split = s.kind == "zb1p";
  // Each rank's own order: inputs before use, every compute once.
  std::map<std::tuple<int, int, int>, int> done;  // (op, stage, micro) -> count
  std::map<MsgKey, int> sends, recvs;
  for (int r = 0; r < s.p; ++r) {
    std::set<std::tuple<int, int, int>> seen;  // what ran before on this rank
    auto has = [&](PpOp op, int stage, int micro) { return seen.count({int(op), stage, micro}) > 0; };
    for (const PpAction& a : s.ranks[size_t(r)]) {
      auto bad = [&](const std::string& why) {
        fail("pipeline", "{} schedule (p {}, v {}, m {}): rank {}: {}: {}", s.kind, s.p, s.v, s.m, r, action_str(a), why);
      };
      if (a.stage < 0 || a.stage >= S || a.micro < 0 || a.micro >= s.m) bad("stage or micro-batch out of range");
      if (s.rank_of(a.stage) != r) bad(fmt::format("stage {} belongs to rank {}", a.stage, s.rank_of(a.stage)));
      switch (a.op) {
        case PpOp::forward:
          if (a.stage > 0 && !has(PpOp::recv_act, a.stage, a.micro)) bad("runs before its activation arrives");
          break;
        case PpOp::backward:
        case PpOp::backward_input:
          if ((a.op == PpOp::backward_input) != split) bad("the wrong kind of backward for this schedule");
          if (!has(PpOp::forward, a.stage, a.micro)) bad("runs before its forward");
          if (a.stage < S - 1 && !has(PpOp::recv_grad, a.stage, a.micro)) bad("runs before its gradient arrives");
          break;
        case PpOp::backward_weight:
          if (!split) bad("a deferred weight gradient outside zb1p");
          if (!has(PpOp::backward_input, a.stage, a.micro)) bad("runs before its input gradient");
          break;
        case PpOp::send_act:
          if (!has(PpOp::forward, a.stage, a.micro)) bad("sends before the forward");
          if (a.stage == S - 1 || a.peer != s.rank_of(a.stage + 1)) bad("not to the next stage's rank");
          ++sends[sent_key(a)];
          break;
        case PpOp::send_grad:
          if (!has(split ? PpOp::backward_input : PpOp::backward, a.stage, a.micro)) bad("sends before the backward");
          if (a.stage == 0 || a.peer != s.rank_of(a.stage - 1)) bad("not to the previous stage's rank");
          ++sends[sent_key(a)];
          break;
        case PpOp::recv_act:
          if (a.stage == 0 || a.peer != s.rank_of(a.stage - 1)) bad("not from the previous stage's rank");
          ++recvs[wanted_key(a)];
          break;
        case PpOp::recv_grad:
          if (a.stage == S - 1 || a.peer != s.rank_of(a.stage + 1)) bad("not from the next stage's rank");
          ++recvs[wanted_key(a)];
          break;
      }
      if (is_compute(a.op) && ++done[{int(a.op), a.stage, a.micro}] > 1) bad("runs twice");
      seen.insert({int(a.op), a.stage, a.micro});
    }
  }
  // Every forward and backward of every (stage, micro-batch), exactly once.
  for (int st = 0; st < S; ++st)
    for (int mb = 0; mb < s.m; ++mb) {
      std::vector<PpOp> need = {PpOp::forward};
      if (split) need.insert(need.end(), {PpOp::backward_input, PpOp::backward_weight});
      else need.push_back(PpOp::backward);
      for (PpOp op : need)
        MT_CHECK(done.count({int(op), st, mb}) == 1, "pipeline", "{} schedule (p {}, v {}, m {}): {} of stage {} micro {} never runs",
                 s.kind, s.p, s.v, s.m, pp_op_name(op), st, mb);
    }
  for (auto& [k, n] : sends)
    MT_CHECK(n == 1 && recvs.count(k) && recvs.at(k) == 1, "pipeline",
             "{} schedule: the {} of stage {} micro {} is sent {} time(s) and received {}", s.kind,
             std::get<0>(k) ? "gradient" : "activation", std::get<1>(k), std::get<2>(k), n,
             recvs.count(k) ? recvs.at(k) : 0);
  for (auto& [k, n] : recvs)
    MT_CHECK(sends.count(k), "pipeline", "{} schedule: the {} of stage {} micro {} is received but never sent", s.kind,
             std::get<0>(k) ? "gradient" : "activation", std::get<1>(k), std::get<2>(k));
  simulate_pp_schedule(s);  // deadlock freedom: the lists run to the end with blocking receives
}

PpSimulation simulate_pp_schedule(const PpSchedule& s, const PpCosts& c) {
  const int S = s.stages();
  const bool split = s.kind == "zb1p";
  PpSimulation out;
  out.busy.assign(size_t(s.p), 0);
  out.idle.assign(size_t(s.p), 0);
  out.peak_activations.assign(size_t(s.p), 0);
  std::vector<size_t> next(size_t(s.p), 0);
  std::vector<double> t(size_t(s.p), 0);
  std::vector<int> held(size_t(s.p), 0);
  std::map<MsgKey, double> arrived;
  auto cost = [&](PpOp op) {
    switch (op) {
      case PpOp::forward: return c.forward;
      case PpOp::backward: return c.backward;
      case PpOp::backward_input: return c.backward_input;
      case PpOp::backward_weight: return c.backward_weight;
      default: return 0.0;
    }
  };
  for (;;) {
    bool progressed = false, all_done = true;
    for (int r = 0; r < s.p; ++r) {
      const auto& list = s.ranks[size_t(r)];
      while (next[size_t(r)] < list.size()) {
        const PpAction& a = list[size_t(next[size_t(r)])];
        if (a.op == PpOp::recv_act || a.op == PpOp::recv_grad) {
          auto it = arrived.find(wanted_key(a));
          if (it == arrived.end()) break;  // not sent yet: this rank waits
          t[size_t(r)] = std::max(t[size_t(r)], it->second);
        } else if (is_send(a)) {
          arrived[sent_key(a)] = t[size_t(r)] + c.transfer;
        } else {
          t[size_t(r)] += cost(a.op);
          out.busy[size_t(r)] += cost(a.op);
          if (a.op == PpOp::forward) out.peak_activations[size_t(r)] = std::max(out.peak_activations[size_t(r)], ++held[size_t(r)]);
          if (a.op == (split ? PpOp::backward_weight : PpOp::backward)) --held[size_t(r)];
        }
        ++next[size_t(r)];
        progressed = true;
      }
      if (next[size_t(r)] < list.size()) all_done = false;
    }
    if (all_done) break;
    if (!progressed) {
      std::string waits;
      for (int r = 0; r < s.p; ++r)
        if (next[size_t(r)] < s.ranks[size_t(r)].size())
          waits += fmt::format("; rank {} waits at {}", r, action_str(s.ranks[size_t(r)][next[size_t(r)]]));
      fail("pipeline", "{} schedule (p {}, v {}, m {}) deadlocks{}", s.kind, s.p, s.v, s.m, waits);
    }
  }
  (void)S;
  out.makespan = *std::max_element(t.begin(), t.end());
  for (int r = 0; r < s.p; ++r) out.idle[size_t(r)] = out.makespan - out.busy[size_t(r)];
  return out;
}

bool pp_runs(const PpAction& a, bool forward_only) {
  return !forward_only || a.op == PpOp::forward || a.op == PpOp::send_act || a.op == PpOp::recv_act;
}

std::string pp_batches_deadlock(const PpSchedule& s, bool forward_only) {
  // Each rank's batches, in order, and each ordered pair's messages in issue order on both sides.
  std::vector<std::vector<std::vector<PpAction>>> batches(size_t(s.p));
  std::map<std::pair<int, int>, std::vector<MsgKey>> sent, received;  // (from rank, to rank)
  for (int r = 0; r < s.p; ++r) {
    bool open = false;
    for (const PpAction& a : s.ranks[size_t(r)]) {
      if (!pp_runs(a, forward_only)) continue;
      if (is_compute(a.op)) {
        open = false;
        continue;
      }
      if (!open) batches[size_t(r)].emplace_back(), open = true;
      batches[size_t(r)].back().push_back(a);
      if (is_send(a)) sent[{r, a.peer}].push_back(sent_key(a));
      else received[{a.peer, r}].push_back(wanted_key(a));
    }
  }
  for (const auto& [pair, keys] : sent)
    if (received[pair] != keys)
      return fmt::format("rank {} sends rank {} its messages in another order than rank {} receives them (NCCL pairs "
                         "them by order)",
                         pair.first, pair.second, pair.second);
  // Rendezvous: a rank enters its next batch (posting its messages) and leaves it once every message's other half
  // is posted.
  std::set<std::pair<bool, MsgKey>> posted;  // (a send?, the message)
  std::vector<size_t> next(size_t(s.p), 0);
  std::vector<bool> inside(size_t(s.p), false);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < s.p; ++r) {
      if (next[size_t(r)] == batches[size_t(r)].size()) continue;
      const std::vector<PpAction>& b = batches[size_t(r)][next[size_t(r)]];
      if (!inside[size_t(r)]) {
        for (const PpAction& a : b) posted.insert({is_send(a), is_send(a) ? sent_key(a) : wanted_key(a)});
        inside[size_t(r)] = progressed = true;
      }
      const bool done = std::all_of(b.begin(), b.end(), [&](const PpAction& a) {
        return posted.count({!is_send(a), is_send(a) ? sent_key(a) : wanted_key(a)}) > 0;
      });
      if (done) ++next[size_t(r)], inside[size_t(r)] = false, progressed = true;
    }
  }
  std::string waits;
  for (int r = 0; r < s.p; ++r) {
    if (next[size_t(r)] == batches[size_t(r)].size()) continue;
    std::string b;
    for (const PpAction& a : batches[size_t(r)][next[size_t(r)]]) b += (b.empty() ? "" : ", ") + action_str(a);
    waits += fmt::format("{}rank {} waits in the batch [{}]", waits.empty() ? "" : "; ", r, b);
  }
  return waits;
}

PpSchedule pp_lockstep_lists(const PpSchedule& s, bool forward_only) {
  // Each rank's computes in order, with the messages each consumes (the receives before it) and produces (the sends
  // after it).
  struct Compute {
    PpAction a;
    std::vector<MsgKey> in;
    std::vector<PpAction> out;  // the sends
  };
  std::vector<std::vector<Compute>> comps(size_t(s.p));
  std::map<MsgKey, int> receiver;  // the message's receiving rank
  std::map<MsgKey, PpAction> recv_of;
  for (int r = 0; r < s.p; ++r) {
    std::vector<MsgKey> pending_in;
    for (const PpAction& a : s.ranks[size_t(r)]) {
      if (!pp_runs(a, forward_only)) continue;
      if (is_compute(a.op)) {
        comps[size_t(r)].push_back({a, std::move(pending_in), {}});
        pending_in.clear();
      } else if (is_send(a)) {
        MT_CHECK(!comps[size_t(r)].empty(), "pipeline", "{} schedule: rank {} sends before any compute", s.kind, r);
        comps[size_t(r)].back().out.push_back(a);
      } else {
        pending_in.push_back(wanted_key(a));
        receiver[wanted_key(a)] = r, recv_of[wanted_key(a)] = a;
      }
    }
  }
  // Unit times: a compute starts once its rank is free and its inputs have arrived; its messages arrive at its end.
  std::map<MsgKey, int64_t> arrival;
  std::vector<std::vector<int64_t>> start(size_t(s.p));
  std::vector<size_t> next(size_t(s.p), 0);
  std::vector<int64_t> t(size_t(s.p), 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < s.p; ++r)
      while (next[size_t(r)] < comps[size_t(r)].size()) {
        const Compute& c = comps[size_t(r)][next[size_t(r)]];
        int64_t at = t[size_t(r)];
        bool ready = true;
        for (const MsgKey& k : c.in) {
          auto it = arrival.find(k);
          if (it == arrival.end()) ready = false;
          else at = std::max(at, it->second);
        }
        if (!ready) break;
        start[size_t(r)].push_back(at);
        t[size_t(r)] = at + 1;
        for (const PpAction& a : c.out) arrival[sent_key(a)] = at + 1;
        ++next[size_t(r)];
        progressed = true;
      }
  }
  for (int r = 0; r < s.p; ++r)
    MT_CHECK(next[size_t(r)] == comps[size_t(r)].size(), "pipeline", "{} schedule (p {}, v {}, m {}) deadlocks", s.kind,
             s.p, s.v, s.m);
  // Each rank's list by time: at a time, its messages (sent and received, by key) before the compute starting then.
  struct Event {
    int64_t time;
    int order;     // 0 a transfer, 1 a compute
    MsgKey key;    // a transfer's
    size_t index;  // a compute's
    PpAction a;
  };
  PpSchedule out = s;
  for (int r = 0; r < s.p; ++r) {
    std::vector<Event> ev;
    for (size_t i = 0; i < comps[size_t(r)].size(); ++i) {
      const Compute& c = comps[size_t(r)][i];
      ev.push_back({start[size_t(r)][i], 1, {}, i, c.a});
      for (const PpAction& a : c.out) {
        ev.push_back({arrival.at(sent_key(a)), 0, sent_key(a), 0, a});
        const int to = receiver.at(sent_key(a));
        MT_CHECK(to == a.peer, "pipeline", "{} schedule: a message for rank {} is received by rank {}", s.kind, a.peer, to);
      }
    }
    for (const auto& [k, to] : receiver)
      if (to == r) ev.push_back({arrival.at(k), 0, k, 0, recv_of.at(k)});
    std::sort(ev.begin(), ev.end(), [](const Event& x, const Event& y) {
      return std::tie(x.time, x.order, x.key, x.index) < std::tie(y.time, y.order, y.key, y.index);
    });
    std::vector<PpAction>& list = out.ranks[size_t(r)];
    list.clear();
    for (const Event& e : ev) list.push_back(e.a);
  }
  return out;
}

double PpSimulation::bubble() const {
  double sum = 0;
  for (size_t r = 0; r < busy.size(); ++r) sum += busy[r] > 0 ? idle[r] / busy[r] : 0;
  return busy.empty() ? 0 : sum / double(busy.size());
}

double pp_bubble_formula(const std::string& kind, int p, int v, int m) {
  if (kind == "interleaved_1f1b") return double(p - 1) / double(v * m);
  if (kind == "zb1p") return double(p - 1) / double(3 * m);
  return double(p - 1) / double(m);
}

std::vector<int> pp_layer_split(int64_t n_layers, int stages, double first_extra, double last_extra,
                                const std::vector<int>& explicit_split) {
  MT_CHECK(stages >= 1, "config", "parallel.pp x parallel.pp_virtual = {} stages: expected >= 1", stages);
  if (!explicit_split.empty()) {
    MT_CHECK(int(explicit_split.size()) == stages, "config",
             "parallel.pp_layers lists {} stages but parallel.pp x parallel.pp_virtual = {}", explicit_split.size(),
             stages);
    int64_t sum = 0;
    for (size_t i = 0; i < explicit_split.size(); ++i) {
      MT_CHECK(explicit_split[i] >= 1, "config", "parallel.pp_layers[{}] = {}: every stage needs a layer", i,
               explicit_split[i]);
      sum += explicit_split[i];
    }
    MT_CHECK(sum == n_layers, "config", "parallel.pp_layers sums to {} but model.n_layers = {}", sum, n_layers);
    return explicit_split;
  }
  MT_CHECK(n_layers >= stages, "config",
           "parallel.pp x parallel.pp_virtual = {} stages but model.n_layers = {}: every stage needs a decoder layer",
           stages, n_layers);
  // best[s][l]: the least possible most expensive stage when stages 0..s-1 hold the first l layers. Stage s's cost
  // is its layer count, plus the embedding on stage 0 and the head on the last.
  const int L = int(n_layers), S = stages;
  const double inf = 1e300;
  std::vector<std::vector<double>> best(size_t(S + 1), std::vector<double>(size_t(L + 1), inf));
  std::vector<std::vector<int>> cut(size_t(S + 1), std::vector<int>(size_t(L + 1), 0));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s)
    for (int l = s; l <= L - (S - s); ++l)
      for (int k = s - 1; k < l; ++k) {  // stage s-1 holds layers [k, l); on a tie the later stage takes more
        double c = double(l - k) + (s == 1 ? first_extra : 0) + (s == S ? last_extra : 0);
        double v = std::max(best[size_t(s - 1)][size_t(k)], c);
        if (v < best[size_t(s)][size_t(l)] - 1e-12) best[size_t(s)][size_t(l)] = v, cut[size_t(s)][size_t(l)] = k;
      }
  std::vector<int> split(static_cast<size_t>(S), 0);
  for (int s = S, l = L; s >= 1; --s) {
    const int k = cut[size_t(s)][size_t(l)];
    split[size_t(s - 1)] = l - k;
    l = k;
  }
  return split;
}

std::string pp_schedule_str(const PpSchedule& s) {
  std::string out;
  for (int r = 0; r < s.p; ++r) {
    out += fmt::format("rank {}:", r);
    for (const PpAction& a : s.ranks[size_t(r)]) {
      if (!is_compute(a.op)) continue;
      out += fmt::format(" {}{}", pp_op_name(a.op), a.micro);
      if (s.v > 1) out += fmt::format(".{}", a.stage / s.p);
    }
    out += "\n";
  }
  return out;
}

std::vector<ModelChunk> pp_rank_chunks(const std::vector<int>& split, int p, int v, int rank) {
  const int S = p * v;
  MT_CHECK(int(split.size()) == S, "parallel", "a split of {} stages for pp {} x pp_virtual {}", split.size(), p, v);
  std::vector<int64_t> begin(size_t(S) + 1, 0);
  for (int s = 0; s < S; ++s) begin[size_t(s) + 1] = begin[size_t(s)] + split[size_t(s)];
  std::vector<ModelChunk> out;
  for (int s = rank; s < S; s += p)
    out.push_back({s, begin[size_t(s)], begin[size_t(s) + 1], s == 0, s == S - 1});
  return out;
}

int64_t pp_step_sends(const PpSchedule& s, int pp_rank) {
  int64_t sends = 0;
  for (int st = pp_rank; st < s.stages(); st += s.p) sends += s.m * ((st < s.stages() - 1) + (st > 0));
  return sends;
}

std::vector<CommBytes> pp_step_bytes(const PpSchedule& s, int pp_rank, double message_bytes, const std::string& tag) {
  const int64_t sends = pp_step_sends(s, pp_rank);
  return {{tag, dim::pp, "send", double(sends) * message_bytes, sends, true}, {tag, dim::pp, "recv", 0, sends, true}};
}

}  // namespace mt
