// The time model of cluster.h: a rank's share of a node's cores and peaks, the links' alpha-beta collective
// times, the wait a collective adds after computing (LinkSpec::sync_seconds).
#include <algorithm>
#include <iterator>

#include "runtime/core/log.h"
#include "runtime/planner/cluster.h"
#include "runtime/planner/cluster_internal.h"

namespace mt {

using cluster_detail::kinds_list;
using cluster_detail::known_kind;

double peak_flops(const ClusterSpec& c, const std::string& dtype) {
  auto it = c.peak_tflops.find(dtype);
  if (it == c.peak_tflops.end()) {
    std::string have;
    for (auto& [dt, x] : c.peak_tflops) have += (have.empty() ? "" : ", ") + dt;
    fail("cluster", "{}: peak_tflops has no entry for '{}' (it gives {}): add the device's {} peak",
         c.file.empty() ? "<cluster>" : c.file, dtype, have.empty() ? "none" : have, dtype);
  }
  return it->second * 1e12;
}

namespace {
// A rank's threads on shared cores: threads, or train's default for 0 (the node's cores / its ranks, at least 1).
int rank_threads(const ClusterSpec& c, int ranks_on_node, int threads) {
  MT_CHECK(ranks_on_node >= 1 && threads >= 0, "cluster", "{} ranks on the node, {} threads", ranks_on_node, threads);
  return threads > 0 ? threads : std::max(1, c.cores_per_node / ranks_on_node);
}
}  // namespace

double rank_share(const ClusterSpec& c, int ranks_on_node, int threads) {
  if (c.cores_per_node <= 0) return 1;
  return std::min(double(rank_threads(c, ranks_on_node, threads)), double(c.cores_per_node) / ranks_on_node);
}

double core_oversubscription(const ClusterSpec& c, int ranks_on_node, int threads) {
  if (c.cores_per_node <= 0) return 1;
  return std::max(1.0, double(rank_threads(c, ranks_on_node, threads)) / rank_share(c, ranks_on_node, threads));
}

double rank_peak_flops(const ClusterSpec& c, const std::string& dtype, int ranks_on_node, int threads) {
  return peak_flops(c, dtype) * rank_share(c, ranks_on_node, threads);
}

double rank_memory_bandwidth(const ClusterSpec& c, int ranks_on_node, int threads) {
  return c.memory_bandwidth_gbs * 1e9 * rank_share(c, ranks_on_node, threads);
}

// ---- The time model ----

bool inside_one_node(const ClusterSpec& c, const std::vector<int>& world_ranks) {
  MT_CHECK(c.devices_per_node >= 1, "cluster", "devices_per_node = {}: expected >= 1", c.devices_per_node);
  for (int r : world_ranks)
    if (r / c.devices_per_node != world_ranks.front() / c.devices_per_node) return false;
  return true;
}

const LinkSpec& link_for(const ClusterSpec& c, const std::vector<int>& world_ranks) {
  if (!inside_one_node(c, world_ranks)) return c.network;
  auto it = c.node_by_ranks.find(int(world_ranks.size()));
  return it != c.node_by_ranks.end() ? it->second : c.node;
}

int collective_steps(const std::string& kind, int n) {
  // A misspelt kind is an error whatever n.
  if (!known_kind(kind)) fail("cluster", "unknown collective kind '{}' (known: {})", kind, kinds_list());
  if (n <= 1) return 0;
  if (kind == "all_reduce") return 2 * (n - 1);
  if (kind == "all_gather" || kind == "reduce_scatter" || kind == "all_to_all") return n - 1;
  if (kind == "broadcast" || kind == "barrier") {
    int steps = 0;
    while ((1 << steps) < n) ++steps;  // ceil(log2 n)
    return steps;
  }
  if (kind == "ring_shift" || kind == "send") return 1;
  return 0;  // recv
}

double collective_seconds(const LinkSpec& l, const std::string& kind, double bytes_per_rank, int n, bool async) {
  const int steps = collective_steps(kind, n);
  MT_CHECK(bytes_per_rank >= 0, "cluster", "collective_seconds: {} of {} bytes: expected bytes >= 0", kind,
           bytes_per_rank);
  if (n <= 1) return 0;
  const double bw = l.bandwidth_for(kind, async);
  MT_CHECK(bw > 0, "cluster", "collective_seconds: {} on a link of bandwidth {} GB/s", kind, bw);
  return steps * l.latency_us * 1e-6 + bytes_per_rank / (bw * 1e9);
}

double LinkSpec::sync_seconds(double segment_s) const {
  if (sync_us.empty()) return 0;
  const double ms = std::max(0.0, segment_s * 1e3);
  auto hi = sync_us.lower_bound(ms);
  if (hi == sync_us.begin()) return (hi->first > 0 ? hi->second * ms / hi->first : hi->second) * 1e-6;
  if (hi == sync_us.end()) return std::prev(hi)->second * 1e-6;
  auto lo = std::prev(hi);
  const double f = (ms - lo->first) / (hi->first - lo->first);
  return (lo->second + f * (hi->second - lo->second)) * 1e-6;
}

double calls_seconds(const LinkSpec& l, const std::string& kind, double bytes_per_rank, int n, int64_t calls,
                     bool async) {
  if (calls <= 0 || n <= 1) return 0;
  return collective_seconds(l, kind, bytes_per_rank, n, async) +
         double(calls - 1) * collective_seconds(l, kind, 0, n, async);
}

bool oversubscribed(const ClusterSpec& c, int ranks_on_node, int threads) {
  return core_oversubscription(c, ranks_on_node, threads) > 1;  // ranks x threads > cores
}

double attention_forward_flops(double B, double T, double S, double H, double hd, bool causal) {
  const double f = 4.0 * B * T * S * H * hd;
  return causal && T == S ? 0.5 * f : f;
}

}  // namespace mt
