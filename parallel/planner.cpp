#include "parallel/planner.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <queue>
#include <unordered_map>

namespace mt {

std::string_view step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::all_gather:
      return "all_gather";
    case StepKind::all_reduce:
      return "all_reduce";
    case StepKind::reduce_scatter:
      return "reduce_scatter";
    case StepKind::all_to_all:
      return "all_to_all";
    case StepKind::local_chunk:
      return "local chunk";
    case StepKind::local_partial:
      return "local partial";
  }
  return "?";
}

std::vector<double> link_bandwidths(int mesh_ndim, const std::vector<double>& link_gbps) {
  if (!link_gbps.empty()) {
    MT_CHECK(int(link_gbps.size()) == mesh_ndim, "redistribute",
             "comm.link_gbps has {} entries for a mesh of {} dims (one per dim, outermost first)", link_gbps.size(),
             mesh_ndim);
    return link_gbps;
  }
  std::vector<double> g(static_cast<size_t>(mesh_ndim));
  double bw = 100;
  for (int m = mesh_ndim - 1; m >= 0; --m, bw /= 4) g[size_t(m)] = bw;
  return g;
}

Planner planner_from_name(const std::string& name) {
  if (name == "min-cost") return Planner::min_cost;
  if (name == "greedy") return Planner::greedy;
  fail("redistribute", "unknown planner '{}' (expected min-cost or greedy)", name);
}

bool same_layout(const DTensorSpec& a, const DTensorSpec& b) {
  return a.placements == b.placements && a.shard_order == b.shard_order;
}

