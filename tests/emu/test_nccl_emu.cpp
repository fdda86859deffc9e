// The NCCL stand-in over MPI (tests/emu/nccl_emu.cpp) on the emulated device (tests/emu/cuda_runtime_emu.cpp).
// Run under MPI with an even number of ranks (scripts/mpirun.sh -np 4 test_nccl_emu): every collective
// meshtrain calls, in f32 and bf16 (reductions also f64, i32, i64; movement also u8), out of place and in place,
// each reduction op, each root, over the world and over sub-communicators of 2 ranks whose NCCL ranks run
// opposite to the world's and whose id is made by NCCL rank 1; the grouped patterns of comm/nccl/nccl_group.cpp
// (all_gather_v as broadcasts, reduce_scatter_v as reduces, exchange as sends and receives, sends issued before
// the receives in a ring); and the refusals (host buffers, types and ops not emulated, ranks that disagree on a
// collective, a receive of the wrong size, a stream-order hazard, an aborted communicator), each naming the call
// and the buffer, on every rank without a hang.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/emu/stand_in_test.h"

namespace {

int g_world = 0, g_size = 1;

// ---------------------------------------------------------------- values

size_t esize(ncclDataType_t t) {
  switch (t) {
    case ncclUint8:
      return 1;
    case ncclBfloat16:
      return 2;
    case ncclFloat32:
    case ncclInt32:
      return 4;
    default:
      return 8;
  }
}
bool is_int(ncclDataType_t t) { return t == ncclInt32 || t == ncclInt64 || t == ncclUint8; }

// A T's bytes at b, read or written whole (the buffers' elements need not be aligned for T).
template <typename T> T load(const unsigned char* b) {
  T x;
  std::memcpy(&x, b, sizeof x);
  return x;
}
template <typename T> void store(unsigned char* b, T x) { std::memcpy(b, &x, sizeof x); }

// Element i of a buffer of type t, written from or read as a double.
void put(void* buf, ncclDataType_t t, size_t i, double v) {
  auto* b = static_cast<unsigned char*>(buf) + i * esize(t);
  switch (t) {
    case ncclFloat32: return store(b, float(v));
    case ncclBfloat16: return store(b, to_bf16(float(v)));
    case ncclFloat64: return store(b, v);
    case ncclInt32: return store(b, int32_t(v));
    case ncclInt64: return store(b, int64_t(v));
    case ncclUint8: return store(b, uint8_t(int(v)));
    default: FAIL("type");
  }
}
double get(const void* buf, ncclDataType_t t, size_t i) {
  auto* b = static_cast<const unsigned char*>(buf) + i * esize(t);
  switch (t) {
    case ncclFloat32: return load<float>(b);
    case ncclBfloat16: return from_bf16(load<uint16_t>(b));
    case ncclFloat64: return load<double>(b);
    case ncclInt32: return load<int32_t>(b);
    case ncclInt64: return double(load<int64_t>(b));
    case ncclUint8: return *b;
    default: return NAN;
  }
}

// Rank r's element i: small numbers exact in every type (halves for the float types), negative ones too, so
// that sums, averages over 2 or 4 ranks, maxima and minima are exact whatever the order.
double value(ncclDataType_t t, int r, size_t i, int salt = 0) {
  const double base = double(int((r * 7 + i * 3 + size_t(salt) * 5) % 11) - 5);
  if (t == ncclUint8) return double((r * 31 + i * 7 + size_t(salt)) % 256);
  return is_int(t) ? base * 1000 + double(r) : base + (i % 2 ? 0.5 : 0.0);
}

double reduce_expected(ncclDataType_t t, ncclRedOp_t op, int n, const std::function<double(int)>& v) {
  if (is_int(t)) {
    int64_t acc = int64_t(v(0));
    for (int r = 1; r < n; ++r) {
      const int64_t x = int64_t(v(r));
      acc = op == ncclMax ? std::max(acc, x) : op == ncclMin ? std::min(acc, x) : acc + x;
    }
    return double(op == ncclAvg ? acc / n : acc);
  }
  double acc = v(0);
  for (int r = 1; r < n; ++r) {
    const double x = v(r);
    acc = op == ncclMax ? std::max(acc, x) : op == ncclMin ? std::min(acc, x) : acc + x;
  }
  if (op != ncclAvg) return acc;
  // The sum is exact; the quotient rounds as the type computes it (bf16: in f32, then to bf16).
  if (t == ncclFloat64) return acc / n;
  const float q = float(acc) / float(n);
  return t == ncclBfloat16 ? double(from_bf16(to_bf16(q))) : double(q);
}

const char* tname(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return "f32";
    case ncclBfloat16:
      return "bf16";
    case ncclFloat64:
      return "f64";
    case ncclInt32:
      return "i32";
    case ncclInt64:
      return "i64";
    case ncclUint8:
      return "u8";
    default:
      return "?";
  }
}
const char* oname(ncclRedOp_t o) {
  return o == ncclSum ? "sum" : o == ncclAvg ? "avg" : o == ncclMax ? "max" : o == ncclMin ? "min" : "?";
}

