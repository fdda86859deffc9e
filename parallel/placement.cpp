#include "parallel/placement.h"

#include <algorithm>
#include <cctype>

namespace mt {

std::string Placement::str() const {
  switch (kind) {
    case Kind::shard:
      return fmt::format("S({})", dim);
    case Kind::replicate:
      return "R";
    case Kind::partial:
      return fmt::format("P({})", reduce_op_name(op));
  }
  return "?";
}

ParsedPlacements parse_placements(const std::string& text) {
  ParsedPlacements r;
  size_t i = 0, n = text.size();
  auto bad = [&](const std::string& why) -> void {
    fail("placement", "cannot parse placements '{}' at position {}: {} (expected e.g. 'S(0),R' or 'P(sum)S(1)')", text,
         i, why);
  };
  auto read_paren = [&]() {
    if (i >= n || text[i] != '(') bad("expected '('");
    size_t close = text.find(')', i);
    if (close == std::string::npos) bad("missing ')'");
    std::string inner = text.substr(i + 1, close - i - 1);
    i = close + 1;
    return inner;
  };
  while (i < n) {
    char c = text[i];
    if (c == ',' || std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    Placement p;
    if (c == 'R') {
      ++i;
      p = Placement::Replicate();
    } else if (c == 'S') {
      ++i;
      std::string inner = read_paren();
      char* end = nullptr;
      long d = std::strtol(inner.c_str(), &end, 10);
      if (inner.empty() || *end != '\0') bad("shard dim '" + inner + "' is not an integer");
      p = Placement::Shard(int(d));
    } else if (c == 'P') {
      ++i;
      std::string inner = i < n && text[i] == '(' ? read_paren() : "sum";
      try {
        p = Placement::Partial(reduce_op_from_name(inner));
      } catch (const Error&) {
        bad("unknown partial op '" + inner + "' (sum, avg, max or min)");
      }
    } else {
      bad(std::string("unexpected '") + c + "'");
    }
    int mark = -1;
    if (i < n && text[i] == '[') {
      size_t close = text.find(']', i);
      if (close == std::string::npos) bad("missing ']'");
      std::string inner = text.substr(i + 1, close - i - 1);
      char* end = nullptr;
      long k = std::strtol(inner.c_str(), &end, 10);
      if (inner.empty() || *end != '\0' || k < 0) bad("shard order mark '[" + inner + "]' is not a position >= 0");
      if (!p.is_shard()) bad("only S(d) takes a shard order mark");
      mark = int(k);
      i = close + 1;
    }
    r.placements.push_back(p);
    r.order_marks.push_back(mark);
  }
  if (r.placements.empty()) fail("placement", "empty placements '{}'", text);
  return r;
}

Chunk chunk_of(int64_t size, int n, int k) {
  int64_t c = (size + n - 1) / n;
  int64_t begin = std::min<int64_t>(int64_t(k) * c, size);
  return {begin, std::min<int64_t>(c, size - begin)};
}

std::vector<int> mesh_coordinate(const std::vector<MeshDim>& mesh, int rank) {
  std::vector<int> c(mesh.size());
  for (size_t i = mesh.size(); i-- > 0;) {
    c[i] = rank % mesh[i].size;
    rank /= mesh[i].size;
  }
  return c;
}

int mesh_rank(const std::vector<MeshDim>& mesh, const std::vector<int>& coord) {
  int r = 0;
  for (size_t i = 0; i < mesh.size(); ++i) r = r * mesh[i].size + coord[i];
  return r;
}

DTensorSpec DTensorSpec::make(std::vector<MeshDim> mesh, Placements placements, Shape global_shape, ShardOrder order) {
  DTensorSpec s;
  s.mesh = std::move(mesh);
  s.global_shape = std::move(global_shape);
  int nd = int(s.global_shape.size());
  MT_CHECK(placements.size() == s.mesh.size(), "placement", "{} placements for a mesh of {} dims ({})",
           placements.size(), s.mesh.size(), mesh_str(s.mesh));
  for (auto& p : placements) {
    if (!p.is_shard()) continue;
    int d = p.dim < 0 ? p.dim + nd : p.dim;
    MT_CHECK(d >= 0 && d < nd, "placement", "S({}) on a tensor of shape {} (dims 0..{})", p.dim,
             shape_str(s.global_shape), nd - 1);
    p.dim = d;
  }
  s.placements = std::move(placements);
  if (order.empty()) {
    order.assign(size_t(nd), {});
    for (int m = 0; m < s.mesh_ndim(); ++m)
      if (s.placements[size_t(m)].is_shard()) order[size_t(s.placements[size_t(m)].dim)].push_back(m);
  }
  MT_CHECK(int(order.size()) == nd, "placement", "shard order has {} entries for a {}-dim tensor", order.size(), nd);
  // Every sharding mesh dim appears exactly once, under its tensor dim.
  std::vector<int> seen(s.mesh.size(), 0);
  for (int d = 0; d < nd; ++d)
    for (int m : order[size_t(d)]) {
      MT_CHECK(m >= 0 && m < s.mesh_ndim() && s.placements[size_t(m)].is_shard(d), "placement",
               "shard order lists mesh dim {} under tensor dim {}, but its placement is {}", m, d,
               m >= 0 && m < s.mesh_ndim() ? s.placements[size_t(m)].str() : "out of range");
      seen[size_t(m)]++;
    }
  for (int m = 0; m < s.mesh_ndim(); ++m)
    MT_CHECK(seen[size_t(m)] == (s.placements[size_t(m)].is_shard() ? 1 : 0), "placement",
             "shard order must list mesh dim {} ({}) exactly once", m, s.placements[size_t(m)].str());
  s.shard_order = std::move(order);
  return s;
}

DTensorSpec DTensorSpec::make(std::vector<MeshDim> mesh, const ParsedPlacements& parsed, Shape global_shape) {
  bool any = std::any_of(parsed.order_marks.begin(), parsed.order_marks.end(), [](int k) { return k >= 0; });
  if (!any) return make(std::move(mesh), parsed.placements, std::move(global_shape));
  DTensorSpec plain = make(mesh, parsed.placements, global_shape);  // normalises dims
  ShardOrder order(global_shape.size());
  for (size_t d = 0; d < order.size(); ++d) {
    auto& ms = plain.shard_order[d];
    if (ms.size() < 2) {
      order[d] = ms;
      continue;
    }
    std::vector<std::pair<int, int>> marked;
    for (int m : ms) {
      int k = parsed.order_marks[size_t(m)];
      MT_CHECK(k >= 0, "placement", "mesh dims {} all shard tensor dim {}: give each an order mark [k]",
               fmt::join(ms, ","), d);
      marked.emplace_back(k, m);
    }
    std::sort(marked.begin(), marked.end());
    for (size_t j = 0; j < marked.size(); ++j) {
      MT_CHECK(marked[j].first == int(j), "placement", "order marks of tensor dim {} must be 0..{}", d, ms.size() - 1);
      order[d].push_back(marked[j].second);
    }
  }
  return make(std::move(mesh), plain.placements, std::move(global_shape), order);
}

bool DTensorSpec::has_default_order() const {
  for (auto& ms : shard_order)
    if (!std::is_sorted(ms.begin(), ms.end())) return false;
  return true;
}

Shape DTensorSpec::local_shape(const std::vector<int>& coord) const {
  Shape s = global_shape;
  for (size_t d = 0; d < s.size(); ++d)
    for (int m : shard_order[d]) s[d] = chunk_of(s[d], mesh[size_t(m)].size, coord[size_t(m)]).len;
  return s;
}

Shape DTensorSpec::local_offset(const std::vector<int>& coord) const {
  Shape off(global_shape.size(), 0);
  for (size_t d = 0; d < off.size(); ++d) {
    int64_t size = global_shape[d];
    for (int m : shard_order[d]) {
      Chunk c = chunk_of(size, mesh[size_t(m)].size, coord[size_t(m)]);
      off[d] += c.begin;
      size = c.len;
    }
  }
  return off;
}

std::string DTensorSpec::str() const {
  std::string r;
  for (int m = 0; m < mesh_ndim(); ++m) {
    const Placement& p = placements[size_t(m)];
    r += p.str();
    if (p.is_shard() && shard_order[size_t(p.dim)].size() > 1) {
      auto& ms = shard_order[size_t(p.dim)];
      r += fmt::format("[{}]", std::find(ms.begin(), ms.end(), m) - ms.begin());
    }
  }
  return r;
}

bool DTensorSpec::operator==(const DTensorSpec& o) const {
  if (mesh.size() != o.mesh.size()) return false;
  for (size_t i = 0; i < mesh.size(); ++i)
    if (mesh[i].name != o.mesh[i].name || mesh[i].size != o.mesh[i].size) return false;
  return placements == o.placements && global_shape == o.global_shape && shard_order == o.shard_order;
}

DTensorSpec shard_param(const DTensorSpec& spec, int tensor_dim, const std::vector<int>& mesh_dims) {
  int nd = spec.tensor_ndim();
  int d = tensor_dim < 0 ? tensor_dim + nd : tensor_dim;
  MT_CHECK(d >= 0 && d < nd, "shard_param", "tensor dim {} out of range for shape {}", tensor_dim,
           shape_str(spec.global_shape));
  MT_CHECK(!mesh_dims.empty(), "shard_param", "no mesh dims given to shard tensor dim {} over", d);
  int64_t existing = 1, added = 1;
  std::string names;
  for (int m : spec.shard_order[size_t(d)]) existing *= spec.mesh[size_t(m)].size;
  for (int m : mesh_dims) {
    MT_CHECK(m >= 0 && m < spec.mesh_ndim(), "shard_param", "mesh dim {} out of range (mesh {})", m,
             mesh_str(spec.mesh));
    MT_CHECK(spec.placements[size_t(m)].is_replicate(), "shard_param",
             "mesh dim {} ('{}') is already {}; only a replicated mesh dim can shard a parameter", m,
             spec.mesh[size_t(m)].name, spec.placements[size_t(m)].str());
    added *= spec.mesh[size_t(m)].size;
    names += fmt::format("{}{} ({})", names.empty() ? "" : " x ", spec.mesh[size_t(m)].name, spec.mesh[size_t(m)].size);
  }
  int64_t size = spec.global_shape[size_t(d)];
  MT_CHECK(size % (existing * added) == 0, "shard_param",
           "tensor dim {} of size {} cannot be sharded evenly over {}{} = {} (parameters must shard evenly)", d, size,
           names, existing > 1 ? fmt::format(" after the existing {}-way shard", existing) : "", existing * added);
  Placements p = spec.placements;
  ShardOrder order = spec.shard_order;
  for (int m : mesh_dims) {
    p[size_t(m)] = Placement::Shard(d);
    order[size_t(d)].push_back(m);
  }
  return DTensorSpec::make(spec.mesh, p, spec.global_shape, order);
}

std::vector<Placements> placement_product(const std::vector<Placement>& choices, int ndims) {
  std::vector<Placements> out{{}};
  for (int m = 0; m < ndims; ++m) {
    std::vector<Placements> next;
    for (const Placements& p : out)
      for (const Placement& x : choices) {
        Placements q = p;
        q.push_back(x);
        next.push_back(std::move(q));
      }
    out = std::move(next);
  }
  return out;
}

}  // namespace mt
