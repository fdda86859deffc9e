// Ring attention (attention/ring_attention.h) over a cp group against local
// attention over the whole sequence on one rank: every rank builds the same
// full q, k, v and dout, keeps its shard, runs the ring forward and backward,
// and compares its out, lse, dq, dk and dv with the matching rows of the
// single-rank result. Both methods (ring, all_gather), both load balances
// (none, head_tail), causal and full, grouped-query, f64 and f32, packed
// documents off and on; on the whole world as the cp group and on the cp dim of
// a dp_replicate x cp mesh (each dp replica with its own data); and the bytes
// the runtime counts for the cp traffic.
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../check_error.h"
#include "cp_cases.h"
#include "attention/ring_attention.h"
#include "comm/mesh.h"
#include "mpi_world.h"
#include "../test_util.h"
#include "parallel/dtensor.h"
#include "runtime/kernels/ops.h"
#include "../skip.h"

using namespace mt;

namespace {

const int64_t B = 2, H = 4, KV = 2, hd = 8;  // GQA: two q heads per kv head
const int32_t kSeparator = 0;

Tensor randn_full(const Shape& s, uint64_t seed) { return test::randn(s, seed); }

Tensor cast(const Tensor& t, DType dt) { return from_values(to_f64(t), t.shape(), dt); }

using test::rel_err;  // norm-wise relative error (tests/test_util.h)

using test::document_tokens;
using test::lse_err;
using test::shard_lse;

using Reference = test::CpReference;
Reference reference(int64_t T, bool causal, double scale, bool docs, int64_t chunk, uint64_t seed) {
  Tensor doc_start = docs ? document_starts(document_tokens(T, chunk, kSeparator, uint64_t(T)), kSeparator) : Tensor();
  return test::cp_reference(B, T, H, KV, hd, causal, scale, doc_start, seed);
}

struct Result {
  Tensor out, lse, dq, dk, dv;
};

// Leaves freed host memory full of NaN (all bits set) in blocks of the sizes a ring implementation's
// buffers are likely to have (half, once and twice the local q, k and lse, in the activation and the
// accum dtype), so that a buffer taken from empty() and used before it is written shows up as NaN
// instead of depending on what the heap happened to hold.
void poison_freed_memory(int64_t q_numel, int64_t k_numel, int64_t lse_numel, DType dt) {
  std::vector<Tensor> hold;
  for (int64_t x : {q_numel, k_numel, lse_numel})
    for (int64_t mult2 : {1, 2, 4})  // x * mult2 / 2
      for (size_t es : {dtype_size(dt), dtype_size(accum_dtype(dt))})
        for (int copy = 0; copy < 4; ++copy) {
          Tensor u = empty({(x * mult2 / 2) * int64_t(es) / 2}, DType::u16);  // bytes / 2 u16 elements
          std::memset(u.data_ptr(), 0xff, u.nbytes());
          hold.push_back(u);
        }
}
// This rank's shard of ref's inputs through ring attention forward and backward in dtype dt.
Result run_ring(const Reference& ref, Group* group, CpMethod method, CpLoadBalance lb, bool causal, double scale,
                DType dt) {
  const int64_t T = ref.q.size(1);
  const int n = group ? group->size() : 1, rank = group ? group->rank() : 0;
  const SequenceShard sh = sequence_shard(lb, T, n, rank);
  RingAttentionOptions o;
  o.causal = causal, o.scale = scale, o.group = group, o.method = method, o.load_balance = lb, o.seq_len = T;
  if (ref.doc_start.defined()) o.doc_start = shard_sequence(ref.doc_start, sh);
  Tensor q = shard_sequence(cast(ref.q, dt), sh), k = shard_sequence(cast(ref.k, dt), sh);
  Tensor v = shard_sequence(cast(ref.v, dt), sh), dout = shard_sequence(cast(ref.dout, dt), sh);
  const int64_t Tl = sh.size();
  Result r;
  r.out = empty({B, Tl, H, hd}, dt), r.lse = empty({B, H, Tl}, accum_dtype(dt));
  std::memset(r.out.data_ptr(), 0xff, r.out.nbytes());  // NaN: the forward writes every element
  std::memset(r.lse.data_ptr(), 0xff, r.lse.nbytes());
  poison_freed_memory(q.numel(), k.numel(), B * H * Tl, dt);
  ring_attention_forward(r.out, r.lse, q, k, v, o);
  // Garbage in the gradients beforehand: the backward overwrites them.
  r.dq = cast(randn_full(q.shape(), 77), dt), r.dk = cast(randn_full(k.shape(), 78), dt);
  r.dv = cast(randn_full(v.shape(), 79), dt);
  poison_freed_memory(q.numel(), k.numel(), B * H * Tl, dt);
  ring_attention_backward(r.dq, r.dk, r.dv, dout, q, k, v, r.out, r.lse, o);
  return r;
}

// Compares this rank's ring results with the reference's rows for its shard.
void check_against(const Result& got, const Reference& ref, const SequenceShard& sh, DType dt) {
  const double tol = dt == DType::f64 ? 1e-10 : 1e-5;
  REQUIRE(got.out.dtype() == dt);
  REQUIRE(got.lse.dtype() == accum_dtype(dt));
  double e_out = rel_err(got.out, shard_sequence(ref.out, sh));
  int64_t bad_inf = 0;
  double e_lse = lse_err(got.lse, shard_lse(ref.lse, sh), bad_inf);
  double e_dq = rel_err(got.dq, shard_sequence(ref.dq, sh));
  double e_dk = rel_err(got.dk, shard_sequence(ref.dk, sh));
  double e_dv = rel_err(got.dv, shard_sequence(ref.dv, sh));
  INFO("relative errors: out ", e_out, ", lse ", e_lse, ", dq ", e_dq, ", dk ", e_dk, ", dv ", e_dv,
       "; lse -inf mismatches ", bad_inf);
  CHECK(e_out < tol);
  CHECK(e_lse < tol);
  CHECK(bad_inf == 0);
  CHECK(e_dq < tol);
  CHECK(e_dk < tol);
  CHECK(e_dv < tol);
}

// The whole grid on one cp group: methods x load balances x causal/full x documents off/on x f64/f32, for
// T = 2 n k with each k of ks; without full_grid only causal with documents in f64 and full without
// documents in f32 (for the larger sizes). seed_offset differs between groups that must not mix their data.
void ring_grid(Group& group, const std::vector<int64_t>& ks, uint64_t seed_offset, bool full_grid) {
  const int n = group.size();
  uint64_t seed = 100 + seed_offset;
  for (int64_t k : ks)
    for (bool causal : {true, false})
      for (bool docs : {false, true}) {
        const int64_t T = 2 * int64_t(n) * k;
        const double scale = causal ? 0 : 0.3;  // the default 1/sqrt(hd), and a custom one
        seed += 10;
        if (!full_grid && !(causal && docs) && !(!causal && !docs)) continue;
        Reference ref = reference(T, causal, scale, docs, k, seed);
        for (CpMethod method : {CpMethod::ring, CpMethod::all_gather})
          for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail})
            for (DType dt : {DType::f64, DType::f32}) {
              if (!full_grid && (dt == DType::f64) != causal) continue;
              const std::string what =
                  "cp " + std::to_string(n) + " (" + group.name() + ", rank " + std::to_string(group.rank()) + "), T " +
                  std::to_string(T) + ", " + cp_method_name(method) + ", " + cp_load_balance_name(lb) +
                  (causal ? ", causal" : ", full") + (docs ? ", documents" : "") + ", " + std::string(dtype_name(dt));
              INFO(what);
              Result got = run_ring(ref, &group, method, lb, causal, scale, dt);
              check_against(got, ref, sequence_shard(lb, T, n, group.rank()), dt);
            }
      }
}

}  // namespace

