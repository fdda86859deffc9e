// FP8 linears (ops.h fp8_cast / fp8_matmul, training.fp8, docs/design/fp8.md): the CPU reference, the ops' checks
// and dispatch. The CPU kernels are the bit-exact reference the CUDA backend is checked against on the emulated
// device: the same codes (runtime/core/fp8.h, shared with runtime/kernels/cuda/fp8.cu) and the products summed in
// f64 in the emulated cuBLASLt's order (tests/emu/cublaslt_emu.cpp), so the two agree to the bit. Not fast: the
// CPU backend runs FP8 to check it, not to train with it. Compiled in the baseline pass only (no ISA variants).
#include "runtime/kernels/cpu/isa_level.h"

#if MT_CPU_OPS
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/fp8.cu: the cast kernels; cuda/matmul.cu: the FP8 GEMM on cuBLASLt
// Floats of device scratch fp8_cast needs for (R, K) (amax partials and scales).
int64_t fp8_cast_scratch(int64_t R, int64_t K, bool rowwise);
// q (R, K), q_inv, qt (K, R), qt_inv as ops.h fp8_cast (each pair may be null); fmt 0 e4m3, 1 e5m2.
template <typename T> int fp8_cast(uint8_t* q, float* q_inv, uint8_t* qt, float* qt_inv, float* scratch, const T* x,
                                   int64_t R, int64_t K, int fmt, bool rowwise, bool pow2, void* stream);
// out (M, N) row-major (bf16, or f32 when out_f32) = (a (M, K) . b (N, K)^T) * b_inv * a_inv (+ out); vec_scales:
// a_inv (M) and b_inv (N), else (1) each.
int fp8_matmul(void* out, bool out_f32, const uint8_t* a, const float* a_inv, const uint8_t* b, const float* b_inv,
               int64_t M, int64_t N, int64_t K, int a_fmt, int b_fmt, bool vec_scales, bool accumulate, void* stream,
               int device);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

namespace {

template <typename T> float load_f(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, bf16>) return bf16::to_float(p[i].bits);
  else return float(p[i]);
}

