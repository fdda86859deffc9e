// Mixture of experts with the routing on the device (ops.h moe_route, moe_unpad_order, moe_stats_record,
// moe_aux_grad_row, grouped_matmul_* with device offsets; declared in runtime/kernels/cpu/moe.cpp). Nothing here
// is read back by the host: the groups' sizes stay on the device and the grouped GEMM's blocks find their group
// by reading the offsets. Deterministic: no atomics; every sum has a fixed order.

#include "runtime/kernels/cuda/common.cuh"

#include <cstring>
#include <type_traits>

namespace mt::cuda {

namespace {

constexpr int kRouteThreads = 256;

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }

// Block e of E: expert e's rows. Each thread takes a contiguous chunk of the N K entries, counts its matches; thread
// 0 scans the 256 counts (each thread's first place), then each thread writes its matches' places into slot (the
// place, or -1 past the capacity; route_slot_k turns places into rows). Every entry belongs to one expert: one
// block writes it.
__global__ void route_rank_k(int32_t* slot, int32_t* counts, int32_t* selected, const int32_t* ex, int64_t n,
                             int64_t cap) {
  __shared__ int64_t first[kRouteThreads];
  const int e = int(blockIdx.x), t = int(threadIdx.x);
  const int64_t chunk = (n + kRouteThreads - 1) / kRouteThreads;
  const int64_t b = lmin(n, t * chunk), end = lmin(n, b + chunk);
  int64_t mine = 0;
  for (int64_t i = b; i < end; ++i) mine += ex[i] == e;
  first[t] = mine;
  __syncthreads();
  if (t == 0) {
    int64_t run = 0;
    for (int j = 0; j < kRouteThreads; ++j) {
      const int64_t c = first[j];
      first[j] = run;
      run += c;
    }
    selected[e] = int32_t(run);
    counts[e] = int32_t(lmin(run, cap));
  }
  __syncthreads();
  int64_t place = first[t];
  for (int64_t i = b; i < end; ++i)
    if (ex[i] == e) slot[i] = place < cap ? int32_t(place) : -1, ++place;
}

// One thread: the groups' first rows and the dropped count.
__global__ void route_offsets_k(int32_t* offsets, int32_t* dropped, const int32_t* counts, const int32_t* selected,
                                int E) {
  int32_t run = 0, drop = 0;
  for (int e = 0; e < E; ++e) offsets[e] = run, run += counts[e], drop += selected[e] - counts[e];
  offsets[E] = run;
  dropped[0] = drop;
}

// Places to rows: offsets[e] + place (padded: e * cap + place); -1 stays, an expert out of range is dropped.
__global__ void route_slot_k(int32_t* slot, const int32_t* ex, const int32_t* offsets, int64_t n, int E, bool padded,
                             int64_t cap) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = ex[i];
  if (e < 0 || e >= E) {
    slot[i] = -1;
    return;
  }
  const int32_t p = slot[i];
  slot[i] = p < 0 ? -1 : int32_t((padded ? int64_t(e) * cap : int64_t(offsets[e])) + p);
}

// One block: thread 0 the local experts' offsets (sums over sources), then every arrived row's grouped row.
__global__ void unpad_order_k(int32_t* order, int32_t* offsets, const int32_t* counts, int P, int El, int64_t cap) {
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int j = 0; j < El; ++j) {
      offsets[j] = run;
      for (int p = 0; p < P; ++p) run += counts[p * El + j];
    }
    offsets[El] = run;
  }
  __syncthreads();
  const int64_t n = int64_t(P) * El * cap;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    const int p = int(r / (int64_t(El) * cap)), j = int(r / cap % El);
    const int64_t i = r % cap;
    if (i >= counts[p * El + j]) {
      order[r] = -1;
      continue;
    }
    int64_t row = offsets[j] + i;
    for (int q = 0; q < p; ++q) row += counts[q * El + j];
    order[r] = int32_t(row);
  }
}

