#include "comm/mesh.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "comm/control.h"
#include "comm/mpi/mpi_group.h"
#include "comm/nccl/nccl_group.h"
#include "comm/watchdog.h"
#include "runtime/core/cuda_backend.h"
#include "runtime/core/error.h"

namespace mt {

std::vector<MeshDim> parse_mesh_spec(const std::string& spec, int world_size) {
  std::vector<MeshDim> dims;
  std::stringstream ss(spec);
  std::string part;
  int infer = -1;
  while (std::getline(ss, part, ',')) {
    auto eq = part.find('=');
    MT_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < part.size(), "mesh",
             "bad mesh dim '{}' in '{}' (expected name=size, e.g. dp_shard=2,tp=2)", part, spec);
    MeshDim d{part.substr(0, eq), 0};
    std::string v = part.substr(eq + 1);
    char* end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    MT_CHECK(end && *end == '\0' && (x >= 1 || x == -1), "mesh",
             "mesh dim '{}' has size '{}' (expected a positive integer, or -1 for the remaining ranks)", d.name, v);
    if (x == -1) {
      MT_CHECK(infer < 0, "mesh", "mesh '{}': only one dim may be -1", spec);
      infer = int(dims.size());
    }
    d.size = int(x);
    dims.push_back(d);
  }
  MT_CHECK(!dims.empty(), "mesh", "empty mesh spec");
  if (infer >= 0) {
    int known = 1;
    for (auto& d : dims)
      if (d.size > 0) known *= d.size;
    MT_CHECK(world_size % known == 0, "mesh",
             "mesh '{}': the other dims multiply to {}, which does not divide {} ranks", spec, known, world_size);
    dims[size_t(infer)].size = world_size / known;
  }
  validate_mesh_dims(dims, world_size);
  return dims;
}

void validate_mesh_dims(const std::vector<MeshDim>& dims, int world_size) {
  std::set<std::string> seen;
  long prod = 1;
  for (auto& d : dims) {
    MT_CHECK(!d.name.empty(), "mesh", "a mesh dim has an empty name");
    MT_CHECK(d.name != "world" && d.name.find(',') == std::string::npos, "mesh",
             "'{}' cannot name a mesh dim (it names a flattened group)", d.name);
    MT_CHECK(seen.insert(d.name).second, "mesh", "mesh dim '{}' appears twice", d.name);
    MT_CHECK(d.size >= 1, "mesh", "mesh dim '{}' has size {} (expected >= 1)", d.name, d.size);
    prod *= d.size;
  }
  MT_CHECK(prod == world_size, "mesh", "mesh {} has {} ranks but the job has {}", mesh_str(dims), prod, world_size);
}

std::string mesh_str(const std::vector<MeshDim>& dims) {
  std::string r;
  for (size_t i = 0; i < dims.size(); ++i) r += (i ? "," : "") + dims[i].name + "=" + std::to_string(dims[i].size);
  return r;
}

namespace {

// The first pair of ranks of one node that would use the same GPU, as "world ranks A and B share the GPU
// <PCI bus id>", or "" when every rank has its own (collective over the world; the same answer on every rank).
// NCCL cannot hold one GPU twice in a communicator, so such ranks talk through the MPI backend, which stages
// device buffers through the host (tests running several ranks on one GPU).
std::string shared_device(const Device& d) {
  constexpr int kId = 64;
  char mine[kId] = {0};
  std::snprintf(mine, kId, "%s", cuda::pci_bus_id(d.index).c_str());
  MPI_Comm node;
  int world_rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  {
    WatchdogScope w("MPI_Comm_split_type", "grouping the ranks of each node to compare their GPUs");
    MT_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node));
  }
  MPI_Comm_size(node, &n);
  std::vector<char> ids(size_t(n) * kId);
  std::vector<int> ranks(static_cast<size_t>(n));
  control_all_gather(node, ids.data(), mine, kId, MPI_CHAR, "GPU ids", "the ranks of this node");
  control_all_gather(node, ranks.data(), &world_rank, 1, MPI_INT, "GPU ranks", "the ranks of this node");
  MPI_Comm_free(&node);
  std::string what;
  for (int i = 0; i < n && what.empty(); ++i)
    for (int j = i + 1; j < n && what.empty(); ++j)
      if (std::string(&ids[size_t(i) * kId]) == std::string(&ids[size_t(j) * kId]))
        what = fmt::format("world ranks {} and {} share the GPU {}", ranks[size_t(i)], ranks[size_t(j)],
                           std::string(&ids[size_t(i) * kId]));
  int any = what.empty() ? 0 : 1;
  control_all_reduce(MPI_COMM_WORLD, &any, 1, MPI_INT, MPI_MAX, "GPU sharing");
  if (any && what.empty()) what = "ranks of another node share a GPU";
  return any ? what : std::string();
}

}  // namespace

