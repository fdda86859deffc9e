#include "comm/env.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "comm/control.h"
#include "comm/watchdog.h"
#include "runtime/core/device.h"
#include "runtime/core/error.h"
#include "runtime/core/fault.h"
#include "runtime/core/startup.h"
#include "runtime/core/stream.h"

namespace mt {

namespace {
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0') ? int(x) : fallback;
}
}  // namespace

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int provided = 0;
  // The watchdog runs from the start: MPI_Init waits for every rank of the job
  // (with the timeout set before, from the command line's config, or the default).
  watchdog_start();
  // MULTIPLE: the watchdog thread may call MPI_Abort while the main thread is
  // blocked inside a collective.
  {
    WatchdogScope w("MPI_Init", "the job's start-up");
    fault_stop_point("MPI_Init");
    MT_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  }
  watchdog_mpi_ready();
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  host_ = std::string(name, size_t(len));
  set_process_identity(rank_, host_);

  // Node-local rank: the launcher's variables when present (Open MPI, Slurm),
  // else ranks sharing memory with this one.
  MPI_Comm node;
  {
    WatchdogScope w("MPI_Comm_split_type", fmt::format("the world ({} ranks), finding node-local ranks", size_));
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
  }
  int node_rank = 0, node_size = 1;
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  local_rank_ = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("SLURM_LOCALID", node_rank));
  local_size_ = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env_int("SLURM_NTASKS_PER_NODE", node_size));
  startup::mark("mpi");
  (void)provided;
}

int MpiEnv::cuda_device() const {
  if (!device_found_) {
    device_found_ = true;
    int ndev = cuda_device_count();
    if (ndev > 0) {
      cuda_device_ = local_rank_ % ndev;
      set_device(cuda_device_);
    }
  }
  return cuda_device_;
}

// A rank stopped near the end must not hold the others forever: a watched
// barrier first (it names the ranks that did not arrive), then MPI_Finalize
// (which waits for every rank too) still under the watchdog.
MpiEnv::~MpiEnv() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    if (size_ > 1) {
      try {
        control_barrier(MPI_COMM_WORLD, "exit barrier");
      } catch (const std::exception& e) {
        abort_job(e.what(), 1);
      }
    }
    watchdog_mpi_finalizing();
    WatchdogScope w("MPI_Finalize", fmt::format("the world ({} ranks), at exit", size_));
    MPI_Finalize();
  }
  watchdog_stop();
}

void abort_job(const std::string& msg, int code) {
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  int init = 0;
  MPI_Initialized(&init);
  if (init) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void fail_mpi(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(fmt::format("[mpi] {} failed: {} at {}", call, std::string(text, size_t(len)), where(file, line)));
}

}  // namespace mt
