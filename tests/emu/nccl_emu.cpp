// NCCL stand-in over MPI for the emulated CUDA device (build option -Dcuda_emulator=true): the part of the NCCL
// API that comm/nccl/nccl_group.cpp calls, with the signatures of the real nccl.h. Device buffers are host
// memory in the emulator, so every operation is an MPI operation on them, run at once on the calling thread
// ("on the stream": the emulated device runs what is enqueued when it is enqueued), in call order.
//
// Communicators. ncclGetUniqueId writes a tag, the creator's world rank and a per-process serial into the id.
// ncclCommInitRank (collective over the communicator's ranks only) sends (nranks, rank, world rank) to the
// creator over MPI_COMM_WORLD with a tag made from the serial; the creator, which must itself be one of the
// ranks (as in meshtrain: the group's rank 0 makes the id), collects the world ranks in communicator rank
// order and sends the list back, and every rank builds the communicator with MPI_Comm_create_group, so its MPI
// ranks are the NCCL ranks. ncclCommAbort (called from the watchdog thread, maybe while the main thread is
// inside MPI) only marks the communicator; it is neither freed nor usable after.
//
// Collectives check, before running, that every rank of the communicator issues the same one (kind, count,
// type, op, root): a mismatch, which would hang or corrupt on the real library, is reported on every rank.
// Reductions gather the ranks' contributions and reduce them in rank order on each rank, so every rank gets
// the same bits: f32 in f32, f64 in f64, bf16 in f32 rounded once to nearest even, integers wrapping; avg is
// the sum divided by the number of ranks (integers: truncated); max/min propagate NaN. Counts of 0 are a local
// no-op (nothing is read, written or exchanged).
//
// Groups (ncclGroupStart/End, nestable, per thread): operations are checked when issued and run at the
// outermost ncclGroupEnd: sends and receives are posted non-blocking first (MPI_Issend/MPI_Irecv, so a group
// of sends and receives in any order does not deadlock), then the collectives run in issue order, then the
// point-to-point transfers are completed and every receive is checked to have got exactly its count. A send or
// receive outside a group is a group of one; the send is synchronous, as on the real library, where it does
// not complete before the peer receives.
//
// Buffer checks (emu::check_device_range): every buffer an operation reads or writes must lie inside a live
// device allocation (a host buffer is an error naming the call and the buffer); sendbuff of ncclBroadcast and
// recvbuff of ncclReduce only on the root, as NCCL documents. In-place forms are the documented ones
// (recvbuff == sendbuff; all-gather: sendbuff == recvbuff + rank * sendcount; reduce-scatter: recvbuff ==
// sendbuff + rank * recvcount); any other overlap of the two is an error. The stream must be live and belong
// to the communicator's device (the current device at ncclCommInitRank). Reads and writes are recorded on the
// stream for the hazard tracker (emu::note_read / note_write).
//
// Types: reductions ncclFloat32, ncclBfloat16, ncclFloat64, ncclInt32, ncclInt64 with ncclSum, ncclAvg,
// ncclMax, ncclMin; data movement also ncclUint8. Anything else is refused (ncclInvalidArgument), as are the
// NCCL calls meshtrain does not make (not defined here: a link error names them).
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "runtime/core/dtype.h"
#include "tests/emu/device_registry.h"

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, nranks = 0, device = 0;
  std::atomic<bool> aborted{false};
};

