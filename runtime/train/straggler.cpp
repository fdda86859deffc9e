#include "runtime/train/straggler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "comm/world.h"
#include "runtime/core/trace.h"

namespace mt {

namespace {
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

std::string StragglerCheck::step(int64_t step, const std::vector<RankStepTimes>& t, nlohmann::json& record) {
  const size_t n = t.size();
  streak_.resize(n, 0);
  // The median of each set of peers (the same pp rank); a set of one rank is compared with every rank.
  std::map<int, std::vector<double>> by_peers;
  for (const RankStepTimes& r : t) by_peers[r.peers].push_back(r.compute_s);
  std::vector<double> all_compute, all_wait;
  for (const RankStepTimes& r : t) all_compute.push_back(r.compute_s), all_wait.push_back(r.wait_s);
  std::vector<double> walls;
  for (const RankStepTimes& r : t) walls.push_back(r.compute_s + r.wait_s);
  const double step_s = median(walls);
  double worst = 0;
  int slowest = -1;
  std::string line;
  for (size_t i = 0; i < n; ++i) {
    const auto& peers = by_peers[t[i].peers];
    const double med = peers.size() > 1 ? median(peers) : median(all_compute);
    const double ratio = med > 0 ? t[i].compute_s / med : 1;
    if (ratio > worst) worst = ratio, slowest = int(i);
    // Slower by the threshold, and by more than 2% of the step: a few hundred microseconds on a step that mostly
    // waits are noise, not a straggler.
    const bool slow = n > 1 && ratio > 1 + threshold_ && t[i].compute_s - med > 0.02 * step_s;
    streak_[i] = slow ? streak_[i] + 1 : 0;
    if (slow && streak_[i] == steps_) {
      std::vector<double> peer_waits;
      for (const RankStepTimes& r : t)
        if (peers.size() <= 1 || r.peers == t[i].peers) peer_waits.push_back(r.wait_s);
      const double med_wait = median(peer_waits);
      named_ = int(i);
      line = fmt::format(
          "slow rank: rank {} on {} has been slower than its peers for {} steps (step {}): compute {:.1f} ms against "
          "the median's {:.1f} ms (+{:.0f}%, +{:.1f} ms), waiting in collectives {:.1f} ms against {:.1f} ms: the "
          "difference is in {}",
          i, i < hosts_.size() ? hosts_[i] : "?", steps_, step + 1, 1e3 * t[i].compute_s, 1e3 * med,
          100 * (ratio - 1), 1e3 * (t[i].compute_s - med), 1e3 * t[i].wait_s, 1e3 * med_wait,
          t[i].compute_s - med >= t[i].wait_s - med_wait ? "its own compute (the others wait for it)"
                                                        : "waiting (a slow link or a slow peer of its own)");
    }
  }
  record = {{"event", "ranks"},
            {"step", step + 1},
            {"compute_s", all_compute},
            {"wait_s", all_wait},
            {"compute_max_over_median", worst},
            {"slowest_rank", slowest}};
  return line;
}

void fault_slow_rank() {
  static const std::pair<int, int> f = [] {
    const char* e = std::getenv("MT_FAULT_SLOW_RANK");
    int rank = -1, ms = 0;
    if (e && std::sscanf(e, "%d:%d", &rank, &ms) == 2) {
      if (world::rank() != rank) rank = -1;
    } else {
      rank = -1;
    }
    return std::pair<int, int>{rank, ms};
  }();
  if (f.first < 0) return;
  trace::Span span("MT_FAULT_SLOW_RANK sleep", "op");
  std::this_thread::sleep_for(std::chrono::milliseconds(f.second));
}

}  // namespace mt
