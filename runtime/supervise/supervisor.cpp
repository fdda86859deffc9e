// The supervisor's policy between launches: which outcome ends the job, the failure's report and record, the
// back-off, giving up, and the nodes left out (supervisor.h).
#include "runtime/supervise/supervisor.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "runtime/supervise/evidence.h"
#include "runtime/supervise/goodput.h"
#include "runtime/supervise/launch.h"
#include "runtime/train/memory_segment.h"
#include "runtime/train/run_config.h"

namespace mt {

using namespace supervisor;

namespace {
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& a : v) s += (s.empty() ? "" : " ") + a;
  return s;
}

// The value of `--set KEY=VALUE` (or --set=KEY=VALUE) in a launch command, if any.
std::string launch_setting(const std::vector<std::string>& argv, const std::string& key) {
  std::string found;
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string a = argv[i];
    if (a.rfind("--set=", 0) == 0) a = a.substr(6);
    else if (a == "--set" && i + 1 < argv.size()) a = argv[++i];
    else continue;
    if (a.rfind(key + "=", 0) == 0) found = a.substr(key.size() + 1);
  }
  return found;
}

void append_record(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return;
  FILE* f = std::fopen(path.c_str(), "a");
  if (!f) {
    say("warning: cannot append the {} record to the metrics file {}: {}", j.value("event", "supervisor's"), path,
        std::strerror(errno));
    return;
  }
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::fwrite(s.data(), 1, s.size(), f);
  std::fclose(f);
}

// Why the supervisor could not append to a metrics file named on its command line ("" when it can): the file's
// folder must exist and be writable (the supervisor creates none: a mistyped path would be recorded to nowhere),
// and the file, if there, be a writable file.
std::string not_appendable(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::exists(dir, ec)) return fmt::format("its folder {} does not exist", dir.string());
  if (!fs::is_directory(dir, ec)) return fmt::format("{} is not a folder", dir.string());
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return fmt::format("its folder {} is not writable ({})", dir.string(), std::strerror(errno));
  if (!fs::exists(p, ec)) return "";
  if (fs::is_directory(p, ec)) return "it is a folder, not a file";
  if (::access(p.c_str(), R_OK | W_OK) != 0)
    return fmt::format("it cannot be read and written ({})", std::strerror(errno));
  return "";
}

// The launch command of an attempt: srun's with --kill-on-bad-exit=1 unless given, and the nodes left out.
std::vector<std::string> attempt_argv(const std::vector<std::string>& launch, const std::string& launcher,
                                      const std::set<std::string>& excluded) {
  std::vector<std::string> argv = launch;
  // srun leaves the other tasks running when one dies (KillOnBadExit=0, Slurm's default): they would wait for it
  // until their watchdog fires. One dead rank ends the step at once.
  if (launcher == "srun" && std::none_of(argv.begin(), argv.end(), [](const std::string& x) {
        return x.rfind("--kill-on-bad-exit", 0) == 0 || x.rfind("-K", 0) == 0;
      }))
    argv.insert(argv.begin() + 1, "--kill-on-bad-exit=1");
  if (launcher == "srun" && !excluded.empty()) {
    std::string list;
    for (const std::string& n : excluded) list += (list.empty() ? "" : ",") + n;
    argv.insert(argv.begin() + 1, "--exclude=" + list);
  }
  return argv;
}