__global__ void stats_record_k(double* stats, const int32_t* selected, const float* prob_sums, const int32_t* dropped,
                               int64_t L, int E, int64_t layer, int64_t rows) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    stats[layer * E + e] = double(selected[e]);
    if (prob_sums) stats[L * E + e] = double(prob_sums[e]);
  }
  if (threadIdx.x == 0) {
    stats[L * E + E] += double(rows);
    if (dropped) stats[L * E + E + 1] += double(dropped[0]);
  }
}

__global__ void stats_add_k(double* stats, const double* in, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    stats[i] += in[i];
}

// The host formula's operations in its order, in f64 (moe.h: the balance loss's gradient row).
__global__ void aux_grad_row_k(float* row, const double* stats, int64_t L, int E, double coef, double loss_scale) {
  const double R = stats[L * E + E];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double C = 0;
    for (int64_t l = 0; l < L; ++l) C += stats[l * E + e];
    const double w = R / double(L) * loss_scale;
    row[e] = R > 0 ? float(w * coef * double(E) * C / (R * R)) : 0.0f;
  }
}

// ---- The grouped GEMM in f32: a 64 x 64 tile of outputs per block of 256 threads (4 x 4 each, strided by 16 so
// that a warp reads consecutive shared words), K in steps of 16 through shared memory, f32 accumulation. (bf16:
// the tensor-core kernels below.)
constexpr int kTM = 64, kTN = 64, kTK = 16, kGemmThreads = 256;

// One k-tile of the f32 tiled GEMMs: thread (tx, ty) accumulates its 4 x 4 outputs (rows ty + 16 i, columns
// tx + 16 j of the 64 x 64 tile) from the shared tiles, in k order.
__device__ __forceinline__ void fma_tiles(float (&acc)[4][4], const float (&As)[kTK][kTM + 1],
                                          const float (&Bs)[kTK][kTN + 1], int tx, int ty) {
  for (int kk = 0; kk < kTK; ++kk) {
    float av[4], bv[4];
    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty + 16 * i];
    for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx + 16 * j];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
  }
}

// Block x of the rows' grid: group g's row tile (its tiles, group after group), or past them a tile of the rows
// past offsets[G] (to be zeroed); false: nothing for this block.
__device__ inline bool find_tile(const int32_t* offsets, int G, int64_t M, int64_t& r0, int64_t& r1, int& g) {
  int64_t b = blockIdx.x;
  for (g = 0; g < G; ++g) {
    const int64_t n = int64_t(offsets[g + 1]) - offsets[g], tiles = (n + kTM - 1) / kTM;
    if (b < tiles) {
      r0 = offsets[g] + b * kTM, r1 = lmin(r0 + kTM, int64_t(offsets[g + 1]));
      return true;
    }
    b -= tiles;
  }
  r0 = offsets[G] + b * kTM, r1 = lmin(r0 + kTM, M);  // g = G: the tail
  return r0 < M;
}

