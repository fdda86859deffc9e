// meshtrain layout: where each rank's shard of a tensor lives under a layout,
// the plan to another layout (steps, collectives, bytes), and, run with as
// many ranks as the mesh has, the plan executed and checked on a tensor whose
// elements are their own global index.
#include "runtime/cli/command.h"
#include <string>
#include <CLI/CLI.hpp>

#include <filesystem>
#include <sstream>

#include "comm/world.h"
#include "parallel/dtensor.h"
#include "runtime/io/npy.h"

namespace mt {

struct LayoutArgs {
  std::string mesh, shape, from, to, planner = "min-cost", dump, dtype = "f32";
};


namespace {

Shape parse_shape(const std::string& s) {
  Shape r;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    char* end = nullptr;
    long long v = std::strtoll(part.c_str(), &end, 10);
    MT_CHECK(!part.empty() && *end == '\0' && v >= 0, "layout", "bad --shape '{}' (expected sizes like 7,5)", s);
    r.push_back(v);
  }
  MT_CHECK(!r.empty(), "layout", "empty --shape");
  return r;
}

std::string shards_table(const DTensorSpec& spec) {
  std::string out =
      fmt::format("{} of global shape {} on mesh {}\n{:>5}  {:<14} {:<16} {:<16}\n", spec.str(),
                  shape_str(spec.global_shape), mesh_str(spec.mesh), "rank", "coordinate", "local shape", "offset");
  int world = 1;
  for (auto& d : spec.mesh) world *= d.size;
  for (int r = 0; r < world; ++r) {
    auto c = mesh_coordinate(spec.mesh, r);
    out += fmt::format("{:>5}  {:<14} {:<16} {:<16}\n", r, fmt::format("({})", fmt::join(c, ",")),
                       shape_str(spec.local_shape(c)), shape_str(spec.local_offset(c)));
  }
  return out;
}

}  // namespace

void add_layout_options(CLI::App* sub, LayoutArgs& a) {
  sub->add_option("--mesh", a.mesh, "mesh dims, e.g. dp_shard=2,tp=2")->required();
  sub->add_option("--shape", a.shape, "global tensor shape, e.g. 7,5")->required();
  sub->add_option("--from", a.from, "source placements, e.g. \"S(0),R\"")->required();
  sub->add_option("--to", a.to, "target placements: print the plan (and run it under mpirun)");
  sub->add_option("--planner", a.planner, "min-cost or greedy")->capture_default_str();
  sub->add_option("--dump", a.dump, "write each rank's shard before and after as DIR/rank<r>_{src,dst}.npy");
  sub->add_option("--dtype", a.dtype, "element type of the executed tensor")->capture_default_str();
}

int run_layout_command(const RunContext& ctx, const LayoutArgs& a) {
  const MpiEnv& env = *ctx.env;
  // One rank can print any layout; executing needs one rank per mesh position.
  int mesh_world = env.size();
  if (env.size() == 1) {
    // Printing only: the mesh's own sizes decide (every size must be given).
    MT_CHECK(a.mesh.find("-1") == std::string::npos, "layout",
             "--mesh {}: with one rank every size must be given (-1 needs the job's rank count)", a.mesh);
    std::stringstream ss(a.mesh);
    std::string part;
    mesh_world = 1;
    while (std::getline(ss, part, ','))
      if (auto eq = part.find('='); eq != std::string::npos)
        mesh_world *= std::max(1, std::atoi(part.c_str() + eq + 1));
  }
  auto dims = parse_mesh_spec(a.mesh, mesh_world);
  Shape shape = parse_shape(a.shape);
  DTensorSpec src = DTensorSpec::make(dims, parse_placements(a.from), shape);
  Planner planner = planner_from_name(a.planner);
  DType dtype = dtype_from_name(a.dtype);
  bool rank0 = env.rank() == 0;
  if (rank0) std::printf("%s", shards_table(src).c_str());
  std::optional<DTensorSpec> dst;
  if (!a.to.empty()) {
    dst = DTensorSpec::make(dims, parse_placements(a.to), shape);
    if (rank0) {
      std::printf("\n%s", shards_table(*dst).c_str());
      const Plan& plan = plan_redistribute(src, *dst, dtype_size(dtype), ctx.config.comm.link_gbps, planner);
      std::printf("\nplan: %s", plan.str().c_str());
    }
  }
  if (env.size() != mesh_world) {
    if (rank0) std::printf("\n(not executed: run under mpirun -np %d to execute and check the plan)\n", mesh_world);
    return 0;
  }

  MeshOptions mo;
  mo.device = rank_device(env, ctx.config.comm.device);
  mo.backend = ctx.config.comm.backend;
  DeviceMesh mesh = DeviceMesh::create(dims, mo);
  std::vector<double> idx(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = double(i);
  Tensor global = from_values(idx, shape, dtype).to(mo.device);
  DTensor x = distribute_tensor(global, mesh, src.placements, std::nullopt, src.shard_order);
  DTensor y = dst ? redistribute(x, *dst, {planner, ctx.config.comm.link_gbps}) : x;
  // What this rank must hold: the target layout made straight from the global tensor.
  DTensorSpec want_spec = dst ? *dst : src;
  DTensor want = distribute_tensor(global, mesh, want_spec.placements, std::nullopt, want_spec.shard_order);
  auto got = to_f64(y.local), exp = to_f64(want.local);
  int64_t bad = got.size() == exp.size() ? 0 : 1;
  for (size_t i = 0; !bad && i < got.size(); ++i)
    if (std::abs(got[i] - exp[i]) > 1e-6 * std::max(1.0, std::abs(exp[i]))) ++bad;
  if (!a.dump.empty()) {
    std::filesystem::create_directories(a.dump);
    write_npy(fmt::format("{}/rank{}_src.npy", a.dump, env.rank()), x.local);
    write_npy(fmt::format("{}/rank{}_dst.npy", a.dump, env.rank()), y.local);
  }
  const int64_t total = world::all_reduce(bad, ReduceOp::sum, "layout error count");
  if (rank0) {
    std::printf("\nexecuted on %d ranks (%s backend): %s\n", env.size(), mesh.backend().c_str(),
                total ? fmt::format("WRONG on {} rank(s)", total).c_str() : "every rank's shard is correct");
    if (!a.dump.empty()) std::printf("shards written to %s/rank<r>_{src,dst}.npy\n", a.dump.c_str());
  }
  return total ? 1 : 0;
}

Command layout_command() {
  return command_with<LayoutArgs>("layout", "print the local shards of a layout and the plan between two layouts",
      add_layout_options, run_layout_command);
}

}  // namespace mt
