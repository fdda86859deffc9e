#include "runtime/supervise/goodput.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

namespace mt {

void GoodputAccount::begin_attempt(double launch_t, double backoff_s) {
  AttemptRecords a;
  a.launch_t = launch_t;
  a.backoff_s = backoff_s;
  attempts_.push_back(a);
  attempt_checkpoint_s_ = attempt_output_ckpt_s_ = 0;
  attempt_events_ = false;
  attempt_output_committed_ = -1;
}

void GoodputAccount::add_record(const nlohmann::json& r, double read_t) {
  if (attempts_.empty() || !r.is_object()) return;
  AttemptRecords& a = attempts_.back();
  auto num = [&](const char* key, double fallback) {
    auto it = r.find(key);
    return it != r.end() && it->is_number() ? it->get<double>() : fallback;
  };
  const double t = num("time", read_t);
  if (auto ev = r.find("event"); ev != r.end() && ev->is_string()) {
    const std::string e = ev->get<std::string>();
    if (e == "goodput" || e == "failure") return;  // the job's own records (and a run's summary)
    a.last_record_t = std::max(a.last_record_t, t);
    if (e == "start") {
      a.first_step_t = t;
      a.start_step = int64_t(num("start_step", -1));
      a.setup_s = num("setup_s", -1);
      a.load_s = num("load_s", -1);
      if (auto it = r.find("resumed_from"); it != r.end() && it->is_string()) a.resumed_from = it->get<std::string>();
    } else if (e == "checkpoint") {
      const double stall = std::max(0.0, num("stall_s", 0));
      checkpoint_s_ += stall;
      attempt_checkpoint_s_ += stall;
      attempt_events_ = true;
    } else if (e == "checkpoint_committed") {
      const auto step = int64_t(num("step", -1));
      a.last_committed = std::max(a.last_committed, step);
      last_committed_ = std::max(last_committed_, step);
      attempt_events_ = true;
    }
    return;
  }
  if (!r.contains("step")) return;
  a.last_record_t = std::max(a.last_record_t, t);
  if (r.contains("val_loss")) {
    eval_s_ += std::max(0.0, num("eval_s", 0));
    return;
  }
  if (!r.contains("loss") || !r.contains("step_ms")) return;
  const auto step = int64_t(num("step", -1));
  const double s = std::max(0.0, num("step_ms", 0) / 1e3);
  all_steps_s_ += s;
  ++step_records_;
  last_step_s_[step] = s;
  a.last_step = std::max(a.last_step, step);
  ++a.steps_recorded;
  if (a.first_step_t < 0) a.first_step_t = t - s;
}

void GoodputAccount::add_output_checkpoint(int64_t step, double seconds) {
  if (attempts_.empty()) return;
  attempt_output_ckpt_s_ += std::max(0.0, seconds);
  attempt_output_committed_ = std::max(attempt_output_committed_, step);
}

void GoodputAccount::end_attempt(double exit_t, bool failed) {
  if (attempts_.empty()) return;
  AttemptRecords& a = attempts_.back();
  a.exit_t = exit_t;
  a.failed = failed;
  // A binary that writes no checkpoint events: its output's "checkpoint step N -> DIR in X s" lines (printed once
  // the save is complete and renamed) stand for them.
  if (!attempt_events_ && attempt_output_committed_ >= 0) {
    checkpoint_s_ += attempt_output_ckpt_s_;
    a.last_committed = attempt_output_committed_;
    last_committed_ = std::max(last_committed_, attempt_output_committed_);
  }
}

int64_t GoodputAccount::steps_lost() const {
  if (attempts_.empty()) return 0;
  const AttemptRecords& a = attempts_.back();
  if (a.last_step < 0) return 0;
  const int64_t from = std::max<int64_t>(last_committed_, a.start_step);
  return std::max<int64_t>(0, a.last_step - std::max<int64_t>(from, 0));
}

GoodputParts GoodputAccount::parts(double wall_s) const {
  GoodputParts p;
  p.wall_s = wall_s;
  for (const auto& [step, s] : last_step_s_) p.productive_s += s;
  p.steps = int64_t(last_step_s_.size());
  p.redone_steps = step_records_ - p.steps;
  p.lost_s = std::max(0.0, all_steps_s_ - p.productive_s);
  p.checkpoint_s = checkpoint_s_;
  p.eval_s = eval_s_;
  p.restart_s = extra_wait_s_;
  for (const AttemptRecords& a : attempts_) {
    ++p.attempts;
    p.restart_s += a.backoff_s;
    const double end = a.exit_t > 0 ? a.exit_t : a.launch_t;
    if (a.first_step_t < 0) {
      p.restart_s += std::max(0.0, end - a.launch_t);  // never reached a step
    } else {
      p.restart_s += std::max(0.0, a.first_step_t - a.launch_t);
      if (a.failed) p.lost_s += std::max(0.0, end - std::max(a.last_record_t, a.first_step_t));
    }
    if (a.failed) ++p.failures;
  }
  p.other_s = std::max(0.0, wall_s - p.productive_s - p.checkpoint_s - p.eval_s - p.lost_s - p.restart_s);
  p.goodput = wall_s > 0 ? p.productive_s / wall_s : 0;
  return p;
}

nlohmann::json goodput_record(const GoodputParts& p) {
  return {{"event", "goodput"},       {"scope", "job"},         {"wall_s", p.wall_s},
          {"productive_s", p.productive_s}, {"checkpoint_s", p.checkpoint_s}, {"eval_s", p.eval_s},
          {"lost_s", p.lost_s},       {"restart_s", p.restart_s}, {"other_s", p.other_s},
          {"goodput", p.goodput},     {"steps", p.steps},       {"redone_steps", p.redone_steps},
          {"attempts", p.attempts},   {"failures", p.failures}};
}

std::string goodput_line(const GoodputParts& p) {
  auto part = [&](const char* name, double s) {
    return fmt::format("{} {:.1f} s ({:.1f}%)", name, s, p.wall_s > 0 ? 100 * s / p.wall_s : 0.0);
  };
  return fmt::format("goodput {:.1f}% of {:.1f} s wall: {}, {}, {}, {}, {}, {}; {} steps ({} redone), {} launch{}, "
                     "{} failure{}",
                     100 * p.goodput, p.wall_s, part("productive", p.productive_s),
                     part("checkpoint", p.checkpoint_s), part("eval", p.eval_s), part("lost", p.lost_s),
                     part("restart", p.restart_s), part("other", p.other_s), p.steps, p.redone_steps, p.attempts,
                     p.attempts == 1 ? "" : "es", p.failures, p.failures == 1 ? "" : "s");
}

FileTail::FileTail(std::string path, bool from_end) : path_(std::move(path)) {
  if (from_end) skip_to_end();
}

void FileTail::skip_to_end() {
  partial_.clear();
  offset_ = 0;
  if (FILE* f = std::fopen(path_.c_str(), "rb")) {
    if (std::fseek(f, 0, SEEK_END) == 0) offset_ = std::ftell(f);
    std::fclose(f);
  }
}

std::vector<std::string> FileTail::read_lines() {
  std::vector<std::string> lines;
  FILE* f = std::fopen(path_.c_str(), "rb");
  if (!f) return lines;
  std::fseek(f, 0, SEEK_END);
  const long long size = std::ftell(f);
  if (size < offset_) {  // truncated or replaced: from its start
    offset_ = 0;
    partial_.clear();
  }
  std::fseek(f, long(offset_), SEEK_SET);
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    offset_ += (long long)n;
    for (size_t i = 0; i < n; ++i) {
      if (buf[i] == '\n') {
        lines.push_back(std::move(partial_));
        partial_.clear();
      } else {
        partial_.push_back(buf[i]);
      }
    }
  }
  std::fclose(f);
  return lines;
}

}  // namespace mt
