// Fully sharded data parallel (ZeRO-3, PyTorch's fully_shard): every large
// parameter is sharded over the fsdp mesh dim (dp_shard), so parameters,
// gradients and optimizer state take 1/N of the memory; the parameters of a
// unit (a decoder layer, the embedding, the final norm with lm_head) are
// all-gathered just before the unit runs and freed after it, and its gradients
// leave backward reduce-scattered to the shards.
//
// Layout inference, per parameter: at most
// min_weight_size elements stays replicated; otherwise the largest tensor dim
// that divides by the fsdp dim's size and that no other mesh dim shards gets
// Shard on the fsdp dim; when the only divisible dim is one tensor parallel
// already shards, it is sharded over both (tp first, then dp_shard within each
// tp part: divisibility by the product); with no divisible dim it stays
// replicated with a warning. Sharding keeps this rank's part of the current
// value: no communication.
//
// A unit's life: before its forward, its sharded parameters are gathered from
// one flat buffer per unit (one all-gather in param_dtype) into
// its FsdpParamState, which layers read through compute_local(); the next
// unit's gather is started before this one computes (prefetch). After forward
// they are freed (reshard_after_forward) or kept until backward. Before its
// backward they are gathered again (and the previous unit's gather started),
// and full-size gradient buffers (grad_local()) are given to the
// layers; after its backward the gradients are reduce-scattered (one flat
// buffer, reduce_dtype) and added to the parameters' sharded gradients. At
// most two units' gathered parameters are alive at a time (with reshard).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_bytes.h"
#include "parallel/module.h"
#include "parallel/parallel_dims.h"

namespace mt {

struct FullyShardOptions {
  std::string mesh_dim = dim::dp_shard;
  int64_t min_weight_size = int64_t(1) << 18;  // elements; parameters this small stay replicated
  // The units, in any order: a module pattern (each module it matches is a unit: "model.layers.*"), or
  // patterns joined by '+' (every module they match together form one unit: "model.norm+lm_head").
  std::vector<std::string> units;
  bool reshard_after_forward = true;
  DType param_dtype = DType::f32;   // the dtype parameters are gathered in (the compute dtype)
  DType reduce_dtype = DType::f32;  // the dtype gradients are reduce-scattered in
};

// Where one parameter goes on the fsdp dim.
struct FsdpDecision {
  std::string param;
  int tensor_dim = -1;   // sharded tensor dim, -1: replicated
  bool with_tp = false;  // that dim is also sharded by another mesh dim (sharded over both)
  bool warn = false;     // replicated although large: no dim divides
  std::string reason;    // "largest divisible dim 1 (768)", "256 elements <= min_weight_size 262144", ...
};
// The rule alone (pure), for a parameter of this spec; mesh_dim is the fsdp dim's index.
FsdpDecision decide_fsdp_layout(const std::string& name, const DTensorSpec& spec, int mesh_dim,
                                int64_t min_weight_size);

struct FsdpUnit;
// The state behind a fully sharded model's hooks: it must outlive every forward and backward.
class FullyShard {
 public:
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;
  ~FullyShard();
  const std::vector<FsdpDecision>& decisions() const { return decisions_; }
  // "26 units: 24 parameters sharded on dp_shard (3 with tp), 9 replicated"
  std::string describe() const;
  // Names of the units in forward order.
  std::vector<std::string> unit_names() const;
  // Elements of one rank's flat buffers over all units (each all-gather sends (dp_shard - 1) of them).
  int64_t slot_elements() const;
  // Each unit's flat buffer in elements (one rank's slot), in forward order: gathered, a unit is n x that.
  std::vector<int64_t> unit_slots() const;
  // The same for the gradients' buffers, which hold only the trainable parameters (frozen ones, LoRA's base, have
  // no gradient): equal to the above without LoRA, 0 for a unit of only frozen parameters (it reduces nothing).
  int64_t grad_slot_elements() const;
  std::vector<int64_t> unit_grad_slots() const;
  // Each unit's sharded parameters, their gathered elements (this rank's tp part, whole on the fsdp dim), in
  // forward order: each is its own allocation while the unit is unpacked, and so is its full-size gradient.
  std::vector<std::vector<int64_t>> unit_param_elements() const;
  // The same for the trainable ones only, those given a full-size gradient in backward (all without LoRA).
  std::vector<std::vector<int64_t>> unit_grad_param_elements() const;
  const FullyShardOptions& options() const { return opts_; }
  // Pipeline parallel with reshard_after_forward false: between hold() and release() a unit gathered once stays
  // gathered and its gradients accumulate whole; release() reduce-scatters each unit's once and frees it. So a
  // step of m micro-batches gathers and reduce-scatters each unit once instead of m times.
  void hold();
  void release();

 private:
  friend std::unique_ptr<FullyShard> fully_shard(Module&, const DeviceMesh&, const FullyShardOptions&);
  FullyShard() = default;
  std::vector<FsdpDecision> decisions_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  FullyShardOptions opts_;
  bool hold_ = false;
};

// The tags its collectives are counted under (comm_counters.h).
inline constexpr const char* kFsdpGatherTag = "fsdp.gather";
inline constexpr const char* kFsdpReduceTag = "fsdp.reduce";
// The analytic bytes one rank sends in a step's forward and backward (one micro-batch): the units' flat
// buffers all-gathered in forward, again in backward when resharded after forward, the gradients
// reduce-scattered; each sends (n-1) x one rank's buffer. n: the fsdp dim's size.
struct FsdpStepBytes {
  double forward = 0, backward = 0;
};
FsdpStepBytes fsdp_step_bytes(const FullyShard& fs, int n);
// The step's collectives (comm_bytes.h): fsdp_step_bytes for each of `micro_batches` forward and backward, or once
// under pipeline parallel without resharding (a unit stays gathered from its first forward to its last backward).
std::vector<CommBytes> fsdp_step_collectives(const FullyShard& fs, int n, int64_t micro_batches, bool pipelined);

// Shards root's parameters over opts.mesh_dim by the rule above and installs the unit hooks. Errors
// (before anything changes) name a unit pattern that matches nothing, a module in two units, a parameter
// shared by two units (tied embeddings in different units), a negative min_weight_size.
std::unique_ptr<FullyShard> fully_shard(Module& root, const DeviceMesh& mesh, const FullyShardOptions& opts);

}  // namespace mt