// Where the launch's metrics go (--metrics, else the launch's config as its ranks will read it: --config and every
// --set, when it can be read here; its errors are the launch's to report), with a warning when a relaunch would not
// resume or there is no metrics file.
std::string launch_metrics_path(const SuperviseOptions& a, std::string* checkpoint_dir) {
  std::optional<Config> cfg;
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < a.launch.size(); ++i) {
    const std::string& x = a.launch[i];
    if ((x == "--config" || x == "-c") && i + 1 < a.launch.size()) config_path = a.launch[i + 1];
    else if (x.rfind("--config=", 0) == 0) config_path = x.substr(9);
    else if (x == "--set" && i + 1 < a.launch.size()) overrides.push_back(a.launch[i + 1]);
    else if (x.rfind("--set=", 0) == 0) overrides.push_back(x.substr(6));
  }
  try {
    if (!config_path.empty()) cfg = load_config(config_path, overrides);
  } catch (const std::exception&) {
  }
  const std::string metrics_path = !a.metrics.empty() ? a.metrics
                                   : cfg              ? cfg->log.metrics_file
                                                      : launch_setting(a.launch, "log.metrics_file");
  *checkpoint_dir = cfg ? cfg->checkpoint.dir : launch_setting(a.launch, "checkpoint.dir");
  const bool resumes = cfg ? cfg->checkpoint.resume == "auto" && !cfg->checkpoint.dir.empty()
                           : launch_setting(a.launch, "checkpoint.resume") == "auto";
  if (!resumes)
    say("warning: {}: a relaunch would start over (add --set checkpoint.resume=auto to the launch, and a "
        "checkpoint.dir)",
        cfg ? "the launch's config has no checkpoint.resume: auto with a checkpoint.dir"
            : "the launch has no --set checkpoint.resume=auto (and its config could not be read here)");
  if (metrics_path.empty())
    say("warning: no metrics file (--metrics, or --set log.metrics_file=... in the launch): the failure lines lack "
        "the steps and there is no goodput");
  return metrics_path;
}

// The exit codes of ranks that stopped on a stop signal after their checkpoint (a preemption).
bool stop_exit(int code) { return code == 128 + SIGTERM || code == 128 + SIGUSR1 || code == 128 + SIGINT; }

// The job's launches, one after another, and what is kept between them.
class Supervisor {
 public:
  Supervisor(const SuperviseOptions& o, double t0, std::string metrics_path, std::string checkpoint_dir)
      : o_(o), t0_(t0), metrics_path_(std::move(metrics_path)), checkpoint_dir_(std::move(checkpoint_dir)),
        launcher_(std::filesystem::path(o.launch[0]).filename()) {
    if (!metrics_path_.empty()) metrics_.emplace(metrics_path_, /*from_end=*/true);
  }

  int run() {
    for (int attempt = 1;; ++attempt) {
      OutputScanner scan(acct_);
      const LaunchResult r = launch(attempt, scan);
      if (ends_job(attempt, r, scan.ev)) break;
      const bool give_up = restarts_ >= o_.max_restarts;
      report_failure(attempt, r, scan.ev, give_up);
      remove_mpi_leftovers(acct_.current().launch_t);
      count_node_failure(scan.ev);
      if (give_up) {
        say("giving up: {} relaunch{} (--max-restarts {}) used; the last launch exited {}", restarts_,
            restarts_ == 1 ? "" : "es", o_.max_restarts, code_);
        break;
      }
      if (!back_off()) break;
    }
    remove_segments();
    if (metrics_) {
      GoodputParts p = acct_.parts(now_unix() - t0_);
      say("{}", goodput_line(p));
      say("{}", restart_line(p));
      append_record(metrics_path_, goodput_record(p));
    }
    return code_;
  }

 private:
  LaunchResult launch(int attempt, OutputScanner& scan) {
    const std::vector<std::string> argv = attempt_argv(o_.launch, launcher_, excluded_);
    say("launch {} of at most {}: {}", attempt, o_.max_restarts + 1, join(argv));
    acct_.begin_attempt(now_unix(), waited_);
    LaunchResult r = run_launch(argv, metrics_ ? &*metrics_ : nullptr, acct_, scan, o_.hang_timeout_s);
    code_ = r.code;
    // A launch that finished, or stopped on a signal after its checkpoint, did not fail.
    const bool stopped = r.forwarded || code_ == 0 || stop_exit(code_);
    acct_.end_attempt(now_unix(), !stopped);
    return r;
  }

