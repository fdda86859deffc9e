#include "runtime/core/startup.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>

namespace mt::startup {

namespace {

// Seconds from the process's start to now by the kernel's clocks (starttime, field 22 of /proc/self/stat, in
// clock ticks since boot, against CLOCK_BOOTTIME); -1 when unreadable or implausible.
double seconds_since_exec() {
  std::ifstream f("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  timespec now{};
  const long hz = sysconf(_SC_CLK_TCK);
  if (!fields || hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &now) != 0) return -1;
  const double started = double(std::stoull(field)) / double(hz);
  const double since = double(now.tv_sec) + 1e-9 * double(now.tv_nsec) - started;
  return since >= 0 && since < 600 ? since : -1;
}

struct Clock {
  std::chrono::steady_clock::time_point start;
  std::mutex mu;
  std::vector<std::pair<std::string, double>> marks;
  Clock() {
    const auto now = std::chrono::steady_clock::now();
    double exec = 0;
    try {
      exec = std::max(0.0, seconds_since_exec());
    } catch (...) {  // a malformed field: counted from here
    }
    start = now - std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(exec));
    marks.emplace_back("exec", exec);
  }
};

Clock& clock() {
  static Clock c;
  return c;
}

// Started with the static initialisation, before main.
const bool g_started = (clock(), true);

}  // namespace

double seconds_since_process_start() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - clock().start).count();
}

void mark(const std::string& part) {
  const double t = seconds_since_process_start();
  Clock& c = clock();
  std::lock_guard lock(c.mu);
  for (const auto& m : c.marks)
    if (m.first == part) return;
  c.marks.emplace_back(part, t);
}

std::vector<std::pair<std::string, double>> marks() {
  Clock& c = clock();
  std::lock_guard lock(c.mu);
  return c.marks;
}

}  // namespace mt::startup
