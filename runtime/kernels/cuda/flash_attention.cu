// FlashAttention-2 style attention in bf16 on tensor cores: mma.sync m16n8k16 (bf16 in, fp32 accumulate)
// fed by ldmatrix from shared memory, tiles streamed in by cp.async. See flash_attention.h for the contract.
//
// Tiles. 4 warps; a warp owns 16 MT rows (MT m16 row blocks of the mma: MT = 1 or 2, chosen per kernel and head
// dim by tiling(), measured on an H200) end to end, so softmax statistics never leave the warp. The forward and dQ
// kernels take 64 MT queries a CTA against blocks of 64 keys; the dK/dV kernel 64 MT keys a CTA against blocks of
// 64 queries. MT = 2 makes every B fragment read from shared memory (ldmatrix) feed two mma: shared-memory reads,
// not the tensor cores, bound these loops on mma.sync, so that is where a second m tile pays, where the registers
// allow it (two m tiles of dK and dV at hd 128 would be 256 floats a thread). 64 keys per step amortise each
// barrier over 64-256 mma per warp; loops whose scores would not fit beside the accumulators take them in chunks
// of 32 (the hd 128 forward at MT = 2: its own online-softmax step per chunk; dQ at MT = 2). Shared memory rows
// are padded by 8 bf16 (16 bytes), so the 8 row addresses of every ldmatrix 8x8 matrix hit different banks.
// Per CTA (hd 128): forward 85-102 KiB, dq 102 KiB, dk/dv 103 KiB: two CTAs (8 warps) fit on an H100 SM.
// Within a CTA's key (or query) blocks, a warp computes only the blocks its own rows see (causally and by the
// document mask): the causal diagonal of a 128-row tile costs half its warps nothing.
//
// Forward, one CTA per (64 MT-query block, b, h), the heaviest causal blocks launched first:
//   for each key block j the block's last query sees (two-stage pipeline: block j+1's K and V load
//   while block j computes):  S = Q K^T;  online softmax in the log2 domain (running max m, running
//   sum l, scores prescaled by scale*log2e, exp2f);  O = O * 2^(m_old - m) + P V, with P rounded to
//   bf16 straight from the accumulator registers (the C layout of two n8 tiles is the A layout).
//   Only key blocks that cross a warp's causal diagonal or the end of the keys are masked element-wise;
//   fully masked blocks are never visited. A row that sees no key keeps m = -inf and l = 0: its
//   exponentials use base 0 instead of -inf (no inf - inf), and it stores out = 0, lse = -inf.
// Document masks (doc_start): a query also sees no key before its document's start (first_key). The key
//   blocks visited start at the one holding the smallest first_key of the query block (each warp reduces
//   the values itself), and blocks before a row's first key are masked element-wise as well.
// Backward (deterministic, no atomics), three kernels:
//   1. D = rowsum(dout * out), (B, H, T) f32 in the scratch.
//   2. dK, dV: one CTA per (64 MT-key block, b, kv head); warp w owns keys 16 MT w .. 16 MT (w + 1) - 1 and
//      keeps their dK, dV in registers while it walks every q head of the GQA group and every 64-query block
//      that sees a key of the block, in a fixed order. It works on the transposed products (keys as mma rows):
//      S^T = K Q^T, P^T = 2^(S^T*scale*log2e - lse*log2e), dP^T = V dO^T, dS^T = P^T (dP^T - D),
//      dV += P^T dO, dK += dS^T Q (scaled once at the end), in two halves of 32 queries to bound the
//      registers. Q, dO, lse and D of the next item load while the current one computes. With document
//      masks the q blocks run from the first to the last whose smallest first_key is within the key block
//      (per-q-block bounds from a small kernel, flash_doc_tiles_k, in the scratch), and the queries'
//      first keys load with lse and D.
//   3. dQ: one CTA per (64 MT-query block, b, h) like the forward: S = Q K^T, dP = dO V^T,
//      dS = P (dP - D), dQ += dS K. S and dP are computed twice (in 2 and 3), the price of no atomics.
//   Tails: rows past T or S are zero-filled in shared memory (0 * garbage could be NaN); key columns
//   past S are masked; queries past T get lse = +inf in the backward, so their P is exactly 0.
//
// tests/emu compiles this file with the host compiler under MT_CUDA_EMULATOR (tests/emu/cuda_emulator.h): the
// emulator then supplies the CUDA headers' surface, the PTX wrappers, dynamic shared memory and launches.
#ifndef MT_CUDA_EMULATOR
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#define MT_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "runtime/kernels/cuda/flash_attention.h"
#include "runtime/kernels/cuda/launch.cuh"

