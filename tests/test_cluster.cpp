// The cluster description (runtime/planner/cluster.h): the shipped H100 file, the YAML round trip, the errors naming
// the file and the key, the link a group uses, and the alpha-beta times against hand-computed values.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "check_error.h"
#include "runtime/planner/cluster.h"

using namespace mt;

namespace {

// A valid cluster file's text; tests break one key at a time.
const char* kValid = R"(name: "t"
devices_per_node: 4
device_memory_gib: 16
peak_tflops: {fp32: 10, bf16: 40}
node: {bandwidth_gbs: 100, latency_us: 2}
network: {bandwidth_gbs: 10, latency_us: 8}
gemm_efficiency: 0.5
attention_efficiency: 0.25
memory_bandwidth_gbs: 500
)";

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / fmt::format("mt_cluster_{}_{}", ::getpid(), name)).string();
}

std::string write_text(const std::string& name, const std::string& text) {
  const std::string p = temp_path(name);
  std::ofstream(p) << text;
  return p;
}

// kValid with the line starting with `key:` replaced by `line` ("" removes it).
std::string with_line(const std::string& key, const std::string& line) {
  std::string s = kValid, out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find('\n', pos);
    std::string l = s.substr(pos, end - pos);
    if (l.rfind(key + ":", 0) == 0) l = line;
    if (!l.empty()) out += l + "\n";
    pos = end + 1;
  }
  return out;
}

}  // namespace

TEST_CASE("cluster: h100_ib.yaml loads with the datasheet figures") {
  const ClusterSpec c = load_cluster(MT_SOURCE_DIR "/configs/clusters/h100_ib.yaml");
  CHECK(c.name == "h100_ib");
  CHECK(c.devices_per_node == 8);
  CHECK(c.device_memory_gib == doctest::Approx(79.6));
  CHECK(c.peak_tflops.at("bf16") == 989);
  CHECK(c.peak_tflops.at("fp32") == 67);
  CHECK(peak_flops(c, "bf16") == doctest::Approx(989e12));
  CHECK(c.node.bandwidth_gbs == 450);
  CHECK(c.network.bandwidth_gbs == 50);
  CHECK(c.node.latency_us > 0);
  CHECK(c.network.latency_us > c.node.latency_us);
  CHECK(c.node_by_ranks.empty());
  CHECK(c.cores_per_node == 0);  // a GPU per rank
  CHECK(c.gemm_efficiency == doctest::Approx(0.75));
  CHECK(c.attention_efficiency == doctest::Approx(0.5));
  CHECK(c.memory_bandwidth_gbs == doctest::Approx(2680));
  CHECK(c.source.find("datasheet") != std::string::npos);
}

TEST_CASE("cluster: write then load gives the same values") {
  ClusterSpec c = cluster_from_yaml(kValid, "valid.yaml");
  c.name = "round trip: 'quoted' \"and\" # not a comment";
  c.peak_tflops["fp32"] = 0.123456789012345;  // needs every digit to come back equal
  c.node.latency_us = 0;                      // a latency of 0 is allowed
  c.cores_per_node = 2;
  c.node_by_ranks[2] = {33.3, 1.25};
  c.node_by_ranks[4] = {12.5, 0.75, {{"reduce_scatter", 1.5}, {"all_reduce", 9.25}}};
  c.node_by_ranks[4].sync_us = {{1.75, 228}, {7.3, 1186.5}, {34.2, 1736}};  // a block link with waits
  c.network.sync_us = {{0, 12.5}};                                         // a flow link, one wait (a number)
  c.source = "line one\nline two: with a colon";
  const std::string p = temp_path("round_trip.yaml");
  write_cluster(c, p, "a header\nof two lines");
  const ClusterSpec r = load_cluster(p);
  CHECK(r.file == p);
  CHECK(r.name == c.name);
  CHECK(r.devices_per_node == c.devices_per_node);
  CHECK(r.device_memory_gib == c.device_memory_gib);
  CHECK(r.cores_per_node == 2);
  CHECK(r.peak_tflops == c.peak_tflops);
  CHECK(r.node.bandwidth_gbs == c.node.bandwidth_gbs);
  CHECK(r.node.latency_us == 0);
  CHECK(r.network.bandwidth_gbs == c.network.bandwidth_gbs);
  CHECK(r.network.latency_us == c.network.latency_us);
  REQUIRE(r.node_by_ranks.size() == 2);
  CHECK(r.node_by_ranks.at(2).bandwidth_gbs == 33.3);
  CHECK(r.node_by_ranks.at(4).latency_us == 0.75);
  CHECK(r.node_by_ranks.at(4).bandwidth_gbs_by_kind == c.node_by_ranks.at(4).bandwidth_gbs_by_kind);
  CHECK(r.node_by_ranks.at(2).bandwidth_gbs_by_kind.empty());
  CHECK(r.node_by_ranks.at(4).sync_us == c.node_by_ranks.at(4).sync_us);
  CHECK(r.node_by_ranks.at(2).sync_us.empty());
  CHECK(r.network.sync_us == c.network.sync_us);
  CHECK(r.node.sync_us.empty());
  CHECK(r.gemm_efficiency == c.gemm_efficiency);
  CHECK(r.attention_efficiency == c.attention_efficiency);
  CHECK(r.memory_bandwidth_gbs == c.memory_bandwidth_gbs);
  CHECK(r.source == c.source);
  std::ifstream in(p);
  std::string first;
  std::getline(in, first);
  CHECK(first == "# a header");
  std::filesystem::remove(p);
  // name defaults to the file's stem.
  const std::string q = write_text("stem_name.yaml", with_line("name", ""));
  CHECK(load_cluster(q).name == fmt::format("mt_cluster_{}_stem_name", ::getpid()));
  std::filesystem::remove(q);
}

