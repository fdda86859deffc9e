#include "runtime/train/trace_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/core/error.h"

namespace mt {

namespace fs = std::filesystem;

std::string trace_rank_path(const std::string& dir, int rank) {
  return (fs::path(dir) / fmt::format("trace_rank{}.json", rank)).string();
}

// 50 us an event: about 3 MB/s of trace text, a slow shared disk (a local one writes a hundred times faster).
double trace_write_budget_s(int64_t events) { return 50e-6 * double(std::max<int64_t>(events, 0)); }

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < 16; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 16) s += fmt::format(" and {} more", ranks.size() - 16);
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", s);
}

// dir's trace_rank{R}.json, by rank.
std::vector<std::pair<int, fs::path>> rank_files(const std::string& dir) {
  MT_CHECK(fs::is_directory(dir), "trace", "{}: not a directory", dir);
  const std::regex name(R"(trace_rank(\d+)\.json)");
  std::vector<std::pair<int, fs::path>> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string f = e.path().filename().string();
    if (std::regex_match(f, m, name)) files.emplace_back(std::stoi(m[1].str()), e.path());
  }
  MT_CHECK(!files.empty(), "trace", "{}: no trace_rank*.json files (written by a run with profile.steps and profile.dir)",
           dir);
  std::sort(files.begin(), files.end());
  return files;
}

// A rank file's metadata: the run id and world size it must carry, and the rank its name gives.
nlohmann::json checked_metadata(const nlohmann::json& m, const fs::path& path, int rank) {
  const nlohmann::json run = m.is_object() ? m.value("run", nlohmann::json::object()) : nlohmann::json::object();
  MT_CHECK(run.is_object() && run.value("run_id", nlohmann::json()).is_string() &&
               run.value("world_size", nlohmann::json()).is_number_integer(),
           "trace", "{}: no run id and world size in its metadata (written by an older meshtrain?): cannot tell which "
           "run it belongs to", path.string());
  MT_CHECK(m.value("rank", -1) == rank, "trace", "{}: its metadata says rank {}, its name rank {}", path.string(),
           m.value("rank", -1), rank);
  return m;
}

// One rank's file, any layout: parsed whole. Each event's text goes to emit; returns its metadata.
template <typename Emit> nlohmann::json read_rank_file(const fs::path& path, int rank, Emit&& emit) {
  std::ifstream in(path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    fail("trace", "{}: not JSON ({})", path.string(), e.what());
  }
  MT_CHECK(j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array(), "trace",
           "{}: not a Chrome trace (no traceEvents array)", path.string());
  for (const auto& e : j["traceEvents"]) emit(e.dump());
  return checked_metadata(j.value("metadata", nlohmann::json::object()), path, rank);
}

// One rank's file as trace::write lays it out (a line `{"traceEvents":[`, one event a line, each but the last
// ending in a comma, then `],"displayTimeUnit":...,"metadata":{...}}`): each event line checked as JSON and passed
// on as it is, no document built (rank 0's merge holds every rank waiting: about twice as fast as parsing it
// whole). nullopt: not that layout (nothing emitted), for read_rank_file.
template <typename Emit>
std::optional<nlohmann::json> read_written_rank_file(const fs::path& path, int rank, Emit&& emit) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line) || line != "{\"traceEvents\":[") return std::nullopt;
  const std::string tail = "],\"displayTimeUnit\"";
  for (int64_t n = 2; std::getline(in, line); ++n) {
    if (line.compare(0, tail.size(), tail) == 0) {
      const nlohmann::json rest = nlohmann::json::parse("{" + line.substr(2), nullptr, false);
      MT_CHECK(rest.is_object() && !std::getline(in, line), "trace", "{}: damaged (line {}: the end of a trace file "
               "that does not parse, or text after it)", path.string(), n);
      return checked_metadata(rest.value("metadata", nlohmann::json::object()), path, rank);
    }
    if (!line.empty() && line.back() == ',') line.pop_back();
    MT_CHECK(!line.empty() && line.front() == '{' && nlohmann::json::accept(line), "trace",
             "{}: damaged (line {} is not a JSON event)", path.string(), n);
    emit(line);
  }
  fail("trace", "{}: damaged (truncated: no end of the traceEvents array)", path.string());
}

