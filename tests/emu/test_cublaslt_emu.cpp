// The cuBLASLt stand-in (tests/emu/cublaslt_emu.cpp) on the emulated device (tests/emu/cuda_runtime_emu.cpp):
// every transpose combination, leading dimensions above the row counts, f32 and bf16 operands with f32 or bf16
// output, alpha and beta, C = D in place and C apart from D, checked against a triple loop in double; the
// descriptor sequence runtime/kernels/cuda/matmul.cu makes (forward, dinp, dweight accumulating in f32); and the
// refusals: attributes and values meshtrain does not use, host pointers, operands past their allocation,
// pointers less aligned than the preference promised, an algorithm of another problem, a short workspace,
// destroyed descriptors; FP8 (E4M3 / E5M2 with scale pointers, scalar and outer-vector, TN only). Each refusal must name the call and the operand on stderr ([cuda-emu] ...).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "runtime/core/fp8.h"
#include "tests/emu/stand_in_test.h"

namespace {

// ---------------------------------------------------------------- helpers

// A column-major matrix of rows x cols with leading dimension ld, in device memory, f32 or bf16, with the
// float value of each element kept for the reference.
struct Mat {
  cudaDataType_t type;
  int rows, cols, ld;
  std::vector<float> val;  // ld * cols, as stored (bf16-rounded for bf16)
  Dev dev;
  Mat(cudaDataType_t t, int r, int c, int l)
      : type(t), rows(r), cols(c), ld(l), val(size_t(l) * size_t(c)), dev(size_t(l) * size_t(c) * es(t)) {}
  static size_t es(cudaDataType_t t) { return t == CUDA_R_16BF ? 2 : 4; }
  void set(size_t i, float v) {
    if (type == CUDA_R_16BF) {
      const uint16_t u = to_bf16(v);
      dev.as<uint16_t>()[i] = u;
      val[i] = from_bf16(u);
    } else {
      dev.as<float>()[i] = v;
      val[i] = v;
    }
  }
  float get(size_t i) const { return type == CUDA_R_16BF ? from_bf16(dev.as<uint16_t>()[i]) : dev.as<float>()[i]; }
  void fill(std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1, 1);
    for (size_t i = 0; i < val.size(); ++i) set(i, u(rng));
  }
  void fill_nan() {
    for (size_t i = 0; i < val.size(); ++i) set(i, NAN);
  }
};

// A whole cuBLASLt problem made as matmul.cu makes it (descriptor, TRANSA/B, three layouts with C = D's,
// preference with workspace and alignments, one algorithm from the heuristic).
struct Plan {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t ws_bytes = 0;
  Plan(bool transa, bool transb, int m, int n, int k, cudaDataType_t at, cudaDataType_t dt, int lda, int ldb, int ldc,
       int ldd, size_t workspace = 1 << 20, uint32_t align = 16) {
    REQUIRE(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS);
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&a, at, transa ? k : m, transa ? m : k, lda) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&b, at, transb ? n : k, transb ? k : n, ldb) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&c, dt, m, n, ldc) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(cublasLtMatrixLayoutCreate(&d, dt, m, n, ldd) == CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulPreference_t pref = nullptr;
    REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
    uint64_t ws = workspace;
    REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ==
            CUBLAS_STATUS_SUCCESS);
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align) == CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    REQUIRE(cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, d, pref, 1, &r, &found) == CUBLAS_STATUS_SUCCESS);
    REQUIRE(found == 1);
    CHECK(r.state == CUBLAS_STATUS_SUCCESS);
    CHECK(r.workspaceSize <= workspace);
    cublasLtMatmulPreferenceDestroy(pref);
    algo = r.algo;
    ws_bytes = r.workspaceSize;
  }
  ~Plan() {
    for (auto l : {a, b, c, d})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
    if (h) cublasLtDestroy(h);
  }
};

// D = alpha op(A) op(B) + beta C in double, from the stored values.
std::vector<double> reference(bool transa, bool transb, int m, int n, int k, float alpha, const Mat& A, const Mat& B,
                              float beta, const std::vector<float>& C, int ldc) {
  std::vector<double> d(size_t(m) * size_t(n));
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      for (int l = 0; l < k; ++l) {
        const double a = transa ? A.val[size_t(l) + size_t(i) * A.ld] : A.val[size_t(i) + size_t(l) * A.ld];
        const double b = transb ? B.val[size_t(j) + size_t(l) * B.ld] : B.val[size_t(l) + size_t(j) * B.ld];
        acc += a * b;
      }
      d[size_t(i) + size_t(j) * m] = alpha * acc + (beta != 0 ? beta * double(C[size_t(i) + size_t(j) * ldc]) : 0.0);
    }
  return d;
}