namespace mt::cuda {

namespace {

using bf16_t = __nv_bfloat16;

constexpr int kBlockM = 64;  // queries per tile: 4 warps x one m16 row block
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4, kThreads = 32 * kWarps;
// CTAs per SM the register allocation must allow (<= 255 registers a thread): shared memory admits 2 at hd 128
// (~100 KiB each); asking 3 at hd 64 (<= 168 registers) makes the backward spill.
constexpr int kMinBlocks = 2;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// A 64-row tile of HD bf16 in shared memory, rows padded by 8 elements (see the top comment); tiles of 64 MT rows
// have the same rows.
template <int HD> struct Tile {
  static constexpr int kLd = HD + 8;  // elements per row
  static constexpr int kElems = 64 * kLd;
};

struct Range {  // an NVTX range over a launcher, so that Nsight Systems shows the op by name
  explicit Range(const char* name) { nvtxRangePushA(name); }
  ~Range() { nvtxRangePop(); }
};

// Sizes (checked to fit in int by the launchers) and the masking rule.
struct Dims {
  int B, T, S, H, KV, group;
  float scale, scale_log2;  // softmax scale, and scale * log2(e) for exp2f
  bool causal;
  long long q_pos0, k_pos0;
  // Query t sees keys [0, limit(t)).
  __device__ int limit(int64_t t) const {
    if (!causal) return S;
    const long long v = q_pos0 + t - k_pos0 + 1;
    return v <= 0 ? 0 : (v >= S ? S : int(v));
  }
  // Key s is seen by queries [first_query(s), ...); INT_MAX when no query sees it (s >= S). Causal only: the
  // document mask is applied on top (first_key).
  __device__ int first_query(int64_t s) const {
    if (s >= S) return INT_MAX;
    if (!causal) return 0;
    const long long v = s + k_pos0 - q_pos0;
    return v <= 0 ? 0 : (v >= INT_MAX ? INT_MAX : int(v));
  }
  // Document masks: doc_start (B, T) (global positions) or null. Query t of row b sees no key before
  // first_key(b, t) (clamped to [0, S]; 0 without a mask or for t past T).
  const int64_t* doc_start;
  // Backward only, with doc_start: (B, query blocks, 2) the smallest and largest first_key of each 64-query block
  // (flash_doc_tiles_k, in the scratch).
  const int* tile_first;
  __device__ int first_key(int b, int64_t t) const {
    if (!doc_start || t >= T) return 0;
    const long long v = (long long)doc_start[int64_t(b) * T + t] - k_pos0;
    return v <= 0 ? 0 : (v >= S ? S : int(v));
  }
};

// The smallest first_key of queries [t0, t0 + nq) of row b (the first key any of them sees; S when they all start
// past the keys), the same in every lane: each warp computes it on its own. 0 without a document mask.
__device__ __forceinline__ int tile_first_min(const Dims& d, int b, int t0, int nq) {
  if (!d.doc_start) return 0;
  int v = d.S;
  for (int i = int(threadIdx.x) % 32; i < nq; i += 32) v = min(v, d.first_key(b, t0 + i));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

#ifndef MT_CUDA_EMULATOR
// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, asynchronously; with valid false nothing is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8. Register j holds, in lane l,
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j (transposed with .trans).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// c (16 x 8, f32) += a (16 x 16, bf16, row) . b (16 x 8, bf16, col). Lane l (g = l / 4, i = l % 4) holds
// a: {(g, 2i..2i+1), (g+8, 2i..), (g, 2i+8..), (g+8, 2i+8..)}; b: {(k 2i..2i+1, n g), (k 2i+8.., n g)};
// c: {(g, 2i), (g, 2i+1), (g+8, 2i), (g+8, 2i+1)}.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif  // MT_CUDA_EMULATOR

// Two floats as a bf16 pair (round to nearest even), lo in the low half (the lower column).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// ---------------------------------------------------------------- tiles and warp GEMMs

// Rows [0, rows) of a ROWS x HD tile whose row r starts at src + r * ld, into dst (row stride HD + 8). Rows
// >= rows are zero-filled: tails then add exact zeros to the products. any_valid: a readable address passed
// for the zero-filled chunks (nothing is read from it).
template <int HD, int ROWS = 64> __device__ __forceinline__ void load_tile(bf16_t* dst, const bf16_t* src, int64_t ld,
                                                                           int rows, const bf16_t* any_valid) {
  constexpr int kPerRow = HD / 8, kChunks = ROWS * kPerRow;  // 16-byte chunks
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kPerRow, col = (c % kPerRow) * 8;
    const bool ok = r < rows;
    cp_async16(dst + r * Tile<HD>::kLd + col, ok ? src + r * ld + col : any_valid, ok);
  }
}

// acc (MT x 16 x 8 NT) += A B^T, A = m tiles a_row + 16 mt of sA (each 16 x HD), B = rows b_row .. b_row + 8 NT - 1
// of sB (8 NT x HD): both operands row-major along HD, as Q K^T, K Q^T, dO V^T, V dO^T are. Each B fragment read
// from shared memory feeds MT mma: reading shared memory is what bounds these loops.
template <int HD, int NT, int MT> __device__ __forceinline__ void gemm_abt(float (&acc)[MT][NT][4], const bf16_t* sA,
                                                                           int a_row, const bf16_t* sB, int b_row) {
  static_assert(NT % 2 == 0, "n tiles in pairs");
  constexpr int LD = Tile<HD>::kLd;
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int kc = 0; kc < HD / 16; ++kc) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], sA + (a_row + 16 * mt + lane % 16) * LD + kc * 16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldsm_x4(b, sB + (b_row + np * 16 + lane % 8 + (lane / 16) * 8) * LD + kc * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// P (16 x 8 NT) given as NT f32 accumulator tiles, rounded to bf16 as KC = NT / 2 A operands (16 x 16). The C
// layout of n tiles 2kc and 2kc + 1 is the A layout of k chunk kc: no shuffles needed.
template <int NT> __device__ __forceinline__ void to_a(uint32_t (&a)[NT / 2][4], const float (&p)[NT][4]) {
  static_assert(NT % 2 == 0, "k chunks of 16");
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {
    a[kc][0] = pack_bf16(p[2 * kc][0], p[2 * kc][1]);
    a[kc][1] = pack_bf16(p[2 * kc][2], p[2 * kc][3]);
    a[kc][2] = pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]);
    a[kc][3] = pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3]);
  }
}

// acc (MT x 16 x HD) += P B, P (MT x 16 x 16 KC) as A operands (to_a), B = rows b_row .. b_row + 16 KC - 1 of sB
// (16 KC x HD, row-major along HD), as P V, P^T dO, dS^T Q, dS K are. Each B fragment feeds MT mma.
template <int HD, int KC, int MT> __device__ __forceinline__ void gemm_pb(float (&acc)[MT][HD / 8][4],
                                                                          const uint32_t (&a)[MT][KC][4],
                                                                          const bf16_t* sB, int b_row) {
  constexpr int LD = Tile<HD>::kLd;
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int kc = 0; kc < KC; ++kc)
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      uint32_t b[4];  // transposed matrices: k 0-7 x n 0-7, k 8-15 x n 0-7, k 0-7 x n 8-15, k 8-15 x n 8-15
      ldsm_x4_trans(b, sB + (b_row + kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + dp * 16 + (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(acc[mt][2 * dp], a[mt][kc], b[0], b[1]);
        mma_bf16(acc[mt][2 * dp + 1], a[mt][kc], b[2], b[3]);
      }
    }
}