namespace {

// The layout after mesh dim m changes to `to`: a shard leaving a tensor dim
// must be the last applied to it (only then is the change a collective over
// the dim's group); a new shard applies last to its tensor dim.
bool apply(const DTensorSpec& s, int m, const Placement& to, DTensorSpec& out) {
  const Placement& from = s.placements[size_t(m)];
  ShardOrder order = s.shard_order;
  if (from.is_shard()) {
    auto& ms = order[size_t(from.dim)];
    if (ms.empty() || ms.back() != m) return false;
    ms.pop_back();
  }
  if (to.is_shard()) order[size_t(to.dim)].push_back(m);
  out = s;
  out.placements[size_t(m)] = to;
  out.shard_order = std::move(order);
  return true;
}

int64_t local_numel_max(const DTensorSpec& s) { return shape_numel(s.local_shape(std::vector<int>(s.mesh.size(), 0))); }

PlanStep make_step(const DTensorSpec& s, int m, StepKind kind, const Placement& to, const DTensorSpec& after,
                   size_t elem_bytes, const std::vector<double>& gbps) {
  PlanStep st;
  st.mesh_dim = m;
  st.kind = kind;
  st.from = s.placements[size_t(m)];
  st.to = to;
  st.after = after;
  int n = s.mesh[size_t(m)].size;
  int64_t local = local_numel_max(s) * int64_t(elem_bytes);
  switch (kind) {
    case StepKind::all_gather:
      st.bytes_per_rank = local * (n - 1);
      break;
    case StepKind::all_reduce:
      st.bytes_per_rank = 2 * local * (n - 1) / n;
      break;
    case StepKind::reduce_scatter:
    case StepKind::all_to_all:
      st.bytes_per_rank = local * (n - 1) / n;
      break;
    default:
      st.bytes_per_rank = 0;
  }
  bool comm = kind != StepKind::local_chunk && kind != StepKind::local_partial && n > 1;
  st.cost_s = comm ? double(st.bytes_per_rank) / (gbps[size_t(m)] * 1e9) + kCollectiveLatencyS : 1e-12;
  return st;
}

void check_pair(const DTensorSpec& src, const DTensorSpec& dst) {
  bool same_mesh = src.mesh.size() == dst.mesh.size();
  for (size_t i = 0; same_mesh && i < src.mesh.size(); ++i)
    same_mesh = src.mesh[i].name == dst.mesh[i].name && src.mesh[i].size == dst.mesh[i].size;
  MT_CHECK(same_mesh, "redistribute", "source mesh {} and target mesh {} differ", mesh_str(src.mesh),
           mesh_str(dst.mesh));
  MT_CHECK(src.global_shape == dst.global_shape, "redistribute", "source shape {} and target shape {} differ",
           shape_str(src.global_shape), shape_str(dst.global_shape));
  for (int m = 0; m < src.mesh_ndim(); ++m) {
    const auto &a = src.placements[size_t(m)], &b = dst.placements[size_t(m)];
    MT_CHECK(!(a.is_partial() && b.is_partial() && a.op != b.op), "redistribute",
             "{} -> {} on mesh dim {} ('{}'): a partial value cannot change its reduction; reduce first "
             "(redistribute to R) and then partition",
             a.str(), b.str(), m, src.mesh[size_t(m)].name);
  }
}

// A compact identity of a layout: placements and shard order as raw bytes
// (the planner hashes many of these; formatting would dominate).
void append_layout(std::string& k, const DTensorSpec& s) {
  for (auto& p : s.placements) {
    k += char(p.kind);
    k += char(p.is_shard() ? p.dim : p.is_partial() ? int(p.op) : 0);
  }
  for (auto& ms : s.shard_order) {
    k += '|';
    for (int m : ms) k += char(m);
  }
}
std::string key_of(const DTensorSpec& s) {
  std::string k;
  k.reserve(32);
  append_layout(k, s);
  return k;
}

// The mesh dims the search need not move: a dim of size 1 whose placement is the same in src and dst and, when it
// shards a tensor dim, whose tensor dim only such dims shard, in the same order in both. Moving one costs a step and
// changes no local shape (a size-1 dim's chunk is the whole dim), so no bytes are saved; it never unblocks another
// dim (every dim before it in its shard order stays too, and any dim pushed later comes after it). The plan found
// without them is the plan found with them; without this rule the size-1 dims of a full mesh (dp, ep and cp of size
// 1 beside tp) multiply the states the search visits into the tens of thousands.
std::vector<bool> still_dims(const DTensorSpec& src, const DTensorSpec& dst) {
  const int nd = src.mesh_ndim();
  auto unchanged_one = [&](int m) {
    return src.mesh[size_t(m)].size == 1 && src.placements[size_t(m)] == dst.placements[size_t(m)];
  };
  std::vector<bool> still(size_t(nd), false);
  for (int m = 0; m < nd; ++m) {
    if (!unchanged_one(m)) continue;
    const Placement& p = src.placements[size_t(m)];
    if (!p.is_shard()) {
      still[size_t(m)] = true;
      continue;
    }
    const auto &a = src.shard_order[size_t(p.dim)], &b = dst.shard_order[size_t(p.dim)];
    still[size_t(m)] = a == b && std::all_of(a.begin(), a.end(), unchanged_one);
  }
  return still;
}

Plan min_cost_plan(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes, const std::vector<double>& gbps,
                   bool every_dim) {
  const std::vector<bool> still = every_dim ? std::vector<bool>{} : still_dims(src, dst);
  struct Node {
    double cost;
    int steps;
    std::string key;
    // Ties broken by the layout's key: the plan chosen depends on the graph alone, never on the order the search
    // met its nodes (so leaving still dims out cannot change it).
    bool operator>(const Node& o) const {
      return cost != o.cost ? cost > o.cost : steps != o.steps ? steps > o.steps : key > o.key;
    }
  };
  struct Seen {
    double cost;
    int steps;
    DTensorSpec spec;
    std::string prev;
    PlanStep step;
    bool done = false;
  };
  std::unordered_map<std::string, Seen> seen;
  std::priority_queue<Node, std::vector<Node>, std::greater<Node>> pq;
  std::string start = key_of(src);
  seen.emplace(start, Seen{0, 0, src, "", {}, false});
  pq.push({0, 0, start});
  while (!pq.empty()) {
    Node n = pq.top();
    pq.pop();
    Seen& cur = seen.at(n.key);
    if (cur.done) continue;
    cur.done = true;
    if (same_layout(cur.spec, dst)) {
      Plan p;
      p.src = src;
      p.dst = dst;
      p.planner = "min-cost";
      for (std::string k = n.key; k != start; k = seen.at(k).prev) p.steps.push_back(seen.at(k).step);
      std::reverse(p.steps.begin(), p.steps.end());
      return p;
    }
    DTensorSpec spec = cur.spec;  // copy: `cur` may move when the map grows
    double base = cur.cost;
    int steps = cur.steps;
    for (auto& st : next_steps(spec, dst, elem_bytes, gbps, still)) {
      std::string k = key_of(st.after);
      double c = base + st.cost_s;
      auto it = seen.find(k);
      // Better: cheaper, then fewer steps, then a smaller predecessor (every predecessor on an optimal path is
      // cheaper, so all of them are relaxed before the node is taken).
      if (it == seen.end() ||
          (!it->second.done &&
           (c < it->second.cost ||
            (c == it->second.cost &&
             (steps + 1 < it->second.steps || (steps + 1 == it->second.steps && n.key < it->second.prev)))))) {
        seen.insert_or_assign(k, Seen{c, steps + 1, st.after, n.key, st, false});
        pq.push({c, steps + 1, k});
      }
    }
  }
  fail("redistribute", "no path from {} to {} on mesh {}", src.str(), dst.str(), mesh_str(src.mesh));
}

// DTensor-style fixed phases: undo shards innermost-first (all-to-all when the
// target shards another dim), reduce partials, then chunk and partition.
bool greedy_plan(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes, const std::vector<double>& gbps,
                 Plan& plan) {
  DTensorSpec cur = src;
  auto settled = [&](int m) {
    const Placement& p = cur.placements[size_t(m)];
    if (!(p == dst.placements[size_t(m)])) return false;
    if (!p.is_shard()) return true;
    auto& a = cur.shard_order[size_t(p.dim)];
    auto& b = dst.shard_order[size_t(p.dim)];
    size_t pos = size_t(std::find(a.begin(), a.end(), m) - a.begin());
    return pos < b.size() && std::equal(a.begin(), a.begin() + long(pos) + 1, b.begin());
  };
  auto step = [&](int m, StepKind kind, const Placement& to) {
    DTensorSpec next;
    if (!apply(cur, m, to, next)) return false;
    plan.steps.push_back(make_step(cur, m, kind, to, next, elem_bytes, gbps));
    cur = next;
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (int m = cur.mesh_ndim() - 1; m >= 0; --m) {
      const Placement p = cur.placements[size_t(m)];
      if (!p.is_shard() || settled(m)) continue;
      const Placement& t = dst.placements[size_t(m)];
      bool a2a = t.is_shard() && t.dim != p.dim;
      if (step(m, a2a ? StepKind::all_to_all : StepKind::all_gather, a2a ? t : Placement::Replicate())) changed = true;
    }
  }
  for (int m = 0; m < cur.mesh_ndim(); ++m) {
    const Placement p = cur.placements[size_t(m)], t = dst.placements[size_t(m)];
    if (!p.is_partial() || p == t) continue;
    if (t.is_shard()) step(m, StepKind::reduce_scatter, t);
    else step(m, StepKind::all_reduce, Placement::Replicate());
  }
  for (int m = 0; m < cur.mesh_ndim(); ++m) {
    const Placement p = cur.placements[size_t(m)], t = dst.placements[size_t(m)];
    if (!p.is_replicate() || t.is_replicate()) continue;
    step(m, t.is_shard() ? StepKind::local_chunk : StepKind::local_partial, t);
  }
  plan.planner = "greedy";
  return same_layout(cur, dst);
}

}  // namespace

