// Test main for the multi-rank suites: every rank runs every test case; the
// per-case results are combined across ranks (a case fails if it fails on
// any rank, and is skipped if it skipped itself, MT_SKIP, on any rank and
// failed on none) and rank 0 prints one summary line that scripts/test.sh reads:
//   "[test_mpi np=4] 12 passed, 0 failed, 3 skipped"
// A test that hangs is ended by the watchdog (MT_TEST_TIMEOUT seconds, 120 by default).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/env.h"
#include "comm/watchdog.h"
#include "runtime/core/device.h"
#include "runtime/core/log.h"
#include "../skip.h"
#include "mpi_world.h"

REGISTER_LISTENER("suite_counts", 1, mt_test::SuiteCounts);

namespace {
const mt::MpiEnv* g_env = nullptr;
}
const mt::MpiEnv& test_env() { return *g_env; }

int main(int argc, char** argv) {
  mt::MpiEnv env(&argc, &argv);
  g_env = &env;
#if MT_TEST_GPU_MAIN
  // test_gpu: this rank's device made current at start, as for a CUDA run (MpiEnv finds it when first asked).
  if (mt::cuda_built()) (void)env.cuda_device();
#endif
  mt::init_logging(env.rank(), "warn");
  const char* t = std::getenv("MT_TEST_TIMEOUT");
  mt::watchdog_set_timeout(t ? std::atof(t) : 120.0);

  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  ctx.setOption("minimal", true);  // failures only; the summary comes from rank 0 below
  ctx.setOption("no-version", true);
  ctx.setOption("no-colors", true);
  int rc = ctx.run();
  if (ctx.shouldExit()) return rc;

  std::vector<int>& results = mt_test::case_results();
  int n = int(results.size()), nmax = 0;
  MPI_Allreduce(&n, &nmax, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  results.resize(size_t(nmax), mt_test::case_failed);  // a rank that ran fewer cases failed the rest
  std::vector<int> worst(size_t(nmax), 0);
  MPI_Allreduce(results.data(), worst.data(), nmax, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int failed = 0, skipped = 0;
  const std::vector<std::string>& names = mt_test::case_names();
  for (int i = 0; i < nmax; ++i) {
    if (worst[size_t(i)] == mt_test::case_skip) ++skipped;
    if (worst[size_t(i)] != mt_test::case_failed) continue;
    ++failed;
    if (env.rank() == 0 && size_t(i) < names.size())
      std::printf("FAILED (on some rank): %s\n", names[size_t(i)].c_str());
  }
  if (env.rank() == 0) {
    const char* name = std::getenv("MT_SUITE_NAME");
    std::printf("[%s np=%d] %d passed, %d failed, %d skipped\n", name ? name : "test_mpi", env.size(),
                nmax - failed - skipped, failed, skipped);
    std::fflush(stdout);
  }
  return failed ? 1 : 0;
}
