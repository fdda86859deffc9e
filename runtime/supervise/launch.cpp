#include "runtime/supervise/launch.h"

#include <sys/stat.h>
#include <fstream>
#include <cctype>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

namespace mt::supervisor {

namespace {
std::atomic<int> g_signal{0};
extern "C" void on_supervisor_signal(int sig) { g_signal = sig; }

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= size_t(w);
  }
}

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

// Whether the process is an MPI rank: Open MPI gives each OMPI_COMM_WORLD_RANK (mpirun and its helpers have none).
bool is_mpi_rank(pid_t pid) {
  FILE* f = std::fopen(fmt::format("/proc/{}/environ", pid).c_str(), "r");
  if (!f) return false;
  std::string env;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) env.append(buf, n);
  std::fclose(f);
  const std::string key = "OMPI_COMM_WORLD_RANK=";
  return env.rfind(key, 0) == 0 || env.find('\0' + key) != std::string::npos;
}

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

// Starts the launcher in a process group of its own (a hang kill reaches all it started), its stdout and stderr
// into pipes whose read ends go to fds. Returns its pid.
//
// The launch dies with the supervisor: a supervisor killed with SIGKILL passes nothing on, and a launch that prints
// nothing would never notice (only a write to its closed pipe would end it), so the launcher gets SIGTERM when the
// supervisor dies (Linux's parent-death signal, kept across exec), which mpirun and srun pass on to their ranks
// (Open MPI's mpirun then kills them, within about 2 s). The signal follows the thread that forked: the supervisor's
// one thread. A supervisor that died between fork and prctl is caught by the check of the parent's pid after it.
pid_t start_launcher(const std::vector<std::string>& argv, int fds[2]) {
  int out_pipe[2], err_pipe[2];
  if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) throw std::runtime_error("pipe failed");
  const pid_t supervisor = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
      std::fprintf(stderr, "meshtrain supervise: prctl(PR_SET_PDEATHSIG) failed: %s\n", std::strerror(errno));
      std::_Exit(127);
    }
    if (::getppid() != supervisor) std::_Exit(128 + SIGTERM);  // the supervisor is gone already
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
  fds[0] = out_pipe[0];
  fds[1] = err_pipe[0];
  return pid;
}

// A launch in flight: what run() follows from one 100 ms round to the next.
class Launch {
 public:
  Launch(const std::vector<std::string>& argv, FileTail* metrics, GoodputAccount& acct, OutputScanner& scan,
         double hang_timeout_s)
      : metrics_(metrics), acct_(acct), scan_(scan), hang_timeout_s_(hang_timeout_s) {
    pid_ = start_launcher(argv, fds_);
  }

  LaunchResult run() {
    while (true) {
      pump_output(fds_, open_fd_, partial_, scan_);
      // The failure's first sight: the step in flight is lost until then at most, the rest is detection.
      if (scan_.ev.level > 0 || scan_.launcher_aborting) acct_.failure_seen(now_unix());
      if (!exited_ && !ranks_ended_ && scan_.launcher_aborting && forwarded_.empty() && !scan_.ev.stopped_by_signal)
        end_ranks();
      const double t = now_unix();
      if (int sig = take_stop_signal(); sig != 0 && !exited_) forward(sig);
      if (t - last_metrics_read_ >= 0.1) read_metrics();
      if (!exited_ && hang_timeout_s_ > 0 && steps_seen_ > 0 && t - last_step_t_ > hang_timeout_s_ &&
          !res_.hang_killed)
        kill_hung(t);
      if (!exited_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) {
        exited_ = true;
        exit_seen_ = t;
      }
      // After the exit, what is left in the pipes; a process that inherited them and lives on is not waited for.
      if (exited_ && ((!open_fd_[0] && !open_fd_[1]) || t - exit_seen_ > 3)) break;
    }
    for (int i = 0; i < 2; ++i) {
      if (!partial_[i].empty()) scan_.line(partial_[i]);
      ::close(fds_[i]);
    }
    read_metrics();
    res_.code = WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
    if (WIFSIGNALED(status_)) res_.launcher_signal = WTERMSIG(status_);
    return res_;
  }

 private:
  void read_metrics() {
    if (!metrics_) return;
    const double t = now_unix();
    last_metrics_read_ = t;
    for (const std::string& l : metrics_->read_lines()) {
      nlohmann::json r = nlohmann::json::parse(l, nullptr, false);
      if (r.is_discarded()) continue;
      acct_.add_record(r, t);
      if (r.contains("loss") && r.contains("step")) {
        ++steps_seen_;
        last_step_t_ = t;
      }
    }
  }

