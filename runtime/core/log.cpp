#include "runtime/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "runtime/core/error.h"

namespace mt {

spdlog::level::level_enum parse_log_level(const std::string& level) {
  for (auto [name, lvl] : {std::pair{"trace", spdlog::level::trace},
                           {"debug", spdlog::level::debug},
                           {"info", spdlog::level::info},
                           {"warn", spdlog::level::warn},
                           {"error", spdlog::level::err},
                           {"off", spdlog::level::off}})
    if (level == name) return lvl;
  fail("log", "bad log level '{}' (expected trace, debug, info, warn, error or off)", level);
}

namespace {

bool is_terminal_device(const std::string& path) {
  return path.rfind("/dev/pts/", 0) == 0 || path.rfind("/dev/tty", 0) == 0 || path == "/dev/console";
}

// The launcher among this process's ancestors (a few levels: mpirun may start us through a shell or a wrapper):
// its pid and name, or {0, ""} when none is found.
std::pair<long, std::string> launcher_ancestor() {
  long pid = long(getppid());
  for (int depth = 0; depth < 8 && pid > 1; ++depth) {
    std::string stat;
    if (FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r")) {
      char buf[512] = {0};
      size_t n = std::fread(buf, 1, sizeof buf - 1, f);
      std::fclose(f);
      stat.assign(buf, n);
    }
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so take the last ')'.
    size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close < open) break;
    std::string comm = stat.substr(open + 1, close - open - 1);
    for (const char* l : {"mpirun", "mpiexec", "orterun", "prterun", "prte", "orted", "prted", "srun", "slurmstepd",
                          "hydra_pmi_proxy", "mpiexec.hydra"})
      if (comm == l) return {pid, comm};
    long ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %*c %ld", &ppid) != 1) break;
    pid = ppid;
  }
  return {0, ""};
}

}  // namespace

bool reaches_terminal(int fd) {
  if (!isatty(fd)) return false;
  if (const char* term = std::getenv("TERM"); term && std::string(term) == "dumb") return false;
  // scripts/mpirun.sh says what its own stdout and stderr are.
  if (const char* e = std::getenv(fd == 2 ? "MT_STDERR_TTY" : "MT_STDOUT_TTY"); e && *e) return e[0] == '1';
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK") ||
                        std::getenv("SLURM_PROCID");
  if (!launched) return true;  // started by hand: the terminal is the person's
  // Launched: the pty may be the launcher's. A local mpirun shows where it writes; a remote daemon
  // (orted, slurmstepd, ...) or an unknown launcher does not, and gets plain output.
  auto [pid, name] = launcher_ancestor();
  if (name == "mpirun" || name == "mpiexec" || name == "orterun" || name == "prterun" || name == "mpiexec.hydra") {
    char target[256] = {0};
    ssize_t n = readlink(fmt::format("/proc/{}/fd/{}", pid, fd).c_str(), target, sizeof target - 1);
    return n > 0 && is_terminal_device(std::string(target, size_t(n)));
  }
  // srun gives a task a terminal only with --pty, which is a person asking for one.
  return (name == "srun" || name == "slurmstepd") && std::getenv("SLURM_PTY_PORT") != nullptr;
}

void init_logging(int rank, const std::string& level) {
  // The level first: a bad one throws while the current logger (the one the error is reported through) still
  // exists; dropping it first left no default logger, and reporting the error crashed every rank.
  auto lvl = level.empty() ? spdlog::level::info : parse_log_level(level);
  // stderr for every rank: stdout stays for tables and results a user may pipe.
  spdlog::drop("meshtrain");  // init_logging may be called again (tests, --log-level)
  // Colours only where a person reads them: not in a file or batch log that mpirun fills from a pty.
  auto logger = spdlog::stderr_color_mt(
      "meshtrain", reaches_terminal(STDERR_FILENO) ? spdlog::color_mode::automatic : spdlog::color_mode::never);
  logger->set_pattern(fmt::format("[%H:%M:%S.%e] [r{}] [%^%l%$] %v", rank));
  if (!level.empty()) {
    // An explicit level applies to rank 0; other ranks never go below warn so
    // that 64 ranks do not print 64 copies (debug and trace apply everywhere).
    logger->set_level(rank == 0 || lvl < spdlog::level::info ? lvl : std::max(lvl, spdlog::level::warn));
  } else {
    logger->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  }
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace mt
