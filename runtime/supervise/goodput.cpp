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
  // A record dated after the supervisor saw the failure is no progress of the launch (a rank stopped mid-step and
  // woken by the launcher's abort finishes its step): the detection counts from the last one before.
  auto advance = [&](double when) {
    if (a.failure_seen_t < 0 || when <= a.failure_seen_t) a.last_record_t = std::max(a.last_record_t, when);
  };
  if (auto ev = r.find("event"); ev != r.end() && ev->is_string()) {
    const std::string e = ev->get<std::string>();
    if (e == "goodput" || e == "failure") return;  // the job's own records (and a run's summary)
    // The launch's last record (the detection counts from it) moves with its progress only: the set-up, the start and
    // the checkpoints, each with its own time. A side record ("ranks", written after the step's agreement) can be
    // written once a stopped rank is woken by the launcher's abort; one without a time is dated when it was read.
    const bool progress = e == "setup" || e == "start" || e == "checkpoint" || e == "checkpoint_committed";
    if (progress && r.contains("time")) advance(t);
    if (e == "setup") {
      a.setup_t = t;
      a.setup_total_s = num("total_s", -1);
      a.setup_parts.clear();
      if (auto it = r.find("parts"); it != r.end() && it->is_array())
        for (const auto& part : *it)
          if (part.is_object() && part.value("part", nlohmann::json()).is_string() &&
              part.value("s", nlohmann::json()).is_number())
            a.setup_parts.emplace_back(part["part"].get<std::string>(), part["s"].get<double>());
    } else if (e == "start") {
      a.first_step_t = t;
      a.start_step = int64_t(num("start_step", -1));
      a.setup_s = num("setup_s", -1);
      a.load_s = num("load_s", -1);
      if (auto it = r.find("resumed_from"); it != r.end() && it->is_string()) a.resumed_from = it->get<std::string>();
    } else if (e == "checkpoint") {
      const double stall = std::max(0.0, num("stall_s", 0));
      const auto mode = r.find("mode");
      (mode != r.end() && *mode == "memory" ? memory_save_s_ : disk_save_s_) += stall;
      if (mode != r.end() && *mode == "memory") a.last_memory = std::max(a.last_memory, int64_t(num("step", -1)));
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
  if (r.contains("val_loss")) {
    advance(t);
    eval_s_ += std::max(0.0, num("eval_s", 0));
    return;
  }
  if (!r.contains("loss") || !r.contains("step_ms")) return;  // a step's side record (the pipeline's times)
  if (a.failure_seen_t >= 0 && t > a.failure_seen_t) return;  // its time overlaps the detection's
  advance(t);
  const auto step = int64_t(num("step", -1));
  const double s = std::max(0.0, num("step_ms", 0) / 1e3);
  all_steps_s_ += s;
  ++step_records_;
  last_step_s_[step] = {s, attempts_.size() - 1};
  a.last_step = std::max(a.last_step, step);
  ++a.steps_recorded;
  if (a.first_step < 0) a.first_step = step, a.first_step_s = s;
  else if (a.early_steps_s.size() < 32) a.early_steps_s.push_back(s);
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
    disk_save_s_ += attempt_output_ckpt_s_;
    a.last_committed = attempt_output_committed_;
    last_committed_ = std::max(last_committed_, attempt_output_committed_);
  }
}

int64_t GoodputAccount::steps_lost() const {
  if (attempts_.empty()) return 0;
  const AttemptRecords& a = attempts_.back();
  if (a.last_step < 0) return 0;
  // A relaunch resumes from the newest of the disk's checkpoint and this launch's in-memory one (when the memory
  // survived: a machine that lost it falls back, and its redone steps show in the goodput's lost time).
  const int64_t from = std::max({last_committed_, a.start_step, a.last_memory});
  return std::max<int64_t>(0, a.last_step - std::max<int64_t>(from, 0));
}

void GoodputAccount::failure_seen(double t) {
  if (!attempts_.empty() && attempts_.back().failure_seen_t < 0) attempts_.back().failure_seen_t = t;
}

double AttemptRecords::typical_step_s() const {
  if (early_steps_s.empty()) return first_step_s;
  std::vector<double> v = early_steps_s;
  std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
  return v[v.size() / 2];
}

namespace {
// The restart phase of a set-up part (runtime/core/startup.h's marks).
std::string setup_phase(const std::string& part) {
  if (part == "exec" || part == "mpi") return "mpi";
  if (part == "config" || part == "mesh") return "mesh";
  return part;
}

void add_phase(std::vector<std::pair<std::string, double>>& parts, const std::string& name, double s) {
  for (auto& [n, v] : parts)
    if (n == name) {
      v += s;
      return;
    }
  parts.emplace_back(name, s);
}
}  // namespace