// out (M, N) rows [r0, r1) of group g = a (M, Kd) rows @ B_g, B_g (Kd, N) read from w (G, ...) slice g:
// nt: w_g is (N, Kd) (the forward, out = inp W^T); else (Kd, N) (dinp = dout W). Tail rows are zeroed.
template <typename T>
__global__ void gmm_rows_k(T* out, const T* a, const T* w, const int32_t* offsets, int G, int64_t M, int64_t Kd,
                           int64_t N, bool nt) {
  __shared__ float As[kTK][kTM + 1], Bs[kTK][kTN + 1];
  int64_t r0, r1;
  int g;
  if (!find_tile(offsets, G, M, r0, r1, g)) return;
  const int tid = int(threadIdx.x), tx = tid % 16, ty = tid / 16;
  const int64_t n0 = int64_t(blockIdx.y) * kTN;
  if (g == G) {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t r = r0 + ty + 16 * i, c = n0 + tx + 16 * j;
        if (r < r1 && c < N) out[r * N + c] = to<T>(0.0f);
      }
    return;
  }
  const T* wg = w + int64_t(g) * N * Kd;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < Kd; k0 += kTK) {
    for (int l = tid; l < kTK * kTM; l += kGemmThreads) {
      const int kk = l % kTK, rr = l / kTK;
      const int64_t r = r0 + rr, k = k0 + kk;
      As[kk][rr] = r < r1 && k < Kd ? ld(a[r * Kd + k]) : 0.0f;
    }
    for (int l = tid; l < kTK * kTN; l += kGemmThreads) {
      int kk, cc;
      if (nt) kk = l % kTK, cc = l / kTK;  // w_g (N, Kd): consecutive k are consecutive in memory
      else kk = l / kTN, cc = l % kTN;      // w_g (Kd, N)
      const int64_t c = n0 + cc, k = k0 + kk;
      Bs[kk][cc] = c < N && k < Kd ? ld(nt ? wg[c * Kd + k] : wg[k * N + c]) : 0.0f;
    }
    __syncthreads();
    fma_tiles(acc, As, Bs, tx, ty);
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int64_t r = r0 + ty + 16 * i, c = n0 + tx + 16 * j;
      if (r < r1 && c < N) out[r * N + c] = to<T>(acc[i][j]);
    }
}

// dweight (G, OC, C) f32 += per group dout_g^T @ inp_g: block (c tile, o tile, group), the group's rows in steps
// of 16, in row order.
template <typename T>
__global__ void gmm_dweight_k(float* dw, const T* dout, const T* inp, const int32_t* offsets, int64_t C, int64_t OC) {
  __shared__ float As[kTK][kTM + 1], Bs[kTK][kTN + 1];
  const int g = int(blockIdx.z);
  const int64_t m0 = offsets[g], m1 = offsets[g + 1];
  if (m1 <= m0) return;  // an empty group adds nothing
  const int tid = int(threadIdx.x), tx = tid % 16, ty = tid / 16;
  const int64_t o0 = int64_t(blockIdx.y) * kTM, c0 = int64_t(blockIdx.x) * kTN;
  float acc[4][4] = {};
  for (int64_t k0 = m0; k0 < m1; k0 += kTK) {
    for (int l = tid; l < kTK * kTM; l += kGemmThreads) {
      const int kk = l / kTM, oo = l % kTM;
      const int64_t m = k0 + kk, o = o0 + oo;
      As[kk][oo] = m < m1 && o < OC ? ld(dout[m * OC + o]) : 0.0f;
    }
    for (int l = tid; l < kTK * kTN; l += kGemmThreads) {
      const int kk = l / kTN, cc = l % kTN;
      const int64_t m = k0 + kk, c = c0 + cc;
      Bs[kk][cc] = m < m1 && c < C ? ld(inp[m * C + c]) : 0.0f;
    }
    __syncthreads();
    fma_tiles(acc, As, Bs, tx, ty);
    __syncthreads();
  }
  float* d = dw + int64_t(g) * OC * C;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int64_t o = o0 + ty + 16 * i, c = c0 + tx + 16 * j;
      if (o < OC && c < C) d[o * C + c] += acc[i][j];
    }
}

// ---- bf16 on tensor cores: the same tiles (64 x 64 outputs a block), 4 warps of 16 rows each, K in steps of 32
// through shared memory (rows padded by 8 bf16), mma.sync m16n8k16 with f32 accumulation. The fragments are read
// from shared memory by the PTX layout directly (pairs of bf16 as one 32-bit word), so one loader serves the
// operands that arrive transposed (dout W's W, the dweight GEMM's both).
constexpr int kMK = 32, kMmaThreads = 128, kLdS = kMK + 8;
using bh = __nv_bfloat16;

