// Timeline traces in the Chrome trace event format, which Perfetto and chrome://tracing open.
// `profile.steps: [a, b]` and `profile.dir` (runtime/io/config.h) turn recording on for those steps: every rank
// appends events to one vector in memory and writes `profile.dir/trace_rank{R}.json` at the end of the range;
// `meshtrain trace merge DIR` (or rank 0 at the end of the range) joins them into DIR/trace.json, a process per
// rank.
//
// What records a span: ops (kprof::Scope's hook points, category "op"), Group collectives ("comm": kind, group,
// tag, bytes, peer; their waits "wait"), the control plane ("control"), pipeline actions ("pipeline": stage,
// micro-batch), the step's phases ("phase"), data loading, evaluation and checkpoints. The allocator's bytes are
// a counter track ("C" events) written at every change.
//
// Off (the default) a hook is one test of a global bool: nothing is recorded. Timestamps come from the host's
// steady clock plus an offset measured against rank 0 at start (set_clock), in microseconds since rank 0's start.
//
// Beside the trace, `wait_ns()` counts the nanoseconds this process has spent blocked in collectives (blocking
// Group calls, Work::wait and the control plane), read per step for the slow-rank check; on when timing() is.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mt::trace {

extern bool g_on;      // recording events now
extern bool g_timing;  // counting wait time (set by the training loop)
inline bool on() { return g_on; }
inline bool timing() { return g_on || g_timing; }

int64_t now_ns();  // the host's steady clock

// Event args: the fields the viewers show beside a span (empty / negative: not written).
struct Args {
  std::string tag, group, kind, detail;
  int64_t bytes = -1;
  int peer = -1, stage = -1, micro = -1;
  int64_t step = -1;
};

// This process's rank and host (names the process in the trace), and the offset that maps its clock to rank 0's
// (ns to add) and rank 0's time at start (ns; the trace's zero).
void set_process(int rank, const std::string& host);
void set_clock(int64_t offset_ns, int64_t zero_ns, int64_t rtt_ns);
int64_t clock_offset_ns();

// Starts and stops recording (events are kept until take/write).
void start();
void stop();
void clear();  // the events and the count of dropped ones

// The most events kept (profile.max_events): past it each new event is dropped and counted, so a long range holds
// bounded memory. full(): the bound is reached.
void set_max_events(size_t n);
bool full();
size_t dropped_events();

// A complete event ("ph":"X") on this thread's lane. name and cat must outlive the run (literals) unless given
// as a string.
void complete(const char* name, const char* cat, int64_t t0_ns, int64_t t1_ns, Args args = {});
void complete(std::string name, const char* cat, int64_t t0_ns, int64_t t1_ns, Args args = {});
// A complete event on a named lane of its own (the device's streams: "GPU kernels", "GPU collectives"), made on
// first use.
void complete_on(const char* lane, const char* name, const char* cat, int64_t t0_ns, int64_t t1_ns);
// A counter sample ("ph":"C"): series name -> value, at now.
void counter(const char* name, std::vector<std::pair<const char*, double>> values, int64_t t_ns = -1);
// Names this thread's lane ("main", "checkpoint writer").
void name_thread(const std::string& name);

// Memory by part: the model state's bytes and the gradient buckets' (fixed during a run: set
// once by the training loop), the fully_shard units' (the host allocations made inside a UnitScope while
// recording, followed to their free), and a sample of the allocator's bytes in use, written as the counter
// "memory" with the series parameters, gradients, optimizer, "communication buffers", "fully_shard units",
// "checkpoint snapshot" (the host allocations made inside a SnapshotScope, followed to their free) and
// "activations and temporaries" (the rest), stacked to the allocator's total. The host allocator samples at every
// change and reports each allocation and free (memory_block).
void set_memory_parts(int64_t parameters, int64_t gradients, int64_t optimizer, int64_t buffers = 0);
// Whose allocator the track follows: -1 the host's (CPU runs), else that CUDA device's caching allocator.
extern int g_memory_device;
inline void set_memory_device(int device) { g_memory_device = device; }
void memory_sample(int64_t allocated_bytes);
void memory_block(const void* p, int64_t bytes, bool allocated);
// While one lives, this thread's host allocations count as the fully_shard units' (gathers, unpacked weights,
// full-size gradients and their reduce buffers); nested scopes count once.
class UnitScope {
 public:
  UnitScope();
  ~UnitScope();
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;
};
// While one lives, this thread's host allocations count as a checkpoint's snapshot (a UnitScope inside wins).
class SnapshotScope {
 public:
  SnapshotScope();
  ~SnapshotScope();
  SnapshotScope(const SnapshotScope&) = delete;
  SnapshotScope& operator=(const SnapshotScope&) = delete;
};

// The wait time counted so far (see above), and its addition.
int64_t wait_ns();
void add_wait_ns(int64_t ns);

// The events as a JSON object text {"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}};
// metadata_json: the text of a JSON object (or "" for {}). Writes path; returns false when it cannot.
bool write(const std::string& path, const std::string& metadata_json);
size_t event_count();

// A span on this thread's lane while it lives (when recording at its start).
class Span {
 public:
  Span(const char* name, const char* cat) {
    if (g_on) t0_ = now_ns(), name_ = name, cat_ = cat;
  }
  Span(const char* name, const char* cat, Args args) {
    if (g_on) t0_ = now_ns(), name_ = name, cat_ = cat, args_ = std::move(args);
  }
  ~Span() {
    if (t0_ >= 0) complete(name_, cat_, t0_, now_ns(), std::move(args_));
  }
  Args* args() { return t0_ >= 0 ? &args_ : nullptr; }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  int64_t t0_ = -1;
  const char* name_ = nullptr;
  const char* cat_ = nullptr;
  Args args_;
};

// JSON string escaping (quotes included).
std::string json_string(const std::string& s);

}  // namespace mt::trace