namespace {

std::mutex g_mu;
std::unordered_set<const ncclComm*> g_comms;  // live (not destroyed) communicators
thread_local std::string t_last_error;

using emu::strf;

ncclResult_t fail(const char* call, const std::string& what, ncclResult_t rc) {
  t_last_error = std::string(call) + ": " + what;
  emu::report(call, what + " (NCCL stand-in, tests/emu/nccl_emu.cpp)");
  return rc;
}

// A check of the device registry failed: it reported on stderr; the text for ncclGetLastError.
ncclResult_t registry_fail(const char* call, const std::string& what, ncclResult_t rc) {
  t_last_error = std::string(call) + ": " + what + " (the emulated device's report, [cuda-emu] on stderr, says why)";
  return rc;
}

ncclResult_t mpi_fail(const char* call, const char* mpi_call, int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return fail(call, strf("%s failed: %s", mpi_call, text), ncclSystemError);
}
#define MPI_TRY(call, expr)                                     \
  do {                                                          \
    int mpi_rc_ = (expr);                                       \
    if (mpi_rc_ != MPI_SUCCESS) return mpi_fail(call, #expr, mpi_rc_); \
  } while (0)

// ---------------------------------------------------------------- the unique id

constexpr char kIdMagic[16] = "mt-nccl-emu-id1";
struct IdBody {
  char magic[16];
  int32_t creator;  // world rank of the process that made the id
  int32_t pad;
  uint64_t serial;  // per-creator count of ids
};
static_assert(sizeof(IdBody) <= sizeof(ncclUniqueId));
std::atomic<uint64_t> g_serial{0};

// Bootstrap tags on MPI_COMM_WORLD: below 32767 (MPI's least MPI_TAG_UB), away from meshtrain's (7190-7193).
int bootstrap_tag(uint64_t serial) { return 20000 + int(serial % 10000); }
constexpr int kP2pTag = 1;  // on the communicator's own MPI_Comm

// ---------------------------------------------------------------- types and reductions

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclUint8:
      return 1;
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}
const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return "ncclInt8";
    case ncclUint8:
      return "ncclUint8";
    case ncclInt32:
      return "ncclInt32";
    case ncclUint32:
      return "ncclUint32";
    case ncclInt64:
      return "ncclInt64";
    case ncclUint64:
      return "ncclUint64";
    case ncclFloat16:
      return "ncclFloat16";
    case ncclFloat32:
      return "ncclFloat32";
    case ncclFloat64:
      return "ncclFloat64";
    case ncclBfloat16:
      return "ncclBfloat16";
    default:
      return "another ncclDataType_t";
  }
}
const char* op_name(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return "ncclSum";
    case ncclProd:
      return "ncclProd";
    case ncclMax:
      return "ncclMax";
    case ncclMin:
      return "ncclMin";
    case ncclAvg:
      return "ncclAvg";
    default:
      return "a custom ncclRedOp_t";
  }
}

// The runtime's host bf16 conversions (round to nearest even; NaN stays a quiet NaN).
float bf16_to_f32(uint16_t u) { return mt::bf16::to_float(u); }
uint16_t f32_to_bf16(float f) { return mt::bf16::from_float(f); }

// Reduces nranks contributions of c elements each (contiguous, rank-major in `in`) into out, in rank order.
// Elem: the stored type; Acc: the type it is reduced in.
template <typename Elem, typename Acc> void reduce_as(const unsigned char* in, int nranks, size_t c, void* out,
                                                     ncclRedOp_t op) {
  auto load = [&](int r, size_t i) -> Acc {
    Elem e;
    std::memcpy(&e, in + (size_t(r) * c + i) * sizeof(Elem), sizeof(Elem));
    if constexpr (std::is_same_v<Elem, uint16_t>) return bf16_to_f32(e);
    else return Acc(e);
  };
  for (size_t i = 0; i < c; ++i) {
    Acc a = load(0, i);
    for (int r = 1; r < nranks; ++r) {
      const Acc b = load(r, i);
      if (op == ncclSum || op == ncclAvg) {
        if constexpr (std::is_integral_v<Acc>)  // wraps, as the hardware does
          a = Acc(std::make_unsigned_t<Acc>(a) + std::make_unsigned_t<Acc>(b));
        else a = a + b;
      } else {
        const bool take_b = op == ncclMax ? b > a : b < a;
        if constexpr (std::is_floating_point_v<Acc>) {
          if (std::isnan(a) || std::isnan(b)) a = std::isnan(a) ? a : b;
          else if (take_b) a = b;
        } else if (take_b) a = b;
      }
    }
    if (op == ncclAvg) a = Acc(a / Acc(nranks));
    Elem e;
    if constexpr (std::is_same_v<Elem, uint16_t>) e = f32_to_bf16(a);
    else e = Elem(a);
    std::memcpy(static_cast<unsigned char*>(out) + i * sizeof(Elem), &e, sizeof(Elem));
  }
}