  // Whether this launch's end is the job's (done, stopped, or an error a relaunch would repeat), said why.
  bool ends_job(int attempt, const LaunchResult& r, const FailureEvidence& ev) {
    const AttemptRecords& at = acct_.current();
    if (r.forwarded) {
      if (code_ != 0) code_ = 128 + r.forwarded;  // mpirun reports 1 after its ranks stopped on a forwarded SIGTERM
      say("launch {} stopped on {} ({}): exit code {}, not relaunched", attempt, r.forwarded,
          signal_name(r.forwarded), code_);
      return true;
    }
    if (code_ == 0) {
      say("launch {} finished (exit code 0){}", attempt,
          at.last_step >= 0 ? fmt::format(" at step {}", at.last_step) : "");
      return true;
    }
    if (stop_exit(code_)) {
      say("launch {} exited {}: its ranks stopped on signal {} ({}) after a checkpoint (a preemption): passed on, "
          "not relaunched",
          attempt, code_, code_ - 128, signal_name(code_ - 128));
      return true;
    }
    if (code_ == 2) {
      say("launch {} exited 2 (a command-line error): not relaunched", attempt);
      return true;
    }
    const bool launcher_killed = r.launcher_signal != 0;
    if (!ev.rank_failure() && !r.hang_killed && !launcher_killed && at.steps_recorded == 0) {
      say("launch {} failed with exit code {} before its first step, with no rank killed, stopped or timed out: an "
          "error that a relaunch would repeat (the config, the data, the command line?): not relaunched",
          attempt, code_);
      return true;
    }
    return false;
  }

  // One line per failure (who, where, how, and what it cost) and its record in the metrics file.
  void report_failure(int attempt, const LaunchResult& r, const FailureEvidence& ev, bool give_up) {
    const AttemptRecords& at = acct_.current();
    const AttemptRecords::Tail tail = at.failure_tail();
    const int64_t lost = acct_.steps_lost();
    std::string who = ev.rank >= 0 ? fmt::format("rank {}", ev.rank) : "a rank";
    if (!ev.node.empty()) who += " on " + ev.node;
    std::string how = r.hang_killed ? fmt::format("hung: no new step for {:g} s (--hang-timeout)", o_.hang_timeout_s)
                      : !ev.how.empty()        ? ev.how
                      : r.launcher_signal != 0 ? fmt::format("(unknown: the launcher was killed by signal {}, {})",
                                                             r.launcher_signal, signal_name(r.launcher_signal))
                                               : "(unknown: no rank named in the launch's output)";
    say("failure {} (launch {}): {} {}; exit code {}; last step recorded {}, last committed checkpoint {}{}, {} "
        "step{} lost{}",
        restarts_ + 1, attempt, who, how, code_, at.last_step >= 0 ? std::to_string(at.last_step) : "none",
        acct_.last_committed() >= 0 ? std::to_string(acct_.last_committed()) : "none",
        at.last_memory >= 0 ? fmt::format(" (in memory: {})", at.last_memory) : "", lost, lost == 1 ? "" : "s",
        at.last_record_t > 0 && at.exit_t > at.last_record_t
            ? fmt::format(" ({:.1f} s since the last record: {:.1f} s the step in flight, {:.1f} s detection and "
                          "tear-down)",
                          at.exit_t - at.last_record_t, tail.in_flight_s, tail.detection_s)
            : "");
    nlohmann::json rec = {{"event", "failure"},
                          {"attempt", attempt},
                          {"rank", ev.rank},
                          {"node", ev.node},
                          {"signal", ev.signal},
                          {"rank_exit_code", ev.rank_exit},
                          {"exit_code", code_},
                          {"how", how},
                          {"hang", r.hang_killed},
                          {"last_step", at.last_step},
                          {"last_committed", acct_.last_committed()},
                          {"last_memory", at.last_memory},
                          {"steps_lost", lost},
                          {"in_flight_s", tail.in_flight_s},
                          {"detection_s", tail.detection_s},
                          {"time", now_unix()},
                          {"action", give_up ? "give up" : "relaunch"}};
    append_record(metrics_path_, rec);
  }

