#include "parallel/parallel_dims.h"

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

std::vector<MeshDim> ParallelDims::mesh_dims() const {
  return {{"dp_replicate", dp_replicate}, {"dp_shard", dp_shard}, {"cp", cp}, {"tp", tp}};
}

int ParallelDims::dp_rank(const DeviceMesh& mesh) const {
  return mesh.coordinate(kDpReplicate) * dp_shard + mesh.coordinate(kDpShard);
}

Placement ParallelDims::activation_placement(const std::string& dim_name) {
  if (dim_name == "dp_replicate" || dim_name == "dp_shard") return Placement::Shard(0);  // batch rows
  if (dim_name == "cp") return Placement::Shard(1);                                      // the sequence
  return Placement::Replicate();
}

int64_t ParallelDims::seq_multiple() const {
  int64_t parts = cp > 1 && cp_load_balance == CpLoadBalance::head_tail ? 2 * int64_t(cp) : cp;
  return parts * (sequence_parallel && tp > 1 ? tp : 1);
}

void ParallelDims::check_seq_len(int64_t seq_len) const {
  if (seq_len % seq_multiple() == 0) return;
  std::string why;
  if (cp > 1)
    why = cp_load_balance == CpLoadBalance::head_tail
              ? fmt::format("parallel.cp = {} with cp_load_balance head_tail splits it into 2 x {} chunks", cp, cp)
              : fmt::format("parallel.cp = {} splits it into {} parts", cp, cp);
  if (sequence_parallel && tp > 1)
    why += fmt::format("{}parallel.tp = {} with sequence_parallel splits each rank's part into {}",
                       why.empty() ? "" : ", and ", tp, tp);
  fail("config", "training.seq_len = {} must be a multiple of {}: {}", seq_len, seq_multiple(), why);
}

void ParallelDims::make_groups(const DeviceMesh& mesh) const {
  mesh.group("dp");
  mesh.group(loss_group());
}

std::string ParallelDims::describe() const {
  std::vector<std::string> parts;
  if (dp_replicate > 1) parts.push_back(fmt::format("dp_replicate={} (batch)", dp_replicate));
  if (dp_shard > 1) parts.push_back(fmt::format("dp_shard={} (batch)", dp_shard));
  if (cp > 1)
    parts.push_back(
        fmt::format("cp={} (sequence: {}, {})", cp, cp_load_balance_name(cp_load_balance), cp_method_name(cp_method)));
  if (tp > 1) parts.push_back(fmt::format("tp={} (heads{})", tp, sequence_parallel ? ", sequence parallel" : ""));
  if (parts.empty()) return "1 rank";
  std::string s;
  for (auto& p : parts) s += (s.empty() ? "" : " x ") + p;
  return s;
}

}  // namespace mt