// A query tile's rows as one warp holds them: rows w0 .. w0 + 16 MT - 1 of the tile, this thread's rows
// w0 + 16 mt + lane / 4 (+ 8), their causal limits and first keys, and what the warp as a whole sees.
template <int MT> struct WarpRows {
  int w0, lim[MT][2], fk[MT][2];
  int lim_min, fk_max;  // this thread's smallest limit and largest first key: no element mask needed past them
  int lo, hi;           // the warp sees keys [lo, hi) at most (hi = 0 when it has no row within T)
  __device__ WarpRows(const Dims& d, int b, int first_row) : w0(first_row) {
    fk_max = 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        lim[mt][r] = d.limit(row(mt, r));
        fk[mt][r] = d.first_key(b, row(mt, r));
        fk_max = fk_max > fk[mt][r] ? fk_max : fk[mt][r];
      }
    lim_min = lim[0][0];
    const int wn = min(16 * MT, d.T - w0);
    hi = wn > 0 ? d.limit(w0 + wn - 1) : 0;
    lo = tile_first_min(d, b, w0, wn);
  }
  __device__ int row(int mt, int r) const { return w0 + 16 * mt + int(threadIdx.x) % 32 / 4 + 8 * r; }
  // The warp sees a key of [s0, s0 + 64).
  __device__ bool sees(int s0) const { return s0 < hi && lo < s0 + kBlockN && lo < hi; }
};

// ---------------------------------------------------------------- forward

// grid (B*H, query blocks of 64 MT), 128 threads; smem: Q (64 MT rows), then K and V of two stages. Warp w owns
// query rows 16 MT w .. 16 MT (w + 1) - 1. (Holding Q's fragments in registers instead of re-reading them from shared
// memory for each key block ran slower on an H200: 1.40 against 1.32 ms at hd 128.)
template <int HD, int MT> __global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_fwd_k(bf16_t* __restrict__ out, float* __restrict__ lse, const bf16_t* __restrict__ q,
                const bf16_t* __restrict__ k, const bf16_t* __restrict__ v, Dims d) {
  constexpr int QB = kWarps * 16 * MT, kElems = Tile<HD>::kElems;
  MT_DYNAMIC_SMEM(smem);
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem);  // (QB, HD + 8)
  bf16_t* sK = sQ + QB * Tile<HD>::kLd;          // [2] (64, HD + 8): key block j in stage j % 2
  bf16_t* sV = sK + 2 * kElems;                  // [2] (64, HD + 8)
  const int b = int(blockIdx.x) / d.H, h = int(blockIdx.x) % d.H, kvh = h / d.group;
  const int t0 = (int(gridDim.y) - 1 - int(blockIdx.y)) * QB;  // the last (heaviest causal) blocks first
  const int nq = min(QB, d.T - t0);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t q_ld = int64_t(d.H) * HD, kv_ld = int64_t(d.KV) * HD;  // row strides
  const bf16_t* qg = q + ((int64_t(b) * d.T + t0) * d.H + h) * HD;     // (nq, hd)
  const bf16_t* kg = k + (int64_t(b) * d.S * d.KV + kvh) * HD;         // (S, hd)
  const bf16_t* vg = v + (int64_t(b) * d.S * d.KV + kvh) * HD;         // (S, hd)
  // Key blocks [j_begin, j_end). The last row sees the most keys: later key blocks are fully masked and
  // skipped; no row sees a key before the earliest document start of the tile: earlier blocks are skipped too.
  // Within them a warp computes only the blocks its own rows see, and masks element-wise only blocks that end
  // past its first row's limit or start before a row's first key.
  const int hi = d.limit(t0 + nq - 1), lo = tile_first_min(d, b, t0, nq);
  const int j_begin = lo / kBlockN, j_end = lo < hi ? (hi + kBlockN - 1) / kBlockN : j_begin;
  const WarpRows<MT> w(d, b, t0 + warp * 16 * MT);
  const int col = (lane % 4) * 2;  // this thread's first column in each n8 tile

  auto load_kv = [&](int j, int stage) {
    const int s0 = j * kBlockN, rows = min(kBlockN, d.S - s0);
    load_tile<HD>(sK + stage * kElems, kg + s0 * kv_ld, kv_ld, rows, k);
    load_tile<HD>(sV + stage * kElems, vg + s0 * kv_ld, kv_ld, rows, v);
  };
  load_tile<HD, QB>(sQ, qg, q_ld, nq, q);
  if (j_begin < j_end) load_kv(j_begin, j_begin % 2);
  cp_async_commit();
  float o[MT][HD / 8][4] = {};  // (16 MT, HD) un-normalised output of the warp's rows
  float m[MT][2], l[MT][2];     // running max (log2 domain) and this thread's part of the sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  for (int j = j_begin; j < j_end; ++j) {
    if (j + 1 < j_end) load_kv(j + 1, (j + 1) % 2);
    cp_async_commit();  // possibly empty: keeps one group per iteration so wait<1> means "block j is here"
    cp_async_wait<1>();
    __syncthreads();
    const int s0 = j * kBlockN;
    if (w.sees(s0)) {  // the same in every lane of the warp
      const bf16_t* cK = sK + (j % 2) * kElems;
      const bf16_t* cV = sV + (j % 2) * kElems;
      const bool masked = s0 + kBlockN > w.lim_min || s0 < w.fk_max;  // a key past a limit or before a document
      // In chunks of KK keys, each its own online-softmax step: at 16 MT x HD = 4096 the output accumulators take
      // 128 registers, and a whole block's scores would not fit beside them.
      constexpr int KK = MT * HD <= 128 ? kBlockN : kBlockN / 2;
#pragma unroll 1
      for (int kk = 0; kk < kBlockN; kk += KK) {
        float s[MT][KK / 8][4] = {};  // (16 MT, KK) scores, then probabilities
        gemm_abt<HD, KK / 8, MT>(s, sQ, warp * 16 * MT, cK, kk);
        uint32_t pa[MT][KK / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
          for (int nt = 0; nt < KK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = s[mt][nt][e] * d.scale_log2;
              const int key = s0 + kk + nt * 8 + col + (e & 1);
              if (masked && (key >= w.lim[mt][e / 2] || key < w.fk[mt][e / 2])) x = -INFINITY;
              s[mt][nt][e] = x;
              mx[e / 2] = fmaxf(mx[e / 2], x);
            }
          float base[2], corr[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // The 4 lanes of a quad hold the same row.
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // a row with nothing visible yet: exp2(-inf - 0) = 0, no NaN
            corr[r] = exp2f(m[mt][r] - base[r]);         // 0 while m is -inf
            m[mt][r] = mx[r];
            l[mt][r] *= corr[r];
          }
#pragma unroll
          for (int nt = 0; nt < KK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float p = exp2f(s[mt][nt][e] - base[e / 2]);
              s[mt][nt][e] = p;
              l[mt][e / 2] += p;
            }
#pragma unroll
          for (int dt = 0; dt < HD / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][dt][e] *= corr[e / 2];
          to_a(pa[mt], s[mt]);
        }
        gemm_pb<HD, KK / 16, MT>(o, pa, cV, kk);
      }
    }
    __syncthreads();  // every warp is done with this stage before iteration j + 1 refills it
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int t = w.row(mt, r);
      if (t >= d.T) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that saw no key: out = 0
      bf16_t* og = out + ((int64_t(b) * d.T + t) * d.H + h) * HD + col;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt)
        *reinterpret_cast<uint32_t*>(og + dt * 8) = pack_bf16(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      if (lane % 4 == 0) lse[(int64_t(b) * d.H + h) * d.T + t] = sum > 0.f ? m[mt][r] * kLn2 + logf(sum) : -INFINITY;
    }
}

