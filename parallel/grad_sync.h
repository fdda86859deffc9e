// Gradient sync, bucketed and overlapped with backward: step 5 of the training
// step (train_step), the one rule "redistribute each gradient to its
// parameter's placement" carried out as a few large all-reduces instead of one
// per parameter. Gradients that are Partial over the same mesh dims go into
// flat buckets of about bucket_bytes, in backward order; a bucket's all-reduce
// starts (async) as soon as the backward of every parameter in it has run on
// the last micro-batch, so communication overlaps the rest of backward (on
// NCCL's own stream on GPUs). finish() waits and copies the sums back.
// Parameters whose placement is not Replicate on a partial dim (sharded data
// parallel), and every parameter when bucket_bytes is 0, take the general path:
// one redistribute each, in finish().
#pragma once
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "comm/comm_bytes.h"
#include "comm/group.h"
#include "parallel/module.h"

namespace mt {

// The tags its collectives are counted under (comm_counters.h): the buckets' all-reduces, and the general
// path's redistributions.
inline constexpr const char* kGradReduceTag = "grad.reduce";
inline constexpr const char* kGradRedistributeTag = "grad.redistribute";

struct GradSyncOptions {
  std::vector<int> dp_dims;         // mesh dims the batch is split over: every gradient is Partial on them
  size_t bucket_bytes = 25 << 20;   // target bucket size (in the reduce dtype); 0: one redistribute per parameter
  DType reduce_dtype = DType::f32;  // bf16 halves the bytes; sums are converted back to the gradient's dtype
};

class GradSync {
 public:
  // Plans the buckets and installs post_backward hooks on the modules that own parameters. The
  // owner of a tied parameter is its first user in forward order (Module::parameters), hence the
  // last in backward: its gradient is complete when the owner's backward has run.
  GradSync(Module& model, const DeviceMesh& mesh, GradSyncOptions opt);
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Before each micro-batch's backward: only the last one's hooks launch collectives.
  void arm(bool last_micro_batch);
  // Launches what the hooks did not, waits for every bucket, writes the sums back into the gradients
  // and gives each gradient its parameter's placements.
  void finish();
  // "2 bucket(s) (f32): 12288.0 KiB over dp_replicate, 0.5 KiB over dp_replicate,tp"
  std::string describe() const;
  // The analytic bytes one rank sends for the buckets in a step: a ring all-reduce of each, 2 (n-1)/n of it.
  int64_t bucket_bytes_per_rank() const;
  // The same as the step's collectives (comm_bytes.h), one all_reduce entry per group the buckets are reduced over
  // ("dp_replicate", "dp_shard,tp"), a call per bucket.
  std::vector<CommBytes> step_bytes() const;
  int64_t buckets_launched_early() const { return launched_early_; }
  // The flat buffers' bytes once made (held for the run: a second copy of the bucketed gradients).
  int64_t bucket_buffer_bytes() const;

 private:
  struct Bucket {
    std::string dims;  // the group's name: "dp_replicate" or "dp_replicate,tp"
    std::vector<Parameter*> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in flat
    int64_t numel = 0;             // elements of the flat buffer
    Tensor flat;                   // (numel) in the reduce dtype, on the gradients' device, made at the first launch
    int pending = 0;               // parameters whose backward has not run yet on this micro-batch
    bool launched = false;
    Work work;
  };
  void mark_ready(Parameter* p);
  void launch(Bucket& b);

  DeviceMesh mesh_;
  GradSyncOptions opt_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<Parameter*, std::vector<int>>> general_;  // (parameter, partial dims): redistribute
  std::unordered_map<Parameter*, size_t> bucket_of_;              // parameter -> bucket index
  bool armed_ = false;
  int64_t launched_early_ = 0;
};

}  // namespace mt
