// Cluster files (cluster.h): the spec read from YAML with every error naming the file and key, checked, and
// written back. The time model is in time_model.cpp, the calibration that measures this machine in calibrate.cpp.
#include "runtime/planner/cluster.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/core/log.h"
#include "runtime/planner/cluster_internal.h"

namespace mt {

namespace cluster_detail {

extern const std::vector<std::string> kKinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                                "barrier",    "ring_shift", "send",           "recv"};
extern const std::vector<std::string> kAsyncKinds = {"all_reduce", "all_gather", "reduce_scatter", "ring_shift"};
std::string kinds_list(const std::vector<std::string>& kinds) {
  std::string r;
  for (auto& k : kinds) r += (r.empty() ? "" : ", ") + k;
  return r;
}
bool known_kind(const std::string& k) { return std::find(kKinds.begin(), kKinds.end(), k) != kKinds.end(); }

}  // namespace cluster_detail

namespace {

using cluster_detail::kAsyncKinds;
using cluster_detail::kinds_list;
using cluster_detail::kKinds;

// ---- Reading ----

const std::vector<std::string> kDtypes = {"fp32", "bf16", "fp64"};  // training.dtype's values
const std::vector<std::string> kLinkKeys = {"bandwidth_gbs", "latency_us", "bandwidth_gbs_by_kind", "sync_us"};
// bandwidth_gbs_by_kind's keys: the kinds, and "<kind>_async" for those the runtime also issues non-blocking.
std::vector<std::string> by_kind_keys() {
  std::vector<std::string> keys = kKinds;
  for (auto& k : kAsyncKinds) keys.push_back(k + "_async");
  return keys;
}
// The top-level keys, in the order write_cluster writes them, with what each is (for "missing key" messages).
const std::vector<std::pair<std::string, std::string>> kTopKeys = {
    {"name", "the cluster's name"},
    {"devices_per_node", "ranks (GPUs) per node"},
    {"device_memory_gib", "memory per device in GiB"},
    {"cores_per_node", "CPU ranks: the cores a node's ranks share (0: a device per rank)"},
    {"peak_tflops", "dense peak TFLOP/s per dtype, e.g. {bf16: 989, fp32: 67}"},
    {"node", "the link inside a node: {bandwidth_gbs, latency_us}"},
    {"network", "the link across nodes: {bandwidth_gbs, latency_us}"},
    {"node_by_ranks", "measured links of groups of n ranks inside a node"},
    {"gemm_efficiency", "fraction of peak GEMMs reach, in (0, 1]"},
    {"attention_efficiency", "fraction of peak attention reaches, in (0, 1]"},
    {"memory_bandwidth_gbs", "memory bandwidth elementwise ops reach, GB/s"},
    {"rank_floor_mb", "an idle rank's resident memory in MiB (after MPI init, before any model)"},
    {"source", "where the figures come from"},
};
const std::set<std::string> kOptionalKeys = {"name", "cores_per_node", "node_by_ranks", "rank_floor_mb", "source"};

std::string origin(const std::string& file) { return file.empty() ? "<string>" : file; }

std::string describe(const YAML::Node& n) {
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing";
  return "'" + n.Scalar() + "'";
}

// Reads one file's keys; every error names the file and the key path.
struct ClusterReader {
  std::string file;

  [[noreturn]] void bad(const std::string& msg) const { fail("cluster", "{}: {}", origin(file), msg); }

  template <class T> T scalar(const YAML::Node& n, const std::string& key, const char* expected) const {
    if (!n.IsScalar()) bad(fmt::format("{}: expected {}, got {}", key, expected, describe(n)));
    try {
      return n.as<T>();
    } catch (const YAML::Exception&) {
      bad(fmt::format("{}: expected {}, got {}", key, expected, describe(n)));
    }
  }
  double number(const YAML::Node& n, const std::string& key) const { return scalar<double>(n, key, "a number"); }