// ---------------------------------------------------------------- backward

// D (B, H, T) = rowsum(dout * out): a warp per row, rows in memory order ((b, t, h)).
template <int HD> __global__ void flash_rowdot_k(float* __restrict__ D, const bf16_t* __restrict__ dout,
                                                 const bf16_t* __restrict__ out, int64_t rows, int T, int H) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  if (row >= rows) return;  // whole warps leave together
  constexpr int kPer = HD / 32;
  const bf16_t* a = dout + row * HD + lane * kPer;
  const bf16_t* o = out + row * HD + lane * kPer;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s = fmaf(__bfloat162float(a[i]), __bfloat162float(o[i]), s);
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    const int64_t h = row % H, bt = row / H;
    D[(bt / T * H + h) * T + bt % T] = s;
  }
}

// Document masks: per (b, 64-query block) the smallest and the largest first_key of its queries, into
// tile_first (B, n_qb, 2), for the dK/dV kernel's choice of q blocks and of masking. A warp per query block.
__global__ void flash_doc_tiles_k(int* __restrict__ tile_first, Dims d, int n_qb) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  if (w >= int64_t(d.B) * n_qb) return;  // whole warps leave together
  const int b = int(w / n_qb), t0 = int(w % n_qb) * kBlockM, nq = min(kBlockM, d.T - t0);
  int lo = d.S, hi = 0;
  for (int i = lane; i < nq; i += 32) {
    const int f = d.first_key(b, t0 + i);
    lo = min(lo, f);
    hi = hi > f ? hi : f;
  }
  for (int off = 16; off > 0; off /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    const int o = __shfl_xor_sync(0xffffffffu, hi, off);
    hi = hi > o ? hi : o;
  }
  if (lane == 0) tile_first[2 * w] = lo, tile_first[2 * w + 1] = hi;
}

