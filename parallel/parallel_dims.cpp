#include "parallel/parallel_dims.h"

#include <algorithm>

#include "runtime/core/error.h"

namespace mt {

CpLoadBalance cp_load_balance_from_name(const std::string& s, const std::string& key) {
  if (s == "none") return CpLoadBalance::none;
  if (s == "head_tail") return CpLoadBalance::head_tail;
  fail("config",
       "{} = '{}': expected head_tail (the sequence in 2 x cp chunks, rank r holding chunks r and "
       "2 cp - 1 - r) or none (contiguous)",
       key, s);
}

CpMethod cp_method_from_name(const std::string& s, const std::string& key) {
  if (s == "ring") return CpMethod::ring;
  if (s == "all_gather") return CpMethod::all_gather;
  fail("config",
       "{} = '{}': expected ring (K/V passed around the cp ranks, overlapped with compute) or "
       "all_gather (K/V gathered once per layer, dK/dV reduce-scattered)",
       key, s);
}

std::string cp_load_balance_name(CpLoadBalance lb) { return lb == CpLoadBalance::none ? "none" : "head_tail"; }
std::string cp_method_name(CpMethod m) { return m == CpMethod::ring ? "ring" : "all_gather"; }

namespace {

// The descriptors, outermost first: the one list of the mesh's dims.
std::vector<DimSpec> dim_specs() {
  // name, size, batch, sequence, heads, shards_params, data, what
  DimSpec dp_replicate{dim::dp_replicate, 1, true, false, false, false, true, "batch"};
  DimSpec dp_shard{dim::dp_shard, 1, true, false, false, true, true, "batch, parameters sharded"};
  // Expert parallel: its ranks hold other experts and, for every other parameter, are data parallel (they see
  // other rows of the batch; dense gradients are summed over them, experts' are not: MoeContext).
  DimSpec ep{dim::ep, 1, true, false, false, false, true, "batch, experts split"};
  DimSpec cp_ring{dim::cp_ring, 1, false, true, false, false, true, "sequence"};
  DimSpec cp_ulysses{dim::cp_ulysses, 1, false, true, false, false, true, "sequence, heads inside attention (alltoall)"};
  DimSpec tp{dim::tp, 1, false, false, true, false, false, "heads"};
  return {dp_replicate, dp_shard, ep, cp_ring, cp_ulysses, tp};
}

// The sizes alone (each >= 1 or -1, one -1 at most; cp_ring, cp_ulysses >= 0).
void check_parallel_sizes(const ParallelConfig& p) {
  std::string inferred;
  int n_inferred = 0;
  for (auto [key, v] :
       {std::pair{"dp_replicate", p.dp_replicate}, {"dp_shard", p.dp_shard}, {"cp", p.cp}, {"tp", p.tp}}) {
    if (v == -1) inferred += (n_inferred++ ? ", " : "") + std::string(key);
    else if (v < 1) fail("config", "parallel.{} = {}: expected a size >= 1, or -1 for the remaining ranks", key, v);
  }
  if (n_inferred > 1) {
    // dp_replicate is -1 by default, so "dp_shard: -1" alone trips this; say so.
    bool default_dp = p.dp_replicate == -1;
    fail("config", "parallel: only one of dp_replicate, dp_shard, cp, tp may be -1, but {} are{}", inferred,
         default_dp ? " (dp_replicate is -1 by default: set it to 1)" : "");
  }
  if (p.ep < 1) fail("config", "parallel.ep = {}: expected a size >= 1 (expert parallel)", p.ep);
  for (auto [key, v] : {std::pair{"cp_ring", p.cp_ring}, {"cp_ulysses", p.cp_ulysses}})
    if (v < 0)
      fail("config", "parallel.{} = {}: expected a size >= 1 (0 or absent: derived from parallel.cp and cp_method)",
           key, v);
}

// The config's size keys with -1 (the remaining ranks) allowed on one of them.
struct SizeKey {
  const char* key;
  int value;
};

// cp from its keys: with cp_ring and cp_ulysses both given, their product (parallel.cp, when set, must be it).
int cp_degree(const ParallelConfig& p) {
  if (p.cp_ring == 0 || p.cp_ulysses == 0) return p.cp;
  const int prod = p.cp_ring * p.cp_ulysses;
  if (p.cp > 1 && p.cp != prod)
    fail("config",
         "parallel.cp_ulysses x parallel.cp_ring = {} x {} = {}, but parallel.cp = {}: cp is their product (set it "
         "to {} or leave it out)",
         p.cp_ulysses, p.cp_ring, prod, p.cp, prod);
  return prod;
}

// The sizes of one stage's dims (world_size: a stage's ranks), the -1 among them resolved; their product must be
// the stage's ranks.
void resolve_sizes(std::vector<SizeKey>& keys, const ParallelConfig& p, int world_size) {
  const int full_world = world_size * p.pp;
  int infer = -1;
  int64_t known = 1;  // 64 bits: sizes typed by hand may overflow an int product
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].value == -1) infer = int(i);
    else known *= keys[i].value;
  }
  if (infer >= 0) {
    if (world_size % known != 0)
      fail("config", "parallel.{} = -1: the other sizes multiply to {}, which does not divide the job's {} ranks{}",
           keys[size_t(infer)].key, known, world_size,
           p.pp > 1 ? fmt::format(" per pipeline stage ({} / parallel.pp = {})", full_world, p.pp) : "");
    keys[size_t(infer)].value = int(world_size / known);
  }
  int64_t prod = 1;
  std::string product, factors;
  for (auto& k : keys) {
    prod *= k.value;
    if (std::string(k.key) == "ep" && k.value == 1) continue;  // named only when set: a dense run's message as before
    product += (product.empty() ? "" : "*") + std::string(k.key);
    factors += (factors.empty() ? "" : "*") + std::to_string(k.value);
  }
  if (prod == world_size) return;
  if (p.pp > 1)
    fail("config", "parallel: pp*{} = {}*{} = {} but the job has {} ranks", product, p.pp, factors, prod * p.pp,
         full_world);
  fail("config", "parallel: {} = {} = {} but the job has {} ranks", product, factors, prod, world_size);
}

