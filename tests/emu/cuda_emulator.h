// Runs CUDA kernel source on the CPU, so that the tensor-core kernels' indexing, masking, pipelining and
// synchronisation are checked on machines without a GPU (CI). Include this, define MT_CUDA_EMULATOR, then
// include the .cu file: it skips its CUDA headers and PTX wrappers, and the emulator supplies them.
//
// Model. Every CUDA thread of a block is a fiber (ucontext) on one OS thread; blocks are spread over the
// cores. Fibers switch only at barriers (__syncthreads, and a warp barrier inside every warp collective), so a
// kernel whose threads disagree on which barrier comes next ends in a reported deadlock, not a hang. Warp
// collectives (shfl, ldmatrix, mma.sync m16n8k16 bf16) exchange operands through per-warp slots between two
// warp barriers and follow the PTX ISA's fragment layouts. cp.async copies land as late as the PTX rules allow
// (at the wait_group that needs them), shared memory starts filled with NaN bytes, and every cp.async source
// must lie inside a buffer the test registered (emu::allow_reads), so reading too early or past a tail shows.
// Not modelled: timing, register pressure, bank conflicts, shared-memory races between barriers.
#pragma once

#if defined(MT_EMU_RUNTIME)
// The emulated build (-Demulate_cuda=true): the kernel files are compiled through this header by the host
// compiler (tests/emu/emu_unit.cpp.in) and linked with the emulated runtime (cuda_runtime_emu.cpp). The
// toolkit's own headers declare the API; launches run in stream order through emu::launch_checked, which checks
// every pointer argument against the device-allocation registry and records it for the hazard tracker.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include "tests/emu/cuda_emulator_hooks.h"
#include "tests/emu/device_registry.h"
#else
#include <cuda_bf16.h>
#endif
#include <ucontext.h>

