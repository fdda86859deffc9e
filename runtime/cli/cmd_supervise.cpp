// `meshtrain supervise [options] -- LAUNCH...`: runs a training launch (mpirun ... meshtrain ... train, or srun
// ...) and launches it again from its newest good checkpoint (checkpoint.resume: auto) when a rank dies or hangs,
// up to --max-restarts times with a back-off, logging each failure: which rank, which node, how, at what step, what
// was lost. It is not one of the job's ranks: it starts no MPI (Command::needs_mpi), like torchrun's agent.
//
// What ends it: the launch exits 0 (done); a stop signal (SIGTERM, SIGUSR1, SIGINT) sent to the supervisor is
// passed to the launcher, whose ranks checkpoint and stop, and the supervisor exits 128 + the signal without a
// relaunch (a batch script's requeue path); a launch that exits 128 + SIGTERM/SIGUSR1/SIGINT by itself (a stop
// signal reached the ranks some other way) is passed through the same way; 2 (a command-line error) and a launch
// that failed before its first step with no rank killed, timed out or hung (a config or data error, which a
// relaunch would only repeat) are not relaunched. Anything else is a failure, relaunched after
// backoff x 2^(consecutive failures - 1) seconds (capped; a failure after progress starts again at --backoff).
//
// With the run's metrics file (--metrics, else the launch's --set log.metrics_file=...) it also accounts for the
// job's wall time (runtime/train/goodput.h): printed at the end and appended to the metrics file as
// {"event":"goodput","scope":"job",...}, with one {"event":"failure",...} per failure.
#include "runtime/cli/command.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/train/goodput.h"
#include "runtime/train/run_config.h"

namespace mt {

namespace {

struct SuperviseArgs {
  int max_restarts = 3;
  double backoff_s = 5;
  double backoff_max_s = 60;
  double hang_timeout_s = 0;
  std::string metrics;
  int exclude_after = 0;
  std::vector<std::string> launch;
};

void add_supervise_options(CLI::App* app, SuperviseArgs& a) {
  // Every count and duration option: a negative value is a usage error.
  auto count = [app](const char* name, auto& value, const char* help) {
    app->add_option(name, value, help)->check(CLI::NonNegativeNumber);
  };
  count("--max-restarts", a.max_restarts, "relaunches after failures before giving up (default 3)");
  count("--backoff", a.backoff_s,
        "seconds to wait before the first relaunch, doubled per consecutive failure without progress (default 5)");
  count("--backoff-max", a.backoff_max_s, "the longest wait between launches in seconds (default 60)");
  count("--hang-timeout", a.hang_timeout_s,
        "kill the launch when the metrics file gets no new step for this many seconds after its first "
        "(0: off, default; the ranks' own watchdog, comm.timeout_s, ends stuck collectives)");
  app->add_option("--metrics", a.metrics,
                  "the run's metrics file (log.metrics_file), for the failure lines and the goodput (default: the "
                  "launch's --set log.metrics_file=...)");
  count("--exclude-after", a.exclude_after,
        "srun launches: leave out (srun --exclude) a node that failed this many times (0: never, default)");
  app->add_option("launch", a.launch, "the launch command, after --: mpirun -np 4 meshtrain ... train")->required();
}

std::atomic<int> g_signal{0};
extern "C" void on_supervisor_signal(int sig) { g_signal = sig; }

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// "[supervise HH:MM:SS] ..." on stderr.
template <typename... A>
void say(fmt::format_string<A...> f, A&&... args) {
  std::time_t t = std::time(nullptr);
  char hms[16];
  std::strftime(hms, sizeof hms, "%H:%M:%S", std::localtime(&t));
  std::string line = fmt::format("[supervise {}] {}\n", hms, fmt::format(f, std::forward<A>(args)...));
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= size_t(w);
  }
}

std::string signal_name(int sig) {
  const char* s = strsignal(sig);
  return s ? s : fmt::format("signal {}", sig);
}

// The signal a launcher names in words ("Killed", "Terminated", "Segmentation fault"), or 0.
int signal_from_words(const std::string& w) {
  for (int s = 1; s < 32; ++s)
    if (const char* n = strsignal(s); n && w.rfind(n, 0) == 0) return s;
  return 0;
}

// What the launch's output says about why it failed, from the launchers' and meshtrain's own lines. The strongest
// evidence wins: a rank that says it was the one suspended, then a rank killed by a signal, then a rank a peer's
// watchdog found missing, then a rank's exit code, then the rank that called MPI_Abort.
struct FailureEvidence {
  int level = 0;  // 0: nothing seen
  int rank = -1;
  std::string node;
  int signal = 0;     // the signal that ended the rank, as its launcher reported it
  int rank_exit = -1;  // the rank's exit code, as its launcher reported it
  std::string how;
  bool stopped_by_signal = false;  // meshtrain's "signal N (...) received: stopped after step K"