  // The map's keys are names, none twice, all known; section "" is the top level.
  void check_keys(const YAML::Node& m, const std::string& section, const std::vector<std::string>& known) const {
    const std::string where = section.empty() ? "the top level" : section;
    if (!m.IsMap()) bad(fmt::format("{}: expected a map of keys, got {}", where, describe(m)));
    std::set<std::string> seen;
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (!it->first.IsScalar()) bad(fmt::format("{}: keys must be names, got {}", where, describe(it->first)));
      const std::string key = it->first.Scalar();
      const std::string full = section.empty() ? key : section + "." + key;
      // yaml-cpp keeps the first of two equal keys: the second, silently dropped, would hide an edit.
      if (!seen.insert(key).second) bad(fmt::format("duplicate key '{}'", full));
      if (known.empty() || std::find(known.begin(), known.end(), key) != known.end()) continue;
      std::string names;
      for (auto& k : known) names += (names.empty() ? "" : ", ") + k;
      const std::string best = nearest_name(key, known);
      bad(fmt::format("unknown key '{}' (known keys in '{}': {}){}", full, where, names,
                      best.empty() ? "" : fmt::format("; did you mean '{}'?", best)));
    }
  }

  LinkSpec link(const YAML::Node& n, const std::string& key) const {
    check_keys(n, key, kLinkKeys);
    LinkSpec l;
    for (const char* k : {"bandwidth_gbs", "latency_us"})
      if (!n[k]) bad(fmt::format("missing key '{}.{}'", key, k));
    l.bandwidth_gbs = number(n["bandwidth_gbs"], key + ".bandwidth_gbs");
    l.latency_us = number(n["latency_us"], key + ".latency_us");
    if (const YAML::Node sy = n["sync_us"]; sy && !sy.IsNull()) {
      const std::string sk = key + ".sync_us";
      if (sy.IsMap()) {
        for (auto it = sy.begin(); it != sy.end(); ++it) {
          const std::string at = sk + "." + it->first.Scalar();
          const double ms = number(it->first, at + " (a segment in ms)");
          if (!l.sync_us.emplace(ms, number(it->second, at)).second) bad(fmt::format("duplicate segment '{}'", at));
        }
      } else {
        l.sync_us[0] = number(sy, sk);
      }
    }
    if (const YAML::Node by = n["bandwidth_gbs_by_kind"]; by && !by.IsNull()) {
      const std::string bk = key + ".bandwidth_gbs_by_kind";
      check_keys(by, bk, by_kind_keys());
      for (auto it = by.begin(); it != by.end(); ++it)
        l.bandwidth_gbs_by_kind[it->first.Scalar()] = number(it->second, bk + "." + it->first.Scalar());
    }
    return l;
  }

  ClusterSpec read(const YAML::Node& root) const {
    std::vector<std::string> known;
    for (auto& [k, what] : kTopKeys) known.push_back(k);
    check_keys(root, "", known);
    for (auto& [k, what] : kTopKeys)
      if (!kOptionalKeys.count(k) && !root[k]) bad(fmt::format("missing key '{}' ({})", k, what));
    ClusterSpec c;
    c.file = file;
    c.name = root["name"] ? scalar<std::string>(root["name"], "name", "a string")
                          : std::filesystem::path(file).stem().string();
    c.devices_per_node = scalar<int>(root["devices_per_node"], "devices_per_node", "an integer");
    c.device_memory_gib = number(root["device_memory_gib"], "device_memory_gib");
    if (root["cores_per_node"]) c.cores_per_node = scalar<int>(root["cores_per_node"], "cores_per_node", "an integer");
    const YAML::Node peak = root["peak_tflops"];
    check_keys(peak, "peak_tflops", {});
    for (auto it = peak.begin(); it != peak.end(); ++it) {
      const std::string dt = it->first.Scalar();
      if (std::find(kDtypes.begin(), kDtypes.end(), dt) == kDtypes.end())
        bad(fmt::format("peak_tflops.{}: unknown dtype (known: fp32, bf16, fp64, the values of training.dtype)", dt));
      c.peak_tflops[dt] = number(it->second, "peak_tflops." + dt);
    }
    c.node = link(root["node"], "node");
    c.network = link(root["network"], "network");
    if (const YAML::Node by = root["node_by_ranks"]; by && !by.IsNull()) {
      check_keys(by, "node_by_ranks", {});
      for (auto it = by.begin(); it != by.end(); ++it) {
        const std::string key = "node_by_ranks." + it->first.Scalar();
        const int n = scalar<int>(it->first, key, "a rank count as the key");
        c.node_by_ranks[n] = link(it->second, key);
      }
    }
    c.gemm_efficiency = number(root["gemm_efficiency"], "gemm_efficiency");
    c.attention_efficiency = number(root["attention_efficiency"], "attention_efficiency");
    c.memory_bandwidth_gbs = number(root["memory_bandwidth_gbs"], "memory_bandwidth_gbs");
    if (root["rank_floor_mb"]) c.rank_floor_mb = number(root["rank_floor_mb"], "rank_floor_mb");
    if (root["source"])
      c.source = root["source"].IsNull() ? "" : scalar<std::string>(root["source"], "source", "a string");
    return c;
  }
};

