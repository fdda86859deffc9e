// Included first by each kernel file, which is compiled once per instruction-set
// level (runtime/kernels/meson.build) with MT_CPU_ISA naming the level's
// namespace (isa_base, isa_avx2, isa_avx512) and that level's -march. Every
// function a kernel file defines lives in mt::cpu::MT_CPU_ISA, so the levels'
// copies never share a symbol; Eigen, whose templates would otherwise be
// instantiated under the same names at every level (and the linker would keep
// one of them: AVX-512 code on an AVX2 machine, or SSE code on an AVX-512 one),
// is renamed per level too (see matmul.cpp). Code in these files must not leave
// out-of-line instances of other shared templates (std containers,
// algorithms): tests/cli/test_cpu_isa.sh checks the linked binary for wide
// instructions outside the per-level names. The baseline pass (MT_CPU_ISA =
// isa_base, MT_CPU_OPS = 1) also compiles the family's ops (checks and
// dispatch, runtime/kernels/op.h); they are baseline code like ops.cpp.
#pragma once

#ifndef MT_CPU_ISA
#error "runtime/kernels/cpu kernel files are compiled once per instruction-set level (runtime/kernels/meson.build)"
#endif

#define MT_CPU_CAT2(a, b) a##b
#define MT_CPU_CAT(a, b) MT_CPU_CAT2(a, b)

// ---- One kernel, every level: MT_CPU_EXPORT and MT_CPU_KERNEL ----
// A family file (runtime/kernels/cpu/<family>.cpp) defines its kernels as templates on the element type in
// mt::cpu::MT_CPU_ISA and names each once with MT_CPU_EXPORT(kernel) after them, at global scope. In the
// x86-64-v3 and -v4 passes that defines mt::cpu::<kernel>_at_isa_avx2<T> / _at_isa_avx512<T> (T = float and
// double), pointers to that level's instance; in the baseline pass (MT_CPU_OPS, the only one that also
// compiles the ops: checks, dispatch) it declares them, their type taken from the baseline's own template,
// so no signature is written twice. The ops call MT_CPU_KERNEL(kernel, T)(args...): the instance of the
// level this process runs at (isa.h), one switch per call. The references also pull the wider levels'
// objects into the link.
#if MT_CPU_OPS
#include "runtime/kernels/cpu/isa.h"
namespace mt::cpu {
// The pointer for the running level (the wider ones exist only with MT_CPU_DISPATCH).
template <typename F> F by_level(F base, [[maybe_unused]] F avx2, [[maybe_unused]] F avx512) {
#if MT_CPU_DISPATCH
  switch (cpu_isa()) {
    case CpuIsa::avx512:
      return avx512;
    case CpuIsa::avx2:
      return avx2;
    case CpuIsa::base:
      break;
  }
#endif
  return base;
}
}  // namespace mt::cpu
#if MT_CPU_DISPATCH
#define MT_CPU_EXPORT(name)                                                       \
  namespace mt::cpu {                                                             \
  template <typename T> extern decltype(&isa_base::name<T>) name##_at_isa_avx2;   \
  template <typename T> extern decltype(&isa_base::name<T>) name##_at_isa_avx512; \
  }
#define MT_CPU_KERNEL(name, T)                                                         \
  ::mt::cpu::by_level(&::mt::cpu::isa_base::name<T>, ::mt::cpu::name##_at_isa_avx2<T>, \
                      ::mt::cpu::name##_at_isa_avx512<T>)
#else
#define MT_CPU_EXPORT(name)
#define MT_CPU_KERNEL(name, T) (&::mt::cpu::isa_base::name<T>)
#endif
#else  // a wider level's pass: define its pointers
#define MT_CPU_EXPORT(name)                                                                                       \
  namespace mt::cpu {                                                                                             \
  template <typename T> decltype(&MT_CPU_ISA::name<T>) MT_CPU_CAT(name##_at_, MT_CPU_ISA) = &MT_CPU_ISA::name<T>; \
  template decltype(&MT_CPU_ISA::name<float>) MT_CPU_CAT(name##_at_, MT_CPU_ISA)<float>;                          \
  template decltype(&MT_CPU_ISA::name<double>) MT_CPU_CAT(name##_at_, MT_CPU_ISA)<double>;                        \
  }
#endif