// The ranks merged came from one run and hold every rank of it.
void check_one_run(const std::string& dir, const std::map<std::string, std::pair<int, std::vector<int>>>& runs) {
  if (runs.size() > 1) {
    std::string list;
    for (const auto& [id, r] : runs) list += fmt::format("; run {} ({} ranks): {}", id, r.first, rank_list(r.second));
    fail("trace", "{}: trace files of {} runs{}: merge one run at a time (move the other's trace_rank*.json elsewhere)",
         dir, runs.size(), list);
  }
  const auto& [id, r] = *runs.begin();
  std::vector<int> missing, beyond;
  for (int k = 0; k < r.first; ++k)
    if (!std::binary_search(r.second.begin(), r.second.end(), k)) missing.push_back(k);
  for (int k : r.second)
    if (k >= r.first) beyond.push_back(k);
  MT_CHECK(missing.empty(), "trace", "{}: run {} had {} ranks, {} missing (no trace_rank{{R}}.json): a merge needs "
           "every rank's file", dir, id, r.first, rank_list(missing));
  MT_CHECK(beyond.empty(), "trace", "{}: run {} had {} ranks, but {} of it beyond them", dir, id, r.first,
           rank_list(beyond));
}

}  // namespace

MergedTraces merge_traces(const std::string& dir, const std::string& run_id, int world) {
  std::vector<std::pair<int, fs::path>> files = rank_files(dir);
  MergedTraces out;
  if (!run_id.empty()) {  // the run's own: its ranks' files (another run's with higher ranks are left alone)
    const auto mine = std::stable_partition(files.begin(), files.end(), [&](const auto& f) { return f.first < world; });
    out.other_files = int(files.end() - mine);
    files.erase(mine, files.end());
  }
  // Written beside, one rank file at a time, and renamed once whole and checked.
  const fs::path target = fs::path(dir) / "trace.json", part = fs::path(dir) / "trace.json.part";
  std::ofstream o(part);
  MT_CHECK(o.good(), "trace", "{}: cannot write", part.string());
  std::map<std::string, std::pair<int, std::vector<int>>> runs;  // run id -> world size, ranks
  nlohmann::json ranks = nlohmann::json::array();
  try {
    o << "{\"traceEvents\":[";
    bool first = true;
    auto emit = [&](const std::string& e) { o << (first ? "\n" : ",\n") << e, first = false; };
    for (const auto& [rank, path] : files) {
      std::optional<nlohmann::json> m = read_written_rank_file(path, rank, emit);
      if (!m) m = read_rank_file(path, rank, emit);
      nlohmann::json& run = (*m)["run"];
      const std::string id = run["run_id"];
      MT_CHECK(run_id.empty() || id == run_id, "trace", "{}: from run {}, not this run's {}", path.string(), id,
               run_id);
      runs[id].first = run["world_size"].get<int>();
      runs[id].second.push_back(rank);
      out.dropped += run.value("dropped_events", int64_t(0));
      ranks.push_back(std::move(*m));
    }
    check_one_run(dir, runs);
    out.run_id = runs.begin()->first, out.ranks = int(files.size());
    const nlohmann::json meta = {{"run_id", out.run_id}, {"world_size", out.ranks}, {"ranks", std::move(ranks)}};
    o << "\n],\"displayTimeUnit\":\"ms\",\"metadata\":" << meta.dump() << "}\n";
    o.close();
    MT_CHECK(o.good(), "trace", "{}: cannot write", part.string());
  } catch (...) {
    o.close();
    std::error_code ec;
    fs::remove(part, ec);
    throw;
  }
  std::error_code ec;
  fs::rename(part, target, ec);
  MT_CHECK(!ec, "trace", "{}: cannot write ({})", target.string(), ec.message());
  out.path = target.string();
  return out;
}

}  // namespace mt

// ---- RunTrace ----

#include <unistd.h>

#include <cstring>
#include <ctime>
#include <random>

#include "comm/env.h"
#include "comm/world.h"
#include "runtime/core/allocator.h"
#include "runtime/core/fault.h"
#include "runtime/core/kernel_profile.h"
#include "runtime/core/trace.h"
#include "runtime/train/agree.h"
#include "runtime/train/metrics.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/run_config.h"
#include "runtime/train/run.h"

