// The slow rank, named. Every step each rank's compute time (the step's wall time less the time
// it waited in collectives, trace::wait_ns) and wait time travel with the loop's per-step control collective (one
// small all-gather); every rank then runs the same check on the same numbers. A rank is slow at a step when its
// compute time is above the median of the ranks doing the same work (the same pp rank: stages differ) by more than
// profile.straggler_threshold (and by more than 2% of the median step time: less is noise); after profile.straggler_steps slow steps in a row it is named in a log line with its
// host and where the difference goes (its compute against the median's, its waits against theirs). The spread
// (slowest compute / median compute, the slowest rank) goes into a per-step metrics record.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mt {

struct RankStepTimes {
  double compute_s = 0, wait_s = 0;
  int peers = 0;  // ranks with the same value do the same work (the pp rank)
};

class StragglerCheck {
 public:
  StragglerCheck(double threshold, int steps, std::vector<std::string> hosts)
      : threshold_(threshold), steps_(steps), hosts_(std::move(hosts)) {}
  // One step's times of every rank (index: world rank). Returns the line naming a rank when one has just been slow
  // `steps` steps in a row (else ""); record gets the step's spread.
  std::string step(int64_t step, const std::vector<RankStepTimes>& t, nlohmann::json& record);
  int named() const { return named_; }

 private:
  double threshold_;
  int steps_;
  std::vector<std::string> hosts_;
  std::vector<int> streak_;
  int named_ = -1;
};

}  // namespace mt