// The worst error of D against the reference, in units of the output type's rounding (relative to the largest
// magnitude of the column's terms, so cancellation does not inflate it); and D's padding rows untouched.
void check_result(const Mat& D, const std::vector<double>& ref, int m, int n, const std::vector<float>& before) {
  const double unit = D.type == CUDA_R_16BF ? std::ldexp(1.0, -8) : std::ldexp(1.0, -22);
  double worst = 0;
  double scale = 1e-30;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < D.ld; ++i) {
      const size_t idx = size_t(i) + size_t(j) * D.ld;
      const float got = D.get(idx);
      if (i >= m) {  // padding between the rows and the leading dimension: never written
        uint32_t g = 0, w = 0;
        if (D.type == CUDA_R_16BF) {
          g = D.dev.as<uint16_t>()[idx];
          w = to_bf16(before[idx]);
        } else {
          std::memcpy(&g, &got, 4);
          std::memcpy(&w, &before[idx], 4);
        }
        CHECK_MESSAGE(g == w, "padding row ", i, " column ", j, " was written");
        continue;
      }
      REQUIRE_MESSAGE(std::isfinite(got), "D(", i, ",", j, ") = ", got);
      worst = std::max(worst, std::fabs(double(got) - ref[size_t(i) + size_t(j) * m]) / scale);
    }
  CHECK_MESSAGE(worst <= 2 * unit, "worst relative error ", worst, " (output rounding ", unit, ")");
}

struct Case {
  bool transa, transb;
  int m, n, k, pad;  // pad: leading dimensions exceed the rows by this
  cudaDataType_t at, dt;
  float alpha, beta;
  bool in_place;  // C is D (else a separate C buffer)
};

void run_case(const Case& cs, uint32_t seed) {
  INFO("transa ", cs.transa, " transb ", cs.transb, " m ", cs.m, " n ", cs.n, " k ", cs.k, " pad ", cs.pad, " A ",
       int(cs.at), " D ", int(cs.dt), " alpha ", cs.alpha, " beta ", cs.beta, " in place ", cs.in_place);
  std::mt19937 rng(seed);
  const int ar = cs.transa ? cs.k : cs.m, ac = cs.transa ? cs.m : cs.k;
  const int br = cs.transb ? cs.n : cs.k, bc = cs.transb ? cs.k : cs.n;
  Mat A(cs.at, ar, ac, ar + cs.pad), B(cs.at, br, bc, br + cs.pad), D(cs.dt, cs.m, cs.n, cs.m + cs.pad);
  Mat C(cs.dt, cs.m, cs.n, cs.m + 2 * cs.pad + 1);
  A.fill(rng), B.fill(rng), D.fill(rng), C.fill(rng);
  const Mat& Cm = cs.in_place ? D : C;
  const std::vector<float> c_vals = Cm.val, d_before = D.val;
  const std::vector<double> ref =
      reference(cs.transa, cs.transb, cs.m, cs.n, cs.k, cs.alpha, A, B, cs.beta, c_vals, Cm.ld);
  Plan p(cs.transa, cs.transb, cs.m, cs.n, cs.k, cs.at, cs.dt, A.ld, B.ld, Cm.ld, D.ld);
  Dev ws(p.ws_bytes + 1);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  const long long before = emu::reports();
  REQUIRE(cublasLtMatmul(p.h, p.op, &cs.alpha, A.dev.p, p.a, B.dev.p, p.b, &cs.beta, Cm.dev.p, p.c, D.dev.p, p.d,
                         &p.algo, ws.p, p.ws_bytes, s) == CUBLAS_STATUS_SUCCESS);
  CHECK(emu::reports() == before);
  check_result(D, ref, cs.m, cs.n, d_before);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  cudaStreamDestroy(s);
}

}  // namespace

// ---------------------------------------------------------------- results

TEST_CASE("every transpose combination, leading dimensions above the rows, f32, alpha and beta, C = D and C apart") {
  uint32_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int pad : {0, 3})
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.5f, 0.0f}, {1.0f, 1.0f}, {-0.75f, 0.5f}})
          for (bool in_place : {true, false})
            run_case({ta, tb, 7, 5, 9, pad, CUDA_R_32F, CUDA_R_32F, alpha, beta, in_place}, seed++);
}

TEST_CASE("bf16 operands with bf16 and f32 output, f32 compute") {
  uint32_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (cudaDataType_t dt : {CUDA_R_16BF, CUDA_R_32F})
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {2.0f, -1.0f}})
          run_case({ta, tb, 16, 8, 64, 2, CUDA_R_16BF, dt, alpha, beta, true}, seed++);
}

