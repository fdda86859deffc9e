// The cuDNN stand-in (tests/emu/cudnn_emu.cpp) refuses misuse with the real library's status codes: an attribute of
// the wrong type or another descriptor's, a set after finalize, a required attribute unset, dims and strides of
// different ranks, a matmul whose shapes do not compose, a descriptor not finalized, and at execute a uid missing
// from the variant pack, a pointer less aligned than its tensor promised, strides reaching past the allocation
// (reported by the device registry too). A small graph (C = A B) runs and is checked against a triple loop.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <cudnn_graph.h>
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <vector>

#include "tests/emu/stand_in_test.h"

namespace {

using Dims = std::array<int64_t, 4>;

cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t t) {
  cudnnBackendDescriptor_t d = nullptr;
  REQUIRE(cudnnBackendCreateDescriptor(t, &d) == CUDNN_STATUS_SUCCESS);
  return d;
}

// A tensor descriptor, finalized; returns the status of the finalize.
cudnnStatus_t tensor(cudnnBackendDescriptor_t* out, int64_t uid, Dims dims, Dims strides, int64_t align = 4,
                     int64_t n_strides = 4) {
  *out = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  cudnnDataType_t f = CUDNN_DATA_FLOAT;
  REQUIRE(cudnnBackendSetAttribute(*out, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f) == 0);
  REQUIRE(cudnnBackendSetAttribute(*out, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data()) == 0);
  REQUIRE(cudnnBackendSetAttribute(*out, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, n_strides, strides.data()) == 0);
  REQUIRE(cudnnBackendSetAttribute(*out, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid) == 0);
  REQUIRE(cudnnBackendSetAttribute(*out, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align) == 0);
  return cudnnBackendFinalize(*out);
}

cudnnStatus_t matmul_op(cudnnBackendDescriptor_t* op, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                        cudnnBackendDescriptor_t c) {
  cudnnBackendDescriptor_t mm = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  cudnnDataType_t f = CUDNN_DATA_FLOAT;
  REQUIRE(cudnnBackendSetAttribute(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f) == 0);
  REQUIRE(cudnnBackendFinalize(mm) == 0);
  *op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  cudnnBackendSetAttribute(*op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
  cudnnBackendSetAttribute(*op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
  cudnnBackendSetAttribute(*op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
  cudnnBackendSetAttribute(*op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
  return cudnnBackendFinalize(*op);
}

// C (1, 1, M, N) = A (1, 1, M, K) B (1, 1, K, N), f32, as a plan: what each execute-time check runs against.
struct Gemm {
  static constexpr int64_t M = 3, K = 4, N = 5;
  cudnnHandle_t h = nullptr;
  cudnnBackendDescriptor_t plan = nullptr;
  Gemm(Dims b_strides = {K * N, K * N, N, 1}) {
    REQUIRE(cudnnCreate(&h) == CUDNN_STATUS_SUCCESS);
    cudnnBackendDescriptor_t a, b, c, op;
    REQUIRE(tensor(&a, 1, {1, 1, M, K}, {M * K, M * K, K, 1}) == 0);
    REQUIRE(tensor(&b, 2, {1, 1, K, N}, b_strides) == 0);
    REQUIRE(tensor(&c, 3, {1, 1, M, N}, {M * N, M * N, N, 1}) == 0);
    REQUIRE(matmul_op(&op, a, b, c) == 0);
    cudnnBackendDescriptor_t g = create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    REQUIRE(cudnnBackendSetAttribute(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &op) == 0);
    REQUIRE(cudnnBackendFinalize(g) == 0);
    cudnnBackendDescriptor_t heur = create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g);
    cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    REQUIRE(cudnnBackendFinalize(heur) == 0);
    cudnnBackendDescriptor_t cfg = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    int64_t n = 0;
    REQUIRE(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &cfg) ==
            0);
    REQUIRE(n == 1);
    plan = create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg);
    REQUIRE(cudnnBackendFinalize(plan) == 0);
  }
  cudnnStatus_t execute(std::vector<int64_t> uids, std::vector<void*> ptrs, void* ws) {
    cudnnBackendDescriptor_t vp = create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()),
                             uids.data());
    cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()),
                             ptrs.data());
    cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    REQUIRE(cudnnBackendFinalize(vp) == 0);
    return cudnnBackendExecute(h, plan, vp);
  }
};

}  // namespace

