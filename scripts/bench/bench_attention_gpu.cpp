// The bf16 tensor-core attention kernel alone (runtime/kernels/cuda/flash_attention.h, called directly),
// forward and forward+backward timed with CUDA events on one GPU. Prints one JSON line per (T, hd):
// TFLOP/s counting the causal half (forward 4 B H T S hd, halved when causal; backward 2.5x the forward),
// the figure FlashAttention-2 reports, in the format of attention_torch.py ("kernel":"torch_sdpa").
//   bench_attention_gpu [--B 4] [--H 16] [--KV 16] [--T 8192] [--hd 128] [--causal 1] [--iters 10] [--warmup 3]
//                       [--kernel flash|cudnn]
// --T and --hd take comma-separated lists (--T 2048,8192 --hd 64,128): one line per pair. S = T. --kernel cudnn:
// meshtrain's attention through cuDNN (runtime/kernels/cuda/cudnn_attention.h, "kernel":"meshtrain_cudnn").
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/stream.h"
#include "runtime/core/tensor.h"
#include "runtime/kernels/cuda/cudnn_attention.h"
#include "runtime/kernels/cuda/flash_attention.h"

using namespace mt;

namespace {

std::vector<int64_t> int_list(const std::string& s) {
  std::vector<int64_t> r;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) r.push_back(std::stoll(item));
  return r;
}

// Uniform values in [-2, 2) as bf16 on the device, from a cheap generator (normal sampling of ~10^8
// values would take longer than the benchmark).
Tensor random_bf16(const Shape& s, uint64_t seed, Device d) {
  std::vector<bf16> v(size_t(shape_numel(s)));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& e : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    e = bf16(float(double(x >> 11) * (4.0 / 9007199254740992.0) - 2.0));
  }
  Tensor t = from_blob(v.data(), s, DType::bf16).to(d);
  current_stream(d.index).synchronize();  // the copy has read v before v goes
  return t;
}

void check(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + " returned " + std::to_string(rc));
}

}  // namespace

int main(int argc, char** argv) {
  int64_t B = 4, H = 16, KV = 16, iters = 10, warmup = 3;
  std::vector<int64_t> Ts{8192}, hds{128};
  bool causal = true;
  std::string kernel = "flash";  // --kernel cudnn: attention through cuDNN (attention.kernel: cudnn)
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--B") B = std::stoll(v);
    else if (k == "--H") H = std::stoll(v);
    else if (k == "--KV") KV = std::stoll(v);
    else if (k == "--T") Ts = int_list(v);
    else if (k == "--hd") hds = int_list(v);
    else if (k == "--causal") causal = v != "0";
    else if (k == "--iters") iters = std::stoll(v);
    else if (k == "--warmup") warmup = std::stoll(v);
    else if (k == "--kernel" && (v == "flash" || v == "cudnn")) kernel = v;
    else {
      std::fprintf(stderr, "bench_attention_gpu: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    if (cuda_device_count() == 0) throw std::runtime_error("no CUDA device visible");
    set_device(0);
    const bool use_cudnn = kernel == "cudnn";
    if (use_cudnn) {
      bool loaded = false;
      const std::string what = cuda::cudnn_load(&loaded);
      if (!loaded) throw std::runtime_error("cuDNN does not load: " + what);
      std::fprintf(stderr, "bench_attention_gpu: %s\n", what.c_str());
    }
    const Device d = Device::cuda(0);
    const Stream& st = current_stream(0);
    for (int64_t hd : hds)
      for (int64_t T : Ts) {
        const int64_t S = T;
        const double scale = 1.0 / std::sqrt(double(hd));
        Tensor q = random_bf16({B, T, H, hd}, 1, d), k = random_bf16({B, S, KV, hd}, 2, d),
               v = random_bf16({B, S, KV, hd}, 3, d), dout = random_bf16({B, T, H, hd}, 4, d);
        Tensor out = empty(q.shape(), DType::bf16, d), lse = empty({B, H, T}, DType::f32, d);
        Tensor dq = empty(q.shape(), DType::bf16, d), dk = empty(k.shape(), DType::bf16, d),
               dv = empty(k.shape(), DType::bf16, d);
        const size_t scratch_bytes = cuda::flash_attention_backward_scratch_bytes(B, T, S, H, KV, hd);
        Tensor scratch = empty({int64_t(scratch_bytes / sizeof(float)) + 1}, DType::f32, d);
        auto forward = [&] {
          if (use_cudnn)
            return check(cuda::cudnn_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(),
                                                       v.data_ptr(), B, T, S, H, KV, hd, scale, causal, 0, 0, nullptr,
                                                       st.handle()),
                         "cudnn_attention_forward");
          check(
              cuda::flash_attention_forward(out.data_ptr(), lse.data<float>(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                            B, T, S, H, KV, hd, scale, causal, 0, 0, nullptr, st.handle()),
              "flash_attention_forward");
        };
        auto backward = [&] {
          if (use_cudnn)
            return check(cuda::cudnn_attention_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dout.data_ptr(),
                                                        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                        lse.data<float>(), B, T, S, H, KV, hd, scale, causal, 0, 0,
                                                        nullptr, false, false, st.handle()),
                         "cudnn_attention_backward");
          check(cuda::flash_attention_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), scratch.data_ptr(),
                                               dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                               out.data_ptr(), lse.data<float>(), B, T, S, H, KV, hd, scale, causal, 0,
                                               0, nullptr, false, st.handle()),
                "flash_attention_backward");
        };
        // Mean milliseconds per iteration between two events on the stream, after warm-up runs.
        auto time_ms = [&](bool with_backward) {
          for (int64_t i = 0; i < warmup; ++i) {
            forward();
            if (with_backward) backward();
          }
          Event start = Event::create(true), end = Event::create(true);
          start.record(st);
          for (int64_t i = 0; i < iters; ++i) {
            forward();
            if (with_backward) backward();
          }
          end.record(st);
          end.synchronize();
          return double(start.elapsed_ms(end)) / double(iters);
        };
        const double fwd_ms = time_ms(false), all_ms = time_ms(true);
        const double fwd_flops = 4.0 * double(B * H) * double(T) * double(S) * double(hd) * (causal ? 0.5 : 1.0);
        std::printf(
            "{\"kernel\":\"%s\",\"timer\":\"cuda_events\",\"device\":\"cuda\",\"dtype\":\"bf16\","
            "\"causal\":%s,\"B\":%lld,\"H\":%lld,\"KV\":%lld,\"T\":%lld,\"hd\":%lld,\"fwd_ms\":%.3f,"
            "\"fwdbwd_ms\":%.3f,\"fwd_tflops\":%.2f,\"fwdbwd_tflops\":%.2f}\n",
            use_cudnn ? "meshtrain_cudnn" : "meshtrain", causal ? "true" : "false", (long long)B, (long long)H,
            (long long)KV, (long long)T, (long long)hd, fwd_ms,
            all_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, 3.5 * fwd_flops / (all_ms * 1e-3) / 1e12);
        std::fflush(stdout);
      }
  } catch (const std::exception& e) {
    std::printf("{\"kernel\":\"meshtrain\",\"error\":\"%s\"}\n", e.what());
    return 1;
  }
  return 0;
}
