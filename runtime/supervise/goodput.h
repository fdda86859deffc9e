// Goodput of a job made of several launches (`meshtrain supervise`): where its wall time went, read from the
// run's metrics file (log.metrics_file), which every launch appends to. The parts:
//   productive  the steps that count: step_ms of the last record of each step number (a step redone after a
//               failure counts once, its last time)
//   checkpoint  the training loop held by saves ("checkpoint" events' stall_s)
//   eval        evaluations (eval records' eval_s)
//   lost        work thrown away by failures: every earlier record of a redone step, and each failed launch's
//               time after its last record (the step it died in, the detection, the tear-down)
//   restart     the back-off waits, and each launch's time before its first step (the launcher starting the
//               ranks, set-up, the checkpoint load); a launch that failed before its first step, all of it
//   other       the rest of the wall time (logging, the step boundaries, the exit)
// goodput = productive / wall. Records the trainer may not write (an older binary) fall back: the start of the
// first step from the first step record (its time minus its step_ms), else when the supervisor read it.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mt {

struct GoodputParts {
  double wall_s = 0, productive_s = 0, checkpoint_s = 0, eval_s = 0, lost_s = 0, restart_s = 0, other_s = 0;
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
  int64_t steps_recorded = 0;
  double setup_s = -1, load_s = -1;
  std::string resumed_from;
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
  std::vector<AttemptRecords> attempts_;
  std::map<int64_t, double> last_step_s_;  // step -> seconds of its last record
  double all_steps_s_ = 0;
  int64_t step_records_ = 0;
  double checkpoint_s_ = 0, eval_s_ = 0;
  double attempt_checkpoint_s_ = 0;   // the current launch's stalls from "checkpoint" events
  double attempt_output_ckpt_s_ = 0;  // the current launch's saves seen in its output
  int64_t attempt_output_committed_ = -1;
  bool attempt_events_ = false;  // the current launch's metrics carry checkpoint events
  int64_t last_committed_ = -1;
  double extra_wait_s_ = 0;
};

// {"event":"goodput","scope":"job","wall_s":...,"productive_s":...,...,"goodput":...}
nlohmann::json goodput_record(const GoodputParts& p);
// "goodput 87.1% of 600.0 s: productive 522.6 s (87.1%), checkpoint ..., eval ..., lost ..., restart ..., other ..."
std::string goodput_line(const GoodputParts& p);

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
