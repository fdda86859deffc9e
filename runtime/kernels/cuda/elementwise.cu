// Element-wise ops, conversion and deterministic reductions (ops.h add, scale_, convert, sum, sum_squares and
// their batched and on-device forms, bias_add_forward / _backward; declared in runtime/kernels/cpu/elementwise.cpp and ops.cpp).

#include "runtime/core/philox.h"
#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

struct AddF {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// t *= s, W elements a thread (Pack: 16-byte loads where n divides and t is aligned, else W = 1).
template <typename T, int W> __global__ void scale_k(T* t, float s, int64_t n_packs) {
  using P = Pack<T, W>;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_packs) return;
  P x = reinterpret_cast<P*>(t)[i];
#pragma unroll
  for (int e = 0; e < W; ++e) x.v[e] = to<T>(ld(x.v[e]) * s);
  reinterpret_cast<P*>(t)[i] = x;
}

}  // namespace

template <typename T> int add(T* out, const T* a, const T* b, int64_t n, void* stream) {
  Range r("add");
  if (n == 0) return 0;
  return map2(out, a, b, n, AddF{}, stream);
}
namespace {
template <typename T>
__global__ void dropout_rows_k(T* out, const T* inp, const int64_t* row_ids, int64_t N, int64_t C, uint64_t seed,
                               uint64_t stream, int64_t col_offset, int64_t cols_global, float p, float keep_scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C;
  const uint64_t idx = uint64_t(row_ids[n]) * uint64_t(cols_global) + uint64_t(col_offset + c);
  const bool keep = philox::uniform(seed, stream, idx) >= p;
  out[i] = keep ? to<T>(ld(inp[i]) * keep_scale) : to<T>(0.0f);
}
}  // namespace

template <typename T>
int dropout_rows(T* out, const T* inp, const int64_t* row_ids, int64_t N, int64_t C, uint64_t seed, uint64_t stream,
                 int64_t col_offset, int64_t cols_global, double p, void* cuda_stream) {
  Range r("dropout_rows");
  if (N * C == 0) return 0;
  MT_LAUNCH(dropout_rows_k<Dev<T>>, blocks_for(N * C), kThreads, 0, st(cuda_stream), dp(out), dp(inp), row_ids, N, C,
            seed, stream, col_offset, cols_global, float(p), float(1.0 / (1.0 - p)));
  return last_error();
}

template <typename T> int scale(T* t, double s, int64_t n, void* stream) {
  Range r("scale");
  if (n == 0) return 0;
  const bool packed = packable(n, kPack<T>, t);
  const int64_t w = packed ? kPack<T> : 1;
  auto kernel = packed ? scale_k<Dev<T>, kPack<T>> : scale_k<Dev<T>, 1>;
  MT_LAUNCH(kernel, blocks_for(n / w), kThreads, 0, st(stream), dp(t), float(s), n / w);
  return last_error();
}

namespace {

template <typename D, typename S> __global__ void convert_k(D* dst, const S* src, int64_t n) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = to<D>(ld(src[i]));
}
// MT_LAUNCH takes the kernel as one macro argument (no comma).
constexpr auto convert_f32_to_bf16_k = convert_k<__nv_bfloat16, float>;
constexpr auto convert_bf16_to_f32_k = convert_k<float, __nv_bfloat16>;

}  // namespace

int convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, void* stream) {
  Range r("convert");
  if (n == 0) return 0;
  if (dst_type == DType::bf16 && src_type == DType::f32)
    MT_LAUNCH(convert_f32_to_bf16_k, blocks_for(n), kThreads, 0, st(stream), static_cast<__nv_bfloat16*>(dst),
              static_cast<const float*>(src), n);
  else if (dst_type == DType::f32 && src_type == DType::bf16)
    MT_LAUNCH(convert_bf16_to_f32_k, blocks_for(n), kThreads, 0, st(stream), static_cast<float*>(dst),
              static_cast<const __nv_bfloat16*>(src), n);
  else if (dst_type == src_type)
    return int(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(dst_type), cudaMemcpyDeviceToDevice, st(stream)));
  else return int(cudaErrorInvalidValue);
  return last_error();
}

