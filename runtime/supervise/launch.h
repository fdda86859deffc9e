// One launch of the job under the supervisor (supervisor.h): the launcher (mpirun, srun) started in a process group
// of its own, its stdout and stderr passed through and scanned line by line (evidence.h), the run's metrics file
// read as it grows (goodput.h), the supervisor's stop signals passed on, and a hung launch killed with every process
// below it. Also the supervisor's own voice: its clock, its stop signals and its "[supervise HH:MM:SS]" lines.
#pragma once
#include <cstdio>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "runtime/supervise/evidence.h"
#include "runtime/supervise/goodput.h"

namespace mt::supervisor {

// Unix seconds: the clock of the metrics records.
double now_unix();
// The signal's name (strsignal), else "signal N".
std::string signal_name(int sig);

// "[supervise HH:MM:SS] ..." on stderr.
template <typename... A>
void say(fmt::format_string<A...> f, A&&... args) {
  std::time_t t = std::time(nullptr);
  char hms[16];
  std::strftime(hms, sizeof hms, "%H:%M:%S", std::localtime(&t));
  std::string line = fmt::format("[supervise {}] {}\n", hms, fmt::format(f, std::forward<A>(args)...));
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

// From here on SIGTERM, SIGUSR1 and SIGINT are recorded, for the launch to pass on, and SIGPIPE is ignored.
void catch_stop_signals();
// The stop signal received last (0: none); take_stop_signal also clears it.
int pending_stop_signal();
int take_stop_signal();

struct LaunchResult {
  int code = 0;           // the exit code, 128 + N when the launcher itself was killed by signal N
  bool hang_killed = false;
  int forwarded = 0;      // the stop signal passed on to the launcher (0: none)
  int launcher_signal = 0;  // the signal that killed the launcher itself (0: it exited)
};

// Runs one launch: its output passed through and scanned, the metrics file (if any) read as it grows into acct,
// stop signals forwarded, a hang (no new step for hang_timeout_s after the first; 0: never) ended.
LaunchResult run_launch(const std::vector<std::string>& argv, FileTail* metrics, GoodputAccount& acct,
                        OutputScanner& scan, double hang_timeout_s);

// Open MPI's shared-memory transport files that a launch's killed ranks left in `dir` (Open MPI's backing directory:
// $OMPI_MCA_btl_vader_backing_directory or $OMPI_MCA_btl_sm_backing_directory when set, else /dev/shm):
// vader_segment.* (Open MPI 4) and sm_segment.* (5). A rank removes its own at MPI_Finalize; one killed cannot, and each such file holds
// pages of shared memory until the machine restarts. Removes this user's files of those names modified at or after
// since_unix that no live process maps (another job's, or the next launch's, stay); returns how many.
int remove_mpi_shm_leftovers(double since_unix, const std::string& dir);
std::string mpi_shm_dir();

}  // namespace mt::supervisor