void reduce(ncclDataType_t t, const unsigned char* in, int nranks, size_t c, void* out, ncclRedOp_t op) {
  switch (t) {
    case ncclFloat32:
      return reduce_as<float, float>(in, nranks, c, out, op);
    case ncclFloat64:
      return reduce_as<double, double>(in, nranks, c, out, op);
    case ncclBfloat16:
      return reduce_as<uint16_t, float>(in, nranks, c, out, op);
    case ncclInt32:
      return reduce_as<int32_t, int32_t>(in, nranks, c, out, op);
    case ncclInt64:
      return reduce_as<int64_t, int64_t>(in, nranks, c, out, op);
    default:
      return;  // refused when the operation was issued
  }
}

// ---------------------------------------------------------------- operations

enum class Kind : int32_t { all_reduce, all_gather, reduce_scatter, broadcast, reduce, send, recv };
const char* kind_call(Kind k) {
  switch (k) {
    case Kind::all_reduce:
      return "ncclAllReduce";
    case Kind::all_gather:
      return "ncclAllGather";
    case Kind::reduce_scatter:
      return "ncclReduceScatter";
    case Kind::broadcast:
      return "ncclBroadcast";
    case Kind::reduce:
      return "ncclReduce";
    case Kind::send:
      return "ncclSend";
    case Kind::recv:
      return "ncclRecv";
  }
  return "nccl?";
}

struct Op {
  Kind kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t send_bytes = 0, recv_bytes = 0;  // what this rank reads and writes
  size_t count = 0;                       // the call's count argument
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;  // root, or peer for send/recv
  ncclComm* comm = nullptr;
  cudaStream_t stream = nullptr;
};

struct GroupState {
  int depth = 0;
  std::vector<Op> ops;
};
thread_local GroupState t_group;

ncclResult_t check_comm(const char* call, ncclComm_t comm) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_comms.count(comm))
      return fail(call, strf("communicator %p is not live (never made, or destroyed)", (void*)comm),
                  ncclInvalidArgument);
  }
  if (comm->aborted) return fail(call, strf("communicator %p was aborted", (void*)comm), ncclInvalidUsage);
  return ncclSuccess;
}

bool overlap(const void* p, size_t pn, const void* q, size_t qn) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return pn > 0 && qn > 0 && a < b + qn && b < a + pn;
}

