// The recorder of trace.h: one vector of events per process under a mutex, written as Chrome trace JSON.
#include "runtime/core/trace.h"
#include "runtime/core/trace_memory.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

namespace mt::trace {

bool g_on = false;
bool g_timing = false;
int g_memory_device = -1;

namespace {

struct Event {
  char ph;  // 'X' or 'C'
  int tid;
  const char* name;   // a literal, or null when owned is the name
  std::string owned;  // a name made at run time
  const char* cat;
  int64_t t0, t1;  // local steady-clock ns
  Args args;
  std::vector<std::pair<const char*, double>> values;  // counters
};

struct State {
  std::mutex mu;
  std::vector<Event> events;
  std::vector<std::pair<int, std::string>> threads;
  int rank = 0;
  std::string host;
  int64_t offset_ns = 0, zero_ns = 0, rtt_ns = 0;
  int next_tid = 0;
  size_t max_events = SIZE_MAX, dropped = 0;
  // Past max_events: counted, not kept (the caller holds mu). The vector grows by doubling up to max_events, never
  // past it: a full buffer holds max_events * sizeof(Event) bytes, not up to twice that.
  bool drop_locked() {
    if (events.size() >= max_events) {
      ++dropped;
      return true;
    }
    if (events.size() == events.capacity())
      events.reserve(std::min(max_events, std::max<size_t>(1024, 2 * events.size())));
    return false;
  }
};
State& state() {
  static State* s = new State;  // never destroyed: spans may end during static destruction
  return *s;
}

std::atomic<int64_t> g_wait_ns{0};
thread_local int t_tid = -1;

int tid_locked(State& s) {
  if (t_tid < 0) {
    t_tid = s.next_tid++;
    s.threads.emplace_back(t_tid, t_tid == 0 ? "main" : fmt::format("thread {}", t_tid));
  }
  return t_tid;
}

// Microseconds since rank 0's zero, on rank 0's clock.
double ts_us(const State& s, int64_t t) { return double(t + s.offset_ns - s.zero_ns) * 1e-3; }

void append_args(std::string& o, const Args& a) {
  std::string r;
  auto add = [&](const char* k, const std::string& v) {
    r += (r.empty() ? "" : ",") + fmt::format("\"{}\":{}", k, v);
  };
  if (!a.tag.empty()) add("tag", json_string(a.tag));
  if (!a.group.empty()) add("group", json_string(a.group));
  if (!a.kind.empty()) add("kind", json_string(a.kind));
  if (!a.detail.empty()) add("detail", json_string(a.detail));
  if (a.bytes >= 0) add("bytes", std::to_string(a.bytes));
  if (a.peer >= 0) add("peer", std::to_string(a.peer));
  if (a.stage >= 0) add("stage", std::to_string(a.stage));
  if (a.micro >= 0) add("micro", std::to_string(a.micro));
  if (a.step >= 0) add("step", std::to_string(a.step));
  if (!r.empty()) o += ",\"args\":{" + r + "}";
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void set_process(int rank, const std::string& host) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.rank = rank, s.host = host;
}

void set_clock(int64_t offset_ns, int64_t zero_ns, int64_t rtt_ns) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.offset_ns = offset_ns, s.zero_ns = zero_ns, s.rtt_ns = rtt_ns;
}

int64_t clock_offset_ns() { return state().offset_ns; }

void start() { g_on = true; }
void stop() { g_on = false; }
void clear() {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.events.clear();
  s.events.shrink_to_fit();  // a range's memory is given back when it is written
  s.dropped = 0;
}

void set_max_events(size_t n) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.max_events = n;
}

bool full() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.events.size() >= s.max_events;
}

size_t dropped_events() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.dropped;
}

void complete(const char* name, const char* cat, int64_t t0, int64_t t1, Args args) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.drop_locked()) return;
  s.events.push_back(Event{'X', tid_locked(s), name, {}, cat, t0, t1, std::move(args), {}});
}