namespace mt {

void check_profile_dir(const Config& cfg, const MpiEnv& env) {
  const auto& p = cfg.profile;
  if (p.steps.empty()) return;
  char why[256] = {0};
  if (env.rank() == 0) {
    std::error_code ec;
    fs::create_directories(p.dir, ec);
    const fs::path probe = fs::path(p.dir) / fmt::format(".write_test.{}", ::getpid());
    if (ec) {
      std::snprintf(why, sizeof why, "cannot create it: %s", ec.message().c_str());
    } else {
      std::FILE* f = std::fopen(probe.c_str(), "w");
      bool ok = f && std::fputs("ok\n", f) >= 0;
      ok = f && std::fclose(f) == 0 && ok;
      if (!ok) std::snprintf(why, sizeof why, "cannot write in it: %s", std::strerror(errno));
      fs::remove(probe, ec);
    }
  }
  world::broadcast(std::as_writable_bytes(std::span(why)), 0, "profile.dir check");
  // Every rank has rank 0's answer: one message, printed by rank 0.
  if (why[0])
    throw ReportedError(fmt::format("[config] profile.dir = {}: {} (profile.steps traces go there)", p.dir, why), 1,
                        env.rank() == 0);
}

namespace {

// Rank 0's clock and a random number: the id every rank file of this launch carries, so that a merge takes one
// run's files only.
std::string agree_run_id(const MpiEnv& env) {
  char id[32] = {0};
  if (env.rank() == 0) {
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char when[24];
    std::strftime(when, sizeof when, "%Y%m%dT%H%M%SZ", &utc);
    std::snprintf(id, sizeof id, "%s-%08x", when, unsigned(std::random_device{}()));
  }
  world::broadcast(std::as_writable_bytes(std::span(id)), 0, "trace run id");
  id[sizeof id - 1] = '\0';
  return id;
}

}  // namespace

RunTrace::RunTrace(const Config& cfg, const MpiEnv& env, const TrainRun& run, MetricsLogger& log)
    : cfg_(cfg), env_(env) {
  const auto& p = cfg.profile;
  if (p.steps.empty()) return;
  // The range in global steps, within this run: up to training.steps, from where it resumed.
  first_ = p.steps[0], last_ = std::min<int64_t>(p.steps[1], cfg.training.steps);
  if (last_ <= run.start_step) {
    log.note(fmt::format("trace: profile.steps = [{}, {}] ends before step {}, where this run resumes: nothing traced",
                         p.steps[0], p.steps[1], run.start_step + 1));
    first_ = last_ = 0;
    return;
  }
  if (p.steps[1] > cfg.training.steps)
    log.note(fmt::format("trace: profile.steps = [{}, {}] ends after training.steps = {}: steps {} to {} are traced",
                         p.steps[0], p.steps[1], cfg.training.steps, std::max<int64_t>(first_, run.start_step + 1),
                         last_));
  run_id_ = agree_run_id(env);
  trace::set_max_events(size_t(p.max_events));
  const ClockSync c = world::clock_sync();
  trace::set_clock(c.offset_ns, c.zero_ns, c.rtt_ns);
  trace::set_process(env.rank(), env.host());
  trace::name_thread("main");
  // The model state's parts, as the allocator counts them (its rounding): the memory track's fixed series.
  const Device d = run.device;
  int64_t params = 0, grads = 0, opt = 0;
  for (Parameter* q : run.params) {
    params += int64_t(allocation_bytes(d, q->value.local.nbytes()));
    const Tensor copy = compute_copy(*q);
    if (copy.defined()) params += int64_t(allocation_bytes(d, copy.nbytes()));
    if (q->frozen) continue;  // LoRA's base: no gradient, no optimizer state
    grads += int64_t(allocation_bytes(d, q->grad.local.nbytes()));
    const auto& s = run.opt->state().at(q->name);
    opt += int64_t(allocation_bytes(d, s.exp_avg.nbytes()) + allocation_bytes(d, s.exp_avg_sq.nbytes()));
  }
  const int64_t buffers = run.grad_sync ? int64_t(allocation_bytes(d, size_t(run.grad_sync->bucket_buffer_bytes()))) : 0;
  trace::set_memory_parts(params, grads, opt, buffers);
  device_ = d;
  trace::set_memory_device(d.is_cuda() ? d.index : -1);  // a GPU run's track is the device's memory
}

void RunTrace::before_step(int64_t step) {
  if (!enabled() || recording_ || done_ || step + 1 < first_) return;
  before_ = comm_counters();
  trace::clear();
  trace::reset_memory_peak();
  trace::start();
  recording_ = true;
  traced_first_ = step + 1;
  trace::memory_sample(int64_t(allocator_stats(device_).allocated_bytes));
}

void RunTrace::step_done(int64_t step, int64_t t0_ns, int64_t peak) {
  if (!recording_) return;
  trace::Args a;
  a.step = step + 1;
  a.bytes = peak;
  a.detail = "bytes: the allocator's peak of the step";
  trace::complete("step", "step", t0_ns, trace::now_ns(), std::move(a));
  traced_last_ = step + 1;
  // On a GPU, each op's run on its stream (the device may still be running the optimizer: those spans end past
  // the host's step span).
  kprof::trace_device_flush();
}

bool RunTrace::full() const { return recording_ && trace::full(); }

void RunTrace::after_step(int64_t step, int full_rank, MetricsLogger& log) {
  if (!recording_) return;
  if (full_rank >= 0 && step + 1 < last_)
    log.note(fmt::format("trace: rank {} reached profile.max_events = {} in step {}: the range ends there (steps {} "
                         "to {} traced of {} to {}; each event holds about 250 B of memory)",
                         full_rank, cfg_.profile.max_events, step + 1, traced_first_, step + 1, first_, last_));
  if (full_rank >= 0 || step + 1 >= last_) finish(log);
}

bool RunTrace::write_file() {
  peak_ = trace::memory_peak();
  // The Group counters of the traced range: what the "comm" spans' bytes must add up to.
  const CommCounters now = comm_counters();
  nlohmann::json counters = nlohmann::json::array();
  for (const auto& [k, c] : now.entries) {
    CommCounters::Count b;
    if (auto it = before_.entries.find(k); it != before_.entries.end()) b = it->second;
    if (c.calls == b.calls) continue;
    counters.push_back({{"tag", std::get<0>(k)}, {"group", std::get<1>(k)}, {"kind", std::get<2>(k)},
                        {"calls", c.calls - b.calls}, {"bytes", c.bytes - b.bytes}});
  }
  const nlohmann::json meta = {{"run_id", run_id_},
                               {"world_size", env_.size()},
                               {"steps", {traced_first_, traced_last_}},
                               {"max_events", cfg_.profile.max_events},
                               {"dropped_events", int64_t(trace::dropped_events())},
                               {"comm_counters", counters},
                               {"memory_peak", {{"parameters", peak_.parameters}, {"gradients", peak_.gradients},
                                                {"optimizer", peak_.optimizer}, {"communication buffers", peak_.buffers},
                                                {"fully_shard units", peak_.units},
                                                {"checkpoint snapshot", peak_.snapshot},
                                                {"activations and temporaries", peak_.other},
                                                {"total", peak_.total()}}}};
  const bool ok = trace::write(trace_rank_path(cfg_.profile.dir, env_.rank()), meta.dump());
  fault_slow_trace(int64_t(trace::event_count()));
  return ok;
}

void RunTrace::finish(MetricsLogger& log) {
  if (!recording_) return;
  trace::stop();
  recording_ = false, done_ = true;
  const int64_t t0 = trace::now_ns();
  // Every rank's size first (all arrive here from the same step), so that each knows how long the largest file
  // and the merge may take.
  const std::vector<int64_t> sizes = world::all_gather(int64_t(trace::event_count()), "trace sizes");
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  int64_t all = 0;
  for (int64_t n : sizes) all += n;
  const bool ok = write_file();
  trace::clear();
  world::barrier("trace files written", trace_write_budget_s(largest));
  const int64_t written = trace::now_ns();
  const std::vector<int> oks = world::all_gather(int(ok), "trace files agreed");
  std::vector<int> failed;
  for (int r = 0; r < int(oks.size()); ++r)
    if (!oks[size_t(r)]) failed.push_back(r);
  if (env_.rank() == 0) merge(log, sizes[0], all, failed);
  const int64_t merged = trace::now_ns();
  if (after_range) after_range();
  const int64_t compared = trace::now_ns();
  // Rank 0 merged every file meanwhile (and compared its memory with `meshtrain estimate`).
  world::barrier("trace merged", trace_write_budget_s(all));
  // What the range's end cost the run (every rank waits for it): said once, and recorded.
  const double s = 1e-9 * double(trace::now_ns() - t0), write_s = 1e-9 * double(written - t0),
               merge_s = 1e-9 * double(merged - written), compare_s = 1e-9 * double(compared - merged);
  log.note(fmt::format("trace: the range's end held the run {:.2f} s: the files written {:.2f} s (the slowest rank), "
                       "merged {:.2f} s, memory beside estimate {:.2f} s",
                       s, write_s, merge_s, compare_s));
  log.record({{"event", "trace_end"}, {"s", s}, {"write_s", write_s}, {"merge_s", merge_s},
              {"compare_s", compare_s}, {"events", all}});
}

void RunTrace::merge(MetricsLogger& log, int64_t events, int64_t all_events, const std::vector<int>& failed) {
  const std::string& dir = cfg_.profile.dir;
  if (!failed.empty()) {
    log.note(fmt::format("trace: {} could not write {} in {}: no merged trace", rank_list(failed),
                         failed.size() > 1 ? "their files" : "its file", dir));
    return;
  }
  try {
    const MergedTraces m = merge_traces(dir, run_id_, env_.size());
    fault_slow_trace(all_events);
    log.note(fmt::format("trace of steps {} to {}: {} events on rank 0, {} ranks merged into {}{}{} (open it in "
                         "https://ui.perfetto.dev or chrome://tracing)",
                         traced_first_, traced_last_, events, m.ranks, m.path,
                         m.dropped ? fmt::format(", {} events past profile.max_events dropped", m.dropped) : "",
                         m.other_files ? fmt::format(", {} file(s) of another run beside them left out", m.other_files)
                                       : ""));
  } catch (const std::exception& e) {  // a damaged file is the merge's error, never the run's
    log.note(fmt::format("trace: the rank files are written, the merge failed ({}): meshtrain trace merge {} "
                         "after fixing it",
                         e.what(), dir));
  }
}

}  // namespace mt