TEST_CASE("cluster: each bad input is an error naming the file and the key") {
  auto bad = [](const std::string& yaml) { return cluster_from_yaml(yaml, "bad.yaml"); };
  // Each YAML text and the error it gives.
  const std::vector<std::pair<std::string, std::string>> errors{
      // Missing fields, at the top and inside a link.
      {with_line("gemm_efficiency", ""), "[cluster] bad.yaml: missing key 'gemm_efficiency'"},
      {with_line("network", ""), "[cluster] bad.yaml: missing key 'network'"},
      {with_line("node", "node: {bandwidth_gbs: 100}"), "[cluster] bad.yaml: missing key 'node.latency_us'"},
      // Non-positive bandwidths, a negative latency, memory, device count, peak.
      {with_line("node", "node: {bandwidth_gbs: 0, latency_us: 2}"),
       "[cluster] bad.yaml: node.bandwidth_gbs = 0: expected a bandwidth in GB/s > 0"},
      {with_line("network", "network: {bandwidth_gbs: -5, latency_us: 2}"), "bad.yaml: network.bandwidth_gbs = -5"},
      {with_line("network", "network: {bandwidth_gbs: 5, latency_us: -1}"),
       "bad.yaml: network.latency_us = -1: expected a latency in microseconds >= 0"},
      {with_line("memory_bandwidth_gbs", "memory_bandwidth_gbs: 0"), "bad.yaml: memory_bandwidth_gbs = 0"},
      {with_line("device_memory_gib", "device_memory_gib: .nan"), "bad.yaml: device_memory_gib = nan"},
      {with_line("devices_per_node", "devices_per_node: 0"), "bad.yaml: devices_per_node = 0"},
      {std::string(kValid) + "cores_per_node: -2\n", "bad.yaml: cores_per_node = -2"},
      {with_line("peak_tflops", "peak_tflops: {fp32: 0}"), "bad.yaml: peak_tflops.fp32 = 0"},
      {with_line("peak_tflops", "peak_tflops: {}"), "bad.yaml: peak_tflops: expected at least"},
      // Efficiencies outside (0, 1].
      {with_line("gemm_efficiency", "gemm_efficiency: 1.5"),
       "[cluster] bad.yaml: gemm_efficiency = 1.5: expected a fraction of peak in (0, 1]"},
      {with_line("attention_efficiency", "attention_efficiency: 0"), "bad.yaml: attention_efficiency = 0"},
      // Unknown keys and dtypes, with a suggestion.
      {std::string(kValid) + "gemm_eficiency: 0.5\n",
       "[cluster] bad.yaml: unknown key 'gemm_eficiency' (known keys in 'the top level': name, devices_per_node"},
      {std::string(kValid) + "gemm_eficiency: 0.5\n", "did you mean 'gemm_efficiency'?"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, lat: 2}"),
       "bad.yaml: unknown key 'node.lat' (known keys in 'node': bandwidth_gbs, latency_us, bandwidth_gbs_by_kind, "
       "sync_us)"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, bandwidth_gbs_by_kind: {allreduce: 2}}"),
       "bad.yaml: unknown key 'node.bandwidth_gbs_by_kind.allreduce' (known keys in "
       "'node.bandwidth_gbs_by_kind': all_reduce, all_gather"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, bandwidth_gbs_by_kind: {reduce_scatter: 0}}"),
       "bad.yaml: node.bandwidth_gbs_by_kind.reduce_scatter = 0: expected a bandwidth in GB/s > 0"},
      {with_line("peak_tflops", "peak_tflops: {fp8: 1979}"), "bad.yaml: peak_tflops.fp8: unknown dtype"},
      {std::string(kValid) + "gemm_efficiency: 0.6\n", "bad.yaml: duplicate key 'gemm_efficiency'"},
      // Wrong types and shapes.
      {with_line("node", "node: 100"), "bad.yaml: node: expected a map of keys, got '100'"},
      {with_line("gemm_efficiency", "gemm_efficiency: fast"),
       "bad.yaml: gemm_efficiency: expected a number, got 'fast'"},
      {with_line("devices_per_node", "devices_per_node: 2.5"),
       "bad.yaml: devices_per_node: expected an integer, got '2.5'"},
      {"- a\n- b\n", "bad.yaml: the top level: expected a map of keys, got a list"},
      {"", "bad.yaml: the top level: expected a map of keys, got nothing"},
      // "<kind>_async" bandwidths only for the kinds the runtime issues non-blocking.
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, bandwidth_gbs_by_kind: {broadcast_async: 3}}"),
       "bad.yaml: unknown key 'node.bandwidth_gbs_by_kind.broadcast_async'"},
      // sync_us: waits and segments >= 0, segment keys numbers, each once.
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, sync_us: -3}"),
       "bad.yaml: node.sync_us = -3 at a segment of 0 ms: expected a wait in microseconds >= 0"},
      {with_line("network", "network: {bandwidth_gbs: 1, latency_us: 1, sync_us: {2: 5, -1: 3}}"),
       "bad.yaml: network.sync_us has a segment of -1 ms: expected a length in milliseconds >= 0"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, sync_us: {soon: 5}}"),
       "bad.yaml: node.sync_us.soon (a segment in ms): expected a number, got 'soon'"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, sync_us: {2: 5, 2.0: 6}}"),
       "bad.yaml: duplicate segment 'node.sync_us.2.0'"},
      {with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, sync_us: {2: x}}"),
       "bad.yaml: node.sync_us.2: expected a number, got 'x'"},
      // node_by_ranks: sizes from 2 to devices_per_node, each a link.
      {std::string(kValid) + "node_by_ranks: {8: {bandwidth_gbs: 1, latency_us: 1}}\n",
       "bad.yaml: node_by_ranks.8: expected a group size from 2 to devices_per_node = 4"},
      {std::string(kValid) + "node_by_ranks: {2: {bandwidth_gbs: 0, latency_us: 1}}\n",
       "bad.yaml: node_by_ranks.2.bandwidth_gbs = 0"},
  };
  for (const auto& [yaml, error] : errors) CHECK_ERROR_CONTAINS(bad(yaml), error);
  // "<kind>_async" bandwidths for the kinds the runtime issues non-blocking.
  CHECK(bad(with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, bandwidth_gbs_by_kind: {all_reduce_async: 3}}"))
            .node.bandwidth_for("all_reduce", true) == 3);
  // sync_us: a wait in microseconds.
  CHECK(bad(with_line("node", "node: {bandwidth_gbs: 1, latency_us: 1, sync_us: 40}")).node.sync_us.at(0) == 40);
  // Not YAML, and no file at all.
  const std::string p = write_text("not_yaml.yaml", "node: {bandwidth_gbs: [1, 2\n");
  CHECK_ERROR_CONTAINS(load_cluster(p), "[cluster] " + p + ": YAML error at line");
  std::filesystem::remove(p);
  CHECK_ERROR_CONTAINS(load_cluster("/nonexistent/dir/c.yaml"), "cannot read cluster file '/nonexistent/dir/c.yaml'");
  // A peak the file lacks, asked for by dtype.
  CHECK_ERROR_CONTAINS(
      peak_flops(cluster_from_yaml(with_line("peak_tflops", "peak_tflops: {fp32: 1}"), "f.yaml"), "bf16"),
      "[cluster] f.yaml: peak_tflops has no entry for 'bf16' (it gives fp32)");
  // Writing checks too, and names an unwritable path.
  ClusterSpec c = cluster_from_yaml(kValid);
  const std::string file = write_text("a_file", "x");  // a path under a file cannot be written, even by root
  CHECK_ERROR_CONTAINS(write_cluster(c, file + "/b.yaml", ""), "cannot write '" + file + "/b.yaml'");
  std::filesystem::remove(file);
  c.gemm_efficiency = 2;
  c.file = "";
  CHECK_ERROR_CONTAINS(write_cluster(c, temp_path("never.yaml"), ""), "<cluster>: gemm_efficiency = 2");
}