void complete(std::string name, const char* cat, int64_t t0, int64_t t1, Args args) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.drop_locked()) return;
  s.events.push_back(Event{'X', tid_locked(s), nullptr, std::move(name), cat, t0, t1, std::move(args), {}});
}

void complete_on(const char* lane, const char* name, const char* cat, int64_t t0, int64_t t1) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.drop_locked()) return;
  int tid = -1;
  for (auto& [t, n] : s.threads)
    if (n == lane) tid = t;
  if (tid < 0) {
    tid = s.next_tid++;
    s.threads.emplace_back(tid, lane);
  }
  s.events.push_back(Event{'X', tid, name, {}, cat, t0, t1, {}, {}});
}

void counter(const char* name, std::vector<std::pair<const char*, double>> values, int64_t t) {
  if (t < 0) t = now_ns();
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.drop_locked()) return;
  s.events.push_back(Event{'C', tid_locked(s), name, {}, "memory", t, t, {}, std::move(values)});
}

void name_thread(const std::string& name) {
  State& s = state();
  std::lock_guard lock(s.mu);
  const int tid = tid_locked(s);
  for (auto& [t, n] : s.threads)
    if (t == tid) n = name;
}

namespace {
int64_t g_parts[4] = {0, 0, 0, 0};  // parameters, gradients, optimizer, communication buffers
thread_local int t_unit_depth = 0, t_snapshot_depth = 0;
std::mutex g_units_mu;
// Live allocations made in a UnitScope (owner 0) or a SnapshotScope (owner 1) while recording: bytes, owner.
std::unordered_map<const void*, std::pair<int64_t, int>> g_owned_blocks;
int64_t g_owned_bytes[2] = {0, 0};  // fully_shard units, checkpoint snapshot
}  // namespace

UnitScope::UnitScope() { ++t_unit_depth; }
UnitScope::~UnitScope() { --t_unit_depth; }
SnapshotScope::SnapshotScope() { ++t_snapshot_depth; }
SnapshotScope::~SnapshotScope() { --t_snapshot_depth; }

void set_memory_parts(int64_t parameters, int64_t gradients, int64_t optimizer, int64_t buffers) {
  g_parts[0] = parameters, g_parts[1] = gradients, g_parts[2] = optimizer, g_parts[3] = buffers;
}

void memory_block(const void* p, int64_t bytes, bool allocated) {
  const int owner = t_unit_depth > 0 ? 0 : t_snapshot_depth > 0 ? 1 : -1;
  if (allocated && owner < 0) return;  // neither a unit's nor a snapshot's: nothing to follow
  std::lock_guard lock(g_units_mu);
  if (allocated) {
    g_owned_blocks[p] = {bytes, owner}, g_owned_bytes[owner] += bytes;
  } else if (auto it = g_owned_blocks.find(p); it != g_owned_blocks.end()) {
    g_owned_bytes[it->second.second] -= it->second.first;
    g_owned_blocks.erase(it);
  }
}

MemoryParts g_peak;
std::mutex g_peak_mu;

MemoryParts memory_peak() {
  std::lock_guard lock(g_peak_mu);
  return g_peak;
}
void reset_memory_peak() {
  std::lock_guard lock(g_peak_mu);
  g_peak = {};
  std::lock_guard units(g_units_mu);  // blocks allocated before this range are not followed
  g_owned_blocks.clear();
  g_owned_bytes[0] = g_owned_bytes[1] = 0;
}

