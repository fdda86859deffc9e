// RoPE in the Hugging Face convention: out = x * cos + rotate_half(x) * sin with
// rotate_half([x1, x2]) = [-x2, x1]; cos/sin hold the frequencies twice along hd.
#include "runtime/kernels/cpu/isa_level.h"

#include <cmath>

namespace mt::cpu::MT_CPU_ISA {

template <typename T> void rope_tables(T* cos, T* sin, const int64_t* positions, int64_t P, int64_t hd, double theta) {
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      // In T's precision, as Hugging Face computes inv_freq and the angles in the model's float type.
      T inv_freq = T(1) / T(std::pow(T(theta), T(2 * i) / T(hd)));
      T angle = T(positions[p]) * inv_freq;
      T c = T(std::cos(double(angle))), s = T(std::sin(double(angle)));
      cos[p * hd + i] = cos[p * hd + i + half] = c;
      sin[p * hd + i] = sin[p * hd + i + half] = s;
    }
}

template <typename T>
void rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const T* c = cos + (bt % T_) * hd;  // (hd)
    const T* s = sin + (bt % T_) * hd;
    for (int64_t h = 0; h < H; ++h) {
      const T* x = inp + (bt * H + h) * hd;  // (hd)
      T* y = out + (bt * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        T x1 = x[i], x2 = x[i + half];  // read both before writing: out may alias inp
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

template <typename T>
void rope_backward(T* dinp, const T* dout, const T* cos, const T* sin, int64_t B, int64_t T_, int64_t H, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const T* c = cos + (bt % T_) * hd;
    const T* s = sin + (bt % T_) * hd;
    for (int64_t h = 0; h < H; ++h) {
      const T* dy = dout + (bt * H + h) * hd;
      T* dx = dinp + (bt * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        T d1 = dy[i], d2 = dy[i + half];
        dx[i] = d1 * c[i] + d2 * s[i + half];
        dx[i + half] = d2 * c[i + half] - d1 * s[i];
      }
    }
  }
}

}  // namespace mt::cpu::MT_CPU_ISA

MT_CPU_EXPORT(rope_tables)
MT_CPU_EXPORT(rope_forward)
MT_CPU_EXPORT(rope_backward)

#if MT_CPU_OPS  // the ops, compiled once (the baseline pass)
#include "runtime/kernels/op.h"
#include "runtime/kernels/ops.h"

#if MT_CUDA
namespace mt::cuda {  // cuda/rope.cu; backward: the transpose
// out (B, T_, H, hd) = rope(inp) with the tables cos, sin (T_, hd); may alias inp.
template <typename T> int rope_forward(T* out, const T* inp, const T* cos, const T* sin, int64_t B, int64_t T_,
                                       int64_t H, int64_t hd, bool backward, void* stream);
}  // namespace mt::cuda
#endif

namespace mt {
using namespace kern;

// Not through dispatch: the tables are made on the host only (no CUDA kernel), then copied. bf16: computed in
// f32 and rounded, as Hugging Face does for a bf16 model.
void rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions, double theta) {
  const char* op = "rope_tables";
  check_float(op, cos, "cos");
  MT_CHECK(!cos.device().is_cuda(), "kernels", "{}: the tables are computed on the host, then copied", op);
  MT_CHECK(positions.dtype() == DType::i64 && positions.dim() == 1 && !positions.device().is_cuda(), "kernels",
           "{}: positions must be (P) i64 on the CPU", op);
  int64_t P = positions.size(0);
  MT_CHECK(cos.dim() == 2 && cos.size(0) == P && cos.size(1) % 2 == 0, "kernels",
           "{}: cos must be (P, hd) with an even hd, got {}", op, shape_str(cos.shape()));
  expect_shape(op, sin, cos.shape(), "sin");
  same_dtype(op, cos, sin, "sin");
  run_cpu(
      cos,
      [&](auto z, const Tensor& cos, const Tensor& sin, const Tensor& positions) {
        using T = decltype(z);
        MT_CPU_KERNEL(rope_tables, T)(ptr<T>(cos), ptr<T>(sin), positions.data<int64_t>(), P, cos.size(1), theta);
      },
      wr(cos), wr(sin), rd(positions));
}

namespace {
void rope_check(const char* op, const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin) {
  check_float(op, inp, "x");
  MT_CHECK(inp.dim() == 4 && inp.size(3) % 2 == 0, "kernels", "{}: x must be (B, T, H, hd) with an even hd, got {}", op,
           shape_str(inp.shape()));
  expect_shape(op, out, inp.shape(), "out");
  expect_shape(op, cos, {inp.size(1), inp.size(3)}, "cos");
  expect_shape(op, sin, {inp.size(1), inp.size(3)}, "sin");
  for (auto* t : {&out, &cos, &sin}) same_dtype(op, inp, *t, "an operand");
}
}  // namespace

void rope_forward(const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin) {
  rope_check("rope_forward", out, inp, cos, sin);
  const int64_t B = inp.size(0), T_ = inp.size(1), H = inp.size(2), hd = inp.size(3);
  dispatch(
      "rope_forward", inp,
      MT_CUDA_FN(return cuda::rope_forward<T>(ptr<T>(out), ptr<T>(inp), ptr<T>(cos), ptr<T>(sin), B, T_, H, hd, false,
                                              stream_of(inp));),
      [&](auto z, const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin) {
        using T = decltype(z);
        MT_CPU_KERNEL(rope_forward, T)(ptr<T>(out), ptr<T>(inp), ptr<T>(cos), ptr<T>(sin), B, T_, H, hd);
      },
      wr(out), rd(inp), rd(cos), rd(sin));
}

void rope_backward(const Tensor& dinp, const Tensor& dout, const Tensor& cos, const Tensor& sin) {
  rope_check("rope_backward", dinp, dout, cos, sin);
  const int64_t B = dout.size(0), T_ = dout.size(1), H = dout.size(2), hd = dout.size(3);
  dispatch(
      "rope_backward", dout,
      MT_CUDA_FN(return cuda::rope_forward<T>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(cos), ptr<T>(sin), B, T_, H, hd, true,
                                              stream_of(dout));),
      [&](auto z, const Tensor& dinp, const Tensor& dout, const Tensor& cos, const Tensor& sin) {
        using T = decltype(z);
        MT_CPU_KERNEL(rope_backward, T)(ptr<T>(dinp), ptr<T>(dout), ptr<T>(cos), ptr<T>(sin), B, T_, H, hd);
      },
      wr(dinp), rd(dout), rd(cos), rd(sin));
}

}  // namespace mt
#endif  // MT_CPU_OPS