// ---------------------------------------------------------------- communicators

struct Comm {
  ncclComm_t nccl = nullptr;
  int rank = 0, size = 0;
  std::vector<int> world_of;  // world rank of each NCCL rank
  std::string name;
};

// The id made by NCCL rank `maker`, sent over `mpi` (whose ranks are the NCCL ranks), then ncclCommInitRank.
Comm make_comm(MPI_Comm mpi, int maker, const char* name) {
  Comm c;
  c.name = name;
  MPI_Comm_rank(mpi, &c.rank);
  MPI_Comm_size(mpi, &c.size);
  ncclUniqueId id{};
  // Made outside any test too (the shared communicators): a failure ends the job rather than a doctest check.
  if (c.rank == maker && ncclGetUniqueId(&id) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 2);
  MPI_Bcast(&id, int(sizeof id), MPI_BYTE, maker, mpi);
  if (ncclCommInitRank(&c.nccl, c.size, id, c.rank) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 2);
  c.world_of.resize(size_t(c.size));
  MPI_Allgather(&g_world, 1, MPI_INT, c.world_of.data(), 1, MPI_INT, mpi);
  return c;
}

// The world (NCCL rank = world rank, id by rank 0) and this rank's pair: world ranks {2p, 2p+1}, NCCL ranks in
// the opposite order (2p+1 is rank 0), the id made by NCCL rank 1.
struct Comms {
  Comm world, pair;
  MPI_Comm pair_mpi = MPI_COMM_NULL;
  Comms() {
    world = make_comm(MPI_COMM_WORLD, 0, "world");
    MPI_Comm_split(MPI_COMM_WORLD, g_world / 2, -g_world, &pair_mpi);
    pair = make_comm(pair_mpi, 1, "pair");
  }
  ~Comms() {
    if (ncclCommDestroy(pair.nccl) != ncclSuccess || ncclCommDestroy(world.nccl) != ncclSuccess)
      MPI_Abort(MPI_COMM_WORLD, 2);
    MPI_Comm_free(&pair_mpi);
  }
};
Comms* g_comms = nullptr;

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~Stream() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

const ncclDataType_t kReduceTypes[] = {ncclFloat32, ncclBfloat16, ncclFloat64, ncclInt32, ncclInt64};
const ncclDataType_t kMoveTypes[] = {ncclFloat32, ncclBfloat16, ncclFloat64, ncclInt32, ncclInt64, ncclUint8};
const ncclRedOp_t kOps[] = {ncclSum, ncclAvg, ncclMax, ncclMin};

}  // namespace

// ---------------------------------------------------------------- collectives

TEST_CASE("communicators: ranks as given, over the world and over pairs made by NCCL rank 1") {
  REQUIRE(g_size % 2 == 0);
  const Comm& w = g_comms->world;
  const Comm& p = g_comms->pair;
  CHECK(w.rank == g_world);
  CHECK(w.size == g_size);
  CHECK(p.size == 2);
  CHECK(p.rank == 1 - g_world % 2);
  CHECK(p.world_of[0] == (g_world | 1));
  // A sum over the pair shows the two members are the two world ranks of the pair, nobody else.
  Stream s;
  Dev buf(4);
  int32_t mine = 1 << g_world;
  std::memcpy(buf.p, &mine, 4);
  REQUIRE(ncclAllReduce(buf.p, buf.p, 1, ncclInt32, ncclSum, p.nccl, s.s) == ncclSuccess);
  int32_t got;
  std::memcpy(&got, buf.p, 4);
  CHECK(got == (3 << (g_world & ~1)));
}

