// The collectives' self-check (self_check.h): values from value(), so that every expected result is known
// without communication; times in nccl-tests' conventions.
#include "comm/self_check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "comm/mpi/mpi_baseline.h"
#include "comm/world.h"
#include "runtime/core/error.h"
#include "runtime/core/log.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;

// nccl-tests' bus bandwidth factors: what each link carries relative to the
// algorithm bandwidth, so that figures compare with the hardware's.
double bus_factor(const std::string& op, int n) {
  if (n == 1) return 0.0;  // one rank moves nothing over any link
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  return 1.0;  // broadcast, ring_shift
}

// Rank r's input value at element i: small integers, so sums are exact in f32, bf16 and i64.
double value(int r, int64_t i) { return double(r + 1) + double(i % 17); }

struct Buffers {
  Tensor in, out;  // out undefined for in-place ops
};

// Elements moved per op for a buffer of `count` total elements (the larger of in/out).
Buffers make_buffers(const std::string& op, int64_t count, int me, int n, DType dt, Device dev) {
  int64_t m = count / n;  // chunk per rank
  auto fill = [&](int64_t len, int64_t base) {
    std::vector<double> v(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) v[size_t(i)] = value(me, base + i);
    return from_values(v, {len}, dt).to(dev);
  };
  if (op == "all_reduce" || op == "broadcast") return {fill(count, 0), {}};
  if (op == "all_gather") return {fill(m, 0), zeros({m * n}, dt, dev)};
  if (op == "reduce_scatter") return {fill(m * n, 0), zeros({m}, dt, dev)};
  if (op == "all_to_all") return {fill(m * n, 0), zeros({m * n}, dt, dev)};
  if (op == "ring_shift") return {fill(count, 0), zeros({count}, dt, dev)};
  return {};
}

Work run_op(Group& g, const std::string& op, const Buffers& b, bool async = false) {
  if (op == "all_reduce") return g.all_reduce(b.in, ReduceOp::sum, async);
  if (op == "all_gather") return g.all_gather(b.out, b.in, async);
  if (op == "reduce_scatter") return g.reduce_scatter(b.out, b.in, ReduceOp::sum, async);
  if (op == "all_to_all") return g.all_to_all(b.out, b.in, async);
  if (op == "broadcast") return g.broadcast(b.in, 0, async);
  if (op == "ring_shift") return g.ring_shift(b.out, b.in, 1, async);
  g.barrier();
  return {};
}

// Compares the op's result with the expectation computed from value(); returns
// the number of wrong elements (0 = correct).
int64_t verify(const std::string& op, const Buffers& b, int64_t count, int me, int n) {
  int64_t m = count / n;
  std::vector<double> got;
  std::function<double(int64_t)> want;
  double rank_sum = n * (n + 1) / 2.0;
  if (op == "all_reduce") {
    got = to_f64(b.in);
    want = [&](int64_t i) { return rank_sum + n * double(i % 17); };
  } else if (op == "broadcast") {
    got = to_f64(b.in);
    want = [&](int64_t i) { return value(0, i); };
  } else if (op == "all_gather") {
    got = to_f64(b.out);
    want = [&](int64_t j) { return value(int(j / m), j % m); };
  } else if (op == "reduce_scatter") {
    got = to_f64(b.out);
    want = [&](int64_t k) { return rank_sum + n * double((me * m + k) % 17); };
  } else if (op == "all_to_all") {
    got = to_f64(b.out);
    want = [&](int64_t j) { return value(int(j / m), me * m + j % m); };
  } else if (op == "ring_shift") {
    got = to_f64(b.out);
    want = [&](int64_t i) { return value((me + n - 1) % n, i); };
  } else {
    return 0;
  }
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want(int64_t(i))) ++bad;
  return bad;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string human_bytes(int64_t b) {
  if (b >= (1 << 30) && b % (1 << 30) == 0) return fmt::format("{}G", b >> 30);
  if (b >= (1 << 20) && b % (1 << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= (1 << 10) && b % (1 << 10) == 0) return fmt::format("{}K", b >> 10);
  return fmt::format("{}", b);
}

void sync_device(Device d) {
  if (d.is_cuda()) current_stream(d.index).synchronize();
}

// Correctness of each op in every dtype and the async form, on a small odd count: the failures on this rank.
int64_t check_values(Group& g, const std::vector<std::string>& ops, const Device& device) {
  const int n = g.size(), me = g.rank();
  int64_t failures = 0;
  for (const auto& op : ops) {
    for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
      for (bool async : {false, true}) {
        int64_t count = int64_t(n) * 5;
        Buffers b = make_buffers(op, count, me, n, dt, device);
        run_op(g, op, b, async).wait();
        int64_t bad = verify(op, b, count, me, n);
        if (bad) {
          spdlog::error("[check] {} {} ({}{}) on {}: {} wrong elements", op, dtype_name(dt), async ? "async, " : "",
                        device.str(), g.describe(), bad);
          ++failures;
        }
      }
    }
  }
  return failures;
}

