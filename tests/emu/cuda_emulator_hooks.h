// What the kernel launches of the emulated build (cuda_emulator.h under MT_EMU_RUNTIME, MT_LAUNCH) ask of the
// emulated runtime (cuda_runtime_emu.cpp): one check per launch before any thread runs.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

namespace emu {

// One kernel argument as the kernel's parameter type sees it: a pointer (`const T*` read, `T*` written) or not.
struct KernelArg {
  const void* p = nullptr;
  bool pointer = false;
  bool write = false;
};

// Checks the launch configuration (block and grid sizes, dynamic shared memory against
// cudaFuncSetAttribute), the stream, and every pointer argument (null, or inside a live device allocation),
// then records the accesses in the stream-order hazard tracker. False (reported, the thread's last error set
// for cudaGetLastError) when the kernel must not run.
bool launch_prologue(const char* kernel, const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     const KernelArg* args, int n);
// After the kernel ran: every written (T*) argument's buffer must be intact past its end (the canary bytes
// between its extent and its block's end, and a zone past the block). False (reported, last error set) if not.
bool launch_epilogue(const char* kernel, const KernelArg* args, int n);

}  // namespace emu
