// Context-parallel methods side by side, through the attention boundary
// (attention/attention.h) the model calls: ring, all_gather, alltoall (Ulysses)
// and 2-D (Ulysses x ring) over the N ranks of the world.
//   mpirun -np N bench_cp_methods [--T 8192] [--bytes-T 1024] [--H 8] [--hd 64] [--B 1] [--iters 3] [--kv 8,2,1]
//                                 [--time 1]
//   bench_cp_methods --local 1 [--T 8192] ...   (one rank: local attention over the whole sequence)
// 1. Bytes per layer per rank: one forward and backward of one attention layer, the bytes the runtime counts
//    (comm_counters, all cp tags) beside the analytic count each method declares next to its code
//    (cp_layer_bytes, ulysses_layer_bytes), for every kv head count of --kv (grouped-query 1, 4, 8 with H 8),
//    bf16, at --bytes-T tokens.
// 2. Time per layer (--time 1, kv = the first of --kv): forward + backward wall time, the slowest rank, median of
//    --iters after one warm-up, f32; with --local 1 on one rank the whole sequence's local attention, the figure
//    the cp times are set beside.
// One JSON line per figure on rank 0.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "comm/comm_counters.h"
#include "comm/env.h"
#include "comm/mesh.h"
#include "runtime/kernels/ops.h"
#include "tests/test_util.h"

using namespace mt;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Sizes {
  int64_t B = 1, T = 8192, H = 8, hd = 64, iters = 3;
  int64_t bytes_T = 1024;  // the bytes scale with T exactly; a short sequence keeps part 1 quick
  std::vector<int64_t> kv{8, 2, 1};
};

// One way of splitting the sequence over the world: ring ranks outside, Ulysses ranks inside.
struct Method {
  std::string name;  // ring | all_gather | alltoall | 2d_u<U>_r<R>
  int ring = 1, ulysses = 1;
  CpMethod ring_method = CpMethod::ring;
};

