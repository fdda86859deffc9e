// The attention boundary (attention/attention.h) under Ulysses (alltoall over
// cp_ulysses) and 2-D context parallel (Ulysses inside, ring or all_gather over
// cp_ring outside), against attention over the whole sequence on one rank:
// every rank builds the same full q, k, v and dout, keeps its tokens (cp_shard),
// runs the boundary's forward and backward, and compares out, lse, dq, dk, dv
// with the matching rows of the single-rank f64 result. Grouped-query with as
// many kv heads as q heads, a half, a quarter and one (kv heads fewer than the
// Ulysses degree: shared kv heads whose gradients are summed), causal and full,
// packed documents off and on, f64 and f32; and the bytes the runtime counts
// against ulysses_layer_bytes.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "../check_error.h"
#include "cp_cases.h"
#include "../skip.h"
#include "../test_util.h"
#include "attention/attention.h"
#include "comm/comm_counters.h"
#include "comm/mesh.h"
#include "mpi_world.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

const int64_t B = 2, H = 8, hd = 8;
const int32_t kSeparator = 0;
using test::document_tokens;
using test::shard_lse;

Tensor cast(const Tensor& t, DType dt) { return from_values(to_f64(t), t.shape(), dt); }

using Reference = test::CpReference;
Reference reference(int64_t T, int64_t KV, bool causal, double scale, bool docs, int64_t chunk, uint64_t seed) {
  Tensor doc_start =
      docs ? document_starts(document_tokens(T, chunk, kSeparator, uint64_t(T) + 7), kSeparator) : Tensor();
  return test::cp_reference(B, T, H, KV, hd, causal, scale, doc_start, seed);
}

// lse_err with no -inf mismatch allowed: NaN when there is one.
double lse_err(const Tensor& got, const Tensor& want) {
  int64_t bad = 0;
  const double e = test::lse_err(got, want, bad);
  return bad ? NAN : e;
}

// A cp_ring x cp_ulysses mesh over the world (ring outside, as in training).
struct CpMesh {
  DeviceMesh mesh;
  ContextParallel cp;
  int ring_rank = 0, ulysses_rank = 0;
};
CpMesh cp_mesh(int ring, int ulysses, CpMethod method, CpLoadBalance lb, int64_t T) {
  CpMesh m;
  m.mesh = DeviceMesh::create({{"cp_ring", ring}, {"cp_ulysses", ulysses}});
  if (ring > 1) m.cp.ring = &m.mesh.group("cp_ring");
  if (ulysses > 1) m.cp.ulysses = &m.mesh.group("cp_ulysses");
  m.cp.method = method, m.cp.load_balance = lb, m.cp.seq_len = T;
  m.ring_rank = m.mesh.coordinate(0), m.ulysses_rank = m.mesh.coordinate(1);
  return m;
}

// One case through make_attention's forward, lse and backward, checked against the reference.
void check_case(const CpMesh& m, const Reference& ref, bool causal, double scale, DType dt) {
  const int64_t T = ref.q.size(1);
  const SequenceShard sh = cp_shard(m.cp.load_balance, T, m.cp.ring_size(), m.ring_rank, m.cp.ulysses_size(),
                                    m.ulysses_rank);
  auto attn = make_attention(m.cp);
  AttentionCall call;
  call.causal = causal, call.scale = scale, call.doc_start = ref.doc_start, call.batch = 1;
  Tensor q = shard_sequence(cast(ref.q, dt), sh), k = shard_sequence(cast(ref.k, dt), sh);
  Tensor v = shard_sequence(cast(ref.v, dt), sh), dout = shard_sequence(cast(ref.dout, dt), sh);
  AttentionSaved saved;
  Tensor out = attn->forward(saved, q, k, v, call);
  Tensor lse = attn->lse(saved);
  // Garbage in the gradients beforehand: backward overwrites them.
  Tensor dq = cast(test::randn(q.shape(), 77), dt), dk = cast(test::randn(k.shape(), 78), dt);
  Tensor dv = cast(test::randn(v.shape(), 79), dt);
  attn->backward(dq, dk, dv, dout, saved, call);

  const double tol = dt == DType::f64 ? 1e-10 : 1e-5;
  REQUIRE(out.shape() == q.shape());
  REQUIRE(lse.shape() == (Shape{B, H, sh.size()}));
  const double e_out = test::rel_err(out, shard_sequence(ref.out, sh));
  const double e_lse = lse_err(lse, shard_lse(ref.lse, sh));
  const double e_dq = test::rel_err(dq, shard_sequence(ref.dq, sh));
  const double e_dk = test::rel_err(dk, shard_sequence(ref.dk, sh));
  const double e_dv = test::rel_err(dv, shard_sequence(ref.dv, sh));
  INFO(attn->describe(), "; relative errors: out ", e_out, ", lse ", e_lse, ", dq ", e_dq, ", dk ", e_dk, ", dv ",
       e_dv);
  CHECK(e_out < tol);
  CHECK(e_lse < tol);
  CHECK(e_dq < tol);
  CHECK(e_dk < tol);
  CHECK(e_dv < tol);
}

