// The CUDA runtime API of the emulated device (build option -Demulate_cuda=true): every cuda* call meshtrain
// makes, over host memory, declared by the toolkit's own cuda_runtime_api.h and linked instead of libcudart.
// Test-only: a binary built with it says so (cuda_runtime.cpp's device description).
//
// Memory. cudaMalloc returns host memory (256-byte aligned, filled with 0xff bytes: NaN in f32 and bf16, so a
// kernel that reads what nobody wrote shows) and enters it in the registry of live allocations; pinned memory
// (cudaMallocHost) is plain host memory in a set of its own. Copies check their direction against the registry
// (a DeviceToHost whose source is not device memory, a copy running past an allocation, ... are errors naming
// the call), and so does every pointer argument of a kernel launch (tests/emu/cuda_emulator.h, MT_LAUNCH).
//
// Execution and order. Every operation runs when it is enqueued, on the calling host thread (kernels spread
// their blocks over the cores), so its results are complete when the call returns and events are always
// complete. What the emulator models is the order a real device would guarantee, with vector clocks:
//   - each stream S has a clock VC_S (one counter per stream); each operation enqueued on S advances VC_S[S];
//   - cudaEventRecord(E, S) copies VC_S into E; cudaStreamWaitEvent(S, E) makes VC_S = max(VC_S, VC_E);
//   - the host has a clock too: stream, event and device synchronisation (and a successful cudaEventQuery, the
//     synchronous cudaMemcpy and cudaFree) merge what the host waited for into it, and every enqueue merges the
//     host clock into the stream (work enqueued after the host saw X completed runs after X);
//   - the legacy default stream (0, cudaStreamLegacy; cudaStreamPerThread is treated as it) waits for the
//     blocking streams of its device and they for it; cudaStreamNonBlocking streams do not.
// Each allocation remembers its last write (stream, that stream's counter, the call) and the last read on each
// stream since. An access on S to an allocation last written on S' != S is a hazard unless VC_S[S'] has reached
// that write; a write is also checked against the reads of other streams (write after read). A hazard is
// reported ("missing cudaStreamWaitEvent", naming both streams, the allocation and both calls) and the call
// fails with cudaErrorIllegalState.
// What it cannot catch: the unit is the whole allocation (two streams writing disjoint halves of one buffer
// are reported, correctly ordered or not, as a hazard; with the caching allocator one tensor is one
// allocation); host reads and writes of host memory (reading a DeviceToHost result before synchronising;
// rewriting a pinned source before its HostToDevice copy ran); pointers inside struct arguments of kernels;
// races between threads of one kernel; anything about timing. Kernel arguments are classified by the kernel's
// parameter types: `const T*` is read, `T*` is written (and read: a write is checked as both).
//
// Stream capture (CUDA graphs). Between cudaStreamBeginCapture and cudaStreamEndCapture on a stream, every
// enqueuing call on it (kernel launches, async copies and memsets, event records and waits; the stand-ins'
// cublasLtMatmul, NCCL operations and cudnnBackendExecute through record_if_capturing) is recorded instead of run:
// the same call, made again by each cudaGraphLaunch, so a replay is checked (buffers, hazards, canaries) as the
// eager calls are. A stream that waits for an event recorded in a capture joins it (the fork); at the end every
// joined stream must have been waited for by the origin (the join: else cudaErrorStreamCaptureUnjoined). As on a
// device: host copies must be pinned memory (read or written at each replay); synchronising a capturing stream or
// the device, or querying an event recorded in a capture, fails and invalidates the capture (the end then returns
// cudaErrorStreamCaptureInvalidated); cudaMalloc is refused unless the mode is cudaStreamCaptureModeRelaxed. The
// recorded calls keep the values of their scalar arguments at capture (kernel arguments, alpha and beta), as a
// graph does. Graphs are a list of calls: replays run in the captured order.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/core/cuda_backend.h"
#include "tests/emu/cuda_emulator_hooks.h"
#include "tests/emu/device_registry.h"