#ifndef MT_CUDA_EMULATOR
// c (16 x 8, f32) += a (16 x 16, bf16, row) . b (16 x 8, bf16, col); lane l (g = l / 4, t = l % 4) holds
// a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b: {(k 2t..2t+1, n g), (k 2t+8.., n g)};
// c: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. (The emulated build defines the same, tests/emu.)
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Two consecutive bf16 of shared memory (an even column) as one word, the lower column in the low half.
__device__ __forceinline__ uint32_t pair_at(const bh* p) {
  uint32_t u;
  memcpy(&u, p, 4);
  return u;
}

// acc (this warp's 16 rows x 64 columns, 8 n tiles) += sA (64 x kMK, row-major along k) sB^T (64 x kMK, n rows
// along k).
__device__ __forceinline__ void mma_tile(float (&acc)[8][4], const bh (*sA)[kLdS], const bh (*sB)[kLdS]) {
  const int lane = int(threadIdx.x) % 32, w0 = 16 * (int(threadIdx.x) / 32), g = lane / 4, t = lane % 4;
  for (int k0 = 0; k0 < kMK; k0 += 16) {
    const uint32_t a[4] = {pair_at(&sA[w0 + g][k0 + 2 * t]), pair_at(&sA[w0 + g + 8][k0 + 2 * t]),
                           pair_at(&sA[w0 + g][k0 + 2 * t + 8]), pair_at(&sA[w0 + g + 8][k0 + 2 * t + 8])};
    for (int nt = 0; nt < 8; ++nt)
      mma_bf16(acc[nt], a, pair_at(&sB[8 * nt + g][k0 + 2 * t]), pair_at(&sB[8 * nt + g][k0 + 2 * t + 8]));
  }
}

// gmm_rows_k on tensor cores (bf16): out rows [r0, r1) of group g = a rows @ B_g (nt: w_g (N, Kd); else (Kd, N)).
__global__ void gmm_rows_mma_k(bh* out, const bh* a, const bh* w, const int32_t* offsets, int G, int64_t M, int64_t Kd,
                               int64_t N, bool nt) {
  __shared__ __align__(16) bh sA[kTM][kLdS];
  __shared__ __align__(16) bh sB[kTN][kLdS];
  int64_t r0, r1;
  int g;
  if (!find_tile(offsets, G, M, r0, r1, g)) return;
  const int tid = int(threadIdx.x);
  const int64_t n0 = int64_t(blockIdx.y) * kTN;
  const bh zero = __float2bfloat16_rn(0.0f);
  if (g == G) {
    for (int l = tid; l < kTM * kTN; l += kMmaThreads) {
      const int64_t r = r0 + l / kTN, c = n0 + l % kTN;
      if (r < r1 && c < N) out[r * N + c] = zero;
    }
    return;
  }
  const bh* wg = w + int64_t(g) * N * Kd;
  float acc[8][4] = {};
  for (int64_t k0 = 0; k0 < Kd; k0 += kMK) {
    for (int l = tid; l < kTM * kMK; l += kMmaThreads) {
      const int rr = l / kMK, kk = l % kMK;
      const int64_t r = r0 + rr, k = k0 + kk;
      sA[rr][kk] = r < r1 && k < Kd ? a[r * Kd + k] : zero;
    }
    for (int l = tid; l < kTN * kMK; l += kMmaThreads) {
      const int cc = l / kMK, kk = l % kMK;
      const int64_t c = n0 + cc, k = k0 + kk;
      sB[cc][kk] = c < N && k < Kd ? (nt ? wg[c * Kd + k] : wg[k * N + c]) : zero;
    }
    __syncthreads();
    mma_tile(acc, sA, sB);
    __syncthreads();
  }
  const int lane = tid % 32, w0 = 16 * (tid / 32);
  for (int ntile = 0; ntile < 8; ++ntile)
    for (int i = 0; i < 4; ++i) {
      const int64_t r = r0 + w0 + lane / 4 + 8 * (i / 2), c = n0 + 8 * ntile + 2 * (lane % 4) + i % 2;
      if (r < r1 && c < N) out[r * N + c] = __float2bfloat16_rn(acc[ntile][i]);
    }
}

