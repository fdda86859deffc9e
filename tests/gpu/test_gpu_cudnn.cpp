// Attention through cuDNN (runtime/kernels/cuda/cudnn_attention.cpp, attention.kernel = cudnn) against the own flash
// kernel: values, log-sum-exp and gradients; causal and not; grouped-query; the row offsets ring blocks pass
// (q_pos0 > k_pos0); packed documents; dk, dv accumulated; plans cached per shape; the fallbacks of attention.kernel = auto and the
// errors of cudnn. On the emulated device (build-emu) cuDNN is its stand-in (tests/emu/cudnn_emu.cpp), which
// interprets the graph in f64: this checks the graph (layouts, strides, mask, GQA), not cuDNN's engines. On a GPU it
// runs the real library where one loads, and skips where none does.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>
#include <algorithm>

#include "gpu_test.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/cuda/cudnn_attention.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

struct Case {
  int64_t B, T, S, H, KV, hd;
  bool causal;
  int64_t q_pos0 = 0, k_pos0 = 0;
};

struct Result {
  Tensor out, lse, dq, dk, dv;
};

// The kernel choice for a scope.
struct Kernel {
  AttentionKernelChoice saved = attention_kernel();
  Kernel(AttentionKernel k, bool deterministic = false) { set_attention_kernel({k, deterministic}); }
  ~Kernel() { set_attention_kernel(saved); }
};

void require_cudnn() {
  MT_REQUIRE_GPU();
  bool ok = false;
  const std::string what = cuda::cudnn_load(&ok);
  if (!ok) MT_SKIP("cuDNN not loadable: " + what);
}

struct Inputs {
  Tensor q, k, v, dout, dk0, dv0;
  explicit Inputs(const Case& c, uint64_t seed = 1)
      : q(bf(rnd({c.B, c.T, c.H, c.hd}, seed))), k(bf(rnd({c.B, c.S, c.KV, c.hd}, seed + 1))),
        v(bf(rnd({c.B, c.S, c.KV, c.hd}, seed + 2))), dout(bf(rnd({c.B, c.T, c.H, c.hd}, seed + 3))),
        dk0(bf(rnd({c.B, c.S, c.KV, c.hd}, seed + 4))), dv0(bf(rnd({c.B, c.S, c.KV, c.hd}, seed + 5))) {}
};

// (B, T) i64 on the device: each query's document start, documents beginning at the given positions of each row
// (global positions q_pos0 + t; 0 always starts one).
Tensor documents(const Case& c, const std::vector<std::vector<int64_t>>& starts) {
  std::vector<int64_t> v;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      int64_t s = 0;
      for (int64_t p : starts[size_t(b)]) if (p <= c.q_pos0 + t) s = std::max(s, p);
      v.push_back(s);
    }
  return test::ints(v, DType::i64).reshape({c.B, c.T}).to(gpu());
}

Result run(AttentionKernel kernel, const Case& c, const Inputs& in, bool accumulate = false,
           bool deterministic = false, const Tensor& doc = Tensor()) {
  Kernel scope(kernel, deterministic);
  const double scale = 1.0 / std::sqrt(double(c.hd));
  Result r{nan_dev(in.q.shape(), DType::bf16), nan_dev({c.B, c.H, c.T}, DType::f32), nan_dev(in.q.shape(), DType::bf16),
           accumulate ? in.dk0.clone() : nan_dev(in.k.shape(), DType::bf16),
           accumulate ? in.dv0.clone() : nan_dev(in.k.shape(), DType::bf16)};
  local_attention_forward(r.out, r.lse, in.q, in.k, in.v, scale, c.causal, c.q_pos0, c.k_pos0, doc);
  local_attention_backward(r.dq, r.dk, r.dv, in.dout, in.q, in.k, in.v, r.out, r.lse, scale, c.causal, c.q_pos0,
                           c.k_pos0, doc, accumulate);
  current_stream(test_device()).synchronize();
  return r;
}

void check_against_flash(const Case& c, bool accumulate = false, const Tensor& doc = Tensor()) {
  INFO("B ", c.B, " T ", c.T, " S ", c.S, " H ", c.H, " KV ", c.KV, " hd ", c.hd, " causal ", c.causal, " q_pos0 ",
       c.q_pos0, " k_pos0 ", c.k_pos0, " accumulate ", accumulate);
  const Inputs in(c);
  const Result want = run(AttentionKernel::flash, c, in, accumulate, false, doc);
  const Result got = run(AttentionKernel::cudnn, c, in, accumulate, false, doc);
  Tensor want_out = want.out.to(Device::cpu()), want_lse = want.lse.to(Device::cpu());
  CHECK(rel(got.out, want_out) < 1e-2);
  CHECK(rel(got.lse, want_lse) < 1e-3);
  CHECK(rel(got.dq, want.dq.to(Device::cpu())) < 2e-2);
  CHECK(rel(got.dk, want.dk.to(Device::cpu())) < 2e-2);
  CHECK(rel(got.dv, want.dv.to(Device::cpu())) < 2e-2);
}

}  // namespace

