// What each dim of the training mesh means, stated once: an ordered list of
// dim descriptors (name, size, what the dim splits) and the named flattened
// groups. The config reader, the mesh, the trainer, the styles, the gradient
// sync, `meshtrain plan` and parallelize ask this value; no other code types a
// dim's name (they use the constants below) or knows its index. DeviceMesh
// knows nothing of what dims mean. Adding a parallelism is one descriptor in
// parallel_dims.cpp (and its config key) plus the code that uses it.
//
// Mesh order (outermost first): pp, dp_replicate, dp_shard, ep, cp_ring, cp_ulysses, tp.
// pp splits the model itself (stages of consecutive layers, parallel/pipeline.h): the model, its parameters and
// activations live on the stage's mesh, the other dims, made over the stage's ranks only (`dims`, whose indices
// are that mesh's); the world mesh adds pp outermost, and its pp group carries the activations between stages.
// Every dim exists (size 1 where unused). tp is innermost so tensor-parallel
// ranks are neighbours on a node, cp_ulysses next (its all-to-all wants a
// node's bandwidth), cp_ring outside it (its K/V shifts overlap with compute).
//   dp_replicate, dp_shard  split the batch rows (dp_shard also shards parameters: fully_shard);
//   ep                      splits the batch rows too, and an MoE model's experts (each rank holds E/ep of them;
//                           rows travel to their expert's rank by all-to-all): data parallel for the rest;
//   cp_ring                 splits each sequence (ring or all_gather attention);
//   cp_ulysses              splits each cp_ring part again; attention all-to-alls it into heads;
//   tp                      splits heads and, with sequence parallel, the residual stream's sequence.
// Named flattened groups: dp = dp_replicate x dp_shard, cp = cp_ring x cp_ulysses, dp_cp = dp x cp, and loss
// (the dims whose ranks see different tokens: today dp_cp's, the same Group): the loss and token counts are
// summed over it, and a gradient leaves backward Partial over its dims.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "comm/mesh.h"
#include "parallel/placement.h"
#include "runtime/io/config.h"

namespace mt {

// The mesh dims' and named groups' names: the only place they are spelled.
namespace dim {
inline constexpr const char* pp = "pp";
inline constexpr const char* dp_replicate = "dp_replicate";
inline constexpr const char* dp_shard = "dp_shard";
inline constexpr const char* ep = "ep";
inline constexpr const char* cp_ring = "cp_ring";
inline constexpr const char* cp_ulysses = "cp_ulysses";
inline constexpr const char* tp = "tp";
// Flattened groups.
inline constexpr const char* dp = "dp";
inline constexpr const char* cp = "cp";
inline constexpr const char* dp_cp = "dp_cp";
inline constexpr const char* loss = "loss";
}  // namespace dim

// How the sequence is split over the cp_ring ranks and how K/V move between them (attention/ring_attention.h).
// parallel.cp_method alltoall is not one of these: it puts the whole cp degree on the cp_ulysses dim.
enum class CpLoadBalance { none, head_tail };
enum class CpMethod { ring, all_gather };
// "none" | "head_tail"; "ring" | "all_gather". Errors name `key` and the accepted values.
CpLoadBalance cp_load_balance_from_name(const std::string& s, const std::string& key);
CpMethod cp_method_from_name(const std::string& s, const std::string& key);
std::string cp_load_balance_name(CpLoadBalance lb);
std::string cp_method_name(CpMethod m);

// One mesh dim: its name (also its config key, parallel.<name>), size, and what it splits.
struct DimSpec {
  std::string name;
  int size = 1;
  bool batch = false;      // splits the batch rows (activations Shard(0))
  bool sequence = false;   // splits each sequence (activations Shard(1)); attention exchanges over it
  bool heads = false;      // splits heads (tensor parallel: activations Replicate between the styles' hooks)
  bool shards_params = false;  // fully_shard shards parameters over it
  bool data = false;       // ranks see different tokens: the loss is summed and gradients are Partial over it
  std::string what;        // for describe(): "batch", "sequence (ring)", ...
  bool stages = false;     // splits the layers (pipeline parallel): each coordinate holds other parameters
};

struct ParallelDims {
  DimSpec pp;                 // the pipeline dim, outside every other (stages)
  std::vector<DimSpec> dims;  // the stage mesh's dims, outermost first, every dim present
  bool sequence_parallel = false;  // with tp > 1: the residual stream is Shard(1) over tp
  CpMethod cp_method = CpMethod::ring;  // how K/V move over cp_ring
  CpLoadBalance cp_load_balance = CpLoadBalance::head_tail;  // how the sequence splits over cp_ring

