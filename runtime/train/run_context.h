// The context every subcommand runs in: the parsed global options, the config (loaded on every rank and
// agreed across ranks before anything else runs) and the process's MPI environment and device.
#pragma once
#include <string>
#include <vector>

#include "comm/env.h"
#include "comm/mesh.h"
#include "runtime/train/run_config.h"

namespace mt {

struct GlobalOptions {
  std::string config_path;             // --config
  std::vector<std::string> overrides;  // --set a.b=c
  std::string log_level;               // --log-level
};

struct RunContext {
  MpiEnv* env = nullptr;
  GlobalOptions opts;
  Config config;
};

// Loads and validates the config on every rank (no communication), then
// compares its hash across ranks: a mismatch names the ranks that differ.
Config load_and_agree_config(const MpiEnv& env, const GlobalOptions& opts);
// comm.timeout_s as the command line gives it (--config FILE, --set comm.timeout_s=X), read before MPI_Init so
// that the start-up's own waits are bounded by it; the default when the config cannot be read (its errors are
// reported once MPI is up).
double startup_timeout_s(int argc, char** argv);
// The device named by comm.device for this rank: cuda -> cuda:<local device>.
Device rank_device(const MpiEnv& env, const std::string& device_name);

}  // namespace mt
