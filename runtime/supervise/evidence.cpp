#include "runtime/supervise/evidence.h"

#include <cstring>
#include <regex>

#include <fmt/format.h>

namespace mt::supervisor {

namespace {
// The lines the scanner knows, compiled once.
struct Patterns {
  const std::regex ckpt{R"(^checkpoint step (\d+) -> \S+ in ([0-9.]+) s)"};
  const std::regex suspended{R"(\[comm\] rank (\d+) \(host ([^)]+)\) was suspended for ([0-9.]+) s)"};
  const std::regex ompi_signal{R"(process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+) \(([^)]*)\))"};
  const std::regex srun_task{R"(srun: error: ([^:\s]+): tasks? (\d+)[0-9,\-]*: (.*))"};
  const std::regex srun_exit{R"(Exited with exit code (\d+))"};
  const std::regex watchdog_missing{
      R"(\[comm\] timeout: (.*?) did not finish within .*? on rank (\d+) \(host ([^)]+)\); world ranks? ([0-9,]+) did not arrive and did not answer)"};
  const std::regex watchdog_elsewhere{
      R"(\[comm\] timeout: (.*?) did not finish within .*? on rank (\d+) \(host ([^)]+)\); world rank (\d+) did not arrive: it is ([^;(]*))"};
  const std::regex watchdog_any{R"(\[comm\] timeout: (.*?) did not finish within)"};
  const std::regex ompi_process{R"(Process name: \[\[\d+,\d+\],(\d+)\])"};
  const std::regex ompi_exit{R"(Exit code:\s+(\d+))"};
  const std::regex mt_rank_failed{R"(meshtrain: rank (\d+) failed, aborting the job)"};
  const std::regex mpi_abort{R"(MPI_ABORT was invoked on rank (\d+) in communicator \S+\s*(?:with errorcode (\d+))?)"};
};

const Patterns& patterns() {
  static const Patterns p;
  return p;
}

// The signal a launcher names in words ("Killed", "Terminated", "Segmentation fault"), or 0.
int signal_from_words(const std::string& w) {
  for (int s = 1; s < 32; ++s)
    if (const char* n = strsignal(s); n && w.rfind(n, 0) == 0) return s;
  return 0;
}
}  // namespace

void OutputScanner::line(const std::string& l) {
  const Patterns& re = patterns();
  std::smatch m;
  if (l.find("Per user-direction, the job has been aborted") != std::string::npos) launcher_aborting = true;
  if (std::regex_search(l, m, re.ckpt)) {
    acct_.add_output_checkpoint(std::stoll(m[1]), std::stod(m[2]));
  } else if (std::regex_search(l, m, re.suspended)) {
    set(5, std::stoi(m[1]), m[2], 0, -1, fmt::format("was stopped (suspended {} s) and timed out its peers", m[3].str()));
  } else if (std::regex_search(l, m, re.ompi_signal)) {
    const int sig = std::stoi(m[3]);
    set(4, std::stoi(m[1]), m[2], sig, -1, fmt::format("exited on signal {} ({})", sig, m[4].str()));
  } else if (std::regex_search(l, m, re.srun_task)) {
    const std::string what = m[3];
    std::smatch e;
    if (std::regex_search(what, e, re.srun_exit))
      set(2, std::stoi(m[2]), m[1], 0, std::stoi(e[1]), fmt::format("exited with code {}", e[1].str()));
    else if (int sig = signal_from_words(what))
      set(4, std::stoi(m[2]), m[1], sig, -1, fmt::format("exited on signal {} ({})", sig, what));
  } else if (std::regex_search(l, m, re.watchdog_missing)) {
    std::string ranks = m[4];
    set(3, std::stoi(ranks.substr(0, ranks.find(','))), "", 0, -1,
        fmt::format("did not arrive in {} within comm.timeout_s (stopped or dead; reported by rank {} on {})",
                    m[1].str(), m[2].str(), m[3].str()));
  } else if (std::regex_search(l, m, re.watchdog_elsewhere)) {
    set(3, std::stoi(m[4]), "", 0, -1,
        fmt::format("was elsewhere ({}) while its peers waited in {} (reported by rank {} on {})", m[5].str(),
                    m[1].str(), m[2].str(), m[3].str()));
  } else if (std::regex_search(l, m, re.watchdog_any)) {
    set(3, -1, "", 0, -1, fmt::format("watchdog timeout: {} did not finish within comm.timeout_s", m[1].str()));
  } else if (std::regex_search(l, m, re.ompi_process)) {
    pending_rank_ = std::stoi(m[1]);
  } else if (pending_rank_ >= 0 && std::regex_search(l, m, re.ompi_exit)) {
    set(2, pending_rank_, "", 0, std::stoi(m[1]), fmt::format("exited with code {}", m[1].str()));
    pending_rank_ = -1;
  } else if (std::regex_search(l, m, re.mt_rank_failed)) {
    set(2, std::stoi(m[1]), "", 0, 1, "failed with an error");
  } else if (std::regex_search(l, m, re.mpi_abort)) {
    set(1, std::stoi(m[1]), "", 0, -1, fmt::format("called MPI_Abort (error code {})", m[2].str()));
  } else if (l.find("received: stopped after step") != std::string::npos) {
    ev.stopped_by_signal = true;
  }
}

void OutputScanner::set(int level, int rank, const std::string& node, int sig, int code, const std::string& how) {
  if (level <= ev.level) {
    if (ev.node.empty() && rank == ev.rank && !node.empty()) ev.node = node;  // a weaker line may know the node
    return;
  }
  const std::string known_node = rank == ev.rank && node.empty() ? ev.node : node;
  ev.level = level;
  ev.rank = rank;
  ev.node = known_node;
  ev.signal = sig;
  ev.rank_exit = code;
  ev.how = how;
}

}  // namespace mt::supervisor