namespace emu {
namespace {

using Clock = std::vector<unsigned long long>;  // indexed by stream id

void merge(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}
unsigned long long at(const Clock& c, int id) { return size_t(id) < c.size() ? c[size_t(id)] : 0; }

struct Capture;

struct StreamRec {
  int id = 0;
  int device = 0;
  bool blocking = true;  // synchronises with the legacy default stream
  bool legacy = false;
  bool alive = true;
  std::string name;
  Clock vc;
  std::shared_ptr<Capture> capture;  // the capture this stream is in, if any
};

// A stream capture in progress: the recorded calls in host order, the streams in it and whether each forked one
// was joined back (the origin waited for an event recorded on it after its last call).
struct Capture {
  int origin = 0;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::vector<std::function<void()>> ops;
  std::map<int, bool> forked;  // stream id -> joined since its last recorded call
  bool invalid = false;
  std::string why;  // the first call that invalidated it
};

struct EventRec {
  std::shared_ptr<Capture> captured;  // last recorded in this capture (queries fail, waits join it)
  int captured_stream = -1;
  // In a graph a captured record and the waits on it are an edge, not the event (which may be gone by a replay):
  // the clock the replayed record leaves for the replayed waits.
  std::shared_ptr<Clock> edge;
  int device = 0;
  bool timing = true;
  bool recorded = false;
  int not_ready = 0;  // queries still to answer cudaErrorNotReady (MT_EMU_EVENT_POLLS)
  Clock vc;
  std::chrono::steady_clock::time_point when;
};

struct Access {
  int stream = -1;
  unsigned long long tick = 0;
  const char* call = "";
};

constexpr size_t kCanaryZone = 256;      // bytes past a block's end, in the same host allocation
// Their value, and that of a block's bytes past its extent: 0xff, NaN in f32 and bf16, so that a kernel reading past
// its tensor puts NaN into what it computes (the op table fails on a NaN), while a write past it is caught
// byte-exactly after the launch (unless it writes 0xff bytes).
constexpr unsigned char kCanary = 0xff;

struct Alloc {
  size_t bytes = 0;   // what cudaMalloc was asked for
  size_t extent = 0;  // the part in use: bytes, or what the caching allocator handed out (0: in its free list)
  size_t block = 0;   // bytes 256-rounded: [extent, block + kCanaryZone) is the canary
  int device = 0;
  unsigned long long serial = 0;
  Access last_write;            // stream -1: never written
  std::map<int, Access> reads;  // since the last write, one per stream
};

void print_stats();

struct State {
  std::recursive_mutex mu;
  std::map<uintptr_t, Alloc> allocs;  // by start address
  std::set<void*> pinned;
  std::map<uintptr_t, size_t> pinned_bytes;  // start -> size (capture: host copies must lie in pinned memory)
  std::vector<StreamRec> streams;  // by id
  std::unordered_map<cudaStream_t, int> stream_ids;
  std::unordered_map<cudaEvent_t, EventRec> events;
  std::vector<int> legacy;  // legacy default stream id per device
  std::unordered_map<const void*, int> max_dyn_smem;
  Clock host;
  size_t live_bytes = 0;
  unsigned long long next_serial = 1;
  uintptr_t next_handle = 0x10000;
  int n_devices = 1;
  int event_polls = 0;  // MT_EMU_EVENT_POLLS=N: the first N queries of each recorded event answer "not ready"
  size_t device_bytes = size_t(16) << 30;
  bool abort_on_report = false;
  long long reports = 0;
  // MT_EMU_STATS=1: one line on stderr at exit, what was checked (evidence that a clean run exercised the tracker).
  struct {
    long long allocs = 0, launches = 0, copies = 0, accesses = 0, cross_stream = 0, waits = 0, syncs = 0;
  } stats;
  State() {
    if (const char* d = std::getenv("MT_EMU_DEVICES")) n_devices = std::max(1, std::atoi(d));
    if (const char* m = std::getenv("MT_EMU_DEVICE_MEMORY_MB")) device_bytes = size_t(std::atoll(m)) << 20;
    if (const char* a = std::getenv("MT_EMU_ABORT")) abort_on_report = a[0] == '1';
    if (const char* e = std::getenv("MT_EMU_EVENT_POLLS")) event_polls = std::max(0, std::atoi(e));
    if (const char* a = std::getenv("MT_EMU_STATS"); a && a[0] == '1') std::atexit(print_stats);
    for (int d = 0; d < n_devices; ++d) {
      StreamRec s;
      s.id = int(streams.size());
      s.device = d;
      s.legacy = true;
      s.name = "the legacy default stream of cuda:" + std::to_string(d);
      legacy.push_back(s.id);
      streams.push_back(std::move(s));
    }
  }
};

State& S() {
  static State* s = new State;  // never destroyed: static destructors free tensors late
  return *s;
}

void print_stats() {
  auto& s = S();
  std::lock_guard lock(s.mu);
  std::fprintf(stderr,
               "[cuda-emu] pid %d: %lld cudaMalloc, %lld kernel launches, %lld copies/memsets, %lld buffer accesses "
               "tracked (%lld following an access on another stream, each checked for its ordering), %lld "
               "cudaStreamWaitEvent, %lld host synchronisations, %lld errors reported\n",
               int(getpid()), s.stats.allocs, s.stats.launches, s.stats.copies, s.stats.accesses, s.stats.cross_stream,
               s.stats.waits, s.stats.syncs, s.reports);
}

thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local std::string t_last_report;
thread_local cudaError_t t_report_code = cudaSuccess;

std::string ptr_text(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

// Sets the calling thread's last error (cudaGetLastError) and returns the code.
cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}
cudaError_t fail(cudaError_t e, const char* call, const std::string& what) {
  report(call, what);
  t_report_code = e;
  return ret(e);
}

// The cudaMalloc block p points into (its canary zone excluded), or nullptr.
Alloc* block_of(const void* p, uintptr_t* base = nullptr) {
  auto& s = S();
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.upper_bound(a);
  if (it == s.allocs.begin()) return nullptr;
  --it;
  if (a >= it->first + std::max<size_t>(it->second.block, 1)) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

// The allocation whose extent holds [p, p + bytes) (bytes 0: p inside or at its end), or nullptr.
Alloc* lookup(const void* p, size_t bytes, uintptr_t* base = nullptr) {
  uintptr_t b = 0;
  Alloc* al = block_of(p, &b);
  if (!al) return nullptr;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a > b + al->extent || a + bytes > b + al->extent) return nullptr;
  if (base) *base = b;
  return al;
}

std::string where_text(const void* p, size_t bytes) {
  auto& s = S();
  const auto a = reinterpret_cast<uintptr_t>(p);
  uintptr_t b = 0;
  if (Alloc* al = block_of(p, &b)) {
    if (al->extent == 0)
      return ptr_text(p) + " is in a device block the caching allocator holds free (a use after free: the tensor " +
             "was released)";
    if (al->extent < al->bytes)
      return "runs past its tensor (" + ptr_text(p) + " + " + std::to_string(bytes) + " bytes; the tensor at " +
             ptr_text(reinterpret_cast<void*>(b)) + " has " + std::to_string(al->extent) + " bytes, " +
             std::to_string(a <= b + al->extent ? b + al->extent - a : 0) +
             " from this pointer, in a cached block of " + std::to_string(al->bytes) + ")";
    return "runs past its allocation (" + ptr_text(p) + " + " + std::to_string(bytes) + " bytes; the allocation " +
           ptr_text(reinterpret_cast<void*>(b)) + " has " + std::to_string(al->bytes) + " bytes, " +
           std::to_string(a <= b + al->extent ? b + al->extent - a : 0) + " from this pointer)";
  }
  if (s.pinned.count(const_cast<void*>(p))) return ptr_text(p) + " is pinned host memory (cudaMallocHost), not device memory";
  return ptr_text(p) + " (" + std::to_string(bytes) + " bytes) is not device memory (a host pointer, or freed)";
}

// A stream handle's id, or -1 (reported) for an unknown or destroyed stream.
int stream_id(cudaStream_t h, const char* call) {
  auto& s = S();
  if (h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread) return s.legacy[size_t(t_device)];
  auto it = s.stream_ids.find(h);
  if (it == s.stream_ids.end() || !s.streams[size_t(it->second)].alive) {
    fail(cudaErrorInvalidResourceHandle, call, "stream " + ptr_text(h) + " is not a live stream (destroyed, or never created)");
    return -1;
  }
  return it->second;
}

// The record of a live event; else a report naming the call (the caller returns cudaErrorInvalidResourceHandle)
// and nullptr.
EventRec* live_event(cudaEvent_t e, const char* call) {
  auto it = S().events.find(e);
  if (it == S().events.end()) {
    fail(cudaErrorInvalidResourceHandle, call, "event " + ptr_text(e) + " is not a live event");
    return nullptr;
  }
  return &it->second;
}

// A stream or event made by `call`: a new handle (a fake address, never reused) into *p, its record made by
// add(state, handle) under the lock; a null p is refused.
template <typename Handle, typename Add>
cudaError_t create_handle(Handle* p, const char* call, Add&& add) {
  if (!p) return fail(cudaErrorInvalidValue, call, "null result pointer");
  auto& s = S();
  std::lock_guard lock(s.mu);
  const auto h = reinterpret_cast<Handle>(s.next_handle);
  s.next_handle += 16;
  add(s, h);
  *p = h;
  return cudaSuccess;
}

std::string stream_text(int id);

// The ordering an enqueue on stream id inherits (the host's clock, the legacy stream's rules), then its step.
unsigned long long enqueue(int id) {
  auto& s = S();
  StreamRec& st = s.streams[size_t(id)];
  // Work on a stream outside a capture of its device runs now, not at the replays: legal on a device, but never
  // what a graph's maker meant (the graph would miss it): reported.
  if (!st.capture)
    for (auto& o : s.streams)
      if (o.capture && o.device == st.device && !o.capture->invalid) {
        report("enqueue", stream_text(id) + " runs work while " + stream_text(o.id) +
                              " of its device captures a graph: the work runs now and is not in the graph");
        break;
      }
  merge(st.vc, s.host);
  if (st.legacy) {
    for (auto& o : s.streams)
      if (o.alive && !o.legacy && o.blocking && o.device == st.device) merge(st.vc, o.vc);
  } else if (st.blocking) {
    merge(st.vc, s.streams[size_t(s.legacy[size_t(st.device)])].vc);
  }
  if (st.vc.size() <= size_t(id)) st.vc.resize(size_t(id) + 1, 0);
  return ++st.vc[size_t(id)];
}

std::string stream_text(int id) {
  const auto& st = S().streams[size_t(id)];
  return st.name.empty() ? "stream #" + std::to_string(id) : st.name;
}

// Records an access by stream id (after enqueue) and checks its ordering; false after a report.
bool access(Alloc& a, uintptr_t base, int id, bool write, unsigned long long tick, const char* call) {
  auto& s = S();
  const Clock& vc = s.streams[size_t(id)].vc;
  ++s.stats.accesses;
  bool cross = a.last_write.stream >= 0 && a.last_write.stream != id;
  if (write)
    for (const auto& [rs, r] : a.reads) cross = cross || rs != id;
  s.stats.cross_stream += cross;
  auto hazard = [&](const Access& prev, const char* kind) {
    fail(cudaErrorIllegalState, call,
         std::string(kind) + " hazard on the allocation " + ptr_text(reinterpret_cast<void*>(base)) + " (" +
             std::to_string(a.bytes) + " bytes): " + (write ? "written" : "read") + " on " + stream_text(id) +
             ", last " + (std::strcmp(kind, "write-after-read") == 0 ? "read" : "written") + " by " + prev.call +
             " on " + stream_text(prev.stream) + " with no ordering between them (missing cudaStreamWaitEvent on an "
             "event recorded after that access, or a synchronisation)");
    return false;
  };
  if (a.last_write.stream >= 0 && a.last_write.stream != id && at(vc, a.last_write.stream) < a.last_write.tick)
    return hazard(a.last_write, write ? "write-after-write" : "read-after-write");
  if (write)
    for (const auto& [rs, r] : a.reads)
      if (rs != id && at(vc, rs) < r.tick) return hazard(r, "write-after-read");
  if (write) {
    a.last_write = {id, tick, call};
    a.reads.clear();
  } else {
    a.reads[id] = {id, tick, call};
  }
  return true;
}

bool note(const void* p, size_t bytes, cudaStream_t stream, const char* call, bool write) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  uintptr_t base = 0;
  Alloc* a = lookup(p, bytes, &base);
  if (!a) {
    fail(cudaErrorIllegalAddress, call, where_text(p, bytes));
    return false;
  }
  const int id = stream_id(stream, call);
  if (id < 0) return false;
  return access(*a, base, id, write, enqueue(id), call);
}

void host_waits_for(const Clock& c) {
  ++S().stats.syncs;
  merge(S().host, c);
}
void host_waits_for_all(int device /* -1: every device */) {
  auto& s = S();
  ++s.stats.syncs;
  for (auto& st : s.streams)
    if (device < 0 || st.device == device) merge(s.host, st.vc);
}

// ---- stream capture (see the file's head)

struct GraphRec {
  std::vector<std::function<void()>> ops;
  int origin = 0;
};
struct ExecRec {
  std::shared_ptr<GraphRec> graph;
};
std::set<GraphRec*>& graphs() {
  static auto* g = new std::set<GraphRec*>;
  return *g;
}
std::map<ExecRec*, std::unique_ptr<ExecRec>>& execs() {
  static auto* e = new std::map<ExecRec*, std::unique_ptr<ExecRec>>;
  return *e;
}

// Records op on stream id's capture (a call on a forked stream leaves it unjoined); false when id is not capturing.
bool record_on(int id, std::function<void()> op) {
  auto& st = S().streams[size_t(id)];
  if (!st.capture) return false;
  st.capture->ops.push_back(std::move(op));
  if (id != st.capture->origin) st.capture->forked[id] = false;
  return true;
}

// A call a capture cannot hold, made while `cap` is active: the capture is invalidated and the call fails.
cudaError_t break_capture(Capture& cap, cudaError_t e, const char* call, const std::string& what) {
  if (!cap.invalid) cap.invalid = true, cap.why = std::string(call) + ": " + what;
  return fail(e, call, what + " (during a stream capture of " + stream_text(cap.origin) + ": the capture is invalidated)");
}

// The first active capture of a stream of `device` (-1: any), or null.
Capture* capture_on_device(int device) {
  for (auto& st : S().streams)
    if (st.capture && (device < 0 || st.device == device)) return st.capture.get();
  return nullptr;
}

bool in_pinned(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto& m = S().pinned_bytes;
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a + bytes <= it->first + it->second;
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}
// The texts the CUDA 12 runtime gives (cudaGetErrorString), so a message matched against a GPU's matches here too.
const char* error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}

}  // namespace