namespace {

// A group of a simulated mesh: its ranks, no communicator.
class SimGroup final : public Group {
 public:
  SimGroup(std::string name, int rank, std::vector<int> world_ranks) : Group(std::move(name), rank, std::move(world_ranks)) {}
  std::string_view backend() const override { return "simulated"; }

 protected:
  [[noreturn]] void refuse(const char* op) const {
    fail("mesh", "{} on {}: the mesh is simulated (meshtrain estimate): nothing is communicated", op, describe());
  }
  Work do_all_reduce(const Tensor&, ReduceOp, bool) override { refuse("all_reduce"); }
  Work do_all_gather(const Tensor&, const Tensor&, bool) override { refuse("all_gather"); }
  Work do_all_gather_v(const Tensor&, const Tensor&, const std::vector<int64_t>&, bool) override {
    refuse("all_gather_v");
  }
  Work do_reduce_scatter(const Tensor&, const Tensor&, ReduceOp, bool) override { refuse("reduce_scatter"); }
  Work do_reduce_scatter_v(const Tensor&, const Tensor&, const std::vector<int64_t>&, ReduceOp, bool) override {
    refuse("reduce_scatter_v");
  }
  Work do_all_to_all(const Tensor&, const Tensor&, bool) override { refuse("all_to_all"); }
  Work do_all_to_all_v(const Tensor&, const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                       bool) override {
    refuse("all_to_all_v");
  }
  Work do_broadcast(const Tensor&, int, bool) override { refuse("broadcast"); }
  Work do_send(const Tensor&, int, bool, int, const std::string&) override { refuse("send"); }
  Work do_recv(const Tensor&, int, bool, int, const std::string&) override { refuse("recv"); }
  Work do_ring_shift(const Tensor&, const Tensor&, int, bool) override { refuse("ring_shift"); }
  void do_barrier() override { refuse("barrier"); }
};

}  // namespace

struct DeviceMesh::Impl {
  std::vector<MeshDim> dims;
  MeshOptions opts;
  std::string backend;  // resolved: mpi | nccl
  int world_rank = 0;
  std::vector<int> coord;
  std::vector<std::unique_ptr<Group>> dim_groups;
  std::mutex mu;
  MPI_Comm base = MPI_COMM_WORLD;  // the ranks the mesh covers (MeshOptions::base)
  std::vector<int> base_world_ranks;  // the job's rank of each of them (empty: the world itself)
  bool simulated = false;             // DeviceMesh::simulate: groups without communicators
  std::map<std::vector<int>, std::unique_ptr<Group>> flat_groups;  // by their dims (indices, ascending)
  std::vector<std::pair<std::string, Group*>> flat_order;         // the name each was asked for first

  std::vector<int> unravel(int r) const {
    std::vector<int> c(dims.size());
    for (size_t i = dims.size(); i-- > 0;) {
      c[i] = r % dims[i].size;
      r /= dims[i].size;
    }
    return c;
  }
  int ravel(const std::vector<int>& c) const {
    int r = 0;
    for (size_t i = 0; i < dims.size(); ++i) r = r * dims[i].size + c[i];
    return r;
  }

  // The group of ranks that differ from this one only in the dims `in`
  // (indices, in mesh order). Collective over the world.
  std::unique_ptr<Group> make_group(const std::vector<int>& in, const std::string& name) {
    std::vector<bool> member(dims.size(), false);
    for (int d : in) member[size_t(d)] = true;
    int color = 0, key = 0;
    for (size_t i = 0; i < dims.size(); ++i) {
      if (member[i]) key = key * dims[i].size + coord[i];
      else color = color * dims[i].size + coord[i];
    }
    // World ranks of the members, in group-rank (key) order.
    std::vector<int> ranks;
    int gsize = 1;
    for (int d : in) gsize *= dims[size_t(d)].size;
    for (int k = 0; k < gsize; ++k) {
      std::vector<int> c = coord;
      int rem = k;
      for (size_t j = in.size(); j-- > 0;) {
        int d = in[j];
        c[size_t(d)] = rem % dims[size_t(d)].size;
        rem /= dims[size_t(d)].size;
      }
      const int r = ravel(c);
      ranks.push_back(base_world_ranks.empty() ? r : base_world_ranks[size_t(r)]);
    }
    if (simulated) return std::make_unique<SimGroup>(name, key, ranks);
    MPI_Comm comm;
    {
      WatchdogScope w("MPI_Comm_split", fmt::format("making group '{}' of mesh {}", name, mesh_str(dims)));
      MT_MPI_CHECK(MPI_Comm_split(base, color, key, &comm));
    }
    if (backend == "nccl") return make_nccl_group(comm, name, ranks, opts.device.index);
    return make_mpi_group(comm, name, ranks);
  }
};

