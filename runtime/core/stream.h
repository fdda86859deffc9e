// CUDA streams and events as move-only RAII handles. The handles are opaque
// (void*) so that code compiled without CUDA can still name them; every
// function throws "[cuda] ..." in a build without the CUDA backend.
#pragma once
#include "runtime/core/device.h"

namespace mt {

class Stream {
 public:
  Stream() = default;  // the null handle: the device's legacy default stream
  static Stream create(int device, bool non_blocking = true);
  ~Stream();
  Stream(Stream&& o) noexcept : handle_(o.handle_), device_(o.device_), owned_(o.owned_) { o.owned_ = false; }
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void* handle() const { return handle_; }  // cudaStream_t
  int device() const { return device_; }
  void synchronize() const;
  // A non-owning alias of this stream.
  Stream borrow() const {
    Stream s;
    s.handle_ = handle_;
    s.device_ = device_;
    return s;
  }

 private:
  void* handle_ = nullptr;
  int device_ = 0;
  bool owned_ = false;
};

class Event {
 public:
  Event() = default;
  static Event create(bool timing = false);
  ~Event();
  Event(Event&& o) noexcept : handle_(o.handle_) { o.handle_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void* handle() const { return handle_; }  // cudaEvent_t
  void record(const Stream& s);
  void wait_on(const Stream& s) const;  // s waits for this event (no host block)
  bool query() const;                   // true when complete
  void synchronize() const;
  float elapsed_ms(const Event& end) const;

 private:
  void* handle_ = nullptr;
};

// A CUDA graph (training.cuda_graph, runtime/train/cuda_graph.h): the device work this thread enqueues on a device's
// current stream between begin_capture and end_capture, recorded instead of run (kernels, copies, NCCL calls, with
// the values their arguments had), and replayed by replay() on the current stream. Every tensor the recorded work
// touches must stay where it was: the caching allocator keeps the blocks a capture used for the device's graphs
// (cuda_backend.h), and tensors made before the capture must outlive the graph. A host synchronisation inside a
// capture is an error (forbid_host_sync).
class CudaGraph {
 public:
  CudaGraph() = default;
  static void begin_capture(int device);
  // The capture's graph; throws "[cuda] ..." naming what broke the capture when it failed (nothing of it ran).
  static CudaGraph end_capture(int device);
  static bool capturing(int device);
  ~CudaGraph();
  CudaGraph(CudaGraph&& o) noexcept : exec_(o.exec_), device_(o.device_) { o.exec_ = nullptr; }
  CudaGraph& operator=(CudaGraph&& o) noexcept;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  bool defined() const { return exec_ != nullptr; }
  void replay() const;

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
  int device_ = 0;
};

// The stream device work of this thread is issued on (per device); by default
// a stream created on first use, so nothing runs on the legacy default stream.
const Stream& current_stream(int device);
void set_current_stream(int device, Stream s);  // takes a borrowed or owned stream
void set_device(int device);
void device_synchronize();

// Host synchronisations: every place where the host waits for the device (stream, event and device
// synchronize, so every copy from a device into host memory) adds one. On the CPU backend the same code
// points add one (a host read of a tensor's values: to_f64, sum, sum_squares, sum_squares_each), so a CPU
// run counts what a GPU run would. The trainer logs the count per step at debug level.
void note_host_sync();
int64_t host_sync_count();  // since the process started; thread-safe
// While set on this thread (a CUDA graph capture: runtime/train/cuda_graph.h), note_host_sync throws an error
// naming `why` before the host waits: a capture records device work and cannot hold a host wait. nullptr: allowed.
void forbid_host_sync(const char* why);

}  // namespace mt
