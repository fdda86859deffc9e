// Element types of a Tensor and the bf16 value type used on the host.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace mt {

// u8: raw bytes, the FP8 codes of training.fp8 (runtime/core/fp8.h; the format travels with the op, not the tensor).
enum class DType : uint8_t { f32, bf16, f64, i32, i64, u16, u8 };

size_t dtype_size(DType d);
std::string_view dtype_name(DType d);
DType dtype_from_name(std::string_view name);  // throws "[core] unknown dtype ..."
bool dtype_is_float(DType d);
// The mixed-precision rule: with bf16 activations, statistics (norms' rstd, attention's lse, losses),
// weight gradients, master weights and optimizer state are f32; otherwise the activations' own dtype.
inline DType accum_dtype(DType d) { return d == DType::bf16 ? DType::f32 : d; }

// bfloat16 on the host: the top 16 bits of an IEEE f32, round-to-nearest-even
// on conversion (as PyTorch and CUDA's __float2bfloat16 do).
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::u16; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

// Calls f(T{}) with T the C++ type of d.
template <typename F> decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(bf16{});
    case DType::f64:
      return f(double{});
    case DType::i32:
      return f(int32_t{});
    case DType::i64:
      return f(int64_t{});
    case DType::u16:
      return f(uint16_t{});
    case DType::u8:
      return f(uint8_t{});
  }
  return f(float{});
}

}  // namespace mt