  // A rank died or hung: not an error that would repeat.
  bool rank_failure() const { return level >= 3; }
};

class OutputScanner {
 public:
  explicit OutputScanner(GoodputAccount& acct) : acct_(acct) {}

  void line(const std::string& l) {
    std::smatch m;
    if (std::regex_search(l, m, ckpt_)) {
      acct_.add_output_checkpoint(std::stoll(m[1]), std::stod(m[2]));
    } else if (std::regex_search(l, m, suspended_)) {
      set(5, std::stoi(m[1]), m[2], 0, -1, fmt::format("was stopped (suspended {} s) and timed out its peers", m[3].str()));
    } else if (std::regex_search(l, m, ompi_signal_)) {
      const int sig = std::stoi(m[3]);
      set(4, std::stoi(m[1]), m[2], sig, -1, fmt::format("exited on signal {} ({})", sig, m[4].str()));
    } else if (std::regex_search(l, m, srun_task_)) {
      const std::string what = m[3];
      std::smatch e;
      if (std::regex_search(what, e, std::regex(R"(Exited with exit code (\d+))")))
        set(2, std::stoi(m[2]), m[1], 0, std::stoi(e[1]), fmt::format("exited with code {}", e[1].str()));
      else if (int sig = signal_from_words(what))
        set(4, std::stoi(m[2]), m[1], sig, -1, fmt::format("exited on signal {} ({})", sig, what));
    } else if (std::regex_search(l, m, watchdog_missing_)) {
      std::string ranks = m[4];
      set(3, std::stoi(ranks.substr(0, ranks.find(','))), "", 0, -1,
          fmt::format("did not arrive in {} within comm.timeout_s (stopped or dead; reported by rank {} on {})",
                      m[1].str(), m[2].str(), m[3].str()));
    } else if (std::regex_search(l, m, watchdog_elsewhere_)) {
      set(3, std::stoi(m[4]), "", 0, -1,
          fmt::format("was elsewhere ({}) while its peers waited in {} (reported by rank {} on {})", m[5].str(),
                      m[1].str(), m[2].str(), m[3].str()));
    } else if (std::regex_search(l, m, watchdog_any_)) {
      set(3, -1, "", 0, -1, fmt::format("watchdog timeout: {} did not finish within comm.timeout_s", m[1].str()));
    } else if (std::regex_search(l, m, ompi_process_)) {
      pending_rank_ = std::stoi(m[1]);
    } else if (pending_rank_ >= 0 && std::regex_search(l, m, ompi_exit_)) {
      set(2, pending_rank_, "", 0, std::stoi(m[1]), fmt::format("exited with code {}", m[1].str()));
      pending_rank_ = -1;
    } else if (std::regex_search(l, m, mt_rank_failed_)) {
      set(2, std::stoi(m[1]), "", 0, 1, "failed with an error");
    } else if (std::regex_search(l, m, abort_)) {
      set(1, std::stoi(m[1]), "", 0, -1, fmt::format("called MPI_Abort (error code {})", m[2].str()));
    } else if (l.find("received: stopped after step") != std::string::npos) {
      ev.stopped_by_signal = true;
    }
  }

  FailureEvidence ev;