std::vector<PlanStep> next_steps(const DTensorSpec& s, const DTensorSpec& target, size_t elem_bytes,
                                 const std::vector<double>& gbps, const std::vector<bool>& still) {
  std::vector<PlanStep> out;
  int nd = s.tensor_ndim();
  auto add = [&](int m, StepKind kind, const Placement& to) {
    DTensorSpec next;
    if (apply(s, m, to, next)) out.push_back(make_step(s, m, kind, to, next, elem_bytes, gbps));
  };
  for (int m = 0; m < s.mesh_ndim(); ++m) {
    if (!still.empty() && still[size_t(m)]) continue;
    const Placement& p = s.placements[size_t(m)];
    if (p.is_shard()) {
      add(m, StepKind::all_gather, Placement::Replicate());
      for (int b = 0; b < nd; ++b)
        if (b != p.dim) add(m, StepKind::all_to_all, Placement::Shard(b));
    } else if (p.is_partial()) {
      add(m, StepKind::all_reduce, Placement::Replicate());
      for (int b = 0; b < nd; ++b) add(m, StepKind::reduce_scatter, Placement::Shard(b));
    } else {
      for (int b = 0; b < nd; ++b) add(m, StepKind::local_chunk, Placement::Shard(b));
      // Partitioning only ever serves a target that is partial on this dim.
      const Placement& t = target.placements[size_t(m)];
      if (t.is_partial()) add(m, StepKind::local_partial, t);
    }
  }
  return out;
}