TEST_CASE("a communicator of one rank (meshtrain makes them for dims of size 1)") {
  Stream s;
  Comm one = make_comm(MPI_COMM_SELF, 0, "self");
  CHECK(one.size == 1);
  Dev a(8 * 4), b(8 * 4);
  for (size_t i = 0; i < 8; ++i) put(a.p, ncclFloat32, i, double(i) + 0.5);
  REQUIRE(ncclAllReduce(a.p, b.p, 8, ncclFloat32, ncclAvg, one.nccl, s.s) == ncclSuccess);
  for (size_t i = 0; i < 8; ++i) CHECK(get(b.p, ncclFloat32, i) == double(i) + 0.5);
  REQUIRE(ncclAllGather(a.p, b.p, 8, ncclFloat32, one.nccl, s.s) == ncclSuccess);
  REQUIRE(ncclReduceScatter(a.p, b.p, 8, ncclFloat32, ncclMax, one.nccl, s.s) == ncclSuccess);
  REQUIRE(ncclBroadcast(a.p, b.p, 8, ncclFloat32, 0, one.nccl, s.s) == ncclSuccess);
  for (size_t i = 0; i < 8; ++i) CHECK(get(b.p, ncclFloat32, i) == double(i) + 0.5);
  REQUIRE(ncclCommDestroy(one.nccl) == ncclSuccess);
}

TEST_CASE("all_reduce: every type and op, out of place and in place, world and pair") {
  Stream s;
  const size_t n = 37;
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : kReduceTypes)
      for (ncclRedOp_t op : kOps)
        for (bool in_place : {false, true}) {
          INFO(c->name, " ", tname(t), " ", oname(op), in_place ? " in place" : " out of place");
          Dev send(n * esize(t)), recv(n * esize(t));
          for (size_t i = 0; i < n; ++i) put(send.p, t, i, value(t, c->rank, i));
          void* out = in_place ? send.p : recv.p;
          REQUIRE(ncclAllReduce(send.p, out, n, t, op, c->nccl, s.s) == ncclSuccess);
          REQUIRE(cudaStreamSynchronize(s.s) == cudaSuccess);
          for (size_t i = 0; i < n; ++i) {
            const double want = reduce_expected(t, op, c->size, [&](int r) { return value(t, r, i); });
            CHECK_MESSAGE(get(out, t, i) == want, "element ", i);
          }
        }
}

TEST_CASE("a NaN on one rank is the result of every op (max and min included)") {
  Stream s;
  const Comm& c = g_comms->world;
  for (ncclDataType_t t : {ncclFloat32, ncclBfloat16, ncclFloat64})
    for (ncclRedOp_t op : kOps) {
      INFO(tname(t), " ", oname(op));
      Dev buf(2 * esize(t));
      put(buf.p, t, 0, c.rank == 1 ? NAN : double(c.rank));
      put(buf.p, t, 1, double(c.rank));
      REQUIRE(ncclAllReduce(buf.p, buf.p, 2, t, op, c.nccl, s.s) == ncclSuccess);
      CHECK(std::isnan(get(buf.p, t, 0)));
      CHECK(!std::isnan(get(buf.p, t, 1)));
    }
}

TEST_CASE("bf16 reductions accumulate in f32 and round once") {
  // Rank r adds 1 + r 2^-8: the f32 sum over 4 ranks is 4 + 6 2^-8, which rounds to 4 + 2^-5 in bf16; rounding
  // each partial sum to bf16 would give 4. (Over 2 ranks: 2 + 2^-8, a tie that rounds to even, 2.)
  Stream s;
  for (const Comm* c : {&g_comms->world, &g_comms->pair}) {
    Dev buf(2);
    const uint16_t mine = to_bf16(1.0f + float(c->rank) * std::ldexp(1.0f, -8));
    std::memcpy(buf.p, &mine, 2);
    REQUIRE(ncclAllReduce(buf.p, buf.p, 1, ncclBfloat16, ncclSum, c->nccl, s.s) == ncclSuccess);
    float f32_sum = 0;
    for (int r = 0; r < c->size; ++r) f32_sum += from_bf16(to_bf16(1.0f + float(r) * std::ldexp(1.0f, -8)));
    CHECK(get(buf.p, ncclBfloat16, 0) == from_bf16(to_bf16(f32_sum)));
    if (c->size == 4) CHECK(get(buf.p, ncclBfloat16, 0) == 4 + std::ldexp(1.0, -5));
  }
}

