// cuBLASLt stand-in for the emulated CUDA device (build option -Demulate_cuda=true): exactly the part of the
// cuBLASLt API that runtime/kernels/cuda/matmul.cu calls, plus cublasGetStatusName/String (runtime/core,
// runtime/kernels/cuda/common.cu), with the signatures of the real cublasLt.h / cublas_api.h.
//
// Semantics follow NVIDIA's cuBLASLt documentation: column-major matrices, D = alpha op(A) op(B) + beta C with
// op from CUBLASLT_MATMUL_DESC_TRANSA/B, leading dimensions from the layouts, C not read when beta is 0, C may
// be D (in place, same layout). The product runs at once on the calling thread ("on the stream": every
// operation of the emulated device runs when it is enqueued), accumulating in double (wider than the f32 that
// CUBLAS_COMPUTE_32F asks for), the epilogue alpha acc + beta C in f32, rounded to D's type (bf16: to nearest
// even).
//
// Only what meshtrain uses is accepted; anything else is reported (emu::report: "[cuda-emu] CALL: WHAT") and
// refused with CUBLAS_STATUS_NOT_SUPPORTED, never guessed at:
//   cublasLtMatmulDescCreate        compute CUBLAS_COMPUTE_32F, scale CUDA_R_32F
//   cublasLtMatmulDescSetAttribute  CUBLASLT_MATMUL_DESC_TRANSA / _TRANSB (int32_t: CUBLAS_OP_N or CUBLAS_OP_T)
//   cublasLtMatrixLayoutCreate      CUDA_R_32F or CUDA_R_16BF (column-major, batch 1; any
//                                   cublasLtMatrixLayoutSetAttribute is refused)
//   cublasLtMatmulPreferenceSetAttribute  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES (uint64_t),
//                                   CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES (uint32_t, power of 2 <= 256)
//   type combinations (C = D): bf16 x bf16 -> bf16 or f32, f32 x f32 -> f32; FP8 (CUDA_R_8F_E4M3 / _E5M2, not both
//   E5M2) -> bf16 or f32, only TN (transa T, transb N: what Hopper takes), m, n, k and the lds multiples of 16
//   CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / _B_SCALE_POINTER (device f32, FP8 only; default 1) and
//   CUBLASLT_MATMUL_DESC_A_SCALE_MODE / _B_SCALE_MODE (SCALAR_32F, or OUTER_VEC_32F: A's m and B's n scales, both
//   the same mode): D = alpha (acc scale_A[i] scale_B[j]) + beta C, acc rounded to f32 first
// Checks beyond the types: every descriptor handle is live; the layouts agree with op(A) (m x k), op(B) (k x n),
// C = D (m x n) and ld >= rows; A, B, C (when beta != 0), D and the workspace lie inside live device
// allocations (emu::check_device_range), alpha and beta are host memory (the default host pointer mode), D
// overlaps neither A nor B, C is either D itself (same layout) or disjoint from it; the algorithm passed to
// cublasLtMatmul is one the heuristic returned for this very problem, every pointer is aligned as the
// preference promised (MIN_ALIGNMENT_*), and the workspace is as large as the algorithm asked for. The
// algorithm is taken to use all of the workspace the preference allowed (an upper bound of what a real one
// may use), and that is recorded as a write on the stream, so two streams sharing one workspace unordered show
// in the hazard tracker, as do A, B (and C) read and D written (emu::note_read / note_write).
#include <cublasLt.h>
#include <cublas_api.h>

#include <cinttypes>
#include <cstdarg>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "runtime/core/dtype.h"
#include "runtime/core/fp8.h"
#include "tests/emu/device_registry.h"

namespace {

// ---------------------------------------------------------------- descriptors

struct LtContext {
  int device = 0;
};
struct MatmulDesc {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  const float* a_scale = nullptr;  // device pointers (FP8): null = 1
  const float* b_scale = nullptr;
  int32_t a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
};
struct Layout {
  cudaDataType_t type = CUDA_R_32F;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
};
struct Preference {
  uint64_t max_workspace = 0;      // default: no workspace allowed
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D; default 256
};

// Live objects of each kind: a destroyed or never-created handle is reported, not dereferenced.
std::mutex g_mu;
std::unordered_set<const void*> g_handles, g_descs, g_layouts, g_prefs;

using emu::strf;

cublasStatus_t refuse(const char* call, const std::string& what, cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED) {
  emu::report(call, what + " (cuBLASLt stand-in, tests/emu/cublaslt_emu.cpp)");
  return s;
}

template <typename T> T* live(const std::unordered_set<const void*>& set, const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  return set.count(p) ? static_cast<T*>(const_cast<void*>(p)) : nullptr;
}

const char* type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F:
      return "CUDA_R_32F";
    case CUDA_R_16BF:
      return "CUDA_R_16BF";
    case CUDA_R_16F:
      return "CUDA_R_16F";
    case CUDA_R_64F:
      return "CUDA_R_64F";
    case CUDA_R_8I:
      return "CUDA_R_8I";
    case CUDA_R_32I:
      return "CUDA_R_32I";
    case CUDA_R_8F_E4M3:
      return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2:
      return "CUDA_R_8F_E5M2";
    default:
      return "another cudaDataType_t";
  }
}
bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
size_t type_size(cudaDataType_t t) { return is_fp8(t) ? 1 : t == CUDA_R_16BF ? 2 : 4; }

