// NCCL backend of Group. Every collective runs on the group's own
// non-blocking stream: an event recorded on the compute stream (the current
// stream of this rank's device) orders it after the work that produced its
// inputs, and a done-event recorded after it lets the compute stream (blocking
// form, or Work::wait of the async form) wait for it without blocking the
// host. The watchdog polls the done-event, so a collective a peer never joins
// aborts the job instead of hanging it (ncclCommAbort first, then MPI_Abort).
#include "comm/nccl/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>

#include "comm/mpi/mpi_group.h"
#include "comm/nccl/nccl_table.h"
#include "comm/watchdog.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/stream.h"
#include "runtime/core/cuda_guard.h"

namespace mt {

void fail_nccl(int code, void* comm, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(static_cast<ncclComm_t>(comm));
  throw Error(fmt::format("[nccl] {} failed: {}; {} at {}", call, ncclGetErrorString(static_cast<ncclResult_t>(code)),
                          last && *last ? last : "(no further detail)", where(file, line)));
}

bool nccl_built() { return true; }

namespace {

// A CUDA event shared by a Work and the watchdog's completion check; recorded: the collective was issued and the
// event recorded after it (until then the operation is not done, whatever an unrecorded event's query says).
struct DoneEvent {
  cudaEvent_t e = nullptr;
  std::atomic<bool> recorded{false};
  DoneEvent() { MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~DoneEvent() {
    if (e) (void)cudaEventDestroy(e);
  }
  DoneEvent(const DoneEvent&) = delete;
  DoneEvent& operator=(const DoneEvent&) = delete;
};

cudaStream_t compute_stream(int device) { return static_cast<cudaStream_t>(current_stream(device).handle()); }

// Whether the collective behind `done` has finished, asked from the watchdog's thread. A new thread's current
// device is 0: its first CUDA call (the query, or the event's destruction when the watchdog drops the last
// reference) would create a primary context on GPU 0 for every rank of a node (about 0.5 GiB each there, and
// an error on GPUs in exclusive-process mode). So the thread first makes the collective's device current.
bool done_on_device(const DoneEvent& done, int device) {
  thread_local int current = -1;
  if (current != device) {
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
    current = device;
  }
  return cudaEventQuery(done.e) == cudaSuccess;
}

struct NcclWork : Work::Impl {
  std::shared_ptr<DoneEvent> done;
  int device = 0;
  std::vector<Tensor> keep;  // buffers stay alive at least until the compute stream is ordered after them
  bool waited = false;

  ~NcclWork() override {
    // Dropped without wait(): still order the compute stream after the
    // collective, so that the buffers released below are not reused by work
    // that could run before it finishes.
    if (!waited && done) (void)cudaStreamWaitEvent(compute_stream_noexcept(), done->e, 0);
  }
  cudaStream_t compute_stream_noexcept() {
    try {
      return compute_stream(device);
    } catch (...) {
      return nullptr;
    }
  }
  void wait() override {
    if (waited) return;
    MT_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(device), done->e, 0));
    waited = true;
    keep.clear();
  }
  bool test() override {
    cudaError_t rc = cudaEventQuery(done->e);
    if (rc == cudaSuccess) return true;
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();  // an answer, not an error a later launch check should read
      return false;
    }
    fail_cuda(rc, "cudaEventQuery", __FILE__, __LINE__);
  }
};

// The communicator, shared with the watchdog's abort hook (which may outlive the group).
struct CommState {
  std::mutex mu;
  ncclComm_t comm = nullptr;
  bool aborted = false;
};

class NcclGroup final : public Group, public HasMpiComm {
 public:
  NcclGroup(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device, int rank)
      : Group(std::move(name), rank, std::move(world_ranks)), mpi_(comm), device_(device) {}

  void init() {
    int n = cuda_device_count();
    MT_CHECK(device_ >= 0 && device_ < n, "nccl", "cannot make {}: device cuda:{} does not exist ({} visible)",
             describe(), device_, n);
    MT_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id{};
    {
      WatchdogScope w("nccl bootstrap", describe());
      if (rank() == 0) MT_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
      MT_MPI_CHECK(MPI_Bcast(&id, int(sizeof id), MPI_BYTE, 0, mpi_));
    }
    state_ = std::make_shared<CommState>();
    {
      WatchdogScope w("ncclCommInitRank", describe());
      MT_NCCL_CHECK(ncclCommInitRank(&state_->comm, size(), id, rank()), nullptr);
    }
    comm_ = state_->comm;
    watchdog_add_abort_hook([s = state_] {
      std::lock_guard lock(s->mu);
      if (s->comm && !s->aborted) {
        (void)ncclCommAbort(s->comm);
        s->aborted = true;
      }
    });
    stream_ = Stream::create(device_, true);
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  }