TEST_CASE("cudnn stand-in: descriptors refuse misuse with cuDNN's status codes") {
  cudnnBackendDescriptor_t t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  int64_t uid = 1;
  float wrong = 1;
  CHECK(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_FLOAT, 1, &wrong) ==
        CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE);
  CHECK(cudnnBackendSetAttribute(t, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_INT64, 1, &uid) == CUDNN_STATUS_BAD_PARAM);
  CHECK(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid) == CUDNN_STATUS_SUCCESS);
  CHECK(cudnnBackendFinalize(t) == CUDNN_STATUS_BAD_PARAM);  // dims, strides, type, alignment unset
  cudnnBackendDescriptor_t bad;
  CHECK(tensor(&bad, 2, {1, 1, 2, 2}, {4, 4, 2, 1}, 4, /*n_strides=*/3) == CUDNN_STATUS_BAD_PARAM);
  CHECK(tensor(&bad, 2, {1, 1, 2, 2}, {4, 4, 0, 1}) == CUDNN_STATUS_BAD_PARAM);  // a zero stride
  CHECK(tensor(&bad, 2, {1, 1, 2, 2}, {4, 4, 2, 1}, 3) == CUDNN_STATUS_BAD_PARAM);  // alignment not a power of 2
  cudnnBackendDescriptor_t a, b, c, op;
  REQUIRE(tensor(&a, 1, {1, 1, 3, 4}, {12, 12, 4, 1}) == 0);
  REQUIRE(tensor(&b, 2, {1, 1, 5, 4}, {20, 20, 4, 1}) == 0);  // K 5, A's is 4
  REQUIRE(tensor(&c, 3, {1, 1, 3, 4}, {12, 12, 4, 1}) == 0);
  CHECK(matmul_op(&op, a, b, c) == CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH);
  int64_t one = 1;
  CHECK(cudnnBackendSetAttribute(a, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &one) ==
        CUDNN_STATUS_BAD_PARAM);  // finalized
  cudnnBackendDescriptor_t unfinished = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  CHECK(matmul_op(&op, a, unfinished, c) == CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED);
}

TEST_CASE("cudnn stand-in: a plan runs, and execute checks the variant pack and the pointers") {
  Gemm g;
  constexpr int64_t M = Gemm::M, K = Gemm::K, N = Gemm::N;
  Dev A(M * K * 4), B(K * N * 4), C(M * N * 4), ws(256), small(8);
  for (int64_t i = 0; i < M * K; ++i) A.as<float>()[i] = float(i % 7) - 3;
  for (int64_t i = 0; i < K * N; ++i) B.as<float>()[i] = float(i % 5) - 2;
  REQUIRE(g.execute({1, 2, 3}, {A.p, B.p, C.p}, ws.p) == CUDNN_STATUS_SUCCESS);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k) want += double(A.as<float>()[m * K + k]) * B.as<float>()[k * N + n];
      CHECK(C.as<float>()[m * N + n] == float(want));
    }
  CHECK(g.execute({1, 2}, {A.p, B.p}, ws.p) == CUDNN_STATUS_BAD_PARAM);  // C's uid missing
  CHECK(g.execute({1, 2, 3}, {A.p, static_cast<char*>(B.p) + 2, C.p}, ws.p) ==
        CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER);
  EXPECT_REPORTED(g.execute({1, 2, 3}, {A.p, small.p, C.p}, ws.p), CUDNN_STATUS_EXECUTION_FAILED, "uid 2");
  EXPECT_REPORTED(g.execute({1, 2, 3}, {A.p, B.p, C.p}, small.p), CUDNN_STATUS_BAD_PARAM, "workspace");
  // Strides that reach past B's allocation (a row stride of 2 N): the registry names the tensor.
  Gemm wide({2 * K * N, 2 * K * N, 2 * N, 1});
  EXPECT_REPORTED(wide.execute({1, 2, 3}, {A.p, B.p, C.p}, ws.p), CUDNN_STATUS_EXECUTION_FAILED, "uid 2");
}