TEST_CASE("shapes: vectors, k = 1, a long reduction") {
  run_case({false, false, 1, 1, 1, 0, CUDA_R_32F, CUDA_R_32F, 1, 0, true}, 7);
  run_case({true, false, 1, 13, 31, 1, CUDA_R_32F, CUDA_R_32F, 1, 1, true}, 8);
  run_case({false, true, 13, 1, 31, 1, CUDA_R_16BF, CUDA_R_16BF, 1, 1, true}, 9);
  run_case({true, false, 3, 4, 4096, 0, CUDA_R_16BF, CUDA_R_32F, 1, 0, true}, 10);
}

TEST_CASE("bf16 products are exact and accumulated in f32 or wider") {
  // 256 terms of (1 + 2^-7)(1 - 2^-7) = 1 - 2^-14 (exact in f32, not in bf16): the sum 256 - 2^-6 is exact in
  // an f32 (or wider) accumulator; one that rounded the products or the partial sums to bf16 would give 256.
  const int k = 256;
  Mat A(CUDA_R_16BF, 1, k, 1), B(CUDA_R_16BF, k, 1, k), D(CUDA_R_32F, 1, 1, 1);
  for (int l = 0; l < k; ++l) A.set(size_t(l), 1 + std::ldexp(1.0f, -7)), B.set(size_t(l), 1 - std::ldexp(1.0f, -7));
  Plan p(false, false, 1, 1, k, CUDA_R_16BF, CUDA_R_32F, 1, k, 1, 1);
  Dev ws(p.ws_bytes + 1);
  float alpha = 1, beta = 0;
  REQUIRE(cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d, &p.algo,
                         ws.p, p.ws_bytes, nullptr) == CUBLAS_STATUS_SUCCESS);
  CHECK(D.get(0) == 256.0f - std::ldexp(1.0f, -6));
}

TEST_CASE("bf16 output is rounded once, to nearest even") {
  // k = 2: 1 * a + 1 * 2^-8 lands exactly halfway between two bf16 values (spacing 2^-7 above 1).
  Mat A(CUDA_R_16BF, 1, 2, 1), B(CUDA_R_16BF, 2, 1, 2), D(CUDA_R_16BF, 1, 1, 1);
  Plan p(false, false, 1, 1, 2, CUDA_R_16BF, CUDA_R_16BF, 1, 2, 1, 1);
  Dev ws(p.ws_bytes + 1);
  float alpha = 1, beta = 0;
  A.set(0, 1), A.set(1, 1), B.set(1, std::ldexp(1.0f, -8));
  for (auto [a, want] : {std::pair{1.0f, 1.0f},                                          // tie: down to even
                         {1 + std::ldexp(1.0f, -7), 1 + std::ldexp(1.0f, -6)},            // tie: up to even
                         {-1.0f, -1.0f + std::ldexp(1.0f, -8)}}) {                        // exact below 1
    B.set(0, a);
    REQUIRE(cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d, &p.algo,
                           ws.p, p.ws_bytes, nullptr) == CUBLAS_STATUS_SUCCESS);
    CHECK(D.get(0) == want);
  }
}

TEST_CASE("beta = 0 does not read C (NaN there stays out of D)") {
  Mat A(CUDA_R_32F, 4, 3, 4), B(CUDA_R_32F, 3, 2, 3), D(CUDA_R_32F, 4, 2, 4);
  std::mt19937 rng(3);
  A.fill(rng), B.fill(rng), D.fill_nan();
  Plan p(false, false, 4, 2, 3, CUDA_R_32F, CUDA_R_32F, 4, 3, 4, 4);
  Dev ws(p.ws_bytes + 1);
  float alpha = 1, beta = 0;
  REQUIRE(cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d, &p.algo,
                         ws.p, p.ws_bytes, nullptr) == CUBLAS_STATUS_SUCCESS);
  for (int i = 0; i < 8; ++i) CHECK(std::isfinite(D.get(size_t(i))));
}