// gmm_dweight_k on tensor cores (bf16 activations, f32 dweight): the group's rows are k, in steps of 32.
__global__ void gmm_dweight_mma_k(float* dw, const bh* dout, const bh* inp, const int32_t* offsets, int64_t C,
                                  int64_t OC) {
  __shared__ __align__(16) bh sA[kTM][kLdS];
  __shared__ __align__(16) bh sB[kTN][kLdS];
  const int g = int(blockIdx.z);
  const int64_t m0 = offsets[g], m1 = offsets[g + 1];
  if (m1 <= m0) return;
  const int tid = int(threadIdx.x);
  const int64_t o0 = int64_t(blockIdx.y) * kTM, c0 = int64_t(blockIdx.x) * kTN;
  const bh zero = __float2bfloat16_rn(0.0f);
  float acc[8][4] = {};
  for (int64_t k0 = m0; k0 < m1; k0 += kMK) {
    for (int l = tid; l < kTM * kMK; l += kMmaThreads) {  // consecutive threads: consecutive o of one row m
      const int oo = l % kTM, kk = l / kTM;
      const int64_t o = o0 + oo, m = k0 + kk;
      sA[oo][kk] = o < OC && m < m1 ? dout[m * OC + o] : zero;
    }
    for (int l = tid; l < kTN * kMK; l += kMmaThreads) {
      const int cc = l % kTN, kk = l / kTN;
      const int64_t c = c0 + cc, m = k0 + kk;
      sB[cc][kk] = c < C && m < m1 ? inp[m * C + c] : zero;
    }
    __syncthreads();
    mma_tile(acc, sA, sB);
    __syncthreads();
  }
  float* d = dw + int64_t(g) * OC * C;
  const int lane = tid % 32, w0 = 16 * (tid / 32);
  for (int ntile = 0; ntile < 8; ++ntile)
    for (int i = 0; i < 4; ++i) {
      const int64_t o = o0 + w0 + lane / 4 + 8 * (i / 2), c = c0 + 8 * ntile + 2 * (lane % 4) + i % 2;
      if (o < OC && c < C) d[o * C + c] += acc[ntile][i];
    }
}

// The rows' grid: every group's tiles (at most M / 64 + G of them) and the tail's.
dim3 rows_grid(int64_t M, int64_t G, int64_t N) {
  return dim3(unsigned((M + kTM - 1) / kTM + G + 1), unsigned((N + kTN - 1) / kTN));
}

}  // namespace

int moe_route(int32_t* slot, int32_t* counts, int32_t* selected, int32_t* offsets, int32_t* dropped,
              const int32_t* experts, int64_t n, int64_t E, int64_t capacity, bool padded, void* stream) {
  Range r("moe_route");
  const int64_t cap = capacity > 0 ? capacity : int64_t(INT32_MAX);
  if (E > 0) MT_LAUNCH(route_rank_k, unsigned(E), kRouteThreads, 0, st(stream), slot, counts, selected, experts, n, cap);
  MT_LAUNCH(route_offsets_k, 1, 1, 0, st(stream), offsets, dropped, counts, selected, int(E));
  if (n > 0)
    MT_LAUNCH(route_slot_k, blocks_for(n), kThreads, 0, st(stream), slot, experts, offsets, n, int(E), padded, cap);
  return last_error();
}

int moe_unpad_order(int32_t* order, int32_t* offsets, const int32_t* counts, int64_t P, int64_t El, int64_t capacity,
                    void* stream) {
  Range r("moe_unpad_order");
  MT_LAUNCH(unpad_order_k, 1, kThreads, 0, st(stream), order, offsets, counts, int(P), int(El), capacity);
  return last_error();
}

