// Logging through spdlog. Every line carries the rank ("[r3] ..."); rank 0
// logs at info by default, the other ranks at warn, so a 64-rank job prints
// one copy of progress but every rank's warnings and errors.
#pragma once
#include <string>

#include <spdlog/spdlog.h>

namespace mt {

// level: trace, debug, info, warn, error, off. Empty keeps the default.
void init_logging(int rank, const std::string& level = "");
spdlog::level::level_enum parse_log_level(const std::string& level);  // throws "[log] ..."
// Whether fd (1 or 2) reaches a person's terminal: it is a terminal (TERM not dumb) and, under a launcher that
// forwards the ranks' output (mpirun, srun), the launcher's own output is one too, as it says (MT_STDOUT_TTY /
// MT_STDERR_TTY = 1 | 0, set by scripts/mpirun.sh) or as /proc shows for an mpirun among this process's
// ancestors; srun only with --pty. A rank's pty that mpirun copies into a file or a batch log does not count.
bool reaches_terminal(int fd);

}  // namespace mt

#define MT_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define MT_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define MT_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
#define MT_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