 private:
  void set(int level, int rank, const std::string& node, int sig, int code, const std::string& how) {
    if (level <= ev.level) {
      if (ev.node.empty() && rank == ev.rank && !node.empty()) ev.node = node;  // a weaker line may know the node
      return;
    }
    const std::string known_node = rank == ev.rank && node.empty() ? ev.node : node;
    ev.level = level;
    ev.rank = rank;
    ev.node = known_node;
    ev.signal = sig;
    ev.rank_exit = code;
    ev.how = how;
  }

  GoodputAccount& acct_;
  int pending_rank_ = -1;
  const std::regex ckpt_{R"(^checkpoint step (\d+) -> \S+ in ([0-9.]+) s)"};
  const std::regex suspended_{R"(\[comm\] rank (\d+) \(host ([^)]+)\) was suspended for ([0-9.]+) s)"};
  const std::regex ompi_signal_{
      R"(process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+) \(([^)]*)\))"};
  const std::regex srun_task_{R"(srun: error: ([^:\s]+): tasks? (\d+)[0-9,\-]*: (.*))"};
  const std::regex watchdog_missing_{
      R"(\[comm\] timeout: (.*?) did not finish within .*? on rank (\d+) \(host ([^)]+)\); world ranks? ([0-9,]+) did not arrive and did not answer)"};
  const std::regex watchdog_elsewhere_{
      R"(\[comm\] timeout: (.*?) did not finish within .*? on rank (\d+) \(host ([^)]+)\); world rank (\d+) did not arrive: it is ([^;(]*))"};
  const std::regex watchdog_any_{R"(\[comm\] timeout: (.*?) did not finish within)"};
  const std::regex ompi_process_{R"(Process name: \[\[\d+,\d+\],(\d+)\])"};
  const std::regex ompi_exit_{R"(Exit code:\s+(\d+))"};
  const std::regex mt_rank_failed_{R"(meshtrain: rank (\d+) failed, aborting the job)"};
  const std::regex abort_{R"(MPI_ABORT was invoked on rank (\d+) in communicator \S+\s*(?:with errorcode (\d+))?)"};
};

// Every process below `root` (its children, theirs, ...), from /proc.
std::vector<pid_t> descendants(pid_t root) {
  std::map<pid_t, std::vector<pid_t>> children;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    FILE* f = std::fopen((e.path() / "stat").c_str(), "r");
    if (!f) continue;
    char buf[512] = {0};
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    std::string s(buf, n);
    size_t close = s.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    if (std::sscanf(s.c_str() + close + 1, " %*c %d", &ppid) == 1) children[pid_t(ppid)].push_back(pid_t(std::stoi(name)));
  }
  std::vector<pid_t> out, frontier{root};
  while (!frontier.empty()) {
    pid_t p = frontier.back();
    frontier.pop_back();
    for (pid_t c : children[p]) {
      out.push_back(c);
      frontier.push_back(c);
    }
  }
  return out;
}

struct LaunchResult {
  int code = 0;           // the exit code, 128 + N when the launcher itself was killed by signal N
  bool hang_killed = false;
  int forwarded = 0;      // the stop signal passed on to the launcher (0: none)
  int launcher_signal = 0;  // the signal that killed the launcher itself (0: it exited)
};