// The calls of runtime/kernels/cuda/matmul.cu, in its order, for its three GEMMs (row-major out = inp W^T;
// dinp = dout W; dW += dout^T inp in f32), checked against row-major loops.
TEST_CASE("the descriptor sequence of matmul.cu: forward, dinp, dweight (bf16 activations, f32 dweight)") {
  const int N = 6, C = 10, OC = 4;
  std::mt19937 rng(11);
  Mat inp(CUDA_R_16BF, C, N, C), weight(CUDA_R_16BF, C, OC, C), dout(CUDA_R_16BF, OC, N, OC);
  Mat out(CUDA_R_16BF, OC, N, OC), dinp(CUDA_R_16BF, C, N, C), dweight(CUDA_R_32F, C, OC, C);
  inp.fill(rng), weight.fill(rng), dout.fill(rng), out.fill_nan(), dinp.fill_nan(), dweight.fill(rng);
  const std::vector<float> dw0 = dweight.val;
  const size_t kWorkspace = size_t(32) << 20;
  Dev ws(kWorkspace);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  auto alignment_of = [](const void* q) {
    uintptr_t u = reinterpret_cast<uintptr_t>(q);
    int a = 256;
    while (a > 1 && u % uintptr_t(a) != 0) a /= 2;
    return a;
  };
  // lt_gemm of matmul.cu, verbatim in its calls.
  auto lt_gemm = [&](bool transa, bool transb, int m, int n, int k, const void* A, int lda, const void* B, int ldb,
                     void* D, int ldd, cudaDataType_t at, cudaDataType_t dt, bool accumulate) {
    cublasLtHandle_t handle = nullptr;
    REQUIRE(cublasLtCreate(&handle) == CUBLAS_STATUS_SUCCESS);
    int align = std::min(alignment_of(A), std::min(alignment_of(B), alignment_of(D)));
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&a, at, transa ? k : m, transa ? m : k, lda) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&b, at, transb ? n : k, transb ? k : n, ldb) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&d, dt, m, n, ldd) == 0);
    cublasLtMatmulPreference_t pref = nullptr;
    REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == 0);
    uint64_t wsb = kWorkspace;
    uint32_t al = uint32_t(align);
    REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)) ==
            0);
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)) == 0);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    REQUIRE(cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, 1, &result, &found) == 0);
    cublasLtMatmulPreferenceDestroy(pref);
    REQUIRE(found == 1);
    float alpha = 1, beta = accumulate ? 1 : 0;
    CHECK(cublasLtMatmul(handle, op, &alpha, A, a, B, b, &beta, D, d, D, d, &result.algo, ws.p, kWorkspace, s) == 0);
    // A second launch of the cached plan (matmul.cu reuses it) must be accepted too: here with beta = 0 again
    // only when not accumulating, so the result stays the single product.
    if (!accumulate)
      CHECK(cublasLtMatmul(handle, op, &alpha, A, a, B, b, &beta, D, d, D, d, &result.algo, ws.p, kWorkspace, s) == 0);
    cublasLtMatmulDescDestroy(op);
    for (auto l : {a, b, d}) cublasLtMatrixLayoutDestroy(l);
    cublasLtDestroy(handle);
  };
  const long long before = emu::reports();
  // matmul_forward: lt_gemm(T, N, OC, N, C, weight, C, inp, C, out, OC)
  lt_gemm(true, false, OC, N, C, weight.dev.p, C, inp.dev.p, C, out.dev.p, OC, CUDA_R_16BF, CUDA_R_16BF, false);
  // matmul_backward dinp: lt_gemm(N, N, C, N, OC, weight, C, dout, OC, dinp, C)
  lt_gemm(false, false, C, N, OC, weight.dev.p, C, dout.dev.p, OC, dinp.dev.p, C, CUDA_R_16BF, CUDA_R_16BF, false);
  // dweight: lt_gemm(N, T, C, OC, N, inp, C, dout, OC, dweight, C, accumulate)
  lt_gemm(false, true, C, OC, N, inp.dev.p, C, dout.dev.p, OC, dweight.dev.p, C, CUDA_R_16BF, CUDA_R_32F, true);
  CHECK(emu::reports() == before);
  // Row-major references: out[t][o] = sum_c inp[t][c] W[o][c]; dinp[t][c] = sum_o dout[t][o] W[o][c];
  // dW[o][c] += sum_t dout[t][o] inp[t][c]. (Row-major X (R, K) is column-major K x R with ld K.)
  for (int t = 0; t < N; ++t)
    for (int o = 0; o < OC; ++o) {
      double acc = 0;
      for (int c = 0; c < C; ++c) acc += double(inp.val[size_t(t * C + c)]) * weight.val[size_t(o * C + c)];
      CHECK(out.get(size_t(t * OC + o)) == doctest::Approx(from_bf16(to_bf16(float(acc)))).epsilon(1e-2));
    }
  for (int t = 0; t < N; ++t)
    for (int c = 0; c < C; ++c) {
      double acc = 0;
      for (int o = 0; o < OC; ++o) acc += double(dout.val[size_t(t * OC + o)]) * weight.val[size_t(o * C + c)];
      CHECK(dinp.get(size_t(t * C + c)) == doctest::Approx(from_bf16(to_bf16(float(acc)))).epsilon(1e-2));
    }
  for (int o = 0; o < OC; ++o)
    for (int c = 0; c < C; ++c) {
      double acc = dw0[size_t(o * C + c)];
      for (int t = 0; t < N; ++t) acc += double(dout.val[size_t(t * OC + o)]) * inp.val[size_t(t * C + c)];
      CHECK(dweight.get(size_t(o * C + c)) == doctest::Approx(acc).epsilon(1e-6));
    }
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
}

