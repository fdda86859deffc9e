#include "runtime/planner/plan_search.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#include "runtime/core/bytes_format.h"
#include "models/model.h"
#include "runtime/core/error.h"
#include "runtime/core/log.h"

namespace mt {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The largest term of a stage's step: compute, or the collective costing most, or the bubble.
std::string largest_cost(const StageEstimate& s) {
  std::string what = fmt::format("compute {:.3f} ms", 1e3 * s.compute_s);
  double most = s.compute_s;
  for (const CommPart& c : s.comm)
    if (c.seconds > most) most = c.seconds, what = fmt::format("{} {} over {} {:.3f} ms", c.tag, c.kind, c.group, 1e3 * c.seconds);
  if (s.bubble_s > most) what = fmt::format("pipeline bubble {:.3f} ms", 1e3 * s.bubble_s);
  return what;
}

// The pipelines tried: pp = 1, or a stage count p dividing the world (p <= the decoder layers) with 1f1b and, where
// the layers allow two chunks a rank, interleaved_1f1b (virtual 2); the config's own schedule as well when it sets
// pp. Under keep_pp only the config's.
struct PpChoice {
  int p = 1;
  std::string schedule;
  int virt = 1;
};
std::vector<PpChoice> pp_choices(const Config& cfg, int world, bool keep_pp) {
  const auto& par = cfg.parallel;
  const PpChoice own{std::max(1, par.pp), par.pp_schedule, std::max(1, par.pp_virtual)};
  if (keep_pp) return {own};
  std::vector<PpChoice> out{{1, par.pp_schedule, 1}};
  auto add = [&](const PpChoice& c) {
    for (const PpChoice& o : out)
      if (o.p == c.p && o.schedule == c.schedule && o.virt == c.virt) return;
    out.push_back(c);
  };
  for (int p : divisors(world)) {
    if (p == 1 || p > cfg.model.n_layers) continue;
    add({p, "1f1b", 1});
    if (2 * p <= cfg.model.n_layers) add({p, "interleaved_1f1b", 2});
  }
  if (own.p > 1) add(own);
  return out;
}

// One mesh of one pipeline, with the cp method and sequence parallel: the unit the search hands a thread. Its up to
// six plans (recompute x reshard) are estimated in memory order, so the smaller ones can rule out the larger.
struct MeshItem {
  PpChoice pp;
  int dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  int ep = 1;  // an MoE model's expert parallel (a batch dim too)
  int64_t micro = 0;
  std::string method;
  bool sp = false;
  bool too_few_micro = false;  // fewer rows a data-parallel rank than stages: train refuses it; counted, not estimated
};

std::vector<MeshItem> mesh_items(const Config& cfg, int world, const ClusterSpec& cluster, const PlanSearchOptions& opt,
                                 const std::vector<PpChoice>& pipelines) {
  std::vector<MeshItem> items;
  for (const PpChoice& pp : pipelines) {
    const int stage = world / pp.p;
    for (int tp : divisors(stage)) {
      if (tp > cluster.devices_per_node) continue;  // tensor parallel stays inside a node
      for (int cp : divisors(stage / tp))
        for (int dp_shard : divisors(stage / tp / cp))
          for (int ep : divisors(stage / tp / cp / dp_shard)) {
          // An MoE model's experts split over ep, a divisor of the experts within the data-parallel ranks; a
          // dense model has none.
          if (ep > 1 && (!cfg.model.moe.enabled() || cfg.model.moe.n_experts % ep != 0)) continue;
          MeshItem it;
          it.pp = pp, it.tp = tp, it.cp = cp, it.dp_shard = dp_shard, it.ep = ep;
          it.dp_replicate = stage / tp / cp / dp_shard / ep;
          // The micro-batch under pp: the config's where it leaves at least p micro-batches on a data-parallel
          // rank (interleaved_1f1b: a multiple of p), else the largest that does (the time model does not see a
          // smaller GEMM's lower efficiency, so the search does not shrink it further); without pp, and under
          // --keep-pp, the config's.
          it.micro = cfg.training.micro_batch_size;
          const int64_t dp = int64_t(it.dp_replicate) * dp_shard * ep, rows = cfg.training.batch_size / dp;
          const bool divides = cfg.training.batch_size % dp == 0;
          if (!opt.keep_pp && pp.p > 1 && rows >= pp.p && divides) {
            const int64_t want = it.micro > 0 ? it.micro : rows;
            it.micro = 1;
            for (int64_t b = want; b >= 1; --b)
              if (rows % b == 0 && rows / b >= pp.p && (pp.schedule != "interleaved_1f1b" || rows / b % pp.p == 0)) {
                it.micro = b;
                break;
              }
          }
          it.too_few_micro = pp.p > 1 && divides && rows < pp.p;
          const std::vector<std::string> methods = cp > 1 ? std::vector<std::string>{"ring", "all_gather", "alltoall"}
                                                          : std::vector<std::string>{cfg.parallel.cp_method};
          for (const std::string& method : methods)
            for (int sp = tp > 1 ? 0 : 1; sp < 2; ++sp) {
              it.method = method, it.sp = sp == 1;
              items.push_back(it);
            }
        }
    }
  }
  return items;
}

// One plan of a mesh item: its reshard_after_forward (when dp_shard > 1) and its recompute (ac: 0 none, 1 full,
// 2 selective, keeping attention).
struct PlanVariant {
  int reshard = 1, ac = 0;
};

// The config of one plan: the item's mesh, pipeline, micro-batch and cp method, and the variant's recompute and
// resharding. layers: whole-layer recompute's pattern.
Config plan_config(const Config& cfg, const PlanSearchOptions& opt, const MeshItem& it, PlanVariant v,
                   const std::string& layers) {
  Config c = cfg;
  auto& p = c.parallel;
  p.pp = it.pp.p, p.pp_schedule = it.pp.schedule, p.pp_virtual = it.pp.virt;
  if (!opt.keep_pp && it.pp.p != std::max(1, cfg.parallel.pp)) p.pp_layers.clear();
  c.training.micro_batch_size = it.micro;
  p.dp_replicate = it.dp_replicate, p.dp_shard = it.dp_shard, p.cp = it.cp, p.tp = it.tp;
  if (cfg.model.moe.enabled()) p.ep = it.ep;
  p.cp_ring = p.cp_ulysses = 0;
  p.cp_method = it.method;
  p.sequence_parallel = it.sp;
  p.fsdp.reshard_after_forward = v.reshard == 1;
  p.recompute.patterns.clear(), p.recompute.keep.clear();
  if (v.ac > 0) p.recompute.patterns = {layers};
  if (v.ac == 2) p.recompute.keep = {"attention"};
  return c;
}

// The plan as the table names it: the mesh dims above 1 with their options, then the recompute.
std::string plan_label(const Config& cfg, const MeshItem& it, PlanVariant v) {
  const PpChoice& pp = it.pp;
  std::string label;
  auto part = [&](const std::string& s) { label += (label.empty() ? "" : " x ") + s; };
  if (pp.p > 1)
    part(fmt::format("pp={} ({}{}, micro-batches of {})", pp.p, pp.schedule,
                     pp.virt > 1 ? fmt::format(" v={}", pp.virt) : "", it.micro));
  if (it.dp_replicate > 1) part(fmt::format("dp_replicate={}", it.dp_replicate));
  if (it.dp_shard > 1) part(fmt::format("dp_shard={}{}", it.dp_shard, v.reshard ? "" : " (no reshard)"));
  if (it.ep > 1) part(fmt::format("ep={} ({} experts a rank)", it.ep, cfg.model.moe.n_experts / it.ep));
  if (it.cp > 1) part(fmt::format("cp={} ({})", it.cp, it.method));
  if (it.tp > 1) part(fmt::format("tp={}{}", it.tp, it.sp ? " (sequence parallel)" : ""));
  if (label.empty()) label = "1 rank";
  label += v.ac == 0 ? "" : v.ac == 1 ? ", recompute full" : ", recompute selective";
  return label;
}

// The --set overrides that turn the config into this plan (the pipeline's only when the search chose it).
std::vector<std::string> plan_overrides(const Config& cfg, const PlanSearchOptions& opt, const MeshItem& it,
                                        PlanVariant v, const std::string& layers) {
  std::vector<std::string> out;
  if (!opt.keep_pp)
    out = {fmt::format("parallel.pp={}", it.pp.p), fmt::format("parallel.pp_schedule={}", it.pp.schedule),
           fmt::format("parallel.pp_virtual={}", it.pp.virt), fmt::format("training.micro_batch_size={}", it.micro)};
  for (std::string o :
       {fmt::format("parallel.dp_replicate={}", it.dp_replicate), fmt::format("parallel.dp_shard={}", it.dp_shard),
        fmt::format("parallel.cp={}", it.cp), fmt::format("parallel.cp_method={}", it.method),
        fmt::format("parallel.tp={}", it.tp), fmt::format("parallel.sequence_parallel={}", it.sp ? "true" : "false"),
        fmt::format("parallel.fsdp.reshard_after_forward={}", v.reshard ? "true" : "false"),
        v.ac == 0 ? std::string("parallel.recompute.patterns=[]")
                  : fmt::format("parallel.recompute.patterns=[\"{}\"]", layers),
        std::string(v.ac == 2 ? "parallel.recompute.keep=[\"attention\"]" : "parallel.recompute.keep=[]")})
    out.push_back(std::move(o));
  if (cfg.model.moe.enabled()) out.push_back(fmt::format("parallel.ep={}", it.ep));
  return out;
}

// The estimate of one plan into cand; false (counted in out) when the estimator refuses the plan.
bool estimate_plan(const Config& c, int world, const ClusterSpec& cluster, PlanCandidate& cand, PlanSearch& out) {
  ++out.tried;
  try {
    cand.estimate = estimate_run(c, world, cluster);
  } catch (const Error& e) {
    std::string why = e.what();
    why = why.substr(0, std::min<size_t>(why.size(), why.find(':') == std::string::npos ? 60 : why.find(':') + 30));
    ++out.refused[why];
    return false;
  }
  for (const StageEstimate& s : cand.estimate.stages) cand.peak_bytes = std::max(cand.peak_bytes, s.peak_bytes);
  return true;
}

// The plans of one mesh item, into out (its own: merged in item order afterwards).
void search_item(const Config& cfg, int world, const ClusterSpec& cluster, const PlanSearchOptions& opt,
                 const MeshItem& it, PlanSearch& out) {
  const double capacity = cluster.device_memory_gib * double(1 << 30);
  const std::string& layers = family_of(cfg.model).layers;  // whole-layer recompute's pattern
  // Memory only grows from recompute full to selective to none, and from resharding to holding the gathered
  // weights: a plan whose smaller neighbour is too large is too large, and is not estimated.
  bool big[3][2] = {};  // [ac][reshard]
  for (int reshard = 1; reshard >= (it.dp_shard > 1 ? 0 : 1); --reshard)
    for (int ac : {1, 2, 0}) {
      if (it.too_few_micro) {  // one line for every such plan, not one per batch and dp
        ++out.tried;
        ++out.refused["[config] parallel.pp = P needs P micro-batches, but batch_size / dp < P sequences a "
                      "data-parallel rank"];
        continue;
      }
      const int smaller = ac == 2 ? 1 : ac == 0 ? 2 : -1;
      if (opt.prune && ((smaller >= 0 && big[smaller][reshard]) || (reshard == 0 && big[ac][1]))) {
        big[ac][reshard] = true;
        ++out.tried, ++out.too_large, ++out.pruned;
        continue;
      }
      const PlanVariant v{reshard, ac};
      PlanCandidate cand;
      cand.label = plan_label(cfg, it, v);
      cand.overrides = plan_overrides(cfg, opt, it, v, layers);
      if (!estimate_plan(plan_config(cfg, opt, it, v, layers), world, cluster, cand, out)) continue;
      cand.fits = cand.peak_bytes <= capacity;
      if (out.smallest_peak < 0 || cand.peak_bytes < out.smallest_peak) out.smallest_peak = cand.peak_bytes;
      if (!cand.fits) {
        big[ac][reshard] = true;
        ++out.too_large;
        continue;
      }
      out.ranked.push_back(std::move(cand));
    }
}

}  // namespace