// Waits up to 100 ms for the launch's stdout and stderr (fds), passes what arrives through to ours and hands each
// whole line to the scanner (partial: the unfinished line of each); a pipe at its end is marked closed in open_fd.
void pump_output(const int fds[2], bool open_fd[2], std::string partial[2], OutputScanner& scan) {
  pollfd p[2];
  int n = 0;
  int which[2];
  for (int i = 0; i < 2; ++i)
    if (open_fd[i]) p[n] = {fds[i], POLLIN, 0}, which[n++] = i;
  if (n == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return;
  }
  if (::poll(p, nfds_t(n), 100) <= 0) return;
  for (int k = 0; k < n; ++k) {
    if (!(p[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    const int i = which[k];
    char buf[65536];
    ssize_t got = ::read(fds[i], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      open_fd[i] = false;
      continue;
    }
    write_all(i == 0 ? 1 : 2, buf, size_t(got));
    for (ssize_t j = 0; j < got; ++j) {
      if (buf[j] == '\n') {
        scan.line(partial[i]);
        partial[i].clear();
      } else if (buf[j] != '\r') {
        partial[i].push_back(buf[j]);
      }
    }
  }
}

// Runs one launch: its output passed through and scanned, the metrics file read as it grows, stop signals
// forwarded, a hang (no new step for hang_timeout_s) ended.
LaunchResult run_launch(const std::vector<std::string>& argv, FileTail* metrics, GoodputAccount& acct,
                        OutputScanner& scan, double hang_timeout_s) {
  LaunchResult res;
  int out_pipe[2], err_pipe[2];
  if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    for (int s : {SIGTERM, SIGUSR1, SIGINT, SIGPIPE}) std::signal(s, SIG_DFL);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::close(out_pipe[0]), ::close(out_pipe[1]), ::close(err_pipe[0]), ::close(err_pipe[1]);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "meshtrain supervise: cannot run %s: %s\n", args[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  int fds[2] = {out_pipe[0], err_pipe[0]};
  std::string partial[2];
  bool open_fd[2] = {true, true};
  bool exited = false;
  int status = 0;
  double exit_seen = 0, last_step_t = -1, last_metrics_read = 0;
  int64_t steps_seen = 0;
  std::set<int> forwarded;
  auto read_metrics = [&] {
    if (!metrics) return;
    const double t = now_unix();
    last_metrics_read = t;
    for (const std::string& l : metrics->read_lines()) {
      nlohmann::json r = nlohmann::json::parse(l, nullptr, false);
      if (r.is_discarded()) continue;
      acct.add_record(r, t);
      if (r.contains("loss") && r.contains("step")) {
        ++steps_seen;
        last_step_t = t;
      }
    }
  };
  while (true) {
    pump_output(fds, open_fd, partial, scan);
    const double t = now_unix();
    if (int sig = g_signal.exchange(0); sig != 0 && !exited) {
      // Once per signal: Open MPI's mpirun kills its ranks at once on a second SIGTERM, before their checkpoint
      // (a signal may reach the supervisor twice: from `timeout`, from Slurm signalling every process of the job).
      // A second Ctrl-C is passed on: the user asks to stop now.
      if (forwarded.count(sig) && sig != SIGINT) {
        say("received {} ({}) again: already passed on, the ranks are stopping", sig, signal_name(sig));
      } else {
        // SIGTERM goes on as SIGUSR1, which the ranks treat alike (checkpoint, stop): Open MPI's mpirun, given
        // SIGTERM, terminates its ranks itself shortly after passing it on, before a loaded rank has saved;
        // SIGUSR1 it only forwards (srun forwards both).
        const int pass = sig == SIGTERM ? SIGUSR1 : sig;
        say("received {} ({}): passing it to the launch (pid {}){}; its ranks checkpoint and stop, and there is no "
            "relaunch",
            sig, signal_name(sig), pid, pass != sig ? " as SIGUSR1" : "");
        ::kill(pid, pass);
        forwarded.insert(sig);
        res.forwarded = sig;
      }
    }
    if (t - last_metrics_read >= 0.1) read_metrics();
    if (!exited && hang_timeout_s > 0 && steps_seen > 0 && t - last_step_t > hang_timeout_s && !res.hang_killed) {
      say("no new step in the metrics for {:.0f} s (--hang-timeout): the launch hangs; killing it", t - last_step_t);
      res.hang_killed = true;
      std::vector<pid_t> all = descendants(pid);
      ::kill(-pid, SIGKILL);
      for (pid_t d : all) ::kill(d, SIGKILL);
    }
    if (!exited) {
      pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) {
        exited = true;
        exit_seen = t;
      }
    }
    // After the exit, what is left in the pipes; a process that inherited them and lives on is not waited for.
    if (exited && ((!open_fd[0] && !open_fd[1]) || t - exit_seen > 3)) break;
  }
  for (int i = 0; i < 2; ++i) {
    if (!partial[i].empty()) scan.line(partial[i]);
    ::close(fds[i]);
  }
  read_metrics();
  res.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (WIFSIGNALED(status)) res.launcher_signal = WTERMSIG(status);
  return res;
}

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
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    std::fwrite(s.data(), 1, s.size(), f);
    std::fclose(f);
  }
}

// One line per failure (who, where, how, and what it cost) and its record in the metrics file.
void report_failure(int failure, int attempt, const LaunchResult& r, const FailureEvidence& ev,
                    const AttemptRecords& at, const GoodputAccount& acct, double hang_timeout_s, int code, bool give_up,
                    const std::string& metrics_path) {
  const int64_t lost = acct.steps_lost();
  std::string who = ev.rank >= 0 ? fmt::format("rank {}", ev.rank) : "a rank";
  if (!ev.node.empty()) who += " on " + ev.node;
  std::string how = r.hang_killed     ? fmt::format("hung: no new step for {:g} s (--hang-timeout)", hang_timeout_s)
                    : !ev.how.empty() ? ev.how
                    : r.launcher_signal != 0 ? fmt::format("(unknown: the launcher was killed by signal {}, {})",
                                                           r.launcher_signal, signal_name(r.launcher_signal))
                                             : "(unknown: no rank named in the launch's output)";
  say("failure {} (launch {}): {} {}; exit code {}; last step recorded {}, last committed checkpoint {}, {} "
      "step{} lost{}",
      failure, attempt, who, how, code, at.last_step >= 0 ? std::to_string(at.last_step) : "none",
      acct.last_committed() >= 0 ? std::to_string(acct.last_committed()) : "none", lost, lost == 1 ? "" : "s",
      at.last_record_t > 0 && at.exit_t > at.last_record_t
          ? fmt::format(" ({:.1f} s since the last record)", at.exit_t - at.last_record_t)
          : "");
  nlohmann::json rec = {{"event", "failure"},
                        {"attempt", attempt},
                        {"rank", ev.rank},
                        {"node", ev.node},
                        {"signal", ev.signal},
                        {"rank_exit_code", ev.rank_exit},
                        {"exit_code", code},
                        {"how", how},
                        {"hang", r.hang_killed},
                        {"last_step", at.last_step},
                        {"last_committed", acct.last_committed()},
                        {"steps_lost", lost},
                        {"time", now_unix()},
                        {"action", give_up ? "give up" : "relaunch"}};
  append_record(metrics_path, rec);
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
std::string launch_metrics_path(const SuperviseArgs& a) {
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

int run_supervise(const SuperviseArgs& a) {
  const double t0 = now_unix();
  if (a.launch.empty()) {
    std::fprintf(stderr, "meshtrain supervise: no launch command (meshtrain supervise [OPTIONS] -- mpirun ...)\n");
    return 2;
  }
  const std::string metrics_path = launch_metrics_path(a);
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) std::signal(s, on_supervisor_signal);
  std::signal(SIGPIPE, SIG_IGN);

  GoodputAccount acct;
  std::optional<FileTail> metrics;
  if (!metrics_path.empty()) metrics.emplace(metrics_path, /*from_end=*/true);
  std::map<std::string, int> node_failures;
  std::set<std::string> excluded;
  const std::string launcher = std::filesystem::path(a.launch[0]).filename();
  int restarts = 0, consecutive = 0, code = 0;
  int64_t best_step = -1;
  double waited = 0;
  for (int attempt = 1;; ++attempt) {
    const std::vector<std::string> argv = attempt_argv(a.launch, launcher, excluded);
    say("launch {} of at most {}: {}", attempt, a.max_restarts + 1, join(argv));
    acct.begin_attempt(now_unix(), waited);
    OutputScanner scan(acct);
    LaunchResult r = run_launch(argv, metrics ? &*metrics : nullptr, acct, scan, a.hang_timeout_s);
    code = r.code;
    // A launch that finished, or stopped on a signal after its checkpoint, did not fail.
    const bool stopped = r.forwarded || code == 0 || code == 128 + SIGTERM || code == 128 + SIGUSR1 ||
                         code == 128 + SIGINT;
    acct.end_attempt(now_unix(), !stopped);
    const AttemptRecords& at = acct.current();
    if (r.forwarded) {
      if (code != 0) code = 128 + r.forwarded;  // mpirun reports 1 after its ranks stopped on a forwarded SIGTERM
      say("launch {} stopped on {} ({}): exit code {}, not relaunched", attempt, r.forwarded,
          signal_name(r.forwarded), code);
      break;
    }
    if (code == 0) {
      say("launch {} finished (exit code 0){}", attempt,
          at.last_step >= 0 ? fmt::format(" at step {}", at.last_step) : "");
      break;
    }
    if (code == 128 + SIGTERM || code == 128 + SIGUSR1 || code == 128 + SIGINT) {
      say("launch {} exited {}: its ranks stopped on signal {} ({}) after a checkpoint (a preemption): passed on, "
          "not relaunched",
          attempt, code, code - 128, signal_name(code - 128));
      break;
    }
    const FailureEvidence& ev = scan.ev;
    if (code == 2) {
      say("launch {} exited 2 (a command-line error): not relaunched", attempt);
      break;
    }
    const bool launcher_killed = r.launcher_signal != 0;
    if (!ev.rank_failure() && !r.hang_killed && !launcher_killed && at.steps_recorded == 0) {
      say("launch {} failed with exit code {} before its first step, with no rank killed, stopped or timed out: an "
          "error that a relaunch would repeat (the config, the data, the command line?): not relaunched",
          attempt, code);
      break;
    }
    const bool give_up = restarts >= a.max_restarts;
    report_failure(restarts + 1, attempt, r, scan.ev, at, acct, a.hang_timeout_s, code, give_up, metrics_path);
    if (!ev.node.empty() && ++node_failures[ev.node] >= a.exclude_after && a.exclude_after > 0 &&
        launcher == "srun" && !excluded.count(ev.node)) {
      excluded.insert(ev.node);
      say("node {} failed {} times (--exclude-after {}): the next launches leave it out", ev.node,
          node_failures[ev.node], a.exclude_after);
    }
    if (give_up) {
      say("giving up: {} relaunch{} (--max-restarts {}) used; the last launch exited {}", restarts,
          restarts == 1 ? "" : "es", a.max_restarts, code);
      break;
    }
    // The back-off: doubled per failure in a row without progress; progress (a step beyond any before) resets it.
    const bool progress = at.last_step > best_step;
    best_step = std::max(best_step, at.last_step);
    consecutive = progress ? 1 : consecutive + 1;
    waited = std::min(a.backoff_max_s, a.backoff_s * double(1LL << std::min(consecutive - 1, 20)));
    ++restarts;
    say("relaunch {} of {} in {:g} s{}", restarts, a.max_restarts, waited,
        progress ? "" : fmt::format(" ({} failures in a row without progress)", consecutive));
    const double until = now_unix() + waited;
    int sig = 0;
    while (now_unix() < until && !(sig = g_signal.load())) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (sig) {
      code = 128 + sig;
      say("received {} ({}) while waiting to relaunch: not relaunched, exit code {}", sig, signal_name(sig), code);
      acct.add_wait(now_unix() - (until - waited));  // the wait so far, as restart time
      break;
    }
  }
  if (metrics) {
    GoodputParts p = acct.parts(now_unix() - t0);
    say("{}", goodput_line(p));
    append_record(metrics_path, goodput_record(p));
  }
  return code;
}

}  // namespace

Command supervise_command() {
  return command_with<SuperviseArgs>(
      "supervise",
      "run a launch (after --: mpirun ... meshtrain ... train) and relaunch it from its newest checkpoint when a rank "
      "dies or hangs; goodput at the end; no config, no MPI",
      add_supervise_options, [](RunContext&, const SuperviseArgs& a) { return run_supervise(a); },
      /*needs_config=*/false, /*needs_mpi=*/false);
}

}  // namespace mt