TEST_CASE("reduce_scatter: every type and op, out of place and in place") {
  Stream s;
  const size_t n = 13;  // per rank
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : kReduceTypes)
      for (ncclRedOp_t op : kOps)
        for (bool in_place : {false, true}) {
          INFO(c->name, " ", tname(t), " ", oname(op), in_place ? " in place" : " out of place");
          const size_t es = esize(t), total = n * size_t(c->size);
          Dev send(total * es), recv(n * es);
          for (size_t i = 0; i < total; ++i) put(send.p, t, i, value(t, c->rank, i));
          void* out = in_place ? send.at(size_t(c->rank) * n * es) : recv.p;
          REQUIRE(ncclReduceScatter(send.p, out, n, t, op, c->nccl, s.s) == ncclSuccess);
          for (size_t i = 0; i < n; ++i) {
            const size_t g = size_t(c->rank) * n + i;
            const double want = reduce_expected(t, op, c->size, [&](int r) { return value(t, r, g); });
            CHECK_MESSAGE(get(out, t, i) == want, "element ", i);
          }
        }
}

TEST_CASE("all_gather: every type, out of place and in place") {
  Stream s;
  const size_t n = 11;
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : kMoveTypes)
      for (bool in_place : {false, true}) {
        INFO(c->name, " ", tname(t), in_place ? " in place" : " out of place");
        const size_t es = esize(t);
        Dev send(n * es), recv(n * size_t(c->size) * es);
        const void* in = in_place ? recv.at(size_t(c->rank) * n * es) : send.p;
        for (size_t i = 0; i < n; ++i) put(const_cast<void*>(in), t, i, value(t, c->rank, i));
        REQUIRE(ncclAllGather(in, recv.p, n, t, c->nccl, s.s) == ncclSuccess);
        for (int r = 0; r < c->size; ++r)
          for (size_t i = 0; i < n; ++i)
            CHECK_MESSAGE(get(recv.p, t, size_t(r) * n + i) == value(t, r, i), "rank ", r, " element ", i);
      }
}

TEST_CASE("broadcast: every root, the non-roots' sendbuff null (as nccl_group.cpp passes), and in place") {
  Stream s;
  const size_t n = 9;
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : {ncclFloat32, ncclBfloat16, ncclUint8, ncclInt64})
      for (int root = 0; root < c->size; ++root)
        for (bool in_place : {false, true}) {
          INFO(c->name, " ", tname(t), " root ", root, in_place ? " in place" : " out of place");
          const size_t es = esize(t);
          Dev send(n * es), recv(n * es);
          for (size_t i = 0; i < n; ++i) put(in_place ? recv.p : send.p, t, i, value(t, c->rank, i, root));
          const void* sb = c->rank != root ? nullptr : in_place ? recv.p : send.p;
          REQUIRE(ncclBroadcast(sb, recv.p, n, t, root, c->nccl, s.s) == ncclSuccess);
          for (size_t i = 0; i < n; ++i) CHECK(get(recv.p, t, i) == value(t, root, i, root));
        }
}

TEST_CASE("reduce: every root and op, the non-roots' recvbuff null, in place at the root") {
  Stream s;
  const size_t n = 7;
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : {ncclFloat32, ncclBfloat16, ncclInt32})
      for (ncclRedOp_t op : kOps)
        for (int root = 0; root < c->size; ++root)
          for (bool in_place : {false, true}) {
            INFO(c->name, " ", tname(t), " ", oname(op), " root ", root, in_place ? " in place" : "");
            const size_t es = esize(t);
            Dev send(n * es), recv(n * es);
            for (size_t i = 0; i < n; ++i) put(send.p, t, i, value(t, c->rank, i));
            void* rb = c->rank != root ? nullptr : in_place ? send.p : recv.p;
            REQUIRE(ncclReduce(send.p, rb, n, t, op, root, c->nccl, s.s) == ncclSuccess);
            if (c->rank == root)
              for (size_t i = 0; i < n; ++i)
                CHECK(get(rb, t, i) == reduce_expected(t, op, c->size, [&](int r) { return value(t, r, i); }));
          }
}

