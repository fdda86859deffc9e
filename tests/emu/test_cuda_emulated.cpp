// The emulated CUDA device's runtime (tests/emu/cuda_runtime_emu.cpp), its kernel launches (cuda_emulator.h under
// MT_EMU_RUNTIME) and its CUB stand-in (include/cub): what they run, and that each misuse a real device would
// punish (silently or not) is an error naming the call: host pointers given as device pointers and the
// reverse, copies past an allocation, launches the device refuses, and every kind of missing cross-stream
// ordering the hazard tracker models (read after write, write after read, write after write; the legacy
// default stream's implicit ordering). Built only with -Demulate_cuda=true.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#define MT_EMU_RUNTIME 1
#include "tests/emu/cuda_emulator.h"

#include <cub/device/device_radix_sort.cuh>

#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "runtime/core/cuda_backend.h"
#include "tests/emu/device_registry.h"

namespace {

__global__ void fill_k(float* out, float v, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = v;
}
__global__ void copy_k(float* out, const float* in, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i];
}
// A block-wide sum through static shared memory and a barrier, in a 2-D block of 48 threads (a partial warp).
__global__ void block_sum_k(float* out, const float* in) {
  __shared__ float part[64];
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  part[t] = in[blockIdx.x * 48 + t];
  __syncthreads();
  if (t == 0) {
    float s = 0;
    for (unsigned i = 0; i < 48; ++i) s += part[i];
    out[blockIdx.x] = s;
  }
}

std::string last_error_text() {
  const cudaError_t e = cudaGetLastError();
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

struct Buf {
  float* p = nullptr;
  size_t n;
  explicit Buf(size_t count) : n(count) { REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)) == cudaSuccess); }
  ~Buf() { CHECK(cudaFree(p) == cudaSuccess); }
  size_t bytes() const { return n * sizeof(float); }
};

struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  explicit Streams(unsigned flags = cudaStreamNonBlocking) {
    REQUIRE(cudaStreamCreateWithFlags(&a, flags) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&b, flags) == cudaSuccess);
  }
  ~Streams() {
    CHECK(cudaStreamDestroy(a) == cudaSuccess);
    CHECK(cudaStreamDestroy(b) == cudaSuccess);
  }
};

}  // namespace

