// The opt-in op profiler of kernel_profile.h: CUDA events from a pool (one pair per op launch), read after
// each step; host-clock times for CPU ops; totals per op name.
#include "runtime/core/kernel_profile.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "runtime/core/stream.h"
#include "runtime/core/tensor.h"

namespace mt::kprof {

namespace {

bool read_env() {
  const char* e = std::getenv("MT_PROFILE_KERNELS");
  return e && *e && std::string(e) != "0";
}

struct Pending {  // a device op whose events are not read yet
  const char* name;
  const char* category;
  double flops, bytes;
  size_t start, end;  // indices into the event pool
};

struct State {
  std::mutex mu;
  std::vector<Event> pool;   // every event made so far (timing events)
  std::vector<size_t> free;  // indices of pool not in use
  std::vector<Pending> pending;
  std::map<std::string, OpStat> totals;
};
State& state() {
  static State* s = new State;  // never destroyed: scopes may run during static destruction
  return *s;
}
thread_local int t_depth = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string key_of(const char* name, const char* category) {
  return category ? fmt::format("{}:{}", category, name) : std::string(name);
}

void add(State& s, const char* name, const char* category, double ms, double flops, double bytes, bool device) {
  OpStat& o = s.totals[key_of(name, category)];
  if (o.name.empty()) o.name = key_of(name, category);
  o.calls += 1;
  o.ms += ms;
  o.flops += flops;
  o.bytes += bytes;
  o.device = o.device || device;
  o.comm = o.comm || (category && std::string(category) == "nccl");
}

size_t take_event(State& s) {
  if (s.free.empty()) {
    s.pool.push_back(Event::create(true));
    return s.pool.size() - 1;
  }
  size_t i = s.free.back();
  s.free.pop_back();
  return i;
}

// What Scope::end needs of a timing scope, by slot: device records keep their name and cost in `pending`;
// host ones in this thread's small stack (scopes end in reverse order of their start).
struct HostOpen {
  const char* name;
  const char* category;
  double flops, bytes;
  int64_t t0;
};
thread_local std::vector<HostOpen> t_host;
thread_local std::vector<const Stream*> t_streams;  // the stream of each open device scope

}  // namespace

extern const bool g_enabled = read_env();

double bytes_of(std::initializer_list<const Tensor*> ts) {
  double b = 0;
  for (const Tensor* t : ts)
    if (t && t->defined()) b += double(t->nbytes());
  return b;
}

double bytes_of_all(const std::vector<Tensor>& ts) {
  double b = 0;
  for (const Tensor& t : ts)
    if (t.defined()) b += double(t.nbytes());
  return b;
}

void Scope::begin(const char* name, const char* category, Device d, double flops, double bytes, const Stream* stream) {
  if (t_depth++ > 0) {
    state_ = 1;
    return;
  }
  state_ = 2;
  if (!d.is_cuda()) {
    t_host.push_back({name, category, flops, bytes, now_ns()});
    slot_ = -1;
    return;
  }
  const Stream& st = stream ? *stream : current_stream(d.index);
  State& s = state();
  std::lock_guard lock(s.mu);
  Pending p{name, category, flops, bytes, take_event(s), take_event(s)};
  s.pool[p.start].record(st);
  slot_ = int64_t(s.pending.size());
  s.pending.push_back(p);
  t_streams.push_back(&st);
}

void Scope::end() {
  --t_depth;
  if (state_ != 2) return;
  if (slot_ < 0) {
    HostOpen h = t_host.back();
    t_host.pop_back();
    State& s = state();
    std::lock_guard lock(s.mu);
    add(s, h.name, h.category, double(now_ns() - h.t0) * 1e-6, h.flops, h.bytes, false);
    return;
  }
  const Stream* st = t_streams.back();
  t_streams.pop_back();
  State& s = state();
  std::lock_guard lock(s.mu);
  s.pool[s.pending[size_t(slot_)].end].record(*st);
}

thread_local int t_trace_depth = 0;

// The device side of traced ops: event pairs from the same pool as the profiler's, and the reference event that
// places them on the host clock (recorded on an idle device: its host time is when it ran).
struct TracePending {
  const char* name;
  bool comm;
  size_t start, end;
  const Stream* stream;
};
std::vector<TracePending> g_trace_pending;  // under state().mu
int64_t g_trace_ref = -1;                   // pool index of the reference event, -1: none yet this step
int64_t g_trace_ref_ns = 0;

void Scope::trace_begin(const char* name, const char* category, Device d, const Stream* stream) {
  if (t_trace_depth++ > 0) {
    trace_state_ = 1;
    return;
  }
  trace_state_ = 2;
  trace_name_ = name;
  trace_t0_ = trace::now_ns();
  if (!d.is_cuda()) return;
  const Stream& st = stream ? *stream : current_stream(d.index);
  State& s = state();
  std::lock_guard lock(s.mu);
  if (g_trace_ref < 0) {  // the step's first device op: an idle device, then the reference
    device_synchronize();
    g_trace_ref = int64_t(take_event(s));
    g_trace_ref_ns = trace::now_ns();
    s.pool[size_t(g_trace_ref)].record(st);
  }
  TracePending p{name, category && std::string(category) == "nccl", take_event(s), take_event(s), &st};
  s.pool[p.start].record(st);
  trace_slot_ = int64_t(g_trace_pending.size());
  g_trace_pending.push_back(p);
}

void Scope::trace_end() {
  --t_trace_depth;
  if (trace_state_ != 2) return;
  trace::complete(trace_name_, "op", trace_t0_, trace::now_ns());
  if (trace_slot_ < 0) return;
  State& s = state();
  std::lock_guard lock(s.mu);
  const TracePending& p = g_trace_pending[size_t(trace_slot_)];
  s.pool[p.end].record(*p.stream);
}

void trace_device_flush() {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (g_trace_ref < 0) return;
  device_synchronize();
  const Event& ref = s.pool[size_t(g_trace_ref)];
  for (const TracePending& p : g_trace_pending) {
    const auto at = [&](size_t e) { return g_trace_ref_ns + int64_t(double(ref.elapsed_ms(s.pool[e])) * 1e6); };
    trace::complete_on(p.comm ? "GPU collectives" : "GPU kernels", p.name, p.comm ? "gpu comm" : "gpu", at(p.start),
                       at(p.end));
    s.free.push_back(p.start);
    s.free.push_back(p.end);
  }
  g_trace_pending.clear();
  s.free.push_back(size_t(g_trace_ref));
  g_trace_ref = -1;
}

// A muted thread looks like one inside a scope: every scope it opens is nested, hence not timed.
Mute::Mute() { ++t_depth; }
Mute::~Mute() { --t_depth; }

double flush() {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.pending.empty()) return 0;
  device_synchronize();  // every recorded event has happened: one wait for the whole step
  double total = 0;
  for (const Pending& p : s.pending) {
    const double ms = double(s.pool[p.start].elapsed_ms(s.pool[p.end]));
    add(s, p.name, p.category, ms, p.flops, p.bytes, true);
    total += ms;
    s.free.push_back(p.start);
    s.free.push_back(p.end);
  }
  s.pending.clear();
  return total;
}