// nccl_group.cpp's all_gather_v: one broadcast per rank with a count, into consecutive slices, in a group.
TEST_CASE("grouped broadcasts (all_gather_v) and grouped reduces (reduce_scatter_v)") {
  Stream s;
  for (const Comm* c : {&g_comms->world, &g_comms->pair}) {
    std::vector<size_t> counts;
    size_t total = 0;
    for (int r = 0; r < c->size; ++r) counts.push_back(size_t(r % 3 == 1 ? 0 : 3 + 2 * r)), total += counts.back();
    const ncclDataType_t t = ncclBfloat16;
    const size_t es = esize(t);
    Dev in(std::max<size_t>(1, counts[size_t(c->rank)]) * es), out(total * es);
    for (size_t i = 0; i < counts[size_t(c->rank)]; ++i) put(in.p, t, i, value(t, c->rank, i));
    REQUIRE(ncclGroupStart() == ncclSuccess);
    size_t off = 0;
    for (int r = 0; r < c->size; ++r) {
      if (counts[size_t(r)] > 0)
        REQUIRE(ncclBroadcast(r == c->rank ? in.p : nullptr, out.at(off * es), counts[size_t(r)], t, r, c->nccl,
                              s.s) == ncclSuccess);
      off += counts[size_t(r)];
    }
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    off = 0;
    for (int r = 0; r < c->size; ++r) {
      for (size_t i = 0; i < counts[size_t(r)]; ++i) CHECK(get(out.p, t, off + i) == value(t, r, i));
      off += counts[size_t(r)];
    }
    // reduce_scatter_v: every rank's full input, slice r reduced to rank r.
    Dev full(total * 4), mine(std::max<size_t>(1, counts[size_t(c->rank)]) * 4);
    for (size_t i = 0; i < total; ++i) put(full.p, ncclFloat32, i, value(ncclFloat32, c->rank, i));
    REQUIRE(ncclGroupStart() == ncclSuccess);
    off = 0;
    for (int r = 0; r < c->size; ++r) {
      if (counts[size_t(r)] > 0)
        REQUIRE(ncclReduce(full.at(off * 4), r == c->rank ? mine.p : nullptr, counts[size_t(r)], ncclFloat32, ncclSum,
                           r, c->nccl, s.s) == ncclSuccess);
      off += counts[size_t(r)];
    }
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    off = 0;
    for (int r = 0; r < c->rank; ++r) off += counts[size_t(r)];
    for (size_t i = 0; i < counts[size_t(c->rank)]; ++i)
      CHECK(get(mine.p, ncclFloat32, i) ==
            reduce_expected(ncclFloat32, ncclSum, c->size, [&](int r) { return value(ncclFloat32, r, off + i); }));
  }
}

// ---------------------------------------------------------------- point to point

TEST_CASE("send/recv in a group: a ring with every send issued before its receive, and an all-to-all") {
  Stream s;
  for (const Comm* c : {&g_comms->world, &g_comms->pair})
    for (ncclDataType_t t : {ncclFloat32, ncclBfloat16, ncclUint8}) {
      INFO(c->name, " ", tname(t));
      const size_t n = 1000, es = esize(t);  // large enough that a blocking synchronous send could not complete
      const int to = (c->rank + 1) % c->size, from = (c->rank + c->size - 1) % c->size;
      Dev a(n * es), b(n * es);
      for (size_t i = 0; i < n; ++i) put(a.p, t, i, value(t, c->rank, i));
      REQUIRE(ncclGroupStart() == ncclSuccess);
      REQUIRE(ncclSend(a.p, n, t, to, c->nccl, s.s) == ncclSuccess);
      REQUIRE(ncclRecv(b.p, n, t, from, c->nccl, s.s) == ncclSuccess);
      REQUIRE(ncclGroupEnd() == ncclSuccess);
      for (size_t i = 0; i < n; ++i) CHECK(get(b.p, t, i) == value(t, from, i));

      // nccl_group.cpp's exchange: block j of `in` to rank j, block j of `out` from rank j; its own by a copy.
      const size_t blk = 5;
      Dev in(blk * size_t(c->size) * es), out(blk * size_t(c->size) * es);
      for (size_t i = 0; i < blk * size_t(c->size); ++i) put(in.p, t, i, value(t, c->rank, i));
      REQUIRE(cudaMemcpyAsync(out.at(size_t(c->rank) * blk * es), in.at(size_t(c->rank) * blk * es), blk * es,
                              cudaMemcpyDeviceToDevice, s.s) == cudaSuccess);
      REQUIRE(ncclGroupStart() == ncclSuccess);
      for (int j = 0; j < c->size; ++j) {
        if (j == c->rank) continue;
        REQUIRE(ncclSend(in.at(size_t(j) * blk * es), blk, t, j, c->nccl, s.s) == ncclSuccess);
        REQUIRE(ncclRecv(out.at(size_t(j) * blk * es), blk, t, j, c->nccl, s.s) == ncclSuccess);
      }
      REQUIRE(ncclGroupEnd() == ncclSuccess);
      for (int j = 0; j < c->size; ++j)
        for (size_t i = 0; i < blk; ++i)
          CHECK(get(out.p, t, size_t(j) * blk + i) == value(t, j, size_t(c->rank) * blk + i));
    }
}

