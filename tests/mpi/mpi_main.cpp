// Test main for the multi-rank suites: every rank runs every test case; the
// per-case results are combined across ranks (a case fails if it fails on
// any rank) and rank 0 prints one summary line that scripts/test.sh reads:
//   "[test_mpi np=4] 12 passed, 0 failed"
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
#include "runtime/core/log.h"

namespace {

std::vector<int> g_case_failed;  // one flag per test case, in run order
std::vector<std::string> g_case_names;

struct RankListener : doctest::IReporter {
  explicit RankListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override { g_case_names.emplace_back(tc.m_name); }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    g_case_failed.push_back(st.failure_flags != 0 || !st.testCaseSuccess ? 1 : 0);
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("rank_listener", 1, RankListener);

}  // namespace

int main(int argc, char** argv) {
  mt::MpiEnv env(&argc, &argv);
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

  int n = int(g_case_failed.size()), nmax = 0;
  MPI_Allreduce(&n, &nmax, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  g_case_failed.resize(size_t(nmax), 1);  // a rank that ran fewer cases failed the rest
  std::vector<int> any(size_t(nmax), 0);
  MPI_Allreduce(g_case_failed.data(), any.data(), nmax, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int failed = 0;
  for (int i = 0; i < nmax; ++i) {
    if (any[size_t(i)]) {
      ++failed;
      if (env.rank() == 0 && size_t(i) < g_case_names.size())
        std::printf("FAILED (on some rank): %s\n", g_case_names[size_t(i)].c_str());
    }
  }
  if (env.rank() == 0) {
    const char* name = std::getenv("MT_SUITE_NAME");
    std::printf("[%s np=%d] %d passed, %d failed\n", name ? name : "test_mpi", env.size(), nmax - failed, failed);
    std::fflush(stdout);
  }
  return failed ? 1 : 0;
}
