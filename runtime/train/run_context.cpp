// What every subcommand does first: the config, read by every rank and agreed
// on, and the device of this rank.
#include "runtime/train/run_context.h"

#include <cstring>
#include <string>
#include <vector>

#include "comm/watchdog.h"
#include "comm/world.h"
#include "runtime/core/device.h"
#include "runtime/core/startup.h"
#include "runtime/train/agree.h"

namespace mt {

double startup_timeout_s(int argc, char** argv) {
  std::string path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "-c" || a == "--config") && i + 1 < argc) path = argv[++i];
    else if (a.rfind("--config=", 0) == 0) path = a.substr(9);
    else if (a == "--set")  // takes every following key=value
      while (i + 1 < argc && std::strchr(argv[i + 1], '=') && argv[i + 1][0] != '-') overrides.push_back(argv[++i]);
    else if (a.rfind("--set=", 0) == 0) overrides.push_back(a.substr(6));
  }
  try {
    return load_config(path, overrides).comm.timeout_s;
  } catch (...) {
    return CommConfig{}.timeout_s;
  }
}

Config load_and_agree_config(const MpiEnv& env, const GlobalOptions& opts) {
  // Every rank reads the same file and --set: an error printed once when it is the same everywhere.
  Config c;
  run_agreed(env, "the config", [&] { c = load_config(opts.config_path, opts.overrides); });
  watchdog_set_timeout(c.comm.timeout_s);
  // First collective of the run: every rank must have read the same config.
  uint64_t h = config_hash(c);
  const std::vector<uint64_t> all = world::all_gather(h, "config agreement");
  std::string differ;
  for (int r = 0; r < env.size(); ++r)
    if (all[size_t(r)] != all[0]) differ += (differ.empty() ? "" : ",") + std::to_string(r);
  MT_CHECK(differ.empty(), "config",
           "ranks {} read a different config than rank 0 (hash {:016x} vs {:016x}): is the file the same on every "
           "node, and are the --set overrides the same on every rank?",
           differ, all[0], h);
  startup::mark("config");
  return c;
}

Device rank_device(const MpiEnv& env, const std::string& device_name) {
  if (device_name == "cpu") return Device::cpu();
  // The CUDA backend is a library loaded now (runtime/core/cuda_table.h): when it cannot be (or was not built),
  // every rank says why here, before any collective.
  const std::string& why = cuda_backend_error();
  MT_CHECK(why.empty(), "config", "comm.device = {}: {} (rank {} on {})", device_name, why, env.rank(), env.host());
  MT_CHECK(env.cuda_device() >= 0, "config", "comm.device = {} but no CUDA device is visible (rank {} on {})",
           device_name, env.rank(), env.host());
  return Device::cuda(env.cuda_device());
}

}  // namespace mt