TEST_CASE("send and recv outside a group (nccl_group.cpp's send/recv), several to one peer kept in order") {
  Stream s;
  const Comm& c = g_comms->pair;
  Dev a(64 * 4), b(64 * 4);
  for (int k = 0; k < 3; ++k) {
    if (c.rank == 0) {
      for (size_t i = 0; i < 64; ++i) put(a.p, ncclFloat32, i, value(ncclFloat32, 0, i, k));
      REQUIRE(ncclSend(a.p, 64, ncclFloat32, 1, c.nccl, s.s) == ncclSuccess);
    } else {
      REQUIRE(ncclRecv(b.p, 64, ncclFloat32, 0, c.nccl, s.s) == ncclSuccess);
      for (size_t i = 0; i < 64; ++i) CHECK(get(b.p, ncclFloat32, i) == value(ncclFloat32, 0, i, k));
    }
  }
  // Nested groups: two sends to the same peer in one group arrive in issue order.
  REQUIRE(ncclGroupStart() == ncclSuccess);
  REQUIRE(ncclGroupStart() == ncclSuccess);
  if (c.rank == 0) {
    for (size_t i = 0; i < 64; ++i) put(a.p, ncclFloat32, i, double(i));
    REQUIRE(ncclSend(a.p, 32, ncclFloat32, 1, c.nccl, s.s) == ncclSuccess);
    REQUIRE(ncclSend(a.at(32 * 4), 32, ncclFloat32, 1, c.nccl, s.s) == ncclSuccess);
  } else {
    REQUIRE(ncclRecv(b.p, 32, ncclFloat32, 0, c.nccl, s.s) == ncclSuccess);
    REQUIRE(ncclRecv(b.at(32 * 4), 32, ncclFloat32, 0, c.nccl, s.s) == ncclSuccess);
  }
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  if (c.rank == 1) CHECK(get(b.p, ncclFloat32, 0) == value(ncclFloat32, 0, 0, 2));  // not yet: the outer group is open
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  if (c.rank == 1)
    for (size_t i = 0; i < 64; ++i) CHECK(get(b.p, ncclFloat32, i) == double(i));
}

// ---------------------------------------------------------------- refusals

// Every rank: the call returns `want`, a report is made naming the call and each word, and ncclGetLastError
// names the call.
#define EXPECT_REFUSED(expr, want, call, ...)                                      \
  do {                                                                             \
    EXPECT_REPORTED(expr, want, call, __VA_ARGS__);                                \
    CHECK(std::string(ncclGetLastError(nullptr)).find(call) != std::string::npos); \
  } while (0)

