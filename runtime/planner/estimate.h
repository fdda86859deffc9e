// `meshtrain estimate`: memory, bytes and time per rank of a config on N ranks, computed by one process
// with no MPI ranks. The mesh is simulated (DeviceMesh::simulate): the same ParallelDims, tensor-parallel styles,
// fully_shard rule, cp sharding, recompute policy and pipeline split as `train` lay out every parameter of a
// rank's stage (the model is built deferred and never materialized), so a plan `train` refuses is refused here
// with the same message, and the parameter, gradient and optimizer bytes are those the run allocates. What is not
// a layout is asked of the code it describes: the activations each layer keeps for backward, the step's largest
// temporaries and the FLOPs per token from the model (CausalLM::activation_bytes and stage_flops, models/model.h),
// the bytes of each collective from each parallelism's function beside its code (comm/comm_bytes.h's CommBytes,
// the same `plan` prints); the time is this file's (FLOPs at a calibrated efficiency, an alpha-beta model per link
// of runtime/planner/cluster.h).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "parallel/parallel_dims.h"
#include "runtime/planner/cluster.h"
#include "runtime/train/run_config.h"

namespace mt {

struct MemoryPart {
  std::string name;  // "parameters", "activations (4 layers x 2 micro-batches in flight)", ...
  double bytes = 0;
  std::string note;
};

// The bytes one rank sends in a step over one group in one kind of collective (comm_counters.h's convention).
struct CommPart {
  std::string tag, group, kind;  // "layout", "tp", "all_gather"
  double bytes = 0;              // per step
  int64_t calls = 0;             // per step
  double seconds = 0;            // alpha-beta on the group's link, plus the sync wait
  bool overlapped = false;       // hidden behind compute when it fits
  std::string link;              // "node" | "network"
  double sync_seconds = 0;       // of seconds, the link's sync_us per call (members arriving from computing)
};

struct StageEstimate {
  int pp_rank = 0;
  int world_rank = 0;  // the rank described (the stage's first)
  std::vector<MemoryPart> memory;
  double state_bytes = 0;       // parameters, gradients, optimizer moments, compute copies (the run's "model state")
  double activation_bytes = 0;  // saved for backward at the peak (every micro-batch in flight)
  double peak_bytes = 0;        // the allocator's high-water mark over a step
  std::string peak_where;
  // The rank's resident memory: its floor (an idle rank of this binary: the cluster's rank_floor_mb, else
  // kDefaultRankFloorMib), train's own set-up above it (kTrainSetupMib) and the pages the tensors touch at the
  // peak (CPU ranks; a granule's unwritten tail is not resident).
  double floor_bytes = 0, setup_bytes = 0, resident_bytes = 0, process_bytes = 0;
  std::vector<CommPart> comm;
  double params = 0, trainable_params = 0;  // the stage's parameters' global elements: all, those that train (LoRA)
  double flops = 0;             // per step on this rank (model FLOPs; recompute adds its forward again)
  double memory_traffic = 0;    // bytes the memory-bound ops move per step (norms, RoPE, SwiGLU, loss, AdamW)
  double compute_s = 0, exposed_comm_s = 0, bubble_s = 0, step_s = 0;
};

// An idle CPU rank of meshtrain after MPI init (ru_maxrss: code, libraries, Open MPI's shared-memory buffers),
// measured here with 4 ranks under scripts/mpirun.sh (`meshtrain estimate --rank-floor`: 18.2 to 18.3 MiB); a
// cluster file's rank_floor_mb (`estimate --calibrate`) replaces it.
inline constexpr double kDefaultRankFloorMib = 18.3;
// What `train` adds to an idle rank before its tensors, on CPU ranks: cpu_peak_flops' GEMM probe (three 768^2
// f32 matrices left in the allocator's cache; 6.75 MiB fewer when the peak is read from log.peak_cache's file,
// runtime/train/peak_cache.h, so this errs high then), the data loader and tokenizer, Eigen's and OpenMP's buffers;
// measured here (one thread per rank) as train's RSS less an idle rank's less the tensors, on
// tests/cli/test_estimate_sweep.sh's configurations of under 10 MiB of tensors: 18.8 to 21.1 MiB.
inline constexpr double kTrainSetupMib = 19.5;

struct Estimate {
  Config config;
  ParallelDims pd;
  int world = 1;
  int64_t micro = 0, micro_batches = 0;  // sequences per forward, forwards per step per rank
  std::vector<StageEstimate> stages;     // one per pp stage
  std::optional<ClusterSpec> cluster;    // time only with one
  double step_s = 0, tokens_per_s = 0, mfu = 0;
  std::vector<std::string> notes;        // what the model leaves out
};

// Refuses (the same errors as `train`) a config that does not split over `world` ranks.
Estimate estimate_run(const Config& cfg, int world, const std::optional<ClusterSpec>& cluster);
std::string estimate_table(const Estimate& e);
// LoRA (lora.rank > 0): "  LoRA rank 8 (scale 2) on q_proj,...: N trainable parameters of M (x%); the base frozen..."
std::string lora_line(const Estimate& e);
nlohmann::json estimate_json(const Estimate& e);

}  // namespace mt
