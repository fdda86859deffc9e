// MT_LAUNCH(kernel, grid, block, smem, stream, args...): every kernel launch of runtime/kernels/cuda. Under nvcc it
// is the <<<>>> launch; the emulated build (-Demulate_cuda=true, tests/emu/cuda_emulator.h, included first)
// defines it to run the kernel in stream order on the CPU, checking each pointer argument against the device
// allocations and recording it for the stream-order hazard tracker (const T* read, T* written).
#pragma once
#ifndef MT_CUDA_EMULATOR
#define MT_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif
