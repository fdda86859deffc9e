// The run's configuration: YAML into typed structs, validated on every rank
// before any collective. Each section is a plain struct with defaults whose
// visit() lists its keys once; that one list drives reading (with unknown-key
// and type errors naming the key path), writing the canonical YAML, and the
// hash that ranks compare. Adding a key is one line in visit().
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

struct ParallelConfig {
  int dp_replicate = -1;  // replicated data parallel; by default whatever the other dims leave
  int dp_shard = 1;      // fully sharded data parallel
  int cp = 1;            // context parallel (ring attention)
  int tp = 1;            // tensor (and sequence) parallel, innermost
  template <class V> void visit(V& v) {
    v("dp_replicate", dp_replicate, "replicated data-parallel degree (-1: the remaining ranks)");
    v("dp_shard", dp_shard, "fully sharded data-parallel degree (-1: the remaining ranks)");
    v("cp", cp, "context-parallel degree (-1: the remaining ranks)");
    v("tp", tp, "tensor-parallel degree (-1: the remaining ranks)");
  }
};

struct CommConfig {
  double timeout_s = 600;
  std::string backend = "auto";
  std::string device = "cpu";
  std::vector<double> link_gbps;
  template <class V> void visit(V& v) {
    v("timeout_s", timeout_s, "seconds before a stuck collective aborts the job");
    v("backend", backend, "auto | mpi | nccl (auto: nccl for cuda when built)");
    v("device", device, "cpu | cuda");
    v("link_gbps", link_gbps, "link bandwidth per mesh dim in GB/s, outermost first (empty: defaults)");
  }
};

struct LogConfig {
  std::string level;  // empty: info on rank 0, warn elsewhere
  int interval = 10;
  std::string metrics_file;
  template <class V> void visit(V& v) {
    v("level", level, "'' | trace | debug | info | warn | error | off");
    v("interval", interval, "steps between progress lines");
    v("metrics_file", metrics_file, "JSON-lines metrics file ('' = none)");
  }
};

struct Config {
  ParallelConfig parallel;
  CommConfig comm;
  LogConfig log;
  template <class V> void visit(V& v) {
    v("parallel", parallel, "mesh sizes");
    v("comm", comm, "communication");
    v("log", log, "logging and metrics");
  }
};

// Loads path (empty: defaults only), applies --set overrides, converts and validates.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
Config config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides = {});
std::string config_to_yaml(const Config& c);  // canonical: every key, defaults included
uint64_t config_hash(const Config& c);        // FNV-1a 64 of config_to_yaml
// Resolves a -1 and checks the product equals world_size; returns {dp_replicate, dp_shard, cp, tp}.
std::vector<int> resolve_mesh_sizes(const ParallelConfig& p, int world_size);
// "[config] training.batch_size = 10 must be divisible by dp = 4"
void require_divisible(const std::string& key, int64_t value, const std::string& by_key, int64_t by);

}  // namespace mt
