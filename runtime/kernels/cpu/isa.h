// Which instruction-set level the CPU kernels run at in this process.
//
// The files under runtime/kernels/cpu are compiled once per level
// (runtime/kernels/meson.build) and the widest level the running machine
// supports is chosen at start-up: the binary runs on any x86-64-v2 machine
// and uses AVX2 or AVX-512 where they exist. On other architectures there is
// one level, `base`. MT_CPU_ISA=base|avx2|avx512 in the environment asks for
// a lower level (benchmarks, tests); a level the machine lacks is refused.
#pragma once

namespace mt {

enum class CpuIsa {
  base,    // the build's baseline (-Dcpu_arch, x86-64-v2 by default: SSE4.2)
  avx2,    // x86-64-v3: AVX2, FMA, BMI2 (Haswell and Zen 1 on)
  avx512,  // x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 on)
};

// The level the kernels run at now (detected once, then as set).
CpuIsa cpu_isa();
// The widest level both this build and this machine support.
CpuIsa cpu_isa_supported();
// Runs the kernels at `isa` from now on; throws ([kernels]) when it is wider than cpu_isa_supported().
void set_cpu_isa(CpuIsa isa);
// "x86-64-v4 (AVX-512)" and the like.
const char* cpu_isa_name(CpuIsa isa);

}  // namespace mt
