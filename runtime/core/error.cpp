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
  if (g_rank < 0) return fmt::format("{}:{}", file, line);
  return fmt::format("{}:{}, rank {} on host {}", file, line, g_rank, g_host);
}

}  // namespace mt