TEST_CASE("ring attention: the whole world as the cp group, against attention over the whole sequence") {
  ThreadsPerRank threads;
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"cp", n}});
  Group& cp = mesh.group(mesh.dim_index("cp"));
  REQUIRE(cp.size() == n);
  // Chunks of 3 tokens (head_tail) and 6 (none): every grid case; chunks of 40 and 80 (more than a 64-row
  // block of the local kernel): causal with documents in f64, full without documents in f32.
  ring_grid(cp, {3}, 0, true);
  ring_grid(cp, {40}, 1000, false);
}

TEST_CASE("ring attention: the cp dim of a dp_replicate x cp mesh, each replica with its own data") {
  ThreadsPerRank threads;
  const int n = world_size();
  if (n < 4 || n % 2) MT_SKIP("needs an even number of ranks >= 4");
  DeviceMesh mesh = DeviceMesh::create({{"dp_replicate", 2}, {"cp", n / 2}});
  Group& cp = mesh.group("cp");
  REQUIRE(cp.size() == n / 2);
  // Different data on the two replicas: a ring over the wrong ranks would mix them.
  ring_grid(cp, {3}, uint64_t(mesh.coordinate(0)) * 5000, true);
  // The bytes counted are those of the cp sub-group (N = n / 2), under its name.
  const int64_t N = n / 2, T = 2 * N * 3;
  Reference ref = reference(T, true, 0, false, 3, 800);
  const SequenceShard sh = sequence_shard(CpLoadBalance::head_tail, T, int(N), cp.rank());
  RingAttentionOptions o;
  o.group = &cp, o.seq_len = T;
  Tensor q = shard_sequence(ref.q, sh), k = shard_sequence(ref.k, sh), v = shard_sequence(ref.v, sh);
  Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, sh.size()}, DType::f64);
  reset_comm_counters();
  ring_attention_forward(out, lse, q, k, v, o);
  CommCounters c = comm_counters();
  CHECK(c.bytes("", "cp") == (N - 1) * int64_t(k.nbytes() + v.nbytes()));
  CHECK(c.total() == (N - 1) * int64_t(k.nbytes() + v.nbytes()));
  reset_comm_counters();
}

