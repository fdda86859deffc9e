#include "runtime/core/fault.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>

#include "runtime/core/error.h"
#include "runtime/core/trace.h"

namespace mt {

namespace {
// This process's world rank: known once MPI is up, before that only from the launcher.
int fault_rank() {
  int me = process_rank();
  if (me < 0)
    for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"})
      if (const char* v = std::getenv(var); v && *v) {
        me = std::atoi(v);
        break;
      }
  return me;
}

const char* stop_spec() {
  static const char* spec = std::getenv("MT_FAULT_STOP_AT");
  return spec;
}
bool stop_fired = false;
}  // namespace

bool fault_stop_armed() { return stop_spec() && *stop_spec() && !stop_fired; }

void fault_stop_point(std::string_view label) {
  const char* spec = stop_spec();
  if (!spec || !*spec || stop_fired) return;
  std::string_view v(spec);
  size_t colon = v.rfind(':');
  if (colon == std::string_view::npos) return;
  std::string_view point = v.substr(0, colon);
  int rank = std::atoi(std::string(v.substr(colon + 1)).c_str());
  if (rank != fault_rank() || label.substr(0, point.size()) != point) return;
  stop_fired = true;
  std::fprintf(stderr, "[fault] MT_FAULT_STOP_AT=%s: rank %d (pid %d) stops itself at '%.*s'\n", spec, rank,
               int(::getpid()), int(label.size()), label.data());
  std::fflush(stderr);
  std::raise(SIGSTOP);
}

void fault_slow_rank() {
  // Read at the first step, when MPI is up: (-1, 0) unless this rank is the slow one.
  static const std::pair<int, int> f = [] {
    const char* e = std::getenv("MT_FAULT_SLOW_RANK");
    int rank = -1, ms = 0;
    if (!e || std::sscanf(e, "%d:%d", &rank, &ms) != 2 || rank != fault_rank()) rank = -1;
    return std::pair<int, int>{rank, ms};
  }();
  if (f.first < 0) return;
  trace::Span span("MT_FAULT_SLOW_RANK sleep", "op");
  std::this_thread::sleep_for(std::chrono::milliseconds(f.second));
}

void fault_slow_trace(int64_t events) {
  static const std::pair<int, int> f = [] {
    const char* e = std::getenv("MT_FAULT_SLOW_TRACE");
    int rank = -1, us = 0;
    if (!e || std::sscanf(e, "%d:%d", &rank, &us) != 2 || rank != fault_rank()) rank = -1;
    return std::pair<int, int>{rank, us};
  }();
  if (f.first >= 0) std::this_thread::sleep_for(std::chrono::microseconds(int64_t(f.second) * events));
}

bool fault_checkpoint_at(int64_t step, bool error) {
  const char* f = std::getenv("MT_FAULT_CHECKPOINT");
  if (!f || std::atoll(f) != step) return false;
  return error == (std::string(f).find(":error") != std::string::npos);
}

void fault_memory_checkpoint(int64_t step) {
  const char* f = std::getenv("MT_FAULT_MEMORY");
  if (!f) return;
  long long s = -1;
  int rank = -1;
  if (std::sscanf(f, "%lld:%d", &s, &rank) != 2 || s != step || rank != fault_rank()) return;
  std::fprintf(stderr, "[fault] MT_FAULT_MEMORY=%s: rank %d (pid %d) is killed (SIGKILL) half way through writing "
               "its in-memory checkpoint of step %lld\n", f, rank, int(::getpid()), s);
  std::fflush(stderr);
  ::raise(SIGKILL);
}

}  // namespace mt