// ---------------------------------------------------------------- refusals

// The call returns `want` (a cublasStatus_t) and reports once, naming the call and each of `words`.
#define EXPECT_REFUSED(expr, want, ...) EXPECT_REPORTED(expr, want, __VA_ARGS__)

TEST_CASE("attributes and values meshtrain does not use are refused, naming them") {
  cublasLtMatmulDesc_t op = nullptr;
  EXPECT_REFUSED(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F), CUBLAS_STATUS_NOT_SUPPORTED,
                 "cublasLtMatmulDescCreate", "compute type");
  EXPECT_REFUSED(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_16BF), CUBLAS_STATUS_NOT_SUPPORTED,
                 "scale type");
  REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS);
  int32_t epi = CUBLASLT_EPILOGUE_BIAS;
  EXPECT_REFUSED(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulDescSetAttribute", "CUBLASLT_MATMUL_DESC_EPILOGUE (7)");
  int32_t pm = CUBLASLT_POINTER_MODE_DEVICE;
  EXPECT_REFUSED(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm),
                 CUBLAS_STATUS_NOT_SUPPORTED, "CUBLASLT_MATMUL_DESC_POINTER_MODE");
  cublasOperation_t opc = CUBLAS_OP_C;
  EXPECT_REFUSED(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opc, sizeof opc),
                 CUBLAS_STATUS_NOT_SUPPORTED, "CUBLASLT_MATMUL_DESC_TRANSA");
  int64_t wide = CUBLAS_OP_T;
  EXPECT_REFUSED(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &wide, sizeof wide),
                 CUBLAS_STATUS_INVALID_VALUE, "CUBLASLT_MATMUL_DESC_TRANSB", "int32_t");
  cublasLtMatrixLayout_t l = nullptr;
  EXPECT_REFUSED(cublasLtMatrixLayoutCreate(&l, CUDA_R_16F, 4, 4, 4), CUBLAS_STATUS_NOT_SUPPORTED,
                 "cublasLtMatrixLayoutCreate", "CUDA_R_16F");
  REQUIRE(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 4, 4, 4) == CUBLAS_STATUS_SUCCESS);
  int32_t batch = 2;
  EXPECT_REFUSED(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatrixLayoutSetAttribute", "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT");
  cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulPreference_t pref = nullptr;
  REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS);
  uint32_t mode = 0;
  EXPECT_REFUSED(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof mode),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulPreferenceSetAttribute", "CUBLASLT_MATMUL_PREF_SEARCH_MODE");
  uint32_t odd = 12;
  EXPECT_REFUSED(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &odd, sizeof odd),
      CUBLAS_STATUS_NOT_SUPPORTED, "MIN_ALIGNMENT_B_BYTES = 12");
  uint32_t small_ws = 5;
  EXPECT_REFUSED(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &small_ws, sizeof small_ws),
      CUBLAS_STATUS_INVALID_VALUE, "MAX_WORKSPACE_BYTES", "uint64_t");
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(op);
  EXPECT_REFUSED(cublasLtMatmulDescDestroy(op), CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescDestroy", "not a live");
}

