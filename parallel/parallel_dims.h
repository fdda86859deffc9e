// What each dim of the training mesh means, stated once. The trainer, the
// parallel styles, the gradient sync, `meshtrain plan` and checkpoints ask
// this value instead of knowing dim names and indices themselves, so adding a
// parallelism changes this file.
//
// Mesh order (outermost first): dp_replicate, dp_shard, cp, tp; tp innermost so
// tensor-parallel ranks are neighbours on a node. Every dim exists (size 1
// where unused).
//   dp_replicate, dp_shard  split the batch rows;
//   cp                      splits each sequence (ring attention);
//   tp                      splits heads and, with sequence parallel, the
//                           residual stream's sequence.
// The loss and the token counts are summed over dp x cp; a gradient leaves
// backward Partial over dp and cp (every rank saw different tokens).
#pragma once
#include <string>
#include <vector>

#include "comm/mesh.h"
#include "parallel/placement.h"

namespace mt {

// How the sequence is split over the cp ranks and how K/V move between them (attention/ring_attention.h).
enum class CpLoadBalance { none, head_tail };
enum class CpMethod { ring, all_gather };
// "none" | "head_tail"; "ring" | "all_gather". Errors name `key` and the accepted values.
CpLoadBalance cp_load_balance_from_name(const std::string& s, const std::string& key);
CpMethod cp_method_from_name(const std::string& s, const std::string& key);
std::string cp_load_balance_name(CpLoadBalance lb);
std::string cp_method_name(CpMethod m);

struct ParallelDims {
  int dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  bool sequence_parallel = false;  // with tp > 1: the residual stream is Shard(1) over tp
  CpMethod cp_method = CpMethod::ring;
  CpLoadBalance cp_load_balance = CpLoadBalance::head_tail;

  // Mesh dim indices in the canonical order.
  static constexpr int kDpReplicate = 0, kDpShard = 1, kCp = 2, kTp = 3;

  int world() const { return dp_replicate * dp_shard * cp * tp; }
  int dp() const { return dp_replicate * dp_shard; }
  // The four dims with their sizes, outermost first (DeviceMesh::create takes them).
  std::vector<MeshDim> mesh_dims() const;

  // The dims that split the batch rows, and this rank's index among dp() row groups.
  std::vector<int> batch_dims() const { return {kDpReplicate, kDpShard}; }
  int dp_rank(const DeviceMesh& mesh) const;
  // This rank's place in the sequence split: its index in the cp group.
  int cp_rank(const DeviceMesh& mesh) const { return mesh.coordinate(kCp); }
  // The group the loss and token counts are summed over: every rank that saw other tokens (dp x cp).
  // Made on first use, which is collective: make_groups() makes it on every rank at start-up.
  std::string loss_group() const { return "dp_replicate,dp_shard,cp"; }
  // Mesh dims over which every gradient is Partial after backward.
  std::vector<int> grad_partial_dims() const { return {kDpReplicate, kDpShard, kCp}; }
  // How an activation (B, T, ...) is laid out on a mesh dim other than the one a style works on:
  // batch rows Shard(0) on the dp dims, the sequence Shard(1) on cp, Replicate on tp.
  static Placement activation_placement(const std::string& dim_name);
  // The sequence length must be a multiple of this: cp parts (2 cp with head_tail) times tp under sequence
  // parallel.
  int64_t seq_multiple() const;
  // Errors naming training.seq_len, parallel.cp and parallel.tp when seq_len does not split.
  void check_seq_len(int64_t seq_len) const;
  // Makes the flattened groups training uses (collective over the world: every rank, same order).
  void make_groups(const DeviceMesh& mesh) const;
  // "dp_replicate=2 (batch) x cp=2 (sequence: head_tail, ring) x tp=2 (heads, sequence parallel)"
  std::string describe() const;
};

}  // namespace mt