// dK, dV. grid (B*KV, key blocks of 64 MT), 128 threads; smem: K, V (64 MT rows each), then Q and dO of two stages,
// then lse*log2e, D and the queries' first keys of two stages (64 floats or ints each), then 2 kWarps ints. Warp
// w owns keys 16 MT w .. 16 MT (w + 1) - 1 of the block.
template <int HD, int MT> __global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_bwd_dkdv_k(bf16_t* __restrict__ dk, bf16_t* __restrict__ dv, const bf16_t* __restrict__ dout,
                     const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                     const float* __restrict__ lse, const float* __restrict__ rowdot, Dims d, bool accumulate) {
  constexpr int KB = kWarps * 16 * MT, kElems = Tile<HD>::kElems;
  MT_DYNAMIC_SMEM(smem);
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem);            // (KB, HD + 8) this CTA's keys
  bf16_t* sV = sK + KB * Tile<HD>::kLd;                    // (KB, HD + 8)
  bf16_t* sQ = sV + KB * Tile<HD>::kLd;                    // [2] (64, HD + 8): item i in stage i % 2
  bf16_t* sdO = sQ + 2 * kElems;                           // [2] (64, HD + 8)
  float* sL = reinterpret_cast<float*>(sdO + 2 * kElems);  // [2] (64) lse * log2e; +inf past T or for -inf
  float* sD = sL + 2 * kBlockM;                            // [2] (64) row dots; 0 past T
  int* sF = reinterpret_cast<int*>(sD + 2 * kBlockM);      // [2] (64) first_key of each query; 0 past T
  int* sRange = sF + 2 * kBlockM;                          // [2][kWarps] the q block range, per warp
  const int b = int(blockIdx.x) / d.KV, kvh = int(blockIdx.x) % d.KV;
  const int s0 = int(blockIdx.y) * KB, nk = min(KB, d.S - s0);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t q_ld = int64_t(d.H) * HD, kv_ld = int64_t(d.KV) * HD;
  // Items: every q head of the group, and for each the q blocks from the one holding the first query that sees
  // key s0 (later queries see at least as many keys) to the last.
  const int n_qb = (d.T + kBlockM - 1) / kBlockM;
  const int first = d.first_query(s0);
  int qb_begin = first >= d.T ? n_qb : first / kBlockM, qb_end = n_qb;
  if (d.doc_start) {
    // Document masks: only from the first to the last q block with a query whose document starts at or before
    // the block's last key (the smallest first_key of the q block, from flash_doc_tiles_k). Document starts are
    // not assumed ordered along t: blocks in between are visited, masked element-wise.
    int lo = INT_MAX, hi = -1;
    for (int qb = qb_begin + int(threadIdx.x); qb < n_qb; qb += kThreads)
      if (d.tile_first[2 * (int64_t(b) * n_qb + qb)] < s0 + nk) {
        lo = min(lo, qb);
        hi = hi > qb ? hi : qb;
      }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
      const int o = __shfl_xor_sync(0xffffffffu, hi, off);
      hi = hi > o ? hi : o;
    }
    if (lane == 0) sRange[warp] = lo, sRange[kWarps + warp] = hi;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      lo = min(lo, sRange[w]);
      hi = hi > sRange[kWarps + w] ? hi : sRange[kWarps + w];
    }
    if (hi < 0) qb_end = qb_begin;  // no query sees a key of the block
    else qb_begin = lo, qb_end = hi + 1;
  }
  const int per_head = qb_end - qb_begin, n_items = d.group * per_head;
  // The warp's keys [k0, k1) (k1 <= k0 when none is below S), the first query that sees its first key, and this
  // thread's keys (mma rows) k0 + 16 mt + lane / 4 (+ 8) with the first queries that see them.
  const int k0 = s0 + warp * 16 * MT, k1 = min(k0 + 16 * MT, d.S), wq = d.first_query(k0);
  auto key = [&](int mt, int r) { return k0 + 16 * mt + lane / 4 + 8 * r; };
  int first_q[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) first_q[mt][r] = d.first_query(key(mt, r));
  const int col = (lane % 4) * 2;

  auto load_item = [&](int it, int stage) {
    const int h = kvh * d.group + it / per_head, t0 = (qb_begin + it % per_head) * kBlockM;
    const int nq = min(kBlockM, d.T - t0);
    const int64_t off = ((int64_t(b) * d.T + t0) * d.H + h) * HD;
    load_tile<HD>(sQ + stage * kElems, q + off, q_ld, nq, q);
    load_tile<HD>(sdO + stage * kElems, dout + off, q_ld, nq, dout);
    if (int(threadIdx.x) < kBlockM) {
      const int i = int(threadIdx.x);
      float L2 = INFINITY, Dv = 0.f;  // P = 2^(x - inf) = 0 for queries past T and for rows that saw no key
      if (i < nq) {
        const int64_t idx = (int64_t(b) * d.H + h) * d.T + t0 + i;
        const float L = lse[idx];
        L2 = L == -INFINITY ? INFINITY : L * kLog2e;
        Dv = rowdot[idx];
      }
      sL[stage * kBlockM + i] = L2;
      sD[stage * kBlockM + i] = Dv;
      sF[stage * kBlockM + i] = d.first_key(b, t0 + i);
    }
  };
  const int64_t kv_off = ((int64_t(b) * d.S + s0) * d.KV + kvh) * HD;
  load_tile<HD, KB>(sK, k + kv_off, kv_ld, nk, k);
  load_tile<HD, KB>(sV, v + kv_off, kv_ld, nk, v);
  if (n_items > 0) load_item(0, 0);
  cp_async_commit();

  float dK[MT][HD / 8][4] = {}, dV[MT][HD / 8][4] = {};  // (16 MT, HD) each, the warp's keys
  for (int it = 0; it < n_items; ++it) {
    const int stage = it % 2;
    if (it + 1 < n_items) load_item(it + 1, 1 - stage);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // item it (and K, V) landed for every thread; sL, sD stores visible
    const int t0 = (qb_begin + it % per_head) * kBlockM, nq = min(kBlockM, d.T - t0);
    const int qb = t0 / kBlockM;
    // The warp computes only items whose queries see one of its keys: a query at or after the one that sees its
    // first key, and a document starting before its last key.
    const bool sees = k0 < k1 && wq < t0 + nq && (!d.doc_start || d.tile_first[2 * (int64_t(b) * n_qb + qb)] < k1);
    if (sees) {
      const bf16_t* cQ = sQ + stage * kElems;
      const bf16_t* cdO = sdO + stage * kElems;
      const float* cL = sL + stage * kBlockM;
      const float* cD = sD + stage * kBlockM;
      const int* cF = sF + stage * kBlockM;
      // Some (query, key) of the warp's part is not visible: past a causal limit, or before a query's document.
      const bool masked =
          k0 + 16 * MT > d.limit(t0) || (d.doc_start && d.tile_first[2 * (int64_t(b) * n_qb + qb) + 1] > k0);
#pragma unroll 1  // not unrolled: the two halves' live ranges would overlap and spill
      for (int half = 0; half < 2; ++half) {
        const int qo = half * 32;                     // queries qo .. qo + 31 of the tile
        float st[MT][4][4] = {}, dpt[MT][4][4] = {};  // (16 MT keys, 32 queries): S^T, then P^T; dP^T, then dS^T
        gemm_abt<HD, 4, MT>(st, sK, warp * 16 * MT, cQ, qo);
        gemm_abt<HD, 4, MT>(dpt, sV, warp * 16 * MT, cdO, qo);
        uint32_t pa[MT][2][4], dsa[MT][2][4];  // P^T and dS^T as bf16 A operands: the f32 tiles die here
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = qo + nt * 8 + col + (e & 1);  // query within the tile
              float p = exp2f(fmaf(st[mt][nt][e], d.scale_log2, -cL[i]));
              // Select, not multiply: p may be inf there.
              if (masked && (t0 + i < first_q[mt][e / 2] || key(mt, e / 2) < cF[i])) p = 0.f;
              st[mt][nt][e] = p;
              dpt[mt][nt][e] = p * (dpt[mt][nt][e] - cD[i]);
            }
          to_a(pa[mt], st[mt]);
          to_a(dsa[mt], dpt[mt]);
        }
        gemm_pb<HD, 2, MT>(dV, pa, cdO, qo);
        gemm_pb<HD, 2, MT>(dK, dsa, cQ, qo);
      }
    }
    __syncthreads();  // every warp is done with this stage before iteration it + 1 refills it
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {  // this thread's keys: rows r of m tile mt
    const int mt = i / 2, r = i % 2, s = key(mt, r);
    if (s >= d.S) continue;
    const int64_t off = ((int64_t(b) * d.S + s) * d.KV + kvh) * HD + col;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      float kx = dK[mt][dt][2 * r] * d.scale, ky = dK[mt][dt][2 * r + 1] * d.scale;
      float vx = dV[mt][dt][2 * r], vy = dV[mt][dt][2 * r + 1];
      uint32_t* pk = reinterpret_cast<uint32_t*>(dk + off + dt * 8);
      uint32_t* pv = reinterpret_cast<uint32_t*>(dv + off + dt * 8);
      if (accumulate) {  // in fp32, rounded once
        const float2 ok = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(pk));
        const float2 ov = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(pv));
        kx += ok.x, ky += ok.y, vx += ov.x, vy += ov.y;
      }
      *pk = pack_bf16(kx, ky);
      *pv = pack_bf16(vx, vy);
    }
  }
}