int moe_stats_record(double* stats, const int32_t* selected, const float* prob_sums, const int32_t* dropped, int64_t L,
                     int64_t E, int64_t layer, int64_t rows, void* stream) {
  Range r("moe_stats_record");
  MT_LAUNCH(stats_record_k, 1, kThreads, 0, st(stream), stats, selected, prob_sums, dropped, L, int(E), layer, rows);
  return last_error();
}

int moe_stats_add(double* stats, const double* in, int64_t n, void* stream) {
  Range r("moe_stats_add");
  if (n == 0) return 0;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  MT_LAUNCH(stats_add_k, int(blocks < 1024 ? blocks : 1024), kThreads, 0, st(stream), stats, in, n);
  return last_error();
}

int moe_aux_grad_row(float* row, const double* stats, int64_t L, int64_t E, double coef, double loss_scale,
                     void* stream) {
  Range r("moe_aux_grad_row");
  MT_LAUNCH(aux_grad_row_k, 1, kThreads, 0, st(stream), row, stats, L, int(E), coef, loss_scale);
  return last_error();
}

template <typename T>
int grouped_matmul_forward_dev(T* out, const T* inp, const T* weight, const int32_t* offsets, int64_t M, int64_t C,
                               int64_t OC, int64_t G, void* stream) {
  Range r("grouped_matmul_forward");
  if (M * OC == 0) return 0;
  if constexpr (std::is_same_v<T, bf16>) {
    MT_LAUNCH(gmm_rows_mma_k, rows_grid(M, G, OC), kMmaThreads, 0, st(stream), dp(out), dp(inp), dp(weight), offsets,
              int(G), M, C, OC, true);
    return last_error();
  }
  MT_LAUNCH(gmm_rows_k<Dev<T>>, rows_grid(M, G, OC), kGemmThreads, 0, st(stream), dp(out), dp(inp), dp(weight),
            offsets, int(G), M, C, OC, true);
  return last_error();
}

template <typename T>
int grouped_matmul_backward_dev(T* dinp, float* dweight, const T* dout, const T* inp, const T* weight,
                                const int32_t* offsets, int64_t M, int64_t C, int64_t OC, int64_t G, void* stream) {
  Range r("grouped_matmul_backward");
  if constexpr (std::is_same_v<T, bf16>) {
    if (dinp && M * C > 0)
      MT_LAUNCH(gmm_rows_mma_k, rows_grid(M, G, C), kMmaThreads, 0, st(stream), dp(dinp), dp(dout), dp(weight),
                offsets, int(G), M, OC, C, false);
    if (dweight && G > 0 && OC * C > 0) {
      const dim3 grid(unsigned((C + kTN - 1) / kTN), unsigned((OC + kTM - 1) / kTM), unsigned(G));
      MT_LAUNCH(gmm_dweight_mma_k, grid, kMmaThreads, 0, st(stream), dweight, dp(dout), dp(inp), offsets, C, OC);
    }
    return last_error();
  }
  if (dinp && M * C > 0)
    MT_LAUNCH(gmm_rows_k<Dev<T>>, rows_grid(M, G, C), kGemmThreads, 0, st(stream), dp(dinp), dp(dout), dp(weight),
              offsets, int(G), M, OC, C, false);
  if (dweight && G > 0 && OC * C > 0) {
    const dim3 grid(unsigned((C + kTN - 1) / kTN), unsigned((OC + kTM - 1) / kTM), unsigned(G));
    MT_LAUNCH(gmm_dweight_k<Dev<T>>, grid, kGemmThreads, 0, st(stream), dweight, dp(dout), dp(inp), offsets, C, OC);
  }
  return last_error();
}

#define MT_INSTANTIATE(T)                                                                                             \
  template int grouped_matmul_forward_dev<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,       \
                                             int64_t, void*);                                                         \
  template int grouped_matmul_backward_dev<T>(T*, float*, const T*, const T*, const T*, const int32_t*, int64_t,      \
                                              int64_t, int64_t, int64_t, void*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(bf16)
#undef MT_INSTANTIATE

}  // namespace mt::cuda
