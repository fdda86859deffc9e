// FP8 formats on the host (runtime/core/fp8.h): every code decoded against the format's definition, the encoder
// against a brute-force nearest search (ties to even), saturation, subnormals and the amax-based scale.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "runtime/core/fp8.h"
#include "runtime/core/philox.h"

using namespace mt;

namespace {

struct Fmt {
  Fp8Format f;
  int ebits, mbits, bias;
  const char* name;
};
const Fmt kFmts[] = {{Fp8Format::e4m3, 4, 3, 7, "e4m3"}, {Fp8Format::e5m2, 5, 2, 15, "e5m2"}};

// The definition: sign, exponent field, mantissa; E4M3 (fn) has no infinities and one NaN per sign (all ones),
// E5M2 IEEE specials at the top exponent.
double reference_decode(uint8_t c, const Fmt& f) {
  const int e = (c >> f.mbits) & ((1 << f.ebits) - 1), m = c & ((1 << f.mbits) - 1);
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  if (f.f == Fp8Format::e4m3 && (c & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  if (f.f == Fp8Format::e5m2 && e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(double(m), 1 - f.bias - f.mbits);
  return sign * std::ldexp(double((1 << f.mbits) + m), e - f.bias - f.mbits);
}

// The finite non-negative codes in increasing value.
std::vector<uint8_t> finite_positive(const Fmt& f) {
  std::vector<uint8_t> v;
  for (int c = 0; c < 128; ++c)
    if (std::isfinite(reference_decode(uint8_t(c), f))) v.push_back(uint8_t(c));
  return v;
}

// Brute force: the nearest finite code, ties to the even code (mantissa LSB 0), beyond max saturated.
uint8_t reference_encode(float x, const Fmt& f) {
  const auto codes = finite_positive(f);
  const double a = std::fabs(double(x));
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  uint8_t best = codes[0];
  double best_d = INFINITY;
  for (uint8_t c : codes) {
    const double d = std::fabs(reference_decode(c, f) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  return uint8_t(best | sign);
}

}  // namespace

TEST_CASE("fp8: every code decodes to the format's value and encodes back") {
  for (const Fmt& f : kFmts) {
    CAPTURE(f.name);
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
      CAPTURE(c);
      const double want = reference_decode(uint8_t(c), f);
      const float got = fp8::decode(uint8_t(c), f.f);
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
        CHECK(std::isnan(fp8::decode(fp8::encode(got, f.f), f.f)));  // a NaN stays a NaN
        continue;
      }
      CHECK(double(got) == want);
      CHECK(std::signbit(got) == bool(c & 0x80));
      if (std::isinf(want)) continue;  // E5M2's inf saturates to max on the way back (torchao's clamp)
      CHECK(int(fp8::encode(got, f.f)) == c);
      ++finite;
    }
    CHECK(finite == (f.f == Fp8Format::e4m3 ? 254 : 248));
  }
  CHECK(fp8::decode(0x7e, Fp8Format::e4m3) == 448.0f);
  CHECK(fp8::decode(0x01, Fp8Format::e4m3) == std::ldexp(1.0f, -9));
  CHECK(fp8::decode(0x38, Fp8Format::e4m3) == 1.0f);
  CHECK(fp8::decode(0x7b, Fp8Format::e5m2) == 57344.0f);
  CHECK(fp8::decode(0x01, Fp8Format::e5m2) == std::ldexp(1.0f, -16));
  CHECK(fp8::decode(0x3c, Fp8Format::e5m2) == 1.0f);
  CHECK(std::isinf(fp8::decode(0xfc, Fp8Format::e5m2)));
}

TEST_CASE("fp8: encoding rounds to nearest, ties to even, against a brute-force search") {
  for (const Fmt& f : kFmts) {
    CAPTURE(f.name);
    const auto codes = finite_positive(f);
    // Every midpoint between neighbours (a tie: to the even code), and one f32 ulp either side of it.
    int ties = 0;
    for (size_t i = 0; i + 1 < codes.size(); ++i) {
      const float lo = fp8::decode(codes[i], f.f), hi = fp8::decode(codes[i + 1], f.f);
      const float mid = float((double(lo) + double(hi)) / 2);
      REQUIRE(double(mid) == (double(lo) + double(hi)) / 2);  // exact in f32
      for (float s : {1.0f, -1.0f}) {
        const uint8_t sign = s < 0 ? 0x80 : 0;
        CAPTURE(mid);
        const uint8_t even = (codes[i] & 1) == 0 ? codes[i] : codes[i + 1];
        CHECK(int(fp8::encode(s * mid, f.f)) == int(even | sign));
        CHECK(int(fp8::encode(s * std::nextafter(mid, 0.0f), f.f)) == int(codes[i] | sign));
        CHECK(int(fp8::encode(s * std::nextafter(mid, INFINITY), f.f)) == int(codes[i + 1] | sign));
        ++ties;
      }
    }
    CHECK(ties == 2 * int(codes.size() - 1));
    // Random values over the whole range, subnormals included.
    for (uint64_t i = 0; i < 20000; ++i) {
      const double u = philox::uniform(7, 1, 2 * i), v = philox::uniform(7, 1, 2 * i + 1);
      const float x = float((u < 0.5 ? -1 : 1) * std::ldexp(1.0 + v, int(u * 1000) % 40 - 24));
      CAPTURE(x);
      CHECK(int(fp8::encode(x, f.f)) == int(reference_encode(x, f)));
    }
  }
}

TEST_CASE("fp8: saturation, specials and subnormals") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Beyond max (448 / 57344), infinities included: +-max, as torchao clamps before its cast.
  for (float x : {449.0f, 464.0f, 480.0f, 1e6f, inf}) {
    CHECK(fp8::encode(x, Fp8Format::e4m3) == 0x7e);
    CHECK(fp8::encode(-x, Fp8Format::e4m3) == 0xfe);
  }
  for (float x : {57345.0f, 61440.0f, 1e9f, inf}) {
    CHECK(fp8::encode(x, Fp8Format::e5m2) == 0x7b);
    CHECK(fp8::encode(-x, Fp8Format::e5m2) == 0xfb);
  }
  CHECK(fp8::encode(nan, Fp8Format::e4m3) == 0x7f);
  CHECK(fp8::encode(-nan, Fp8Format::e4m3) == 0xff);
  CHECK(fp8::encode(nan, Fp8Format::e5m2) == 0x7f);
  CHECK(fp8::encode(0.0f, Fp8Format::e4m3) == 0x00);
  CHECK(fp8::encode(-0.0f, Fp8Format::e4m3) == 0x80);
  // E4M3 subnormals: steps of 2^-9; half a step is a tie to 0 (even), 1.5 steps a tie to 2 steps.
  CHECK(fp8::encode(std::ldexp(1.0f, -10), Fp8Format::e4m3) == 0x00);
  CHECK(fp8::encode(3 * std::ldexp(1.0f, -10), Fp8Format::e4m3) == 0x02);
  CHECK(fp8::encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f), Fp8Format::e4m3) == 0x01);
  CHECK(fp8::encode(7 * std::ldexp(1.0f, -9), Fp8Format::e4m3) == 0x07);  // the largest subnormal
  CHECK(fp8::encode(7.5f * std::ldexp(1.0f, -9), Fp8Format::e4m3) == 0x08);  // tie: up to the smallest normal (even)
  CHECK(fp8::encode(1e-30f, Fp8Format::e4m3) == 0x00);
  CHECK(fp8::encode(std::numeric_limits<float>::denorm_min(), Fp8Format::e5m2) == 0x00);
  // E5M2 subnormals: steps of 2^-16.
  CHECK(fp8::encode(std::ldexp(1.0f, -16), Fp8Format::e5m2) == 0x01);
  CHECK(fp8::encode(3 * std::ldexp(1.0f, -16), Fp8Format::e5m2) == 0x03);
  CHECK(fp8::encode(3.5f * std::ldexp(1.0f, -16), Fp8Format::e5m2) == 0x04);  // tie to even: the smallest normal
}

