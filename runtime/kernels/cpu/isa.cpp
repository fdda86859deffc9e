// The instruction-set level the CPU kernels run at (isa.h): detected once from
// CPUID (GCC's __builtin_cpu_supports, which also checks that the OS saves the
// AVX / AVX-512 registers), or as MT_CPU_ISA / set_cpu_isa ask. The ops pick
// their kernel of that level through MT_CPU_KERNEL (isa_level.h). Compiled at
// the baseline only, like everything outside the kernel files.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/core/error.h"
#include "runtime/kernels/cpu/isa.h"

#ifndef MT_CPU_DISPATCH
#define MT_CPU_DISPATCH 0
#endif

namespace mt {

namespace {

CpuIsa detect_supported() {
#if MT_CPU_DISPATCH
  __builtin_cpu_init();
  // The levels as the compiler defines them (-march=x86-64-v3 / -v4 may emit any of these instructions).
#if defined(__clang__) || __GNUC__ < 12
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe") &&
                  __builtin_cpu_supports("lzcnt");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
#else
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
  const bool v4 = v3 && __builtin_cpu_supports("x86-64-v4");
#endif
  return v4 ? CpuIsa::avx512 : v3 ? CpuIsa::avx2 : CpuIsa::base;
#else
  return CpuIsa::base;
#endif
}

CpuIsa parse_isa(const char* s) {
  if (!std::strcmp(s, "base")) return CpuIsa::base;
  if (!std::strcmp(s, "avx2")) return CpuIsa::avx2;
  if (!std::strcmp(s, "avx512")) return CpuIsa::avx512;
  fail("kernels", "MT_CPU_ISA={}: expected base, avx2 or avx512", s);
}

std::atomic<int>& current_slot() {
  static std::atomic<int> slot{[] {
    CpuIsa isa = cpu_isa_supported();
    if (const char* env = std::getenv("MT_CPU_ISA"); env && *env) {
      CpuIsa want = parse_isa(env);
      MT_CHECK(int(want) <= int(isa), "kernels", "MT_CPU_ISA={} asks for {}, which this {} lacks (widest: {})", env,
               cpu_isa_name(want), MT_CPU_DISPATCH ? "machine" : "build", cpu_isa_name(isa));
      isa = want;
    }
    return int(isa);
  }()};
  return slot;
}

inline CpuIsa active() { return CpuIsa(current_slot().load(std::memory_order_relaxed)); }

}  // namespace

CpuIsa cpu_isa_supported() {
  static const CpuIsa s = detect_supported();
  return s;
}

CpuIsa cpu_isa() { return active(); }

void set_cpu_isa(CpuIsa isa) {
  MT_CHECK(int(isa) <= int(cpu_isa_supported()), "kernels", "set_cpu_isa: {} is not supported here (widest: {})",
           cpu_isa_name(isa), cpu_isa_name(cpu_isa_supported()));
  current_slot().store(int(isa), std::memory_order_relaxed);
}

const char* cpu_isa_name(CpuIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case CpuIsa::avx512:
      return "x86-64-v4 (AVX-512)";
    case CpuIsa::avx2:
      return "x86-64-v3 (AVX2, FMA)";
    case CpuIsa::base:
      break;
  }
  return MT_CPU_DISPATCH ? "x86-64-v2 (SSE4.2)" : "the build's -march";
#else
  (void)isa;
  return "baseline";
#endif
}

}  // namespace mt
