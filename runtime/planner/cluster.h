// The cluster description `meshtrain estimate` predicts for: what one device computes, how much memory
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
// bandwidth_gbs_by_kind may also hold "<kind>_async" (all_reduce, all_gather, reduce_scatter, ring_shift): the kind
// issued non-blocking, as the runtime issues gradient buckets, fully_shard's transfers and ring attention's shifts;
// Open MPI runs its non-blocking collectives by other algorithms than its blocking ones, at other speeds.
// bandwidth_gbs_by_kind: optional bus bandwidths measured per collective kind, which replace bandwidth_gbs for that
// kind: one MPI library's reduce_scatter may move bytes several times slower than its all_reduce (this machine's
// Open MPI does), and one figure for both would misplace fully_shard against data parallel.
// sync_us: optional, the wait one collective call adds, beyond its alpha-beta time, when its members arrive from
// computing as in a training step: with more CPU ranks than cores a member may not be scheduled when the others
// arrive, and the waiting ranks' polling takes cores from the computing ones. The wait grows with the work between
// two calls (the segment) and levels off near the scheduler's time slice, so it is given at segment lengths,
// {segment_ms: wait_us}: between two points it is interpolated, below the first it shrinks in proportion (calls back
// to back wait nothing more), past the last it stays the last's; a plain number is one wait at every segment.
// Calibration measures it; devices with a core each wait no such thing, so datasheet files leave it out.
struct LinkSpec {
  double bandwidth_gbs = 0;
  double latency_us = 0;
  std::map<std::string, double> bandwidth_gbs_by_kind;
  std::map<double, double> sync_us;  // segment ms -> wait us; {0: x} is the plain number x; empty: none
  LinkSpec() = default;
  LinkSpec(double bandwidth, double latency, std::map<std::string, double> by_kind = {})
      : bandwidth_gbs(bandwidth), latency_us(latency), bandwidth_gbs_by_kind(std::move(by_kind)) {}
  // The wait of one call after segment_s seconds of work, in seconds.
  double sync_seconds(double segment_s) const;
  // async: the collective issued non-blocking ("<kind>_async" when measured, else the kind's own figure).
  double bandwidth_for(const std::string& kind, bool async = false) const {
    if (async)
      if (auto it = bandwidth_gbs_by_kind.find(kind + "_async"); it != bandwidth_gbs_by_kind.end()) return it->second;
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
  // What an idle rank of meshtrain takes before any model, in MiB: code, libraries, MPI's buffers, the threads'
  // stacks (its resident set after MPI init; `estimate --calibrate` measures it). Optional; 0: the estimate's
  // documented default for CPU ranks (estimate.h's kDefaultRankFloorMib).
  double rank_floor_mb = 0;
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
// busbw. n <= 1: 0 (nothing leaves the rank). l.sync_us is not in it: it is per call (calls_seconds). A ring model: at thousands of ranks NCCL's trees have fewer steps,
// so small collectives there are over-estimated; large ones, which dominate a step, are bandwidth-bound either way.
// async: issued non-blocking (l.bandwidth_for's async figure).
double collective_seconds(const LinkSpec& l, const std::string& kind, double bytes_per_rank, int n, bool async = false);
// `calls` calls of kind on n ranks sending bytes_per_rank in all: one collective_seconds of the bytes and the message
// steps' latency of each further call. calls <= 0 or n <= 1: 0. The sync wait is the caller's to add
// (l.sync_seconds per call, where the node's cores are oversubscribed: `oversubscribed`).
double calls_seconds(const LinkSpec& l, const std::string& kind, double bytes_per_rank, int n, int64_t calls,
                     bool async = false);
// Whether a node's CPU ranks outnumber its cores: ranks_on_node x threads > cores_per_node (threads 0: train's
// default, cores / ranks, at least 1). Never for devices of their own (cores_per_node 0). Only then does a rank wait
// for members the scheduler has not run (LinkSpec::sync_us): with a core each, they all run.
bool oversubscribed(const ClusterSpec& c, int ranks_on_node, int threads);
// How many times slower a rank runs for sharing its node's cores: its threads over rank_share (4 for 8 one-thread
// ranks on 2 cores); 1 with devices of their own or a core per thread.
double core_oversubscription(const ClusterSpec& c, int ranks_on_node, int threads);

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
  // The sync loops: GEMM rows (segment lengths), calls per loop at the first (fewer at larger GEMMs, so that each
  // loop lasts about as long), timed rounds (the median of the samples taken).
  std::vector<int64_t> sync_rows = {256, 1024, 4096};
  int sync_calls = 32, sync_reps = 8;
  int64_t elementwise_elems = 16 << 20;  // f32 elements per tensor of the memory-bandwidth ops (past the caches)
  // On a CUDA device (comm.device cuda): the bandwidth sizes (what NVLink needs to approach its bus bandwidth) and
  // the bf16 elements per tensor of the memory-bandwidth ops (past a GPU's L2 cache).
  std::vector<int64_t> device_bandwidth_sizes = {1 << 20, 16 << 20, 64 << 20, 256 << 20};
  int64_t device_elementwise_elems = 64 << 20;
  bool quick = false;                    // smaller problems and fewer repetitions (tests); figures less exact
  // A cluster file whose node and network links are taken instead of measured (--links-from): what a machine of
  // one device (one rank, no link to measure) writes its file with; said in the file's source.
  std::string links_from;
};

// Measures this machine, on every rank of the job at once (collective over the world). CPU ranks (comm.device cpu),
// with training.threads threads per rank (0: the node's cores / its ranks, as train sets them):
//   peak        cpu_peak_flops()'s 768^3 GEMM (metrics.h) on one rank alone, per core, raised to the fastest rate
//               measured here so that every efficiency stays <= 1;
//   efficiency  GEMM (matmul forward+backward at N=2048, C=256..1024) and attention (local, causal, forward+
//               backward, T=256..1024, hd 32/64) rates with all ranks running, over the rank's peak;
//   memory      add_, rmsnorm, swiglu and adamw over 64 MiB tensors, bytes read + written per second;
//   links       all_reduce, all_gather, reduce_scatter, all_to_all and ring_shift in groups of every size n
//               dividing the world (node_by_ranks; `node` is the world's): latency from an 8-byte message, a
//               bandwidth per kind from 256K..16M ones (and of all_reduce, all_gather, reduce_scatter and
//               ring_shift issued non-blocking, "<kind>_async"), and bandwidth_gbs (broadcast, send) the blocking
//               kinds' median;
//               sync_us from loops of (a GEMM, a small collective) against the GEMMs alone, every rank running such
//               loops at once, at three GEMM sizes (sync_rows), the segment each one's time per GEMM.
// Compute figures are written per core (cores_per_node set), so that an estimate for another rank count scales them
// by rank_share; the links are not rescaled: they are this rank count's (calibrate with the rank count to estimate).
// Every rank is on one node: devices_per_node = its ranks, network = node (said in source). Needs >= 2 ranks.
// comm.device cuda: each rank's own CUDA device (rank_device's), the same measurements on device tensors in bf16
// (the training dtype on a GPU), each op timed up to the device's synchronisation: the peak is the fastest bf16 rate
// (matmul forward on 4096^2 and 8192^2 squares, or a rate measured if higher; fp32 from the 4096^2 square in f32);
// GEMMs at N=8192, C=1024..4096, attention T=2048..8192, 16-32 heads, hd 64/128; memory over 128 MiB bf16 tensors;
// the links on device buffers through the mesh's backend (nccl with a device per rank), at 1M..256M (no sync_us:
// a device per rank waits for no core). cores_per_node 0 (a device per rank: the figures are one device's);
// device_memory_gib the device's total memory (divided among ranks sharing one). --quick: tiny shapes (the
// emulated device of the tests).
ClusterSpec calibrate_cluster(const MpiEnv& env, const Config& cfg, const CalibrateOptions& opts = {});
// The floor of a rank of this binary in MiB: the most over the job's ranks of the resident-set high-water mark
// (ru_maxrss, what train's peak_mem_bytes reads) now, after MPI init and the config, before any model or data
// (collective over the world). calibrate_cluster writes it as rank_floor_mb.
double rank_floor_mib();
// Runs calibrate_cluster and, on rank 0, prints what it measured and writes out_path (checked writable before
// anything is measured, so that a bad path fails at once). Returns the exit code.
int run_calibrate(const RunContext& ctx, const std::string& out_path, const CalibrateOptions& opts = {});

}  // namespace mt