// ---------------------------------------------------------------- the registry (device_registry.h)

bool is_device_ptr(const void* p, size_t bytes) {
  std::lock_guard lock(S().mu);
  return lookup(p, bytes) != nullptr;
}

bool find_allocation(const void* p, const void** base, size_t* bytes) {
  std::lock_guard lock(S().mu);
  uintptr_t b = 0;
  Alloc* a = lookup(p, 0, &b);
  if (!a) return false;
  if (base) *base = reinterpret_cast<const void*>(b);
  if (bytes) *bytes = a->extent;
  return true;
}

bool check_device_range(const void* p, size_t bytes, const char* call, const char* what) {
  if (!p && bytes == 0) return true;
  std::lock_guard lock(S().mu);
  if (lookup(p, bytes)) return true;
  report(call, std::string(what) + " " + where_text(p, bytes));
  return false;
}

bool note_read(const void* p, size_t bytes, cudaStream_t stream, const char* call) {
  return note(p, bytes, stream, call, false);
}
bool note_write(const void* p, size_t bytes, cudaStream_t stream, const char* call) {
  return note(p, bytes, stream, call, true);
}

bool check_stream(cudaStream_t stream, const char* call) {
  std::lock_guard lock(S().mu);
  return stream_id(stream, call) >= 0;
}

