// MPI backend of Group. Blocking collectives call MPI's blocking routines
// (Open MPI's tuned algorithms; its non-blocking ones are slower), each under
// a WatchdogScope; async ones use MPI_I* and are waited by polling MPI_Test.
#include "comm/mpi/mpi_group.h"

#include <climits>
#include <mutex>

#include "comm/watchdog.h"
#include "runtime/core/allocator.h"
#include "runtime/core/cuda_backend.h"

namespace mt {

namespace {

// bf16 has no MPI type: a 2-byte contiguous type with our own reductions,
// computed in f32 and rounded back (as NCCL does).
MPI_Datatype g_bf16_type = MPI_DATATYPE_NULL;
MPI_Op g_bf16_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min

template <int Kind> void bf16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = bf16::to_float(a[i]), y = bf16::to_float(b[i]);
    float r = Kind == 0 ? x + y : Kind == 1 ? (x > y ? x : y) : (x < y ? x : y);
    b[i] = bf16::from_float(r);
  }
}

void init_bf16_types() {
  static std::once_flag once;
  std::call_once(once, [] {
    MPI_Type_contiguous(2, MPI_BYTE, &g_bf16_type);
    MPI_Type_commit(&g_bf16_type);
    MPI_Op_create(&bf16_reduce<0>, 1, &g_bf16_ops[0]);
    MPI_Op_create(&bf16_reduce<1>, 1, &g_bf16_ops[1]);
    MPI_Op_create(&bf16_reduce<2>, 1, &g_bf16_ops[2]);
  });
}

MPI_Op mpi_op(ReduceOp op, DType d) {
  if (d == DType::bf16) {
    init_bf16_types();
    return op == ReduceOp::max ? g_bf16_ops[1] : op == ReduceOp::min ? g_bf16_ops[2] : g_bf16_ops[0];
  }
  return op == ReduceOp::max ? MPI_MAX : op == ReduceOp::min ? MPI_MIN : MPI_SUM;
}

int to_int(int64_t n, const char* op, const Group& g) {
  MT_CHECK(n <= INT_MAX, "comm", "{} on {}: {} elements exceed MPI's int count", op, g.describe(), n);
  return int(n);
}

std::vector<int> to_ints(const std::vector<int64_t>& v, const char* op, const Group& g) {
  std::vector<int> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = to_int(v[i], op, g);
  return r;
}

