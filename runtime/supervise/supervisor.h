// The supervisor (`meshtrain supervise [options] -- LAUNCH...`): runs a training launch (mpirun ... meshtrain ...
// train, or srun ...) and launches it again from its newest good checkpoint (checkpoint.resume: auto) when a rank
// dies or hangs, up to max_restarts times with a back-off, logging each failure: which rank, which node, how, at
// what step, what was lost. It is not one of the job's ranks and starts no MPI, like torchrun's agent.
//
// What ends it: the launch exits 0 (done); a stop signal (SIGTERM, SIGUSR1, SIGINT) sent to the supervisor is
// passed to the launcher, whose ranks checkpoint and stop, and the supervisor exits 128 + the signal without a
// relaunch (a batch script's requeue path); a launch that exits 128 + SIGTERM/SIGUSR1/SIGINT by itself (a stop
// signal reached the ranks some other way) is passed through the same way; 2 (a command-line error) and a launch
// that failed before its first step with no rank killed, timed out or hung (a config or data error, which a
// relaunch would only repeat) are not relaunched. Anything else is a failure, relaunched after
// backoff x 2^(consecutive failures - 1) seconds (capped; a failure after progress starts again at backoff).
//
// With the run's metrics file (metrics, else the launch's --set log.metrics_file=...) it also accounts for the
// job's wall time (goodput.h): printed at the end and appended to the metrics file as
// {"event":"goodput","scope":"job",...}, with one {"event":"failure",...} per failure.
//
// Its parts: evidence.h (what the launch's output says about a failure), launch.h (one launch: the process, its
// pipes, signals, the hang kill), goodput.h (the job's wall time), supervisor.cpp (the policy between launches).
#pragma once
#include <string>
#include <vector>

namespace mt {

struct SuperviseOptions {
  int max_restarts = 3;        // relaunches after failures before giving up
  double backoff_s = 5;        // the wait before the first relaunch, doubled per failure in a row without progress
  double backoff_max_s = 60;   // the longest wait between launches
  double hang_timeout_s = 0;   // kill a launch whose metrics get no new step for this long after its first (0: off)
  std::string metrics;         // the run's metrics file; empty: the launch's config or --set log.metrics_file=...
  int exclude_after = 0;       // srun launches: leave out a node that failed this many times (0: never)
  std::vector<std::string> launch;  // the launch command
};

// Supervises the launch to its end; the exit code: the last launch's (0: done), 128 + a stop signal, 2 without a
// launch command or with a --metrics file it could not append to (its folder missing or not writable).
int supervise(const SuperviseOptions& o);

}  // namespace mt