int stream_device(cudaStream_t stream) {
  std::lock_guard lock(S().mu);
  auto it = S().stream_ids.find(stream);
  return it == S().stream_ids.end() ? t_device : S().streams[size_t(it->second)].device;
}

int current_device() { return t_device; }
int device_count() { return S().n_devices; }

void report(const char* call, const std::string& what) {
  auto& s = S();
  std::string line = std::string(call) + ": " + what;
  std::fprintf(stderr, "[cuda-emu] %s\n", line.c_str());
  std::fflush(stderr);
  t_last_report = std::move(line);
  t_report_code = cudaSuccess;
  {
    std::lock_guard lock(s.mu);
    ++s.reports;
  }
  if (s.abort_on_report) std::abort();
}

long long reports() {
  std::lock_guard lock(S().mu);
  return S().reports;
}

// ---------------------------------------------------------------- kernel launches (cuda_emulator_hooks.h)

bool launch_prologue(const char* kernel, const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     const KernelArg* args, int n) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const std::string call = std::string("launch of ") + kernel;
  // The call name must outlive the access records: kernel names are string literals, so keep one string each.
  static std::set<std::string> names;
  const char* cname = names.insert(call).first->c_str();
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64) {
    fail(cudaErrorInvalidConfiguration, cname,
         "block (" + std::to_string(block.x) + ", " + std::to_string(block.y) + ", " + std::to_string(block.z) +
             ") is empty or over 1024 threads");
    return false;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    fail(cudaErrorInvalidConfiguration, cname,
         "grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " + std::to_string(grid.z) +
             ") is empty or too large (an empty launch is an error on the device: skip it on the host)");
    return false;
  }
  if (smem > 48 * 1024) {
    auto it = s.max_dyn_smem.find(fn);
    if (it == s.max_dyn_smem.end() || size_t(it->second) < smem) {
      fail(cudaErrorInvalidValue, cname,
           std::to_string(smem) + " bytes of dynamic shared memory, over 48 KiB without (enough) "
           "cudaFuncAttributeMaxDynamicSharedMemorySize");
      return false;
    }
  }
  const int id = stream_id(stream, cname);
  if (id < 0) return false;
  // Every pointer argument must be null or inside a live allocation, before anything runs.
  std::vector<std::pair<Alloc*, uintptr_t>> found(size_t(n), {nullptr, 0});
  for (int i = 0; i < n; ++i) {
    if (!args[i].pointer || !args[i].p) continue;
    uintptr_t base = 0;
    Alloc* a = lookup(args[i].p, 0, &base);
    if (!a || reinterpret_cast<uintptr_t>(args[i].p) == base + a->extent) {
      fail(cudaErrorIllegalAddress, cname,
           "argument " + std::to_string(i) + " (" + (args[i].write ? "T*" : "const T*") + ") " +
               where_text(args[i].p, 1));
      return false;
    }
    found[size_t(i)] = {a, base};
  }
  ++s.stats.launches;
  const unsigned long long tick = enqueue(id);
  for (int i = 0; i < n; ++i)
    if (found[size_t(i)].first && !access(*found[size_t(i)].first, found[size_t(i)].second, id, args[i].write, tick, cname))
      return false;
  return true;
}

namespace {
// The first byte of [from, to) that is not the canary, or to.
uintptr_t canary_broken(uintptr_t from, uintptr_t to) {
  for (uintptr_t c = from; c < to; ++c)
    if (*reinterpret_cast<const unsigned char*>(c) != kCanary) return c;
  return to;
}
}  // namespace

bool launch_epilogue(const char* kernel, const KernelArg* args, int n) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  bool ok = true;
  for (int i = 0; i < n && ok; ++i) {
    if (!args[i].pointer || !args[i].write || !args[i].p) continue;
    uintptr_t b = 0;
    Alloc* a = block_of(args[i].p, &b);
    if (!a) continue;
    const uintptr_t end = b + a->block + kCanaryZone, bad = canary_broken(b + a->extent, end);
    if (bad == end) continue;
    fail(cudaErrorIllegalAddress, (std::string("launch of ") + kernel).c_str(),
         "argument " + std::to_string(i) + " (T*): the kernel wrote past the end of its buffer: byte " +
             std::to_string(bad - b - a->extent) + " after the " + std::to_string(a->extent) + " bytes at " +
             ptr_text(reinterpret_cast<void*>(b)) + " (the " +
             (a->extent < a->bytes ? "tensor's" : "allocation's") + " end) changed");
    std::memset(reinterpret_cast<void*>(b + a->extent), kCanary, end - b - a->extent);  // report once
    ok = false;
  }
  return ok;
}

