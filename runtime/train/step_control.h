// What every rank must decide alike at the end of a step, agreed by one small all-gather per step: a stop signal
// on any rank stops every rank after the same step; rank 0's clock says when a time-based checkpoint is due; an
// asynchronous save is committed once no rank is still writing it; a trace range ends once a rank's buffer is
// full. Each rank's compute and wait times of the step ride along for the slow-rank check (straggler.h).
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/train/straggler.h"

namespace mt {

// SIGTERM, SIGUSR1 and SIGINT (Slurm's warning before the time limit, a user's Ctrl-C) ask the run to checkpoint
// and stop after the current step, exiting 128 + the signal; a second SIGINT stops at once. Caught from the
// call on: a signal during set-up stops the run after its first step.
void catch_stop_signals();
int stop_signal_received();  // the last signal caught (0: none)

// This rank's part of the message: plain data, gathered as bytes.
struct StepControl {
  int32_t stop_signal = 0;     // a stop signal this rank received (0: none)
  int32_t checkpoint_due = 0;  // rank 0's vote: a time-based checkpoint is due
  int32_t writing = 0;         // this rank's writer is still writing the save in flight
  int32_t pp_coord = 0;        // this rank's pipeline stage (ranks of one stage do the same work)
  int32_t trace_full = 0;      // this rank's trace buffer holds profile.max_events (trace_file.h)
  double compute_s = 0;        // the step's wall time less its waits in collectives
  double wait_s = 0;           // the step's waits in collectives
};

// What the ranks agreed: the same on every rank.
struct AgreedControl {
  int stop_signal = 0;          // the largest signal number any rank received (0: none)
  bool checkpoint_due = false;  // rank 0 says a time-based checkpoint is due
  bool writing = false;         // some rank is still writing the save in flight
  int trace_full_rank = -1;     // the first rank whose trace buffer is full: the range ends on every rank (-1: none)
  std::vector<RankStepTimes> times;  // by world rank
};

// Collective over the world (under the watchdog as "stop-signal all_reduce", the label the hang drills stop at).
AgreedControl agree_step_control(const StepControl& mine);

}  // namespace mt
