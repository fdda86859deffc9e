// Where a CPU training step's time goes: the step's linear-layer GEMMs
// (forward y = x W^T, backward dx = dy W and dW += dy^T x, every linear of
// every layer and the lm_head) and its attention (forward and backward per
// layer), each timed alone through ops.h at the model's shapes, f32. Prints
// one JSON line: milliseconds and GFLOP/s of each part. bench_train_cpu.sh
// sets these beside the measured step and the GEMM peak.
//   bench_step_parts [--dim 256] [--layers 4] [--heads 8] [--kv 4] [--ffn 768] [--vocab 256]
//                    [--batch 8] [--seq 256] [--iters 5]
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attention/local_attention.h"
#include "runtime/kernels/ops.h"
#include "tests/test_util.h"

using namespace mt;

namespace {

// One linear layer's operands: x (N, C), W (OC, C), y and dy (N, OC), dx (N, C), dW (OC, C).
struct LinearShapes {
  Tensor x, w, y, dy, dx, dw;
};

template <typename F> double seconds_per_call(int64_t iters, F&& f) {
  f();  // warm-up: allocator, page faults
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(iters);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t dim = 256, layers = 4, heads = 8, kv = 4, ffn = 768, vocab = 256, batch = 8, seq = 256, iters = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::stoll(argv[i + 1]);
    if (k == "--dim") dim = v;
    else if (k == "--layers") layers = v;
    else if (k == "--heads") heads = v;
    else if (k == "--kv") kv = v;
    else if (k == "--ffn") ffn = v;
    else if (k == "--vocab") vocab = v;
    else if (k == "--batch") batch = v;
    else if (k == "--seq") seq = v;
    else if (k == "--iters") iters = v;
    else {
      std::fprintf(stderr, "bench_step_parts: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    const int64_t N = batch * seq, hd = dim / heads;
    // (C, OC) of one layer's linears (q, k, v, o, gate, up, down); the lm_head once.
    std::vector<std::pair<int64_t, int64_t>> per_layer = {
        {dim, heads * hd}, {dim, kv * hd}, {dim, kv * hd}, {heads * hd, dim}, {dim, ffn}, {dim, ffn}, {ffn, dim}};
    std::vector<LinearShapes> lin;
    double gemm_flops = 0;
    uint64_t seed = 1;
    auto add = [&](int64_t C, int64_t OC) {
      lin.push_back({test::randn({N, C}, seed++, DType::f32), test::randn({OC, C}, seed++, DType::f32),
                     empty({N, OC}, DType::f32), test::randn({N, OC}, seed++, DType::f32), empty({N, C}, DType::f32),
                     zeros({OC, C}, DType::f32)});
      gemm_flops += 6.0 * double(N) * double(C) * double(OC);  // forward 2 N C OC, backward 4 N C OC
    };
    for (int64_t l = 0; l < layers; ++l)
      for (auto [C, OC] : per_layer) add(C, OC);
    add(dim, vocab);
    const double gemm_s = seconds_per_call(iters, [&] {
      for (auto& s : lin) matmul_forward(s.y, s.x, s.w);
      for (auto& s : lin) matmul_backward(s.dx, s.dw, s.dy, s.x, s.w);
    });

    // Attention: q (B, T, H, hd), k and v (B, T, KV, hd), causal, once per layer.
    Tensor q = test::randn({batch, seq, heads, hd}, seed++, DType::f32),
           k = test::randn({batch, seq, kv, hd}, seed++, DType::f32),
           v = test::randn({batch, seq, kv, hd}, seed++, DType::f32),
           dout = test::randn({batch, seq, heads, hd}, seed++, DType::f32);
    Tensor out = empty(q.shape(), DType::f32), lse = empty({batch, heads, seq}, DType::f32);
    Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(k.shape(), DType::f32);
    AttentionOptions o;
    o.causal = true;
    const double attn_s = double(layers) * seconds_per_call(iters, [&] {
                            attention_forward(out, lse, q, k, v, o);
                            attention_backward(dq, dk, dv, dout, q, k, v, out, lse, o);
                          });
    // Attention FLOPs as the step counts them (12 L d T per token: QK^T and PV, forward and backward).
    const double attn_flops = 12.0 * double(layers) * double(dim) * double(seq) * double(N);
    std::printf(
        "{\"threads\":%d,\"gemm_ms\":%.2f,\"gemm_gflops\":%.1f,\"gemm_mflop\":%.1f,\"attention_ms\":%.2f,"
        "\"attention_gflops\":%.1f}\n",
        cpu_threads(), 1e3 * gemm_s, gemm_flops / gemm_s / 1e9, gemm_flops / 1e6, 1e3 * attn_s,
        attn_flops / attn_s / 1e9);
  } catch (const std::exception& e) {
    std::printf("{\"error\":\"%s\"}\n", e.what());
    return 1;
  }
  return 0;
}