void memory_sample(int64_t a) {
  // The fixed parts first (each at most what is left), then the units and a snapshot, then the rest.
  int64_t left = a;
  auto take = [&](int64_t want) {
    const int64_t t = std::max<int64_t>(0, std::min(left, want));
    left -= t;
    return t;
  };
  MemoryParts m;
  m.parameters = take(g_parts[0]);
  m.gradients = take(g_parts[1]);
  m.optimizer = take(g_parts[2]);
  m.buffers = take(g_parts[3]);
  {
    std::lock_guard lock(g_units_mu);
    m.units = take(g_owned_bytes[0]);
    m.snapshot = take(g_owned_bytes[1]);
  }
  m.other = left;
  {
    std::lock_guard lock(g_peak_mu);  // the step's peak: a snapshot still being written does not move it
    if (m.training() > g_peak.training()) g_peak = m;
  }
  counter("memory", {{"parameters", double(m.parameters)},
                     {"gradients", double(m.gradients)},
                     {"optimizer", double(m.optimizer)},
                     {"communication buffers", double(m.buffers)},
                     {"fully_shard units", double(m.units)},
                     {"checkpoint snapshot", double(m.snapshot)},
                     {"activations and temporaries", double(m.other)}});
}

int64_t wait_ns() { return g_wait_ns.load(std::memory_order_relaxed); }
void add_wait_ns(int64_t ns) { g_wait_ns.fetch_add(ns, std::memory_order_relaxed); }

size_t event_count() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.events.size();
}

std::string json_string(const std::string& in) {
  std::string r = "\"";
  for (unsigned char c : in) {
    if (c == '"' || c == '\\') r += '\\', r += char(c);
    else if (c < 0x20) r += fmt::format("\\u{:04x}", c);
    else r += char(c);
  }
  return r + "\"";
}

bool write(const std::string& path, const std::string& metadata_json) {
  State& s = state();
  std::lock_guard lock(s.mu);
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  // Written in pieces of about 1 MiB: a long range's text is never held whole beside its events.
  bool ok = true;
  std::string o;
  o.reserve((1 << 20) + 4096);
  auto flush = [&](size_t at_least) {
    if (o.size() < at_least) return;
    ok = ok && std::fwrite(o.data(), 1, o.size(), f) == o.size();
    o.clear();
  };
  o += "{\"traceEvents\":[\n";
  const int pid = s.rank;
  // Metadata: the process (rank and host) and each thread's lane, ordered by rank.
  o += fmt::format("{{\"name\":\"process_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{},\"tid\":0,\"args\":{{\"name\":{}}}}}",
                   pid, json_string(fmt::format("rank {} ({})", s.rank, s.host)));
  o += fmt::format(",\n{{\"name\":\"process_sort_index\",\"ph\":\"M\",\"ts\":0,\"pid\":{},\"tid\":0,\"args\":{{"
                   "\"sort_index\":{}}}}}",
                   pid, s.rank);
  for (auto& [tid, name] : s.threads)
    o += fmt::format(",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}}",
                     pid, tid, json_string(name));
  for (const Event& e : s.events) {
    const std::string name = e.name ? json_string(e.name) : json_string(e.owned);
    if (e.ph == 'X') {
      o += fmt::format(",\n{{\"name\":{},\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{:.3f},\"dur\":{:.3f},\"pid\":{},\"tid\":{}",
                       name, e.cat, ts_us(s, e.t0), double(std::max<int64_t>(e.t1 - e.t0, 0)) * 1e-3, pid, e.tid);
      append_args(o, e.args);
      o += "}";
    } else {
      std::string vals;
      for (auto& [k, v] : e.values) vals += (vals.empty() ? "" : ",") + fmt::format("\"{}\":{:.0f}", k, v);
      o += fmt::format(",\n{{\"name\":{},\"cat\":\"{}\",\"ph\":\"C\",\"ts\":{:.3f},\"pid\":{},\"tid\":{},\"args\":{{{}}}}}",
                       name, e.cat, ts_us(s, e.t0), pid, e.tid, vals);
    }
    flush(1 << 20);
  }
  o += fmt::format("\n],\"displayTimeUnit\":\"ms\",\"metadata\":{{\"rank\":{},\"host\":{},\"clock_offset_ns\":{},"
                   "\"clock_sync_rtt_ns\":{},\"run\":{}}}}}\n",
                   s.rank, json_string(s.host), s.offset_ns, s.rtt_ns, metadata_json.empty() ? "{}" : metadata_json);
  flush(0);
  return std::fclose(f) == 0 && ok;
}

}  // namespace mt::trace