void set_extent(void* block, size_t bytes) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  uintptr_t b = 0;
  Alloc* a = block_of(block, &b);
  if (!a || b != reinterpret_cast<uintptr_t>(block) || bytes > a->bytes) {
    report("set_extent", ptr_text(block) + " is not the start of a live device allocation of at least " +
                             std::to_string(bytes) + " bytes");
    return;
  }
  a->extent = bytes;
  auto* p = static_cast<unsigned char*>(block);
  std::memset(p, 0xff, bytes);  // fresh memory: NaN
  std::memset(p + bytes, kCanary, a->block + kCanaryZone - bytes);
}

bool record_if_capturing(cudaStream_t stream, std::function<void()> op) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const int id = stream_id(stream, "record_if_capturing");
  return id >= 0 && record_on(id, std::move(op));
}

namespace {
// The caching allocator's blocks (runtime/core/cuda_backend.h) get their tensors' extents: registered as the
// library loads, before anything can allocate.
[[maybe_unused]] const bool g_block_hook_set = (mt::detail::set_cuda_block_hook(&set_extent), true);
}  // namespace

}  // namespace emu

// ---------------------------------------------------------------- the runtime API

using emu::S;

extern "C" {

cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::t_last_error;
  emu::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::t_last_error; }

const char* cudaGetErrorName(cudaError_t e) { return emu::error_name(e); }

const char* cudaGetErrorString(cudaError_t e) {
  if (e != cudaSuccess && e == emu::t_report_code && !emu::t_last_report.empty()) {
    thread_local std::string text;
    text = std::string(emu::error_text(e)) + " [emulated CUDA device: " + emu::t_last_report + "]";
    return text.c_str();
  }
  return emu::error_text(e);
}

cudaError_t cudaGetDeviceCount(int* n) {
  if (!n) return emu::fail(cudaErrorInvalidValue, "cudaGetDeviceCount", "null count");
  *n = S().n_devices;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  if (!d) return emu::fail(cudaErrorInvalidValue, "cudaGetDevice", "null device");
  *d = emu::t_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= S().n_devices)
    return emu::fail(cudaErrorInvalidDevice, "cudaSetDevice",
                     "device " + std::to_string(d) + " of " + std::to_string(S().n_devices) + " emulated (MT_EMU_DEVICES)");
  emu::t_device = d;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int device) {
  if (device < 0 || device >= S().n_devices)
    return emu::fail(cudaErrorInvalidDevice, "cudaDeviceGetPCIBusId", "device " + std::to_string(device));
  if (!id || len < 13) return emu::fail(cudaErrorInvalidValue, "cudaDeviceGetPCIBusId", "buffer under 13 bytes");
  // Every process has emulated devices of its own (nothing is shared between processes): the domain is made from
  // the process id, so no two processes of a node report the same GPU (meshtrain's NCCL backend refuses ranks
  // sharing one), and a process's device d is always bus 0xe0 + d.
  std::snprintf(id, size_t(len), "%04x:%02x:00.0", unsigned(getpid()) & 0xffffu, 0xe0 + device);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device < 0 || device >= S().n_devices)
    return emu::fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties", "device " + std::to_string(device));
  if (!p) return emu::fail(cudaErrorInvalidValue, "cudaGetDeviceProperties", "null properties");
  // Only what meshtrain reads (the name); the rest zero.
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "emulated CUDA device %d", device);
  std::lock_guard lock(S().mu);
  p->totalGlobalMem = S().device_bytes;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  if (free_b) *free_b = s.device_bytes > s.live_bytes ? s.device_bytes - s.live_bytes : 0;
  if (total_b) *total_b = s.device_bytes;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  std::lock_guard lock(S().mu);
  if (emu::Capture* c = emu::capture_on_device(emu::t_device))
    return emu::break_capture(*c, cudaErrorStreamCaptureUnsupported, "cudaDeviceSynchronize", "the device synchronised");
  emu::host_waits_for_all(emu::t_device);
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value) {
  if (!fn) return emu::fail(cudaErrorInvalidDeviceFunction, "cudaFuncSetAttribute", "null kernel");
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > 227 * 1024)
      return emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute",
                       std::to_string(value) + " bytes of dynamic shared memory (an H100 SM has 227 KiB)");
    std::lock_guard lock(S().mu);
    S().max_dyn_smem[fn] = value;
  }
  return cudaSuccess;
}

// ---- memory

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (!p) return emu::fail(cudaErrorInvalidValue, "cudaMalloc", "null result pointer");
  auto& s = S();
  std::lock_guard lock(s.mu);
  if (emu::Capture* c = emu::capture_on_device(emu::t_device); c && c->mode != cudaStreamCaptureModeRelaxed)
    return emu::break_capture(*c, cudaErrorStreamCaptureUnsupported, "cudaMalloc",
                              "cudaMalloc outside cudaStreamCaptureModeRelaxed");
  if (bytes > s.device_bytes || s.live_bytes + bytes > s.device_bytes) {
    *p = nullptr;
    return emu::ret(cudaErrorMemoryAllocation);  // meshtrain retries after emptying its cache: no report
  }
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* m = std::aligned_alloc(256, rounded + emu::kCanaryZone);
  if (!m) {
    *p = nullptr;
    return emu::ret(cudaErrorMemoryAllocation);
  }
  std::memset(m, 0xff, bytes);  // NaN: a kernel that reads what nobody wrote shows
  std::memset(static_cast<unsigned char*>(m) + bytes, emu::kCanary, rounded + emu::kCanaryZone - bytes);
  emu::Alloc a;
  a.bytes = a.extent = bytes;
  a.block = rounded;
  a.device = emu::t_device;
  a.serial = s.next_serial++;
  ++s.stats.allocs;
  s.allocs.emplace(reinterpret_cast<uintptr_t>(m), std::move(a));
  s.live_bytes += bytes;
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto& s = S();
  std::lock_guard lock(s.mu);
  auto it = s.allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == s.allocs.end())
    return emu::fail(cudaErrorInvalidValue, "cudaFree",
                     emu::ptr_text(p) + " is not the start of a live device allocation (double free, or not from cudaMalloc)");
  emu::host_waits_for_all(-1);  // cudaFree synchronises the device
  s.live_bytes -= it->second.bytes;
  s.allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (!p) return emu::fail(cudaErrorInvalidValue, "cudaMallocHost", "null result pointer");
  void* m = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (!m) return emu::ret(cudaErrorMemoryAllocation);
  std::lock_guard lock(S().mu);
  S().pinned.insert(m);
  S().pinned_bytes[reinterpret_cast<uintptr_t>(m)] = bytes;
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard lock(S().mu);
  if (!S().pinned.erase(p))
    return emu::fail(cudaErrorInvalidValue, "cudaFreeHost", emu::ptr_text(p) + " is not from cudaMallocHost");
  S().pinned_bytes.erase(reinterpret_cast<uintptr_t>(p));
  emu::host_waits_for_all(-1);
  std::free(p);
  return cudaSuccess;
}