// ---- Writing ----

std::string quoted(const std::string& s) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << s;
  return e.c_str();
}
// Shortest text that reads back to the same double.
std::string num(double x) { return fmt::format("{}", x); }
// A link as one flow map, or as a block (indented by indent) when it has per-kind bandwidths, one line each.
std::string sync_yaml(const LinkSpec& l) {
  if (l.sync_us.size() == 1 && l.sync_us.begin()->first == 0) return num(l.sync_us.begin()->second);
  std::string y;
  for (auto& [ms, us] : l.sync_us) y += fmt::format("{}{}: {}", y.empty() ? "" : ", ", num(ms), num(us));
  return "{" + y + "}";
}
std::string link_yaml(const LinkSpec& l, const std::string& indent) {
  const std::string sync = l.sync_us.empty() ? "" : fmt::format(", sync_us: {}", sync_yaml(l));
  if (l.bandwidth_gbs_by_kind.empty())
    return fmt::format(" {{bandwidth_gbs: {}, latency_us: {}{}}}\n", num(l.bandwidth_gbs), num(l.latency_us), sync);
  std::string y = fmt::format("\n{0}bandwidth_gbs: {1}\n{0}latency_us: {2}\n", indent, num(l.bandwidth_gbs),
                              num(l.latency_us));
  if (!l.sync_us.empty()) y += fmt::format("{}sync_us: {}\n", indent, sync_yaml(l));
  y += fmt::format("{}bandwidth_gbs_by_kind:\n", indent);
  for (auto& [k, x] : l.bandwidth_gbs_by_kind) y += fmt::format("{}  {}: {}\n", indent, k, num(x));
  return y;
}

}  // namespace

// ---- The file ----

ClusterSpec cluster_from_yaml(const std::string& yaml, const std::string& file) {
  ClusterReader r{file};
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    r.bad(fmt::format("YAML error at line {}, column {}: {}", e.mark.line + 1, e.mark.column + 1, e.msg));
  }
  ClusterSpec c;
  try {
    c = r.read(root);
  } catch (const YAML::Exception& e) {
    // A yaml-cpp corner not checked above still leaves as a cluster error, not a bare library one.
    r.bad(e.what());
  }
  check_cluster(c);
  return c;
}

