// What a launch's output says about why it failed, read line by line as the launch runs: the launchers' own lines
// (Open MPI's mpirun, Slurm's srun) and meshtrain's (the watchdog's timeout, a rank's error, a suspended rank).
// The strongest evidence wins: a rank that says it was the one suspended, then a rank killed by a signal, then a
// rank a peer's watchdog found missing, then a rank's exit code, then the rank that called MPI_Abort.
#pragma once
#include <string>

#include "runtime/supervise/goodput.h"

namespace mt::supervisor {

struct FailureEvidence {
  int level = 0;  // 0: nothing seen
  int rank = -1;
  std::string node;
  int signal = 0;     // the signal that ended the rank, as its launcher reported it
  int rank_exit = -1;  // the rank's exit code, as its launcher reported it
  std::string how;
  bool stopped_by_signal = false;  // meshtrain's "signal N (...) received: stopped after step K"

  // A rank died or hung: not an error that would repeat.
  bool rank_failure() const { return level >= 3; }
};

class OutputScanner {
 public:
  // acct gets the checkpoints that only the output reports ("checkpoint step N -> DIR in X s").
  explicit OutputScanner(GoodputAccount& acct) : acct_(acct) {}

  // One whole line of the launch's stdout or stderr, without its newline.
  void line(const std::string& l);

  FailureEvidence ev;
  // Open MPI's mpirun said that a rank failed and that it aborts the job ("Per user-direction, the job has been
  // aborted"): the supervisor may end the other ranks at once (launch.cpp).
  bool launcher_aborting = false;

 private:
  void set(int level, int rank, const std::string& node, int sig, int code, const std::string& how);

  GoodputAccount& acct_;
  int pending_rank_ = -1;  // the rank of Open MPI's "Process name" line, whose "Exit code" line follows
};

}  // namespace mt::supervisor
