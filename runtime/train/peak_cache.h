// The CPU GEMM peak that MFU is measured against (cpu_peak_flops(), metrics.h), kept per machine: the probe takes
// over a second of every launch's set-up (more with several ranks on few cores), and a relaunch after a failure
// waits for it. log.peak_cache names the folder (auto: $XDG_CACHE_HOME/meshtrain, else ~/.cache/meshtrain; off:
// probed at every start); the file is named by, and holds, what the figure depends on: the CPU's model name, the
// kernels' instruction-set level, the threads per rank, the ranks on the node (they probe at once and share the
// cores), and the binary (its path, size and time: another build may have other kernels).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "comm/env.h"

namespace mt {

struct CpuPeak {
  double flops = 0;    // per rank, FLOP/s
  std::string source;  // "probed" or "cached"
  std::string line;    // where it came from, for the log: "probed in 1.31 s, kept in PATH" / "cached in PATH ..."
};

// What the peak depends on, as written in the file ("cpu", "isa", "threads", "ranks_on_node", "binary").
nlohmann::json cpu_peak_key(int ranks_on_node);
// The cache file of that key in dir: dir/cpu_peak-<16 hex digits of the key's hash>.json.
std::string cpu_peak_file(const std::string& dir, const nlohmann::json& key);
// The folder log.peak_cache names ('' for off).
std::string peak_cache_dir(const std::string& setting);

// Collective. Rank 0 reads the file and passes the figure on; a missing, unreadable, corrupt or foreign file
// (another key) is probed again, on every rank at once as before, and rank 0 writes the file atomically (a
// temporary file renamed: concurrent jobs leave one whole file). A corrupt or foreign file, or one that cannot be
// written, is one warning naming it and log.peak_cache; never an error.
CpuPeak cpu_peak_for_run(const std::string& peak_cache, const MpiEnv& env);

}  // namespace mt
