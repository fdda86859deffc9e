#include "runtime/train/plan_search.h"

#include <algorithm>

#include "runtime/core/error.h"

namespace mt {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

std::string mib(double b) { return fmt::format("{:.2f} MiB", b / double(1 << 20)); }
std::string human(double b) { return b >= double(1 << 30) ? fmt::format("{:.2f} GiB", b / double(1 << 30)) : mib(b); }

// The largest term of a stage's step: compute, or the collective costing most, or the bubble.
std::string largest_cost(const StageEstimate& s) {
  std::string what = fmt::format("compute {:.3f} ms", 1e3 * s.compute_s);
  double most = s.compute_s;
  for (const CommPart& c : s.comm)
    if (c.seconds > most) most = c.seconds, what = fmt::format("{} {} over {} {:.3f} ms", c.tag, c.kind, c.group, 1e3 * c.seconds);
  if (s.bubble_s > most) what = fmt::format("pipeline bubble {:.3f} ms", 1e3 * s.bubble_s);
  return what;
}

}  // namespace

PlanSearch search_plans(const Config& cfg, int world, const ClusterSpec& cluster) {
  MT_CHECK(world >= 1, "plan", "--world {}: expected >= 1 ranks", world);
  PlanSearch out;
  const int pp = std::max(1, cfg.parallel.pp);
  MT_CHECK(world % pp == 0, "config", "parallel.pp = {} does not divide --world {}", pp, world);
  const int stage = world / pp;
  const double capacity = cluster.device_memory_gib * double(1 << 30);
  out.smallest_peak = -1;
  for (int tp : divisors(stage)) {
    if (tp > cluster.devices_per_node) continue;  // tensor parallel stays inside a node
    for (int cp : divisors(stage / tp))
      for (int dp_shard : divisors(stage / tp / cp)) {
        const int dp_replicate = stage / tp / cp / dp_shard;
        const std::vector<std::string> methods = cp > 1 ? std::vector<std::string>{"ring", "all_gather", "alltoall"}
                                                        : std::vector<std::string>{cfg.parallel.cp_method};
        for (const std::string& method : methods)
          for (int sp = tp > 1 ? 0 : 1; sp < 2; ++sp)
            for (int ac = 0; ac < 3; ++ac)
              for (int reshard = dp_shard > 1 ? 0 : 1; reshard < 2; ++reshard) {
                Config c = cfg;
                auto& p = c.parallel;
                p.dp_replicate = dp_replicate, p.dp_shard = dp_shard, p.cp = cp, p.tp = tp;
                p.cp_ring = p.cp_ulysses = 0;
                p.cp_method = method;
                p.sequence_parallel = sp == 1;
                p.fsdp.reshard_after_forward = reshard == 1;
                p.recompute.patterns.clear(), p.recompute.keep.clear();
                if (ac > 0) p.recompute.patterns = {"model.layers.*"};
                if (ac == 2) p.recompute.keep = {"attention"};
                PlanCandidate cand;
                std::string label;
                auto part = [&](const std::string& s) { label += (label.empty() ? "" : " x ") + s; };
                if (pp > 1) part(fmt::format("pp={}", pp));
                if (dp_replicate > 1) part(fmt::format("dp_replicate={}", dp_replicate));
                if (dp_shard > 1) part(fmt::format("dp_shard={}{}", dp_shard, reshard ? "" : " (no reshard)"));
                if (cp > 1) part(fmt::format("cp={} ({})", cp, method));
                if (tp > 1) part(fmt::format("tp={}{}", tp, sp ? " (sequence parallel)" : ""));
                if (label.empty()) label = "1 rank";
                label += ac == 0 ? "" : ac == 1 ? ", recompute full" : ", recompute selective";
                cand.label = label;
                cand.overrides = {fmt::format("parallel.dp_replicate={}", dp_replicate),
                                  fmt::format("parallel.dp_shard={}", dp_shard), fmt::format("parallel.cp={}", cp),
                                  fmt::format("parallel.cp_method={}", method), fmt::format("parallel.tp={}", tp),
                                  fmt::format("parallel.sequence_parallel={}", sp ? "true" : "false"),
                                  fmt::format("parallel.fsdp.reshard_after_forward={}", reshard ? "true" : "false"),
                                  ac == 0 ? "parallel.recompute.patterns=[]"
                                          : "parallel.recompute.patterns=[\"model.layers.*\"]",
                                  ac == 2 ? "parallel.recompute.keep=[\"attention\"]" : "parallel.recompute.keep=[]"};
                ++out.tried;
                try {
                  cand.estimate = estimate_run(c, world, cluster);
                } catch (const Error& e) {
                  std::string why = e.what();
                  why = why.substr(0, std::min<size_t>(why.size(), why.find(':') == std::string::npos ? 60 : why.find(':') + 30));
                  ++out.refused[why];
                  continue;
                }
                for (const StageEstimate& s : cand.estimate.stages) cand.peak_bytes = std::max(cand.peak_bytes, s.peak_bytes);
                cand.fits = cand.peak_bytes <= capacity;
                if (out.smallest_peak < 0 || cand.peak_bytes < out.smallest_peak) out.smallest_peak = cand.peak_bytes;
                if (!cand.fits) {
                  ++out.too_large;
                  continue;
                }
                out.ranked.push_back(std::move(cand));
              }
      }
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.estimate.step_s != b.estimate.step_s) return a.estimate.step_s < b.estimate.step_s;
    return a.peak_bytes < b.peak_bytes;  // a tie: the plan with more headroom
  });
  if (out.ranked.empty()) {
    const double need = out.smallest_peak;
    if (need > 0) {
      out.advice.push_back(fmt::format("the smallest plan needs {} per rank against {:.1f} GiB", human(need),
                                       cluster.device_memory_gib));
      out.advice.push_back(fmt::format("more ranks: about {:.0f}x as many to shard the state and the activations further",
                                       std::ceil(need / capacity)));
      out.advice.push_back("a shorter training.seq_len or a smaller training.micro_batch_size (activations scale with "
                           "both); recompute is already among the plans tried");
    }
  }
  return out;
}