// Every kv head count of {H, H/2, H/4, 1}, causal and full, documents off and on, f64 and f32, for T = 2 R U k.
void grid(int ring, int ulysses, const std::vector<CpMethod>& methods, const std::vector<CpLoadBalance>& lbs,
          int64_t k, uint64_t seed) {
  const int64_t T = 2 * int64_t(ring) * ulysses * k;
  for (int64_t KV : {H, H / 2, H / 4, int64_t(1)})
    for (bool causal : {true, false})
      for (bool docs : {false, true}) {
        seed += 10;
        const double scale = causal ? 0 : 0.3;
        Reference ref = reference(T, KV, causal, scale, docs, k, seed);
        for (CpMethod method : methods)
          for (CpLoadBalance lb : lbs)
            for (DType dt : {DType::f64, DType::f32}) {
              INFO("cp_ring ", ring, " x cp_ulysses ", ulysses, ", T ", T, ", kv heads ", KV, ", ",
                   cp_method_name(method), ", ", cp_load_balance_name(lb), causal ? ", causal" : ", full",
                   docs ? ", documents" : "", ", ", dtype_name(dt));
              CpMesh m = cp_mesh(ring, ulysses, method, lb, T);
              check_case(m, ref, causal, scale, dt);
            }
      }
}

}  // namespace

TEST_CASE("Ulysses (alltoall) over the whole world against attention over the whole sequence") {
  ThreadsPerRank threads;
  const int n = world_size();
  if (n == 1 || H % n != 0) MT_SKIP("needs 2, 4 or 8 ranks (8 q heads split over them)");
  // Chunks of 3 tokens: every grid case; chunks of 40 (a 64-row kernel block spans several ranks' tokens).
  grid(1, n, {CpMethod::ring}, {CpLoadBalance::head_tail}, 3, 100);
  grid(1, n, {CpMethod::ring}, {CpLoadBalance::none}, 40, 500);
}

TEST_CASE("2-D context parallel: Ulysses inside ring or all_gather") {
  ThreadsPerRank threads;
  const int n = world_size();
  std::vector<std::pair<int, int>> shapes;  // (ulysses, ring)
  if (n == 4) shapes = {{2, 2}};
  if (n == 6) shapes = {{2, 3}};
  if (n == 8) shapes = {{2, 4}, {4, 2}};
  if (shapes.empty()) MT_SKIP("needs 4, 6 or 8 ranks");
  uint64_t seed = 1000;
  for (auto [u, r] : shapes) {
    grid(r, u, {CpMethod::ring, CpMethod::all_gather}, {CpLoadBalance::head_tail, CpLoadBalance::none}, 3, seed);
    seed += 1000;
  }
}

