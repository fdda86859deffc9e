// `plan --search` (runtime/planner/plan_search.h): the plans it skips by memory are the ones a full search finds too
// large, its pipelines (pp = 1 and each stage count with 1f1b and interleaved_1f1b) and their micro-batches, each
// plan's --set arguments giving back the estimate it was ranked by, and --keep-pp.
#include <doctest/doctest.h>

#include <set>

#include "runtime/planner/cluster.h"
#include "runtime/planner/plan_search.h"
#include "runtime/train/run_config.h"

using namespace mt;

namespace {

// 8 layers, batch 8 of 64 tokens: small enough to estimate a few hundred plans in a second.
const char* kModel = R"(
model: {dim: 64, n_layers: 8, n_heads: 8, n_kv_heads: 4, ffn_dim: 96, vocab_size: 256, max_seq_len: 64}
training: {steps: 1, batch_size: 8, seq_len: 64, threads: 1}
data: {train: "", val: ""}
)";

// The shipped H100 file (8 GPUs a node) with a device memory that holds some plans and not others (set per test).
ClusterSpec cluster_with(double gib) {
  ClusterSpec c = load_cluster(MT_SOURCE_DIR "/configs/clusters/h100_ib.yaml");
  c.device_memory_gib = gib;
  return c;
}

}  // namespace

TEST_CASE("plan --search: skipping by memory loses no plan that fits") {
  const Config cfg = config_from_yaml_string(kModel);
  // The peaks of the plans on 8 ranks lie between about 1 and 8 MiB: a limit in between leaves some of each.
  for (double mib : {1.5, 2.5, 4.0}) {
    CAPTURE(mib);
    const ClusterSpec cl = cluster_with(mib / 1024.0);
    const PlanSearch pruned = search_plans(cfg, 8, cl, {false, true});
    const PlanSearch full = search_plans(cfg, 8, cl, {false, false});
    CHECK(full.pruned == 0);
    CHECK(pruned.pruned > 0);
    CHECK(pruned.tried == full.tried);
    CHECK(pruned.too_large == full.too_large);
    CHECK(pruned.refused == full.refused);
    REQUIRE(pruned.ranked.size() == full.ranked.size());
    REQUIRE(!full.ranked.empty());
    std::multiset<std::string> a, b;
    for (const PlanCandidate& c : pruned.ranked) a.insert(c.label);
    for (const PlanCandidate& c : full.ranked) b.insert(c.label);
    CHECK(a == b);
    CHECK(pruned.ranked.front().estimate.step_s == full.ranked.front().estimate.step_s);
  }
}

TEST_CASE("plan --search: pipelines searched, their micro-batches, the --set arguments reproduce the estimate") {
  const Config cfg = config_from_yaml_string(kModel);
  const ClusterSpec cl = cluster_with(16);
  const PlanSearch s = search_plans(cfg, 8, cl);
  std::set<std::string> pipelines;
  for (const PlanCandidate& c : s.ranked) {
    CAPTURE(c.label);
    const Config& got = c.estimate.config;
    pipelines.insert(fmt::format("{} {} {}", got.parallel.pp, got.parallel.pp_schedule, got.parallel.pp_virtual));
    const int pp = got.parallel.pp;
    const int64_t dp = int64_t(got.parallel.dp_replicate) * got.parallel.dp_shard;
    const int64_t rows = cfg.training.batch_size / dp;
    const int64_t m = got.training.micro_batch_size > 0 ? rows / got.training.micro_batch_size : 1;
    if (pp > 1) {
      CHECK(m >= pp);
      if (got.parallel.pp_schedule == "interleaved_1f1b") CHECK(m % pp == 0);
      CHECK(c.label.rfind(fmt::format("pp={} ", pp), 0) == 0);
    }
  }
  // 8 ranks, 8 layers: pp 2, 4 and 8 with 1f1b; interleaved (2 chunks a rank) with pp 2 and 4.
  CHECK(pipelines == std::set<std::string>{"1 1f1b 1", "2 1f1b 1", "2 interleaved_1f1b 2", "4 1f1b 1",
                                           "4 interleaved_1f1b 2", "8 1f1b 1"});
  // Every plan's printed --set arguments, applied to the config, give the estimate it was ranked by.
  for (size_t i = 0; i < s.ranked.size(); i += 17) {
    const PlanCandidate& c = s.ranked[i];
    CAPTURE(c.label);
    const Estimate e = estimate_run(config_from_yaml_string(kModel, c.overrides), 8, cl);
    CHECK(e.step_s == c.estimate.step_s);
    CHECK(e.stages.size() == c.estimate.stages.size());
  }
}

TEST_CASE("plan --search --keep-pp: the config's pipeline only") {
  const Config cfg = config_from_yaml_string(
      kModel, {"parallel.pp=2", "parallel.pp_schedule=gpipe", "training.micro_batch_size=1"});
  const PlanSearch s = search_plans(cfg, 8, cluster_with(16), {true, true});
  REQUIRE(!s.ranked.empty());
  for (const PlanCandidate& c : s.ranked) {
    CAPTURE(c.label);
    CHECK(c.estimate.config.parallel.pp == 2);
    CHECK(c.estimate.config.parallel.pp_schedule == "gpipe");
    CHECK(c.estimate.config.training.micro_batch_size == 1);
    for (const std::string& o : c.overrides) CHECK(o.rfind("parallel.pp", 0) != 0);
  }
  // Without it the same config's search also tries pp = 1 and the config's gpipe beside 1f1b.
  const PlanSearch all = search_plans(cfg, 8, cluster_with(16));
  std::set<std::string> kinds;
  for (const PlanCandidate& c : all.ranked)
    kinds.insert(fmt::format("{} {}", c.estimate.config.parallel.pp, c.estimate.config.parallel.pp_schedule));
  CHECK(kinds.count("1 gpipe") == 1);  // pp = 1 keeps the config's schedule name (unused)
  CHECK(kinds.count("2 gpipe") == 1);
  CHECK(kinds.count("2 1f1b") == 1);
}

TEST_CASE("plan --search: the same ranking on 1 thread and on several") {
  const Config cfg = config_from_yaml_string(kModel);
  const ClusterSpec cl = cluster_with(2.5 / 1024.0);
  const PlanSearch one = search_plans(cfg, 8, cl, {false, true, 1});
  const PlanSearch three = search_plans(cfg, 8, cl, {false, true, 3});
  CHECK(one.threads == 1);
  CHECK(three.threads == 3);
  CHECK(one.tried == three.tried);
  CHECK(one.too_large == three.too_large);
  CHECK(one.refused == three.refused);
  CHECK(one.smallest_peak == three.smallest_peak);
  REQUIRE(one.ranked.size() == three.ranked.size());
  for (size_t i = 0; i < one.ranked.size(); ++i) {
    CHECK(one.ranked[i].label == three.ranked[i].label);
    CHECK(one.ranked[i].estimate.step_s == three.ranked[i].estimate.step_s);
    CHECK(one.ranked[i].peak_bytes == three.ranked[i].peak_bytes);
  }
}