// AddressSanitizer (the --full run of scripts/test.sh, build-emu-asan): every switch between the scheduler and a
// fiber is announced (__sanitizer_start_switch_fiber before, __sanitizer_finish_switch_fiber after), so ASan knows
// which stack is live: its stack bounds, fake stacks (detect_stack_use_after_return) and the unpoisoning that
// follows a throw (__asan_handle_no_return) then apply to the fiber's own stack, not the OS thread's.
#if defined(__SANITIZE_ADDRESS__)
#define MT_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MT_EMU_ASAN 1
#endif
#endif
#if defined(MT_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __launch_bounds__(...)
#undef __align__
#define __align__(x)
// A kernel's static shared memory: one copy per OS thread, and every block runs on an OS thread of its own (all of
// its fibers), so it is shared by the block's threads exactly and starts at zero in each block.
#define __shared__ static thread_local
#define MT_CUDA_EMULATOR 1
#define MT_DYNAMIC_SMEM(name) unsigned char* name = emu::shared_memory()
#if defined(MT_EMU_RUNTIME)
#define MT_LAUNCH(kernel, grid, block, smem, stream, ...) \
  emu::launch_checked(#kernel, kernel, dim3(grid), dim3(block), size_t(smem), stream __VA_OPT__(, ) __VA_ARGS__)
#else
#define MT_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ((void)(stream), emu::launch(kernel, grid, block, smem __VA_OPT__(, ) __VA_ARGS__))
#endif

inline thread_local dim3 threadIdx, blockIdx, gridDim, blockDim;

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "[cuda_emulator] %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// Global ranges cp.async may read; registered by the test before a launch.
struct Range {
  const unsigned char* begin;
  size_t bytes;
};
inline std::vector<Range> readable;
inline void allow_reads(const void* p, size_t bytes) {
  readable.push_back({static_cast<const unsigned char*>(p), bytes});
}
inline void clear_reads() { readable.clear(); }
inline bool may_read(const void* p, size_t n) {
#if defined(MT_EMU_RUNTIME)
  if (is_device_ptr(p, n)) return true;  // the emulated build: any live device allocation
#endif
  auto* c = static_cast<const unsigned char*>(p);
  for (const auto& r : readable)
    if (c >= r.begin && c + n <= r.begin + r.bytes) return true;
  return false;
}

inline std::atomic<long long> mma_count{0};  // warp-level mma instructions, for the test's report
inline std::atomic<size_t> max_smem{0};

struct Pending {
  void* dst;
  const void* src;
  bool valid;
};
struct Slot {
  const void* addr;
  uint32_t a[4];
  uint32_t b[2];
  float f;
  int i;
};

struct Fiber {
  ucontext_t ctx;
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while it is switched out
  unsigned char* stack = nullptr;  // from the OS thread's pool (stack_pool)
  unsigned tid = 0;
  int waiting = -1;       // barrier index (0 = block, 1 + w = warp w), -1 when runnable
  unsigned long gen = 0;  // that barrier's generation when this fiber arrived
  bool done = false;
  std::vector<std::vector<Pending>> groups;  // committed cp.async groups, oldest first
  std::vector<Pending> open;                 // not yet committed
};

struct Barrier {
  unsigned expected = 0, arrived = 0;
  unsigned long gen = 0;
};

// One OS thread's scheduler: runs a block's fibers until all return.
struct Block {
  ucontext_t sched;
  void* sched_fake_stack = nullptr;                  // ASan: the scheduler's, while a fiber runs
  const void* sched_stack = nullptr;                 // ASan: the scheduler's (OS thread's) stack,
  size_t sched_stack_size = 0;                       // learnt when the first fiber starts
  std::vector<Fiber> fibers;
  std::vector<Barrier> barriers;
  std::vector<Slot> slots;  // 32 per warp
  std::vector<unsigned char> smem;
  Fiber* current = nullptr;
  std::function<void()> body;
};
inline thread_local Block* block;

inline Fiber& me() { return *block->current; }
inline unsigned lane() { return me().tid % 32; }
inline unsigned warp() { return me().tid / 32; }
inline unsigned char* shared_memory() { return block->smem.data(); }
inline bool in_smem(const void* p, size_t n) {
  auto* c = static_cast<const unsigned char*>(p);
  return c >= block->smem.data() && c + n <= block->smem.data() + block->smem.size();
}

// Switches with ASan's annotations (no-ops without ASan). to_fiber: the scheduler resumes fiber f; to_sched: the
// running fiber f yields to the scheduler (exiting: it never resumes, its fake stack is released).
inline void switch_to_fiber(Block& b, Fiber& f);
inline void switch_to_sched(Fiber& f, bool exiting);

inline void arrive(int index) {
  Barrier& b = block->barriers[size_t(index)];
  Fiber& f = me();
  if (++b.arrived == b.expected) {  // the last one releases the others
    b.arrived = 0;
    ++b.gen;
    return;
  }
  f.waiting = index;
  f.gen = b.gen;
  switch_to_sched(f, false);
}
inline void warp_sync() { arrive(1 + int(warp())); }
inline Slot& slot(unsigned l) { return block->slots[warp() * 32 + l]; }

constexpr size_t kStack = 256 * 1024;

inline void switch_to_fiber(Block& b, Fiber& f) {
#if defined(MT_EMU_ASAN)
  __sanitizer_start_switch_fiber(&b.sched_fake_stack, f.stack, kStack);
  swapcontext(&b.sched, &f.ctx);
  __sanitizer_finish_switch_fiber(b.sched_fake_stack, nullptr, nullptr);
#else
  swapcontext(&b.sched, &f.ctx);
#endif
}
inline void switch_to_sched(Fiber& f, bool exiting) {
#if defined(MT_EMU_ASAN)
  Block& b = *block;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, b.sched_stack, b.sched_stack_size);
  swapcontext(&f.ctx, &b.sched);
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#else
  (void)exiting;
  swapcontext(&f.ctx, &block->sched);
#endif
}

inline void fiber_entry() {
#if defined(MT_EMU_ASAN)
  // First run of this fiber: finish the switch that started it, learning the scheduler's stack to switch back to.
  __sanitizer_finish_switch_fiber(nullptr, &block->sched_stack, &block->sched_stack_size);
#endif
  block->body();
  me().done = true;
  switch_to_sched(me(), true);
}