TEST_CASE("cudnn attention: values and gradients against the flash kernel") {
  require_cudnn();
  const int64_t plans0 = cuda::cudnn_cached_plans();
  check_against_flash({2, 32, 32, 2, 2, 64, true});   // causal, one head per kv head
  check_against_flash({1, 32, 32, 4, 2, 64, true});   // grouped-query (2 query heads a kv head)
  check_against_flash({1, 16, 48, 4, 1, 64, false});  // not causal, T != S, one kv head
  // A ring block: queries at 32.., keys at 0..: query t sees keys s <= t + 32 (same shape: the plan is reused).
  check_against_flash({1, 32, 32, 4, 2, 64, true, 32, 0});
  check_against_flash({1, 32, 32, 4, 2, 64, true, 32, 0}, /*accumulate=*/true);
  if (!emulated_quick()) check_against_flash({1, 32, 32, 2, 1, 128, true, 16, 0});
  // Forward and backward plans per (shape, causal, documents): the offsets and accumulation reuse them.
  CHECK(cuda::cudnn_cached_plans() - plans0 == (emulated_quick() ? 6 : 8));
}

TEST_CASE("cudnn attention: packed documents (a per-query lower bound in the mask) against the flash kernel") {
  require_cudnn();
  const Case c{2, 32, 32, 4, 2, 64, true};
  check_against_flash(c, false, documents(c, {{0, 10, 21}, {0, 5}}));
  // A ring's diagonal block at global positions 32..63 (documents starting before and inside it).
  const Case ring{1, 32, 32, 4, 2, 64, true, 32, 32};
  check_against_flash(ring, true, documents(ring, {{0, 20, 40, 41, 60}}));
}

TEST_CASE("cudnn attention: auto falls back to the flash kernel where cuDNN cannot, cudnn says why") {
  require_cudnn();
  // A query block before its key block (queries that see no key): cuDNN's mask needs q_pos0 >= k_pos0.
  const Case c{1, 16, 16, 2, 2, 64, true, 0, 8};
  const Inputs in(c);
  const Result flash = run(AttentionKernel::flash, c, in);
  const Result autom = run(AttentionKernel::automatic, c, in);
  CHECK(rel(autom.out, flash.out.to(Device::cpu())) == 0);
  CHECK(rel(autom.dq, flash.dq.to(Device::cpu())) == 0);
  CHECK_THROWS_WITH_AS(run(AttentionKernel::cudnn, c, in), doctest::Contains("attention.kernel = cudnn"), Error);
  // Documents in a block off the diagonal (queries after their keys: a ring's earlier block).
  const Case off{1, 16, 16, 2, 2, 64, true, 16, 0};
  const Inputs in_off(off);
  const Tensor doc = documents(off, {{0, 20}});  // queries 20.. see none of the keys 0..15
  const Result flash_doc = run(AttentionKernel::flash, off, in_off, false, false, doc);
  const Result auto_doc = run(AttentionKernel::automatic, off, in_off, false, false, doc);
  CHECK(rel(auto_doc.out, flash_doc.out.to(Device::cpu())) == 0);
  CHECK(rel(auto_doc.dk, flash_doc.dk.to(Device::cpu())) == 0);
  CHECK_THROWS_WITH_AS(run(AttentionKernel::cudnn, off, in_off, false, false, doc),
                       doctest::Contains("packed documents in a block off the diagonal"), Error);
  Kernel scope(AttentionKernel::cudnn);
  CHECK_THROWS_WITH_AS(check_attention_kernel(gpu(), 64, /*has_documents=*/true),
                       doctest::Contains("attention.kernel = cudnn"), Error);
  CHECK_THROWS_WITH_AS(check_attention_kernel(Device::cpu(), 64, false), doctest::Contains("attention.kernel = cudnn"),
                       Error);
}

#if defined(MT_CUDA_EMULATED)
TEST_CASE("cudnn attention: deterministic takes only engines without the nondeterministic note") {
  require_cudnn();
  const Case c{1, 16, 16, 2, 1, 64, true};
  const Inputs in(c);
  ::setenv("MT_CUDNN_EMU_NONDETERMINISTIC", "1", 1);  // the stand-in's engine says it is nondeterministic
  const Result autom = run(AttentionKernel::automatic, c, in, false, /*deterministic=*/true);
  // The forward ran on cuDNN (the note does not matter there); the backward fell back to the flash kernel: the same
  // bits as the flash kernel's backward from the same out and lse.
  Tensor dq = nan_dev(in.q.shape(), DType::bf16), dk = nan_dev(in.k.shape(), DType::bf16),
         dv = nan_dev(in.k.shape(), DType::bf16);
  {
    Kernel flash(AttentionKernel::flash);
    local_attention_backward(dq, dk, dv, in.dout, in.q, in.k, in.v, autom.out, autom.lse, 0.125, true, 0, 0, Tensor(),
                             false);
  }
  CHECK(rel(autom.dq, dq.to(Device::cpu())) == 0);
  CHECK(rel(autom.dv, dv.to(Device::cpu())) == 0);
  CHECK_THROWS_WITH_AS(run(AttentionKernel::cudnn, c, in, false, true), doctest::Contains("deterministic"), Error);
  const Result nondet = run(AttentionKernel::cudnn, c, in, false, false);  // the same engine, not asked
  CHECK(rel(nondet.dq, dq.to(Device::cpu())) < 2e-2);
  ::unsetenv("MT_CUDNN_EMU_NONDETERMINISTIC");
}
#endif
