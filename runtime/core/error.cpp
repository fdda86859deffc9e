#include "runtime/core/error.h"

namespace mt {

namespace {
int g_rank = -1;
std::string g_host;
}  // namespace

void set_process_identity(int rank, std::string host) {
  g_rank = rank;
  g_host = std::move(host);
}
int process_rank() { return g_rank; }
const std::string& process_host() { return g_host; }

std::string where(const char* file, int line) {
  std::string s = fmt::format("{}:{}", file, line);
  if (g_rank >= 0) s += fmt::format(", rank {} on host {}", g_rank, g_host);
  return s;
}

}  // namespace mt