TEST_CASE("device memory: the registry, copies in both directions, direction and range checks") {
  int n = 0;
  REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
  CHECK(n >= 1);
  Buf d(100);
  CHECK(emu::is_device_ptr(d.p, d.bytes()));
  CHECK_FALSE(emu::is_device_ptr(d.p, d.bytes() + 1));
  CHECK(emu::is_device_ptr(d.p + 50, 50 * sizeof(float)));
  std::vector<float> h(100), back(100, 0.f);
  for (int i = 0; i < 100; ++i) h[size_t(i)] = float(i);
  CHECK_FALSE(emu::is_device_ptr(h.data(), 4));
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  CHECK(cudaMemcpyAsync(d.p, h.data(), d.bytes(), cudaMemcpyHostToDevice, s) == cudaSuccess);
  CHECK(cudaMemcpyAsync(back.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(back == h);

  const long long before = emu::reports();
  // DeviceToHost from host memory; HostToDevice into host memory; device memory given as the host side.
  CHECK(cudaMemcpyAsync(back.data(), h.data(), 16, cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue);
  CHECK(last_error_text().find("cudaMemcpyAsync: DeviceToHost copy of 16 bytes: source") != std::string::npos);
  CHECK(cudaMemcpyAsync(back.data(), h.data(), 16, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue);
  CHECK(cudaMemcpyAsync(d.p, d.p + 10, 16, cudaMemcpyHostToDevice, s) == cudaErrorInvalidMemcpyDirection);
  // Past the allocation (by one element), and from inside it.
  CHECK(cudaMemcpyAsync(back.data(), d.p + 1, d.bytes(), cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue);
  CHECK(last_error_text().find("runs past its allocation") != std::string::npos);
  CHECK(cudaMemcpyAsync(d.p + 99, h.data(), 8, cudaMemcpyHostToDevice, s) == cudaErrorInvalidValue);
  CHECK(cudaMemsetAsync(d.p + 1, 0, d.bytes(), s) == cudaErrorInvalidValue);
  // A 2-D copy whose last row runs past the source.
  CHECK(cudaMemcpy2DAsync(back.data(), 40, d.p, 200, 40, 3, cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy2DAsync(back.data(), 40, d.p, 160, 40, 3, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  CHECK(back[10] == 40.f);
  // Frees: not from cudaMalloc, a pointer inside an allocation, pinned memory the wrong way round.
  CHECK(cudaFree(h.data()) == cudaErrorInvalidValue);
  CHECK(cudaFree(d.p + 1) == cudaErrorInvalidValue);
  void* pinned = nullptr;
  REQUIRE(cudaMallocHost(&pinned, 64) == cudaSuccess);
  CHECK_FALSE(emu::is_device_ptr(pinned, 1));
  CHECK(cudaFree(pinned) == cudaErrorInvalidValue);
  CHECK(cudaFreeHost(pinned) == cudaSuccess);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // read once, then cleared
  CHECK(emu::reports() - before == 10);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaErrorInvalidResourceHandle);  // destroyed
  (void)cudaGetLastError();
}

TEST_CASE("cudaMalloc fills new memory with NaN bytes; cudaMemGetInfo counts live allocations") {
  size_t free0 = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free0, &total) == cudaSuccess);
  Buf d(16);
  std::vector<float> h(16);
  REQUIRE(cudaMemcpy(h.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::isnan(h[0]));
  size_t free1 = 0;
  REQUIRE(cudaMemGetInfo(&free1, &total) == cudaSuccess);
  CHECK(free0 - free1 == d.bytes());
  char id[32];
  REQUIRE(cudaDeviceGetPCIBusId(id, 32, 0) == cudaSuccess);
  CHECK(std::string(id).substr(4) == ":e0:00.0");
}

TEST_CASE("kernel launches: they run in stream order; pointer arguments are checked; refused configurations") {
  Streams st;
  Buf d(1000), e(1000);
  MT_LAUNCH(fill_k, 4, 256, 0, st.a, d.p, 2.5f, 1000);
  MT_LAUNCH(copy_k, 4, 256, 0, st.a, e.p, d.p, 1000);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::vector<float> h(1000);
  REQUIRE(cudaMemcpyAsync(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost, st.a) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);
  CHECK(h[0] == 2.5f);
  CHECK(h[999] == 2.5f);

  // A host pointer as a kernel argument: refused before anything runs, naming the kernel and the argument.
  std::vector<float> host(1000, -1.f);
  MT_LAUNCH(copy_k, 4, 256, 0, st.a, e.p, host.data(), 1000);
  std::string err = last_error_text();
  CHECK(err.find("cudaErrorIllegalAddress") == 0);
  CHECK(err.find("launch of copy_k: argument 1 (const T*)") != std::string::npos);
  CHECK(err.find("not device memory") != std::string::npos);
  // One past the end of an allocation is not inside it.
  MT_LAUNCH(fill_k, 1, 32, 0, st.a, d.p + 1000, 0.f, 0);
  CHECK(last_error_text().find("argument 0 (T*)") != std::string::npos);
  // Null pointers pass (optional arguments); empty grids, oversized blocks and unasked shared memory do not.
  MT_LAUNCH(fill_k, 1, 32, 0, st.a, static_cast<float*>(nullptr), 0.f, 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  MT_LAUNCH(fill_k, 0, 256, 0, st.a, d.p, 0.f, 0);
  CHECK(last_error_text().find("cudaErrorInvalidConfiguration") == 0);
  MT_LAUNCH(fill_k, 1, 2048, 0, st.a, d.p, 0.f, 0);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  MT_LAUNCH(fill_k, 1, 32, 64 * 1024, st.a, d.p, 0.f, 0);
  CHECK(last_error_text().find("cudaFuncAttributeMaxDynamicSharedMemorySize") != std::string::npos);
  REQUIRE(cudaFuncSetAttribute(fill_k, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024) == cudaSuccess);
  MT_LAUNCH(fill_k, 1, 32, 64 * 1024, st.a, d.p, 0.f, 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaFuncSetAttribute(fill_k, cudaFuncAttributeMaxDynamicSharedMemorySize, 300 * 1024) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

TEST_CASE("kernel launches: a write past the end of a buffer; tensors in cached blocks; use after free") {
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  Buf d(100);
  MT_LAUNCH(fill_k, 1, 128, 0, s, d.p, 1.f, 100);
  CHECK(cudaGetLastError() == cudaSuccess);
  MT_LAUNCH(fill_k, 1, 128, 0, s, d.p, 1.f, 101);  // one element too many
  std::string err = last_error_text();
  CHECK(err.find("launch of fill_k: argument 0 (T*): the kernel wrote past the end of its buffer: byte 0 after the "
                 "400 bytes") != std::string::npos);
  MT_LAUNCH(fill_k, 1, 128, 0, s, d.p, 1.f, 100);  // reported once
  CHECK(cudaGetLastError() == cudaSuccess);
  // The caching allocator's view: a 1000-byte block holding a 100-float tensor.
  void* block = nullptr;
  REQUIRE(cudaMalloc(&block, 1000) == cudaSuccess);
  emu::set_extent(block, 400);
  std::vector<float> h(250);
  CHECK(cudaMemcpyAsync(h.data(), block, 404, cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue);
  CHECK(last_error_text().find("runs past its tensor") != std::string::npos);
  MT_LAUNCH(fill_k, 1, 128, 0, s, static_cast<float*>(block), 1.f, 101);
  CHECK(last_error_text().find("wrote past the end of its buffer: byte 0 after the 400 bytes") != std::string::npos);
  emu::set_extent(block, 0);  // back in the allocator's free list
  MT_LAUNCH(fill_k, 1, 128, 0, s, static_cast<float*>(block), 1.f, 1);
  CHECK(last_error_text().find("use after free") != std::string::npos);
  CHECK(cudaMemcpyAsync(h.data(), block, 4, cudaMemcpyDeviceToHost, s) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
  emu::set_extent(block, 1000);
  CHECK(cudaMemcpyAsync(h.data(), block, 1000, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  CHECK(std::isnan(h[0]));  // a fresh extent is NaN
  CHECK(cudaFree(block) == cudaSuccess);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("the caching allocator tells the device each block's tensor (set_cuda_block_hook), then that it is freed") {
  void* p = mt::detail::cuda_caching_alloc(0, 400);  // a 512-byte block
  const void* base = nullptr;
  size_t bytes = 0;
  REQUIRE(emu::find_allocation(p, &base, &bytes));
  CHECK(base == p);
  CHECK(bytes == 400);
  mt::detail::cuda_caching_free(0, p, 400);
  REQUIRE(emu::find_allocation(p, &base, &bytes));
  CHECK(bytes == 0);  // cached: a use is a use after free
  mt::detail::cuda_empty_cache(0);
  CHECK_FALSE(emu::find_allocation(p, nullptr, nullptr));
}

TEST_CASE("kernel launches: 2-D blocks with a partial warp and static shared memory") {
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  Buf in(48 * 5), out(5);
  std::vector<float> h(48 * 5);
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(i % 48);
  REQUIRE(cudaMemcpyAsync(in.p, h.data(), in.bytes(), cudaMemcpyHostToDevice, s) == cudaSuccess);
  MT_LAUNCH(block_sum_k, 5, dim3(16, 3), 0, s, out.p, in.p);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::vector<float> r(5);
  REQUIRE(cudaMemcpyAsync(r.data(), out.p, out.bytes(), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  for (float v : r) CHECK(v == 47.f * 48.f / 2.f);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("hazards: a cross-stream access needs an event wait or a synchronisation in between") {
  std::vector<float> h(256);
  SUBCASE("read after write: refused without the wait, accepted with it") {
    Streams st;
    Buf d(256);
    REQUIRE(cudaMemsetAsync(d.p, 0, d.bytes(), st.a) == cudaSuccess);
    CHECK(cudaMemcpyAsync(h.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost, st.b) == cudaErrorIllegalState);
    const std::string err = last_error_text();
    CHECK(err.find("read-after-write hazard") != std::string::npos);
    CHECK(err.find("missing cudaStreamWaitEvent") != std::string::npos);
    CHECK(err.find("last written by cudaMemsetAsync") != std::string::npos);
    cudaEvent_t ev;
    REQUIRE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventRecord(ev, st.a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(st.b, ev, 0) == cudaSuccess);
    CHECK(cudaMemcpyAsync(h.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost, st.b) == cudaSuccess);
    // a overwriting what b reads needs b's read ordered before: here the host waits for b.
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, d.p, 1.f, 256);
    CHECK(last_error_text().find("write-after-read hazard") != std::string::npos);
    REQUIRE(cudaStreamSynchronize(st.b) == cudaSuccess);
    // An event recorded BEFORE the write orders nothing.
    REQUIRE(cudaEventRecord(ev, st.a) == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, d.p, 1.f, 256);
    CHECK(cudaGetLastError() == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(st.b, ev, 0) == cudaSuccess);
    MT_LAUNCH(copy_k, 1, 256, 0, st.b, d.p, d.p, 256);
    CHECK(last_error_text().find("launch of copy_k") != std::string::npos);
    CHECK(cudaEventDestroy(ev) == cudaSuccess);
  }
  SUBCASE("write after read, and two streams that only read") {
    Streams st;
    Buf d(256), e(256), f(256);
    REQUIRE(cudaMemsetAsync(d.p, 0, d.bytes(), st.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);  // the host saw it: later work on any stream is after it
    MT_LAUNCH(copy_k, 1, 256, 0, st.a, e.p, d.p, 256);
    MT_LAUNCH(copy_k, 1, 256, 0, st.b, f.p, d.p, 256);  // const float*: reads on two streams are no hazard
    CHECK(cudaGetLastError() == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, st.b, d.p, 3.f, 256);  // but b overwriting what a still reads is
    const std::string err = last_error_text();
    CHECK(err.find("write-after-read hazard") != std::string::npos);
    CHECK(err.find("last read by launch of copy_k") != std::string::npos);
  }
  SUBCASE("write after write; the device and stream synchronisations order everything before them") {
    Streams st;
    Buf d(256);
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, d.p, 1.f, 256);
    CHECK(cudaMemsetAsync(d.p, 0, d.bytes(), st.b) == cudaErrorIllegalState);
    CHECK(last_error_text().find("write-after-write hazard") != std::string::npos);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(cudaMemsetAsync(d.p, 0, d.bytes(), st.b) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st.b) == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, d.p, 1.f, 256);
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  SUBCASE("the legacy default stream orders blocking streams, not non-blocking ones") {
    Streams blocking(cudaStreamDefault), nonblocking(cudaStreamNonBlocking);
    Buf d(256), e(256), f(256);
    MT_LAUNCH(fill_k, 1, 256, 0, blocking.a, d.p, 1.f, 256);
    CHECK(cudaMemcpyAsync(h.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost, nullptr) == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, nonblocking.a, e.p, 1.f, 256);
    CHECK(cudaMemcpyAsync(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost, nullptr) == cudaErrorIllegalState);
    CHECK(last_error_text().find("the legacy default stream of cuda:0") != std::string::npos);
    // The synchronous cudaMemcpy runs on the legacy stream too.
    MT_LAUNCH(fill_k, 1, 256, 0, nonblocking.b, f.p, 1.f, 256);
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(cudaMemcpy(h.data(), f.p, f.bytes(), cudaMemcpyDeviceToHost) == cudaErrorIllegalState);
    (void)cudaGetLastError();
  }
}

TEST_CASE("events: always complete once recorded; timing only where enabled") {
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t t0, t1, quiet;
  REQUIRE(cudaEventCreateWithFlags(&t0, cudaEventDefault) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&t1, cudaEventDefault) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&quiet, cudaEventDisableTiming) == cudaSuccess);
  CHECK(cudaEventQuery(t0) == cudaSuccess);  // never recorded: complete
  REQUIRE(cudaEventRecord(t0, s) == cudaSuccess);
  REQUIRE(cudaEventRecord(t1, s) == cudaSuccess);
  REQUIRE(cudaEventRecord(quiet, s) == cudaSuccess);
  CHECK(cudaEventQuery(t1) == cudaSuccess);
  CHECK(cudaEventSynchronize(t1) == cudaSuccess);
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, t0, t1) == cudaSuccess);
  CHECK(ms >= 0);
  CHECK(cudaEventElapsedTime(&ms, t0, quiet) == cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  for (cudaEvent_t e : {t0, t1, quiet}) CHECK(cudaEventDestroy(e) == cudaSuccess);
  CHECK(cudaEventDestroy(t0) == cudaErrorInvalidResourceHandle);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
  (void)cudaGetLastError();
}

TEST_CASE("cub::DeviceRadixSort::SortPairs: the size query, then a stable sort by the key bits") {
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const std::vector<int32_t> keys = {5, -3, 5, 0, -3, 7, 5, 0, -100, 2147483647};
  const int n = int(keys.size());
  std::vector<int32_t> vals(keys.size());
  for (int i = 0; i < n; ++i) vals[size_t(i)] = i;
  int32_t *kin, *kout, *vin, *vout;
  for (int32_t** p : {&kin, &kout, &vin, &vout}) REQUIRE(cudaMalloc(reinterpret_cast<void**>(p), keys.size() * 4) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(kin, keys.data(), keys.size() * 4, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(vin, vals.data(), vals.size() * 4, cudaMemcpyHostToDevice, s) == cudaSuccess);
  size_t temp_bytes = 0;
  REQUIRE(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, kin, kout, vin, vout, n, 0, 32, s) == cudaSuccess);
  CHECK(temp_bytes > 0);
  void* temp = nullptr;
  REQUIRE(cudaMalloc(&temp, temp_bytes) == cudaSuccess);
  size_t short_bytes = temp_bytes - 1;
  CHECK(cub::DeviceRadixSort::SortPairs(temp, short_bytes, kin, kout, vin, vout, n, 0, 32, s) == cudaErrorInvalidValue);
  CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, kin, kin, vin, vout, n, 0, 32, s) == cudaErrorInvalidValue);
  REQUIRE(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, kin, kout, vin, vout, n, 0, 32, s) == cudaSuccess);
  std::vector<int32_t> k(keys.size()), v(keys.size());
  REQUIRE(cudaMemcpyAsync(k.data(), kout, k.size() * 4, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(v.data(), vout, v.size() * 4, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(k == std::vector<int32_t>{-100, -3, -3, 0, 0, 5, 5, 5, 7, 2147483647});
  CHECK(v == std::vector<int32_t>{8, 1, 4, 3, 7, 0, 2, 6, 5, 9});  // equal keys keep their input order
  // Only the low 2 bits: 5 -> 1, -3 -> 1, 0 -> 0, 7 -> 3, -100 -> 0, 2^31-1 -> 3.
  REQUIRE(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, kin, kout, vin, vout, n, 0, 2, s) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(v.data(), vout, v.size() * 4, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(v == std::vector<int32_t>{3, 7, 8, 0, 1, 2, 4, 6, 5, 9});
  // A host buffer is refused.
  CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys.data(), kout, vin, vout, n, 0, 32, s) ==
        cudaErrorInvalidValue);
  for (void* p : {static_cast<void*>(kin), static_cast<void*>(kout), static_cast<void*>(vin), static_cast<void*>(vout), temp})
    CHECK(cudaFree(p) == cudaSuccess);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
}

TEST_CASE("stream capture: recorded not run, replayed with the captured arguments; forks, joins and refusals") {
  Streams st;
  Buf d(256), e(256);
  float* pin = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pin), 256 * sizeof(float)) == cudaSuccess);
  std::vector<float> h(256);
  cudaEvent_t fork, join;
  REQUIRE(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(e.p, 0, e.bytes(), st.a) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);

  SUBCASE("a graph of a pinned upload, a fork onto a second stream and a join, replayed twice") {
    for (int i = 0; i < 256; ++i) pin[i] = 1.f;
    REQUIRE(cudaStreamBeginCapture(st.a, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    cudaStreamCaptureStatus status;
    REQUIRE(cudaStreamIsCapturing(st.a, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    REQUIRE(cudaMemcpyAsync(d.p, pin, d.bytes(), cudaMemcpyHostToDevice, st.a) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, st.a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(st.b, fork, 0) == cudaSuccess);  // b joins the capture
    MT_LAUNCH(copy_k, 1, 256, 0, st.b, e.p, d.p, 256);           // e = d, on b
    REQUIRE(cudaEventRecord(join, st.b) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(st.a, join, 0) == cudaSuccess);  // joined back
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, d.p, 7.f, 256);           // d = 7 after the copy
    cudaGraph_t g = nullptr;
    REQUIRE(cudaStreamEndCapture(st.a, &g) == cudaSuccess);
    REQUIRE(g != nullptr);
    // Nothing ran: e is still 0.
    REQUIRE(cudaMemcpy(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(h[0] == 0.f);
    cudaGraphExec_t x = nullptr;
    REQUIRE(cudaGraphInstantiate(&x, g, 0) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(g) == cudaSuccess);  // the executable graph keeps its own copy
    for (float v : {2.f, 3.f}) {  // the pinned source is read at each replay
      for (int i = 0; i < 256; ++i) pin[i] = v;
      REQUIRE(cudaGraphLaunch(x, st.a) == cudaSuccess);
      REQUIRE(cudaMemcpyAsync(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost, st.a) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);
      CHECK(h[0] == v);
      CHECK(h[255] == v);
      REQUIRE(cudaMemcpyAsync(h.data(), d.p, d.bytes(), cudaMemcpyDeviceToHost, st.a) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);
      CHECK(h[17] == 7.f);
    }
    CHECK(cudaGraphExecDestroy(x) == cudaSuccess);
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  SUBCASE("a forked stream never joined back: the end of the capture fails naming it") {
    const long long before = emu::reports();
    REQUIRE(cudaStreamBeginCapture(st.a, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, st.a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(st.b, fork, 0) == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, st.b, e.p, 1.f, 256);
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(st.a, &g) == cudaErrorStreamCaptureUnjoined);
    CHECK(g == nullptr);
    CHECK(last_error_text().find("never joined back") != std::string::npos);
    CHECK(emu::reports() == before + 1);
  }
  SUBCASE("a host synchronisation, a pageable copy or a captured event's query invalidates the capture") {
    const long long before = emu::reports();
    REQUIRE(cudaStreamBeginCapture(st.a, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    MT_LAUNCH(fill_k, 1, 256, 0, st.a, e.p, 1.f, 256);
    std::string what;
    SUBCASE("stream") {
      CHECK(cudaStreamSynchronize(st.a) == cudaErrorStreamCaptureUnsupported);
      what = "the stream synchronised";
    }
    SUBCASE("pageable") {
      CHECK(cudaMemcpyAsync(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost, st.a) == cudaErrorStreamCaptureUnsupported);
      what = "not pinned";
    }
    SUBCASE("event") {
      REQUIRE(cudaEventRecord(fork, st.a) == cudaSuccess);
      CHECK(cudaEventQuery(fork) == cudaErrorCapturedEvent);
      what = "last recorded in a stream capture";
    }
    CHECK(last_error_text().find(what) != std::string::npos);
    cudaStreamCaptureStatus status;
    REQUIRE(cudaStreamIsCapturing(st.a, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusInvalidated);
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(st.a, &g) == cudaErrorStreamCaptureInvalidated);
    CHECK(g == nullptr);
    (void)cudaGetLastError();
    CHECK(emu::reports() == before + 1);
    // Nothing of the capture ran, and the stream works eagerly again.
    REQUIRE(cudaMemcpyAsync(h.data(), e.p, e.bytes(), cudaMemcpyDeviceToHost, st.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st.a) == cudaSuccess);
    CHECK(h[3] == 0.f);
  }
  CHECK(cudaEventDestroy(fork) == cudaSuccess);
  CHECK(cudaEventDestroy(join) == cudaSuccess);
  CHECK(cudaFreeHost(pin) == cudaSuccess);
}