// dQ. grid (B*H, query blocks of 64 MT), 128 threads; smem: Q, dO (64 MT rows each), then K and V of two stages.
template <int HD, int MT> __global__ void __launch_bounds__(kThreads, kMinBlocks)
    flash_bwd_dq_k(bf16_t* __restrict__ dq, const bf16_t* __restrict__ dout, const bf16_t* __restrict__ q,
                   const bf16_t* __restrict__ k, const bf16_t* __restrict__ v, const float* __restrict__ lse,
                   const float* __restrict__ rowdot, Dims d) {
  constexpr int QB = kWarps * 16 * MT, kElems = Tile<HD>::kElems;
  MT_DYNAMIC_SMEM(smem);
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem);  // (QB, HD + 8)
  bf16_t* sdO = sQ + QB * Tile<HD>::kLd;         // (QB, HD + 8)
  bf16_t* sK = sdO + QB * Tile<HD>::kLd;         // [2] (64, HD + 8): key block j in stage j % 2
  bf16_t* sV = sK + 2 * kElems;                  // [2] (64, HD + 8)
  const int b = int(blockIdx.x) / d.H, h = int(blockIdx.x) % d.H, kvh = h / d.group;
  const int t0 = (int(gridDim.y) - 1 - int(blockIdx.y)) * QB;
  const int nq = min(QB, d.T - t0);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t q_ld = int64_t(d.H) * HD, kv_ld = int64_t(d.KV) * HD;
  const int64_t q_off = ((int64_t(b) * d.T + t0) * d.H + h) * HD;
  const bf16_t* kg = k + (int64_t(b) * d.S * d.KV + kvh) * HD;  // (S, hd)
  const bf16_t* vg = v + (int64_t(b) * d.S * d.KV + kvh) * HD;  // (S, hd)
  // Key blocks [j_begin, j_end), and the warp's rows, as in the forward.
  const int hi = d.limit(t0 + nq - 1), lo = tile_first_min(d, b, t0, nq);
  const int j_begin = lo / kBlockN, j_end = lo < hi ? (hi + kBlockN - 1) / kBlockN : j_begin;
  const WarpRows<MT> w(d, b, t0 + warp * 16 * MT);
  const int col = (lane % 4) * 2;
  float L2[MT][2], Dv[MT][2];  // lse * log2e (+inf past T or for a row that saw no key: P = 0) and the row dot
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = w.row(mt, r);
      L2[mt][r] = INFINITY, Dv[mt][r] = 0.f;
      if (t < d.T) {
        const int64_t idx = (int64_t(b) * d.H + h) * d.T + t;
        const float L = lse[idx];
        L2[mt][r] = L == -INFINITY ? INFINITY : L * kLog2e;
        Dv[mt][r] = rowdot[idx];
      }
    }

  auto load_kv = [&](int j, int stage) {
    const int s0 = j * kBlockN, rows = min(kBlockN, d.S - s0);
    load_tile<HD>(sK + stage * kElems, kg + s0 * kv_ld, kv_ld, rows, k);
    load_tile<HD>(sV + stage * kElems, vg + s0 * kv_ld, kv_ld, rows, v);
  };
  load_tile<HD, QB>(sQ, q + q_off, q_ld, nq, q);
  load_tile<HD, QB>(sdO, dout + q_off, q_ld, nq, dout);
  if (j_begin < j_end) load_kv(j_begin, j_begin % 2);
  cp_async_commit();

  float acc[MT][HD / 8][4] = {};  // (16 MT, HD) dQ of the warp's rows, unscaled
  for (int j = j_begin; j < j_end; ++j) {
    if (j + 1 < j_end) load_kv(j + 1, (j + 1) % 2);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int s0 = j * kBlockN;
    if (w.sees(s0)) {
      const bf16_t* cK = sK + (j % 2) * kElems;
      const bf16_t* cV = sV + (j % 2) * kElems;
      const bool masked = s0 + kBlockN > w.lim_min || s0 < w.fk_max;
      // In chunks of KK keys: at two m tiles a whole block's S and dP would not fit the registers with dQ.
      constexpr int KK = MT == 1 ? kBlockN : kBlockN / 2;
#pragma unroll 1
      for (int kk = 0; kk < kBlockN; kk += KK) {
        float s[MT][KK / 8][4] = {}, dp[MT][KK / 8][4] = {};  // (16 MT, KK): S then dS; dP
        gemm_abt<HD, KK / 8, MT>(s, sQ, warp * 16 * MT, cK, kk);
        gemm_abt<HD, KK / 8, MT>(dp, sdO, warp * 16 * MT, cV, kk);
        uint32_t dsa[MT][KK / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < KK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float p = exp2f(fmaf(s[mt][nt][e], d.scale_log2, -L2[mt][e / 2]));
              const int key = s0 + kk + nt * 8 + col + (e & 1);
              if (masked && (key >= w.lim[mt][e / 2] || key < w.fk[mt][e / 2])) p = 0.f;  // select: p may be inf
              s[mt][nt][e] = p * (dp[mt][nt][e] - Dv[mt][e / 2]);
            }
          to_a(dsa[mt], s[mt]);
        }
        gemm_pb<HD, KK / 16, MT>(acc, dsa, cK, kk);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = w.row(mt, r);
      if (t >= d.T) continue;
      bf16_t* g = dq + ((int64_t(b) * d.T + t) * d.H + h) * HD + col;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt)
        *reinterpret_cast<uint32_t*>(g + dt * 8) =
            pack_bf16(acc[mt][dt][2 * r] * d.scale, acc[mt][dt][2 * r + 1] * d.scale);
    }
}

