// The per-rank trace files of a profiled range (runtime/core/trace.h) and their merge.
#pragma once
#include <string>

namespace mt {

// profile.dir/trace_rank{R}.json
std::string trace_rank_path(const std::string& dir, int rank);
// Joins every trace_rank*.json of dir into dir/trace.json (a process per rank, each keeping its pid = rank and
// its metadata under metadata.ranks). Returns the path written and the number of ranks in `ranks`; throws
// "[trace] ..." when dir holds none or a file is not a trace.
std::string merge_traces(const std::string& dir, int* ranks = nullptr);

}  // namespace mt

#include <cstdint>
#include <memory>

#include "comm/comm_counters.h"
#include "runtime/core/device.h"
#include "runtime/core/trace_memory.h"

namespace mt {

struct Config;
class MpiEnv;
struct TrainRun;
class MetricsLogger;

// The training loop's side of profile.steps: before the first traced step it aligns the clocks
// (control_clock_sync), names the process and lanes, and starts recording; each step is a "step" span (the step
// number and the allocator's peak of the step in its args); after the last (or when the loop ends first) every
// rank writes its file with the Group counters of the traced steps in its metadata, and rank 0 merges them after a
// barrier. All collective: every rank calls every method at the same points.
class RunTrace {
 public:
  RunTrace(const Config& cfg, const MpiEnv& env, const TrainRun& run);
  bool enabled() const { return first_ > 0; }
  void before_step(int64_t step);                             // 0-based
  void step_done(int64_t step, int64_t t0_ns, int64_t peak);  // the step span
  void after_step(int64_t step, MetricsLogger& log);          // ends the range after its last step
  void finish(MetricsLogger& log);                            // ends it early (the loop stopped)
  // After the range: this rank's memory track at its peak, by part ({} before).
  const trace::MemoryParts& peak() const { return peak_; }
  bool finished() const { return done_; }

 private:
  const Config& cfg_;
  const MpiEnv& env_;
  int64_t first_ = 0, last_ = 0;  // 1-based
  bool recording_ = false, done_ = false;
  CommCounters before_;
  trace::MemoryParts peak_;
  Device device_ = Device::cpu();  // the run's: whose allocator the memory track follows
};

}  // namespace mt