// Checks an operation when it is issued: communicator, type, op, root or peer, stream, buffers.
ncclResult_t check_op(Op& o) {
  const char* call = kind_call(o.kind);
  if (auto rc = check_comm(call, o.comm)) return rc;
  const ncclComm& c = *o.comm;
  const bool reduces = o.kind == Kind::all_reduce || o.kind == Kind::reduce_scatter || o.kind == Kind::reduce;
  const size_t es = type_size(o.type);
  if (es == 0 || (reduces && o.type == ncclUint8))
    return fail(call,
                strf("datatype %s (%d) is not emulated (%s)", type_name(o.type), int(o.type),
                    reduces ? "reductions: ncclFloat32, ncclBfloat16, ncclFloat64, ncclInt32, ncclInt64"
                            : "data movement: those and ncclUint8"),
                ncclInvalidArgument);
  if (reduces && o.op != ncclSum && o.op != ncclAvg && o.op != ncclMax && o.op != ncclMin)
    return fail(call, strf("reduction %s (%d) is not emulated (ncclSum, ncclAvg, ncclMax, ncclMin are)", op_name(o.op),
                          int(o.op)),
                ncclInvalidArgument);
  const bool rooted = o.kind == Kind::broadcast || o.kind == Kind::reduce;
  const bool p2p = o.kind == Kind::send || o.kind == Kind::recv;
  if ((rooted || p2p) && (o.root < 0 || o.root >= c.nranks))
    return fail(call, strf("%s %d is not a rank of the communicator (%d ranks)", p2p ? "peer" : "root", o.root, c.nranks),
                ncclInvalidArgument);
  if (!emu::check_stream(o.stream, call)) return registry_fail(call, "stream is not a live stream", ncclInvalidArgument);
  const int sdev = emu::stream_device(o.stream);
  if (sdev != c.device)
    return fail(call,
                strf("stream %p belongs to device %d, the communicator to device %d", (void*)o.stream, sdev, c.device),
                ncclInvalidUsage);
  if (o.count == 0) return ncclSuccess;

  const size_t bytes = o.count * es, all = bytes * size_t(c.nranks);
  const bool is_root = o.root == c.rank;
  switch (o.kind) {
    case Kind::all_reduce:
      o.send_bytes = bytes, o.recv_bytes = bytes;
      break;
    case Kind::all_gather:
      o.send_bytes = bytes, o.recv_bytes = all;
      break;
    case Kind::reduce_scatter:
      o.send_bytes = all, o.recv_bytes = bytes;
      break;
    case Kind::broadcast:
      o.send_bytes = is_root ? bytes : 0, o.recv_bytes = bytes;
      if (!is_root) o.send = nullptr;  // only the root's sendbuff is used
      break;
    case Kind::reduce:
      o.send_bytes = bytes, o.recv_bytes = is_root ? bytes : 0;
      if (!is_root) o.recv = nullptr;  // only the root's recvbuff is used
      break;
    case Kind::send:
      o.send_bytes = bytes;
      break;
    case Kind::recv:
      o.recv_bytes = bytes;
      break;
  }
  if (o.send_bytes && !emu::check_device_range(o.send, o.send_bytes, call, "sendbuff"))
    return registry_fail(call, strf("sendbuff %p (%zu bytes) is not device memory", o.send, o.send_bytes),
                         ncclInvalidArgument);
  if (o.recv_bytes && !emu::check_device_range(o.recv, o.recv_bytes, call, "recvbuff"))
    return registry_fail(call, strf("recvbuff %p (%zu bytes) is not device memory", o.recv, o.recv_bytes),
                         ncclInvalidArgument);
  if (o.send_bytes && !o.send) return fail(call, "sendbuff is null", ncclInvalidArgument);
  if (o.recv_bytes && !o.recv) return fail(call, "recvbuff is null", ncclInvalidArgument);
  if (o.send_bytes && o.recv_bytes) {
    // The documented in-place forms; any other overlap is an error.
    const unsigned char* s = static_cast<const unsigned char*>(o.send);
    unsigned char* r = static_cast<unsigned char*>(o.recv);
    bool in_place = s == r;
    if (o.kind == Kind::all_gather) in_place = s == r + size_t(c.rank) * bytes;
    if (o.kind == Kind::reduce_scatter) in_place = r == s + size_t(c.rank) * bytes;
    if (!in_place && overlap(s, o.send_bytes, r, o.recv_bytes))
      return fail(call,
                  strf("sendbuff %p (+%zu) and recvbuff %p (+%zu) overlap, but not in the in-place form NCCL documents",
                      o.send, o.send_bytes, o.recv, o.recv_bytes),
                  ncclInvalidArgument);
  }
  return ncclSuccess;
}

// The signature every rank must agree on before a collective runs.
struct Signature {
  int32_t kind, type, op, root;
  uint64_t count;
  bool operator==(const Signature&) const = default;
};