  // srun launches leave out a node once it failed --exclude-after times.
  void count_node_failure(const FailureEvidence& ev) {
    if (!ev.node.empty() && ++node_failures_[ev.node] >= o_.exclude_after && o_.exclude_after > 0 &&
        launcher_ == "srun" && !excluded_.count(ev.node)) {
      excluded_.insert(ev.node);
      say("node {} failed {} times (--exclude-after {}): the next launches leave it out", ev.node,
          node_failures_[ev.node], o_.exclude_after);
    }
  }

  // The wait before a relaunch: doubled per failure in a row without progress; progress (a step beyond any before)
  // resets it. False: a stop signal came during the wait, and the job ends.
  bool back_off() {
    const AttemptRecords& at = acct_.current();
    const bool progress = at.last_step > best_step_;
    best_step_ = std::max(best_step_, at.last_step);
    consecutive_ = progress ? 1 : consecutive_ + 1;
    waited_ = std::min(o_.backoff_max_s, o_.backoff_s * double(1LL << std::min(consecutive_ - 1, 20)));
    ++restarts_;
    say("relaunch {} of {} in {:g} s{}", restarts_, o_.max_restarts, waited_,
        progress ? "" : fmt::format(" ({} failures in a row without progress)", consecutive_));
    const double until = now_unix() + waited_;
    int sig = 0;
    while (now_unix() < until && !(sig = pending_stop_signal()))
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!sig) return true;
    code_ = 128 + sig;
    say("received {} ({}) while waiting to relaunch: not relaunched, exit code {}", sig, signal_name(sig), code_);
    acct_.add_wait(now_unix() - (until - waited_));  // the wait so far, as restart time
    return false;
  }

  // The job's in-memory checkpoints (checkpoint.memory) on this machine, once it ends: a finished run removed its
  // own; a job given up on, or failed for good, leaves nobody else to (memory_segment.h names them).
  // Open MPI's shared-memory files the failed launch's killed ranks left on this machine (launch.h).
  void remove_mpi_leftovers(double launch_t) {
    const std::string dir = mpi_shm_dir();
    const int n = remove_mpi_shm_leftovers(launch_t, dir);
    if (n > 0)
      say("removed {} Open MPI shared-memory file{} (vader_segment.*) the failed launch's ranks left in {}", n,
          n == 1 ? "" : "s", dir);
  }

  void remove_segments() {
    if (checkpoint_dir_.empty()) return;
    const int n = remove_memory_segments(checkpoint_dir_);
    if (n > 0)
      say("removed {} in-memory checkpoint segment{} of the job ({}/{}-r*)", n, n == 1 ? "" : "s",
          memory_segment_dir(), memory_job_key(checkpoint_dir_));
  }

  const SuperviseOptions& o_;
  const double t0_;
  const std::string metrics_path_;
  const std::string checkpoint_dir_;  // the launch's checkpoint.dir: the job's segments' names
  const std::string launcher_;  // the launch command's program: srun's launches get srun's options
  GoodputAccount acct_;
  std::optional<FileTail> metrics_;
  std::map<std::string, int> node_failures_;
  std::set<std::string> excluded_;
  int restarts_ = 0, consecutive_ = 0, code_ = 0;
  int64_t best_step_ = -1;
  double waited_ = 0;  // the back-off before the next launch
};
}  // namespace

int supervise(const SuperviseOptions& o) {
  const double t0 = now_unix();
  if (o.launch.empty()) {
    std::fprintf(stderr, "meshtrain supervise: no launch command (meshtrain supervise [OPTIONS] -- mpirun ...)\n");
    return 2;
  }
  if (const std::string why = o.metrics.empty() ? "" : not_appendable(o.metrics); !why.empty()) {
    std::fprintf(stderr,
                 "meshtrain supervise: --metrics %s: %s (the supervisor reads the run's records there and appends "
                 "the failures and the goodput); nothing launched\n",
                 o.metrics.c_str(), why.c_str());
    return 2;
  }
  std::string checkpoint_dir;
  const std::string metrics_path = launch_metrics_path(o, &checkpoint_dir);
  catch_stop_signals();
  return Supervisor(o, t0, metrics_path, checkpoint_dir).run();
}

}  // namespace mt