std::string plan_search_table(const PlanSearch& s, const ClusterSpec& cluster, int top) {
  std::string out = fmt::format("{} plans tried on {}: {} fit in {:.1f} GiB, {} too large, {} refused\n", s.tried,
                                cluster.name, s.ranked.size(), cluster.device_memory_gib, s.too_large,
                                [&] {
                                  int64_t n = 0;
                                  for (auto& [w, k] : s.refused) n += k;
                                  return n;
                                }());
  for (auto& [why, n] : s.refused) out += fmt::format("  refused ({} plans): {}...\n", n, why);
  if (s.ranked.empty()) {
    out += "no plan fits:\n";
    for (const std::string& a : s.advice) out += "  " + a + "\n";
    return out;
  }
  const double capacity = cluster.device_memory_gib * double(1 << 30);
  for (int i = 0; i < top && i < int(s.ranked.size()); ++i) {
    const PlanCandidate& c = s.ranked[size_t(i)];
    const StageEstimate* slow = &c.estimate.stages.front();
    for (const StageEstimate& st : c.estimate.stages)
      if (st.step_s > slow->step_s) slow = &st;
    out += fmt::format("\n{}. {}: step {:.3f} ms, {:.0f} tokens/s, MFU {:.1f}%\n", i + 1, c.label, 1e3 * c.estimate.step_s,
                       c.estimate.tokens_per_s, 100 * c.estimate.mfu);
    out += fmt::format("   memory {} of {:.1f} GiB ({:.0f}% headroom); exposed communication {:.3f} ms; largest cost: {}\n",
                       human(c.peak_bytes), cluster.device_memory_gib, 100 * (1 - c.peak_bytes / capacity),
                       1e3 * slow->exposed_comm_s, largest_cost(*slow));
    std::string sets;
    for (const std::string& o : c.overrides) sets += " --set " + o;
    out += "  " + sets + "\n";
  }
  return out;
}

}  // namespace mt
