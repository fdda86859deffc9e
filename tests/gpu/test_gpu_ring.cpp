// Ring attention on device tensors against attention over the whole sequence on the CPU: on 1 rank (NCCL;
// the sequence in chunks handled locally) and on the ranks of the test (NCCL when each has its own GPU, the
// MPI backend staging through the host when ranks share one), both methods, both splits, causal, GQA,
// documents off and on; f32 through the fp32 kernel and bf16 through the tensor-core kernel (hd 64).
#include <doctest/doctest.h>

#include "attention/ring_attention.h"
#include "runtime/core/stream.h"
#include "comm/mesh.h"
#include "gpu_test.h"

using namespace mt;

namespace {

struct Result {
  Tensor out, lse, dq, dk, dv;  // host f32
};

// The CPU reference: attention over the whole sequence, this rank's rows taken afterwards.
Result reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const Tensor& docs,
                 const SequenceShard& sh) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  Tensor out = empty(q.shape(), DType::f32), lse = empty({B, H, T}, DType::f32);
  Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
  AttentionOptions o{true, 0, 0, 0, docs};
  attention_forward(out, lse, q, k, v, o);
  attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
  Result r{shard_sequence(out, sh), empty({B, H, sh.size()}, DType::f32), shard_sequence(dq, sh),
           shard_sequence(dk, sh), shard_sequence(dv, sh)};
  for (size_t c = 0; c < sh.chunk_pos.size(); ++c)
    copy_slice(r.lse, int64_t(c) * sh.chunk_len, lse, sh.chunk_pos[c], sh.chunk_len, 2);
  return r;
}

Tensor host_f32(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  if (h.dtype() == DType::f32) return h;
  Tensor f = empty(h.shape(), DType::f32);
  convert(f, h);
  return f;
}

}  // namespace

TEST_CASE("gpu: ring attention on device tensors matches attention over the whole sequence") {
  MT_REQUIRE_GPU();
  set_device(test_device());
  const int n = world_size();
  // NCCL wants one GPU per rank; ranks sharing a GPU use the MPI backend (device buffers staged).
  MeshOptions mo;
  mo.device = gpu();
  mo.backend = n <= cuda_device_count() ? "nccl" : "mpi";
  DeviceMesh mesh = DeviceMesh::create({{"cp", n}}, mo);
  Group& g = mesh.group("cp");
  const int64_t B = 2, H = 4, KV = 2, hd = 64, T = 2 * int64_t(n) * 48;
  for (DType dt : {DType::f32, DType::bf16})
    for (CpMethod method : {CpMethod::ring, CpMethod::all_gather})
      for (CpLoadBalance lb : {CpLoadBalance::head_tail, CpLoadBalance::none})
        for (bool documents : {false, true}) {
          // The emulated device's quick run (gpu_test.h): bf16 (the tensor-core kernel, every mma.sync emulated)
          // in two of the eight combinations, f32 in all.
          if (dt == DType::bf16 && emulated_quick() &&
              !(method == CpMethod::ring && lb == CpLoadBalance::head_tail && documents) &&
              !(method == CpMethod::all_gather && lb == CpLoadBalance::none && !documents))
            continue;
          INFO("dtype " << dtype_name(dt) << ", " << cp_method_name(method) << ", " << cp_load_balance_name(lb)
                        << (documents ? ", documents" : "") << ", " << n << " rank(s) on " << mo.backend);
          Tensor q = rnd({B, T, H, hd}, 1), k = rnd({B, T, KV, hd}, 2), v = rnd({B, T, KV, hd}, 3),
                 dout = rnd({B, T, H, hd}, 4);
          Tensor docs;
          if (documents) {  // documents of 37 tokens: boundaries inside every chunk, documents across ranks
            Tensor tok = empty({B, T}, DType::i32);
            for (int64_t i = 0; i < B * T; ++i) tok.at<int32_t>(i) = (i % T) % 37 == 5 ? 1 : 0;
            docs = document_starts(tok, 1);
          }
          SequenceShard sh = sequence_shard(lb, T, n, g.rank());
          Result want = reference(q, k, v, dout, docs, sh);
          auto dev = [&](const Tensor& t) { return dt == DType::bf16 ? bf(t) : t.to(gpu()); };
          Tensor ql = dev(shard_sequence(q, sh)), kl = dev(shard_sequence(k, sh)), vl = dev(shard_sequence(v, sh)),
                 dl = dev(shard_sequence(dout, sh));
          Tensor out = nan_dev(ql.shape(), dt), lse = nan_dev({B, H, sh.size()}, DType::f32);
          Tensor dq = nan_dev(ql.shape(), dt), dk = nan_dev(kl.shape(), dt), dv = nan_dev(vl.shape(), dt);
          RingAttentionOptions o;
          o.group = &g, o.method = method, o.load_balance = lb, o.seq_len = T;
          if (documents) o.doc_start = shard_sequence(docs, sh);
          ring_attention_forward(out, lse, ql, kl, vl, o);
          ring_attention_backward(dq, dk, dv, dl, ql, kl, vl, out, lse, o);
          const double tol = dt == DType::bf16 ? 2e-2 : 1e-4;
          CHECK(rel(host_f32(out), want.out) < tol);
          CHECK(rel(host_f32(lse), want.lse) < tol);
          CHECK(rel(host_f32(dq), want.dq) < tol);
          CHECK(rel(host_f32(dk), want.dk) < tol);
          CHECK(rel(host_f32(dv), want.dv) < tol);
        }
}