void reset() {
  flush();
  State& s = state();
  std::lock_guard lock(s.mu);
  s.totals.clear();
}

std::vector<OpStat> stats() {
  State& s = state();
  std::lock_guard lock(s.mu);
  std::vector<OpStat> r;
  for (auto& [k, v] : s.totals) r.push_back(v);
  std::sort(r.begin(), r.end(), [](const OpStat& a, const OpStat& b) { return a.ms > b.ms; });
  return r;
}

std::string report(int top, int64_t steps, double peak_flops, double peak_bw, const std::string& what) {
  std::vector<OpStat> all = stats();
  double total_ms = 0;
  for (const OpStat& o : all) total_ms += o.ms;
  const double ridge = peak_flops > 0 && peak_bw > 0 ? peak_flops / peak_bw : 0;
  const double per = double(std::max<int64_t>(steps, 1));
  std::string r = fmt::format("kernel profile ({}): {} ops, {:.3f} ms timed per step over {} step(s)\n", what,
                              all.size(), total_ms / per, steps);
  if (ridge > 0)
    r += fmt::format(
        "bound by is an estimate: the op's FLOPs per byte of its operands (each read or written once) against the "
        "ridge point {:.0f} TFLOP/s / {:.1f} TB/s = {:.0f} FLOP/B; an op without a FLOP count is data movement\n",
        peak_flops / 1e12, peak_bw / 1e12, ridge);
  r += fmt::format("{:>3} {:<34} {:>8} {:>11} {:>7} {:>10} {:>9} {:>9} {:>8}  {}\n", "#", "op", "calls", "total ms",
                   "share", "ms/call", "TFLOP/s", "GB/s", "FLOP/B", "bound by (estimate)");
  int i = 0;
  for (const OpStat& o : all) {
    if (i >= top) break;
    const double s = o.ms * 1e-3;
    const double tflops = o.flops > 0 && s > 0 ? o.flops / s / 1e12 : 0;
    const double gbs = o.bytes > 0 && s > 0 ? o.bytes / s / 1e9 : 0;
    const double ai = o.bytes > 0 ? o.flops / o.bytes : 0;
    std::string bound = "-";
    if (o.comm) {
      bound = "communication";
    } else if (ridge > 0) {
      if (o.flops > 0 && ai >= ridge)
        bound = fmt::format("compute ({:.0f}% of {:.0f} TFLOP/s)", 100 * tflops * 1e12 / peak_flops, peak_flops / 1e12);
      else if (o.bytes > 0)
        bound = fmt::format("memory ({:.0f}% of {:.1f} TB/s)", 100 * gbs * 1e9 / peak_bw, peak_bw / 1e12);
    }
    r += fmt::format("{:>3} {:<34} {:>8} {:>11.3f} {:>6.1f}% {:>10.4f} {:>9} {:>9} {:>8}  {}\n", ++i, o.name, o.calls,
                     o.ms, total_ms > 0 ? 100 * o.ms / total_ms : 0.0, o.ms / double(o.calls),
                     o.flops > 0 ? (tflops < 1 ? fmt::format("{:.4f}", tflops) : fmt::format("{:.1f}", tflops)) : "-",
                     o.bytes > 0 ? fmt::format("{:.1f}", gbs) : "-", o.flops > 0 ? fmt::format("{:.1f}", ai) : "-",
                     bound);
  }
  return r;
}

}  // namespace mt::kprof