#define MT_NAME(x) \
  case x:          \
    return #x;
// Names of the attributes (those of CUDA 12.0 on; a newer one shows as its number).
const char* desc_attr_name(cublasLtMatmulDescAttributes_t a) {
  switch (a) {
    MT_NAME(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE)
    MT_NAME(CUBLASLT_MATMUL_DESC_SCALE_TYPE)
    MT_NAME(CUBLASLT_MATMUL_DESC_POINTER_MODE)
    MT_NAME(CUBLASLT_MATMUL_DESC_TRANSA)
    MT_NAME(CUBLASLT_MATMUL_DESC_TRANSB)
    MT_NAME(CUBLASLT_MATMUL_DESC_TRANSC)
    MT_NAME(CUBLASLT_MATMUL_DESC_FILL_MODE)
    MT_NAME(CUBLASLT_MATMUL_DESC_EPILOGUE)
    MT_NAME(CUBLASLT_MATMUL_DESC_BIAS_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE)
    MT_NAME(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)
    MT_NAME(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE)
    MT_NAME(CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE)
    MT_NAME(CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET)
    MT_NAME(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_C_SCALE_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER)
    MT_NAME(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE)
    MT_NAME(CUBLASLT_MATMUL_DESC_FAST_ACCUM)
    MT_NAME(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE)
    default:
      return "an attribute";
  }
}
const char* pref_attr_name(cublasLtMatmulPreferenceAttributes_t a) {
  switch (a) {
    MT_NAME(CUBLASLT_MATMUL_PREF_SEARCH_MODE)
    MT_NAME(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
    MT_NAME(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK)
    MT_NAME(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES)
    MT_NAME(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES)
    MT_NAME(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES)
    MT_NAME(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES)
    MT_NAME(CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT)
    MT_NAME(CUBLASLT_MATMUL_PREF_IMPL_MASK)
    default:
      return "an attribute";
  }
}
const char* layout_attr_name(cublasLtMatrixLayoutAttribute_t a) {
  switch (a) {
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_TYPE)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_ORDER)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_ROWS)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_COLS)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_LD)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)
    MT_NAME(CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET)
    default:
      return "an attribute";
  }
}
#undef MT_NAME

// ---------------------------------------------------------------- the problem

// The algorithm handed out by the heuristic: a tag, the problem it was chosen for, the alignments the
// preference promised and the workspace it takes.
constexpr uint64_t kAlgoTag = 0x4d54454d55414c47ull;  // "MTEMUALG"

struct Problem {
  int32_t transa, transb;
  cudaDataType_t a_type, d_type;
  uint64_t m, n, k;
  cudaDataType_t b_type;
  int32_t scale_mode;
};

uint64_t problem_key(const Problem& p) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(uint64_t(p.transa)), mix(uint64_t(p.transb)), mix(uint64_t(p.a_type)), mix(uint64_t(p.d_type));
  mix(p.m), mix(p.n), mix(p.k), mix(uint64_t(p.b_type)), mix(uint64_t(p.scale_mode));
  return h;
}