namespace {

const char* kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost: return "HostToHost";
    case cudaMemcpyHostToDevice: return "HostToDevice";
    case cudaMemcpyDeviceToHost: return "DeviceToHost";
    case cudaMemcpyDeviceToDevice: return "DeviceToDevice";
    default: return "Default";
  }
}

// A copy of `rows` rows of `width` bytes (pitches dpitch, spitch) on `stream` (sync: the synchronous cudaMemcpy on
// the legacy stream, which the host then waits for).
cudaError_t copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
                 cudaMemcpyKind kind, cudaStream_t stream, const char* call, bool sync) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  if (width == 0 || rows == 0) return cudaSuccess;
  if (!dst || !src) return emu::fail(cudaErrorInvalidValue, call, "null pointer");
  if (rows > 1 && (width > dpitch || width > spitch))
    return emu::fail(cudaErrorInvalidPitchValue, call,
                     "width " + std::to_string(width) + " is over a pitch (" + std::to_string(dpitch) + ", " +
                         std::to_string(spitch) + ")");
  if (rows > 1 && (dpitch > size_t(INT32_MAX) || spitch > size_t(INT32_MAX)))
    return emu::fail(cudaErrorInvalidPitchValue, call, "a pitch over the device's maximum of 2^31 - 1 bytes");
  const int id = emu::stream_id(stream, call);
  if (id < 0) return cudaErrorInvalidResourceHandle;
  const size_t dbytes = dpitch * (rows - 1) + width, sbytes = spitch * (rows - 1) + width;
  const bool dst_dev_any = emu::block_of(dst) != nullptr, src_dev_any = emu::block_of(src) != nullptr;
  bool dst_dev, src_dev;
  switch (kind) {
    case cudaMemcpyHostToDevice: dst_dev = true, src_dev = false; break;
    case cudaMemcpyDeviceToHost: dst_dev = false, src_dev = true; break;
    case cudaMemcpyDeviceToDevice: dst_dev = true, src_dev = true; break;
    case cudaMemcpyHostToHost: dst_dev = false, src_dev = false; break;
    case cudaMemcpyDefault: dst_dev = dst_dev_any, src_dev = src_dev_any; break;
    default: return emu::fail(cudaErrorInvalidMemcpyDirection, call, "unknown kind " + std::to_string(int(kind)));
  }
  const std::string k = std::string(kind_name(kind)) + " copy of " + std::to_string(width * rows) + " bytes: ";
  if (src_dev && !emu::lookup(src, sbytes))
    return emu::fail(cudaErrorInvalidValue, call, k + "source " + emu::where_text(src, sbytes));
  if (dst_dev && !emu::lookup(dst, dbytes))
    return emu::fail(cudaErrorInvalidValue, call, k + "destination " + emu::where_text(dst, dbytes));
  if (!src_dev && src_dev_any)
    return emu::fail(cudaErrorInvalidMemcpyDirection, call, k + "the source " + emu::ptr_text(src) + " is device memory");
  if (!dst_dev && dst_dev_any)
    return emu::fail(cudaErrorInvalidMemcpyDirection, call,
                     k + "the destination " + emu::ptr_text(dst) + " is device memory");
  if (emu::StreamRec& st = s.streams[size_t(id)]; st.capture) {
    if (sync) return emu::break_capture(*st.capture, cudaErrorStreamCaptureUnsupported, call, "a synchronous copy");
    if ((!src_dev && !emu::in_pinned(src, sbytes)) || (!dst_dev && !emu::in_pinned(dst, dbytes)))
      return emu::break_capture(*st.capture, cudaErrorStreamCaptureUnsupported, call,
                                k + "host memory that is not pinned (cudaMallocHost) cannot be captured");
    emu::record_on(id, [=] { copy(dst, dpitch, src, spitch, width, rows, kind, stream, call, false); });
    return cudaSuccess;
  }
  ++s.stats.copies;
  const unsigned long long tick = emu::enqueue(id);
  uintptr_t sbase = 0, dbase = 0;
  emu::Alloc* sa = src_dev ? emu::lookup(src, sbytes, &sbase) : nullptr;
  emu::Alloc* da = dst_dev ? emu::lookup(dst, dbytes, &dbase) : nullptr;
  if (sa && !emu::access(*sa, sbase, id, false, tick, call)) return cudaErrorIllegalState;
  if (da && !emu::access(*da, dbase, id, true, tick, call)) return cudaErrorIllegalState;
  for (size_t r = 0; r < rows; ++r)
    std::memmove(static_cast<unsigned char*>(dst) + r * dpitch, static_cast<const unsigned char*>(src) + r * spitch, width);
  if (sync) emu::host_waits_for(s.streams[size_t(id)].vc);
  return cudaSuccess;
}

}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return copy(dst, bytes, src, bytes, bytes, 1, kind, nullptr, "cudaMemcpy", true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return copy(dst, bytes, src, bytes, bytes, 1, kind, stream, "cudaMemcpyAsync", false);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  return copy(dst, dpitch, src, spitch, width, rows, kind, stream, "cudaMemcpy2DAsync", false);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  if (bytes == 0) return cudaSuccess;
  uintptr_t base = 0;
  emu::Alloc* a = emu::lookup(p, bytes, &base);
  if (!a) return emu::fail(cudaErrorInvalidValue, "cudaMemsetAsync", emu::where_text(p, bytes));
  const int id = emu::stream_id(stream, "cudaMemsetAsync");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  if (emu::record_on(id, [=] { cudaMemsetAsync(p, value, bytes, stream); })) return cudaSuccess;
  ++s.stats.copies;
  if (!emu::access(*a, base, id, true, emu::enqueue(id), "cudaMemsetAsync")) return cudaErrorIllegalState;
  std::memset(p, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  const cudaError_t e = cudaMemsetAsync(p, value, bytes, nullptr);
  if (e == cudaSuccess) {
    std::lock_guard lock(S().mu);
    emu::host_waits_for(S().streams[size_t(S().legacy[size_t(emu::t_device)])].vc);
  }
  return e;
}

// ---- streams

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* p, unsigned flags) {
  return emu::create_handle(p, "cudaStreamCreateWithFlags", [&](emu::State& s, cudaStream_t h) {
    emu::StreamRec r;
    r.id = int(s.streams.size());
    r.device = emu::t_device;
    r.blocking = (flags & cudaStreamNonBlocking) == 0;
    r.name = "stream #" + std::to_string(r.id) + " (cuda:" + std::to_string(r.device) +
             (r.blocking ? ", blocking)" : ", non-blocking)");
    s.stream_ids[h] = r.id;
    s.streams.push_back(std::move(r));
  });
}

