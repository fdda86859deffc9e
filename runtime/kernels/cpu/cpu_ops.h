// The CPU backend of runtime/kernels/ops.h: raw-pointer kernels templated on
// float and double, threaded with OpenMP; matmuls on Eigen. Private to
// runtime/kernels (ops.cpp checks shapes and dispatches here).
//
// The kernel files are compiled once per x86 instruction-set level
// (x86-64-v2, -v3, -v4; see isa.h) into mt::cpu::isa_<level>; the functions
// declared here, in mt::cpu, call the level this process runs at
// (dispatch.cpp).
#pragma once
#include <cstdint>

#include "runtime/kernels/cpu/attention_dims.h"

namespace mt::cpu {

#include "runtime/kernels/cpu/cpu_ops_decl.h"

// Rows [0, n) split into the same chunks whatever the thread count, so that
// reductions over chunks (summed in order) give the same bits on any machine.
constexpr int64_t kReduceChunk = 4096;

}  // namespace mt::cpu
