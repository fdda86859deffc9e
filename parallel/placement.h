// Placements of a tensor on a device mesh and the spec that fixes, for any
// rank, which part of the global tensor it holds (DTensor's semantics).
//
// Notation, used in logs, errors and on the command line: one token per mesh
// dim, outermost first: S(d) shards tensor dim d, R replicates, P(sum|avg|max|min)
// holds a partial value. When several mesh dims shard the same tensor dim, each
// such token carries its position in that dim's shard order: S(0)[0]S(0)[1]
// means mesh dim 0 splits tensor dim 0 first and mesh dim 1 splits each piece
// again. Parsing accepts separators (commas, spaces) and negative dims.
#pragma once
#include <string>
#include <vector>

#include "comm/group.h"
#include "comm/mesh.h"
#include "runtime/core/tensor.h"

namespace mt {

struct Placement {
  enum class Kind { shard, replicate, partial };
  Kind kind = Kind::replicate;
  int dim = 0;                  // shard: the tensor dim (may be negative before normalise)
  ReduceOp op = ReduceOp::sum;  // partial: how the values combine

  static Placement Shard(int d) { return {Kind::shard, d, ReduceOp::sum}; }
  static Placement Replicate() { return {Kind::replicate, 0, ReduceOp::sum}; }
  static Placement Partial(ReduceOp op = ReduceOp::sum) { return {Kind::partial, 0, op}; }
  bool is_shard() const { return kind == Kind::shard; }
  bool is_shard(int d) const { return kind == Kind::shard && dim == d; }
  bool is_replicate() const { return kind == Kind::replicate; }
  bool is_partial() const { return kind == Kind::partial; }
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::shard || dim == o.dim) && (kind != Kind::partial || op == o.op);
  }
  std::string str() const;  // S(0), R, P(sum)
};

using Placements = std::vector<Placement>;
// Every list of `ndims` placements drawn from `choices` (choices^ndims of them, the last dim varying fastest):
// the layouts a planner or a test enumerates.
std::vector<Placements> placement_product(const std::vector<Placement>& choices, int ndims);
// For each tensor dim, the mesh dims that shard it, in the order they apply.
using ShardOrder = std::vector<std::vector<int>>;

// "S(0),R" / "S(0)[1]S(0)[0]" / "P(sum) S(-1)" -> placements and, when the
// [k] marks are given, the shard order they state. ndim_tensor normalises
// negative dims (0: keep as written). Throws "[placement] ...".
struct ParsedPlacements {
  Placements placements;
  std::vector<int> order_marks;  // per mesh dim, -1 when not given
};
ParsedPlacements parse_placements(const std::string& text);

// The layout of one distributed tensor: mesh shape, placements, global shape
// and shard order. A value type: no communicator, so planning and shape
// arithmetic need no MPI.
struct DTensorSpec {
  std::vector<MeshDim> mesh;
  Placements placements;
  Shape global_shape;
  ShardOrder shard_order;  // one list per tensor dim

  // Normalises negative shard dims, fills the default shard order (mesh-dim
  // order) when `order` is empty, and checks everything: throws "[placement] ...".
  static DTensorSpec make(std::vector<MeshDim> mesh, Placements placements, Shape global_shape, ShardOrder order = {});
  // Placements plus the [k] marks of a parsed text.
  static DTensorSpec make(std::vector<MeshDim> mesh, const ParsedPlacements& parsed, Shape global_shape);

  int mesh_ndim() const { return int(mesh.size()); }
  int tensor_ndim() const { return int(global_shape.size()); }
  bool has_default_order() const;
  // Local shape and global offset of the shard held at a mesh coordinate
  // (torch.chunk sizes: ceil(size/n) per shard until the size runs out).
  Shape local_shape(const std::vector<int>& coord) const;
  Shape local_offset(const std::vector<int>& coord) const;
  std::string str() const;  // placements in the notation, with [k] marks where needed
  bool operator==(const DTensorSpec& o) const;
};

// torch.chunk's split of `size` into n parts: part k starts at begin and has len elements.
struct Chunk {
  int64_t begin, len;
};
Chunk chunk_of(int64_t size, int n, int k);

std::vector<int> mesh_coordinate(const std::vector<MeshDim>& mesh, int rank);  // row-major
int mesh_rank(const std::vector<MeshDim>& mesh, const std::vector<int>& coord);

// Adds a shard of tensor_dim over mesh_dims (in that order, after any mesh
// dims already sharding it). Parameters must shard evenly: refuses, naming the
// dim, its size and the mesh sizes, when the size is not divisible.
DTensorSpec shard_param(const DTensorSpec& spec, int tensor_dim, const std::vector<int>& mesh_dims);

}  // namespace mt