TEST_CASE("type combinations and shapes the layouts do not support are refused by the heuristic") {
  cublasLtHandle_t h = nullptr;
  REQUIRE(cublasLtCreate(&h) == 0);
  cublasLtMatmulDesc_t op = nullptr;
  REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0);
  cublasLtMatmulPreference_t pref = nullptr;
  REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == 0);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  cublasLtMatrixLayout_t a32, b32, d16, a16, bad_k, short_ld;
  REQUIRE(cublasLtMatrixLayoutCreate(&a32, CUDA_R_32F, 4, 3, 4) == 0);
  REQUIRE(cublasLtMatrixLayoutCreate(&b32, CUDA_R_32F, 3, 2, 3) == 0);
  REQUIRE(cublasLtMatrixLayoutCreate(&d16, CUDA_R_16BF, 4, 2, 4) == 0);
  REQUIRE(cublasLtMatrixLayoutCreate(&a16, CUDA_R_16BF, 4, 3, 4) == 0);
  REQUIRE(cublasLtMatrixLayoutCreate(&bad_k, CUDA_R_32F, 5, 2, 5) == 0);
  REQUIRE(cublasLtMatrixLayoutCreate(&short_ld, CUDA_R_32F, 4, 3, 3) == 0);
  // f32 x f32 -> bf16: not a combination cuBLASLt (or meshtrain) has under COMPUTE_32F.
  EXPECT_REFUSED(cublasLtMatmulAlgoGetHeuristic(h, op, a32, b32, d16, d16, pref, 1, &r, &found),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmulAlgoGetHeuristic", "CUDA_R_32F", "CUDA_R_16BF");
  // bf16 A with f32 B.
  EXPECT_REFUSED(cublasLtMatmulAlgoGetHeuristic(h, op, a16, b32, d16, d16, pref, 1, &r, &found),
                 CUBLAS_STATUS_NOT_SUPPORTED, "A is CUDA_R_16BF but B is CUDA_R_32F");
  // k of op(A) (3) is not k of op(B) (5).
  cublasLtMatrixLayout_t d32;
  REQUIRE(cublasLtMatrixLayoutCreate(&d32, CUDA_R_32F, 4, 2, 4) == 0);
  EXPECT_REFUSED(cublasLtMatmulAlgoGetHeuristic(h, op, a32, bad_k, d32, d32, pref, 1, &r, &found),
                 CUBLAS_STATUS_INVALID_VALUE, "shapes disagree");
  EXPECT_REFUSED(cublasLtMatmulAlgoGetHeuristic(h, op, short_ld, b32, d32, d32, pref, 1, &r, &found),
                 CUBLAS_STATUS_INVALID_VALUE, "Adesc", "leading dimension 3");
  for (auto l : {a32, b32, d16, a16, bad_k, short_ld, d32}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
}

// FP8 as matmul.cu's fp8_matmul makes it: A (k x m) transposed, B (k x n), both K contiguous; D (m x n).
struct Fp8Plan {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  Fp8Plan(bool transa, bool transb, int m, int n, int k, cudaDataType_t at, cudaDataType_t bt, cudaDataType_t dt,
          int32_t mode, const float* sa, const float* sb) {
    REQUIRE(cublasLtCreate(&h) == 0);
    REQUIRE(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0);
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa) == 0);
    REQUIRE(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&a, at, transa ? k : m, transa ? m : k, transa ? k : m) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&b, bt, transb ? n : k, transb ? k : n, transb ? n : k) == 0);
    REQUIRE(cublasLtMatrixLayoutCreate(&d, dt, m, n, m) == 0);
    REQUIRE(cublasLtMatmulPreferenceCreate(&pref) == 0);
    uint64_t ws = 0;
    REQUIRE(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) == 0);
  }
  cublasStatus_t heuristic(cublasLtMatmulAlgo_t* algo) {
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(h, op, a, b, d, d, pref, 1, &r, &found);
    *algo = r.algo;
    return s;
  }
  ~Fp8Plan() {
    cublasLtMatmulPreferenceDestroy(pref);
    for (auto l : {a, b, d}) cublasLtMatrixLayoutDestroy(l);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(h);
  }
};

