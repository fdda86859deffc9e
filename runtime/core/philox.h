// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a counter-based generator, so element i of a random tensor is a
// pure function of (seed, stream, i) and any rank can make its shard alone.
// Header-only and MT_HOST_DEVICE so CUDA kernels produce the same bits.
//
// Recipe (fixed; CPU and CUDA follow it exactly):
//   key     = (seed low 32, seed high 32)
//   counter = (i low 32, i high 32, stream low 32, stream high 32), stream = FNV-1a 64 of the name
//   x = philox4x32_10(counter, key)
//   uniform: (x0 >> 8) * 2^-24, in [0, 1)
//   normal:  u1 = ((x0 >> 8) + 1) * 2^-24 in (0, 1], u2 = (x1 >> 8) * 2^-24,
//            z = sqrt(-2 ln u1) * cos(2 pi u2) computed in double, rounded to float
//            (double keeps one-ulp differences between libm and CUDA's math
//            far below float resolution).
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

namespace mt::philox {

struct U32x4 {
  uint32_t v[4];
};

MT_HOST_DEVICE inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

MT_HOST_DEVICE inline U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(M0, c.v[0], hi0, lo0);
    mulhilo(M1, c.v[2], hi1, lo1);
    c = U32x4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

MT_HOST_DEVICE inline U32x4 draw(uint64_t seed, uint64_t stream, uint64_t index) {
  U32x4 c{{uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)}};
  return philox4x32_10(c, uint32_t(seed), uint32_t(seed >> 32));
}

MT_HOST_DEVICE inline float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return float(draw(seed, stream, index).v[0] >> 8) * (1.0f / 16777216.0f);
}

MT_HOST_DEVICE inline float normal(uint64_t seed, uint64_t stream, uint64_t index);

inline uint64_t stream_id(const char* name) {
  uint64_t h = 1469598103934665603ull;
  for (const char* p = name; *p; ++p) {
    h ^= uint8_t(*p);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace mt::philox

#include <cmath>

namespace mt::philox {
MT_HOST_DEVICE inline float normal(uint64_t seed, uint64_t stream, uint64_t index) {
  U32x4 x = draw(seed, stream, index);
  double u1 = double((x.v[0] >> 8) + 1) * (1.0 / 16777216.0);
  double u2 = double(x.v[1] >> 8) * (1.0 / 16777216.0);
  return float(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
}  // namespace mt::philox