// The CPU cast: amax, scale, codes; x (R, K) of type T.
template <typename T>
void cpu_fp8_cast(uint8_t* q, float* q_inv, uint8_t* qt, float* qt_inv, const T* x, int64_t R, int64_t K,
                  Fp8Format fmt, bool rowwise, bool pow2) {
  auto amax_of = [](float m, float v) {
    const float a = std::fabs(v);
    return a > m ? a : m;  // a NaN is passed over, as the CUDA kernels' comparison does
  };
  std::vector<float> row_scale(size_t(rowwise ? R : 1)), col_scale(size_t(rowwise ? K : 1));
  if (!rowwise) {
    float m = 0;
    for (int64_t i = 0; i < R * K; ++i) m = amax_of(m, load_f(x, i));
    row_scale[0] = col_scale[0] = fp8::scale_from_amax(m, fmt, pow2);
    if (q_inv) q_inv[0] = 1.0f / row_scale[0];
    if (qt_inv) qt_inv[0] = 1.0f / col_scale[0];
  } else {
    if (q)
      for (int64_t r = 0; r < R; ++r) {
        float m = 0;
        for (int64_t c = 0; c < K; ++c) m = amax_of(m, load_f(x, r * K + c));
        row_scale[size_t(r)] = fp8::scale_from_amax(m, fmt, pow2);
        q_inv[r] = 1.0f / row_scale[size_t(r)];
      }
    if (qt) {
      std::vector<float> m(size_t(K), 0.0f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < K; ++c) m[size_t(c)] = amax_of(m[size_t(c)], load_f(x, r * K + c));
      for (int64_t c = 0; c < K; ++c) {
        col_scale[size_t(c)] = fp8::scale_from_amax(m[size_t(c)], fmt, pow2);
        qt_inv[c] = 1.0f / col_scale[size_t(c)];
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < K; ++c) {
      const float v = load_f(x, r * K + c);
      if (q) q[r * K + c] = fp8::quantize(v, row_scale[rowwise ? size_t(r) : 0], fmt);
      if (qt) qt[c * R + r] = fp8::quantize(v, col_scale[rowwise ? size_t(c) : 0], fmt);
    }
}

// The CPU GEMM: every product exact in f64, summed in four chains as the emulated cuBLASLt does.
template <typename O>
void cpu_fp8_matmul(O* out, const uint8_t* a, const float* a_inv, const uint8_t* b, const float* b_inv, int64_t M,
                    int64_t N, int64_t K, Fp8Format af, Fp8Format bf, bool vec, bool accumulate) {
  float lut_a[256], lut_b[256];
  for (int c = 0; c < 256; ++c) lut_a[c] = fp8::decode(uint8_t(c), af), lut_b[c] = fp8::decode(uint8_t(c), bf);
  std::vector<float> bd(size_t(N * K));
  for (int64_t i = 0; i < N * K; ++i) bd[size_t(i)] = lut_b[b[i]];
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    std::vector<float> ai(static_cast<size_t>(K));
    for (int64_t l = 0; l < K; ++l) ai[size_t(l)] = lut_a[a[i * K + l]];
    for (int64_t j = 0; j < N; ++j) {
      const float* bj = bd.data() + j * K;
      double acc4[4] = {0, 0, 0, 0};
      int64_t l = 0;
      for (; l + 4 <= K; l += 4)
        for (int u = 0; u < 4; ++u) acc4[u] += double(ai[size_t(l + u)]) * double(bj[l + u]);
      for (; l < K; ++l) acc4[0] += double(ai[size_t(l)]) * double(bj[l]);
      float v = float((acc4[0] + acc4[1]) + (acc4[2] + acc4[3]));
      v = v * b_inv[vec ? j : 0] * a_inv[vec ? i : 0];
      if (accumulate) v += load_f(out, i * N + j);
      if constexpr (std::is_same_v<O, bf16>) out[i * N + j] = bf16(v);
      else out[i * N + j] = v;
    }
  }
}

void check_codes(const char* op, const Tensor& t, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::u8 && t.dim() == 2, "kernels", "{}: {} must be a 2-D u8 tensor of FP8 "
           "codes, got {} {}", op, what, t.defined() ? dtype_name(t.dtype()) : "undefined",
           t.defined() ? shape_str(t.shape()) : "");
}
void check_inv(const char* op, const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.defined() && t.dtype() == DType::f32 && t.numel() == n, "kernels",
           "{}: {} must be an f32 tensor of {} scale(s), got {} {}", op, what, n,
           t.defined() ? dtype_name(t.dtype()) : "undefined", t.defined() ? shape_str(t.shape()) : "");
}

}  // namespace

void fp8_cast(const Tensor& q, const Tensor& q_inv, const Tensor& qt, const Tensor& qt_inv, const Tensor& x,
              Fp8Format fmt, bool rowwise, bool pow2) {
  const char* op = "fp8_cast";
  check_float(op, x, "x");
  MT_CHECK(x.dtype() != DType::f64 && x.dim() == 2, "kernels", "{}: x must be 2-D bf16 or f32, got {} {}", op,
           dtype_name(x.dtype()), shape_str(x.shape()));
  const int64_t R = x.size(0), K = x.size(1);
  if (q.defined()) {
    check_codes(op, q, "q");
    expect_shape(op, q, {R, K}, "q");
    check_inv(op, q_inv, rowwise ? R : 1, "q_inv");
  }
  if (qt.defined()) {
    check_codes(op, qt, "qt");
    expect_shape(op, qt, {K, R}, "qt");
    check_inv(op, qt_inv, rowwise ? K : 1, "qt_inv");
  }
  if (!q.defined() && !qt.defined()) return;
  kprof::Scope prof(op, x.device(), 0,
                    kprof::enabled() ? kprof::bytes_of({&x, &q, &qt}) : 0);
  if (on_cuda(op, {&x, &q, &q_inv, &qt, &qt_inv})) {
#if MT_CUDA
    Tensor scratch = empty({std::max<int64_t>(1, cuda::fp8_cast_scratch(R, K, rowwise))}, DType::f32, x.device());
    cuda_check(by_cuda_float(x, [&](auto z) {
                 using T = decltype(z);
                 return cuda::fp8_cast<T>(ptr<uint8_t>(q), ptr<float>(q_inv), ptr<uint8_t>(qt), ptr<float>(qt_inv),
                                          scratch.data<float>(), x.data<T>(), R, K, int(fmt), rowwise, pow2,
                                          stream_of(x));
               }),
               op);
#endif
    return;
  }
  auto run = [&](auto z) {
    using T = decltype(z);
    cpu_fp8_cast<T>(ptr<uint8_t>(q), ptr<float>(q_inv), ptr<uint8_t>(qt), ptr<float>(qt_inv), x.data<T>(), R, K, fmt,
                    rowwise, pow2);
  };
  if (x.dtype() == DType::bf16) run(bf16{});
  else run(float{});
}