// Runs fibers round-robin; a fiber waiting on a barrier becomes runnable once that barrier's generation moved.
// MT_EMU_SCHEDULE=reverse runs a block's threads from the last to the first between barriers: a kernel whose
// threads read what other threads write without a barrier in between (a race on a GPU) gives other results in
// the two orders, so running a test in both finds it.
inline const bool reverse_schedule = [] {
  const char* e = std::getenv("MT_EMU_SCHEDULE");
  return e && std::strcmp(e, "reverse") == 0;
}();

inline void run_block(Block& b) {
  block = &b;
  size_t left = b.fibers.size();
  const size_t n = b.fibers.size();
  while (left > 0) {
    bool progressed = false;
    for (size_t k = 0; k < n; ++k) {
      Fiber& f = b.fibers[reverse_schedule ? n - 1 - k : k];
      if (f.done) continue;
      if (f.waiting >= 0) {
        if (b.barriers[size_t(f.waiting)].gen == f.gen) continue;
        f.waiting = -1;
      }
      b.current = &f;
      threadIdx = dim3(f.tid % blockDim.x, f.tid / blockDim.x % blockDim.y, f.tid / (blockDim.x * blockDim.y));
      switch_to_fiber(b, f);
      progressed = true;
      if (f.done) --left;
    }
    if (!progressed) fail("deadlock: threads wait at different barriers (divergent __syncthreads or warp op)");
  }
  for (auto& f : b.fibers)
    if (!f.groups.empty() || !f.open.empty()) fail("cp.async copies still in flight at kernel exit");
}

// Fiber stacks, kept per OS thread across launches. Left uninitialised: the pages a fiber never touches are
// never faulted in (zeroing 128 stacks a launch was most of the emulator's time on small shapes).
inline unsigned char* fiber_stack(unsigned i) {
  thread_local std::vector<std::unique_ptr<unsigned char[]>> pool;
  while (pool.size() <= i) pool.emplace_back(new unsigned char[kStack]);
  return pool[i].get();
}

// Runs every block of the grid, blocks spread over the cores, each block's threads as fibers. Blocks of any
// shape up to 1024 threads; the last warp may be partial (its warp barriers expect only its threads).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block_dim, size_t smem, Args... args) {
  const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024) fail("launch: block size");
  if (smem > 227 * 1024) fail("launch: more dynamic shared memory than an H100 SM has (227 KiB)");
  if (grid.y > 65535 || grid.z > 65535 || grid.x == 0 || grid.y == 0 || grid.z == 0) fail("launch: grid");
  for (size_t m = max_smem; smem > m && !max_smem.compare_exchange_weak(m, smem);) {}
  const long long n_blocks = (long long)grid.x * grid.y * grid.z;
  std::atomic<long long> next{0};
  auto worker = [&] {
    Block b;
    b.fibers.resize(threads);
    const unsigned warps = (threads + 31) / 32;
    b.barriers.resize(1 + warps);
    b.barriers[0].expected = threads;
    for (unsigned w = 0; w < warps; ++w) b.barriers[1 + w].expected = std::min(32u, threads - 32 * w);
    b.slots.resize(size_t(warps) * 32);
    b.body = [&] { kernel(args...); };
    for (unsigned t = 0; t < threads; ++t) b.fibers[t].stack = fiber_stack(t);
    for (long long i; (i = next++) < n_blocks;) {
      // Each block on a fresh OS thread: static __shared__ variables (thread_local) start at zero in every block,
      // as they would start undefined on the device, instead of keeping the last block's (or launch's) values,
      // which would hide a read before the block wrote them.
      std::thread([&] {
        threadIdx = dim3(0);
        blockIdx = dim3(unsigned(i % grid.x), unsigned(i / grid.x % grid.y), unsigned(i / grid.x / grid.y));
        gridDim = grid;
        blockDim = block_dim;
        b.smem.assign(smem, 0xff);  // NaN bytes: the kernel must not read shared memory it did not fill
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.tid = t, f.waiting = -1, f.done = false, f.fake_stack = nullptr, f.groups.clear(), f.open.clear();
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        for (auto& bar : b.barriers) bar.arrived = 0;
        run_block(b);
      }).join();
    }
  };
  const unsigned n_workers = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), unsigned(std::min<long long>(n_blocks, 1 << 20))));
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < n_workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