TEST_CASE("host buffers are refused, naming the call and the buffer") {
  Stream s;
  const Comm& c = g_comms->world;
  std::vector<float> host(64 * size_t(c.size));
  Dev dev(64 * 4 * size_t(c.size));
  EXPECT_REFUSED(ncclAllReduce(host.data(), dev.p, 64, ncclFloat32, ncclSum, c.nccl, s.s), ncclInvalidArgument,
                 "ncclAllReduce", "sendbuff", "not device memory");
  EXPECT_REFUSED(ncclAllReduce(dev.p, host.data(), 64, ncclFloat32, ncclSum, c.nccl, s.s), ncclInvalidArgument,
                 "ncclAllReduce", "recvbuff");
  EXPECT_REFUSED(ncclAllGather(dev.p, host.data(), 64, ncclFloat32, c.nccl, s.s), ncclInvalidArgument, "ncclAllGather",
                 "recvbuff");
  EXPECT_REFUSED(ncclReduceScatter(host.data(), dev.p, 64, ncclFloat32, ncclSum, c.nccl, s.s), ncclInvalidArgument,
                 "ncclReduceScatter", "sendbuff");
  EXPECT_REFUSED(ncclBroadcast(dev.p, host.data(), 64, ncclFloat32, 0, c.nccl, s.s), ncclInvalidArgument,
                 "ncclBroadcast", "recvbuff");
  EXPECT_REFUSED(ncclSend(host.data(), 4, ncclFloat32, (c.rank + 1) % c.size, c.nccl, s.s), ncclInvalidArgument,
                 "ncclSend", "sendbuff");
  EXPECT_REFUSED(ncclRecv(host.data(), 4, ncclFloat32, (c.rank + 1) % c.size, c.nccl, s.s), ncclInvalidArgument,
                 "ncclRecv", "recvbuff");
  // Past the end of an allocation: the all-gather's output is one rank short.
  Dev small(64 * 4 * size_t(c.size - 1));
  EXPECT_REFUSED(ncclAllGather(dev.p, small.p, 64, ncclFloat32, c.nccl, s.s), ncclInvalidArgument, "ncclAllGather",
                 "recvbuff", "runs past its allocation");
  // An overlap that is not the documented in-place form.
  EXPECT_REFUSED(ncclAllReduce(dev.p, dev.at(4), 64, ncclFloat32, ncclSum, c.nccl, s.s), ncclInvalidArgument,
                 "ncclAllReduce", "overlap");
}

TEST_CASE("types, ops, roots and communicators not emulated are refused") {
  Stream s;
  const Comm& c = g_comms->world;
  Dev d(256);
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 4, ncclFloat16, ncclSum, c.nccl, s.s), ncclInvalidArgument, "ncclAllReduce",
                 "ncclFloat16");
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 4, ncclUint8, ncclSum, c.nccl, s.s), ncclInvalidArgument, "ncclAllReduce",
                 "ncclUint8");
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 4, ncclFloat32, ncclProd, c.nccl, s.s), ncclInvalidArgument, "ncclAllReduce",
                 "ncclProd");
  EXPECT_REFUSED(ncclBroadcast(d.p, d.p, 4, ncclFloat32, c.size, c.nccl, s.s), ncclInvalidArgument, "ncclBroadcast",
                 "root");
  EXPECT_REFUSED(ncclSend(d.p, 4, ncclFloat32, -1, c.nccl, s.s), ncclInvalidArgument, "ncclSend", "peer");
  int junk = 0;
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 4, ncclFloat32, ncclSum, reinterpret_cast<ncclComm_t>(&junk), s.s),
                 ncclInvalidArgument, "ncclAllReduce", "not live");
  cudaStream_t dead = nullptr;
  REQUIRE(cudaStreamCreate(&dead) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(dead) == cudaSuccess);
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 4, ncclFloat32, ncclSum, c.nccl, dead), ncclInvalidArgument, "ncclAllReduce",
                 "stream");
  EXPECT_REFUSED(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd", "no ncclGroupStart");
  ncclUniqueId bogus{};
  ncclComm_t nc = nullptr;
  EXPECT_REFUSED(ncclCommInitRank(&nc, 2, bogus, 0), ncclInvalidArgument, "ncclCommInitRank", "ncclGetUniqueId");
  CHECK(std::string(ncclGetErrorString(ncclInvalidUsage)) == "invalid usage");
}

TEST_CASE("ranks that disagree on a collective are told so on every rank (the real library would hang)") {
  Stream s;
  const Comm& c = g_comms->world;
  Dev d(64 * 4);
  const size_t n = c.rank == 0 ? 5 : 6;
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, n, ncclFloat32, ncclSum, c.nccl, s.s), ncclInvalidUsage, "ncclAllReduce",
                 "disagree");
  // Another op on rank 1 than on the others.
  EXPECT_REFUSED(c.rank == 1 ? ncclAllReduce(d.p, d.p, 4, ncclFloat32, ncclMax, c.nccl, s.s)
                             : ncclAllReduce(d.p, d.p, 4, ncclFloat32, ncclSum, c.nccl, s.s),
                 ncclInvalidUsage, "ncclAllReduce", "disagree");
  // The communicator still works after.
  put(d.p, ncclFloat32, 0, 1.0);
  REQUIRE(ncclAllReduce(d.p, d.p, 1, ncclFloat32, ncclSum, c.nccl, s.s) == ncclSuccess);
  CHECK(get(d.p, ncclFloat32, 0) == double(c.size));
}

