// DeviceMesh: the world's ranks arranged as an N-dimensional array with named
// dims, row-major with the last dim innermost (so that tensor-parallel ranks,
// by convention the last dim, are neighbours on one node). A Group exists for
// every dim and for flattened sets of dims, some of them named by the caller
// (parallel/parallel_dims.h names the training mesh's groups). The mesh knows
// nothing of what its dims mean. DeviceMesh is a value handle: copies
// share the same groups.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/group.h"
#include "runtime/core/device.h"

namespace mt {

struct MeshDim {
  std::string name;
  int size = 1;
};

// A name for a flattened set of dims, given by the caller; dims the mesh lacks are left out.
struct MeshGroupName {
  std::string name;
  std::vector<std::string> dims;
};

// "dp_shard=2,cp=2,tp=2": dims in the order given; one size may be -1 to take
// the remaining ranks. Throws "[mesh] ..." naming the offending part.
std::vector<MeshDim> parse_mesh_spec(const std::string& spec, int world_size);
// Checks names (unique, non-empty) and that the product equals world_size.
void validate_mesh_dims(const std::vector<MeshDim>& dims, int world_size);
std::string mesh_str(const std::vector<MeshDim>& dims);  // "dp_shard=2,cp=2,tp=2"

struct MeshOptions {
  Device device = Device::cpu();  // where the collectives' buffers live
  std::string backend = "auto";   // mpi | nccl | auto (nccl for cuda when built)
  std::vector<MeshGroupName> group_names;  // names group(name) accepts besides the dims and "world"
  // The ranks the mesh covers: null, the world; or a group of another mesh (a pipeline stage's ranks), on
  // which creating the mesh and its groups is collective instead of on the world. Its ranks are then the
  // mesh's "world": world_rank() and coordinate_of() count in base's rank order, while each Group's
  // world_ranks() stay the job's.
  const Group* base = nullptr;
};

class DeviceMesh {
 public:
  DeviceMesh() = default;
  // Collective over the world: every rank must call it with the same dims.
  static DeviceMesh create(const std::vector<MeshDim>& dims, const MeshOptions& opts = {});
  // A mesh described, not made (`meshtrain estimate`): rank `rank`'s view of dims of any sizes, with no MPI and
  // no other process. Its groups know their ranks and names but refuse to communicate (an error naming the
  // operation and the group). world_ranks: the job's rank of each of the mesh's ranks (empty: 0, 1, ...).
  static DeviceMesh simulate(const std::vector<MeshDim>& dims, int rank, const MeshOptions& opts = {},
                             std::vector<int> world_ranks = {});
  bool simulated() const;

  int ndim() const;
  const std::vector<MeshDim>& dims() const;
  int size() const;  // product of dim sizes (= world size, or base's size)
  int size(int dim) const;
  int dim_index(const std::string& name) const;  // throws "[mesh] no dim ..."
  bool has_dim(const std::string& name) const;
  const std::vector<int>& coordinate() const;  // this rank's
  int coordinate(int dim) const { return coordinate()[size_t(dim)]; }
  int world_rank() const;
  std::vector<int> coordinate_of(int world_rank) const;
  int world_rank_of(const std::vector<int>& coord) const;
  std::string backend() const;
  Device device() const;

  Group& group(int dim) const;
  // A dim name, a name of MeshOptions::group_names, "world", or a
  // comma-separated list of dims flattened in mesh order. Flattened groups are
  // made on first use (that first use is collective over the world); names of
  // the same set of dims share one group, named by the first use.
  Group& group(const std::string& name) const;
  // The flattened groups made so far (name, group), for the self-check.
  std::vector<std::pair<std::string, Group*>> groups() const;

  // One line per rank: rank, host, device and coordinate (gathered; collective).
  std::string table() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace mt