DeviceMesh DeviceMesh::create(const std::vector<MeshDim>& dims, const MeshOptions& opts) {
  MPI_Comm base = opts.base ? group_mpi_comm(*opts.base) : MPI_COMM_WORLD;
  int world = 0, rank = 0;
  MPI_Comm_size(base, &world);
  MPI_Comm_rank(base, &rank);
  validate_mesh_dims(dims, world);
  for (auto& g : opts.group_names)
    for (auto& d : dims)
      MT_CHECK(g.name != d.name, "mesh", "'{}' names both a mesh dim and a flattened group", d.name);
  DeviceMesh m;
  m.impl_ = std::make_shared<Impl>();
  auto& I = *m.impl_;
  I.dims = dims;
  I.opts = opts;
  I.world_rank = rank;
  I.coord = I.unravel(rank);
  I.base = base;
  if (opts.base) I.base_world_ranks = opts.base->world_ranks();
  if (opts.backend == "auto") {
    // NCCL on device buffers when every rank has its own GPU; ranks sharing one stage through MPI.
    I.backend = opts.device.is_cuda() && nccl_built() && shared_device(opts.device).empty() ? "nccl" : "mpi";
  } else {
    MT_CHECK(opts.backend == "mpi" || opts.backend == "nccl", "mesh",
             "unknown comm backend '{}' (expected auto, mpi or nccl)", opts.backend);
    MT_CHECK(opts.backend == "mpi" || opts.device.is_cuda(), "mesh", "the nccl backend needs device cuda (got {})",
             opts.device.str());
    if (opts.backend == "nccl" && nccl_built()) {
      std::string shared = shared_device(opts.device);
      MT_CHECK(shared.empty(), "mesh",
               "comm.backend nccl: {}, and NCCL needs one GPU per rank (use comm.backend auto or mpi, which stages "
               "device buffers through the host)",
               shared);
    }
    I.backend = opts.backend;
  }
  // Every rank arrives before the first group is made (MPI_Comm_split cannot
  // say who is missing; this barrier can).
  if (world > 1)
    control_barrier(base, "mesh creation",
                    opts.base ? opts.base->describe() : fmt::format("the world ({} ranks)", world));
  for (int d = 0; d < int(dims.size()); ++d) I.dim_groups.push_back(I.make_group({d}, dims[size_t(d)].name));
  return m;
}

DeviceMesh DeviceMesh::simulate(const std::vector<MeshDim>& dims, int rank, const MeshOptions& opts,
                                std::vector<int> world_ranks) {
  int64_t n = 1;
  for (auto& d : dims) {
    MT_CHECK(d.size >= 1, "mesh", "mesh dim '{}' has size {} (expected >= 1)", d.name, d.size);
    n *= d.size;
  }
  MT_CHECK(n <= (int64_t(1) << 30), "mesh", "a simulated mesh of {} ranks: too many", n);
  validate_mesh_dims(dims, int(n));
  MT_CHECK(rank >= 0 && rank < n, "mesh", "simulated rank {} of a mesh of {} ranks", rank, n);
  MT_CHECK(world_ranks.empty() || int64_t(world_ranks.size()) == n, "mesh", "{} world ranks for a mesh of {}",
           world_ranks.size(), n);
  DeviceMesh m;
  m.impl_ = std::make_shared<Impl>();
  auto& I = *m.impl_;
  I.dims = dims;
  I.opts = opts;
  I.opts.base = nullptr;
  I.backend = "simulated";
  I.simulated = true;
  I.world_rank = rank;
  I.coord = I.unravel(rank);
  I.base_world_ranks = std::move(world_ranks);
  for (int d = 0; d < int(dims.size()); ++d) I.dim_groups.push_back(I.make_group({d}, dims[size_t(d)].name));
  return m;
}

bool DeviceMesh::simulated() const { return impl_->simulated; }

