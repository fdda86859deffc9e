// What the watchdog's files share (private to comm/watchdog*.cpp): the registry of pending operations and its
// lock (watchdog.cpp), the "where are you" protocol between ranks and the abort notice (watchdog_peers.cpp), and the
// search for the rank that holds the others up (watchdog_culprit.cpp).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mt::watchdog_detail {

using Clock = std::chrono::steady_clock;

// Tag of the notice a rank that aborts the job sends to every other rank first.
constexpr int kAbortNoticeTag = 7191;
// At a timeout with no better detail, the waiting rank asks the group's other
// ranks where they are; live ones answer from their watchdog thread.
constexpr int kQueryTag = 7192, kReplyTag = 7193, kReplyLen = 1024;
constexpr double kQueryWait_s = 1.0;
// Ranks whose state a reply or a chain search lists at most (the chain search stops there too).
constexpr size_t kMaxRanks = 64, kMaxQueried = 1024;

struct Pending {
  std::string op;
  std::string group;
  Clock::time_point start;
  std::function<bool()> done;
  std::function<std::string()> detail;
  double suspended_s = 0;  // time this process was suspended while the operation waited
  std::vector<int> ranks;  // world ranks of the group; empty: the world
  double grace_s = 0;      // waited beyond the timeout before this rank fires (watchdog_begin's grace_s)
  std::string phase;       // what the thread that began it was doing (WatchdogPhase)
  // An async operation issued and not yet waited for does not block this rank (MPI may well have completed it):
  // it neither times out nor counts as where this rank is until wait() starts (watchdog_async/watchdog_waiting).
  bool waited = true;
  // The culprit search runs before the timeout (kQueryWait_s ahead), so that its wait for ranks that do not answer
  // ends when the timeout does: searched once begun; silent_why what it found when a rank did not answer.
  bool searched = false;
  std::string silent_why;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Pending> pending;
  std::vector<std::function<void()>> abort_hooks;
  uint64_t next_id = 1;
  double timeout_s = 600;
  bool stop = false;
  bool finalizing = false;  // MPI may no longer be called
  bool mpi_up = false;      // MPI_Init has returned
  bool in_mpi = false;      // the watchdog thread is inside an MPI call
  std::thread thread;
};

// The one registry of this process (watchdog.cpp).
State& state();
// MPI is initialised and not finalizing: the watchdog may call it.
bool mpi_usable();
// "rank R (host H)", or the pid before MPI_Init.
std::string rank_str();
// "in OP on GROUP[ while PHASE] for S s": a pending operation as the timeout message and the answers name it.
std::string describe_pending(const Pending& p, Clock::time_point now);

// A peer's answer to "where are you": waiting (in which calls, on which world ranks), in no collective, or no
// answer at all (stopped or dead).
struct Answer {
  bool answered = false, waiting = false, all = false;  // all: waits on the whole world
  std::vector<int> on;
  std::string text;
};

// The protocol between ranks (watchdog_peers.cpp).
// Answers the "where are you" queries of peers that timed out; called from the watchdog thread's every tick.
void answer_queries();
// Asks these ranks where they are and waits up to kQueryWait_s: a rank that does not answer is stopped or dead.
std::vector<Answer> query(const std::vector<int>& ranks);
// Tells every other rank that this one aborts the job, so that a rank resumed later blames no one.
void send_abort_notice();
// After a suspension: leaves, saying so, if a peer aborted the job meanwhile.
void check_abort_notice(double suspended_s);

// At a timeout: the ranks that hold this operation up, named (watchdog_culprit.cpp). found: a culprit was found;
// silent (if given): one that did not answer, which stays true of a stopped rank until the timeout.
std::string find_culprit(const Pending& p, bool* found, bool* silent = nullptr);

}  // namespace mt::watchdog_detail