TEST_CASE("Ulysses: the bytes counted equal ulysses_layer_bytes; a repeated batch reuses the documents") {
  ThreadsPerRank threads;
  const int n = world_size();
  if (n == 1 || H % n != 0) MT_SKIP("needs 2, 4 or 8 ranks");
  const int64_t T = 2 * int64_t(n) * 4;
  for (int64_t KV : {H, int64_t(1)})
    for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
      INFO("cp_ulysses ", n, ", kv heads ", KV, ", ", dtype_name(dt));
      Reference ref = reference(T, KV, true, 0, false, 4, 300);
      CpMesh m = cp_mesh(1, n, CpMethod::ring, CpLoadBalance::head_tail, T);
      const SequenceShard sh = cp_shard(CpLoadBalance::head_tail, T, 1, 0, n, m.ulysses_rank);
      auto attn = make_attention(m.cp);
      AttentionCall call;
      Tensor q = shard_sequence(cast(ref.q, dt), sh), k = shard_sequence(cast(ref.k, dt), sh);
      Tensor v = shard_sequence(cast(ref.v, dt), sh), dout = shard_sequence(cast(ref.dout, dt), sh);
      const CpLayerBytes want = ulysses_layer_bytes(n, B, sh.size(), H, KV, hd, double(dtype_size(dt)));
      AttentionSaved saved;
      reset_comm_counters();
      Tensor out = attn->forward(saved, q, k, v, call);
      CommCounters fwd = comm_counters();
      CHECK(double(fwd.bytes(kCpA2aTag, "cp_ulysses")) == want.forward);
      CHECK(fwd.total() == fwd.bytes(kCpA2aTag));
      Tensor dq = empty(q.shape(), dt), dk = empty(k.shape(), dt), dv = empty(v.shape(), dt);
      reset_comm_counters();
      attn->backward(dq, dk, dv, dout, saved, call);
      CommCounters bwd = comm_counters();
      CHECK(double(bwd.bytes(kCpA2aTag, "cp_ulysses")) == want.backward);
      CHECK(bwd.total() == bwd.bytes(kCpA2aTag));
      reset_comm_counters();
      if (dt == DType::bf16) {
        CHECK(test::rel_err(out, shard_sequence(ref.out, sh)) < 2e-2);
        CHECK(test::rel_err(dq, shard_sequence(ref.dq, sh)) < 3e-2);
        CHECK(test::rel_err(dk, shard_sequence(ref.dk, sh)) < 3e-2);
        CHECK(test::rel_err(dv, shard_sequence(ref.dv, sh)) < 3e-2);
      }
    }
}

TEST_CASE("2-D: a ring whose documents change between batches shards the new ones") {
  ThreadsPerRank threads;
  const int n = world_size();
  if (n != 4) MT_SKIP("needs 4 ranks");
  const int64_t T = 32;
  CpMesh m = cp_mesh(2, 2, CpMethod::ring, CpLoadBalance::head_tail, T);
  auto attn = make_attention(m.cp);
  const SequenceShard sh = cp_shard(CpLoadBalance::head_tail, T, 2, m.ring_rank, 2, m.ulysses_rank);
  for (int batch = 0; batch < 3; ++batch) {
    // Documents at different places in each batch; the same attention object (its cached doc shard).
    Reference ref = reference(T, 2, true, 0, true, 4 + batch, 2000 + uint64_t(batch) * 10);
    AttentionCall call;
    call.doc_start = ref.doc_start, call.batch = uint64_t(batch) + 1;
    AttentionSaved saved;
    Tensor out = attn->forward(saved, shard_sequence(ref.q, sh), shard_sequence(ref.k, sh),
                               shard_sequence(ref.v, sh), call);
    INFO("batch ", batch);
    CHECK(test::rel_err(out, shard_sequence(ref.out, sh)) < 1e-10);
  }
}

TEST_CASE("Ulysses: heads that do not split over the group are an error before any exchange") {
  ThreadsPerRank threads;
  const int n = world_size();
  if (n != 4 && n != 8) MT_SKIP("needs 4 or 8 ranks");
  const int64_t T = 2 * int64_t(n);
  CpMesh m = cp_mesh(1, n, CpMethod::ring, CpLoadBalance::head_tail, T);
  auto attn = make_attention(m.cp);
  AttentionSaved saved;
  // 6 q heads over 4 or 8 ranks; then 8 q heads with 3 kv heads (neither a multiple nor a divisor).
  Tensor q6 = zeros({B, 2, 6, hd}, DType::f64), k6 = zeros({B, 2, 6, hd}, DType::f64);
  CHECK_ERROR_CONTAINS(attn->forward(saved, q6, k6, k6, AttentionCall{}), "6 q heads and 6 kv heads");
  Tensor q = zeros({B, 2, H, hd}, DType::f64), k3 = zeros({B, 2, 3, hd}, DType::f64);
  CHECK_ERROR_CONTAINS(attn->forward(saved, q, k3, k3, AttentionCall{}), "do not split over the");
}
