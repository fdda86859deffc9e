// The emulated CUDA device's registry (build option -Demulate_cuda=true; implemented in cuda_runtime_emu.cpp):
// live device allocations, streams and the cross-stream hazard tracker. The emulated libraries
// (cublaslt_emu.cpp: cublasLt*, nccl_emu.cpp: nccl* over MPI, the CUB stand-in in include/cub) check their
// pointer arguments and record their accesses through this header only. Stable interface: add, never change.
//
// Model (see cuda_runtime_emu.cpp for the whole of it). Device memory is host memory that cudaMalloc put in
// the registry (one entry per allocation, with its size and device). Every operation enqueued on a stream runs
// at once, on the calling host thread, so its results are there when the call returns; what is modelled is the
// ORDER the real device would guarantee: each stream has a vector clock, every access to an allocation is
// recorded with the stream and the clock, and an access on stream S to an allocation last written (or, for a
// write, read) on another stream S' is an error unless S has waited for that access (cudaStreamWaitEvent on an
// event recorded after it, or the host waited for it before enqueueing on S: stream/event/device synchronize).
//
// Errors are reported on stderr as "[cuda-emu] CALL: WHAT" (the text also becomes what cudaGetErrorString
// appends for the code the call returns); the functions below return false after reporting, and the caller
// returns its own library's error code (CUBLAS_STATUS_INVALID_VALUE, ncclInvalidArgument, ...). With
// MT_EMU_ABORT=1 in the environment every report aborts (a core dump at the faulting call).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>

namespace emu {

// printf into a std::string (the stand-ins' messages; 1 KiB at most).
std::string strf(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string strf(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// [p, p + bytes) lies inside one live device allocation (bytes 0: p is inside or one past the end of one).
bool is_device_ptr(const void* p, size_t bytes);
// The live allocation holding p: its start and size; false (outputs untouched) if p is in none.
bool find_allocation(const void* p, const void** base, size_t* bytes);
// is_device_ptr, or report "CALL: WHAT <p> (+bytes) is not device memory / runs past its allocation (...)"
// and return false. A null p with bytes 0 passes.
bool check_device_range(const void* p, size_t bytes, const char* call, const char* what);

// Records that the operation CALL, enqueued on `stream` (nullptr: the legacy default stream;
// cudaStreamPerThread and cudaStreamLegacy are understood), reads or writes [p, p + bytes) (the whole
// allocation holding p is the unit of tracking). Reports and returns false on a missing cross-stream
// ordering ("missing cudaStreamWaitEvent": names both streams and the allocation) or if the range is not
// device memory. Call both for a buffer that is read and written (in place). Each call is one step of the
// stream: call them for an operation's buffers, then do the operation's work, all before returning.
bool note_read(const void* p, size_t bytes, cudaStream_t stream, const char* call);
bool note_write(const void* p, size_t bytes, cudaStream_t stream, const char* call);

// Whether `stream` is a live stream (or one of the special handles); reports and returns false otherwise.
bool check_stream(cudaStream_t stream, const char* call);
// The device a stream belongs to (the current device for the default stream handles).
int stream_device(cudaStream_t stream);
// The calling thread's current device (cudaSetDevice) and the number of emulated devices (MT_EMU_DEVICES,
// default 1).
int current_device();
int device_count();

// For the emulated build's caching allocator (runtime/core/cuda_runtime.cpp, which calls it as its block hook,
// cuda_backend.h's set_cuda_block_hook, registered by cuda_runtime_emu.cpp): the block cudaMalloc returned at
// `block` now holds a tensor of `bytes` (<= the block's size). [block, block + bytes) becomes the allocation's
// extent, what every check above sees, filled with 0xff bytes (NaN) as fresh memory; the rest of the block and a
// zone past it are canary bytes that each kernel's written arguments are checked against after it runs (a write
// past the tensor is an error naming the kernel and the argument). bytes 0: the block is back in the allocator's
// free list, and any use of it is an error (use after free).
void set_extent(void* block, size_t bytes);

// Stream capture (cudaStreamBeginCapture): while `stream` is being captured, records `op` (the caller's same call,
// made again at each cudaGraphLaunch, with the values its arguments have now) and returns true; false: the stream
// is not capturing, run the call now. Every enqueuing entry point of a stand-in asks this first.
bool record_if_capturing(cudaStream_t stream, std::function<void()> op);

// Reports "CALL: WHAT" on stderr (and remembers it for cudaGetErrorString); aborts under MT_EMU_ABORT=1.
void report(const char* call, const std::string& what);

// How many errors were reported in this process (tests assert 0 at the end, or > 0 for a provoked error).
long long reports();

}  // namespace emu
