// Goodput of a job made of several launches (`meshtrain supervise`): where its wall time went, by cause, read
// from the run's metrics file (log.metrics_file), which every launch appends to. The causes (they add up to the wall
// time):
//   productive   the steps that count: step_ms of the last record of each step number (a step redone after a
//                failure counts once, its last time), less a relaunch's first-step warm-up (under restart)
//   memory_save  the training loop held by in-memory checkpoints ("checkpoint" events with "mode": "memory")
//   disk_save    the training loop held by disk checkpoints (the other "checkpoint" events' stall_s)
//   eval         evaluations (eval records' eval_s)
//   lost         work thrown away by failures: every earlier record of a redone step, and the step in flight when
//                a launch failed (from its last record to the failure, at most one step's time)
//   restart      the back-off waits and each launch's time before its first step, split by phase (restart_parts:
//                the launcher starting the processes, MPI start-up, mesh, model, load, GEMM peak, the set-up
//                report, the first step's time above the launch's typical step; from the ranks' "setup" record);
//                a launch that failed before its first step, all of it
//   detection    from the failure to the end of the failed launch: noticing it (the launcher's or the watchdog's
//                word, the hang timeout) and the tear-down
//   other        the rest of the wall time (logging, the step boundaries, the exit)
// goodput = productive / wall. Records the trainer may not write (an older binary) fall back: the start of the
// first step from the first step record (its time minus its step_ms), else when the supervisor read it; a launch
// without a "setup" record has its restart time as one phase ("not timed").
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace mt {

struct GoodputParts {
  double wall_s = 0, productive_s = 0, memory_save_s = 0, disk_save_s = 0, eval_s = 0, lost_s = 0, restart_s = 0,
         detection_s = 0, other_s = 0;
  // restart_s by phase, in launch order (they add up to restart_s): backoff, launcher, mpi, mesh, model, load,
  // peak, report, first_step, not_started (launches that failed before their first step), not_timed.
  std::vector<std::pair<std::string, double>> restart_parts;
  double goodput = 0;        // productive_s / wall_s
  int64_t steps = 0;         // distinct steps recorded
  int64_t redone_steps = 0;  // step records beyond the first of their step number
  int64_t attempts = 0, failures = 0;
};

// What one launch left in the metrics file.
struct AttemptRecords {
  double launch_t = 0, exit_t = 0;  // unix seconds, the supervisor's clock
  double backoff_s = 0;             // waited before this launch
  bool failed = false;
  double first_step_t = -1;   // when its first step began (the "start" record, else the first step record's)
  double last_record_t = -1;  // its last record's time
  int64_t start_step = -1;    // the "start" record's start_step
  int64_t last_step = -1;     // the highest step it recorded
  int64_t last_committed = -1;  // the last checkpoint it committed ("checkpoint_committed"; else "checkpoint")
  int64_t last_memory = -1;     // the last in-memory checkpoint it saved ("checkpoint" with mode "memory")
  int64_t steps_recorded = 0;
  double setup_s = -1, load_s = -1;
  std::string resumed_from;
  double failure_seen_t = -1;  // when the supervisor first saw that it failed (its output, a hang)
  // The ranks' "setup" record: its time (the end of the first step) and parts (name, seconds), in order.
  double setup_t = -1, setup_total_s = -1;
  std::vector<std::pair<std::string, double>> setup_parts;
  int64_t first_step = -1;
  double first_step_s = 0;
  std::vector<double> early_steps_s;  // the step times after the first (at most 32): the launch's typical step
  double typical_step_s() const;
  // A failed launch's end after its last record: the step in flight until the failure was seen (lost; at most one
  // typical step), then the detection and the tear-down. Both 0 before its first step (all restart time).
  struct Tail {
    double in_flight_s = 0, detection_s = 0;
  };
  Tail failure_tail() const;
};

class GoodputAccount {
 public:
  // A launch begins at launch_t (unix seconds) after a back-off of backoff_s.
  void begin_attempt(double launch_t, double backoff_s);
  // One metrics record of the current launch; read_t: when it was read (used when the record has no "time").
  void add_record(const nlohmann::json& r, double read_t);
  // A checkpoint seen only in the launch's output ("checkpoint step N -> DIR in X s"): used for launches whose
  // metrics carry no checkpoint events (the stall is then the whole save).
  void add_output_checkpoint(int64_t step, double seconds);
  void end_attempt(double exit_t, bool failed);
  // The supervisor saw at t that the current launch failed (the first time counts): where detection begins at
  // the latest.
  void failure_seen(double t);
  // A back-off wait that no launch followed (the job was stopped during it): restart time.
  void add_wait(double seconds) { extra_wait_s_ += seconds; }

  const AttemptRecords& current() const { return attempts_.back(); }
  const std::vector<AttemptRecords>& attempts() const { return attempts_; }
  // The newest committed checkpoint seen over every launch so far (-1: none).
  int64_t last_committed() const { return last_committed_; }
  // Steps the current launch recorded after the last committed checkpoint: redone by the next launch.
  int64_t steps_lost() const;
  // The job's parts over wall_s seconds.
  GoodputParts parts(double wall_s) const;

 private:
  // restart_s's phases over the launches (and the first steps' warm-up, taken out of productive).
  void restart_phases(GoodputParts& p) const;

  std::vector<AttemptRecords> attempts_;
  std::map<int64_t, std::pair<double, size_t>> last_step_s_;  // step -> seconds of its last record, its launch
  double all_steps_s_ = 0;
  int64_t step_records_ = 0;
  double memory_save_s_ = 0, disk_save_s_ = 0, eval_s_ = 0;
  double attempt_checkpoint_s_ = 0;   // the current launch's stalls from "checkpoint" events
  double attempt_output_ckpt_s_ = 0;  // the current launch's saves seen in its output
  int64_t attempt_output_committed_ = -1;
  bool attempt_events_ = false;  // the current launch's metrics carry checkpoint events
  int64_t last_committed_ = -1;
  double extra_wait_s_ = 0;
};

// {"event":"goodput","scope":"job","wall_s":...,"productive_s":...,...,"goodput":...}
nlohmann::json goodput_record(const GoodputParts& p);
// "goodput 87.1% of 600.0 s: productive 522.6 s (87.1%), memory saves ..., disk saves ..., eval ..., lost ...,
// restart ..., detection ..., other ..."
std::string goodput_line(const GoodputParts& p);
// "restart 41.2 s by phase: back-off 6.0 s, launcher 3.1 s, MPI start-up 8.2 s, ..." (phases with time only)
std::string restart_line(const GoodputParts& p);

// New whole lines of a file that another process appends to, from where the last call stopped (a line still
// being written waits for its newline; a file that shrank is read again from its start).
class FileTail {
 public:
  explicit FileTail(std::string path, bool from_end = false);
  std::vector<std::string> read_lines();
  const std::string& path() const { return path_; }
  // Skips what is in the file now (lines written before a launch).
  void skip_to_end();

 private:
  std::string path_, partial_;
  long long offset_ = 0;
};

}  // namespace mt