PlanSearch search_plans(const Config& cfg, int world, const ClusterSpec& cluster, const PlanSearchOptions& opt) {
  MT_CHECK(world >= 1, "plan", "--world {}: expected >= 1 ranks", world);
  const std::vector<PpChoice> pipelines = pp_choices(cfg, world, opt.keep_pp);
  MT_CHECK(world % pipelines.front().p == 0, "config", "parallel.pp = {} does not divide --world {}",
           pipelines.front().p, world);
  const std::vector<MeshItem> items = mesh_items(cfg, world, cluster, opt, pipelines);
  // The items on threads (each estimate is independent: simulated meshes, a model built without storage), each
  // item's results kept apart and merged in item order, so the result does not depend on the thread count.
  std::vector<PlanSearch> parts(items.size());
  for (PlanSearch& p : parts) p.smallest_peak = -1;
  const int threads = std::max(1, std::min<int>(opt.threads > 0 ? opt.threads : int(std::thread::hardware_concurrency()),
                                                int(items.size())));
  std::atomic<size_t> next{0}, done{0};
  std::atomic<int64_t> tried{0};
  std::mutex error_mu;
  std::exception_ptr error;
  // Whichever thread finishes an item 10 s after the last report says how far the search is.
  const auto started = std::chrono::steady_clock::now();
  std::atomic<int64_t> reported_ms{0};
  auto report = [&] {
    const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                                 started).count();
    int64_t last = reported_ms.load();
    if (now_ms - last < 10000 || !reported_ms.compare_exchange_strong(last, now_ms)) return;
    MT_LOG_INFO("plan --search: {} of {} meshes, {} plans, in {:.0f} s on {} thread(s)", done.load(), items.size(),
                tried.load(), double(now_ms) / 1e3, threads);
  };
  auto work = [&] {
    for (size_t i = next++; i < items.size(); i = next++) {
      try {
        search_item(cfg, world, cluster, opt, items[i], parts[i]);
      } catch (...) {  // not a refusal (those are counted): stop and rethrow below
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        next = items.size();
      }
      tried += parts[i].tried;
      ++done;
      report();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();  // the calling thread works too
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  PlanSearch out;
  out.smallest_peak = -1;
  out.threads = threads;
  for (PlanSearch& p : parts) {
    out.tried += p.tried, out.too_large += p.too_large, out.pruned += p.pruned;
    for (auto& [why, n] : p.refused) out.refused[why] += n;
    if (p.smallest_peak >= 0 && (out.smallest_peak < 0 || p.smallest_peak < out.smallest_peak))
      out.smallest_peak = p.smallest_peak;
    for (PlanCandidate& c : p.ranked) out.ranked.push_back(std::move(c));
  }
  const double capacity = cluster.device_memory_gib * double(1 << 30);
  std::stable_sort(out.ranked.begin(), out.ranked.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.estimate.step_s != b.estimate.step_s) return a.estimate.step_s < b.estimate.step_s;
    return a.peak_bytes < b.peak_bytes;  // a tie: the plan with more headroom
  });
  if (out.ranked.empty()) {
    const double need = out.smallest_peak;
    if (need > 0) {
      out.advice.push_back(fmt::format("the smallest plan needs {} per rank against {:.1f} GiB", format_bytes(need),
                                       cluster.device_memory_gib));
      out.advice.push_back(fmt::format("more ranks: about {:.0f}x as many to shard the state and the activations further",
                                       std::ceil(need / capacity)));
      out.advice.push_back("a shorter training.seq_len or a smaller training.micro_batch_size (activations scale with "
                           "both); recompute is already among the plans tried");
      if (!cfg.lora.enabled())
        out.advice.push_back("fine-tuning: lora.rank > 0 (LoRA) freezes the base: no gradients or optimizer state for it");
    }
  }
  return out;
}

