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
// instructions outside the per-level names.
#pragma once

#ifndef MT_CPU_ISA
#error "runtime/kernels/cpu kernel files are compiled once per instruction-set level (runtime/kernels/meson.build)"
#endif

#define MT_CPU_CAT2(a, b) a##b
#define MT_CPU_CAT(a, b) MT_CPU_CAT2(a, b)
