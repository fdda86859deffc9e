// The cluster description `meshtrain estimate` predicts for (issue 28): what one device computes, how much memory
// it has, and how fast its links move bytes, read from a YAML file. configs/clusters/h100_ib.yaml is written by hand
// from datasheet figures; configs/clusters/this_machine.yaml by `meshtrain estimate --calibrate`, which measures
// this machine with the runtime's own kernels and collectives (calibrate_cluster below).
//
// The time model the figures serve:
//   compute    FLOPs / (rank_peak_flops x efficiency of the op kind): GEMMs and attention;
//   elementwise bytes read + bytes written / rank_memory_bandwidth (norms, adds, activations, the optimizer);
//   collective message steps x latency + bytes one rank sends / bandwidth (alpha-beta, collective_seconds),
//              on the link of the group's level: `node` when the group's ranks share a node, else `network`.
// Bandwidths follow nccl-tests' bus-bandwidth convention, so that a datasheet figure, a `meshtrain check` table and
// this file compare directly: what one rank sends per direction per second. The bytes are those comm_counters.h
// counts, so that the estimate's bytes are the runtime's and only their time is modelled.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/env.h"
#include "runtime/train/run_config.h"
#include "runtime/train/run_context.h"

namespace mt {

// One link level. bandwidth_gbs: GB/s (1e9 bytes) one rank sends per direction, bus bandwidth in nccl-tests'
// convention (> 0); latency_us: the cost of one message step of a collective in microseconds (>= 0).
// bandwidth_gbs_by_kind: optional bus bandwidths measured per collective kind, which replace bandwidth_gbs for that
// kind: one MPI library's reduce_scatter may move bytes several times slower than its all_reduce (this machine's
// Open MPI does), and one figure for both would misplace fully_shard against data parallel.
struct LinkSpec {
  double bandwidth_gbs = 0;
  double latency_us = 0;
  std::map<std::string, double> bandwidth_gbs_by_kind;
  LinkSpec() = default;
  LinkSpec(double bandwidth, double latency, std::map<std::string, double> by_kind = {})
      : bandwidth_gbs(bandwidth), latency_us(latency), bandwidth_gbs_by_kind(std::move(by_kind)) {}
  double bandwidth_for(const std::string& kind) const {
    auto it = bandwidth_gbs_by_kind.find(kind);
    return it != bandwidth_gbs_by_kind.end() ? it->second : bandwidth_gbs;
  }
};

struct ClusterSpec {
  std::string name;
  std::string file;  // where it was read from, for messages ("" when built in code)
  int devices_per_node = 1;
  double device_memory_gib = 0;  // memory one rank may use (a GPU's; on CPU ranks, the node's RAM / its ranks)
  // 0: every rank has a device of its own (GPUs). > 0: CPU ranks sharing the node's cores_per_node cores; then
  // peak_tflops and memory_bandwidth_gbs are one core's, and a rank gets rank_share of them (a rank's speed depends
  // on how many ranks share the node: 8 ranks on 2 cores each get a quarter of a core). Optional.
  int cores_per_node = 0;
  // Dense peak FLOP/s of one device (one core when cores_per_node > 0) per compute dtype, in TFLOP/s: keys are
  // training.dtype's values (fp32, bf16, fp64). Peak, not reached: the efficiencies say how much each op reaches.
  std::map<std::string, double> peak_tflops;
  LinkSpec node;     // between ranks of one node (NVLink / NVSwitch; shared memory for CPU ranks)
  LinkSpec network;  // between nodes (InfiniBand, RoCE, TCP)
  // Measured links of groups of n ranks inside one node, all of the node's ranks communicating in such groups at
  // once (calibration writes one per divisor of the rank count). Where a group's size has an entry, link_for uses
  // it instead of `node`: on CPU ranks that share cores, a group of 2 and the group of all 8 differ. Optional.
  std::map<int, LinkSpec> node_by_ranks;
  // Fractions of peak_tflops reached, in (0, 1]: GEMMs (matmul forward and backward) and attention (forward plus
  // backward, FLOPs counted as attention_flops says).
  double gemm_efficiency = 0, attention_efficiency = 0;
  // Device memory bandwidth reached by elementwise ops, GB/s (bytes read + bytes written per second); a reached
  // figure, not the datasheet's.
  double memory_bandwidth_gbs = 0;
  std::string source;  // free text: where the figures come from
};

// Reads and checks a cluster file. Every error is "[cluster] FILE: ..." naming the key: a missing field, a
// non-positive bandwidth, memory, peak or device count, a negative latency, an efficiency outside (0, 1], an
// unknown key (with the known ones) or dtype, a value of the wrong type, a section that is not a map, a file that
// cannot be read or is not YAML. name defaults to the file's stem; source and node_by_ranks are optional.
ClusterSpec load_cluster(const std::string& path);
// The same from YAML text; file names the origin in messages ("" = "<string>").
ClusterSpec cluster_from_yaml(const std::string& yaml, const std::string& file = "");
// The checks load_cluster makes, on a spec built in code (errors name c.file, or "<cluster>").
void check_cluster(const ClusterSpec& c);
// Writes c as YAML that load_cluster reads back to the same values, header_comment first (each line made a
// "# " comment). Checks c first. "[cluster] cannot write 'PATH': why" when the file cannot be written.
void write_cluster(const ClusterSpec& c, const std::string& path, const std::string& header_comment);

// peak_tflops[dtype] in FLOP/s (one device's, or one core's); "[cluster] FILE: peak_tflops has no entry for 'bf16'
// ..." when absent.
double peak_flops(const ClusterSpec& c, const std::string& dtype);
// The part of one device's (one core's) figures a rank gets: 1 when ranks have devices of their own
// (cores_per_node 0); on shared cores, the cores it runs on, min(threads, cores_per_node / ranks_on_node), threads 0
// meaning train's default (cores / ranks, at least 1). ranks_on_node: the job's ranks on the rank's node.
double rank_share(const ClusterSpec& c, int ranks_on_node, int threads);
// A rank's peak FLOP/s and elementwise bandwidth (bytes/s): peak_flops and memory_bandwidth_gbs x rank_share.
double rank_peak_flops(const ClusterSpec& c, const std::string& dtype, int ranks_on_node, int threads);
double rank_memory_bandwidth(const ClusterSpec& c, int ranks_on_node, int threads);

// The link a group of ranks uses: inside a node when all its members are on one node (a rank's node is
// world_rank / devices_per_node, ranks filled node by node as mpirun and Slurm place them), else the network.
// Inside a node, node_by_ranks' entry for the group's size when there is one, else `node`. A group of one rank
// (or none) is inside a node.
const LinkSpec& link_for(const ClusterSpec& c, const std::vector<int>& world_ranks);
// Whether the group's ranks are all on one node (link_for's test; the link may be a node_by_ranks entry, so compare
// this, not the returned address, with &c.node).
bool inside_one_node(const ClusterSpec& c, const std::vector<int>& world_ranks);

// Message steps of a collective of kind on n ranks under the ring algorithms comm_counters.h counts bytes for:
// all_reduce 2(n-1) (reduce-scatter then all-gather), all_gather, reduce_scatter and all_to_all n-1 (pairwise),
// broadcast and barrier ceil(log2 n) (a binomial tree), ring_shift and send 1, recv 0 (its time is the sender's).
// n <= 1: 0. Unknown kinds are an error listing the known ones.
int collective_steps(const std::string& kind, int n);
// Alpha-beta time in seconds of one collective: steps x latency + bytes_per_rank / l.bandwidth_for(kind), where
// bytes_per_rank is what one rank sends as comm/comm_counters.h counts it (all_reduce 2(n-1)/n of the buffer,
// all_gather (n-1) x the input, reduce_scatter and all_to_all (n-1)/n of the input, broadcast, ring_shift and send
// the buffer). With bandwidths in bus-bandwidth terms that is nccl-tests' own relation, time = size x bus factor /
// busbw. n <= 1: 0 (nothing leaves the rank). A ring model: at thousands of ranks NCCL's trees have fewer steps,
// so small collectives there are over-estimated; large ones, which dominate a step, are bandwidth-bound either way.
double collective_seconds(const LinkSpec& l, const std::string& kind, double bytes_per_rank, int n);

// Attention FLOPs of one layer's forward on (B, T queries, S keys, H heads, hd): 4 B T S H hd (Q K^T and P V, 2
// FLOPs per multiply-add), halved when causal with T == S (the masked half is skipped). The backward is 2.5x the
// forward (five GEMM-shaped products instead of two: S = Q K^T again, dV, dP, dQ, dK), FlashAttention's count.
double attention_forward_flops(double B, double T, double S, double H, double hd, bool causal);
inline constexpr double kAttentionBackwardFactor = 2.5;

// ---- Calibration: `mpirun -np N meshtrain estimate --calibrate --out FILE` ----
struct CalibrateOptions {
  int iters = 5;              // timed repetitions per measurement (median taken), after one warm-up
  int collective_iters = 20;  // timed repetitions of each collective
  // The messages the bandwidth is fitted to (the whole buffer: nccl-tests' size), the span of a CPU run's tp
  // activations, fully_shard units and gradient buckets (training.grad_bucket_mb, 25 by default).
  std::vector<int64_t> bandwidth_sizes = {256 << 10, 1 << 20, 4 << 20, 16 << 20};
  int64_t latency_bytes = 8;             // the small message
  int64_t elementwise_elems = 16 << 20;  // f32 elements per tensor of the memory-bandwidth ops (past the caches)
  bool quick = false;                    // smaller problems and fewer repetitions (tests); figures less exact
};

// Measures this machine, on every rank of the job at once (collective over the world). CPU ranks only (comm.device
// cpu), with training.threads threads per rank (0: the node's cores / its ranks, as train sets them):
//   peak        cpu_peak_flops()'s 768^3 GEMM (metrics.h) on one rank alone, per core, raised to the fastest rate
//               measured here so that every efficiency stays <= 1;
//   efficiency  GEMM (matmul forward+backward at N=2048, C=256..1024) and attention (local, causal, forward+
//               backward, T=256..1024, hd 32/64) rates with all ranks running, over the rank's peak;
//   memory      add_, rmsnorm, swiglu and adamw over 64 MiB tensors, bytes read + written per second;
//   links       all_reduce, all_gather, reduce_scatter, all_to_all and ring_shift in groups of every size n
//               dividing the world (node_by_ranks; `node` is the world's): latency from an 8-byte message, a
//               bandwidth per kind from 256K..16M ones, and bandwidth_gbs (broadcast, send) the kinds' median.
// Compute figures are written per core (cores_per_node set), so that an estimate for another rank count scales them
// by rank_share; the links are not rescaled: they are this rank count's (calibrate with the rank count to estimate).
// Every rank is on one node: devices_per_node = its ranks, network = node (said in source). Needs >= 2 ranks.
ClusterSpec calibrate_cluster(const MpiEnv& env, const Config& cfg, const CalibrateOptions& opts = {});
// Runs calibrate_cluster and, on rank 0, prints what it measured and writes out_path (checked writable before
// anything is measured, so that a bad path fails at once). Returns the exit code.
int run_calibrate(const RunContext& ctx, const std::string& out_path, const CalibrateOptions& opts = {});

}  // namespace mt