  // Every dim of size 1.
  ParallelDims();
  // From the config's parallel section (sizes, -1 inferred from the world size; cp with cp_method,
  // cp_ring and cp_ulysses resolved into the two cp dims). Errors name the keys ("[config] ...").
  static ParallelDims from_config(const ParallelConfig& p, int world_size);
  // Sizes by name in code (tests, tools): unnamed dims are 1.
  static ParallelDims from_sizes(const std::vector<std::pair<std::string, int>>& sizes);

  int index(const std::string& name) const;  // throws "[parallel] ..." for an unknown dim
  int size(const std::string& name) const { return dims[size_t(index(name))].size; }
  int world() const;  // every rank: pp x the stage's ranks
  int stage_size() const;  // the ranks of one pipeline stage (the stage mesh's size)
  int pp_size() const { return pp.size; }
  int dp_replicate() const { return size(dim::dp_replicate); }
  int dp_shard() const { return size(dim::dp_shard); }
  int ep() const { return size(dim::ep); }
  int cp_ring() const { return size(dim::cp_ring); }
  int cp_ulysses() const { return size(dim::cp_ulysses); }
  int tp() const { return size(dim::tp); }
  int dp() const;  // the product of the batch dims
  int cp() const;  // the product of the sequence dims

  // The dims with their sizes, outermost first, and the named groups (DeviceMesh::create takes them).
  std::vector<MeshDim> mesh_dims() const;
  std::vector<MeshGroupName> group_names() const;
  // The stage mesh (the model's) for these dims (collective over the world), with its named groups made.
  DeviceMesh make_mesh(const MeshOptions& opts = {}) const;
  // With pp: the world mesh (pp outermost, then the stage dims: its group(dim::pp) joins the ranks holding the
  // same part of neighbouring stages) and this rank's stage mesh, made over its stage's ranks. Without pp both
  // are the same mesh.
  struct Meshes {
    DeviceMesh world, stage;
  };
  Meshes make_meshes(const MeshOptions& opts = {}) const;
  // The same meshes as rank `world_rank` of world() would make them, described without MPI (DeviceMesh::simulate:
  // `meshtrain estimate`).
  Meshes simulate_meshes(int world_rank) const;

  // This rank's index among dp() row groups, and its place in each sequence split.
  int dp_rank(const DeviceMesh& mesh) const;
  int cp_ring_rank(const DeviceMesh& mesh) const { return mesh.coordinate(index(dim::cp_ring)); }
  int cp_ulysses_rank(const DeviceMesh& mesh) const { return mesh.coordinate(index(dim::cp_ulysses)); }
  // This rank's pipeline stage: its pp coordinate in the world mesh (0 on a mesh without pp).
  int pp_rank(const DeviceMesh& world) const {
    return world.has_dim(dim::pp) ? world.coordinate(world.dim_index(dim::pp)) : 0;
  }
  // The group the loss and token counts are summed over (the data dims).
  std::string loss_group() const { return dim::loss; }
  // Mesh dims over which every gradient is Partial after backward (the data dims).
  std::vector<int> grad_partial_dims() const;
  // How an activation (B, T, ...) is laid out on a mesh dim other than the one a style works on:
  // batch rows Shard(0) on the batch dims, the sequence Shard(1) on the sequence dims, Replicate on tp.
  Placement activation_placement(int mesh_dim) const;
  // The same by dim name, for code that holds only a mesh (the styles' layout hooks): dims that are not
  // training's (a test's own mesh) are Replicate.
  static Placement activation_placement(const std::string& dim_name);
  // The sequence length must be a multiple of this: cp_ring parts (2 cp_ring with head_tail) times
  // cp_ulysses, times tp under sequence parallel.
  int64_t seq_multiple() const;
  // Errors naming training.seq_len and the parallel keys when seq_len does not split.
  void check_seq_len(int64_t seq_len) const;
  // Errors naming model.n_heads, model.n_kv_heads, parallel.tp and the cp keys when heads do not split over
  // tp and then over cp_ulysses (whole q heads per rank; kv heads a multiple or a divisor of cp_ulysses).
  void check_heads(int64_t n_heads, int64_t n_kv_heads) const;
  // "dp_replicate=2 (batch) x cp_ring=2 (sequence: head_tail, ring) x tp=2 (heads, sequence parallel)"
  std::string describe() const;
};

}  // namespace mt
