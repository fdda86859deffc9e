// Attention alone, forward and forward+backward, through attention/local_attention.h
// (whichever kernel the build and dtype select: the bf16 tensor-core kernel on CUDA,
// the fp32 reference kernel, or the CPU's blockwise one). Prints one JSON line:
// TFLOP/s counting the causal half (forward 4 B H T S hd, halved when causal;
// backward 2.5x the forward), the figure FlashAttention-2 reports.
//   bench_attention [--device cuda|cpu] [--dtype bf16|f32] [--B 4] [--H 16] [--KV 16] [--T 8192] [--hd 128]
//                   [--causal 1] [--iters 10]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "attention/local_attention.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"
#include "tests/test_util.h"

using namespace mt;

namespace {

Tensor random_on(const Shape& s, DType dt, Device d, uint64_t seed) { return test::randn(s, seed, dt).to(d); }

void sync(Device d) {
  if (d.is_cuda()) current_stream(d.index).synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cuda", dtype = "bf16";
  int64_t B = 4, H = 16, KV = 16, T = 8192, hd = 128, iters = 10;
  bool causal = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--device") device = v;
    else if (k == "--dtype") dtype = v;
    else if (k == "--B") B = std::stoll(v);
    else if (k == "--H") H = std::stoll(v);
    else if (k == "--KV") KV = std::stoll(v);
    else if (k == "--T") T = std::stoll(v);
    else if (k == "--hd") hd = std::stoll(v);
    else if (k == "--causal") causal = v != "0";
    else if (k == "--iters") iters = std::stoll(v);
    else {
      std::fprintf(stderr, "bench_attention: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    Device d = device == "cuda" ? Device::cuda(0) : Device::cpu();
    DType dt = dtype == "bf16" ? DType::bf16 : DType::f32;
    if (d.is_cuda()) set_device(0);
    Tensor q = random_on({B, T, H, hd}, dt, d, 1), k = random_on({B, T, KV, hd}, dt, d, 2),
           v = random_on({B, T, KV, hd}, dt, d, 3), dout = random_on({B, T, H, hd}, dt, d, 4);
    Tensor out = empty(q.shape(), dt, d), lse = empty({B, H, T}, accum_dtype(dt), d);
    Tensor dq = empty(q.shape(), dt, d), dk = empty(k.shape(), dt, d), dv = empty(k.shape(), dt, d);
    AttentionOptions o;
    o.causal = causal;
    auto time_it = [&](bool backward) {
      auto once = [&] {
        attention_forward(out, lse, q, k, v, o);
        if (backward) attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
      };
      once();  // warm-up: allocator, GEMM plans
      sync(d);
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < iters; ++i) once();
      sync(d);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(iters);
    };
    double fwd_s = time_it(false), all_s = time_it(true);
    double fwd_flops = 4.0 * double(B * H) * double(T) * double(T) * double(hd) * (causal ? 0.5 : 1.0);
    std::printf(
        "{\"kernel\":\"meshtrain\",\"device\":\"%s\",\"dtype\":\"%s\",\"causal\":%s,\"B\":%lld,\"H\":%lld,"
        "\"KV\":%lld,\"T\":%lld,\"hd\":%lld,\"fwd_ms\":%.3f,\"fwdbwd_ms\":%.3f,\"fwd_tflops\":%.2f,"
        "\"fwdbwd_tflops\":%.2f}\n",
        device.c_str(), dtype.c_str(), causal ? "true" : "false", (long long)B, (long long)H, (long long)KV,
        (long long)T, (long long)hd, 1e3 * fwd_s, 1e3 * all_s, fwd_flops / fwd_s / 1e12,
        3.5 * fwd_flops / all_s / 1e12);
  } catch (const std::exception& e) {
    std::printf("{\"kernel\":\"meshtrain\",\"error\":\"%s\"}\n", e.what());
    return 1;
  }
  return 0;
}