TEST_CASE("fp8: the scale from amax (torchao's amax_to_scale), power-of-two rounding") {
  CHECK(fp8::scale_from_amax(448.0f, Fp8Format::e4m3, false) == 1.0f);
  CHECK(fp8::scale_from_amax(57344.0f, Fp8Format::e5m2, false) == 1.0f);
  CHECK(fp8::scale_from_amax(3.0f, Fp8Format::e4m3, false) == float(448.0 / 3.0));
  CHECK(fp8::scale_from_amax(3.0f, Fp8Format::e4m3, true) == 128.0f);  // 149.3 rounded down to a power of two
  CHECK(fp8::scale_from_amax(0.0f, Fp8Format::e4m3, false) == float(448.0 / 1e-12));  // amax clamped to 1e-12
  CHECK(std::isnan(fp8::scale_from_amax(std::numeric_limits<float>::quiet_NaN(), Fp8Format::e4m3, false)));
  // The scaled amax lands on max (or below it, by the f32 rounding of the scale): nothing saturates.
  for (float a : {0.37f, 1.0f, 5.5f, 1234.5f}) {
    const float s = fp8::scale_from_amax(a, Fp8Format::e4m3, false);
    CHECK(std::fabs(fp8::decode(fp8::quantize(a, s, Fp8Format::e4m3), Fp8Format::e4m3) - 448.0f) <= 16.0f);
  }
}
