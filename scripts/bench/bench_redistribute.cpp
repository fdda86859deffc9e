// Issue-3 benchmark. (1) Planning time per (source, target) pair on a 3-D
// mesh, uncached and cached. (2) Redistribution of a 16 MiB f32 tensor on a
// 1-D mesh of all ranks for S(0)->R, P->R, P->S(0), S(0)->S(1), beside the bare
// MPI collective on the same buffers in the same run; prints both and the ratio.
//   build/scripts/bench/bench_redistribute                     (1 process: planning times)
//   mpirun -np 4 build/scripts/bench/bench_redistribute [--iters N] [--mib M]
// (3) Issue 17 part 5, a tensor-parallel activation's layout changes (any --shape or --device selects it):
//   [mpirun -np N] bench_redistribute --device cuda|cpu --shape 8x2048x2048 --dtype bf16|f32
//                  [--backend auto|nccl|mpi] [--iters 20] [--step-ms MS] [--layers 16] [--link-gbps 360] [--json FILE]
// the all-gather Shard(1) -> Replicate and the reduce-scatter Partial -> Shard(1) of a (B, T, d) activation on a
// 1-D "tp" mesh of the N ranks, each through `redistribute` on the tensor's device, its device-side parts alone
// (pack/unpack kernels, the collective on device buffers), and a bench-local host-staged baseline (device to host,
// pack and collective on the host through MPI, host to device). With one rank the per-rank work of tp = 2 is
// timed (the peer's half stood in by this rank's), since one GPU hosts one NCCL rank: a 2-GPU machine adds the
// link. Time, bytes, GB/s and each as a share of a training step (--step-ms; x 4 L: tp with sequence parallel
// does 2 all-gathers and 2 reduce-scatters per layer and direction, 4 L of each per step).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "comm/control.h"
#include "comm/env.h"
#include "comm/mpi/mpi_group.h"
#include "parallel/dtensor.h"
#include "runtime/core/log.h"
#include "runtime/core/stream.h"
#include "runtime/kernels/ops.h"

using namespace mt;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void planning(int rank) {
  std::vector<MeshDim> mesh{{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}};
  std::vector<Placement> one{Placement::Replicate(), Placement::Shard(0), Placement::Shard(1), Placement::Partial()};
  const std::vector<Placements> all = placement_product(one, 3);
  std::vector<std::pair<DTensorSpec, DTensorSpec>> pairs;
  for (auto& a : all)
    for (auto& b : all)
      pairs.emplace_back(DTensorSpec::make(mesh, a, {4096, 4096}), DTensorSpec::make(mesh, b, {4096, 4096}));
  std::vector<double> unc;
  double worst = 0;
  for (auto& [a, b] : pairs) {
    auto t0 = Clock::now();
    Plan p = plan_redistribute_uncached(a, b);
    double t = seconds_since(t0);
    unc.push_back(t);
    worst = std::max(worst, t);
  }
  clear_plan_cache();
  for (auto& [a, b] : pairs) plan_redistribute(a, b);
  int reps = 20;
  auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r)
    for (auto& [a, b] : pairs) plan_redistribute(a, b);
  double cached = seconds_since(t0) / double(reps * pairs.size());
  double mean = 0;
  for (double t : unc) mean += t / double(unc.size());
  if (rank == 0)
    std::printf(
        "planning, 3-D mesh 2x2x2, %zu pairs of {R,S(0),S(1),P}^3: uncached mean %.1f us, median %.1f us, "
        "max %.1f us (target < 1000 us); cached %.3f us (target < 1 us)\n",
        pairs.size(), mean * 1e6, median(unc) * 1e6, worst * 1e6, cached * 1e6);
}

struct ActivationOptions {
  std::string device = "cpu", dtype = "bf16", backend = "auto", json;
  Shape shape{8, 2048, 2048};
  int iters = 20, layers = 16;
  double step_ms = 0, link_gbps = 360;
};

// Fills a host tensor with small values (0.001 steps), f32 or bf16.
Tensor pattern(const Shape& s, DType dt) {
  Tensor t = empty(s, dt);
  const int64_t n = t.numel();
  if (dt == DType::bf16)
    for (int64_t i = 0; i < n; ++i) t.data<bf16>()[i] = bf16(float(i % 1000) * 1e-3f);
  else
    for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = float(i % 1000) * 1e-3f;
  return t;
}