// ---------------------------------------------------------------- launchers

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 0, or -1 for sizes the kernels do not take (grid.y is limited to 65535 blocks, sizes must fit in int).
int check_sizes(int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV, int64_t hd) {
  if (B < 0 || T < 0 || S < 0 || H < 1 || KV < 1 || H % KV != 0) return -1;
  if (hd != 64 && hd != 128) return -1;
  if (T > (int64_t(1) << 30) || S > (int64_t(1) << 30)) return -1;
  if (B * H > INT_MAX || cdiv(T, kBlockM) > 65535 || cdiv(S, kBlockN) > 65535) return -1;
  return 0;
}

// Bytes of the backward scratch's row dots D (B, H, T) f32; the document-mask bounds (B, query blocks, 2) i32
// follow them.
size_t rowdot_bytes(int64_t B, int64_t T, int64_t H) {
  const int64_t n = B > 0 && T > 0 && H > 0 ? B * H * T : 0;
  return size_t(cdiv(n * int64_t(sizeof(float)), 256) * 256);
}

Dims make_dims(int64_t B, int64_t T, int64_t S, int64_t H, int64_t KV, double scale, bool causal, int64_t q_pos0,
               int64_t k_pos0, const int64_t* doc_start) {
  Dims d;
  d.B = int(B), d.T = int(T), d.S = int(S), d.H = int(H), d.KV = int(KV), d.group = int(H / KV);
  d.scale = float(scale);
  d.scale_log2 = float(scale * 1.4426950408889634);
  d.causal = causal;
  d.q_pos0 = q_pos0, d.k_pos0 = k_pos0;
  d.doc_start = doc_start;
  d.tile_first = nullptr;
  return d;
}

// Opts a kernel into more than 48 KiB of dynamic shared memory, then launches it.
template <typename Kernel, typename... Args>
int launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, Args... args) {
  if (int err = int(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)))) return err;
  MT_LAUNCH(kernel, grid, kThreads, smem, stream, args...);
  return int(cudaGetLastError());
}

// m tiles per warp (rows per warp / 16) of the forward, the dQ and the dK/dV kernels, the faster choice measured on
// an H200 (docs/PERFORMANCE.md, "the flash kernel's tilings"): two for the forward at head dim 128 (1.31 -> 1.12 ms
// on the 1B step's shape) and for dQ and dK/dV at head dim 64 (forward + backward 3.62 -> 3.28 ms); one elsewhere
// (at head dim 128 two in dQ ran 1.2x slower, and dK/dV's accumulators would not fit; at head dim 64 two in the
// forward ran 1.05x slower).
struct Tiling {
  int fwd, dq, dkdv;
};
template <int HD> Tiling tiling() {
  Tiling t = HD == 64 ? Tiling{1, 2, 2} : Tiling{2, 1, 1};
  // MT_FLASH_MT=f,q,k (each 1 or 2; q and k only at head dim 64) overrides them for benchmarks: one build times each.
  static const char* env = std::getenv("MT_FLASH_MT");
  if (env && std::strlen(env) == 5)
    t = Tiling{env[0] == '1' ? 1 : 2, HD == 64 && env[2] == '2' ? 2 : 1, HD == 64 && env[4] == '2' ? 2 : 1};
  return t;
}

template <int HD, int MT> int forward_mt(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                         const Dims& d, cudaStream_t stream) {
  constexpr int QB = kWarps * 16 * MT;
  const dim3 grid(unsigned(d.B * d.H), unsigned(cdiv(d.T, QB)));
  const size_t smem = size_t(QB + 4 * kBlockN) * Tile<HD>::kLd * sizeof(bf16_t);
  return launch(flash_fwd_k<HD, MT>, grid, smem, stream, out, lse, q, k, v, d);
}

template <int HD, int MT> int dq_mt(bf16_t* dq, const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                    const float* lse, const float* D, const Dims& d, cudaStream_t stream) {
  constexpr int QB = kWarps * 16 * MT;
  const dim3 grid(unsigned(d.B * d.H), unsigned(cdiv(d.T, QB)));
  const size_t smem = size_t(2 * QB + 4 * kBlockN) * Tile<HD>::kLd * sizeof(bf16_t);
  return launch(flash_bwd_dq_k<HD, MT>, grid, smem, stream, dq, dout, q, k, v, lse, D, d);
}

template <int HD, int MT> int dkdv_mt(bf16_t* dk, bf16_t* dv, const bf16_t* dout, const bf16_t* q, const bf16_t* k,
                                      const bf16_t* v, const float* lse, const float* D, const Dims& d, bool accumulate,
                                      cudaStream_t stream) {
  constexpr int KB = kWarps * 16 * MT;
  const dim3 grid(unsigned(d.B * d.KV), unsigned(cdiv(d.S, KB)));
  const size_t smem = size_t(2 * KB + 4 * kBlockM) * Tile<HD>::kLd * sizeof(bf16_t) + 4 * kBlockM * sizeof(float) +
                      2 * kBlockM * sizeof(int) + 2 * kWarps * sizeof(int);
  return launch(flash_bwd_dkdv_k<HD, MT>, grid, smem, stream, dk, dv, dout, q, k, v, lse, D, d, accumulate);
}

