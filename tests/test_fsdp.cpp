// fully_shard's layout rule on parameters of many shapes (pure: specs only, no communication): below the
// threshold, one divisible dim, several, only the tp-sharded dim divisible, none.
#include <doctest/doctest.h>

#include "parallel/fully_shard.h"

using namespace mt;

namespace {

// A (dp_shard, tp) mesh; the parameter laid out as `tp_place` on tp, Replicate on dp_shard.
DTensorSpec spec(int ds, int tp, const Shape& shape, Placement tp_place = Placement::Replicate()) {
  return DTensorSpec::make({{"dp_shard", ds}, {"tp", tp}}, {Placement::Replicate(), tp_place}, shape);
}

}  // namespace

TEST_CASE("fully_shard layout rule: threshold, largest divisible dim, two mesh dims, none") {
  struct Case {
    const char* what;
    int ds, tp;
    Shape shape;
    Placement tp_place;
    int64_t min_weight_size;
    int want_dim;  // -1: replicated
    bool want_with_tp, want_warn;
  };
  const Placement R = Placement::Replicate(), S0 = Placement::Shard(0), S1 = Placement::Shard(1);
  std::vector<Case> cases{
      {"at the threshold stays replicated", 2, 1, {16, 16}, R, 256, -1, false, false},
      {"two elements above the threshold is sharded", 2, 1, {258}, R, 256, 0, false, false},
      {"a norm weight below the threshold", 4, 1, {128}, R, 1000, -1, false, false},
      {"the largest dim when both divide", 2, 1, {64, 256}, R, 0, 1, false, false},
      {"ties go to the first dim", 2, 1, {64, 64}, R, 0, 0, false, false},
      {"the largest divisible dim, not the largest", 4, 1, {250, 64}, R, 0, 1, false, false},
      {"a 3-D weight: dim 2", 2, 1, {3, 5, 8}, R, 0, 2, false, false},
      {"tp shards dim 0: dim 1 is free", 2, 2, {128, 96}, S0, 0, 1, false, false},
      {"tp shards the larger dim: the free one wins", 2, 2, {512, 64}, S0, 0, 1, false, false},
      {"only the tp dim divides: both mesh dims on it", 2, 2, {128, 5}, S0, 0, 0, true, false},
      {"the tp dim divides by tp but not by tp x dp_shard", 4, 2, {12, 5}, S0, 0, -1, false, true},
      {"only the tp dim (1) divides, by the product 8", 4, 2, {5, 64}, S1, 0, 1, true, false},
      {"no dim divides: replicated with a warning", 4, 1, {250, 7}, R, 0, -1, false, true},
      {"dp_shard 1 divides everything", 1, 1, {3, 5}, R, 0, 1, false, false},
  };
  for (const Case& c : cases) {
    INFO(std::string(c.what));
    FsdpDecision d = decide_fsdp_layout("w", spec(c.ds, c.tp, c.shape, c.tp_place), 0, c.min_weight_size);
    CHECK(d.tensor_dim == c.want_dim);
    CHECK(d.with_tp == c.want_with_tp);
    CHECK(d.warn == c.want_warn);
    CHECK(!d.reason.empty());
  }
}