TEST_CASE("FP8: E4M3 x E5M2 TN with scalar and outer-vector scales, bf16 and f32 out; what Hopper refuses") {
  const int m = 32, n = 16, k = 48;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> code(0, 255);
  Dev A(size_t(m * k)), B(size_t(n * k)), sa(4 * m), sb(4 * n), D(size_t(m * n) * 4);
  for (int i = 0; i < m * k; ++i) A.as<uint8_t>()[i] = uint8_t(code(rng) & 0xb7);  // no NaN, no inf, moderate
  for (int i = 0; i < n * k; ++i) B.as<uint8_t>()[i] = uint8_t(code(rng) & 0x9b);
  for (int i = 0; i < m; ++i) sa.as<float>()[i] = 0.5f + 0.125f * float(i % 5);
  for (int j = 0; j < n; ++j) sb.as<float>()[j] = 2.0f - 0.25f * float(j % 3);
  for (int32_t mode : {int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F), int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F)})
    for (cudaDataType_t dt : {CUDA_R_16BF, CUDA_R_32F}) {
      CAPTURE(mode);
      const bool vec = mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      Fp8Plan p(true, false, m, n, k, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, dt, mode, sa.as<float>(), sb.as<float>());
      cublasLtMatmulAlgo_t algo{};
      REQUIRE(p.heuristic(&algo) == 0);
      const float alpha = 1, beta = 0;
      REQUIRE(cublasLtMatmul(p.h, p.op, &alpha, A.p, p.a, B.p, p.b, &beta, D.p, p.d, D.p, p.d, &algo, nullptr, 0,
                             nullptr) == 0);
      double worst = 0;
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
          double acc = 0;  // A transposed: element (i, l) at l + i k; B (l, j) at l + j k
          for (int l = 0; l < k; ++l)
            acc += double(mt::fp8::decode(A.as<uint8_t>()[l + i * k], mt::Fp8Format::e4m3)) *
                   double(mt::fp8::decode(B.as<uint8_t>()[l + j * k], mt::Fp8Format::e5m2));
          const double want = acc * sa.as<float>()[vec ? i : 0] * sb.as<float>()[vec ? j : 0];
          const double got = dt == CUDA_R_16BF ? from_bf16(D.as<uint16_t>()[i + j * m]) : D.as<float>()[i + j * m];
          worst = std::max(worst, std::fabs(got - want) / std::max(1.0, std::fabs(want)));
        }
      CHECK(worst < (dt == CUDA_R_16BF ? 4e-3 : 1e-6));
    }
  const int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  cublasLtMatmulAlgo_t algo{};
  {  // NN: not TN
    Fp8Plan p(false, false, m, n, k, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, scalar, sa.as<float>(), sb.as<float>());
    EXPECT_REFUSED(p.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED, "only TN");
  }
  {  // E5M2 x E5M2
    Fp8Plan p(true, false, m, n, k, CUDA_R_8F_E5M2, CUDA_R_8F_E5M2, CUDA_R_16BF, scalar, sa.as<float>(), sb.as<float>());
    EXPECT_REFUSED(p.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED, "E5M2 x E5M2");
  }
  {  // k = 40: not a multiple of 16
    Fp8Plan p(true, false, m, n, 40, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, scalar, sa.as<float>(), sb.as<float>());
    EXPECT_REFUSED(p.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED, "multiple of 16");
  }
  {  // FP8 A with a bf16 B
    Fp8Plan p(true, false, m, n, k, CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF, scalar, sa.as<float>(), sb.as<float>());
    EXPECT_REFUSED(p.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED, "FP8 needs both FP8");
  }
  {  // scales on a bf16 GEMM
    Fp8Plan p(true, false, m, n, k, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, scalar, sa.as<float>(), sb.as<float>());
    EXPECT_REFUSED(p.heuristic(&algo), CUBLAS_STATUS_NOT_SUPPORTED, "FP8 operands only");
  }
}

TEST_CASE("operands outside device memory, misaligned, aliasing, or with a foreign algorithm are refused") {
  const int m = 4, n = 4, k = 4;
  std::mt19937 rng(5);
  Mat A(CUDA_R_32F, m, k, m), B(CUDA_R_32F, k, n, k), D(CUDA_R_32F, m, n, m);
  A.fill(rng), B.fill(rng), D.fill(rng);
  Plan p(false, false, m, n, k, CUDA_R_32F, CUDA_R_32F, m, k, m, m, 4096, 16);
  Dev ws(4096);
  float alpha = 1, beta = 1;
  auto mm = [&](const void* a, const void* b, const void* c, void* d, const cublasLtMatmulAlgo_t* algo, void* w,
                size_t wn, const void* al = nullptr, const void* be = nullptr) {
    return cublasLtMatmul(p.h, p.op, al ? al : &alpha, a, p.a, b, p.b, be ? be : &beta, c, p.c, d, p.d, algo, w, wn,
                          nullptr);
  };
  std::vector<float> host(64, 1.0f);
  // Host buffers, each operand named.
  EXPECT_REFUSED(mm(host.data(), B.dev.p, D.dev.p, D.dev.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "cublasLtMatmul", "A", "not device memory");
  EXPECT_REFUSED(mm(A.dev.p, host.data(), D.dev.p, D.dev.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "cublasLtMatmul", "B", "not device memory");
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, host.data(), D.dev.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "cublasLtMatmul", "C", "not device memory");
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, host.data(), &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "cublasLtMatmul", "D", "not device memory");
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &p.algo, host.data(), 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "cublasLtMatmul", "workspace");
  // Past the end of an allocation: A starting 16 bytes in runs 16 bytes past its end.
  EXPECT_REFUSED(mm(A.dev.as<float>() + 4, B.dev.p, D.dev.p, D.dev.p, &p.algo, ws.p, 4096),
                 CUBLAS_STATUS_INVALID_VALUE, "A", "runs past its allocation");
  // Less aligned than the preference promised (16 bytes).
  Dev big(256);
  EXPECT_REFUSED(mm(big.as<float>() + 1, B.dev.p, D.dev.p, D.dev.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "A", "MIN_ALIGNMENT_A_BYTES = 16");
  // D overlapping A; C partly overlapping D.
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, A.dev.p, A.dev.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE, "overlaps");
  Dev cd(256);
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, cd.as<float>() + 4, cd.p, &p.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "partly overlaps");
  // A short workspace, or none.
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &p.algo, ws.p, 100), CUBLAS_STATUS_INVALID_VALUE,
                 "workspaceSizeInBytes 100");
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &p.algo, nullptr, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "workspace is null");
  // alpha in device memory under the host pointer mode.
  Dev dalpha(4);
  *dalpha.as<float>() = 1;
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &p.algo, ws.p, 4096, dalpha.p), CUBLAS_STATUS_INVALID_VALUE,
                 "CUBLASLT_POINTER_MODE_HOST");
  // An algorithm never returned by the heuristic, and one of another problem.
  cublasLtMatmulAlgo_t junk{};
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &junk, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "not returned by cublasLtMatmulAlgoGetHeuristic");
  Plan other(true, false, m, n, k, CUDA_R_32F, CUDA_R_32F, k, k, m, m, 4096, 16);
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, &other.algo, ws.p, 4096), CUBLAS_STATUS_INVALID_VALUE,
                 "another problem");
  EXPECT_REFUSED(mm(A.dev.p, B.dev.p, D.dev.p, D.dev.p, nullptr, ws.p, 4096), CUBLAS_STATUS_NOT_SUPPORTED,
                 "algo is null");
  // Nothing written by any refused call.
  for (size_t i = 0; i < D.val.size(); ++i) CHECK(D.get(i) == D.val[i]);
  // A destroyed handle.
  cublasLtHandle_t dead = nullptr;
  REQUIRE(cublasLtCreate(&dead) == 0);
  REQUIRE(cublasLtDestroy(dead) == 0);
  EXPECT_REFUSED(cublasLtMatmul(dead, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d,
                                &p.algo, ws.p, 4096, nullptr),
                 CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtHandle_t");
}

