// meshtrain check: the cluster self-check. Runs every collective on every
// mesh dim and on the flattened groups, verifies each result against values
// computed without communication, and times it (median of --iters) in
// nccl-tests' conventions, beside the bare MPI call on the same buffers (comm/mpi/mpi_baseline.h).
#include "runtime/cli/command.h"
#include <cstdint>
#include <string>
#include <vector>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>

#include "comm/mpi/mpi_baseline.h"
#include "comm/world.h"
#include "parallel/parallel_dims.h"
#include "runtime/core/log.h"
#include "runtime/core/stream.h"
#include "runtime/train/agree.h"

namespace mt {

struct CheckArgs {
  std::string mesh;  // "dp_shard=2,cp=2,tp=2"; empty: from the config
  std::string sizes = "1K:64M";
  int iters = 20;
  int warmup = 3;
  std::string device;            // cpu | cuda; empty: comm.device
  std::string backend;           // auto | mpi | nccl; empty: comm.backend
  std::vector<std::string> ops;  // empty: all
  bool compare_mpi = true;       // time bare MPI beside ours (host buffers)
  std::string json;              // write the results as JSON lines here (rank 0)
};
// "1K:64M" -> 1024, 2048, ..., 64 MiB (factor 2); "4M" -> one size. Binary units.
std::vector<int64_t> parse_size_range(const std::string& spec);


namespace {

using Clock = std::chrono::steady_clock;

const std::vector<std::string> kAllOps = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                          "broadcast",  "ring_shift", "barrier"};

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

// The mesh check's sizes and dims from the options (--sizes, --mesh, else the config's parallel dims): the same
// on every rank, so an error in them is printed once.
struct CheckPlan {
  std::vector<int64_t> sizes;
  std::vector<MeshDim> dims;
  std::vector<MeshGroupName> groups;  // the training mesh's named groups (none with --mesh)
};
CheckPlan check_plan(const MpiEnv& env, const Config& cfg, const CheckArgs& args) {
  CheckPlan plan;
  std::vector<int64_t>& sizes = plan.sizes;
  std::vector<MeshDim>& dims = plan.dims;
  run_agreed(env, "the check options", [&] {
    MT_CHECK(args.iters >= 1 && args.warmup >= 0, "check", "--iters must be >= 1 and --warmup >= 0");
    for (auto& op : args.ops)
      MT_CHECK(std::find(kAllOps.begin(), kAllOps.end(), op) != kAllOps.end(), "check",
               "unknown op '{}' in --ops (expected some of all_reduce, all_gather, reduce_scatter, all_to_all, "
               "broadcast, ring_shift, barrier)",
               op);
    sizes = parse_size_range(args.sizes);
    if (!args.mesh.empty()) {
      dims = parse_mesh_spec(args.mesh, env.size());
    } else {
      // The training mesh's dims of size > 1 and its named groups (dp, cp, dp_cp, loss).
      const ParallelDims pd = ParallelDims::from_config(cfg.parallel, env.size());
      for (const MeshDim& d : pd.mesh_dims())
        if (d.size > 1) dims.push_back(d);
      if (dims.empty()) dims.push_back({dim::dp_replicate, 1});
      plan.groups = pd.group_names();
    }
  });
  return plan;
}

// Every dim's group, then each named group and the whole world when they add a new set of ranks.
std::vector<Group*> groups_to_check(DeviceMesh& mesh, const std::vector<MeshGroupName>& names) {
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

// Each op timed at each size (median of args.iters after args.warmup), beside bare MPI on the same buffers where
// it applies; rank 0 prints the table rows (and --json lines). Returns the failures (wrong results) of this group.
int64_t time_ops(const MpiEnv& env, Group& g, const std::vector<std::string>& ops, const std::vector<int64_t>& sizes,
                 const CheckArgs& args, const Device& device, std::ofstream& json) {
  const int n = g.size(), me = g.rank();
  const bool bare = args.compare_mpi && g.backend() == "mpi" && device.is_cpu();
  int64_t failures = 0;
  for (const auto& op : ops) {
    if (env.rank() == 0)
      std::printf("\n%s on %s, %d ranks, %s, %s%s\n%10s %12s %11s %11s %11s %s\n", op.c_str(), g.name().c_str(), n,
                  std::string(g.backend()).c_str(), device.str().c_str(),
                  bare ? " (vs bare MPI on the same buffers)" : "", "size", "time_us", "algbw_GB/s", "busbw_GB/s",
                  bare ? "mpi_busbw" : "", bare ? "   ratio  check" : "check");
    auto op_sizes = op == "barrier" ? std::vector<int64_t>{0} : sizes;
    for (int64_t bytes : op_sizes) {
      int64_t count = std::max<int64_t>(n, bytes / 4 / n * n);  // f32 elements, a multiple of n
      Buffers b = make_buffers(op, count, me, n, DType::f32, device);
      run_op(g, op, b).wait();
      sync_device(device);
      int64_t bad = verify(op, b, count, me, n);
      std::vector<double> ours(size_t(args.iters)), theirs(size_t(args.iters), 0.0);
      for (int it = -args.warmup; it < args.iters; ++it) {
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
      // An iteration lasts as long as its slowest rank.
      mpi_baseline::all_reduce(g, std::span(ours), ReduceOp::max, "check timing all_reduce");
      mpi_baseline::all_reduce(g, std::span(theirs), ReduceOp::max, "check timing all_reduce");
      int64_t bad_all = bad;
      mpi_baseline::all_reduce(g, std::span(&bad_all, 1), ReduceOp::sum, "check wrong-element count");
      if (bad_all) ++failures;
      double t = median(ours), tb = median(theirs);
      int64_t moved = op == "barrier" ? 0 : count * 4;
      double alg = op == "barrier" ? 0 : double(moved) / t / 1e9, bus = alg * bus_factor(op, n);
      double mpi_bus = bare && tb > 0 && op != "barrier" ? double(moved) / tb / 1e9 * bus_factor(op, n) : 0;
      double ratio = bare && t > 0 ? tb / t : 0;
      if (env.rank() == 0) {
        std::printf("%10s %12.1f %11.3f %11.3f", op == "barrier" ? "-" : human_bytes(moved).c_str(), t * 1e6, alg, bus);
        if (bare) std::printf(" %11.3f %7.3f", mpi_bus, ratio);
        std::printf("  %s\n", bad_all ? "WRONG" : "ok");
        std::fflush(stdout);
        if (json.is_open())
          json << fmt::format(
              "{{\"op\":\"{}\",\"group\":\"{}\",\"ranks\":{},\"backend\":\"{}\",\"device\":\"{}\",\"bytes\":{},"
              "\"time_us\":{:.3f},\"algbw_gbps\":{:.4f},\"busbw_gbps\":{:.4f},\"mpi_time_us\":{:.3f},"
              "\"mpi_busbw_gbps\":{:.4f},\"ratio\":{:.4f},\"ok\":{}}}\n",
              op, g.name(), n, g.backend(), device.str(), moved, t * 1e6, alg, bus, tb * 1e6, mpi_bus, ratio,
              bad_all ? "false" : "true");
      }
    }
  }
  return failures;
}

}  // namespace

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

void add_check_options(CLI::App* sub, CheckArgs& a) {
  sub->add_option("--mesh", a.mesh, "mesh dims, e.g. dp_shard=2,cp=2,tp=2 (one size may be -1); default: config");
  sub->add_option("--sizes", a.sizes, "buffer sizes MIN:MAX (x2 steps) or one size, e.g. 1K:64M")
      ->capture_default_str();
  sub->add_option("--iters", a.iters, "timed repetitions per size (median reported)")->capture_default_str();
  sub->add_option("--warmup", a.warmup, "untimed repetitions first")->capture_default_str();
  sub->add_option("--device", a.device, "cpu or cuda (default: comm.device)");
  sub->add_option("--backend", a.backend, "auto, mpi or nccl (default: comm.backend)");
  sub->add_option("--ops", a.ops, "collectives to run (default: all)")->delimiter(',');
  sub->add_flag("!--no-compare-mpi", a.compare_mpi, "do not time the bare MPI calls beside ours");
  sub->add_option("--json", a.json, "also write one JSON object per result line to this file");
}

int run_check_command(const RunContext& ctx, const CheckArgs& args) {
  const MpiEnv& env = *ctx.env;
  const Config& cfg = ctx.config;
  const CheckPlan plan = check_plan(env, cfg, args);
  MeshOptions mo;
  mo.device = rank_device(env, args.device.empty() ? cfg.comm.device : args.device);
  mo.backend = args.backend.empty() ? cfg.comm.backend : args.backend;
  mo.group_names = plan.groups;
  DeviceMesh mesh = DeviceMesh::create(plan.dims, mo);
  std::string table = mesh.table();
  if (env.rank() == 0) std::printf("%s\n", table.c_str());
  std::vector<Group*> groups = groups_to_check(mesh, plan.groups);
  const auto& ops = args.ops.empty() ? kAllOps : args.ops;
  std::ofstream json;
  if (env.rank() == 0 && !args.json.empty()) {
    json.open(args.json);
    MT_CHECK(json.good(), "check", "cannot write --json file '{}'", args.json);
  }
  int64_t failures = 0;
  for (Group* g : groups) {
    failures += check_values(*g, ops, mo.device);
    failures += time_ops(env, *g, ops, plan.sizes, args, mo.device, json);
  }
  const int64_t total = world::all_reduce(failures, ReduceOp::sum, "check failure count");
  if (env.rank() == 0)
    std::printf("\ncheck %s: %lld wrong result(s) over %zu group(s)\n", total ? "FAILED" : "passed", (long long)total,
                groups.size());
  return total ? 1 : 0;
}

Command check_command() {
  return command_with<CheckArgs>("check", "self-check: run and verify every collective on every mesh dim, timed",
      add_check_options, run_check_command);
}

}  // namespace mt