ncclResult_t agree(const Op& o) {
  const char* call = kind_call(o.kind);
  const ncclComm& c = *o.comm;
  const bool rooted = o.kind == Kind::broadcast || o.kind == Kind::reduce;
  const bool reduces = o.kind == Kind::all_reduce || o.kind == Kind::reduce_scatter || o.kind == Kind::reduce;
  Signature mine{int32_t(o.kind), int32_t(o.type), reduces ? int32_t(o.op) : 0, rooted ? o.root : 0, o.count};
  std::vector<Signature> all(size_t(c.nranks));
  MPI_TRY(call, MPI_Allgather(&mine, int(sizeof mine), MPI_BYTE, all.data(), int(sizeof mine), MPI_BYTE, c.mpi));
  for (int r = 0; r < c.nranks; ++r) {
    const Signature& s = all[size_t(r)];
    if (s == mine) continue;
    return fail(call,
                strf("ranks disagree on the collective: rank %d issued %s(count %llu, %s, %s, root %d), rank %d "
                    "%s(count %llu, %s, %s, root %d)",
                    c.rank, call, (unsigned long long)mine.count, type_name(ncclDataType_t(mine.type)),
                    op_name(ncclRedOp_t(mine.op)), mine.root, r, kind_call(Kind(s.kind)), (unsigned long long)s.count,
                    type_name(ncclDataType_t(s.type)), op_name(ncclRedOp_t(s.op)), s.root),
                ncclInvalidUsage);
  }
  return ncclSuccess;
}

// Elements per exchange step: bounds the scratch (nranks x this) and keeps MPI's int counts in range.
size_t chunk_elems(size_t es, int nranks) {
  return std::max<size_t>(1, (size_t(1) << 26) / (es * size_t(std::max(1, nranks))));
}

ncclResult_t run_collective(const Op& o) {
  const char* call = kind_call(o.kind);
  if (auto rc = agree(o)) return rc;
  const ncclComm& c = *o.comm;
  const size_t es = type_size(o.type), n = o.count, step = chunk_elems(es, c.nranks);
  const int P = c.nranks;
  auto* send = static_cast<const unsigned char*>(o.send);
  auto* recv = static_cast<unsigned char*>(o.recv);
  std::vector<unsigned char> tmp, pack;
  for (size_t off = 0; off < n; off += step) {
    const size_t e = std::min(step, n - off), b = e * es;
    const int ib = int(b);
    switch (o.kind) {
      case Kind::all_reduce:
        tmp.resize(b * size_t(P));
        MPI_TRY(call, MPI_Allgather(send + off * es, ib, MPI_BYTE, tmp.data(), ib, MPI_BYTE, c.mpi));
        reduce(o.type, tmp.data(), P, e, recv + off * es, o.op);
        break;
      case Kind::all_gather:
        tmp.resize(b * size_t(P));
        MPI_TRY(call, MPI_Allgather(send + off * es, ib, MPI_BYTE, tmp.data(), ib, MPI_BYTE, c.mpi));
        for (int r = 0; r < P; ++r) std::memcpy(recv + (size_t(r) * n + off) * es, tmp.data() + size_t(r) * b, b);
        break;
      case Kind::reduce_scatter:
        pack.resize(b * size_t(P)), tmp.resize(b * size_t(P));
        for (int r = 0; r < P; ++r) std::memcpy(pack.data() + size_t(r) * b, send + (size_t(r) * n + off) * es, b);
        MPI_TRY(call, MPI_Alltoall(pack.data(), ib, MPI_BYTE, tmp.data(), ib, MPI_BYTE, c.mpi));
        reduce(o.type, tmp.data(), P, e, recv + off * es, o.op);
        break;
      case Kind::broadcast:
        if (c.rank == o.root && send != recv) std::memcpy(recv + off * es, send + off * es, b);
        MPI_TRY(call, MPI_Bcast(recv + off * es, ib, MPI_BYTE, o.root, c.mpi));
        break;
      case Kind::reduce:
        if (c.rank == o.root) tmp.resize(b * size_t(P));
        MPI_TRY(call, MPI_Gather(send + off * es, ib, MPI_BYTE, c.rank == o.root ? tmp.data() : nullptr, ib, MPI_BYTE,
                                 o.root, c.mpi));
        if (c.rank == o.root) reduce(o.type, tmp.data(), P, e, recv + off * es, o.op);
        break;
      case Kind::send:
      case Kind::recv:
        break;
    }
  }
  return ncclSuccess;
}