template <int HD> int forward_hd(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                 const Dims& d, cudaStream_t stream) {
  if (tiling<HD>().fwd == 2) return forward_mt<HD, 2>(out, lse, q, k, v, d, stream);
  return forward_mt<HD, 1>(out, lse, q, k, v, d, stream);
}

template <int HD> int backward_hd(bf16_t* dq, bf16_t* dk, bf16_t* dv, float* D, const bf16_t* dout, const bf16_t* q,
                                  const bf16_t* k, const bf16_t* v, const bf16_t* out, const float* lse, const Dims& d,
                                  bool accumulate, cudaStream_t stream) {
  const int64_t rows = int64_t(d.B) * d.T * d.H;
  const Tiling tl = tiling<HD>();
  if (d.doc_start && int64_t(d.B) * d.T * d.S > 0) {  // the q block bounds the dK/dV kernel reads
    constexpr int kTileThreads = 256;                 // 8 query blocks per CTA
    const int n_qb = int(cdiv(d.T, kBlockM));
    MT_LAUNCH(flash_doc_tiles_k, dim3(unsigned(cdiv(int64_t(d.B) * n_qb * 32, kTileThreads))), kTileThreads, 0, stream,
              const_cast<int*>(d.tile_first), d, n_qb);
    if (int err = int(cudaGetLastError())) return err;
  }
  if (rows > 0) {
    constexpr int kRowThreads = 256;  // 8 rows per block
    MT_LAUNCH(flash_rowdot_k<HD>, dim3(unsigned(cdiv(rows * 32, kRowThreads))), kRowThreads, 0, stream, D, dout, out,
              rows, d.T, d.H);
    if (int err = int(cudaGetLastError())) return err;
    int err;
    if constexpr (HD == 64)  // two m tiles in dQ and dK/dV only at head dim 64 (tiling())
      err = tl.dq == 2 ? dq_mt<HD, 2>(dq, dout, q, k, v, lse, D, d, stream)
                       : dq_mt<HD, 1>(dq, dout, q, k, v, lse, D, d, stream);
    else err = dq_mt<HD, 1>(dq, dout, q, k, v, lse, D, d, stream);
    if (err) return err;
  }
  if (int64_t(d.B) * d.KV * d.S > 0) {  // runs with T == 0 too: dk, dv are then zeroed (or left as they are)
    if constexpr (HD == 64)
      if (tl.dkdv == 2) return dkdv_mt<HD, 2>(dk, dv, dout, q, k, v, lse, D, d, accumulate, stream);
    return dkdv_mt<HD, 1>(dk, dv, dout, q, k, v, lse, D, d, accumulate, stream);
  }
  return 0;
}

const bf16_t* bp(const void* p) { return static_cast<const bf16_t*>(p); }
bf16_t* bp(void* p) { return static_cast<bf16_t*>(p); }

}  // namespace

int flash_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T,
                            int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                            int64_t k_pos0, const int64_t* doc_start, void* stream) {
  if (int err = check_sizes(B, T, S, H, KV, hd)) return err;
  if (B == 0 || T == 0) return 0;
  if (!aligned(out, 16) || !aligned(q, 16) || !aligned(lse, 4) || (S > 0 && (!aligned(k, 16) || !aligned(v, 16))) ||
      !aligned(doc_start, 8))
    return -1;
  Range r("flash_attention_forward");
  const Dims d = make_dims(B, T, S, H, KV, scale, causal, q_pos0, k_pos0, doc_start);
  return hd == 64 ? forward_hd<64>(bp(out), lse, bp(q), bp(k), bp(v), d, st(stream))
                  : forward_hd<128>(bp(out), lse, bp(q), bp(k), bp(v), d, st(stream));
}

size_t flash_attention_backward_scratch_bytes(int64_t B, int64_t T, int64_t /*S*/, int64_t H, int64_t /*KV*/,
                                              int64_t /*hd*/) {
  // D (B, H, T) f32, then the document-mask bounds (B, query blocks, 2) i32 (reserved whether or not a mask is
  // passed).
  const int64_t tiles = B > 0 && T > 0 && H > 0 ? B * cdiv(T, kBlockM) : 0;
  return rowdot_bytes(B, T, H) + size_t(cdiv(tiles * 2 * int64_t(sizeof(int)), 256) * 256);
}

int flash_attention_backward(void* dq, void* dk, void* dv, void* scratch, const void* dout, const void* q,
                             const void* k, const void* v, const void* out, const float* lse, int64_t B, int64_t T,
                             int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                             int64_t k_pos0, const int64_t* doc_start, bool accumulate, void* stream) {
  if (int err = check_sizes(B, T, S, H, KV, hd)) return err;
  if (B == 0 || (T == 0 && S == 0)) return 0;
  if (T > 0 && (!aligned(dq, 16) || !aligned(dout, 16) || !aligned(q, 16) || !aligned(out, 16) || !aligned(lse, 4) ||
                !aligned(scratch, 4) || !aligned(doc_start, 8)))
    return -1;
  if (S > 0 && (!aligned(dk, 16) || !aligned(dv, 16) || !aligned(k, 16) || !aligned(v, 16))) return -1;
  Range r("flash_attention_backward");
  Dims d = make_dims(B, T, S, H, KV, scale, causal, q_pos0, k_pos0, T > 0 ? doc_start : nullptr);
  float* D = static_cast<float*>(scratch);  // (B, H, T)
  if (d.doc_start) d.tile_first = reinterpret_cast<const int*>(static_cast<char*>(scratch) + rowdot_bytes(B, T, H));
  return hd == 64 ? backward_hd<64>(bp(dq), bp(dk), bp(dv), D, bp(dout), bp(q), bp(k), bp(v), bp(out), lse, d,
                                    accumulate, st(stream))
                  : backward_hd<128>(bp(dq), bp(dk), bp(dv), D, bp(dout), bp(q), bp(k), bp(v), bp(out), lse, d,
                                     accumulate, st(stream));
}

}  // namespace mt::cuda