// Checks the descriptor and the four layouts describe one supported problem; fills `out`.
cublasStatus_t check_problem(const char* call, cublasLtMatmulDesc_t op_h, cublasLtMatrixLayout_t a_h,
                             cublasLtMatrixLayout_t b_h, cublasLtMatrixLayout_t c_h, cublasLtMatrixLayout_t d_h,
                             Problem* out) {
  auto* op = live<MatmulDesc>(g_descs, op_h);
  if (!op) return refuse(call, strf("matmul descriptor %p is not a live cublasLtMatmulDesc_t", (void*)op_h),
                         CUBLAS_STATUS_INVALID_VALUE);
  const Layout* l[4];
  const char* names[4] = {"Adesc", "Bdesc", "Cdesc", "Ddesc"};
  cublasLtMatrixLayout_t hs[4] = {a_h, b_h, c_h, d_h};
  for (int i = 0; i < 4; ++i) {
    l[i] = live<Layout>(g_layouts, hs[i]);
    if (!l[i])
      return refuse(call, strf("%s %p is not a live cublasLtMatrixLayout_t", names[i], (void*)hs[i]),
                    CUBLAS_STATUS_INVALID_VALUE);
    if (l[i]->ld < 1 || uint64_t(l[i]->ld) < l[i]->rows)
      return refuse(call,
                    strf("%s: leading dimension %" PRId64 " is less than its %" PRIu64 " rows (column-major)", names[i],
                        l[i]->ld, l[i]->rows),
                    CUBLAS_STATUS_INVALID_VALUE);
  }
  const Layout &A = *l[0], &B = *l[1], &C = *l[2], &D = *l[3];
  const bool fp8 = is_fp8(A.type) || is_fp8(B.type);
  if (fp8) {
    // What Hopper's FP8 GEMMs take (cuBLASLt's documentation, cublasLtMatmul, FP8 type combinations): A and B FP8,
    // not both E5M2; TN; bf16 or f32 C = D; dims and leading dims multiples of 16.
    if (!is_fp8(A.type) || !is_fp8(B.type))
      return refuse(call, strf("A is %s but B is %s: FP8 needs both FP8", type_name(A.type), type_name(B.type)));
    if (A.type == CUDA_R_8F_E5M2 && B.type == CUDA_R_8F_E5M2)
      return refuse(call, "A and B both CUDA_R_8F_E5M2: no FP8 kernel takes E5M2 x E5M2");
    if (op->transa != CUBLAS_OP_T || op->transb != CUBLAS_OP_N)
      return refuse(call, strf("FP8 with transa %d transb %d: Hopper takes only TN (transa CUBLAS_OP_T, transb "
                               "CUBLAS_OP_N)", int(op->transa), int(op->transb)));
    if (C.type != D.type || (D.type != CUDA_R_16BF && D.type != CUDA_R_32F))
      return refuse(call, strf("FP8 with C %s, D %s: the stand-in takes C = D, bf16 or f32", type_name(C.type),
                               type_name(D.type)));
    if (A.rows % 16 || A.cols % 16 || B.rows % 16 || B.cols % 16 || A.ld % 16 || B.ld % 16 || D.ld % 16)
      return refuse(call, strf("FP8 with A %" PRIu64 " x %" PRIu64 " (ld %" PRId64 "), B %" PRIu64 " x %" PRIu64
                               " (ld %" PRId64 "), ldd %" PRId64 ": every dim and leading dim must be a multiple of 16",
                               A.rows, A.cols, A.ld, B.rows, B.cols, B.ld, D.ld));
    if (op->a_scale_mode != op->b_scale_mode)
      return refuse(call, strf("A's scale mode %d differs from B's %d (the stand-in takes both scalar or both "
                               "outer vectors)", int(op->a_scale_mode), int(op->b_scale_mode)));
  } else if (op->a_scale || op->b_scale || op->a_scale_mode || op->b_scale_mode) {
    return refuse(call, strf("scale pointers or modes with A %s: the stand-in scales FP8 operands only",
                             type_name(A.type)));
  }
  if (!fp8 && A.type != B.type)
    return refuse(call, strf("A is %s but B is %s (the stand-in takes A and B of one type)", type_name(A.type),
                            type_name(B.type)));
  if (C.type != D.type)
    return refuse(call, strf("C is %s but D is %s (C and D must have one type)", type_name(C.type), type_name(D.type)));
  const bool ok = fp8 || (A.type == CUDA_R_16BF && (D.type == CUDA_R_16BF || D.type == CUDA_R_32F)) ||
                  (A.type == CUDA_R_32F && D.type == CUDA_R_32F);
  if (!ok)
    return refuse(call, strf("A/B %s with C/D %s under CUBLAS_COMPUTE_32F is not a combination meshtrain uses "
                            "(bf16 -> bf16, bf16 -> f32, f32 -> f32)",
                            type_name(A.type), type_name(D.type)));
  const uint64_t m = D.rows, n = D.cols;
  const uint64_t a_m = op->transa == CUBLAS_OP_N ? A.rows : A.cols, k = op->transa == CUBLAS_OP_N ? A.cols : A.rows;
  const uint64_t b_k = op->transb == CUBLAS_OP_N ? B.rows : B.cols, b_n = op->transb == CUBLAS_OP_N ? B.cols : B.rows;
  if (a_m != m || b_k != k || b_n != n)
    return refuse(call,
                  strf("shapes disagree: op(A) is %" PRIu64 " x %" PRIu64 ", op(B) %" PRIu64 " x %" PRIu64
                      ", D %" PRIu64 " x %" PRIu64 " (need op(A) m x k, op(B) k x n, D m x n)",
                      a_m, k, b_k, b_n, m, n),
                  CUBLAS_STATUS_INVALID_VALUE);
  if (C.rows != D.rows || C.cols != D.cols)
    return refuse(call,
                  strf("C is %" PRIu64 " x %" PRIu64 " but D is %" PRIu64 " x %" PRIu64, C.rows, C.cols, D.rows, D.cols),
                  CUBLAS_STATUS_INVALID_VALUE);
  *out = Problem{op->transa, op->transb, A.type, D.type, m, n, k, B.type, op->a_scale_mode};
  return CUBLAS_STATUS_SUCCESS;
}