void GoodputAccount::restart_phases(GoodputParts& p) const {
  for (const char* name : {"backoff", "launcher", "mpi", "mesh", "model", "load", "peak", "report", "first_step",
                           "not_started", "not_timed"})
    p.restart_parts.emplace_back(name, 0.0);
  add_phase(p.restart_parts, "backoff", extra_wait_s_);
  for (size_t i = 0; i < attempts_.size(); ++i) {
    const AttemptRecords& a = attempts_[i];
    add_phase(p.restart_parts, "backoff", a.backoff_s);
    if (a.first_step_t < 0) {  // never reached a step
      add_phase(p.restart_parts, "not_started", std::max(0.0, (a.exit_t > 0 ? a.exit_t : a.launch_t) - a.launch_t));
      continue;
    }
    // The launch to its first step, cut at the set-up's marks (on the ranks' clock from the process's start, placed
    // by the setup record's time, the end of the first step): each phase clipped into what is left of the window.
    const double until = std::max(a.launch_t, a.first_step_t);
    double at = a.launch_t;
    auto cut = [&](const std::string& phase, double end) {
      const double e = std::clamp(end, at, until);
      add_phase(p.restart_parts, phase, e - at);
      at = e;
    };
    if (a.setup_t > 0 && a.setup_total_s > 0) {
      double mark = a.setup_t - a.setup_total_s;  // the process's start
      cut("launcher", mark);
      for (const auto& [part, s] : a.setup_parts)
        if (part != "first_step") cut(setup_phase(part), mark += s);
    }
    cut("not_timed", until);
    // A relaunch's first step runs cold (caches, pages, the allocator): its time above the launch's typical step
    // is the restart's, when its record is the one that counts.
    const auto it = last_step_s_.find(a.first_step);
    if (!a.early_steps_s.empty() && it != last_step_s_.end() && it->second.second == i) {
      const double warm_up = std::max(0.0, a.first_step_s - a.typical_step_s());
      add_phase(p.restart_parts, "first_step", warm_up);
      p.productive_s -= warm_up;
    }
  }
  for (const auto& [name, s] : p.restart_parts) p.restart_s += s;
}

GoodputParts GoodputAccount::parts(double wall_s) const {
  GoodputParts p;
  p.wall_s = wall_s;
  for (const auto& [step, s] : last_step_s_) p.productive_s += s.first;
  p.steps = int64_t(last_step_s_.size());
  p.redone_steps = step_records_ - p.steps;
  p.lost_s = std::max(0.0, all_steps_s_ - p.productive_s);
  p.memory_save_s = memory_save_s_;
  p.disk_save_s = disk_save_s_;
  p.eval_s = eval_s_;
  restart_phases(p);
  for (const AttemptRecords& a : attempts_) {
    ++p.attempts;
    if (!a.failed) continue;
    ++p.failures;
    const AttemptRecords::Tail t = a.failure_tail();
    p.lost_s += t.in_flight_s;
    p.detection_s += t.detection_s;
  }
  p.other_s = std::max(0.0, wall_s - p.productive_s - p.memory_save_s - p.disk_save_s - p.eval_s - p.lost_s -
                                p.restart_s - p.detection_s);
  p.goodput = wall_s > 0 ? p.productive_s / wall_s : 0;
  return p;
}

AttemptRecords::Tail AttemptRecords::failure_tail() const {
  if (first_step_t < 0) return {};
  // After its last record: the step in flight until the failure (no later than the supervisor saw it).
  const double end = exit_t > 0 ? exit_t : launch_t;
  const double last = std::max(last_record_t, first_step_t);
  const double tail = std::max(0.0, end - last);
  const double seen = failure_seen_t > 0 ? failure_seen_t : end;
  const double in_flight = std::clamp(std::min(seen, last + typical_step_s()) - last, 0.0, tail);
  return {in_flight, tail - in_flight};
}

nlohmann::json goodput_record(const GoodputParts& p) {
  nlohmann::json restart = nlohmann::json::array();
  for (const auto& [name, sec] : p.restart_parts) restart.push_back({{"part", name}, {"s", sec}});
  return {{"event", "goodput"},         {"scope", "job"},
          {"wall_s", p.wall_s},         {"productive_s", p.productive_s},
          {"memory_save_s", p.memory_save_s}, {"disk_save_s", p.disk_save_s},
          {"eval_s", p.eval_s},         {"lost_s", p.lost_s},
          {"restart_s", p.restart_s},   {"detection_s", p.detection_s},
          {"other_s", p.other_s},       {"restart_parts", restart},
          {"goodput", p.goodput},       {"steps", p.steps},
          {"redone_steps", p.redone_steps}, {"attempts", p.attempts},
          {"failures", p.failures}};
}

std::string goodput_line(const GoodputParts& p) {
  auto part = [&](const char* name, double s) {
    return fmt::format("{} {:.1f} s ({:.1f}%)", name, s, p.wall_s > 0 ? 100 * s / p.wall_s : 0.0);
  };
  return fmt::format("goodput {:.1f}% of {:.1f} s wall: {}, {}, {}, {}, {}, {}, {}, {}; {} steps ({} redone), {} "
                     "launch{}, {} failure{}",
                     100 * p.goodput, p.wall_s, part("productive", p.productive_s),
                     part("memory saves", p.memory_save_s), part("disk saves", p.disk_save_s),
                     part("eval", p.eval_s), part("lost", p.lost_s), part("restart", p.restart_s),
                     part("detection", p.detection_s), part("other", p.other_s), p.steps, p.redone_steps,
                     p.attempts, p.attempts == 1 ? "" : "es", p.failures, p.failures == 1 ? "" : "s");
}

std::string restart_line(const GoodputParts& p) {
  static const std::map<std::string, std::string> labels = {
      {"backoff", "back-off"},  {"launcher", "launcher"}, {"mpi", "MPI start-up"},   {"mesh", "config and mesh"},
      {"model", "model"},       {"load", "load or init"}, {"peak", "GEMM peak"},     {"report", "set-up report"},
      {"first_step", "first step's warm-up"}, {"not_started", "launches that never stepped"},
      {"not_timed", "not timed"}};
  std::string parts;
  for (const auto& [name, s] : p.restart_parts) {
    if (s < 0.05) continue;
    const auto l = labels.find(name);
    parts += fmt::format("{}{} {:.1f} s", parts.empty() ? "" : ", ", l == labels.end() ? name : l->second, s);
  }
  return fmt::format("restart {:.1f} s by phase: {}", p.restart_s, parts.empty() ? "none" : parts);
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