std::vector<int> displs_of(const std::vector<int>& counts) {
  std::vector<int> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

// A device tensor is staged through a host copy; host tensors are used as is.
// `buffer`, when given, is reusable pinned host memory of at least t's bytes
// (blocking calls); otherwise a fresh host tensor is made (async calls).
struct Staged {
  Tensor dev;   // the caller's tensor (device or host)
  Tensor host;  // what MPI sees
  bool copy_back = false;
  bool reused = false;  // host is a reused buffer: the copy back must finish before the next call
  Staged(const Tensor& t, bool in, bool out, void* buffer = nullptr) : dev(t), reused(buffer != nullptr) {
    if (t.device().is_cpu()) {
      host = t;
    } else {
      host =
          buffer ? from_blob(buffer, t.shape(), t.dtype(), Device::cpu()) : empty(t.shape(), t.dtype(), Device::cpu());
      if (in) copy_(host, t);
      copy_back = out;
    }
  }
  void finish() const {
    if (!copy_back) return;
    copy_(dev, host);
    if (reused) cuda::stream_sync_current(dev.device().index);
  }
};

struct MpiWork : Work::Impl {
  std::vector<MPI_Request> reqs;
  std::vector<std::vector<int>> keep;  // counts/displs MPI reads until completion
  std::vector<Staged> staged;          // outputs to copy back
  std::function<void()> after;         // post-processing (avg)
  uint64_t watch = 0;
  bool done = false;

  ~MpiWork() override {
    if (!done) watchdog_end(watch);
  }
  void complete() {
    done = true;
    watchdog_end(watch);
    if (after) after();
    for (auto& s : staged) s.finish();
  }
  void wait() override {
    if (done) return;
    // The watchdog entry made at issue time bounds how long this wait may take, timed from now.
    watchdog_waiting(watch);
    MT_MPI_CHECK(MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
    complete();
  }
  bool test() override {
    if (done) return true;
    int flag = 0;
    MT_MPI_CHECK(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) complete();
    return flag != 0;
  }
};

class MpiGroup final : public Group, public HasMpiComm {
 public:
  MpiGroup(MPI_Comm comm, std::string name, std::vector<int> world_ranks)
      : Group(std::move(name), comm_rank(comm), std::move(world_ranks)), comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }
  ~MpiGroup() override {
    for (auto& b : stage_)
      if (b.ptr) pinned_free(b.ptr);
    if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(&comm_);
    }
  }
  MPI_Comm mpi_comm() const override { return comm_; }
  std::string_view backend() const override { return "mpi"; }

  Work do_all_reduce(const Tensor& t, ReduceOp op, bool async) override {
    Staged s(t, true, true, stage(0, t, async));
    int n = to_int(t.numel(), "all_reduce", *this);
    MPI_Datatype ty = mpi_datatype(t.dtype());
    MPI_Op mop = mpi_op(op, t.dtype());
    auto post = [h = s.host, op, sz = size()] {
      if (op == ReduceOp::avg) divide_(h, sz);
    };
    if (!async) {
      {
        WatchdogScope w("all_reduce", *this);
        MT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, s.host.data_ptr(), n, ty, mop, comm_));
      }
      post();
      s.finish();
      return {};
    }
    auto w = start("all_reduce");
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, s.host.data_ptr(), n, ty, mop, comm_, &w->reqs[0]));
    w->after = post;
    w->staged.push_back(s);
    return Work(w);
  }

  using Group::do_all_reduce;
  Work do_all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async) override {
    if (async || !out.device().is_cpu() || !in.device().is_cpu()) return Group::do_all_reduce(out, in, op, async);
    {
      WatchdogScope w("all_reduce", *this);
      MT_MPI_CHECK(MPI_Allreduce(in.data_ptr(), out.data_ptr(), to_int(in.numel(), "all_reduce", *this),
                                 mpi_datatype(in.dtype()), mpi_op(op, in.dtype()), comm_));
    }
    if (op == ReduceOp::avg) divide_(out, size());
    return {};
  }

  Work do_all_gather(const Tensor& out, const Tensor& in, bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    int n = to_int(in.numel(), "all_gather", *this);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    if (!async) {
      {
        WatchdogScope w("all_gather", *this);
        MT_MPI_CHECK(MPI_Allgather(si.host.data_ptr(), n, ty, so.host.data_ptr(), n, ty, comm_));
      }
      so.finish();
      return {};
    }
    auto w = start("all_gather");
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Iallgather(si.host.data_ptr(), n, ty, so.host.data_ptr(), n, ty, comm_, &w->reqs[0]));
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    auto c = to_ints(counts, "all_gather_v", *this);
    auto d = displs_of(c);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    if (!async) {
      {
        WatchdogScope w("all_gather_v", *this);
        MT_MPI_CHECK(MPI_Allgatherv(si.host.data_ptr(), c[size_t(rank())], ty, so.host.data_ptr(), c.data(), d.data(),
                                    ty, comm_));
      }
      so.finish();
      return {};
    }
    auto w = start("all_gather_v");
    w->reqs.resize(1);
    w->keep = {c, d};
    MT_MPI_CHECK(MPI_Iallgatherv(si.host.data_ptr(), c[size_t(rank())], ty, so.host.data_ptr(), w->keep[0].data(),
                                 w->keep[1].data(), ty, comm_, &w->reqs[0]));
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    int n = to_int(out.numel(), "reduce_scatter", *this);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    MPI_Op mop = mpi_op(op, in.dtype());
    auto post = [h = so.host, op, sz = size()] {
      if (op == ReduceOp::avg) divide_(h, sz);
    };
    if (!async) {
      {
        WatchdogScope w("reduce_scatter", *this);
        MT_MPI_CHECK(MPI_Reduce_scatter_block(si.host.data_ptr(), so.host.data_ptr(), n, ty, mop, comm_));
      }
      post();
      so.finish();
      return {};
    }
    auto w = start("reduce_scatter");
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Ireduce_scatter_block(si.host.data_ptr(), so.host.data_ptr(), n, ty, mop, comm_, &w->reqs[0]));
    w->after = post;
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                        bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    auto c = to_ints(counts, "reduce_scatter_v", *this);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    MPI_Op mop = mpi_op(op, in.dtype());
    auto post = [h = so.host, op, sz = size()] {
      if (op == ReduceOp::avg) divide_(h, sz);
    };
    if (!async) {
      {
        WatchdogScope w("reduce_scatter_v", *this);
        MT_MPI_CHECK(MPI_Reduce_scatter(si.host.data_ptr(), so.host.data_ptr(), c.data(), ty, mop, comm_));
      }
      post();
      so.finish();
      return {};
    }
    auto w = start("reduce_scatter_v");
    w->reqs.resize(1);
    w->keep = {c};
    MT_MPI_CHECK(
        MPI_Ireduce_scatter(si.host.data_ptr(), so.host.data_ptr(), w->keep[0].data(), ty, mop, comm_, &w->reqs[0]));
    w->after = post;
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_all_to_all(const Tensor& out, const Tensor& in, bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    int n = to_int(in.numel() / size(), "all_to_all", *this);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    if (!async) {
      {
        WatchdogScope w("all_to_all", *this);
        MT_MPI_CHECK(MPI_Alltoall(si.host.data_ptr(), n, ty, so.host.data_ptr(), n, ty, comm_));
      }
      so.finish();
      return {};
    }
    auto w = start("all_to_all");
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Ialltoall(si.host.data_ptr(), n, ty, so.host.data_ptr(), n, ty, comm_, &w->reqs[0]));
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                       const std::vector<int64_t>& recv_counts, bool async) override {
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    auto sc = to_ints(send_counts, "all_to_all_v", *this), rc = to_ints(recv_counts, "all_to_all_v", *this);
    auto sd = displs_of(sc), rd = displs_of(rc);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    if (!async) {
      {
        WatchdogScope w("all_to_all_v", *this);
        MT_MPI_CHECK(MPI_Alltoallv(si.host.data_ptr(), sc.data(), sd.data(), ty, so.host.data_ptr(), rc.data(),
                                   rd.data(), ty, comm_));
      }
      so.finish();
      return {};
    }
    auto w = start("all_to_all_v");
    w->reqs.resize(1);
    w->keep = {sc, sd, rc, rd};
    MT_MPI_CHECK(MPI_Ialltoallv(si.host.data_ptr(), w->keep[0].data(), w->keep[1].data(), ty, so.host.data_ptr(),
                                w->keep[2].data(), w->keep[3].data(), ty, comm_, &w->reqs[0]));
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  Work do_broadcast(const Tensor& t, int root, bool async) override {
    Staged s(t, rank() == root, rank() != root, stage(0, t, async));
    int n = to_int(t.numel(), "broadcast", *this);
    MPI_Datatype ty = mpi_datatype(t.dtype());
    if (!async) {
      {
        WatchdogScope w("broadcast", *this);
        MT_MPI_CHECK(MPI_Bcast(s.host.data_ptr(), n, ty, root, comm_));
      }
      s.finish();
      return {};
    }
    auto w = start("broadcast");
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Ibcast(s.host.data_ptr(), n, ty, root, comm_, &w->reqs[0]));
    w->staged = {s};
    return Work(w);
  }

  // Point-to-point tags start past the collectives' (kTag, kTag + 1); MPI guarantees tags up to 32767.
  static int p2p_tag(int tag, const Group& g) {
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    const int64_t limit = flag && ub ? *ub : 32767;
    MT_CHECK(int64_t(kTag) + 16 + tag <= limit, "comm", "point to point on {}: tag {} past MPI's largest, {}",
             g.describe(), tag, limit - kTag - 16);
    return kTag + 16 + tag;
  }

  Work do_send(const Tensor& t, int peer, bool async, int tag, const std::string& what) override {
    // The peer is named (a `what` names its own, e.g. the pp rank).
    const std::string op =
        what.empty() ? fmt::format("send to world rank {}", world_ranks()[size_t(peer)]) : "send (" + what + ")";
    const int cnt = to_int(t.numel(), "send", *this), mtag = p2p_tag(tag, *this);
    if (!async) {
      Staged s(t, true, false, stage(0, t, false));
      WatchdogScope w(op.c_str(), *this, {world_ranks()[size_t(peer)]});
      MT_MPI_CHECK(MPI_Send(s.host.data_ptr(), cnt, mpi_datatype(t.dtype()), peer, mtag, comm_));
      return {};
    }
    Staged s(t, true, false, nullptr);
    auto w = start(op, {world_ranks()[size_t(peer)]});
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Isend(s.host.data_ptr(), cnt, mpi_datatype(t.dtype()), peer, mtag, comm_, &w->reqs[0]));
    keep_alive(*w, s);
    return Work(w);
  }

  Work do_recv(const Tensor& t, int peer, bool async, int tag, const std::string& what) override {
    const std::string op =
        what.empty() ? fmt::format("recv from world rank {}", world_ranks()[size_t(peer)]) : "recv (" + what + ")";
    const int cnt = to_int(t.numel(), "recv", *this), mtag = p2p_tag(tag, *this);
    if (!async) {
      Staged s(t, false, true, stage(0, t, false));
      {
        WatchdogScope w(op.c_str(), *this, {world_ranks()[size_t(peer)]});
        MT_MPI_CHECK(MPI_Recv(s.host.data_ptr(), cnt, mpi_datatype(t.dtype()), peer, mtag, comm_, MPI_STATUS_IGNORE));
      }
      s.finish();
      return {};
    }
    Staged s(t, false, true, nullptr);
    auto w = start(op, {world_ranks()[size_t(peer)]});
    w->reqs.resize(1);
    MT_MPI_CHECK(MPI_Irecv(s.host.data_ptr(), cnt, mpi_datatype(t.dtype()), peer, mtag, comm_, &w->reqs[0]));
    w->staged = {s};
    return Work(w);
  }

  Work do_ring_shift(const Tensor& out, const Tensor& in, int shift, bool async) override {
    int n = size();
    int to = ((rank() + shift) % n + n) % n, from = ((rank() - shift) % n + n) % n;
    Staged si(in, true, false, stage(0, in, async)), so(out, false, true, stage(1, out, async));
    int cnt = to_int(in.numel(), "ring_shift", *this);
    MPI_Datatype ty = mpi_datatype(in.dtype());
    if (!async) {
      {
        WatchdogScope w("ring_shift", *this, {world_ranks()[size_t(to)], world_ranks()[size_t(from)]});
        MT_MPI_CHECK(MPI_Sendrecv(si.host.data_ptr(), cnt, ty, to, kTag + 1, so.host.data_ptr(), cnt, ty, from,
                                  kTag + 1, comm_, MPI_STATUS_IGNORE));
      }
      so.finish();
      return {};
    }
    auto w = start("ring_shift", {world_ranks()[size_t(to)], world_ranks()[size_t(from)]});
    w->reqs.resize(2);
    MT_MPI_CHECK(MPI_Irecv(so.host.data_ptr(), cnt, ty, from, kTag + 1, comm_, &w->reqs[0]));
    MT_MPI_CHECK(MPI_Isend(si.host.data_ptr(), cnt, ty, to, kTag + 1, comm_, &w->reqs[1]));
    w->staged = {so};
    keep_alive(*w, si);
    return Work(w);
  }

  void do_barrier() override {
    WatchdogScope w("barrier", *this);
    MT_MPI_CHECK(MPI_Barrier(comm_));
  }

 private:
  static constexpr int kTag = 7100;

  // Pinned host buffers reused by blocking calls on device tensors (slot 0:
  // input or in-place buffer, slot 1: output), grown to the largest seen: a
  // fresh pageable buffer per call costs page faults and a slower copy.
  struct StageBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  StageBuffer stage_[2];
  void* stage(int slot, const Tensor& t, bool async) {
    if (async || t.device().is_cpu() || t.nbytes() == 0) return nullptr;
    auto& b = stage_[slot];
    if (b.bytes < t.nbytes()) {
      if (b.ptr) pinned_free(b.ptr);
      b.ptr = nullptr;
      b.ptr = pinned_alloc(t.nbytes());
      b.bytes = t.nbytes();
    }
    return b.ptr;
  }

  static int comm_rank(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  // peers: the world ranks a point-to-point operation waits on (empty: the whole group).
  std::shared_ptr<MpiWork> start(const std::string& op, std::vector<int> peers = {}) {
    auto w = std::make_shared<MpiWork>();
    w->watch = watchdog_begin(op, *this);
    watchdog_async(w->watch);
    if (!peers.empty()) watchdog_set_ranks(w->watch, std::move(peers));
    return w;
  }
  // An input staged to host must live until MPI is done reading it.
  static void keep_alive(MpiWork& w, const Staged& in) {
    if (!in.dev.device().is_cpu()) {
      Staged k = in;
      k.copy_back = false;
      w.staged.push_back(k);
    }
  }


  MPI_Comm comm_;
};

}  // namespace

MPI_Datatype mpi_datatype(DType d) {
  switch (d) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u16:
      return MPI_UINT16_T;
    case DType::u8:
      return MPI_UINT8_T;
    case DType::bf16:
      init_bf16_types();
      return g_bf16_type;
  }
  return MPI_BYTE;
}

std::unique_ptr<Group> make_mpi_group(MPI_Comm comm, std::string name, std::vector<int> world_ranks) {
  return std::make_unique<MpiGroup>(comm, std::move(name), std::move(world_ranks));
}

MPI_Comm group_mpi_comm(const Group& g) {
  auto* h = dynamic_cast<const HasMpiComm*>(&g);
  MT_CHECK(h, "comm", "{} ({} backend) has no MPI communicator", g.describe(), g.backend());
  return h->mpi_comm();
}

}  // namespace mt