// cp's degree over its two dims (ring, ulysses): cp_method alltoall puts it on cp_ulysses; otherwise on cp_ring,
// unless cp_ring or cp_ulysses is given (0: derived).
std::pair<int, int> split_cp(const ParallelConfig& p, int cp, bool alltoall) {
  int ring = 1, ulysses = 1;
  if (p.cp_ring > 0 && p.cp_ulysses > 0) {
    ring = p.cp_ring, ulysses = p.cp_ulysses;
  } else if (p.cp_ring > 0 || p.cp_ulysses > 0) {
    const bool r = p.cp_ring > 0;
    const int given = r ? p.cp_ring : p.cp_ulysses;
    if (cp % given != 0)
      fail("config", "parallel.{} = {} does not divide parallel.cp = {} (cp = cp_ulysses x cp_ring)",
           r ? "cp_ring" : "cp_ulysses", given, cp);
    ring = r ? given : cp / given;
    ulysses = r ? cp / given : given;
  } else if (alltoall) {
    ulysses = cp;
  } else {
    ring = cp;
  }
  if (alltoall && ring > 1)
    fail("config",
         "parallel.cp_method = alltoall puts all of parallel.cp on Ulysses, but parallel.cp_ring = {}: with "
         "cp_ring and cp_ulysses set, cp_method names the ring dim's method (ring or all_gather)",
         ring);
  return {ring, ulysses};
}

}  // namespace

ParallelDims::ParallelDims()
    : pp{dim::pp, 1, false, false, false, false, false, "layers (pipeline stages)"}, dims(dim_specs()) {
  pp.stages = true;
}

ParallelDims ParallelDims::from_sizes(const std::vector<std::pair<std::string, int>>& sizes) {
  ParallelDims pd;
  for (auto& [name, n] : sizes) {
    MT_CHECK(n >= 1, "parallel", "dim {} has size {} (expected >= 1)", name, n);
    if (name == dim::pp) pd.pp.size = n;
    else pd.dims[size_t(pd.index(name))].size = n;
  }
  return pd;
}

ParallelDims ParallelDims::from_config(const ParallelConfig& p, int world_size) {
  // The names were checked with the config (their constraints in ParallelConfig::visit); the sizes are here, where
  // -1 means the ranks the others leave.
  const bool alltoall = p.cp_method == "alltoall";
  check_parallel_sizes(p);
  if (p.pp < 1) fail("config", "parallel.pp = {}: expected a size >= 1 (pipeline stages)", p.pp);
  if (world_size % p.pp != 0)
    fail("config", "parallel.pp = {} does not divide the job's {} ranks (each stage needs world / pp ranks)", p.pp,
         world_size);
  // The other dims split each stage's ranks.
  std::vector<SizeKey> keys{
      {"dp_replicate", p.dp_replicate}, {"dp_shard", p.dp_shard}, {"cp", cp_degree(p)}, {"tp", p.tp}, {"ep", p.ep}};
  resolve_sizes(keys, p, world_size / p.pp);
  const auto [ring, ulysses] = split_cp(p, keys[2].value, alltoall);
  ParallelDims pd = from_sizes({{dim::dp_replicate, keys[0].value},
                                {dim::dp_shard, keys[1].value},
                                {dim::ep, keys[4].value},
                                {dim::cp_ring, ring},
                                {dim::cp_ulysses, ulysses},
                                {dim::tp, keys[3].value}});
  pd.pp.size = p.pp;
  pd.sequence_parallel = p.sequence_parallel;
  pd.cp_method = alltoall ? CpMethod::ring : cp_method_from_name(p.cp_method, "parallel.cp_method");
  pd.cp_load_balance = cp_load_balance_from_name(p.cp_load_balance, "parallel.cp_load_balance");
  return pd;
}

