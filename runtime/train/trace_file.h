// The per-rank trace files of a profiled range (runtime/core/trace.h) and their merge.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

// profile.dir/trace_rank{R}.json
std::string trace_rank_path(const std::string& dir, int rank);

// What a merge wrote.
struct MergedTraces {
  std::string path;       // dir/trace.json
  std::string run_id;     // the run whose files it holds
  int ranks = 0;          // rank files merged (the run's world size)
  int other_files = 0;    // trace_rank*.json of other runs in dir, left alone (a run's own merge only)
  int64_t dropped = 0;    // events the ranks dropped past profile.max_events
};

// Joins one run's rank files of dir into dir/trace.json (a process per rank, each keeping its pid = rank and its
// metadata under metadata.ranks), one file at a time. run_id empty (`meshtrain trace merge`): every
// trace_rank*.json of dir, which must all carry one run id and hold every rank 0..N-1 of that run's N; else the
// files of that run of `world` ranks only (the run's own merge: another run's stale files beside them are counted
// in other_files). Throws "[trace] ..." naming the runs mixed, the ranks missing, a file that is not a trace; then
// trace.json is left as it was.
MergedTraces merge_traces(const std::string& dir, const std::string& run_id = "", int world = 0);

// The seconds a rank may need to write (or rank 0 to merge) a trace of n events on a slow disk: what its peers wait
// for it beyond comm.timeout_s.
double trace_write_budget_s(int64_t events);

}  // namespace mt

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/comm_counters.h"
#include "runtime/core/device.h"
#include "runtime/core/trace_memory.h"

namespace mt {

struct Config;
class MpiEnv;
struct TrainRun;
class MetricsLogger;

// profile.dir, when profile.steps is set: rank 0 creates it and writes a file in it before the model is set up;
// an error (every rank has rank 0's answer) is printed once.
void check_profile_dir(const Config& cfg, const MpiEnv& env);

// The training loop's side of profile.steps: before the first traced step it aligns the clocks
// (control_clock_sync), names the process and lanes, and starts recording; each step is a "step" span (the step
// number and the allocator's peak of the step in its args); after the last (or when the loop ends first, or a
// rank's buffer holds profile.max_events) every rank writes its file with the run's id, its world size, the steps
// really traced and the Group counters of the traced steps in its metadata, and rank 0 merges them. The ranks wait
// for one another's writing and for the merge with comm.timeout_s plus trace_write_budget_s of the largest file
// (of all of them for the merge): a slow disk is not a hang. All collective: every rank calls every method at the
// same points.
class RunTrace {
 public:
  RunTrace(const Config& cfg, const MpiEnv& env, const TrainRun& run, MetricsLogger& log);
  bool enabled() const { return first_ > 0; }
  void before_step(int64_t step);                             // 0-based
  void step_done(int64_t step, int64_t t0_ns, int64_t peak);  // the step span
  // This rank holds profile.max_events: the per-step agreement (step_control.h) ends the range on every rank.
  bool full() const;
  // Ends the range after its last step, or after this one when full_rank >= 0 (the agreed rank whose buffer is full).
  void after_step(int64_t step, int full_rank, MetricsLogger& log);
  void finish(MetricsLogger& log);  // ends it early (the loop stopped)
  // Run on every rank after the merge, before the ranks agree the range is done (the memory report: rank 0's
  // `meshtrain estimate` is waited for with the merge).
  std::function<void()> after_range;
  // After the range: this rank's memory track at its peak, by part ({} before).
  const trace::MemoryParts& peak() const { return peak_; }
  bool finished() const { return done_; }

 private:
  bool write_file();  // this rank's trace_rank{R}.json
  void merge(MetricsLogger& log, int64_t events, int64_t all_events, const std::vector<int>& failed);

  const Config& cfg_;
  const MpiEnv& env_;
  int64_t first_ = 0, last_ = 0;                // 1-based: the range within this run
  int64_t traced_first_ = 0, traced_last_ = 0;  // the steps recorded
  bool recording_ = false, done_ = false;
  std::string run_id_;
  CommCounters before_;
  trace::MemoryParts peak_;
  Device device_ = Device::cpu();  // the run's: whose allocator the memory track follows
};

}  // namespace mt
