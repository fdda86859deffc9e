#include "runtime/train/peak_cache.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "comm/world.h"
#include "runtime/core/log.h"
#include "runtime/io/checksum.h"
#include "runtime/kernels/cpu/isa.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/metrics.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string v = line.substr(line.find(':') + 1);
      return v.substr(std::min(v.size(), v.find_first_not_of(' ')));
    }
  return "unknown";
}

// This binary: a rebuild (other kernels, other flags) changes its size or time.
nlohmann::json binary_identity() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown";
  const auto size = fs::file_size(exe, ec);
  const auto time = fs::last_write_time(exe, ec).time_since_epoch().count();
  return {{"path", exe.string()}, {"size", ec ? 0 : size}, {"time", ec ? 0 : time}};
}

// The figure of the file at path for key, or 0 with why (empty when the file is missing).
double read_cached(const std::string& path, const nlohmann::json& key, std::string& why) {
  std::ifstream f(path);
  if (!f) return 0;
  try {
    const nlohmann::json j = nlohmann::json::parse(f);
    if (j.value("key", nlohmann::json()) != key) {
      why = "written for another machine, build or layout";
      return 0;
    }
    const double flops = j.at("flops").get<double>();
    if (std::isfinite(flops) && flops > 0 && flops < 1e18) return flops;
    why = fmt::format("its peak {} is not a positive FLOP/s figure", flops);
  } catch (const std::exception& e) {
    why = fmt::format("not a peak cache file ({})", e.what());
  }
  return 0;
}

// Rank 0: written to a temporary file of its own, then renamed over the file. Returns why not ('' when written).
std::string write_cached(const std::string& dir, const std::string& path, const nlohmann::json& key, double flops,
                         double probe_s) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot create the folder ({})", ec.message());
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream f(tmp);
    f << nlohmann::json{{"key", key}, {"flops", flops}, {"probe_s", probe_s}, {"time", unix_time_s()}}.dump(1) << "\n";
    if (!f.flush()) return "cannot write it";
  }
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp);
  return ec ? fmt::format("cannot rename {} to it ({})", tmp, ec.message()) : "";
}

}  // namespace

nlohmann::json cpu_peak_key(int ranks_on_node) {
  return {{"cpu", cpu_model_name()},
          {"isa", cpu_isa_name(cpu_isa())},
          {"threads", cpu_threads()},
          {"ranks_on_node", ranks_on_node},
          {"binary", binary_identity()}};
}

std::string cpu_peak_file(const std::string& dir, const nlohmann::json& key) {
  StreamChecksum sum;
  const std::string k = key.dump();
  sum.update(k.data(), k.size());
  const std::string hex = sum.hex();
  return (fs::path(dir) / ("cpu_peak-" + hex.substr(hex.find(':') + 1) + ".json")).string();
}

std::string peak_cache_dir(const std::string& setting) {
  if (setting == "off") return "";
  if (setting != "auto") return setting;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x == '/') return std::string(x) + "/meshtrain";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/meshtrain";
  return "";
}

CpuPeak cpu_peak_for_run(const std::string& peak_cache, const MpiEnv& env) {
  const std::string dir = peak_cache_dir(peak_cache);
  const nlohmann::json key = cpu_peak_key(env.local_size());
  const std::string path = dir.empty() ? "" : cpu_peak_file(dir, key);
  double cached = 0;
  if (env.rank() == 0 && !path.empty()) {
    std::string why;
    cached = read_cached(path, key, why);
    if (!why.empty()) spdlog::warn("log.peak_cache: ignoring {}: {}; probing the GEMM peak again", path, why);
  }
  world::broadcast(std::as_writable_bytes(std::span<double>(&cached, 1)), 0, "the cached CPU GEMM peak");
  const std::string kernels = fmt::format("CPU kernels: {} (widest supported: {})", cpu_isa_name(cpu_isa()),
                                          cpu_isa_name(cpu_isa_supported()));
  CpuPeak p;
  if (cached > 0) {
    p = {cached, "cached", fmt::format("cached in {}", path)};
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    p.flops = probe_cpu_peak_flops();  // on every rank at once, as the ranks share the cores while they train
    const double probe_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    p.source = "probed";
    p.line = fmt::format("probed in {:.2f} s", probe_s);
    if (dir.empty() && peak_cache != "off")
      p.line += " (log.peak_cache: auto, but no $XDG_CACHE_HOME or $HOME: not kept)";
    if (env.rank() == 0 && !path.empty()) {
      const std::string why = write_cached(dir, path, key, p.flops, probe_s);
      if (why.empty()) p.line += fmt::format(", kept in {}", path);
      else spdlog::warn("log.peak_cache: cannot keep the GEMM peak in {}: {}; it is probed at every start", path, why);
    }
  }
  if (env.rank() == 0)
    spdlog::info("{}; f32 GEMM peak {:.1f} GFLOP/s on {} threads (768^3), {}", kernels, p.flops / 1e9, cpu_threads(),
                 p.line);
  return p;
}

}  // namespace mt