TEST_CASE("a receive larger or smaller than the matching send is reported by the receiver") {
  Stream s;
  const Comm& c = g_comms->pair;
  Dev d(64 * 4);
  if (c.rank == 0) {
    REQUIRE(ncclSend(d.p, 4, ncclFloat32, 1, c.nccl, s.s) == ncclSuccess);
  } else {
    EXPECT_REFUSED(ncclRecv(d.p, 5, ncclFloat32, 0, c.nccl, s.s), ncclInvalidUsage, "ncclRecv", "received 16 bytes",
                   "expected 20");
  }
  // And smaller.
  if (c.rank == 0) {
    REQUIRE(ncclSend(d.p, 6, ncclFloat32, 1, c.nccl, s.s) == ncclSuccess);
  } else {
    EXPECT_REFUSED(ncclRecv(d.p, 5, ncclFloat32, 0, c.nccl, s.s), ncclInvalidUsage, "ncclRecv", "sent more than",
                   "20 bytes");
  }
}

TEST_CASE("stream order: a collective reading what another stream wrote without an event is a hazard") {
  Stream s1, s2;
  const Comm& c = g_comms->world;
  Dev d(64 * 4);
  REQUIRE(cudaMemsetAsync(d.p, 0, 64 * 4, s1.s) == cudaSuccess);
  // Every rank makes the same mistake, so the collective still runs everywhere (and is reported everywhere).
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 64, ncclFloat32, ncclSum, c.nccl, s2.s), ncclInvalidUsage, "ncclAllReduce",
                 "hazard");
  // Ordered by an event: accepted.
  cudaEvent_t e;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(d.p, 0, 64 * 4, s1.s) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, s1.s) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s2.s, e, 0) == cudaSuccess);
  const long long before = emu::reports();
  REQUIRE(ncclAllReduce(d.p, d.p, 64, ncclFloat32, ncclSum, c.nccl, s2.s) == ncclSuccess);
  CHECK(emu::reports() == before);
  cudaEventDestroy(e);
}

TEST_CASE("an aborted communicator refuses every call; a destroyed one is not live") {
  Stream s;
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  Comm c = make_comm(dup, g_size - 1, "extra");  // the id made by the last rank
  Dev d(16);
  put(d.p, ncclInt64, 0, 1);
  REQUIRE(ncclAllReduce(d.p, d.p, 1, ncclInt64, ncclSum, c.nccl, s.s) == ncclSuccess);
  CHECK(get(d.p, ncclInt64, 0) == g_size);
  REQUIRE(ncclCommAbort(c.nccl) == ncclSuccess);
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 1, ncclInt64, ncclSum, c.nccl, s.s), ncclInvalidUsage, "ncclAllReduce",
                 "aborted");
  Comm c2 = make_comm(dup, 0, "extra2");
  REQUIRE(ncclCommDestroy(c2.nccl) == ncclSuccess);
  EXPECT_REFUSED(ncclAllReduce(d.p, d.p, 1, ncclInt64, ncclSum, c2.nccl, s.s), ncclInvalidArgument, "ncclAllReduce",
                 "not live");
  MPI_Comm_free(&dup);
}

TEST_CASE("count 0 is a local no-op (no buffers needed)") {
  Stream s;
  const Comm& c = g_comms->world;
  const long long before = emu::reports();
  if (c.rank == 0) CHECK(ncclAllReduce(nullptr, nullptr, 0, ncclFloat32, ncclSum, c.nccl, s.s) == ncclSuccess);
  CHECK(ncclSend(nullptr, 0, ncclFloat32, (c.rank + 1) % c.size, c.nccl, s.s) == ncclSuccess);
  CHECK(emu::reports() == before);
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int rc = 1;
  if (g_size % 2 != 0) {
    if (g_world == 0) std::fprintf(stderr, "test_nccl_emu: run with an even number of ranks (mpirun -np 4)\n");
  } else {
    g_comms = new Comms;
    doctest::Context ctx(argc, argv);
    if (g_world != 0) ctx.setOption("minimal", true), ctx.setOption("no-colors", true);  // rank 0 prints the summary; the others only failures
    rc = ctx.run();
    delete g_comms;
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_world == 0 && worst != rc) std::fprintf(stderr, "test_nccl_emu: another rank failed\n");
  MPI_Finalize();
  return worst;
}