std::vector<Method> methods(int n) {
  std::vector<Method> m{{"ring", n, 1, CpMethod::ring}, {"all_gather", n, 1, CpMethod::all_gather},
                        {"alltoall", 1, n, CpMethod::ring}};
  for (int u = 2; u < n; u *= 2)
    if (n % u == 0 && n / u > 1) m.push_back({fmt::format("2d_u{}_r{}", u, n / u), n / u, u, CpMethod::ring});
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The analytic bytes of one layer on one rank (forward, backward): Ulysses' exchanges, then the ring's K/V of
// the ring part (B, T/R, KV_u, hd) (cp_layer_bytes: K/V in the activation dtype, dK/dV in the accum dtype).
std::pair<double, double> analytic(const Method& m, const Sizes& z, int64_t T, int64_t KV, DType dt) {
  const int64_t Tl = T / (m.ring * m.ulysses);
  const double elem = double(dtype_size(dt));
  CpLayerBytes u = ulysses_layer_bytes(m.ulysses, z.B, Tl, z.H, KV, z.hd, elem);
  double f = u.forward, b = u.backward;
  if (m.ring > 1) {
    const double kv_elems = 2.0 * double(z.B * Tl * m.ulysses * std::max<int64_t>(1, KV / m.ulysses) * z.hd);
    CpLayerBytes r = cp_layer_bytes(m.ring_method, m.ring, kv_elems * elem,
                                    kv_elems * double(dtype_size(accum_dtype(dt))));
    f += r.forward, b += r.backward;
  }
  return {f, b};
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnv env(&argc, &argv);
  Sizes z;
  bool time = true, local = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i], val = argv[i + 1];
    if (key == "--B") z.B = std::stoll(val);
    else if (key == "--T") z.T = std::stoll(val);
    else if (key == "--bytes-T") z.bytes_T = std::stoll(val);
    else if (key == "--H") z.H = std::stoll(val);
    else if (key == "--hd") z.hd = std::stoll(val);
    else if (key == "--iters") z.iters = std::stoll(val);
    else if (key == "--time") time = val != "0";
    else if (key == "--local") local = val != "0";
    else if (key == "--kv") {
      z.kv.clear();
      std::stringstream ss(val);
      std::string part;
      while (std::getline(ss, part, ',')) z.kv.push_back(std::stoll(part));
    } else {
      if (env.rank() == 0) std::fprintf(stderr, "bench_cp_methods: unknown option %s\n", key.c_str());
      return 2;
    }
  }
  set_cpu_threads(1);
  const int n = env.size();
  try {
    if (local) {
      MT_CHECK(n == 1, "bench", "--local 1 runs on one rank");
      const int64_t KV = z.kv.front();
      Tensor q = test::randn({z.B, z.T, z.H, z.hd}, 1, DType::f32), k = test::randn({z.B, z.T, KV, z.hd}, 2, DType::f32);
      Tensor v = test::randn({z.B, z.T, KV, z.hd}, 3, DType::f32), dout = test::randn(q.shape(), 4, DType::f32);
      auto attn = make_attention();
      std::vector<double> ts;
      for (int64_t it = 0; it <= z.iters; ++it) {
        AttentionSaved s;
        Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
        auto t0 = Clock::now();
        attn->forward(s, q, k, v, AttentionCall{});
        attn->backward(dq, dk, dv, dout, s, AttentionCall{});
        if (it > 0) ts.push_back(seconds_since(t0));
      }
      std::printf(
          "{\"bench\": \"cp_layer_time\", \"method\": \"local\", \"cp\": 1, \"T\": %lld, \"H\": %lld, \"KV\": %lld, "
          "\"hd\": %lld, \"seconds\": %.4f}\n",
          (long long)z.T, (long long)z.H, (long long)KV, (long long)z.hd, median(ts));
      return 0;
    }
    MT_CHECK(n > 1, "bench", "run under mpirun with N > 1 ranks (or --local 1 on one)");
    for (const Method& m : methods(n)) {
      if (z.H % m.ulysses != 0) continue;
      DeviceMesh mesh = DeviceMesh::create({{"cp_ring", m.ring}, {"cp_ulysses", m.ulysses}});
      ContextParallel cp;
      if (m.ring > 1) cp.ring = &mesh.group("cp_ring");
      if (m.ulysses > 1) cp.ulysses = &mesh.group("cp_ulysses");
      cp.method = m.ring_method, cp.load_balance = CpLoadBalance::head_tail, cp.seq_len = z.bytes_T;
      auto attn = make_attention(cp);
      int64_t Tl = z.bytes_T / n;
      // 1. Bytes per layer, counted against the analytic count, every kv head count (bf16: the training dtype).
      for (int64_t KV : z.kv) {
        if (KV % m.ulysses != 0 && m.ulysses % KV != 0) continue;
        const DType dt = DType::bf16;
        Tensor q = test::randn({z.B, Tl, z.H, z.hd}, 1, dt), k = test::randn({z.B, Tl, KV, z.hd}, 2, dt);
        Tensor v = test::randn({z.B, Tl, KV, z.hd}, 3, dt), dout = test::randn(q.shape(), 4, dt);
        Tensor dq = empty(q.shape(), dt), dk = empty(k.shape(), dt), dv = empty(v.shape(), dt);
        AttentionSaved s;
        reset_comm_counters();
        attn->forward(s, q, k, v, AttentionCall{});
        const double f = double(comm_counters().bytes("cp."));
        reset_comm_counters();
        attn->backward(dq, dk, dv, dout, s, AttentionCall{});
        const double b = double(comm_counters().bytes("cp."));
        reset_comm_counters();
        auto [fa, ba] = analytic(m, z, z.bytes_T, KV, dt);
        if (env.rank() == 0)
          std::printf(
              "{\"bench\": \"cp_layer_bytes\", \"method\": \"%s\", \"cp\": %d, \"ring\": %d, \"ulysses\": %d, "
              "\"T\": %lld, \"H\": %lld, \"KV\": %lld, \"hd\": %lld, \"dtype\": \"bf16\", \"forward_mib\": %.3f, "
              "\"forward_analytic_mib\": %.3f, \"backward_mib\": %.3f, \"backward_analytic_mib\": %.3f, "
              "\"measured_over_analytic\": %.4f}\n",
              m.name.c_str(), n, m.ring, m.ulysses, (long long)z.bytes_T, (long long)z.H, (long long)KV,
              (long long)z.hd, f / (1 << 20), fa / (1 << 20), b / (1 << 20), ba / (1 << 20), (f + b) / (fa + ba));
        std::fflush(stdout);
      }
      // 2. Time per layer, f32, the slowest rank.
      if (!time) continue;
      cp.seq_len = z.T, Tl = z.T / n;
      attn = make_attention(cp);
      const int64_t KV = z.kv.front();
      if (KV % m.ulysses != 0 && m.ulysses % KV != 0) continue;
      Tensor q = test::randn({z.B, Tl, z.H, z.hd}, 10 + uint64_t(env.rank()), DType::f32);
      Tensor k = test::randn({z.B, Tl, KV, z.hd}, 20 + uint64_t(env.rank()), DType::f32);
      Tensor v = test::randn({z.B, Tl, KV, z.hd}, 30 + uint64_t(env.rank()), DType::f32);
      Tensor dout = test::randn(q.shape(), 40 + uint64_t(env.rank()), DType::f32);
      std::vector<double> ts;
      for (int64_t it = 0; it <= z.iters; ++it) {
        AttentionSaved s;
        Tensor dq = empty(q.shape(), DType::f32), dk = empty(k.shape(), DType::f32), dv = empty(v.shape(), DType::f32);
        mesh.group("world").barrier();
        auto t0 = Clock::now();
        attn->forward(s, q, k, v, AttentionCall{});
        attn->backward(dq, dk, dv, dout, s, AttentionCall{});
        if (it > 0) ts.push_back(seconds_since(t0));
      }
      Tensor fig = from_values({median(ts)}, {1}, DType::f64);
      mesh.group("world").all_reduce(fig, ReduceOp::max);
      reset_comm_counters();
      if (env.rank() == 0)
        std::printf(
            "{\"bench\": \"cp_layer_time\", \"method\": \"%s\", \"cp\": %d, \"ring\": %d, \"ulysses\": %d, "
            "\"T\": %lld, \"H\": %lld, \"KV\": %lld, \"hd\": %lld, \"seconds\": %.4f}\n",
            m.name.c_str(), n, m.ring, m.ulysses, (long long)z.T, (long long)z.H, (long long)KV, (long long)z.hd,
            fig.at<double>(0));
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp_methods: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 0;
}