ClusterSpec load_cluster(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cluster", "cannot read cluster file '{}': {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return cluster_from_yaml(ss.str(), path);
}

void check_cluster(const ClusterSpec& c) {
  const std::string f = c.file.empty() ? "<cluster>" : c.file;
  auto positive = [&](const std::string& key, double x, const char* what) {
    if (!(std::isfinite(x) && x > 0)) fail("cluster", "{}: {} = {}: expected {} > 0", f, key, x, what);
  };
  auto link = [&](const std::string& key, const LinkSpec& l) {
    positive(key + ".bandwidth_gbs", l.bandwidth_gbs, "a bandwidth in GB/s");
    if (!(std::isfinite(l.latency_us) && l.latency_us >= 0))
      fail("cluster", "{}: {}.latency_us = {}: expected a latency in microseconds >= 0", f, key, l.latency_us);
    for (auto& [ms, us] : l.sync_us) {
      if (!(std::isfinite(ms) && ms >= 0))
        fail("cluster", "{}: {}.sync_us has a segment of {} ms: expected a length in milliseconds >= 0", f, key, ms);
      if (!(std::isfinite(us) && us >= 0))
        fail("cluster", "{}: {}.sync_us = {} at a segment of {} ms: expected a wait in microseconds >= 0", f, key, us,
             ms);
    }
    const auto keys = by_kind_keys();
    for (auto& [kind, x] : l.bandwidth_gbs_by_kind) {
      if (std::find(keys.begin(), keys.end(), kind) == keys.end())
        fail("cluster", "{}: {}.bandwidth_gbs_by_kind.{}: unknown collective kind (known: {})", f, key, kind,
             kinds_list(keys));
      positive(key + ".bandwidth_gbs_by_kind." + kind, x, "a bandwidth in GB/s");
    }
  };
  auto fraction = [&](const std::string& key, double x) {
    if (!(std::isfinite(x) && x > 0 && x <= 1))
      fail("cluster", "{}: {} = {}: expected a fraction of peak in (0, 1]", f, key, x);
  };
  if (c.devices_per_node < 1)
    fail("cluster", "{}: devices_per_node = {}: expected a device count >= 1", f, c.devices_per_node);
  positive("device_memory_gib", c.device_memory_gib, "a memory size in GiB");
  if (c.cores_per_node < 0)
    fail("cluster", "{}: cores_per_node = {}: expected a core count >= 0 (0: a device per rank)", f, c.cores_per_node);
  if (c.peak_tflops.empty())
    fail("cluster", "{}: peak_tflops: expected at least one dtype's peak, e.g. {{bf16: 989, fp32: 67}}", f);
  for (auto& [dt, x] : c.peak_tflops) {
    if (std::find(kDtypes.begin(), kDtypes.end(), dt) == kDtypes.end())
      fail("cluster", "{}: peak_tflops.{}: unknown dtype (known: fp32, bf16, fp64, the values of training.dtype)", f,
           dt);
    positive("peak_tflops." + dt, x, "a peak in TFLOP/s");
  }
  link("node", c.node);
  link("network", c.network);
  for (auto& [n, l] : c.node_by_ranks) {
    if (n < 2 || n > c.devices_per_node)
      fail("cluster", "{}: node_by_ranks.{}: expected a group size from 2 to devices_per_node = {}", f, n,
           c.devices_per_node);
    link(fmt::format("node_by_ranks.{}", n), l);
  }
  fraction("gemm_efficiency", c.gemm_efficiency);
  fraction("attention_efficiency", c.attention_efficiency);
  positive("memory_bandwidth_gbs", c.memory_bandwidth_gbs, "a bandwidth in GB/s");
  if (!(std::isfinite(c.rank_floor_mb) && c.rank_floor_mb >= 0))
    fail("cluster", "{}: rank_floor_mb = {}: expected an idle rank's memory in MiB >= 0 (0: the default)", f,
         c.rank_floor_mb);
}

void write_cluster(const ClusterSpec& c, const std::string& path, const std::string& header_comment) {
  check_cluster(c);
  std::string y;
  std::istringstream hc(header_comment);
  for (std::string line; std::getline(hc, line);) y += line.empty() ? "#\n" : "# " + line + "\n";
  y += "name: " + quoted(c.name) + "\n";
  y += fmt::format("devices_per_node: {}\n", c.devices_per_node);
  y += "device_memory_gib: " + num(c.device_memory_gib) + "\n";
  if (c.cores_per_node > 0) y += fmt::format("cores_per_node: {}\n", c.cores_per_node);
  y += "peak_tflops: {";
  bool first = true;
  for (auto& [dt, x] : c.peak_tflops) y += (first ? "" : ", ") + dt + ": " + num(x), first = false;
  y += "}\n";
  y += "node:" + link_yaml(c.node, "  ");
  y += "network:" + link_yaml(c.network, "  ");
  if (!c.node_by_ranks.empty()) {
    y += "node_by_ranks:\n";
    for (auto& [n, l] : c.node_by_ranks) y += fmt::format("  {}:", n) + link_yaml(l, "    ");
  }
  y += "gemm_efficiency: " + num(c.gemm_efficiency) + "\n";
  y += "attention_efficiency: " + num(c.attention_efficiency) + "\n";
  y += "memory_bandwidth_gbs: " + num(c.memory_bandwidth_gbs) + "\n";
  if (c.rank_floor_mb > 0) y += "rank_floor_mb: " + num(c.rank_floor_mb) + "\n";
  y += "source: " + quoted(c.source) + "\n";
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream out(path);
  if (!out) fail("cluster", "cannot write '{}': {}", path, std::strerror(errno));
  out << y;
  out.close();
  if (!out) fail("cluster", "cannot write '{}': {}", path, std::strerror(errno));
}

}  // namespace mt