cudaError_t cudaStreamCreate(cudaStream_t* p) { return cudaStreamCreateWithFlags(p, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  auto it = s.stream_ids.find(h);
  if (it == s.stream_ids.end() || !s.streams[size_t(it->second)].alive)
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy", "stream " + emu::ptr_text(h) + " is not a live stream");
  s.streams[size_t(it->second)].alive = false;  // its id stays: accesses recorded on it still name it
  s.stream_ids.erase(it);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  std::lock_guard lock(S().mu);
  const int id = emu::stream_id(h, "cudaStreamSynchronize");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  if (auto& c = S().streams[size_t(id)].capture)
    return emu::break_capture(*c, cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize", "the stream synchronised");
  emu::host_waits_for(S().streams[size_t(id)].vc);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t h) { return cudaStreamSynchronize(h); }  // everything enqueued is done

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t e, unsigned int /*flags*/) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const int id = emu::stream_id(h, "cudaStreamWaitEvent");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  emu::EventRec* ev = emu::live_event(e, "cudaStreamWaitEvent");
  if (!ev) return cudaErrorInvalidResourceHandle;
  emu::StreamRec& st = s.streams[size_t(id)];
  if (ev->captured && !st.capture) st.capture = ev->captured, st.capture->forked[id] = true;  // the fork
  if (const auto cap = st.capture) {
    // The origin waiting for an event recorded on a forked stream joins that stream's calls so far.
    if (ev->captured == cap && id == cap->origin && ev->captured_stream != id && cap->forked.count(ev->captured_stream))
      cap->forked[ev->captured_stream] = true;
    const bool joined = id == cap->origin || cap->forked[id];
    if (ev->captured == cap) {
      emu::record_on(id, [id, edge = ev->edge] {  // the edge: the stream waits for the replayed record
        std::lock_guard lock(S().mu);
        emu::enqueue(id);
        ++S().stats.waits;
        emu::merge(S().streams[size_t(id)].vc, *edge);
      });
    } else {
      emu::record_on(id, [=] { cudaStreamWaitEvent(h, e, 0); });  // an event recorded before the capture
    }
    if (id != cap->origin) cap->forked[id] = joined;  // a wait is no work to join back
    return cudaSuccess;
  }
  emu::enqueue(id);
  ++s.stats.waits;
  if (ev->recorded) emu::merge(s.streams[size_t(id)].vc, ev->vc);
  return cudaSuccess;
}

// ---- events

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* p, unsigned flags) {
  return emu::create_handle(p, "cudaEventCreateWithFlags", [&](emu::State& s, cudaEvent_t h) {
    emu::EventRec r;
    r.device = emu::t_device;
    r.timing = (flags & cudaEventDisableTiming) == 0;
    s.events.emplace(h, std::move(r));
  });
}

cudaError_t cudaEventCreate(cudaEvent_t* p) { return cudaEventCreateWithFlags(p, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard lock(S().mu);
  if (!emu::live_event(e, "cudaEventDestroy")) return cudaErrorInvalidResourceHandle;
  S().events.erase(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t h) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  emu::EventRec* ev = emu::live_event(e, "cudaEventRecord");
  if (!ev) return cudaErrorInvalidResourceHandle;
  const int id = emu::stream_id(h, "cudaEventRecord");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  if (s.streams[size_t(id)].device != ev->device)
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventRecord",
                     "the event was created on cuda:" + std::to_string(ev->device) + ", the stream is on cuda:" +
                         std::to_string(s.streams[size_t(id)].device));
  if (const auto cap = s.streams[size_t(id)].capture) {
    ev->captured = cap, ev->captured_stream = id;
    ev->edge = std::make_shared<emu::Clock>();
    const bool joined = id == cap->origin || cap->forked[id];
    emu::record_on(id, [id, edge = ev->edge] {
      std::lock_guard lock(S().mu);
      emu::enqueue(id);
      *edge = S().streams[size_t(id)].vc;
    });
    if (id != cap->origin) cap->forked[id] = joined;  // a record is no work to join back
    return cudaSuccess;
  }
  ev->captured = nullptr, ev->captured_stream = -1, ev->edge = nullptr;
  emu::enqueue(id);
  ev->vc = s.streams[size_t(id)].vc;
  ev->recorded = true;
  ev->not_ready = s.event_polls;
  ev->when = std::chrono::steady_clock::now();
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  emu::EventRec* ev = emu::live_event(e, "cudaEventQuery");
  if (!ev) return cudaErrorInvalidResourceHandle;
  if (ev->captured)
    return emu::break_capture(*ev->captured, cudaErrorCapturedEvent, "cudaEventQuery",
                              "the event was last recorded in a stream capture");
  // Work runs when enqueued, so every event is complete; MT_EMU_EVENT_POLLS makes the first queries say otherwise,
  // so that the callers' "not yet" paths run too (and, as on the device, "not ready" is the thread's last error
  // until read: a caller that does not clear it fails its next launch check).
  if (ev->recorded && ev->not_ready > 0) {
    --ev->not_ready;
    return emu::ret(cudaErrorNotReady);
  }
  emu::host_waits_for(ev->vc);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  std::lock_guard lock(S().mu);
  emu::EventRec* ev = emu::live_event(e, "cudaEventSynchronize");
  if (!ev) return cudaErrorInvalidResourceHandle;
  if (ev->captured)
    return emu::break_capture(*ev->captured, cudaErrorCapturedEvent, "cudaEventSynchronize",
                              "the event was last recorded in a stream capture");
  emu::host_waits_for(ev->vc);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  auto ia = s.events.find(a), ib = s.events.find(b);
  if (!ms) return emu::fail(cudaErrorInvalidValue, "cudaEventElapsedTime", "null result pointer");
  if (ia == s.events.end() || ib == s.events.end())
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime", "not a live event");
  if (!ia->second.timing || !ib->second.timing)
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime", "an event was created with cudaEventDisableTiming");
  if (!ia->second.recorded || !ib->second.recorded)
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime", "an event was never recorded");
  *ms = std::chrono::duration<float, std::milli>(ib->second.when - ia->second.when).count();
  return cudaSuccess;
}