int DeviceMesh::ndim() const { return int(impl_->dims.size()); }
const std::vector<MeshDim>& DeviceMesh::dims() const { return impl_->dims; }
int DeviceMesh::size() const {
  int p = 1;
  for (auto& d : impl_->dims) p *= d.size;
  return p;
}
int DeviceMesh::size(int dim) const {
  MT_CHECK(dim >= 0 && dim < ndim(), "mesh", "mesh dim {} out of range (mesh has {} dims)", dim, ndim());
  return impl_->dims[size_t(dim)].size;
}
bool DeviceMesh::has_dim(const std::string& name) const {
  for (auto& d : impl_->dims)
    if (d.name == name) return true;
  return false;
}
int DeviceMesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < impl_->dims.size(); ++i)
    if (impl_->dims[i].name == name) return int(i);
  fail("mesh", "mesh {} has no dim '{}'", mesh_str(impl_->dims), name);
}
const std::vector<int>& DeviceMesh::coordinate() const { return impl_->coord; }
int DeviceMesh::world_rank() const { return impl_->world_rank; }
std::vector<int> DeviceMesh::coordinate_of(int r) const { return impl_->unravel(r); }
int DeviceMesh::world_rank_of(const std::vector<int>& c) const { return impl_->ravel(c); }
std::string DeviceMesh::backend() const { return impl_->backend; }
Device DeviceMesh::device() const { return impl_->opts.device; }

Group& DeviceMesh::group(int dim) const {
  MT_CHECK(dim >= 0 && dim < ndim(), "mesh", "mesh dim {} out of range (mesh has {} dims)", dim, ndim());
  return *impl_->dim_groups[size_t(dim)];
}

Group& DeviceMesh::group(const std::string& name) const {
  auto& I = *impl_;
  for (size_t i = 0; i < I.dims.size(); ++i)
    if (I.dims[i].name == name) return *I.dim_groups[i];
  std::vector<int> in;
  const MeshGroupName* named = nullptr;
  for (auto& g : I.opts.group_names)
    if (g.name == name) named = &g;
  if (named) {
    for (auto& d : named->dims)
      if (has_dim(d)) in.push_back(dim_index(d));
  } else if (name == "world") {
    for (int d = 0; d < ndim(); ++d) in.push_back(d);
  } else {
    std::stringstream ss(name);
    std::string part;
    while (std::getline(ss, part, ',')) in.push_back(dim_index(part));
  }
  std::sort(in.begin(), in.end());
  MT_CHECK(!in.empty(), "mesh", "group '{}': none of its dims is in mesh {}", name, mesh_str(I.dims));
  MT_CHECK(std::adjacent_find(in.begin(), in.end()) == in.end(), "mesh", "group '{}' names a dim twice", name);
  if (in.size() == 1) return *I.dim_groups[size_t(in[0])];
  std::lock_guard lock(I.mu);
  if (auto it = I.flat_groups.find(in); it != I.flat_groups.end()) return *it->second;
  auto g = I.make_group(in, name);
  Group& ref = *g;
  I.flat_groups.emplace(in, std::move(g));
  I.flat_order.emplace_back(name, &ref);
  return ref;
}

std::vector<std::pair<std::string, Group*>> DeviceMesh::groups() const {
  std::vector<std::pair<std::string, Group*>> r;
  for (size_t i = 0; i < impl_->dims.size(); ++i) r.emplace_back(impl_->dims[i].name, impl_->dim_groups[i].get());
  std::lock_guard lock(impl_->mu);
  for (auto& [n, g] : impl_->flat_order) r.emplace_back(n, g);
  return r;
}

std::string DeviceMesh::table() const {
  auto& I = *impl_;
  constexpr int kLen = 64;
  char mine[2 * kLen] = {};
  std::snprintf(mine, kLen, "%s", process_host().c_str());
  std::snprintf(mine + kLen, kLen, "%s", I.opts.device.str().c_str());
  int world = size();
  std::vector<char> all(size_t(world) * 2 * kLen);
  control_gather(I.base, all.data(), mine, 2 * kLen, MPI_CHAR, 0, "mesh table");
  if (I.world_rank != 0) return {};
  std::string out = fmt::format("mesh {} ({} ranks, backend {})\n", mesh_str(I.dims), world, I.backend);
  std::string head = fmt::format("{:>5}  {:<24} {:<8}", "rank", "host", "device");
  for (auto& d : I.dims) head += fmt::format(" {:>12}", d.name);
  out += head + "\n";
  for (int r = 0; r < world; ++r) {
    auto c = I.unravel(r);
    std::string line = fmt::format("{:>5}  {:<24} {:<8}", r, std::string(&all[size_t(r) * 2 * kLen]),
                                   std::string(&all[size_t(r) * 2 * kLen + kLen]));
    for (int v : c) line += fmt::format(" {:>12}", v);
    out += line + "\n";
  }
  return out;
}

}  // namespace mt