int ParallelDims::index(const std::string& name) const {
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i].name == name) return int(i);
  fail("parallel", "no mesh dim '{}' (the dims are dp_replicate, dp_shard, ep, cp_ring, cp_ulysses, tp)", name);
}

int ParallelDims::stage_size() const {
  int w = 1;
  for (auto& d : dims) w *= d.size;
  return w;
}
int ParallelDims::world() const { return pp.size * stage_size(); }
int ParallelDims::dp() const {
  int n = 1;
  for (auto& d : dims)
    if (d.batch) n *= d.size;
  return n;
}
int ParallelDims::cp() const {
  int n = 1;
  for (auto& d : dims)
    if (d.sequence) n *= d.size;
  return n;
}

std::vector<MeshDim> ParallelDims::mesh_dims() const {
  std::vector<MeshDim> m;
  for (auto& d : dims) m.push_back({d.name, d.size});
  return m;
}

std::vector<MeshGroupName> ParallelDims::group_names() const {
  MeshGroupName dp{dim::dp, {}}, cp{dim::cp, {}}, dp_cp{dim::dp_cp, {}}, loss{dim::loss, {}};
  for (auto& d : dims) {
    if (d.batch) dp.dims.push_back(d.name);
    if (d.sequence) cp.dims.push_back(d.name);
    if (d.data) dp_cp.dims.push_back(d.name), loss.dims.push_back(d.name);
  }
  return {dp, cp, dp_cp, loss};
}

DeviceMesh ParallelDims::make_mesh(const MeshOptions& opts) const { return make_meshes(opts).stage; }

ParallelDims::Meshes ParallelDims::make_meshes(const MeshOptions& opts) const {
  MeshOptions o = opts;
  o.group_names = group_names();
  auto with_groups = [&](DeviceMesh mesh) {
    // The flattened groups training uses, made now on every rank in the same order (making one is collective).
    for (auto& g : o.group_names) mesh.group(g.name);
    return mesh;
  };
  if (pp.size == 1) {
    DeviceMesh m = with_groups(DeviceMesh::create(mesh_dims(), o));
    return {m, m};
  }
  std::vector<MeshDim> all{{pp.name, pp.size}};
  for (auto& d : mesh_dims()) all.push_back(d);
  MeshOptions w = opts;
  DeviceMesh world = DeviceMesh::create(all, w);
  world.group(dim::pp);
  // The stage's ranks: every dim but pp, flattened (collective over the world), then the stage mesh over them.
  std::string inner;
  for (auto& d : dims) inner += (inner.empty() ? "" : ",") + d.name;
  o.base = &world.group(inner);
  return {world, with_groups(DeviceMesh::create(mesh_dims(), o))};
}

ParallelDims::Meshes ParallelDims::simulate_meshes(int world_rank) const {
  MeshOptions o;
  o.group_names = group_names();
  auto with_groups = [&](DeviceMesh mesh) {
    for (auto& g : o.group_names) mesh.group(g.name);
    return mesh;
  };
  if (pp.size == 1) {
    DeviceMesh m = with_groups(DeviceMesh::simulate(mesh_dims(), world_rank, o));
    return {m, m};
  }
  std::vector<MeshDim> all{{pp.name, pp.size}};
  for (auto& d : mesh_dims()) all.push_back(d);
  DeviceMesh world = DeviceMesh::simulate(all, world_rank, {});
  const int S = stage_size(), stage = world_rank / S;
  std::vector<int> ranks(static_cast<size_t>(S));
  for (int i = 0; i < S; ++i) ranks[size_t(i)] = stage * S + i;
  return {world, with_groups(DeviceMesh::simulate(mesh_dims(), world_rank % S, o, ranks))};
}

int ParallelDims::dp_rank(const DeviceMesh& mesh) const {
  int r = 0;
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i].batch) r = r * dims[i].size + mesh.coordinate(int(i));
  return r;
}

