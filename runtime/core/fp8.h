// FP8 element formats (training.fp8, docs/design/fp8.md): encode, decode and the amax-based scale, as plain integer
// and IEEE f32 arithmetic that the CPU backend and the CUDA cast kernels (runtime/kernels/cuda/fp8.cu) share, so the
// two give the same bytes for the same input.
//   E4M3 ("fn": no infinities) bias 7, max 448, NaN 0x7f / 0xff, smallest subnormal 2^-9.
//   E5M2 (IEEE-like) bias 15, max 57344, inf 0x7c / 0xfc, NaN 0x7d..0x7f, smallest subnormal 2^-16.
// Encoding saturates (|x| > max becomes +-max, infinities included: torchao clamps to +-max before its cast) and
// rounds to nearest even; a NaN stays a NaN (0x7f with the sign). Decoding is exact (every FP8 value is an f32).
#pragma once
#include <cstdint>
#include <cstring>

#ifndef MT_HOST_DEVICE  // as runtime/core/philox.h defines it
#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
#endif

namespace mt {

enum class Fp8Format : uint8_t { e4m3, e5m2 };

namespace fp8 {

struct Spec {
  int mant;      // mantissa bits
  int bias;      // exponent bias
  float max;     // largest finite value
  float sub;     // the smallest subnormal, 2^(1 - bias - mant)
};
MT_HOST_DEVICE inline Spec spec(Fp8Format f) {
  return f == Fp8Format::e4m3 ? Spec{3, 7, 448.0f, 0.001953125f} : Spec{2, 15, 57344.0f, 1.52587890625e-05f};
}

MT_HOST_DEVICE inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MT_HOST_DEVICE inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// x -> the format's code: saturating, round to nearest even.
MT_HOST_DEVICE inline uint8_t encode(float x, Fp8Format f) {
  const Spec s = spec(f);
  uint32_t u = f32_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return uint8_t(sign | 0x7f);          // NaN
  if (u >= f32_bits(s.max)) return uint8_t(sign | (f == Fp8Format::e4m3 ? 0x7e : 0x7b));  // saturate to +-max
  const int fexp = int(u >> 23);
  if (fexp == 0) return sign;  // an f32 subnormal is far below half the smallest FP8 subnormal
  const int e = fexp - 127;                                      // x = sig * 2^(e - 23), sig 24 bits
  const int emin = 1 - s.bias;                                   // the smallest normal exponent
  const int et = e > emin ? e : emin;                            // the code's exponent (emin for subnormals)
  const uint64_t sig = (u & 0x7fffffu) | 0x800000u;
  const int shift = 23 + et - s.mant - e;                        // q = sig / 2^shift, rounded: >= 23 - mant
  if (shift > 40) return sign;
  uint64_t q = sig >> shift;
  const uint64_t rem = sig & ((uint64_t(1) << shift) - 1), half = uint64_t(1) << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;
  // q < 2^mant only at et = emin (a subnormal: exponent field 0); a carry to 2^(mant+1) moves to the next
  // exponent; both fall out of one sum.
  return uint8_t(sign | uint32_t((int64_t(et + s.bias) << s.mant) + int64_t(q) - (int64_t(1) << s.mant)));
}

// code -> its exact value.
MT_HOST_DEVICE inline float decode(uint8_t c, Fp8Format f) {
  const Spec s = spec(f);
  const uint32_t sign = uint32_t(c & 0x80) << 24;
  const int ebits = 7 - s.mant;
  const int ef = (c >> s.mant) & ((1 << ebits) - 1), m = c & ((1 << s.mant) - 1);
  if (f == Fp8Format::e4m3 && (c & 0x7f) == 0x7f) return bits_f32(0x7fc00000u | sign);
  if (f == Fp8Format::e5m2 && ef == 31) return bits_f32((m ? 0x7fc00000u : 0x7f800000u) | sign);
  if (ef == 0) return bits_f32(f32_bits(float(m) * s.sub) | sign);
  return bits_f32(sign | uint32_t(ef - s.bias + 127) << 23 | uint32_t(m) << (23 - s.mant));
}

// The scale that maps amax onto the format's max, torchao's amax_to_scale: max / max(amax, 1e-12) in f64, rounded
// to f32; pow2 (the rowwise recipe) rounds it down to a power of two (the mantissa bits cleared). A NaN amax gives
// a NaN scale.
MT_HOST_DEVICE inline float scale_from_amax(float amax, Fp8Format f, bool pow2) {
  const double a = double(amax) < 1e-12 ? 1e-12 : double(amax);
  float scale = float(double(spec(f).max) / a);
  if (pow2) scale = bits_f32(f32_bits(scale) & 0xff800000u);
  return scale;
}

// The value stored for x under `scale`: encode(x * scale) (the product in f32; encode saturates).
MT_HOST_DEVICE inline uint8_t quantize(float x, float scale, Fp8Format f) { return encode(x * scale, f); }

}  // namespace fp8
}  // namespace mt