Plan plan_redistribute_uncached(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes,
                                const std::vector<double>& link_gbps, Planner planner) {
  check_pair(src, dst);
  auto gbps = link_bandwidths(src.mesh_ndim(), link_gbps);
  Plan p;
  p.src = src;
  p.dst = dst;
  if (planner != Planner::greedy || !greedy_plan(src, dst, elem_bytes, gbps, p)) {
    p = min_cost_plan(src, dst, elem_bytes, gbps, planner == Planner::min_cost_every_dim);
  }
  for (auto& st : p.steps) {
    p.cost_s += st.cost_s;
    p.bytes_per_rank += st.bytes_per_rank;
  }
  return p;
}

namespace {
struct Cache {
  std::mutex mu;
  std::unordered_map<std::string, Plan> plans;
};
Cache& cache() {
  static Cache c;
  return c;
}
}  // namespace

const Plan& plan_redistribute(const DTensorSpec& src, const DTensorSpec& dst, size_t elem_bytes,
                              const std::vector<double>& link_gbps, Planner planner) {
  std::string key;
  key.reserve(128);
  auto raw = [&key](const auto& v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (auto& d : src.mesh) {
    key += d.name;
    raw(d.size);
  }
  append_layout(key, src);
  key += ';';
  append_layout(key, dst);
  for (int64_t x : src.global_shape) raw(x);
  raw(elem_bytes);
  raw(planner);
  for (double g : link_gbps) raw(g);
  auto& c = cache();
  std::lock_guard lock(c.mu);
  auto it = c.plans.find(key);
  if (it != c.plans.end()) return it->second;
  return c.plans.emplace(key, plan_redistribute_uncached(src, dst, elem_bytes, link_gbps, planner)).first->second;
}

void clear_plan_cache() {
  std::lock_guard lock(cache().mu);
  cache().plans.clear();
}
size_t plan_cache_size() {
  std::lock_guard lock(cache().mu);
  return cache().plans.size();
}

std::string Plan::chain() const {
  std::string r = src.str();
  for (auto& st : steps) r += " -> " + st.after.str();
  return r;
}

std::string Plan::str() const {
  std::string r = fmt::format("{}  ({} planner, {} step(s), {} bytes sent per rank, est. {:.3g} s)\n", chain(), planner,
                              steps.size(), bytes_per_rank, cost_s);
  for (size_t i = 0; i < steps.size(); ++i) {
    auto& st = steps[i];
    r += fmt::format("  {}. mesh dim {} ('{}'): {} -> {}  {}  {} bytes/rank\n", i + 1, st.mesh_dim,
                     src.mesh[size_t(st.mesh_dim)].name, st.from.str(), st.to.str(), step_kind_name(st.kind),
                     st.bytes_per_rank);
  }
  return r;
}

}  // namespace mt
