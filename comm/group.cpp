#include "comm/group.h"

#include <numeric>

namespace mt {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

ReduceOp reduce_op_from_name(std::string_view s) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
    if (reduce_op_name(op) == s) return op;
  fail("comm", "unknown reduce op '{}' (expected sum, avg, max or min)", s);
}

std::string Group::describe() const {
  std::string r;
  size_t n = std::min<size_t>(world_ranks_.size(), 16);
  for (size_t i = 0; i < n; ++i) r += (i ? "," : "") + std::to_string(world_ranks_[i]);
  if (world_ranks_.size() > n) r += ",...";
  return fmt::format("group '{}' (world ranks {})", name_, r);
}

Work Group::all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async) {
  check_same("all_reduce", out, in);
  check_count("all_reduce", "output", out, in.numel());
  copy_(out, in);
  return all_reduce(out, op, async);
}

void Group::check_same(const char* op, const Tensor& a, const Tensor& b) const {
  MT_CHECK(a.dtype() == b.dtype() && a.device() == b.device(), "comm",
           "{} on {}: input is {} on {}, output is {} on {}; they must match", op, describe(), dtype_name(b.dtype()),
           b.device().str(), dtype_name(a.dtype()), a.device().str());
}

void Group::check_count(const char* op, const char* what, const Tensor& t, int64_t expected) const {
  MT_CHECK(t.numel() == expected, "comm", "{} on {}: {} has {} elements, expected {}", op, describe(), what, t.numel(),
           expected);
}

void Group::check_counts(const char* op, const std::vector<int64_t>& counts) const {
  MT_CHECK(int(counts.size()) == size(), "comm", "{} on {}: {} counts given for {} ranks", op, describe(),
           counts.size(), size());
  for (int64_t c : counts) MT_CHECK(c >= 0, "comm", "{} on {}: negative count {}", op, describe(), c);
}

}  // namespace mt