// Bytes a column-major matrix spans from its first element to its last.
size_t span_bytes(const Layout& l) {
  if (l.rows == 0 || l.cols == 0) return 0;
  return size_t((l.cols - 1) * uint64_t(l.ld) + l.rows) * type_size(l.type);
}

bool overlap(const void* p, size_t pn, const void* q, size_t qn) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return pn > 0 && qn > 0 && a < b + qn && b < a + pn;
}

// The runtime's host bf16 conversions (round to nearest even; NaN stays a quiet NaN).
float bf16_to_f32(uint16_t u) { return mt::bf16::to_float(u); }
uint16_t f32_to_bf16(float f) { return mt::bf16::from_float(f); }

float load(const void* base, cudaDataType_t t, size_t i) {
  if (is_fp8(t))
    return mt::fp8::decode(static_cast<const unsigned char*>(base)[i],
                           t == CUDA_R_8F_E4M3 ? mt::Fp8Format::e4m3 : mt::Fp8Format::e5m2);
  if (t == CUDA_R_16BF) {
    uint16_t u;
    std::memcpy(&u, static_cast<const unsigned char*>(base) + 2 * i, 2);
    return bf16_to_f32(u);
  }
  float f;
  std::memcpy(&f, static_cast<const unsigned char*>(base) + 4 * i, 4);
  return f;
}
void store(void* base, cudaDataType_t t, size_t i, float v) {
  if (t == CUDA_R_16BF) {
    const uint16_t u = f32_to_bf16(v);
    std::memcpy(static_cast<unsigned char*>(base) + 2 * i, &u, 2);
  } else {
    std::memcpy(static_cast<unsigned char*>(base) + 4 * i, &v, 4);
  }
}

int alignment_of(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && u % uintptr_t(a) != 0) a /= 2;
  return a;
}

}  // namespace

extern "C" {

// ---------------------------------------------------------------- statuses

const char* CUBLASWINAPI cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "a resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid value was passed (see the [cuda-emu] report on stderr)";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "the device does not support the operation";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "access to GPU memory failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the operation or a parameter is not supported (see the [cuda-emu] report on stderr)";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "license error";
  }
  return "unknown cuBLAS status";
}