namespace {

// partials (n / kReduceChunk, rounded up) f64: one block per fixed chunk, summed by the caller in order.
constexpr int64_t kReduceChunk = 4096;
template <typename T> __global__ void reduce_k(double* partials, const T* t, int64_t n, bool squares) {
  int64_t begin = int64_t(blockIdx.x) * kReduceChunk, end = min(n, begin + kReduceChunk);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    double x = ld(t[i]);
    s += squares ? x * x : x;
  }
  s = block_sum_d<kThreads>(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

}  // namespace

int64_t reduce_partials_count(int64_t n) { return (n + kReduceChunk - 1) / kReduceChunk; }
template <typename T> int reduce_sum(double* partials, const T* t, int64_t n, bool squares, void* stream) {
  Range r(squares ? "sum_squares" : "sum");
  int64_t blocks = reduce_partials_count(n);
  if (blocks == 0) return 0;
  MT_LAUNCH(reduce_k<Dev<T>>, unsigned(blocks), kThreads, 0, st(stream), partials, dp(t), n, squares);
  return last_error();
}

namespace {

// out[0] += the sum of partials (n), one block, in sum_partials_in_order's order (cuda_ops.h: the host's sums of
// the same partials give the same bits). One thread summing them all waited on each load in turn: 0.09 ms a call
// on an H200 (16k partials for the embedding's gradient), 13 ms of a 1B model's step over its 147 parameters.
__global__ void sum_partials_into_k(double* out, const double* partials, int64_t n) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kSumPartialsThreads) s += partials[i];
  s = block_sum_d<kSumPartialsThreads>(s);
  if (threadIdx.x == 0) out[0] += s;
}

}  // namespace

int sum_partials_into(double* out, const double* partials, int64_t n, void* stream) {
  Range r("sum_partials_into");
  MT_LAUNCH(sum_partials_into_k, 1, kSumPartialsThreads, 0, st(stream), out, partials, n);
  return last_error();
}

namespace {

// out (N, C) = inp (N, C) + bias (C): one thread per element; out may alias inp.
template <typename T> __global__ void bias_add_fwd_k(T* out, const T* inp, const T* bias, int64_t N, int64_t C) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N * C) out[i] = to<T>(ld(inp[i]) + ld(bias[i % C]));
}

// dbias (C) += column sums of dout (N, C). A block per 32 columns: its kBiasRows row groups each sum every
// kBiasRows-th row in f64, then one thread adds the groups in order (fixed order: the same bits on every run).
constexpr int kBiasRows = 8;
template <typename T> __global__ void bias_add_bwd_k(float* dbias, const T* dout, int64_t N, int64_t C) {
  __shared__ double part[kBiasRows][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double acc = 0;
  if (c < C)
    for (int64_t n = threadIdx.y; n < N; n += kBiasRows) acc += ld(dout[n * C + c]);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  double total = 0;
  for (int r = 0; r < kBiasRows; ++r) total += part[r][threadIdx.x];
  dbias[c] += float(total);
}

}  // namespace

template <typename T> int bias_add_forward(T* out, const T* inp, const T* bias, int64_t N, int64_t C, void* stream) {
  Range r("bias_add_forward");
  if (N * C == 0) return 0;
  MT_LAUNCH(bias_add_fwd_k<Dev<T>>, blocks_for(N * C), kThreads, 0, st(stream), dp(out), dp(inp), dp(bias), N, C);
  return last_error();
}
template <typename T> int bias_add_backward(float* dbias, const T* dout, int64_t N, int64_t C, void* stream) {
  Range r("bias_add_backward");
  if (C == 0) return 0;
  MT_LAUNCH(bias_add_bwd_k<Dev<T>>, blocks_for(C, 32), dim3(32, kBiasRows), 0, st(stream), dbias, dp(dout), N, C);
  return last_error();
}

// The launchers' instances for the two activation types.
#define MT_INSTANTIATE(T)                                                            \
  template int add<T>(T*, const T*, const T*, int64_t, void*);                       \
  template int scale<T>(T*, double, int64_t, void*);                                 \
  template int dropout_rows<T>(T*, const T*, const int64_t*, int64_t, int64_t, uint64_t, uint64_t, int64_t, int64_t, \
                               double, void*);                                                                     \
  template int reduce_sum<T>(double*, const T*, int64_t, bool, void*);               \
  template int bias_add_forward<T>(T*, const T*, const T*, int64_t, int64_t, void*); \
  template int bias_add_backward<T>(float*, const T*, int64_t, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