std::vector<int> ParallelDims::grad_partial_dims() const {
  std::vector<int> out;
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i].data) out.push_back(int(i));
  return out;
}

Placement ParallelDims::activation_placement(int mesh_dim) const {
  const DimSpec& d = dims.at(size_t(mesh_dim));
  if (d.batch) return Placement::Shard(0);     // batch rows
  if (d.sequence) return Placement::Shard(1);  // the sequence
  return Placement::Replicate();
}

Placement ParallelDims::activation_placement(const std::string& dim_name) {
  const ParallelDims pd;
  for (size_t i = 0; i < pd.dims.size(); ++i)
    if (pd.dims[i].name == dim_name) return pd.activation_placement(int(i));
  return Placement::Replicate();
}

int64_t ParallelDims::seq_multiple() const {
  const int ring = cp_ring();
  int64_t parts = ring > 1 && cp_load_balance == CpLoadBalance::head_tail ? 2 * int64_t(ring) : ring;
  return parts * cp_ulysses() * (sequence_parallel && tp() > 1 ? tp() : 1);
}

void ParallelDims::check_seq_len(int64_t seq_len) const {
  if (seq_len % seq_multiple() == 0) return;
  std::vector<std::string> why;
  const int ring = cp_ring(), ulysses = cp_ulysses();
  // With one cp dim the user wrote parallel.cp; with both, cp_ring and cp_ulysses.
  const bool two_d = ring > 1 && ulysses > 1;
  if (ring > 1) {
    std::string key = two_d ? "parallel.cp_ring" : "parallel.cp";
    why.push_back(cp_load_balance == CpLoadBalance::head_tail
                      ? fmt::format("{} = {} with cp_load_balance head_tail splits it into 2 x {} chunks", key, ring,
                                    ring)
                      : fmt::format("{} = {} splits it into {} parts", key, ring, ring));
  }
  if (ulysses > 1)
    why.push_back(two_d ? fmt::format("parallel.cp_ulysses = {} splits each of those into {}", ulysses, ulysses)
                        : fmt::format("parallel.cp = {} (alltoall) splits it into {} parts", ulysses, ulysses));
  if (sequence_parallel && tp() > 1)
    why.push_back(fmt::format("parallel.tp = {} with sequence_parallel splits each rank's part into {}", tp(), tp()));
  std::string s;
  for (size_t i = 0; i < why.size(); ++i) s += (i == 0 ? "" : i + 1 == why.size() ? ", and " : ", ") + why[i];
  fail("config", "training.seq_len = {} must be a multiple of {}: {}", seq_len, seq_multiple(), s);
}

void ParallelDims::check_heads(int64_t n_heads, int64_t n_kv_heads) const {
  const int t = tp(), u = cp_ulysses();
  if (n_heads % t != 0 || n_kv_heads % t != 0)
    fail("config",
         "model.n_heads = {} and model.n_kv_heads = {} must both be divisible by parallel.tp = {} "
         "(tensor parallel splits whole heads)",
         n_heads, n_kv_heads, t);
  if (u == 1) return;
  const std::string key = cp_ring() > 1 ? "parallel.cp_ulysses" : "parallel.cp";
  const int64_t h = n_heads / t, kv = n_kv_heads / t;
  if (h % u != 0)
    fail("config",
         "model.n_heads = {} over parallel.tp = {} leaves {} q heads per rank, which do not divide by {} = {} "
         "(Ulysses gives each rank whole heads)",
         n_heads, t, h, key, u);
  if (kv % u != 0 && u % kv != 0)
    fail("config",
         "model.n_kv_heads = {} over parallel.tp = {} leaves {} kv heads per rank, which is neither a multiple nor "
         "a divisor of {} = {} (Ulysses gives each rank whole kv heads, or one kv head shared by the ranks whose "
         "q heads use it); model.n_heads = {}",
         n_kv_heads, t, kv, key, u, n_heads);
}

std::string ParallelDims::describe() const {
  std::vector<std::string> parts;
  if (pp.size > 1) parts.push_back(fmt::format("{}={} ({})", pp.name, pp.size, pp.what));
  for (auto& d : dims) {
    if (d.size == 1) continue;
    std::string what = d.what;
    if (d.name == dim::cp_ring)
      what += fmt::format(": {}, {}", cp_load_balance_name(cp_load_balance), cp_method_name(cp_method));
    if (d.heads && sequence_parallel) what += ", sequence parallel";
    parts.push_back(fmt::format("{}={} ({})", d.name, d.size, what));
  }
  if (parts.empty()) return "1 rank";
  std::string s;
  for (auto& p : parts) s += (s.empty() ? "" : " x ") + p;
  return s;
}

}  // namespace mt