// One op at one size: the medians of our call and of bare MPI's (0 when not compared) over the iterations, each
// iteration as long as its slowest rank, and whether any rank of the group got a wrong result.
struct Timed {
  double ours = 0, theirs = 0;
  bool wrong = false;
};
Timed time_op(Group& g, const std::string& op, int64_t count, const SelfCheckOptions& opt, Device device, bool bare) {
  const int n = g.size(), me = g.rank();
  Buffers b = make_buffers(op, count, me, n, DType::f32, device);
  run_op(g, op, b).wait();
  sync_device(device);
  int64_t bad = verify(op, b, count, me, n);
  std::vector<double> ours(size_t(opt.iters)), theirs(size_t(opt.iters), 0.0);
  for (int it = -opt.warmup; it < opt.iters; ++it) {
    mpi_baseline::barrier(g, fmt::format("check timing barrier ({})", op));
    auto t0 = Clock::now();
    run_op(g, op, b).wait();
    sync_device(device);
    double t = std::chrono::duration<double>(Clock::now() - t0).count();
    if (it >= 0) ours[size_t(it)] = t;
    if (bare) {
      t = mpi_baseline::time_collective(g, op, b.in, b.out, fmt::format("check timing barrier (bare {})", op));
      if (it >= 0) theirs[size_t(it)] = t;
    }
  }
  mpi_baseline::all_reduce(g, std::span(ours), ReduceOp::max, "check timing all_reduce");
  mpi_baseline::all_reduce(g, std::span(theirs), ReduceOp::max, "check timing all_reduce");
  mpi_baseline::all_reduce(g, std::span(&bad, 1), ReduceOp::sum, "check wrong-element count");
  return {median(ours), median(theirs), bad != 0};
}

// A table row on stdout (and its JSON line): the bytes moved, time, algorithm and bus bandwidth, bare MPI's.
void print_row(const Group& g, const std::string& op, int64_t count, const Timed& r, Device device, bool bare,
               std::ostream* json) {
  const int n = g.size();
  const double t = r.ours, tb = r.theirs;
  int64_t moved = op == "barrier" ? 0 : count * 4;
  double alg = op == "barrier" ? 0 : double(moved) / t / 1e9, bus = alg * bus_factor(op, n);
  double mpi_bus = bare && tb > 0 && op != "barrier" ? double(moved) / tb / 1e9 * bus_factor(op, n) : 0;
  double ratio = bare && t > 0 ? tb / t : 0;
  std::printf("%10s %12.1f %11.3f %11.3f", op == "barrier" ? "-" : human_bytes(moved).c_str(), t * 1e6, alg, bus);
  if (bare) std::printf(" %11.3f %7.3f", mpi_bus, ratio);
  std::printf("  %s\n", r.wrong ? "WRONG" : "ok");
  std::fflush(stdout);
  if (json)
    *json << fmt::format(
        "{{\"op\":\"{}\",\"group\":\"{}\",\"ranks\":{},\"backend\":\"{}\",\"device\":\"{}\",\"bytes\":{},"
        "\"time_us\":{:.3f},\"algbw_gbps\":{:.4f},\"busbw_gbps\":{:.4f},\"mpi_time_us\":{:.3f},"
        "\"mpi_busbw_gbps\":{:.4f},\"ratio\":{:.4f},\"ok\":{}}}\n",
        op, g.name(), n, g.backend(), device.str(), moved, t * 1e6, alg, bus, tb * 1e6, mpi_bus, ratio,
        r.wrong ? "false" : "true");
}

