// The self-check's parts that need no other rank (comm/self_check.h): --sizes' ranges and their errors, the ops.
#include <doctest/doctest.h>

#include "check_error.h"
#include "comm/self_check.h"

using namespace mt;

TEST_CASE("size ranges double from the first size up to the second") {
  CHECK(parse_size_range("1K:8K") == std::vector<int64_t>{1024, 2048, 4096, 8192});
  CHECK(parse_size_range("4M") == std::vector<int64_t>{4 << 20});
  CHECK(parse_size_range("100:300") == std::vector<int64_t>{100, 200});
  CHECK(parse_size_range("1KiB:1GiB").back() == int64_t(1) << 30);
  CHECK(parse_size_range("0.5K") == std::vector<int64_t>{512});
}

TEST_CASE("bad sizes are errors naming the size and the spec") {
  CHECK_ERROR_CONTAINS(parse_size_range("1X"), "[check] bad size '1X' in --sizes '1X' (expected e.g. 1K, 4M, 1G)");
  CHECK_ERROR_CONTAINS(parse_size_range(":4K"), "bad size '' in --sizes ':4K'");
  CHECK_ERROR_CONTAINS(parse_size_range("0"), "bad size '0'");
  CHECK_ERROR_CONTAINS(parse_size_range("8K:1K"), "--sizes '8K:1K': the first size must not exceed the second");
}

TEST_CASE("the check knows every collective, barrier last") {
  const auto& ops = self_check_ops();
  CHECK(ops.size() == 7);
  CHECK(ops.front() == "all_reduce");
  CHECK(ops.back() == "barrier");
}
