// Opt-in per-op timing of the work a run issues: MT_PROFILE_KERNELS=1 in the environment
// times every op launch with a pair of CUDA events on the op's stream (host clock for CPU ops, which run
// synchronously), aggregated per op name; `meshtrain train` reads the events after each step (one device
// synchronisation per step, outside the step's own host-sync count) and prints the top ops at the end with
// achieved TFLOP/s, GB/s and an estimate of what bounds each; MT_PROFILE_STEPS=N profiles only the last N steps
// (the others run muted, as without profiling). Off (the default) a Scope is one test of a global bool: nothing
// is recorded, no event exists.
//
// What is covered: every op of runtime/kernels/ops.h (dispatch() and the ops outside it: GEMMs, norms, RoPE,
// SwiGLU, embedding, loss, element-wise, conversions, reductions, AdamW, copies, pack/unpack), local
// attention (the flash kernel and the reference kernels, runtime/kernels/cpu/attention.cpp), device copies and
// fills (runtime/core/tensor.cpp), and NCCL collectives (on the group's stream, comm/nccl). The MPI backend's
// host collectives are not timed. Nested scopes (an op built from other ops, bf16 on the CPU through widened
// copies) count once, in the outermost scope.
//
// NVTX: nvtx_push / nvtx_pop (NvtxRange) name ranges for Nsight Systems at no cost without a tool attached;
// no-ops in a build without CUDA. The CUDA launchers open one per op (runtime/kernels/cuda).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/trace.h"

namespace mt {

class Stream;
class Tensor;

#if MT_CUDA
void nvtx_push(const char* name);
void nvtx_pop();
#else
inline void nvtx_push(const char*) {}
inline void nvtx_pop() {}
#endif
struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtx_push(name); }
  ~NvtxRange() { nvtx_pop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

namespace kprof {

// MT_PROFILE_KERNELS=1 (or any value but 0 or empty) in the environment when the process started.
extern const bool g_enabled;
inline bool enabled() { return g_enabled; }

// Bytes of the defined tensors among ts: the traffic of an op that reads or writes each operand once (the
// least it must move; what the "GB/s" and the arithmetic intensity of the report count).
double bytes_of(std::initializer_list<const Tensor*> ts);
double bytes_of_all(const std::vector<Tensor>& ts);

// Times the work this thread issues while it lives: on a CUDA device with two events recorded on `stream`
// (the device's current stream when null), on the CPU with the host clock. name (and category, e.g. "nccl")
// must outlive the run (string literals). flops and bytes: what the op computes and moves (0: not known).
class Scope {
 public:
  Scope(const char* name, Device d, double flops = 0, double bytes = 0, const Stream* stream = nullptr,
        const char* category = nullptr) {
    if (g_enabled) begin(name, category, d, flops, bytes, stream);
    if (trace::g_on) trace_begin(name, category, d, stream);
  }
  ~Scope() {
    if (state_ != 0) end();
    if (trace_state_ != 0) trace_end();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void begin(const char* name, const char* category, Device d, double flops, double bytes, const Stream* stream);
  void end();
  // The trace's op span (trace.h): the outermost scope of a thread, on the host clock; on a CUDA
  // device also the op's run on its stream, from a pair of events (trace_device_flush).
  void trace_begin(const char* name, const char* category, Device d, const Stream* stream);
  void trace_end();
  int state_ = 0;     // 0 off, 1 nested in another scope (not timed), 2 timing
  int64_t slot_ = 0;  // the pending device record, or the host start time (ns)
  int trace_state_ = 0;  // 0 off, 1 nested, 2 a span
  int64_t trace_t0_ = 0;
  int64_t trace_slot_ = -1;  // the op's pending device events in the trace, or -1
  const char* trace_name_ = nullptr;
};

// While a Mute lives, this thread's ops are not timed (evaluation and samples between training steps).
class Mute {
 public:
  Mute();
  ~Mute();
  Mute(const Mute&) = delete;
  Mute& operator=(const Mute&) = delete;
};

// Reads the timings of the work recorded since the last call and adds them to the per-op totals: waits for
// the devices when any op ran on one (call between steps, never inside one). Returns the milliseconds added.
double flush();
// Drops the totals (after a warm-up step); pending records are flushed and dropped too.
void reset();
// The device spans of a traced step: waits for the device, then writes each op's run on its stream into the trace
// (lanes "GPU kernels" and "GPU collectives"), placed on the host clock by a reference event recorded on an idle
// stream at the step's first device op. Call at a traced step's end; a no-op without device ops. Tracing on a GPU
// thus adds two device synchronisations to a traced step (none when tracing is off).
void trace_device_flush();

struct OpStat {
  std::string name;
  int64_t calls = 0;
  double ms = 0;     // total
  double flops = 0;  // total, 0 when the op does not say
  double bytes = 0;  // total
  bool device = false;
  bool comm = false;  // a collective (category "nccl")
};
// Every op seen so far, by total time, longest first.
std::vector<OpStat> stats();

// The top `top` ops as a table: op, calls, total ms, share of all timed ops, ms per call, TFLOP/s, GB/s,
// FLOP per byte and what bounds it, estimated by comparing the arithmetic intensity with peak_flops /
// peak_bytes_per_s (the ridge point; 0 for either: not estimated). `steps` divides the totals per step.
std::string report(int top, int64_t steps, double peak_flops, double peak_bytes_per_s, const std::string& what);

}  // namespace kprof
}  // namespace mt