TEST_CASE("ring attention: no group is the whole sequence on this rank") {
  ThreadsPerRank threads;
  for (bool docs : {false, true})
    for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail}) {
      const std::string what = cp_load_balance_name(lb) + (docs ? ", documents" : "");
      INFO(what);
      const int64_t T = 150;
      Reference ref = reference(T, true, 0, docs, 75, 900);
      Result got = run_ring(ref, nullptr, CpMethod::ring, lb, true, 0, DType::f64);
      check_against(got, ref, sequence_shard(lb, T, 1, 0), DType::f64);
    }
}

TEST_CASE("ring attention: the bytes counted for the cp traffic") {
  ThreadsPerRank threads;
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"cp", n}});
  Group& cp = mesh.group("cp");
  const int64_t T = 2 * int64_t(n) * 3;
  Reference ref = reference(T, true, 0, false, 3, 700);
  for (CpMethod method : {CpMethod::ring, CpMethod::all_gather})
    for (CpLoadBalance lb : {CpLoadBalance::none, CpLoadBalance::head_tail})
      for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
        INFO("cp ", n, ", ", cp_method_name(method), ", ", cp_load_balance_name(lb), ", ", dtype_name(dt));
        const SequenceShard sh = sequence_shard(lb, T, n, cp.rank());
        RingAttentionOptions o;
        o.group = &cp, o.method = method, o.load_balance = lb, o.seq_len = T;
        Tensor q = shard_sequence(cast(ref.q, dt), sh), k = shard_sequence(cast(ref.k, dt), sh);
        Tensor v = shard_sequence(cast(ref.v, dt), sh), dout = shard_sequence(cast(ref.dout, dt), sh);
        Tensor out = empty(q.shape(), dt), lse = empty({B, H, sh.size()}, accum_dtype(dt));
        // Local K and V in the activation dtype; their gradients travel in the accum dtype.
        const int64_t kv = int64_t(k.nbytes() + v.nbytes());
        const int64_t dkv = 2 * k.numel() * int64_t(dtype_size(accum_dtype(dt)));
        const int64_t N = n;

        reset_comm_counters();
        ring_attention_forward(out, lse, q, k, v, o);
        CommCounters fwd = comm_counters();
        const int64_t want_fwd = (N - 1) * kv;  // ring: N-1 shifts of K/V; all_gather: to N-1 peers
        CHECK(fwd.bytes("", "cp") == want_fwd);
        CHECK(fwd.total() == want_fwd);

        Tensor dq = empty(q.shape(), dt), dk = empty(k.shape(), dt), dv = empty(v.shape(), dt);
        reset_comm_counters();
        ring_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
        CommCounters bwd = comm_counters();
        // ring: K/V shifted N-1 times and the dK/dV accumulator N times (back to its owner);
        // all_gather: K/V gathered again, dK/dV reduce-scattered ((N-1)/N of N ranks' dK/dV).
        const int64_t want_bwd = N == 1                     ? 0
                                 : method == CpMethod::ring ? (N - 1) * kv + N * dkv
                                                            : (N - 1) * kv + (N - 1) * dkv;
        CHECK(bwd.bytes("", "cp") == want_bwd);
        CHECK(bwd.total() == want_bwd);
        reset_comm_counters();

        // bf16 results within bf16 rounding of the f64 reference (f32, f64 are checked closely elsewhere).
        if (dt == DType::bf16) {
          CHECK(rel_err(out, shard_sequence(ref.out, sh)) < 2e-2);
          CHECK(rel_err(dq, shard_sequence(ref.dq, sh)) < 3e-2);
          CHECK(rel_err(dk, shard_sequence(ref.dk, sh)) < 3e-2);
          CHECK(rel_err(dv, shard_sequence(ref.dv, sh)) < 3e-2);
          int64_t bad_inf = 0;
          CHECK(lse_err(lse, shard_lse(ref.lse, sh), bad_inf) < 2e-2);
          CHECK(bad_inf == 0);
        }
      }
}

TEST_CASE("ring attention: shape errors name the sequence split") {
  ThreadsPerRank threads;
  const int n = world_size();
  DeviceMesh mesh = DeviceMesh::create({{"cp", n}});
  Group& cp = mesh.group("cp");
  const int64_t T = 4 * int64_t(n);
  RingAttentionOptions o;
  o.group = &cp, o.seq_len = T, o.load_balance = CpLoadBalance::head_tail;
  // q holds one token too many for its shard (every rank alike, so no rank is left waiting).
  Tensor q = zeros({B, T / n + 1, H, hd}, DType::f64), k = zeros({B, T / n + 1, KV, hd}, DType::f64);
  Tensor out = empty(q.shape(), DType::f64), lse = empty({B, H, T / n + 1}, DType::f64);
  CHECK_ERROR_CONTAINS(ring_attention_forward(out, lse, q, k, k, o), "[attention]");
  // A sequence that does not split into 2n equal chunks (with n > 1: q holds T/n + 1 tokens, which is what
  // one rank of a one-rank group holds of a sequence of T + 1).
  if (n > 1) {
    o.seq_len = T + 1;
    CHECK_ERROR_CONTAINS(ring_attention_forward(out, lse, q, k, k, o), "[attention]");
  }
}