// Milliseconds per call of fn: with one rank on a GPU, events around `iters` calls after 2 warm-up calls (no host
// wait between calls); otherwise the median over iterations of the slowest rank, each iteration between a barrier
// and a device synchronisation.
double time_ms(const std::function<void()>& fn, int iters, int n, Device dev, MPI_Comm comm) {
  if (n == 1 && dev.is_cuda()) {
    fn(), fn();
    const Stream& st = current_stream(dev.index);
    Event a = Event::create(true), b = Event::create(true);
    a.record(st);
    for (int i = 0; i < iters; ++i) fn();
    b.record(st);
    b.synchronize();
    return double(a.elapsed_ms(b)) / iters;
  }
  std::vector<double> t;
  for (int it = -2; it < iters; ++it) {
    if (dev.is_cuda()) current_stream(dev.index).synchronize();
    control_barrier(comm, "bench iteration");
    auto t0 = Clock::now();
    fn();
    if (dev.is_cuda()) current_stream(dev.index).synchronize();
    if (it >= 0) t.push_back(seconds_since(t0) * 1e3);
  }
  control_all_reduce(comm, t.data(), int(t.size()), MPI_DOUBLE, MPI_MAX, "bench times");
  return median(t);
}

int activation_bench(const MpiEnv& env, const ActivationOptions& o) {
  const int n = env.size();
  const bool cuda = o.device == "cuda";
  MT_CHECK(!cuda || cuda_device_count() > 0, "bench", "--device cuda: no CUDA device visible");
  const Device dev = cuda ? Device::cuda(env.cuda_device() >= 0 ? env.cuda_device() : 0) : Device::cpu();
  if (cuda) set_device(dev.index);
  const DType dt = o.dtype == "bf16" ? DType::bf16 : DType::f32;
  MT_CHECK(o.shape.size() == 3, "bench", "--shape takes B x T x d");
  const int64_t B = o.shape[0], T = o.shape[1], d = o.shape[2];
  const int tp = n == 1 ? 2 : n;  // the tp size whose per-rank work is timed
  MT_CHECK(T % tp == 0, "bench", "T = {} must divide by {}", T, tp);
  MeshOptions mo;
  mo.device = dev;
  mo.backend = o.backend;
  DeviceMesh mesh = DeviceMesh::create({{"tp", n}}, mo);
  Group& g = mesh.group(0);
  // The baseline's host collectives: an MPI mesh on the host (its bf16 sums in f32, as the staged backend's).
  MeshOptions host_opts;
  host_opts.backend = "mpi";
  DeviceMesh host_mesh = DeviceMesh::create({{"tp", n}}, host_opts);
  Group& hg = host_mesh.group(0);
  MPI_Comm comm = group_mpi_comm(hg);
  const double es = double(dtype_size(dt)), full = double(B * T * d) * es;
  const std::vector<int64_t> lens(size_t(tp), T / tp);
  Tensor x = pattern(o.shape, dt).to(dev);

  struct Row {
    std::string kase, path, bytes_what;
    double ms, bytes;
    bool estimate = false;
  };
  std::vector<Row> rows;
  auto add_row = [&](const std::string& kase, const std::string& path, double ms, double bytes,
                     const std::string& bytes_what, bool estimate = false) {
    rows.push_back({kase, path, bytes_what, ms, bytes, estimate});
  };
  const std::string where = fmt::format("{} ({})", dev.str(), mesh.backend());
  const double link = (double(tp) - 1) / tp * full;  // bytes each rank receives (all-gather) or sends (reduce-scatter)

  // ---- all-gather Shard(1) -> Replicate ----
  {
    const char* k = "all-gather S(1)->R";
    DTensor src = distribute_tensor(x, mesh, {Placement::Shard(1)});
    add_row(k, fmt::format("redistribute, {} rank(s), {}", n, where),
            time_ms([&] { redistribute(src, {Placement::Replicate()}); }, o.iters, n, dev, comm),
            (double(n) - 1) / n * full, n == 1 ? "none: one rank exchanges nothing" : "received per rank");
    Tensor gathered = empty({B * T * d}, dt, dev), out = empty(o.shape, dt, dev);
    const double unpack = time_ms([&] { unpack_blocks(out, gathered, 1, lens); }, o.iters, n, dev, comm);
    add_row(k, fmt::format("{} unpack_blocks alone ({} blocks, tp = {})", dev.str(), tp, tp), unpack, 2 * full,
            "read + written");
    Tensor local = src.local.reshape({-1});
    add_row(k, fmt::format("collective alone: {} all_gather, {} rank(s)", g.backend(), n),
            time_ms([&] { g.all_gather(gathered.view(0, {local.numel() * n}), local); }, o.iters, n, dev, comm),
            n == 1 ? full : link, n == 1 ? "copied (one rank: no link)" : "received per rank");
    // Host-staged: the rank's (B, T/tp, d) to the host, gathered on the host (MPI; one rank stands in for its
    // peers with copies of its own), unpacked on the host, the (B, T, d) result back to the device.
    Tensor shard = x.view(0, {B, T / tp, d}).clone();  // a (B, T/tp, d) piece: the rank's shard at tp
    Tensor hg_out = empty({B * T * d}, dt), h_out = empty(o.shape, dt);
    add_row(k,
            fmt::format("{}{}", cuda ? "host-staged: D2H, " : "host (CPU: no staging): ",
                        n == 1 ? "host copy (tp = 2 stand-in), host unpack, H2D"
                               : "MPI all_gather on the host, host unpack, H2D"),
            time_ms(
                [&] {
                  Tensor h = shard.to(Device::cpu());
                  if (n > 1) {
                    hg.all_gather(hg_out, h.reshape({-1}));
                  } else {
                    for (int j = 0; j < tp; ++j) copy_(hg_out.view(j * h.numel(), {h.numel()}), h.reshape({-1}));
                  }
                  unpack_blocks(h_out, hg_out, 1, lens);
                  Tensor back = h_out.to(dev);
                },
                o.iters, n, dev, comm),
            cuda ? full / tp + full : link, cuda ? "over PCIe (D2H + H2D)" : "received per rank");
    if (cuda && n == 1)
      add_row(k, fmt::format("estimate for 2 GPUs: unpack + link bytes at {:.0f} GB/s (assumed busbw)", o.link_gbps),
              unpack + link / (o.link_gbps * 1e9) * 1e3, link, "received per rank", true);
  }
  // ---- reduce-scatter Partial -> Shard(1) ----
  {
    const char* k = "reduce-scatter P->S(1)";
    DTensor src = distribute_tensor(x, mesh, {Placement::Partial()});
    add_row(k, fmt::format("redistribute, {} rank(s), {}", n, where),
            time_ms([&] { redistribute(src, {Placement::Shard(1)}); }, o.iters, n, dev, comm),
            (double(n) - 1) / n * full, n == 1 ? "none: one rank exchanges nothing" : "sent per rank");
    Tensor packed = empty({B * T * d}, dt, dev);
    const double pack = time_ms([&] { pack_blocks(packed, x, 1, lens); }, o.iters, n, dev, comm);
    add_row(k, fmt::format("{} pack_blocks alone ({} blocks, tp = {})", dev.str(), tp, tp), pack, 2 * full,
            "read + written");
    Tensor part = empty({B * T * d / n}, dt, dev);
    add_row(k, fmt::format("collective alone: {} reduce_scatter, {} rank(s)", g.backend(), n),
            time_ms([&] { g.reduce_scatter(part, packed, ReduceOp::sum); }, o.iters, n, dev, comm),
            n == 1 ? full : link, n == 1 ? "copied (one rank: no link)" : "sent per rank");
    // Host-staged: the (B, T, d) partial to the host, packed and reduce-scattered there (one rank: its blocks
    // summed, standing in for the peers' reduction), the (B, T/tp, d) result back to the device.
    Tensor h_packed = empty({B * T * d}, dt), h_part = empty({B * T * d / tp}, dt);
    add_row(k,
            fmt::format("{}{}", cuda ? "host-staged: D2H, " : "host (CPU: no staging): ",
                        n == 1 ? "host pack, host sum (tp = 2 stand-in), H2D"
                               : "host pack, MPI reduce_scatter on the host, H2D"),
            time_ms(
                [&] {
                  Tensor h = x.to(Device::cpu());
                  pack_blocks(h_packed, h, 1, lens);
                  if (n > 1) {
                    hg.reduce_scatter(h_part, h_packed, ReduceOp::sum);
                  } else {
                    const int64_t m = h_part.numel();
                    add(h_part, h_packed.view(0, {m}), h_packed.view(m, {m}));
                  }
                  Tensor back = h_part.to(dev);
                },
                o.iters, n, dev, comm),
            cuda ? full + full / tp : link, cuda ? "over PCIe (D2H + H2D)" : "sent per rank");
    if (cuda && n == 1)
      add_row(k, fmt::format("estimate for 2 GPUs: pack + link bytes at {:.0f} GB/s (assumed busbw)", o.link_gbps),
              pack + link / (o.link_gbps * 1e9) * 1e3, link, "sent per rank", true);
  }

  if (env.rank() != 0) return 0;
  const std::string dname(dtype_name(dt));
  std::printf("\nredistribution of a (%lld, %lld, %lld) %s activation (%.1f MiB) on a tp mesh of %d rank(s), %s; %s\n",
              (long long)B, (long long)T, (long long)d, dname.c_str(), full / (1 << 20), n, where.c_str(),
              n == 1 ? "one rank: per-rank work of tp = 2 timed, the link estimated" : "measured");
  std::string step_hdr =
      o.step_ms > 0 ? fmt::format("of a {:.1f} ms step; x {} per step", o.step_ms, 4 * o.layers) : "(no --step-ms)";
  std::printf("%-24s %-78s %9s %10s %9s  %s (%s)\n", "case", "path", "ms", "MiB", "GB/s", "share", step_hdr.c_str());
  FILE* js = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "a");
  for (const Row& r : rows) {
    const double gbs = r.ms > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0;
    std::string share =
        o.step_ms > 0 ? fmt::format("{:.2f}%; {:.1f}%", 100 * r.ms / o.step_ms, 100 * r.ms * 4 * o.layers / o.step_ms)
                      : "-";
    std::printf("%-24s %-78s %9.3f %10.1f %9.1f  %s   [bytes: %s]%s\n", r.kase.c_str(), r.path.c_str(), r.ms,
                r.bytes / (1 << 20), gbs, share.c_str(), r.bytes_what.c_str(), r.estimate ? " ESTIMATE" : "");
    if (js)
      std::fprintf(js,
                   "{\"bench\":\"redistribute\",\"case\":\"%s\",\"path\":\"%s\",\"ranks\":%d,\"device\":\"%s\","
                   "\"backend\":\"%s\",\"shape\":[%lld,%lld,%lld],\"dtype\":\"%s\",\"ms\":%.4f,\"bytes\":%.0f,"
                   "\"bytes_what\":\"%s\",\"gbps\":%.2f,\"estimate\":%s,\"step_ms\":%.3f,\"layers\":%d}\n",
                   r.kase.c_str(), r.path.c_str(), n, dev.str().c_str(), mesh.backend().c_str(), (long long)B,
                   (long long)T, (long long)d, dname.c_str(), r.ms, r.bytes, r.bytes_what.c_str(), gbs,
                   r.estimate ? "true" : "false", o.step_ms, o.layers);
  }
  if (js) std::fclose(js);
  if (n == 1 && cuda)
    std::printf(
        "One GPU hosts one NCCL rank, so the collective above is a device copy; a 2-GPU machine adds the NVLink\n"
        "transfer of the bytes marked 'received/sent per rank' (the ESTIMATE rows assume %.0f GB/s bus bandwidth)\n"
        "and the overlap of NCCL's stream with compute. Run with -np 2 on two GPUs to measure it.\n",
        o.link_gbps);
  return 0;
}