#if defined(MT_EMU_RUNTIME)
template <typename P> KernelArg kernel_arg(const P& x) {
  if constexpr (std::is_pointer_v<P>)
    return {static_cast<const void*>(x), true, !std::is_const_v<std::remove_pointer_t<P>>};
  else
    return {};
}

// MT_LAUNCH of the emulated build: the arguments converted to the kernel's parameter types (as a launch does),
// checked and recorded by the runtime (launch_prologue), then the kernel runs, in stream order: before this
// returns. A launch the runtime refuses does not run; its error is the thread's last error (cudaGetLastError).
template <typename... P, typename... A>
void launch_checked(const char* name, void (*kernel)(P...), dim3 grid, dim3 block_dim, size_t smem,
                    cudaStream_t stream, A&&... a) {
  static_assert(sizeof...(P) == sizeof...(A), "MT_LAUNCH: the argument count differs from the kernel's parameters");
  std::tuple<std::decay_t<P>...> conv(std::forward<A>(a)...);
  // In a stream capture: the launch with these argument values, made at each replay of the graph.
  if (record_if_capturing(stream, [=] {
        std::apply([&](const auto&... x) { launch_checked(name, kernel, grid, block_dim, smem, stream, x...); }, conv);
      }))
    return;
  KernelArg args[sizeof...(P) + 1];
  int n = 0;
  std::apply([&](const auto&... x) { ((args[n++] = kernel_arg(x)), ...); }, conv);
  if (!launch_prologue(name, reinterpret_cast<const void*>(kernel), grid, block_dim, smem, stream, args, n)) return;
  std::apply([&](const auto&... x) { launch(kernel, grid, block_dim, smem, x...); }, conv);
  launch_epilogue(name, args, n);
}
#endif

}  // namespace emu

// ---------------------------------------------------------------- the CUDA surface the kernels use

inline int min(int a, int b) { return a < b ? a : b; }
inline void __syncthreads() { emu::arrive(0); }
inline float __shfl_xor_sync(unsigned mask, float v, int offset) {
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  emu::slot(emu::lane()).f = v;
  emu::warp_sync();
  const float r = emu::slot(emu::lane() ^ unsigned(offset)).f;
  emu::warp_sync();
  return r;
}
inline int __shfl_xor_sync(unsigned mask, int v, int offset) {
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  emu::slot(emu::lane()).i = v;
  emu::warp_sync();
  const int r = emu::slot(emu::lane() ^ unsigned(offset)).i;
  emu::warp_sync();
  return r;
}