void fp8_matmul(const Tensor& out, const Tensor& a, const Tensor& a_inv, const Tensor& b, const Tensor& b_inv,
                Fp8Format a_fmt, Fp8Format b_fmt, bool accumulate) {
  const char* op = "fp8_matmul";
  check_codes(op, a, "a");
  check_codes(op, b, "b");
  check_float(op, out, "out");
  MT_CHECK(out.dtype() == DType::bf16 || out.dtype() == DType::f32, "kernels", "{}: out must be bf16 or f32, got {}",
           op, dtype_name(out.dtype()));
  MT_CHECK(a.size(1) == b.size(1), "kernels", "{}: a {} . b {}^T: the inner sizes differ", op, shape_str(a.shape()),
           shape_str(b.shape()));
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  expect_shape(op, out, {M, N}, "out");
  MT_CHECK(!(a_fmt == Fp8Format::e5m2 && b_fmt == Fp8Format::e5m2), "kernels",
           "{}: a and b are both e5m2 (cuBLASLt has no e5m2 x e5m2 GEMM)", op);
  MT_CHECK(M % kFp8Align == 0 && N % kFp8Align == 0 && K % kFp8Align == 0, "kernels",
           "{}: M {}, N {}, K {}: every dim must be a multiple of {} (cuBLASLt's FP8 GEMMs)", op, M, N, K, kFp8Align);
  const bool vec = a_inv.defined() && a_inv.numel() != 1;
  check_inv(op, a_inv, vec ? M : 1, "a_inv");
  check_inv(op, b_inv, vec ? N : 1, "b_inv");
  MT_CHECK(!vec || (M != 1 && N != 1), "kernels", "{}: row scales need M and N above 1", op);
  kprof::Scope prof(op, a.device(), 2.0 * double(M) * double(N) * double(K),
                    kprof::enabled() ? kprof::bytes_of({&a, &b, &out}) : 0);
  if (on_cuda(op, {&out, &a, &a_inv, &b, &b_inv})) {
#if MT_CUDA
    cuda_check(cuda::fp8_matmul(out.data_ptr(), out.dtype() == DType::f32, a.data<uint8_t>(), a_inv.data<float>(),
                                b.data<uint8_t>(), b_inv.data<float>(), M, N, K, int(a_fmt), int(b_fmt), vec,
                                accumulate, stream_of(out), out.device().index),
               op);
#endif
    return;
  }
  if (out.dtype() == DType::bf16)
    cpu_fp8_matmul(out.data<bf16>(), a.data<uint8_t>(), a_inv.data<float>(), b.data<uint8_t>(), b_inv.data<float>(),
                   M, N, K, a_fmt, b_fmt, vec, accumulate);
  else
    cpu_fp8_matmul(out.data<float>(), a.data<uint8_t>(), a_inv.data<float>(), b.data<uint8_t>(), b_inv.data<float>(),
                   M, N, K, a_fmt, b_fmt, vec, accumulate);
}

}  // namespace mt
#endif  // MT_CPU_OPS