TEST_CASE("stream order: a GEMM reading what another stream wrote without an event is a hazard") {
  const int m = 8, n = 8, k = 8;
  std::mt19937 rng(9);
  Mat A(CUDA_R_32F, m, k, m), B(CUDA_R_32F, k, n, k), D(CUDA_R_32F, m, n, m);
  A.fill(rng), B.fill(rng);
  Plan p(false, false, m, n, k, CUDA_R_32F, CUDA_R_32F, m, k, m, m, 1024, 16);
  Dev ws(1024);
  cudaStream_t s1, s2;
  REQUIRE(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == 0);
  REQUIRE(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == 0);
  float alpha = 1, beta = 0;
  // A written on s1, read by the GEMM on s2 with no ordering.
  REQUIRE(cudaMemsetAsync(A.dev.p, 0, 4, s1) == cudaSuccess);
  {
    const long long before = emu::reports();
    CaptureStderr cap;
    const auto rc = cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d,
                                   &p.algo, ws.p, 1024, s2);
    const std::string text = cap.text();
    CHECK(rc != CUBLAS_STATUS_SUCCESS);
    CHECK(emu::reports() > before);
    CHECK(text.find("cublasLtMatmul") != std::string::npos);
    CHECK(text.find("hazard") != std::string::npos);
  }
  // Ordered by an event: accepted.
  cudaEvent_t e;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == 0);
  REQUIRE(cudaEventRecord(e, s1) == 0);
  REQUIRE(cudaStreamWaitEvent(s2, e, 0) == 0);
  cudaDeviceSynchronize();
  const long long before = emu::reports();
  CHECK(cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d, &p.algo, ws.p,
                       1024, s2) == CUBLAS_STATUS_SUCCESS);
  // The shared workspace, used next on s1 with no ordering after s2's GEMM: a write-after-write hazard.
  {
    CaptureStderr cap;
    const auto rc = cublasLtMatmul(p.h, p.op, &alpha, A.dev.p, p.a, B.dev.p, p.b, &beta, D.dev.p, p.c, D.dev.p, p.d,
                                   &p.algo, ws.p, 1024, s1);
    const std::string text = cap.text();
    CHECK(rc != CUBLAS_STATUS_SUCCESS);
    CHECK(text.find("hazard") != std::string::npos);
  }
  CHECK(emu::reports() > before);
  cudaDeviceSynchronize();
  cudaEventDestroy(e);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

TEST_CASE("status names and strings") {
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_SUCCESS)) == "CUBLAS_STATUS_SUCCESS");
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED)) == "CUBLAS_STATUS_NOT_SUPPORTED");
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE)) == "CUBLAS_STATUS_INVALID_VALUE");
  CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_SUCCESS)) == "success");
  CHECK(std::string(cublasGetStatusName(cublasStatus_t(99))) == "CUBLAS_STATUS_UNKNOWN");
}