// Runs a group: hazards recorded, sends and receives posted, collectives in order, transfers completed.
ncclResult_t run_group(std::vector<Op>& ops) {
  ncclResult_t first = ncclSuccess;
  auto keep = [&](ncclResult_t rc) {
    if (first == ncclSuccess) first = rc;
  };
  for (const Op& o : ops) {
    if (o.count == 0) continue;
    const char* call = kind_call(o.kind);
    // A hazard is reported and returned, but the operation still runs: the other ranks are in it.
    if (o.send_bytes && !emu::note_read(o.send, o.send_bytes, o.stream, call))
      keep(registry_fail(call, "sendbuff: stream-order hazard", ncclInvalidUsage));
    if (o.recv_bytes && !emu::note_write(o.recv, o.recv_bytes, o.stream, call))
      keep(registry_fail(call, "recvbuff: stream-order hazard", ncclInvalidUsage));
  }
  struct Pending {
    const Op* op;
    MPI_Request req;
  };
  std::vector<Pending> p2p;
  for (const Op& o : ops) {
    if (o.count == 0 || (o.kind != Kind::send && o.kind != Kind::recv)) continue;
    const char* call = kind_call(o.kind);
    if (o.send_bytes > size_t(INT32_MAX) || o.recv_bytes > size_t(INT32_MAX)) {
      keep(fail(call, "more than 2^31-1 bytes in one transfer is not emulated", ncclInvalidArgument));
      continue;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    int rc = o.kind == Kind::send
                 ? MPI_Issend(o.send, int(o.send_bytes), MPI_BYTE, o.root, kP2pTag, o.comm->mpi, &req)
                 : MPI_Irecv(o.recv, int(o.recv_bytes), MPI_BYTE, o.root, kP2pTag, o.comm->mpi, &req);
    if (rc != MPI_SUCCESS) keep(mpi_fail(call, o.kind == Kind::send ? "MPI_Issend" : "MPI_Irecv", rc));
    else p2p.push_back({&o, req});
  }
  for (const Op& o : ops) {
    if (o.count == 0 || o.kind == Kind::send || o.kind == Kind::recv) continue;
    if (auto rc = run_collective(o)) {
      keep(rc);
      break;  // every rank saw the same disagreement (or MPI failed): the rest of the group is not run
    }
  }
  for (auto& p : p2p) {
    MPI_Status st;
    const char* call = kind_call(p.op->kind);
    int rc = MPI_Wait(&p.req, &st);
    int cls = MPI_SUCCESS;
    if (rc != MPI_SUCCESS) MPI_Error_class(rc, &cls);
    if (cls == MPI_ERR_TRUNCATE) {
      keep(fail(call,
                strf("rank %d sent more than the %zu bytes expected (%zu x %s): the peer's ncclSend count differs",
                     p.op->root, p.op->recv_bytes, p.op->count, type_name(p.op->type)),
                ncclInvalidUsage));
      continue;
    }
    if (rc != MPI_SUCCESS) {
      keep(mpi_fail(call, "MPI_Wait", rc));
      continue;
    }
    if (p.op->kind == Kind::recv) {
      int got = 0;
      MPI_Get_count(&st, MPI_BYTE, &got);
      if (size_t(got) != p.op->recv_bytes)
        keep(fail(call,
                  strf("received %d bytes from rank %d, expected %zu (%zu x %s): the peer's ncclSend count differs", got,
                      p.op->root, p.op->recv_bytes, p.op->count, type_name(p.op->type)),
                  ncclInvalidUsage));
    }
  }
  return first;
}

// A group, or one operation, run now; in a stream capture (any of its streams capturing) recorded, and run at each
// replay of the graph, when every rank replays its own.
ncclResult_t run_or_record(std::vector<Op> ops) {
  for (const Op& o : ops)
    if (emu::record_if_capturing(o.stream, [ops]() mutable { run_group(ops); })) return ncclSuccess;
  return run_group(ops);
}

ncclResult_t issue(Op o) {
  if (auto rc = check_op(o)) return rc;
  if (t_group.depth > 0) {
    t_group.ops.push_back(o);
    return ncclSuccess;
  }
  return run_or_record({o});
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------- errors

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error (the emulator's MPI failed)";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

// The calling thread's last error (comm is unused, as in NCCL).
const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

// ---------------------------------------------------------------- communicators

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  const char* call = "ncclGetUniqueId";
  if (!uniqueId) return fail(call, "uniqueId is null", ncclInvalidArgument);
  int init = 0;
  MPI_Initialized(&init);
  if (!init) return fail(call, "MPI is not initialised (the NCCL stand-in runs over MPI)", ncclInvalidUsage);
  IdBody b{};
  std::memcpy(b.magic, kIdMagic, sizeof b.magic);
  int world = 0;
  MPI_TRY(call, MPI_Comm_rank(MPI_COMM_WORLD, &world));
  b.creator = world;
  b.serial = g_serial++;
  std::memset(uniqueId, 0, sizeof *uniqueId);
  std::memcpy(uniqueId->internal, &b, sizeof b);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  const char* call = "ncclCommInitRank";
  if (!comm) return fail(call, "comm is null", ncclInvalidArgument);
  IdBody id;
  std::memcpy(&id, commId.internal, sizeof id);
  if (std::memcmp(id.magic, kIdMagic, sizeof id.magic) != 0)
    return fail(call, "commId was not made by ncclGetUniqueId (of this stand-in)", ncclInvalidArgument);
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(call, strf("rank %d of %d ranks", rank, nranks), ncclInvalidArgument);
  int world = 0, world_size = 0;
  MPI_TRY(call, MPI_Comm_rank(MPI_COMM_WORLD, &world));
  MPI_TRY(call, MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (id.creator < 0 || id.creator >= world_size)
    return fail(call, strf("commId names world rank %d as its creator (world of %d)", id.creator, world_size),
                ncclInvalidArgument);
  const int tag = bootstrap_tag(id.serial);
  // The world ranks in communicator rank order: collected by the id's creator, sent back to everyone.
  // Message: serial, nranks, rank, world rank. Reply: nranks world ranks, or -1s if the ranks disagree.
  std::vector<int> worlds(size_t(nranks), -1);
  if (world == id.creator) {
    worlds[size_t(rank)] = world;
    std::string bad;
    std::vector<int> joined;
    for (int i = 1; i < nranks; ++i) {
      int64_t msg[4];
      MPI_Status st;
      MPI_TRY(call, MPI_Recv(msg, 4, MPI_INT64_T, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &st));
      joined.push_back(st.MPI_SOURCE);
      if (uint64_t(msg[0]) != id.serial || msg[1] != nranks || msg[2] < 0 || msg[2] >= nranks ||
          worlds[size_t(msg[2])] != -1) {
        if (bad.empty())
          bad = strf("world rank %d joined as rank %lld of %lld (id serial %llu), but this rank (world %d) made the id "
                    "(serial %llu) for %d ranks, and that rank is %s",
                    st.MPI_SOURCE, (long long)msg[2], (long long)msg[1], (unsigned long long)msg[0], world,
                    (unsigned long long)id.serial, nranks,
                    msg[2] >= 0 && msg[2] < nranks && worlds[size_t(msg[2])] != -1 ? "taken" : "out of range");
        continue;
      }
      worlds[size_t(msg[2])] = int(msg[3]);
    }
    if (!bad.empty()) std::fill(worlds.begin(), worlds.end(), -1);
    for (int dest : joined) MPI_TRY(call, MPI_Send(worlds.data(), nranks, MPI_INT, dest, tag, MPI_COMM_WORLD));
    if (!bad.empty()) return fail(call, bad, ncclInvalidUsage);
  } else {
    int64_t msg[4] = {int64_t(id.serial), nranks, rank, world};
    MPI_TRY(call, MPI_Send(msg, 4, MPI_INT64_T, id.creator, tag, MPI_COMM_WORLD));
    MPI_TRY(call, MPI_Recv(worlds.data(), nranks, MPI_INT, id.creator, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    if (worlds[0] == -1)
      return fail(call, strf("the ranks of the communicator disagree (see the report of world rank %d, which made the id)",
                            id.creator),
                  ncclInvalidUsage);
  }
  MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_TRY(call, MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  MPI_TRY(call, MPI_Group_incl(world_group, nranks, worlds.data(), &group));
  MPI_Comm mpi = MPI_COMM_NULL;
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &mpi);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  if (rc != MPI_SUCCESS) return mpi_fail(call, "MPI_Comm_create_group", rc);
  MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
  int mpi_rank = -1;
  MPI_Comm_rank(mpi, &mpi_rank);
  if (mpi_rank != rank) {
    MPI_Comm_free(&mpi);
    return fail(call, strf("internal: MPI rank %d for NCCL rank %d", mpi_rank, rank), ncclInternalError);
  }
  auto* c = new ncclComm;
  c->mpi = mpi;
  c->rank = rank;
  c->nranks = nranks;
  c->device = emu::current_device();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_comms.insert(c);
  }
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const char* call = "ncclCommDestroy";
  if (!comm) return ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_comms.count(comm))
      return fail(call, strf("communicator %p is not live (never made, or destroyed)", (void*)comm),
                  ncclInvalidArgument);
    if (comm->aborted) return fail(call, strf("communicator %p was aborted", (void*)comm), ncclInvalidUsage);
  }
  for (const Op& o : t_group.ops)
    if (o.comm == comm)
      return fail(call, "an operation on this communicator is still in an open group (ncclGroupEnd not called)",
                  ncclInvalidUsage);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_comms.erase(comm);
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}

// Marks the communicator aborted: any later call on it fails. Nothing is freed and no MPI call is made (the
// watchdog calls this while another thread may be inside MPI on this communicator; the job ends next).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_comms.count(comm))
    return fail("ncclCommAbort", strf("communicator %p is not live (never made, or destroyed)", (void*)comm),
                ncclInvalidArgument);
  comm->aborted = true;
  return ncclSuccess;
}

// ---------------------------------------------------------------- groups

ncclResult_t ncclGroupStart() {
  ++t_group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group.depth == 0) return fail("ncclGroupEnd", "no ncclGroupStart to end", ncclInvalidUsage);
  if (--t_group.depth > 0) return ncclSuccess;
  std::vector<Op> ops;
  ops.swap(t_group.ops);
  for (const Op& o : ops)
    if (auto rc = check_comm("ncclGroupEnd", o.comm)) return rc;
  return run_or_record(std::move(ops));
}