  // Once per signal: Open MPI's mpirun kills its ranks at once on a second SIGTERM, before their checkpoint (a
  // signal may reach the supervisor twice: from `timeout`, from Slurm signalling every process of the job). A second
  // Ctrl-C is passed on: the user asks to stop now.
  void forward(int sig) {
    if (forwarded_.count(sig) && sig != SIGINT) {
      say("received {} ({}) again: already passed on, the ranks are stopping", sig, signal_name(sig));
      return;
    }
    // SIGTERM goes on as SIGUSR1, which the ranks treat alike (checkpoint, stop): Open MPI's mpirun, given
    // SIGTERM, terminates its ranks itself shortly after passing it on, before a loaded rank has saved;
    // SIGUSR1 it only forwards (srun forwards both).
    const int pass = sig == SIGTERM ? SIGUSR1 : sig;
    say("received {} ({}): passing it to the launch (pid {}){}; its ranks checkpoint and stop, and there is no "
        "relaunch",
        sig, signal_name(sig), pid_, pass != sig ? " as SIGUSR1" : "");
    ::kill(pid_, pass);
    forwarded_.insert(sig);
    res_.forwarded = sig;
  }

  // Open MPI's mpirun says at once that a rank failed ("... returned a non-zero exit code. Per user-direction, the
  // job has been aborted") but gives the others SIGTERM and SIGKILL only after a grace (odls_base_sigkill_timeout:
  // 2 s here), which meshtrain's ranks sit out: they catch SIGTERM (to checkpoint at a step boundary) while blocked
  // in a collective on the dead rank. So the ranks are killed at that line; mpirun still reports the failed rank
  // (the first to end) and exits at once. Not after a stop signal passed on: the ranks exit 128 + N by themselves.
  void end_ranks() {
    ranks_ended_ = true;
    int n = 0;
    for (pid_t d : descendants(pid_))
      if (is_mpi_rank(d) && ::kill(d, SIGKILL) == 0) ++n;
    say("the launcher reports a failed rank and aborts the job: its ranks ended now ({} process{}), not after its "
        "grace",
        n, n == 1 ? "" : "es");
  }

  void kill_hung(double t) {
    say("no new step in the metrics for {:.0f} s (--hang-timeout): the launch hangs; killing it", t - last_step_t_);
    res_.hang_killed = true;
    acct_.failure_seen(t);
    std::vector<pid_t> all = descendants(pid_);
    ::kill(-pid_, SIGKILL);
    for (pid_t d : all) ::kill(d, SIGKILL);
  }

  FileTail* metrics_;
  GoodputAccount& acct_;
  OutputScanner& scan_;
  const double hang_timeout_s_;
  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string partial_[2];
  bool open_fd_[2] = {true, true};
  bool exited_ = false, ranks_ended_ = false;
  int status_ = 0;
  double exit_seen_ = 0, last_step_t_ = -1, last_metrics_read_ = 0;
  int64_t steps_seen_ = 0;
  std::set<int> forwarded_;
  LaunchResult res_;
};
}  // namespace

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string signal_name(int sig) {
  const char* s = strsignal(sig);
  return s ? s : fmt::format("signal {}", sig);
}

void catch_stop_signals() {
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) std::signal(s, on_supervisor_signal);
  std::signal(SIGPIPE, SIG_IGN);
}

int pending_stop_signal() { return g_signal.load(); }
int take_stop_signal() { return g_signal.exchange(0); }

LaunchResult run_launch(const std::vector<std::string>& argv, FileTail* metrics, GoodputAccount& acct,
                        OutputScanner& scan, double hang_timeout_s) {
  return Launch(argv, metrics, acct, scan, hang_timeout_s).run();
}

std::string mpi_shm_dir() {
  for (const char* var : {"OMPI_MCA_btl_vader_backing_directory", "OMPI_MCA_btl_sm_backing_directory"})
    if (const char* d = std::getenv(var); d && *d) return d;
  return "/dev/shm";
}

int remove_mpi_shm_leftovers(double since_unix, const std::string& where) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string dir = fs::weakly_canonical(where, ec).string();
  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("vader_segment.", 0) != 0 && name.rfind("sm_segment.", 0) != 0) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) != 0 || st.st_uid != ::getuid()) continue;
    if (double(st.st_mtim.tv_sec) + 1e-9 * double(st.st_mtim.tv_nsec) < since_unix - 1) continue;
    found.push_back(e.path());
  }
  if (found.empty()) return 0;
  // What live processes map (the maps of processes of other users cannot be read: their files are not ours).
  auto mapped_now = [&] {
    std::set<std::string> mapped;
    for (const auto& p : fs::directory_iterator("/proc", ec)) {
      const std::string pid = p.path().filename().string();
      if (pid.empty() || !std::isdigit(static_cast<unsigned char>(pid[0]))) continue;
      std::ifstream maps(p.path() / "maps");
      std::string line;
      while (std::getline(maps, line)) {
        const size_t at = line.find(dir + "/");
        if (at != std::string::npos) mapped.insert(line.substr(at, line.find(" (deleted)", at) - at));
      }
    }
    return mapped;
  };
  // Called once the launch's output pipes closed (its ranks, which hold them, are gone) or 3 s after the
  // launcher's exit: a rank still mapping its file then stays, as another job's does.
  const std::set<std::string> mapped = mapped_now();
  int n = 0;
  for (const fs::path& f : found)
    if (!mapped.count(f.string()) && fs::remove(f, ec)) ++n;
  return n;
}

}  // namespace mt::supervisor