// cp.async.cg 16 bytes: queued in the open group; valid false zero-fills (src is not read).
inline void cp_async16(void* dst, const void* src, bool valid) {
  if (!emu::in_smem(dst, 16) || reinterpret_cast<uintptr_t>(dst) % 16)
    emu::fail("cp.async: destination not 16-byte aligned shared memory");
  if (valid && (reinterpret_cast<uintptr_t>(src) % 16 || !emu::may_read(src, 16)))
    emu::fail("cp.async: source misaligned or outside the input buffers");
  emu::me().open.push_back({dst, src, valid});
}
inline void cp_async_commit() {
  auto& f = emu::me();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
// Lands this thread's oldest groups until at most N are in flight (the latest moment PTX allows).
template <int N> inline void cp_async_wait() {
  auto& f = emu::me();
  while (f.groups.size() > size_t(N)) {
    for (const auto& p : f.groups.front()) {
      if (p.valid) std::memcpy(p.dst, p.src, 16);
      else std::memset(p.dst, 0, 16);
    }
    f.groups.erase(f.groups.begin());
  }
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane i gives the address of row i % 8 of matrix i / 8;
// register j of lane l gets row l / 4, columns 2 (l % 4), +1 of matrix j (of its transpose with .trans).
inline void emu_ldmatrix(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
  if (!emu::in_smem(p, 16) || reinterpret_cast<uintptr_t>(p) % 16)
    emu::fail("ldmatrix: row address not 16-byte aligned shared memory");
  emu::slot(emu::lane()).addr = p;
  emu::warp_sync();
  const unsigned l = emu::lane();
  auto rd = [](const void* a, unsigned i) {
    uint16_t u;
    std::memcpy(&u, static_cast<const unsigned char*>(a) + 2 * i, 2);
    return uint32_t(u);
  };
  for (unsigned j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    if (!trans) {
      const void* row = emu::slot(j * 8 + l / 4).addr;
      lo = rd(row, (l % 4) * 2), hi = rd(row, (l % 4) * 2 + 1);
    } else {
      lo = rd(emu::slot(j * 8 + (l % 4) * 2).addr, l / 4);
      hi = rd(emu::slot(j * 8 + (l % 4) * 2 + 1).addr, l / 4);
    }
    r[j] = lo | (hi << 16);
  }
  emu::warp_sync();
}
inline void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) { emu_ldmatrix(r, p, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) { emu_ldmatrix(r, p, true); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, PTX ISA fragment layouts (g = lane / 4, t = lane % 4):
// a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b: {(k 2t..2t+1, n g), (k 2t+8.., n g)};
// c: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. Products are exact in f32 (bf16 x bf16), summed in k order.
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& s = emu::slot(emu::lane());
  for (int i = 0; i < 4; ++i) s.a[i] = a[i];
  s.b[0] = b0, s.b[1] = b1;
  emu::warp_sync();
  auto half = [](uint32_t w, unsigned k) {
    const uint32_t u = (k % 2 ? w >> 16 : w) & 0xffffu;
    const uint32_t bits = u << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  auto A = [&](unsigned row, unsigned k) {
    return half(emu::slot((row % 8) * 4 + (k % 8) / 2).a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
  };
  auto B = [&](unsigned k, unsigned n) { return half(emu::slot(n * 4 + (k % 8) / 2).b[k >= 8 ? 1 : 0], k); };
  const unsigned g = emu::lane() / 4, t = emu::lane() % 4;
  float out[4];
  for (unsigned i = 0; i < 4; ++i) {
    const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float acc = c[i];
    for (unsigned k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  emu::warp_sync();
  for (int i = 0; i < 4; ++i) c[i] = out[i];
  if (emu::lane() == 0) ++emu::mma_count;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::fail("__syncwarp: only full-warp masks are emulated");
  emu::warp_sync();
}
inline double __shfl_xor_sync(unsigned mask, double v, int offset) {
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  int64_t bits;
  std::memcpy(&bits, &v, 8);
  emu::slot(emu::lane()).i = int(uint32_t(bits));
  emu::slot(emu::lane()).f = 0;
  std::memcpy(&emu::slot(emu::lane()).b, &bits, 8);
  emu::warp_sync();
  int64_t r;
  std::memcpy(&r, &emu::slot(emu::lane() ^ unsigned(offset)).b, 8);
  emu::warp_sync();
  double d;
  std::memcpy(&d, &r, 8);
  return d;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }

#if defined(MT_EMU_RUNTIME)
// cuda_runtime.h's typed overload is compiled only by nvcc: the kernel as the runtime's `const void*` key.
template <typename... P> inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
#else
template <typename Kernel> inline cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int bytes) {
  if (bytes > 227 * 1024) emu::fail("cudaFuncSetAttribute: more than 227 KiB of shared memory");
  return cudaSuccess;
}
inline cudaError_t emu_last_error() { return cudaSuccess; }
#define cudaGetLastError emu_last_error
inline void nvtxRangePushA(const char*) {}
inline void nvtxRangePop() {}
#endif