// ---------------------------------------------------------------- operations

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  Op o{Kind::all_reduce};
  o.send = sendbuff, o.recv = recvbuff, o.count = count, o.type = datatype, o.op = op, o.comm = comm;
  o.stream = stream;
  return issue(o);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  Op o{Kind::all_gather};
  o.send = sendbuff, o.recv = recvbuff, o.count = sendcount, o.type = datatype, o.comm = comm, o.stream = stream;
  return issue(o);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  Op o{Kind::reduce_scatter};
  o.send = sendbuff, o.recv = recvbuff, o.count = recvcount, o.type = datatype, o.op = op, o.comm = comm;
  o.stream = stream;
  return issue(o);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  Op o{Kind::broadcast};
  o.send = sendbuff, o.recv = recvbuff, o.count = count, o.type = datatype, o.root = root, o.comm = comm;
  o.stream = stream;
  return issue(o);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  Op o{Kind::reduce};
  o.send = sendbuff, o.recv = recvbuff, o.count = count, o.type = datatype, o.op = op, o.root = root, o.comm = comm;
  o.stream = stream;
  return issue(o);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  Op o{Kind::send};
  o.send = sendbuff, o.count = count, o.type = datatype, o.root = peer, o.comm = comm, o.stream = stream;
  return issue(o);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  Op o{Kind::recv};
  o.recv = recvbuff, o.count = count, o.type = datatype, o.root = peer, o.comm = comm, o.stream = stream;
  return issue(o);
}

}  // extern "C"