// ---- stream capture and graphs

cudaError_t cudaStreamBeginCapture(cudaStream_t h, cudaStreamCaptureMode mode) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const int id = emu::stream_id(h, "cudaStreamBeginCapture");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  emu::StreamRec& st = s.streams[size_t(id)];
  if (st.legacy)
    return emu::fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture", "the legacy default stream cannot be captured");
  if (st.capture) return emu::fail(cudaErrorIllegalState, "cudaStreamBeginCapture", emu::stream_text(id) + " is already capturing");
  st.capture = std::make_shared<emu::Capture>();
  st.capture->origin = id;
  st.capture->mode = mode;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t h, cudaStreamCaptureStatus* status) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const int id = emu::stream_id(h, "cudaStreamIsCapturing");
  if (id < 0) return cudaErrorInvalidResourceHandle;
  if (!status) return emu::fail(cudaErrorInvalidValue, "cudaStreamIsCapturing", "null result pointer");
  const auto& c = s.streams[size_t(id)].capture;
  *status = !c ? cudaStreamCaptureStatusNone : c->invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t h, cudaGraph_t* graph) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  const char* call = "cudaStreamEndCapture";
  const int id = emu::stream_id(h, call);
  if (id < 0) return cudaErrorInvalidResourceHandle;
  if (!graph) return emu::fail(cudaErrorInvalidValue, call, "null result pointer");
  *graph = nullptr;
  std::shared_ptr<emu::Capture> cap = s.streams[size_t(id)].capture;
  if (!cap) return emu::fail(cudaErrorIllegalState, call, emu::stream_text(id) + " is not capturing");
  if (cap->origin != id)
    return emu::fail(cudaErrorStreamCaptureUnmatched, call, emu::stream_text(id) + " joined a capture it did not begin");
  for (auto& st : s.streams)
    if (st.capture == cap) st.capture = nullptr;
  for (auto& [e, ev] : s.events)
    if (ev.captured == cap) ev.captured = nullptr, ev.captured_stream = -1;
  if (cap->invalid) return emu::ret(cudaErrorStreamCaptureInvalidated);  // the invalidating call was reported
  for (const auto& [sid, joined] : cap->forked)
    if (!joined)
      return emu::fail(cudaErrorStreamCaptureUnjoined, call,
                       emu::stream_text(sid) + " forked from the capture and was never joined back into " +
                           emu::stream_text(id) + " (an event recorded on it after its last call, waited for there)");
  auto* g = new emu::GraphRec{std::move(cap->ops), id};
  emu::graphs().insert(g);
  *graph = reinterpret_cast<cudaGraph_t>(g);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long /*flags*/) {
  auto& s = S();
  std::lock_guard lock(s.mu);
  auto* g = reinterpret_cast<emu::GraphRec*>(graph);
  if (!exec) return emu::fail(cudaErrorInvalidValue, "cudaGraphInstantiate", "null result pointer");
  if (!emu::graphs().count(g)) return emu::fail(cudaErrorInvalidValue, "cudaGraphInstantiate", "not a live graph");
  auto x = std::make_unique<emu::ExecRec>();
  x->graph = std::make_shared<emu::GraphRec>(*g);  // an executable graph is a copy: the graph may be destroyed
  auto* raw = x.get();
  emu::execs().emplace(raw, std::move(x));
  *exec = reinterpret_cast<cudaGraphExec_t>(raw);
  return cudaSuccess;
}

// Runs the recorded calls in their order, after the work enqueued on `h` before it and before the work after it;
// the first error any of them set is the launch's.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t h) {
  auto& s = S();
  std::shared_ptr<emu::GraphRec> g;
  int id = -1;
  {
    std::lock_guard lock(s.mu);
    auto it = emu::execs().find(reinterpret_cast<emu::ExecRec*>(exec));
    if (it == emu::execs().end()) return emu::fail(cudaErrorInvalidValue, "cudaGraphLaunch", "not a live executable graph");
    g = it->second->graph;
    id = emu::stream_id(h, "cudaGraphLaunch");
    if (id < 0) return cudaErrorInvalidResourceHandle;
    if (s.streams[size_t(id)].capture)
      return emu::fail(cudaErrorStreamCaptureUnsupported, "cudaGraphLaunch", "launching a graph into a capture is not emulated");
    if (!s.streams[size_t(g->origin)].alive)
      return emu::fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch", "the stream the graph was captured on is destroyed");
    emu::enqueue(id);
    emu::merge(s.streams[size_t(g->origin)].vc, s.streams[size_t(id)].vc);
  }
  const cudaError_t before = emu::t_last_error;
  emu::t_last_error = cudaSuccess;
  for (auto& op : g->ops) op();  // without the lock: NCCL's calls wait for the other ranks
  const cudaError_t err = emu::t_last_error;
  emu::t_last_error = err != cudaSuccess ? err : before;
  std::lock_guard lock(s.mu);
  emu::merge(s.streams[size_t(id)].vc, s.streams[size_t(g->origin)].vc);
  return err;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard lock(S().mu);
  if (!emu::execs().erase(reinterpret_cast<emu::ExecRec*>(exec)))
    return emu::fail(cudaErrorInvalidValue, "cudaGraphExecDestroy", "not a live executable graph");
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard lock(S().mu);
  auto* g = reinterpret_cast<emu::GraphRec*>(graph);
  if (!emu::graphs().erase(g)) return emu::fail(cudaErrorInvalidValue, "cudaGraphDestroy", "not a live graph");
  delete g;
  return cudaSuccess;
}

}  // extern "C"
