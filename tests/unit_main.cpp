// Test main for the single-process suites: doctest's own report, then one summary line that
// scripts/test.sh reads, with the cases that skipped themselves (MT_SKIP) counted apart:
//   "[unit] 120 passed, 0 failed, 1 skipped"   (the name: MT_SUITE_NAME, default "unit")
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

#include "skip.h"

REGISTER_LISTENER("suite_counts", 1, mt_test::SuiteCounts);

int main(int argc, char** argv) {
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  int passed = 0, failed = 0, skipped = 0;
  for (int r : mt_test::case_results()) {
    if (r == mt_test::case_failed) ++failed;
    else if (r == mt_test::case_skip) ++skipped;
    else ++passed;
  }
  const char* name = std::getenv("MT_SUITE_NAME");
  std::printf("[%s] %d passed, %d failed, %d skipped\n", name ? name : "unit", passed, failed, skipped);
  return rc;
}
