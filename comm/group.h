// Group: one communicator over a set of ranks, the only way meshtrain's upper
// layers talk to other ranks. Buffers are contiguous tensors, counts are in
// elements, and every collective exists in a blocking and an async form
// (async = true returns a Work to wait on; the buffers must stay alive and
// untouched until then). Backends live in subfolders: mpi/ (host buffers;
// device buffers staged through pinned host memory) and nccl/ (device buffers
// on its own stream, ordered against the compute stream with events).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"
#include "runtime/core/trace.h"

namespace mt {

enum class ReduceOp { sum, avg, max, min };
std::string_view reduce_op_name(ReduceOp op);
ReduceOp reduce_op_from_name(std::string_view s);  // throws "[comm] ..."

// Completion handle of an async collective. A default Work is already done.
class Work {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;  // blocks the host (MPI) or orders the compute stream (NCCL)
    virtual bool test() = 0;  // non-blocking completion check
  };
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  void wait() {
    if (impl_) {
      if (group_) timed_wait();
      else impl_->wait();
    }
    impl_.reset();
  }
  bool test() { return !impl_ || impl_->test(); }
  // Group marks the async collectives it issues while trace::timing() is on: their waits count as wait time
  // (the slow-rank check) and, while tracing, as "wait" spans naming the collective.
  void watch(const class Group* group, const char* kind) { group_ = group, kind_ = kind; }

 private:
  void timed_wait();
  std::shared_ptr<Impl> impl_;
  const class Group* group_ = nullptr;
  const char* kind_ = nullptr;
};

class Group {
 public:
  virtual ~Group() = default;

  int rank() const { return rank_; }
  int size() const { return int(world_ranks_.size()); }
  const std::string& name() const { return name_; }
  // World rank of each member, in group-rank order.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  std::string describe() const;  // "group 'tp' (world ranks 0,1)"
  virtual std::string_view backend() const = 0;

  // The collectives. Each checks its arguments (dtype, device, element counts, ranks) once here, counts
  // itself (comm_counters.h: kind, group, bytes, the thread's CommTag), then runs on the backend.
  // In place: t <- op over ranks of t.
  Work all_reduce(const Tensor& t, ReduceOp op, bool async = false);
  // Out of place: out <- op over ranks of in (in unchanged).
  Work all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async = false);
  // out (size * in.numel()) <- concatenation of every rank's in, in rank order.
  Work all_gather(const Tensor& out, const Tensor& in, bool async = false);
  // Unequal sizes: rank r contributes counts[r] elements; out has sum(counts).
  Work all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, bool async = false);
  // in (size * out.numel()) reduced over ranks; rank r keeps chunk r.
  Work reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async = false);
  // Unequal chunks: rank r keeps counts[r] elements of the reduced in.
  Work reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                        bool async = false);
  // in and out hold size equal chunks; chunk j of in goes to rank j and
  // arrives as chunk rank() of its out.
  Work all_to_all(const Tensor& out, const Tensor& in, bool async = false);
  // Unequal: send_counts[j] elements (consecutive in in) to rank j,
  // recv_counts[j] elements (consecutive in out) from rank j.
  Work all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts, bool async = false);
  Work broadcast(const Tensor& t, int root, bool async = false);
  // Point to point. `tag` tells apart messages between the same two ranks (MPI matches by it; NCCL by issue
  // order, so both sides must issue in the same order); `what` names the message in the watchdog's report
  // ("pp activation of stage 1, micro-batch 3"). Async: the buffer must stay alive and untouched until wait().
  Work send(const Tensor& t, int peer, bool async = false, int tag = 0, const std::string& what = "");
  Work recv(const Tensor& t, int peer, bool async = false, int tag = 0, const std::string& what = "");
  // A batch of point-to-point operations: those issued between batch_begin() and batch_end() (async) may match
  // in any order. NCCL needs it (one ncclGroupStart/End): outside a group its send does not complete before the
  // peer receives, so two ranks that each send to the other before receiving would wait on each other. MPI's
  // non-blocking sends and receives need nothing. A batch's Work may be waited for after batch_end().
  void batch_begin() { do_batch_begin(); }
  void batch_end() { do_batch_end(); }
  // Sends in to rank (rank+shift) mod size, receives out from (rank-shift) mod size.
  Work ring_shift(const Tensor& out, const Tensor& in, int shift = 1, bool async = false);
  void barrier();

 protected:
  Group(std::string name, int rank, std::vector<int> world_ranks)
      : name_(std::move(name)), rank_(rank), world_ranks_(std::move(world_ranks)) {}
  // The backend's collectives, called with checked arguments (the contracts above).
  virtual Work do_all_reduce(const Tensor& t, ReduceOp op, bool async) = 0;
  // The default copies in to out, then reduces in place; MPI reads in and writes out directly.
  virtual Work do_all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async);
  virtual Work do_all_gather(const Tensor& out, const Tensor& in, bool async) = 0;
  virtual Work do_all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts,
                               bool async) = 0;
  virtual Work do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async) = 0;
  virtual Work do_reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts,
                                   ReduceOp op, bool async) = 0;
  virtual Work do_all_to_all(const Tensor& out, const Tensor& in, bool async) = 0;
  virtual Work do_all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                               const std::vector<int64_t>& recv_counts, bool async) = 0;
  virtual Work do_broadcast(const Tensor& t, int root, bool async) = 0;
  virtual Work do_send(const Tensor& t, int peer, bool async, int tag, const std::string& what) = 0;
  virtual Work do_recv(const Tensor& t, int peer, bool async, int tag, const std::string& what) = 0;
  virtual Work do_ring_shift(const Tensor& out, const Tensor& in, int shift, bool async) = 0;
  virtual void do_batch_begin() {}
  virtual void do_batch_end() {}
  virtual void do_barrier() = 0;

 private:
  // Argument checks; throw "[comm] ...".
  void check_same(const char* op, const Tensor& a, const Tensor& b) const;
  void check_count(const char* op, const char* what, const Tensor& t, int64_t expected) const;
  void check_counts(const char* op, const std::vector<int64_t>& counts) const;
  void check_peer(const char* op, int peer) const;
  // Counts one collective of this group under the thread's tag (nothing for a group of one rank).
  void count(const char* kind, int64_t bytes) const;
  // The end (trace.h): a blocking collective's time counts as wait, a "comm" span records it with its
  // kind, group, tag, bytes and peer (the bytes count() counted); an async one's Work is watched for its wait.
  // t0: trace::now_ns() at the start when trace::timing(), else -1.
  Work traced(const char* kind, int64_t bytes, int peer, bool async, int64_t t0, Work w) const;

  std::string name_;
  int rank_ = 0;
  std::vector<int> world_ranks_;
};

}  // namespace mt
