#include "runtime/cli/train_reports.h"

#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/core/error.h"
#include "runtime/core/trace_memory.h"
#include "runtime/planner/estimate.h"

namespace mt {

void log_memory_beside_estimate(const Config& cfg, const MpiEnv& env, const RunTrace& tr, MetricsLogger& log) {
  if (env.rank() != 0) return;
  const trace::MemoryParts& p = tr.peak();
  // The estimate states the gathered fully_shard units inside its temporaries at the peak: the two are compared
  // together, as "activations and temporaries" (the track's units shown apart beside them).
  double est[5] = {0, 0, 0, 0, 0}, est_peak = 0;
  try {
    const Estimate e = estimate_run(cfg, env.size(), std::nullopt);
    for (const MemoryPart& m : e.stages.at(0).memory) {
      const std::string& n = m.name;
      if (n.rfind("peak", 0) == 0 || n.rfind("process", 0) == 0) continue;
      const int k = n.rfind("parameters", 0) == 0 || n.rfind("compute copies", 0) == 0 ? 0
                    : n.rfind("gradient buckets", 0) == 0                              ? 3
                    : n.rfind("gradients", 0) == 0                                     ? 1
                    : n.rfind("optimizer", 0) == 0                                     ? 2
                                                                                       : 4;
      est[k] += m.bytes;
    }
    est_peak = e.stages.at(0).peak_bytes;
  } catch (const Error& e) {
    log.note(fmt::format("memory at the traced peak: no estimate to compare ({})", e.what()));
    return;
  }
  const double got[5] = {double(p.parameters), double(p.gradients), double(p.optimizer), double(p.buffers),
                         double(p.units + p.other)};
  const char* names[5] = {"parameters", "gradients", "optimizer state", "communication buffers",
                          "activations and temporaries"};
  std::string parts;
  nlohmann::json rec = {{"event", "memory_peak"}, {"rank", 0}};
  for (int k = 0; k < 5; ++k) {
    parts += fmt::format("{}{} {:.3f} MiB (estimate {:.3f}, {:+.1f}%)", k ? ", " : "", names[k], got[k] / (1 << 20),
                         est[k] / (1 << 20), est[k] > 0 ? 100 * (got[k] / est[k] - 1) : 0.0);
    rec[names[k]] = {{"trace", got[k]}, {"estimate", est[k]}};
  }
  rec["fully_shard units"] = {{"trace", double(p.units)}};
  // An asynchronous checkpoint's snapshot may still be held at the step's peak: shown apart, not in the estimate.
  rec["checkpoint snapshot"] = {{"trace", double(p.snapshot)}};
  rec["peak"] = {{"trace", double(p.training())}, {"estimate", est_peak}};
  log.note(fmt::format("memory at the traced peak on rank 0, by part beside `meshtrain estimate`: {} (of which "
                       "fully_shard units {:.3f} MiB); peak {:.3f} MiB (estimate {:.3f}){}",
                       parts, double(p.units) / (1 << 20), double(p.training()) / (1 << 20), est_peak / (1 << 20),
                       p.snapshot ? fmt::format("; beside it a checkpoint's snapshot {:.3f} MiB", double(p.snapshot) / (1 << 20))
                                  : std::string()));
  log.record(rec);
}

}  // namespace mt