// ---------------------------------------------------------------- handle

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (!lightHandle) return refuse("cublasLtCreate", "lightHandle is null", CUBLAS_STATUS_INVALID_VALUE);
  auto* c = new LtContext{emu::current_device()};
  std::lock_guard<std::mutex> lock(g_mu);
  g_handles.insert(c);
  *lightHandle = reinterpret_cast<cublasLtHandle_t>(c);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t lightHandle) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_handles.erase(lightHandle))
    return refuse("cublasLtDestroy", strf("%p is not a live cublasLtHandle_t", (void*)lightHandle),
                  CUBLAS_STATUS_NOT_INITIALIZED);
  delete reinterpret_cast<LtContext*>(lightHandle);
  return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- matmul descriptor

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                                     cudaDataType_t scaleType) {
  const char* call = "cublasLtMatmulDescCreate";
  if (!matmulDesc) return refuse(call, "matmulDesc is null", CUBLAS_STATUS_INVALID_VALUE);
  if (computeType != CUBLAS_COMPUTE_32F)
    return refuse(call, strf("compute type %d: only CUBLAS_COMPUTE_32F (68) is emulated", int(computeType)));
  if (scaleType != CUDA_R_32F)
    return refuse(call, strf("scale type %s (%d): only CUDA_R_32F is emulated", type_name(scaleType), int(scaleType)));
  auto* d = new MatmulDesc{computeType, scaleType, CUBLAS_OP_N, CUBLAS_OP_N};
  std::lock_guard<std::mutex> lock(g_mu);
  g_descs.insert(d);
  *matmulDesc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_descs.erase(matmulDesc))
    return refuse("cublasLtMatmulDescDestroy", strf("%p is not a live cublasLtMatmulDesc_t", (void*)matmulDesc),
                  CUBLAS_STATUS_INVALID_VALUE);
  delete reinterpret_cast<MatmulDesc*>(matmulDesc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                                           cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                           size_t sizeInBytes) {
  const char* call = "cublasLtMatmulDescSetAttribute";
  auto* d = live<MatmulDesc>(g_descs, matmulDesc);
  if (!d)
    return refuse(call, strf("%p is not a live cublasLtMatmulDesc_t", (void*)matmulDesc), CUBLAS_STATUS_INVALID_VALUE);
  if (attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER || attr == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER) {
    const char* name = attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER"
                                                                     : "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER";
    if (!buf || sizeInBytes != sizeof(void*))
      return refuse(call, strf("%s takes a const void*: buf %p, sizeInBytes %zu", name, buf, sizeInBytes),
                    CUBLAS_STATUS_INVALID_VALUE);
    const float* p;
    std::memcpy(&p, buf, sizeof p);
    (attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? d->a_scale : d->b_scale) = p;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE || attr == CUBLASLT_MATMUL_DESC_B_SCALE_MODE) {
    const char* name =
        attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE ? "CUBLASLT_MATMUL_DESC_A_SCALE_MODE" : "CUBLASLT_MATMUL_DESC_B_SCALE_MODE";
    if (!buf || sizeInBytes != sizeof(int32_t))
      return refuse(call, strf("%s takes an int32_t: buf %p, sizeInBytes %zu", name, buf, sizeInBytes),
                    CUBLAS_STATUS_INVALID_VALUE);
    int32_t v;
    std::memcpy(&v, buf, sizeof v);
    if (v != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F && v != CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F)
      return refuse(call, strf("%s = %d: only SCALAR_32F (0) and OUTER_VEC_32F (3) are emulated", name, int(v)));
    (attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE ? d->a_scale_mode : d->b_scale_mode) = v;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr != CUBLASLT_MATMUL_DESC_TRANSA && attr != CUBLASLT_MATMUL_DESC_TRANSB)
    return refuse(call, strf("%s (%d) is not emulated (only CUBLASLT_MATMUL_DESC_TRANSA, _TRANSB, _A/_B_SCALE_POINTER "
                             "and _A/_B_SCALE_MODE are: no epilogue, bias, pointer mode or fill mode)",
                             desc_attr_name(attr), int(attr)));
  const char* name = attr == CUBLASLT_MATMUL_DESC_TRANSA ? "CUBLASLT_MATMUL_DESC_TRANSA" : "CUBLASLT_MATMUL_DESC_TRANSB";
  if (!buf || sizeInBytes != sizeof(int32_t))
    return refuse(call, strf("%s takes an int32_t: buf %p, sizeInBytes %zu", name, buf, sizeInBytes),
                  CUBLAS_STATUS_INVALID_VALUE);
  int32_t v;
  std::memcpy(&v, buf, sizeof v);
  if (v != CUBLAS_OP_N && v != CUBLAS_OP_T)
    return refuse(call, strf("%s = %d: only CUBLAS_OP_N (0) and CUBLAS_OP_T (1) are emulated", name, int(v)));
  (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->transa : d->transb) = v;
  return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- layouts

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                                       uint64_t rows, uint64_t cols, int64_t ld) {
  const char* call = "cublasLtMatrixLayoutCreate";
  if (!matLayout) return refuse(call, "matLayout is null", CUBLAS_STATUS_INVALID_VALUE);
  if (type != CUDA_R_32F && type != CUDA_R_16BF && !is_fp8(type))
    return refuse(call, strf("type %s (%d): only CUDA_R_32F, CUDA_R_16BF and CUDA_R_8F_E4M3 / _E5M2 are emulated",
                             type_name(type), int(type)));
  auto* l = new Layout{type, rows, cols, ld};
  std::lock_guard<std::mutex> lock(g_mu);
  g_layouts.insert(l);
  *matLayout = reinterpret_cast<cublasLtMatrixLayout_t>(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_layouts.erase(matLayout))
    return refuse("cublasLtMatrixLayoutDestroy", strf("%p is not a live cublasLtMatrixLayout_t", (void*)matLayout),
                  CUBLAS_STATUS_INVALID_VALUE);
  delete reinterpret_cast<Layout*>(matLayout);
  return CUBLAS_STATUS_SUCCESS;
}

// meshtrain sets no layout attribute (column-major, batch 1, the rows, cols and ld of the create call): every
// one is refused, so that a batched or row-major layout added to matmul.cu shows here first.
cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                             cublasLtMatrixLayoutAttribute_t attr, const void*,
                                                             size_t) {
  const char* call = "cublasLtMatrixLayoutSetAttribute";
  if (!live<Layout>(g_layouts, matLayout))
    return refuse(call, strf("%p is not a live cublasLtMatrixLayout_t", (void*)matLayout), CUBLAS_STATUS_INVALID_VALUE);
  return refuse(call, strf("%s (%d) is not emulated (no layout attribute is: column-major, batch count 1)",
                           layout_attr_name(attr), int(attr)));
}