TEST_CASE("cluster: link_for picks the node's link when every member is on one node") {
  ClusterSpec c = cluster_from_yaml(kValid);  // 4 devices per node
  CHECK(&link_for(c, {0, 1, 2, 3}) == &c.node);
  CHECK(&link_for(c, {4, 6}) == &c.node);
  CHECK(&link_for(c, {3, 4}) == &c.network);  // ranks 3 and 4 straddle nodes 0 and 1
  CHECK(&link_for(c, {0, 4, 8, 12}) == &c.network);
  CHECK(&link_for(c, {5}) == &c.node);
  CHECK(&link_for(c, {}) == &c.node);
  // A measured size inside a node wins over `node`; across nodes the network still applies.
  c.node_by_ranks[2] = {7, 0.5};
  CHECK(&link_for(c, {4, 5}) == &c.node_by_ranks.at(2));
  CHECK(inside_one_node(c, {4, 5}));
  CHECK_FALSE(inside_one_node(c, {3, 4}));
  CHECK(&link_for(c, {0, 1, 2, 3}) == &c.node);
  CHECK(&link_for(c, {3, 4}) == &c.network);
  c.devices_per_node = 1;  // every rank its own node
  CHECK(&link_for(c, {0, 1}) == &c.network);
}

TEST_CASE("cluster: collective_seconds is steps x latency + bytes / bandwidth") {
  const LinkSpec l{100, 2};  // 100 GB/s, 2 us per step
  // all_reduce of a 1 GB buffer on 4 ranks: sends 2 * 3/4 GB = 1.5e9 bytes in 6 steps.
  CHECK(collective_seconds(l, "all_reduce", 1.5e9, 4) == doctest::Approx(6 * 2e-6 + 1.5e9 / 100e9));
  // all_gather of 8 ranks, 7 steps; 7e8 bytes sent.
  CHECK(collective_seconds(l, "all_gather", 7e8, 8) == doctest::Approx(7 * 2e-6 + 7e-3));
  CHECK(collective_seconds(l, "reduce_scatter", 0, 8) == doctest::Approx(14e-6));
  CHECK(collective_seconds(l, "all_to_all", 3e6, 4) == doctest::Approx(6e-6 + 3e-5));
  // broadcast: a binomial tree, ceil(log2 n) steps.
  CHECK(collective_seconds(l, "broadcast", 1e9, 8) == doctest::Approx(3 * 2e-6 + 1e-2));
  CHECK(collective_steps("broadcast", 5) == 3);
  CHECK(collective_steps("barrier", 2) == 1);
  CHECK(collective_seconds(l, "ring_shift", 1e6, 2) == doctest::Approx(2e-6 + 1e-5));
  CHECK(collective_seconds(l, "send", 1e6, 2) == doctest::Approx(2e-6 + 1e-5));
  CHECK(collective_seconds(l, "recv", 0, 2) == 0);
  // One rank: nothing leaves it.
  CHECK(collective_seconds(l, "all_reduce", 1e9, 1) == 0);
  // nccl-tests' relation: time = size x bus factor / busbw, so a busbw figure and this model agree.
  const double size = 256e6, n = 8, t = collective_seconds({400, 0}, "all_reduce", size * 2 * (n - 1) / n, int(n));
  CHECK(size / t * 2 * (n - 1) / n / 1e9 == doctest::Approx(400));
  // A kind measured on its own uses its own bandwidth; the others bandwidth_gbs.
  const LinkSpec m{100, 2, {{"reduce_scatter", 10}}};
  CHECK(collective_seconds(m, "reduce_scatter", 7e8, 8) == doctest::Approx(7 * 2e-6 + 7e8 / 10e9));
  CHECK(collective_seconds(m, "all_gather", 7e8, 8) == doctest::Approx(7 * 2e-6 + 7e8 / 100e9));
  // Issued non-blocking: "<kind>_async" where the link has it, else the kind's own figure.
  const LinkSpec a{100, 2, {{"all_reduce", 20}, {"all_reduce_async", 5}}};
  CHECK(a.bandwidth_for("all_reduce", true) == 5);
  CHECK(a.bandwidth_for("all_reduce") == 20);
  CHECK(a.bandwidth_for("all_gather", true) == 100);
  CHECK(collective_seconds(a, "all_reduce", 1e9, 2, true) == doctest::Approx(2 * 2e-6 + 1e9 / 5e9));
  CHECK(calls_seconds(a, "all_reduce", 1e9, 2, 2, true) == doctest::Approx(4 * 2e-6 + 1e9 / 5e9));
  // calls_seconds: the bytes once, each further call's steps (the sync wait is the estimate's to add).
  CHECK(calls_seconds(l, "all_gather", 7e8, 8, 3) == doctest::Approx(3 * 7 * 2e-6 + 7e-3));
  CHECK(calls_seconds(l, "all_gather", 7e8, 8, 0) == 0);
  CHECK(calls_seconds(l, "all_gather", 7e8, 1, 3) == 0);  // one rank: nothing leaves it
  LinkSpec s{100, 2};
  s.sync_us = {{2, 100}, {10, 500}, {40, 800}};  // segment ms -> wait us
  CHECK(s.sync_seconds(0) == 0);                              // back to back: no wait
  CHECK(s.sync_seconds(1e-3) == doctest::Approx(50e-6));      // below the first point: in proportion
  CHECK(s.sync_seconds(2e-3) == doctest::Approx(100e-6));
  CHECK(s.sync_seconds(6e-3) == doctest::Approx(300e-6));     // interpolated
  CHECK(s.sync_seconds(25e-3) == doctest::Approx(650e-6));
  CHECK(s.sync_seconds(0.5) == doctest::Approx(800e-6));      // past the last: levels off
  s.sync_us = {{0, 40}};  // a plain number: one wait at every segment
  CHECK(s.sync_seconds(0) == doctest::Approx(40e-6));
  CHECK(s.sync_seconds(1) == doctest::Approx(40e-6));
  CHECK_ERROR_CONTAINS(collective_seconds(l, "allreduce", 1, 4), "[cluster] unknown collective kind 'allreduce'");
  CHECK_ERROR_CONTAINS(collective_seconds(l, "allreduce", 1, 1), "unknown collective kind 'allreduce'");
  CHECK_ERROR_CONTAINS(collective_seconds(l, "all_reduce", -1, 4), "expected bytes >= 0");
}

