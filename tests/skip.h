// A test case that cannot run here (no GPU, a rank count it does not fit, a missing tool) ends with
// MT_SKIP(why): the suite's summary line counts it as skipped, never as passed. The test mains
// (unit_main.cpp, mpi/mpi_main.cpp) read the flag through SuiteCounts.
#pragma once
#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace mt_test {

// Set by MT_SKIP in the running test case; cleared when the next case starts.
inline bool& case_skipped() {
  static bool skipped = false;
  return skipped;
}

// Per test case, in run order: 0 passed, 1 skipped, 2 failed (the order combines ranks by maximum).
enum CaseResult : int { case_passed = 0, case_skip = 1, case_failed = 2 };

inline std::vector<int>& case_results() {
  static std::vector<int> r;
  return r;
}
inline std::vector<std::string>& case_names() {
  static std::vector<std::string> n;
  return n;
}

// Records each case's result; a case marked doctest::skip() counts as skipped.
struct SuiteCounts : doctest::IReporter {
  explicit SuiteCounts(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    case_skipped() = false;
    case_names().emplace_back(tc.m_name);
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    bool failed = st.failure_flags != 0 || !st.testCaseSuccess;
    case_results().push_back(failed ? case_failed : case_skipped() ? case_skip : case_passed);
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData& tc) override {
    if (!tc.m_skip) return;  // filtered out on the command line: not part of this run
    case_names().emplace_back(tc.m_name);
    case_results().push_back(case_skip);
  }
};

}  // namespace mt_test

#define MT_SKIP(why)                  \
  do {                                \
    MESSAGE("skipped: " << (why));    \
    ::mt_test::case_skipped() = true; \
    return;                           \
  } while (0)