Shape parse_shape(const std::string& s) {
  Shape r;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, 'x');) r.push_back(std::stoll(item));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnv env(&argc, &argv);
  init_logging(env.rank(), "warn");
  int iters = 10;
  int64_t mib = 16;
  ActivationOptions ao;
  bool activation = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--iters") iters = ao.iters = std::atoi(v.c_str());
    else if (k == "--mib") mib = std::atoll(v.c_str());
    else if (k == "--device") ao.device = v, activation = true;
    else if (k == "--shape") ao.shape = parse_shape(v), activation = true;
    else if (k == "--dtype") ao.dtype = v;
    else if (k == "--backend") ao.backend = v;
    else if (k == "--step-ms") ao.step_ms = std::atof(v.c_str());
    else if (k == "--layers") ao.layers = std::atoi(v.c_str());
    else if (k == "--link-gbps") ao.link_gbps = std::atof(v.c_str());
    else if (k == "--json") ao.json = v;
    else {
      if (env.rank() == 0) std::fprintf(stderr, "bench_redistribute: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (activation) {
    try {
      return activation_bench(env, ao);
    } catch (const std::exception& e) {
      if (env.rank() == 0) std::printf("{\"bench\":\"redistribute\",\"error\":\"%s\"}\n", e.what());
      if (env.rank() == 0 && !ao.json.empty())
        if (FILE* js = std::fopen(ao.json.c_str(), "a")) {
          std::string m = e.what();
          std::replace(m.begin(), m.end(), '"', '\'');
          std::fprintf(js, "{\"bench\":\"redistribute\",\"error\":\"%s\"}\n", m.c_str());
          std::fclose(js);
        }
      return 1;
    }
  }
  // Planning is timed by one process alone (other ranks would share its cores).
  if (env.size() == 1) {
    planning(env.rank());
    return 0;
  }

  int n = env.size();
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", n}});
  MPI_Comm comm = group_mpi_comm(mesh.group(0));
  int64_t side = 1;
  while (side * side * 4 < mib << 20) side *= 2;  // a square f32 tensor of `mib` MiB
  Shape shape{side, side};
  std::vector<double> v(static_cast<size_t>(side * side));
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i % 1000);
  Tensor x = from_values(v, shape, DType::f32);
  struct Case {
    const char* name;
    Placements from, to;
  };
  std::vector<Case> cases{{"S(0)->R", {Placement::Shard(0)}, {Placement::Replicate()}},
                          {"P->R", {Placement::Partial()}, {Placement::Replicate()}},
                          {"P->S(0)", {Placement::Partial()}, {Placement::Shard(0)}},
                          {"S(0)->S(1)", {Placement::Shard(0)}, {Placement::Shard(1)}}};
  if (env.rank() == 0)
    std::printf(
        "\nredistribute %lld MiB f32 (%lldx%lld) on %d ranks, median of %d (slowest rank per iteration)\n"
        "%-12s %12s %12s %8s  %s\n",
        (long long)mib, (long long)side, (long long)side, n, iters, "case", "ours_ms", "bare_ms", "ratio", "bare call");
  for (auto& c : cases) {
    DTensor src = distribute_tensor(x, mesh, c.from);
    Tensor local = src.local;
    int64_t cnt = local.numel();
    Tensor out = empty({cnt * n}, DType::f32), part = empty({cnt / n}, DType::f32), a2a = empty({cnt}, DType::f32);
    Tensor work = local.clone();
    std::vector<double> ours, bare;
    for (int it = -2; it < iters; ++it) {
      control_barrier(comm, "bench iteration");
      auto t0 = Clock::now();
      DTensor dst = redistribute(src, c.to);
      double t = seconds_since(t0);
      control_barrier(comm, "bench bare call");
      auto t1 = Clock::now();
      // Open MPI's own collective, the figure ours is compared with: bare by design, entered only once every rank
      // has passed the watched barrier above.
      std::string name(c.name);
      if (name == "S(0)->R")
        MPI_Allgather(local.data_ptr(), int(cnt), MPI_FLOAT, out.data_ptr(), int(cnt), MPI_FLOAT, comm);
      else if (name == "P->R") MPI_Allreduce(MPI_IN_PLACE, work.data_ptr(), int(cnt), MPI_FLOAT, MPI_SUM, comm);
      else if (name == "P->S(0)")
        MPI_Reduce_scatter_block(local.data_ptr(), part.data_ptr(), int(cnt / n), MPI_FLOAT, MPI_SUM, comm);
      else MPI_Alltoall(local.data_ptr(), int(cnt / n), MPI_FLOAT, a2a.data_ptr(), int(cnt / n), MPI_FLOAT, comm);
      double tb = seconds_since(t1);
      if (it >= 0) ours.push_back(t), bare.push_back(tb);
    }
    control_all_reduce(comm, ours.data(), iters, MPI_DOUBLE, MPI_MAX, "bench times");
    control_all_reduce(comm, bare.data(), iters, MPI_DOUBLE, MPI_MAX, "bench times");
    double to = median(ours), tb = median(bare);
    const char* call = std::string(c.name) == "S(0)->R"   ? "MPI_Allgather"
                       : std::string(c.name) == "P->R"    ? "MPI_Allreduce"
                       : std::string(c.name) == "P->S(0)" ? "MPI_Reduce_scatter_block"
                                                          : "MPI_Alltoall (pre-packed)";
    if (env.rank() == 0) std::printf("%-12s %12.2f %12.2f %8.3f  %s\n", c.name, to * 1e3, tb * 1e3, to / tb, call);
  }
  return 0;
}