std::string plan_search_table(const PlanSearch& s, const ClusterSpec& cluster, int top) {
  std::string out = fmt::format("{} plans tried on {}: {} fit in {:.1f} GiB, {} too large{}, {} refused\n", s.tried,
                                cluster.name, s.ranked.size(), cluster.device_memory_gib, s.too_large,
                                s.pruned > 0 ? fmt::format(" ({} of them by a plan that needs less memory)", s.pruned)
                                             : std::string(),
                                [&] {
                                  int64_t n = 0;
                                  for (auto& [w, k] : s.refused) n += k;
                                  return n;
                                }());
  for (auto& [why, n] : s.refused) out += fmt::format("  refused ({} plans): {}...\n", n, why);
  if (!s.ranked.empty() && s.ranked.front().estimate.config.lora.enabled()) out += lora_line(s.ranked.front().estimate);
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
    out += fmt::format(
        "   memory {} of {:.1f} GiB ({:.0f}% headroom); exposed communication {:.3f} ms; largest cost: {}\n",
        format_bytes(c.peak_bytes), cluster.device_memory_gib, 100 * (1 - c.peak_bytes / capacity),
        1e3 * slow->exposed_comm_s, largest_cost(*slow));
    std::string sets;
    for (const std::string& o : c.overrides) sets += " --set " + o;
    out += "  " + sets + "\n";
  }
  return out;
}

}  // namespace mt