TEST_CASE("cluster: attention FLOPs count the causal half") {
  CHECK(attention_forward_flops(1, 1024, 1024, 8, 64, false) == 4.0 * 1024 * 1024 * 8 * 64);
  CHECK(attention_forward_flops(2, 1024, 1024, 8, 64, true) == 4.0 * 1024 * 1024 * 8 * 64);
  CHECK(attention_forward_flops(1, 256, 1024, 8, 64, true) == 4.0 * 256 * 1024 * 8 * 64);  // not square: unmasked
  CHECK(kAttentionBackwardFactor == 2.5);
}

TEST_CASE("cluster: a rank's share of a device, or of shared cores") {
  ClusterSpec c = cluster_from_yaml(kValid);  // peak fp32 10 TFLOP/s, 500 GB/s
  // A device per rank: the device's figures whatever the ranks and threads.
  CHECK(rank_share(c, 8, 0) == 1);
  CHECK(rank_peak_flops(c, "fp32", 4, 3) == doctest::Approx(10e12));
  CHECK(rank_memory_bandwidth(c, 4, 3) == doctest::Approx(500e9));
  // CPU ranks on 2 cores: figures per core, a rank gets min(threads, cores / ranks).
  c.cores_per_node = 2;
  CHECK(rank_share(c, 8, 1) == doctest::Approx(0.25));
  CHECK(rank_share(c, 2, 1) == doctest::Approx(1));
  CHECK(rank_share(c, 1, 1) == doctest::Approx(1));  // one thread uses one core, whatever is free
  CHECK(rank_share(c, 1, 0) == doctest::Approx(2));  // train's default: the node's cores / its ranks
  CHECK(rank_share(c, 1, 4) == doctest::Approx(2));  // more threads than cores: still 2 cores
  CHECK(rank_share(c, 4, 0) == doctest::Approx(0.5));
  CHECK(rank_peak_flops(c, "bf16", 8, 1) == doctest::Approx(40e12 * 0.25));
  CHECK(rank_memory_bandwidth(c, 2, 1) == doctest::Approx(500e9));
  // Oversubscribed (the sync wait applies): more threads on the node than cores.
  CHECK_FALSE(oversubscribed(c, 2, 1));
  CHECK_FALSE(oversubscribed(c, 2, 0));
  CHECK_FALSE(oversubscribed(c, 1, 2));
  CHECK(oversubscribed(c, 4, 1));
  CHECK(oversubscribed(c, 4, 0));  // train's default is still a thread each
  CHECK(oversubscribed(c, 2, 2));  // 4 threads on 2 cores
  c.cores_per_node = 0;            // a device each: never
  CHECK_FALSE(oversubscribed(c, 64, 8));
}