// Each op timed at each size, beside bare MPI on the same buffers where it applies (the MPI backend on host
// buffers); world rank 0 prints the tables. Returns the sizes that came out wrong on any rank of the group.
int64_t time_ops(Group& g, Device device, const SelfCheckOptions& opt) {
  const int n = g.size();
  const bool bare = opt.compare_mpi && g.backend() == "mpi" && device.is_cpu();
  const bool root = world::rank() == 0;
  int64_t failures = 0;
  for (const auto& op : opt.ops) {
    if (root)
      std::printf("\n%s on %s, %d ranks, %s, %s%s\n%10s %12s %11s %11s %11s %s\n", op.c_str(), g.name().c_str(), n,
                  std::string(g.backend()).c_str(), device.str().c_str(),
                  bare ? " (vs bare MPI on the same buffers)" : "", "size", "time_us", "algbw_GB/s", "busbw_GB/s",
                  bare ? "mpi_busbw" : "", bare ? "   ratio  check" : "check");
    for (int64_t bytes : op == "barrier" ? std::vector<int64_t>{0} : opt.sizes) {
      const int64_t count = std::max<int64_t>(n, bytes / 4 / n * n);  // f32 elements, a multiple of n
      const Timed r = time_op(g, op, count, opt, device, bare);
      failures += r.wrong;
      if (root) print_row(g, op, count, r, device, bare, opt.json);
    }
  }
  return failures;
}

}  // namespace

const std::vector<std::string>& self_check_ops() {
  static const std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                               "broadcast",  "ring_shift", "barrier"};
  return ops;
}

std::vector<int64_t> parse_size_range(const std::string& spec) {
  auto parse_one = [&](const std::string& s) -> int64_t {
    MT_CHECK(!s.empty(), "check", "bad size '{}' in --sizes '{}'", s, spec);
    char* end = nullptr;
    double x = std::strtod(s.c_str(), &end);
    std::string unit(end);
    int64_t mul = unit.empty() || unit == "B"    ? 1
                  : unit == "K" || unit == "KiB" ? int64_t(1) << 10
                  : unit == "M" || unit == "MiB" ? int64_t(1) << 20
                  : unit == "G" || unit == "GiB" ? int64_t(1) << 30
                                                 : -1;
    MT_CHECK(mul > 0 && x > 0, "check", "bad size '{}' in --sizes '{}' (expected e.g. 1K, 4M, 1G)", s, spec);
    return int64_t(x * double(mul));
  };
  auto colon = spec.find(':');
  if (colon == std::string::npos) return {parse_one(spec)};
  int64_t lo = parse_one(spec.substr(0, colon)), hi = parse_one(spec.substr(colon + 1));
  MT_CHECK(lo <= hi, "check", "--sizes '{}': the first size must not exceed the second", spec);
  std::vector<int64_t> r;
  for (int64_t s = lo; s <= hi; s *= 2) r.push_back(s);
  return r;
}

std::vector<Group*> self_check_groups(DeviceMesh& mesh, const std::vector<MeshGroupName>& names) {
  std::vector<Group*> groups;
  for (int d = 0; d < mesh.ndim(); ++d) groups.push_back(&mesh.group(d));
  auto add = [&](Group& g) {
    if (std::find(groups.begin(), groups.end(), &g) == groups.end()) groups.push_back(&g);
  };
  for (const MeshGroupName& n : names) {
    int present = 0;
    for (auto& d : n.dims) present += mesh.has_dim(d);
    if (present > 1) add(mesh.group(n.name));
  }
  if (mesh.ndim() > 1) add(mesh.group("world"));
  return groups;
}

int64_t run_self_check(const std::vector<Group*>& groups, Device device, const SelfCheckOptions& opt) {
  int64_t failures = 0;
  for (Group* g : groups) {
    failures += check_values(*g, opt.ops, device);
    failures += time_ops(*g, device, opt);
  }
  return failures;
}

}  // namespace mt