// ---------------------------------------------------------------- preference

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return refuse("cublasLtMatmulPreferenceCreate", "pref is null", CUBLAS_STATUS_INVALID_VALUE);
  auto* p = new Preference{};
  std::lock_guard<std::mutex> lock(g_mu);
  g_prefs.insert(p);
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(p);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_prefs.erase(pref))
    return refuse("cublasLtMatmulPreferenceDestroy", strf("%p is not a live cublasLtMatmulPreference_t", (void*)pref),
                  CUBLAS_STATUS_INVALID_VALUE);
  delete reinterpret_cast<Preference*>(pref);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                                 const void* buf, size_t sizeInBytes) {
  const char* call = "cublasLtMatmulPreferenceSetAttribute";
  auto* p = live<Preference>(g_prefs, pref);
  if (!p)
    return refuse(call, strf("%p is not a live cublasLtMatmulPreference_t", (void*)pref), CUBLAS_STATUS_INVALID_VALUE);
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (!buf || sizeInBytes != sizeof(uint64_t))
      return refuse(call,
                    strf("CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES takes a uint64_t: buf %p, sizeInBytes %zu", buf,
                        sizeInBytes),
                    CUBLAS_STATUS_INVALID_VALUE);
    std::memcpy(&p->max_workspace, buf, sizeof(uint64_t));
    return CUBLAS_STATUS_SUCCESS;
  }
  int slot = -1;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      slot = 0;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      slot = 1;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      slot = 2;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      slot = 3;
      break;
    default:
      return refuse(call, strf("%s (%d) is not emulated (only CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES and "
                               "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES are)",
                               pref_attr_name(attr), int(attr)));
  }
  const char name = "ABCD"[slot];
  if (!buf || sizeInBytes != sizeof(uint32_t))
    return refuse(call,
                  strf("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES takes a uint32_t: buf %p, sizeInBytes %zu", name,
                      buf, sizeInBytes),
                  CUBLAS_STATUS_INVALID_VALUE);
  uint32_t v;
  std::memcpy(&v, buf, sizeof v);
  if (v == 0 || v > 256 || (v & (v - 1)) != 0)
    return refuse(call, strf("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES = %u: only powers of two up to 256 are "
                            "emulated",
                            name, v));
  p->align[slot] = v;
  return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- heuristic

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle,
                                                           cublasLtMatmulDesc_t operationDesc,
                                                           cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                                           cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                                           cublasLtMatmulPreference_t preference,
                                                           int requestedAlgoCount,
                                                           cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                                           int* returnAlgoCount) {
  const char* call = "cublasLtMatmulAlgoGetHeuristic";
  if (!live<LtContext>(g_handles, lightHandle))
    return refuse(call, strf("%p is not a live cublasLtHandle_t", (void*)lightHandle), CUBLAS_STATUS_NOT_INITIALIZED);
  if (requestedAlgoCount <= 0 || !heuristicResultsArray || !returnAlgoCount)
    return refuse(call,
                  strf("requestedAlgoCount %d, heuristicResultsArray %p, returnAlgoCount %p", requestedAlgoCount,
                      (void*)heuristicResultsArray, (void*)returnAlgoCount),
                  CUBLAS_STATUS_INVALID_VALUE);
  auto* pref = live<Preference>(g_prefs, preference);
  if (!pref)
    return refuse(call, strf("%p is not a live cublasLtMatmulPreference_t", (void*)preference),
                  CUBLAS_STATUS_INVALID_VALUE);
  Problem pb{};
  if (auto s = check_problem(call, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, &pb)) return s;
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[0] = kAlgoTag;
  r.algo.data[1] = problem_key(pb);
  r.algo.data[2] = uint64_t(pref->align[0]) | uint64_t(pref->align[1]) << 16 | uint64_t(pref->align[2]) << 32 |
                   uint64_t(pref->align[3]) << 48;
  r.algo.data[3] = pref->max_workspace;
  r.workspaceSize = size_t(pref->max_workspace);
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  heuristicResultsArray[0] = r;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- matmul

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                                           const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                                           const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                                           const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                                           cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo,
                                           void* workspace, size_t workspaceSizeInBytes, cudaStream_t stream) {
  const char* call = "cublasLtMatmul";
  if (!live<LtContext>(g_handles, lightHandle))
    return refuse(call, strf("%p is not a live cublasLtHandle_t", (void*)lightHandle), CUBLAS_STATUS_NOT_INITIALIZED);
  {  // In a stream capture: this call, made at each replay with alpha's and beta's values now (host pointer mode
     // reads them when called) and the algorithm as it is now.
    float a4 = 0, b4 = 0;
    if (alpha && !emu::is_device_ptr(alpha, 4)) std::memcpy(&a4, alpha, 4);
    if (beta && !emu::is_device_ptr(beta, 4)) std::memcpy(&b4, beta, 4);
    const bool has_algo = algo != nullptr;
    const cublasLtMatmulAlgo_t al = has_algo ? *algo : cublasLtMatmulAlgo_t{};
    // The descriptor as it is now (its attributes, the FP8 scale pointers among them, may be set again before a
    // replay): a copy, registered and kept for the graph's life (never freed: a few bytes a captured call).
    cublasLtMatmulDesc_t desc = computeDesc;
    if (emu::record_if_capturing(stream, [] {})) {  // capturing: the no-op recorded first is harmless
      if (auto* d = live<MatmulDesc>(g_descs, computeDesc)) {
        std::lock_guard<std::mutex> lock(g_mu);
        auto* copy = new MatmulDesc(*d);
        g_descs.insert(copy);
        desc = reinterpret_cast<cublasLtMatmulDesc_t>(copy);
      }
      emu::record_if_capturing(stream, [=] {
        cublasLtMatmul(lightHandle, desc, alpha ? &a4 : nullptr, A, Adesc, B, Bdesc, beta ? &b4 : nullptr, C, Cdesc,
                       D, Ddesc, has_algo ? &al : nullptr, workspace, workspaceSizeInBytes, stream);
      });
      return CUBLAS_STATUS_SUCCESS;
    }
  }
  Problem pb{};
  if (auto s = check_problem(call, computeDesc, Adesc, Bdesc, Cdesc, Ddesc, &pb)) return s;
  const Layout &la = *reinterpret_cast<Layout*>(Adesc), &lb = *reinterpret_cast<Layout*>(Bdesc),
               &lc = *reinterpret_cast<Layout*>(Cdesc), &ld = *reinterpret_cast<Layout*>(Ddesc);

  // The algorithm: one the heuristic chose for this problem.
  if (!algo)
    return refuse(call, "algo is null: the stand-in runs only an algorithm from cublasLtMatmulAlgoGetHeuristic");
  if (algo->data[0] != kAlgoTag)
    return refuse(call, "algo was not returned by cublasLtMatmulAlgoGetHeuristic", CUBLAS_STATUS_INVALID_VALUE);
  if (algo->data[1] != problem_key(pb))
    return refuse(call,
                  strf("algo was chosen for another problem than this one (transa %d transb %d, m %" PRIu64
                      " n %" PRIu64 " k %" PRIu64 ", %s -> %s)",
                      int(pb.transa), int(pb.transb), pb.m, pb.n, pb.k, type_name(pb.a_type), type_name(pb.d_type)),
                  CUBLAS_STATUS_INVALID_VALUE);

  // Scalars: host memory in the default pointer mode, f32 (the scale type).
  if (!alpha || !beta) return refuse(call, "alpha or beta is null", CUBLAS_STATUS_INVALID_VALUE);
  if (emu::is_device_ptr(alpha, sizeof(float)) || emu::is_device_ptr(beta, sizeof(float)))
    return refuse(call, "alpha or beta is device memory, but the pointer mode is CUBLASLT_POINTER_MODE_HOST",
                  CUBLAS_STATUS_INVALID_VALUE);
  float alpha_f, beta_f;
  std::memcpy(&alpha_f, alpha, 4);
  std::memcpy(&beta_f, beta, 4);
  const bool read_c = beta_f != 0.0f;

  // Operands: inside live device allocations, aligned as the preference promised, D aliasing nothing but C.
  const size_t a_bytes = span_bytes(la), b_bytes = span_bytes(lb), c_bytes = span_bytes(lc), d_bytes = span_bytes(ld);
  if (!emu::check_device_range(A, a_bytes, call, "A")) return CUBLAS_STATUS_INVALID_VALUE;
  if (!emu::check_device_range(B, b_bytes, call, "B")) return CUBLAS_STATUS_INVALID_VALUE;
  if (read_c && !emu::check_device_range(C, c_bytes, call, "C")) return CUBLAS_STATUS_INVALID_VALUE;
  if (!emu::check_device_range(D, d_bytes, call, "D")) return CUBLAS_STATUS_INVALID_VALUE;
  const auto* desc = reinterpret_cast<const MatmulDesc*>(computeDesc);
  const bool vec = desc->a_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const size_t sa_n = vec ? size_t(pb.m) : 1, sb_n = vec ? size_t(pb.n) : 1;
  if (vec && (!desc->a_scale || !desc->b_scale))
    return refuse(call, "OUTER_VEC_32F scale mode without a scale pointer", CUBLAS_STATUS_INVALID_VALUE);
  if (desc->a_scale && !emu::check_device_range(desc->a_scale, 4 * sa_n, call, "A's scale"))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (desc->b_scale && !emu::check_device_range(desc->b_scale, 4 * sb_n, call, "B's scale"))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (pb.m > 0 && pb.n > 0 && pb.k > 0 && (!A || !B))
    return refuse(call, "A or B is null", CUBLAS_STATUS_INVALID_VALUE);
  if (pb.m > 0 && pb.n > 0 && (!D || (read_c && !C)))
    return refuse(call, "C or D is null", CUBLAS_STATUS_INVALID_VALUE);
  const void* ptrs[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i) {
    if (i == 2 && !read_c) continue;
    const uint32_t want = uint32_t(algo->data[2] >> (16 * i)) & 0xffffu;
    if (ptrs[i] && alignment_of(ptrs[i]) < int(want))
      return refuse(call,
                    strf("%c = %p is %d-byte aligned, but the algorithm was chosen for "
                        "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES = %u",
                        "ABCD"[i], ptrs[i], alignment_of(ptrs[i]), "ABCD"[i], want),
                  CUBLAS_STATUS_INVALID_VALUE);
  }
  if (overlap(D, d_bytes, A, a_bytes) || overlap(D, d_bytes, B, b_bytes))
    return refuse(call, strf("D %p (+%zu) overlaps A %p (+%zu) or B %p (+%zu): the output may not alias an input", D,
                            d_bytes, A, a_bytes, B, b_bytes),
                  CUBLAS_STATUS_INVALID_VALUE);
  if (read_c && C != D && overlap(C, c_bytes, D, d_bytes))
    return refuse(call, strf("C %p (+%zu) partly overlaps D %p (+%zu): C must be D itself or disjoint from it", C,
                            c_bytes, D, d_bytes),
                  CUBLAS_STATUS_INVALID_VALUE);
  if (C == D && lc.ld != ld.ld)
    return refuse(call,
                  strf("in place (C == D) with ldc %" PRId64 " != ldd %" PRId64 ": cuBLASLt needs Cdesc's layout == Ddesc's",
                      lc.ld, ld.ld),
                  CUBLAS_STATUS_INVALID_VALUE);

  // Workspace: as large as the algorithm asked for, in device memory.
  const size_t ws = size_t(algo->data[3]);
  if (workspaceSizeInBytes < ws)
    return refuse(call, strf("workspaceSizeInBytes %zu is less than the %zu bytes the algorithm was chosen with",
                            workspaceSizeInBytes, ws),
                  CUBLAS_STATUS_INVALID_VALUE);
  if (ws > 0 && !workspace)
    return refuse(call, strf("workspace is null, but the algorithm was chosen with %zu bytes of it", ws),
                  CUBLAS_STATUS_INVALID_VALUE);
  if (ws > 0 && !emu::check_device_range(workspace, ws, call, "workspace")) return CUBLAS_STATUS_INVALID_VALUE;

  // Stream order: reads of A, B (C), writes of the workspace and D.
  if (!emu::check_stream(stream, call)) return CUBLAS_STATUS_INVALID_VALUE;
  if (pb.m == 0 || pb.n == 0) return CUBLAS_STATUS_SUCCESS;
  bool ok = true;
  if (pb.k > 0) ok = emu::note_read(A, a_bytes, stream, call) && emu::note_read(B, b_bytes, stream, call) && ok;
  if (desc->a_scale) ok = emu::note_read(desc->a_scale, 4 * sa_n, stream, call) && ok;
  if (desc->b_scale) ok = emu::note_read(desc->b_scale, 4 * sb_n, stream, call) && ok;
  if (read_c) ok = emu::note_read(C, c_bytes, stream, call) && ok;
  if (ws > 0) ok = emu::note_write(workspace, ws, stream, call) && ok;
  ok = emu::note_write(D, d_bytes, stream, call) && ok;
  if (!ok) return CUBLAS_STATUS_EXECUTION_FAILED;

  // The product: op(A) as rows of k, op(B) as columns of k, then dot products accumulated in double.
  const size_t m = size_t(pb.m), n = size_t(pb.n), k = size_t(pb.k);
  std::vector<float> ar(m * k), bc(n * k);
  for (size_t i = 0; i < m; ++i)
    for (size_t l = 0; l < k; ++l)
      ar[i * k + l] = load(A, la.type, pb.transa == CUBLAS_OP_N ? i + l * size_t(la.ld) : l + i * size_t(la.ld));
  for (size_t j = 0; j < n; ++j)
    for (size_t l = 0; l < k; ++l)
      bc[j * k + l] = load(B, lb.type, pb.transb == CUBLAS_OP_N ? l + j * size_t(lb.ld) : j + l * size_t(lb.ld));
  for (size_t j = 0; j < n; ++j) {
    const float* bj = bc.data() + j * k;
    for (size_t i = 0; i < m; ++i) {
      const float* ai = ar.data() + i * k;
      double acc4[4] = {0, 0, 0, 0};  // four chains: the loop is bound by the adds' latency otherwise
      size_t l = 0;
      for (; l + 4 <= k; l += 4)
        for (size_t u = 0; u < 4; ++u) acc4[u] += double(ai[l + u]) * double(bj[l + u]);
      for (; l < k; ++l) acc4[0] += double(ai[l]) * double(bj[l]);
      const double acc = (acc4[0] + acc4[1]) + (acc4[2] + acc4[3]);
      float v = float(acc);
      if (desc->a_scale) v = v * desc->a_scale[vec ? i : 0];  // FP8: the dequantizing scales, A's then B's
      if (desc->b_scale) v = v * desc->b_scale[vec ? j : 0];
      v = alpha_f * v;
      if (read_c) v += beta_f * load(C, lc.type, i + j * size_t(lc.ld));
      store(D, ld.type, i + j * size_t(ld.ld), v);
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