  ~NcclGroup() override {
    if (ready_) (void)cudaEventDestroy(ready_);
    if (state_) {
      std::lock_guard lock(state_->mu);
      if (state_->comm) {
        if (state_->aborted) {
          // ncclCommAbort already released it.
        } else {
          (void)ncclCommDestroy(state_->comm);
        }
        state_->comm = nullptr;
      }
    }
    if (mpi_ != MPI_COMM_NULL && mpi_ != MPI_COMM_WORLD && mpi_ != MPI_COMM_SELF) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(&mpi_);
    }
  }

  MPI_Comm mpi_comm() const override { return mpi_; }
  std::string_view backend() const override { return "nccl"; }

  using Group::do_all_reduce;  // the out-of-place form: copy, then the in-place call below
  Work do_all_reduce(const Tensor& t, ReduceOp op, bool async) override {
    check_dev("all_reduce", t);
    auto ty = reduce_type("all_reduce", t.dtype());
    size_t n = size_t(t.numel());
    if (n == 0) return {};
    return run("all_reduce", {t}, async, [&](cudaStream_t s) {
      MT_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), n, ty, nccl_op(op), comm_, s), comm_);
    });
  }

  Work do_all_gather(const Tensor& out, const Tensor& in, bool async) override {
    check_dev("all_gather", in);
    auto [ty, mult] = move_type(in.dtype());
    size_t n = size_t(in.numel()) * mult;
    if (n == 0) return {};
    return run("all_gather", {out, in}, async, [&](cudaStream_t s) {
      MT_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), n, ty, comm_, s), comm_);
    });
  }

  Work do_all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, bool async) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    check_dev("all_gather_v", in);
    if (total == 0) return {};
    auto [ty, mult] = move_type(in.dtype());
    size_t es = dtype_size(in.dtype());
    return run("all_gather_v", {out, in}, async, [&](cudaStream_t s) {
      char* o = static_cast<char*>(out.data_ptr());
      MT_NCCL_CHECK(ncclGroupStart(), comm_);
      int64_t off = 0;
      for (int r = 0; r < size(); ++r) {
        int64_t c = counts[size_t(r)];
        if (c > 0) {
          const void* send = r == rank() ? in.data_ptr() : nullptr;
          MT_NCCL_CHECK(ncclBroadcast(send, o + size_t(off) * es, size_t(c) * mult, ty, r, comm_, s), comm_);
        }
        off += c;
      }
      MT_NCCL_CHECK(ncclGroupEnd(), comm_);
    });
  }

  Work do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async) override {
    check_dev("reduce_scatter", in);
    auto ty = reduce_type("reduce_scatter", in.dtype());
    size_t n = size_t(out.numel());
    if (n == 0) return {};
    return run("reduce_scatter", {out, in}, async, [&](cudaStream_t s) {
      MT_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), n, ty, nccl_op(op), comm_, s), comm_);
    });
  }

  Work do_reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                        bool async) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    check_dev("reduce_scatter_v", in);
    auto ty = reduce_type("reduce_scatter_v", in.dtype());
    if (total == 0) return {};
    size_t es = dtype_size(in.dtype());
    return run("reduce_scatter_v", {out, in}, async, [&](cudaStream_t s) {
      const char* i = static_cast<const char*>(in.data_ptr());
      MT_NCCL_CHECK(ncclGroupStart(), comm_);
      int64_t off = 0;
      for (int r = 0; r < size(); ++r) {
        int64_t c = counts[size_t(r)];
        if (c > 0) {
          void* recv = r == rank() ? out.data_ptr() : nullptr;
          MT_NCCL_CHECK(ncclReduce(i + size_t(off) * es, recv, size_t(c), ty, nccl_op(op), r, comm_, s), comm_);
        }
        off += c;
      }
      MT_NCCL_CHECK(ncclGroupEnd(), comm_);
    });
  }

  Work do_all_to_all(const Tensor& out, const Tensor& in, bool async) override {
    std::vector<int64_t> c(size_t(size()), in.numel() / size());
    return exchange("all_to_all", out, in, c, c, async);
  }

  Work do_all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                       const std::vector<int64_t>& recv_counts, bool async) override {
    return exchange("all_to_all_v", out, in, send_counts, recv_counts, async);
  }

  Work do_broadcast(const Tensor& t, int root, bool async) override {
    check_dev("broadcast", t);
    auto [ty, mult] = move_type(t.dtype());
    size_t n = size_t(t.numel()) * mult;
    if (n == 0) return {};
    return run("broadcast", {t}, async, [&](cudaStream_t s) {
      MT_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), n, ty, root, comm_, s), comm_);
    });
  }

  // NCCL has no tags: messages between two ranks match in issue order (the pipeline's schedules issue them so).
  Work do_send(const Tensor& t, int peer, bool async, int /*tag*/, const std::string& what) override {
    return point_to_point(what.empty() ? std::string("send") : "send (" + what + ")", t, peer, true, async);
  }
  Work do_recv(const Tensor& t, int peer, bool async, int /*tag*/, const std::string& what) override {
    return point_to_point(what.empty() ? std::string("recv") : "recv (" + what + ")", t, peer, false, async);
  }

  Work do_ring_shift(const Tensor& out, const Tensor& in, int shift, bool async) override {
    int n = size();
    int to = ((rank() + shift) % n + n) % n, from = ((rank() - shift) % n + n) % n;
    std::vector<int64_t> sc(size_t(n), 0), rc(size_t(n), 0);
    sc[size_t(to)] = in.numel();
    rc[size_t(from)] = in.numel();
    return exchange("ring_shift", out, in, sc, rc, async);
  }

  void do_barrier() override {
    if (!barrier_buf_.defined()) barrier_buf_ = zeros({1}, DType::i32, Device::cuda(device_));
    run("barrier", {}, false, [&](cudaStream_t s) {
      MT_NCCL_CHECK(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1, ncclInt32, ncclSum, comm_, s),
                    comm_);
    });
    DeviceGuard g(device_);
    note_host_sync();
    MT_CUDA_CHECK(cudaStreamSynchronize(nstream()));
  }

 private:
  cudaStream_t nstream() const { return static_cast<cudaStream_t>(stream_.handle()); }

  void check_dev(const char* op, const Tensor& t) const {
    MT_CHECK(t.device() == Device::cuda(device_), "nccl",
             "{} on group '{}': tensor is on {}, NCCL needs cuda:{} buffers (use the mpi backend for host tensors)", op,
             name(), t.device().str(), device_);
  }

  static ncclRedOp_t nccl_op(ReduceOp op) {
    switch (op) {
      case ReduceOp::sum:
        return ncclSum;
      case ReduceOp::avg:
        return ncclAvg;
      case ReduceOp::max:
        return ncclMax;
      case ReduceOp::min:
        return ncclMin;
    }
    return ncclSum;
  }

  // The NCCL type of a reduction's elements.
  ncclDataType_t reduce_type(const char* op, DType d) const {
    switch (d) {
      case DType::f32:
        return ncclFloat32;
      case DType::bf16:
        return ncclBfloat16;
      case DType::f64:
        return ncclFloat64;
      case DType::i32:
        return ncclInt32;
      case DType::i64:
        return ncclInt64;
      case DType::u16:
      case DType::u8:
        break;
    }
    fail("nccl", "{} on group '{}': {} tensors cannot be reduced (raw integers, no reduction meshtrain uses)", op,
         name(), dtype_name(d));
  }

  // The NCCL type that moves d's elements, and the element count multiplier.
  static std::pair<ncclDataType_t, size_t> move_type(DType d) {
    switch (d) {
      case DType::f32:
        return {ncclFloat32, 1};
      case DType::bf16:
        return {ncclBfloat16, 1};
      case DType::f64:
        return {ncclFloat64, 1};
      case DType::i32:
        return {ncclInt32, 1};
      case DType::i64:
        return {ncclInt64, 1};
      case DType::u16:
        return {ncclUint8, 2};
      case DType::u8:
        return {ncclUint8, 1};
    }
    return {ncclUint8, dtype_size(d)};
  }

  // Orders the NCCL stream after the compute stream, registers the work with
  // the watchdog, issues it, records the done-event, and (blocking form) makes
  // the compute stream wait for it.
  template <typename F> Work run(const char* op, std::vector<Tensor> keep, bool async, F&& issue) {
    DeviceGuard g(device_);
    cudaStream_t cs = compute_stream(device_);
    cudaStream_t ns = nstream();
    MT_CUDA_CHECK(cudaEventRecord(ready_, cs));
    MT_CUDA_CHECK(cudaStreamWaitEvent(ns, ready_, 0));
    // Watched from before the issue: the host may block in it (NCCL connects a communicator to its peers at its
    // first operation; the emulated device's stand-in runs the collective at once over MPI), and a peer that never
    // joins must end the job there too, not hang it.
    auto done = std::make_shared<DoneEvent>();
    // In a CUDA graph capture (training.cuda_graph) the collective is recorded, not issued: its event cannot be
    // polled (a captured event), and the replay is watched as a whole by the step (runtime/train/cuda_graph.cpp).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(cs, &capture));
    const uint64_t id =
        capture != cudaStreamCaptureStatusNone
            ? 0
            : watchdog_begin(op, *this, [done, dev = device_] { return done->recorded && done_on_device(*done, dev); });
    try {
      {
        // Nsight's range, and with MT_PROFILE_KERNELS=1 the collective's time on the group's stream, counting the
        // bytes of its buffers.
        NvtxRange range(op);
        kprof::Scope prof(op, Device::cuda(device_), 0, kprof::enabled() ? kprof::bytes_of_all(keep) : 0, &stream_,
                          "nccl");
        issue(ns);
      }
      MT_CUDA_CHECK(cudaEventRecord(done->e, ns));
    } catch (...) {
      if (id) watchdog_end(id);  // never issued: nothing to wait for
      throw;
    }
    done->recorded = true;
    if (!async) {
      MT_CUDA_CHECK(cudaStreamWaitEvent(cs, done->e, 0));
      return {};
    }
    auto w = std::make_shared<NcclWork>();
    w->done = std::move(done);
    w->device = device_;
    w->keep = std::move(keep);
    return Work(w);
  }

  // Point-to-point exchange: send_counts[j] consecutive elements of in to rank
  // j, recv_counts[j] consecutive elements of out from rank j. The part a rank
  // keeps for itself is a device copy.
  Work exchange(const char* op, const Tensor& out, const Tensor& in, const std::vector<int64_t>& sc,
                const std::vector<int64_t>& rc, bool async) {
    check_dev(op, in);
    MT_CHECK(sc[size_t(rank())] == rc[size_t(rank())], "comm",
             "{} on {}: rank {} sends {} elements to itself but expects {}", op, describe(), rank(), sc[size_t(rank())],
             rc[size_t(rank())]);
    int64_t st = 0, rt = 0;
    for (int64_t c : sc) st += c;
    for (int64_t c : rc) rt += c;
    if (st == 0 && rt == 0) return {};
    auto [ty, mult] = move_type(in.dtype());
    size_t es = dtype_size(in.dtype());
    return run(op, {out, in}, async, [&](cudaStream_t s) {
      const char* i = static_cast<const char*>(in.data_ptr());
      char* o = static_cast<char*>(out.data_ptr());
      std::vector<int64_t> sd(sc.size(), 0), rd(rc.size(), 0);
      for (size_t j = 1; j < sc.size(); ++j) {
        sd[j] = sd[j - 1] + sc[j - 1];
        rd[j] = rd[j - 1] + rc[j - 1];
      }
      int me = rank();
      if (sc[size_t(me)] > 0)
        MT_CUDA_CHECK(cudaMemcpyAsync(o + size_t(rd[size_t(me)]) * es, i + size_t(sd[size_t(me)]) * es,
                                      size_t(sc[size_t(me)]) * es, cudaMemcpyDeviceToDevice, s));
      bool any = false;
      for (int j = 0; j < size(); ++j)
        if (j != me && (sc[size_t(j)] > 0 || rc[size_t(j)] > 0)) any = true;
      if (!any) return;
      MT_NCCL_CHECK(ncclGroupStart(), comm_);
      for (int j = 0; j < size(); ++j) {
        if (j == me) continue;
        if (sc[size_t(j)] > 0)
          MT_NCCL_CHECK(ncclSend(i + size_t(sd[size_t(j)]) * es, size_t(sc[size_t(j)]) * mult, ty, j, comm_, s), comm_);
        if (rc[size_t(j)] > 0)
          MT_NCCL_CHECK(ncclRecv(o + size_t(rd[size_t(j)]) * es, size_t(rc[size_t(j)]) * mult, ty, j, comm_, s), comm_);
      }
      MT_NCCL_CHECK(ncclGroupEnd(), comm_);
    });
  }

  void do_batch_begin() override {
    MT_CHECK(!batching_, "comm", "batch_begin on {}: a batch is already open", describe());
    DeviceGuard g(device_);
    // The batch's operations start after the compute stream's work so far, as every collective's do.
    MT_CUDA_CHECK(cudaEventRecord(ready_, compute_stream(device_)));
    MT_CUDA_CHECK(cudaStreamWaitEvent(nstream(), ready_, 0));
    MT_NCCL_CHECK(ncclGroupStart(), comm_);
    batching_ = true;
  }

  void do_batch_end() override {
    MT_CHECK(batching_, "comm", "batch_end on {}: no batch is open", describe());
    batching_ = false;
    DeviceGuard g(device_);
    {
      WatchdogScope w("ncclGroupEnd of a point-to-point batch", *this);
      MT_NCCL_CHECK(ncclGroupEnd(), comm_);
    }
    for (auto& d : batch_done_) MT_CUDA_CHECK(cudaEventRecord(d->e, nstream()));  // after the batch's kernels
    batch_done_.clear();
  }

  Work point_to_point(const std::string& label, const Tensor& t, int peer, bool is_send, bool async) {
    const char* op = label.c_str();
    // The peer's range is checked by Group; NCCL alone cannot send to its own rank.
    MT_CHECK(peer != rank(), "comm", "{} on {}: bad peer {} (rank {} of {})", op, describe(), peer, rank(), size());
    check_dev(op, t);
    auto [ty, mult] = move_type(t.dtype());
    size_t n = size_t(t.numel()) * mult;
    if (n == 0) return {};
    if (batching_) {
      // Enqueued in the open group; its completion event is recorded at batch_end, after the group's kernels.
      MT_CHECK(async, "comm", "{} on {}: a blocking operation inside a point-to-point batch", op, describe());
      DeviceGuard g(device_);
      if (is_send) MT_NCCL_CHECK(ncclSend(t.data_ptr(), n, ty, peer, comm_, nstream()), comm_);
      else MT_NCCL_CHECK(ncclRecv(t.data_ptr(), n, ty, peer, comm_, nstream()), comm_);
      auto done = std::make_shared<DoneEvent>();
      batch_done_.push_back(done);
      auto w = std::make_shared<NcclWork>();
      w->done = std::move(done);
      w->device = device_;
      w->keep = {t};
      return Work(w);
    }
    Work w = run(op, {t}, async, [&](cudaStream_t s) {
      if (is_send) MT_NCCL_CHECK(ncclSend(t.data_ptr(), n, ty, peer, comm_, s), comm_);
      else MT_NCCL_CHECK(ncclRecv(t.data_ptr(), n, ty, peer, comm_, s), comm_);
    });
    if (async) return w;
    // Blocking: the host continues once the transfer is complete (a peer that
    // never arrives is caught by the watchdog entry made above).
    DeviceGuard g(device_);
    note_host_sync();
    MT_CUDA_CHECK(cudaStreamSynchronize(nstream()));
    return {};
  }

  MPI_Comm mpi_;
  int device_ = 0;
  std::shared_ptr<CommState> state_;
  ncclComm_t comm_ = nullptr;
  Stream stream_;
  cudaEvent_t ready_ = nullptr;  // re-recorded per collective (the wait captures its state at issue)
  Tensor barrier_buf_;
  bool batching_ = false;                               // inside batch_begin / batch_end
  std::vector<std::shared_ptr<DoneEvent>> batch_done_;  // recorded at batch_end
};

}  // namespace

std::unique_ptr<Group> make_nccl_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device) {
  int rank = 0, n = 0;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MT_MPI_CHECK(MPI_Comm_size(comm, &n));
  MT_CHECK(int(world_ranks.size()) == n, "nccl", "group '{}': {} world ranks given for a communicator of {}", name,
           world_ranks.size(), n);
  auto g = std::make_unique<NcclGroup>(comm, std::move(name), std::move(world_ranks), device, rank);
  g->init();
  return g;
}

}  // namespace mt

// comm's entry of libmeshtrain_cuda.so (nccl_table.h), beside what it points to.
extern "C" __attribute__((visibility("default"))) const mt::NcclBackend* mt_nccl_backend_v1() {
  static const mt::NcclBackend table = [] {
    mt::NcclBackend t;
    t.make_nccl_group = [](MPI_Comm comm, std::string name, std::vector<int> world_ranks, int device) -> mt::Group* {
      return mt::make_nccl_group(comm, std::move(name), std::move(world_ranks), device).release();
    };
    return t;
  }();
  return &table;
}
