// No hangs: every collective registers with the watchdog while it is in
// flight. A thread checks once per 100 ms; an operation older than the
// timeout aborts the whole job after printing which collective, on which
// group, on which rank (NCCL communicators are aborted first, then
// MPI_Abort). A rank that dies makes its peers wait in a collective, so they
// too end within the timeout. The watchdog runs from before MPI_Init to after
// MPI_Finalize. A rank that was itself suspended (SIGSTOP, a paused machine)
// does not count that time as waiting on its peers, and a rank resumed after
// a peer aborted the job says so instead of blaming the peers. Before it
// aborts, the rank that timed out follows the chain of waiting ranks (each
// peer says on which ranks it waits) to the one that is not waiting: the
// stopped, dead or busy rank is what its first line names, never a healthy
// rank that waits on it. (The registry and its thread are in watchdog.cpp, the
// peers' protocol in watchdog_peers.cpp, the chain search in watchdog_culprit.cpp.)
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mt {

class Group;

void watchdog_set_timeout(double seconds);  // <= 0 disables
double watchdog_timeout();
// Called (on the watchdog thread) before MPI_Abort, e.g. ncclCommAbort.
void watchdog_add_abort_hook(std::function<void()> hook);

// Registers an operation; done() is polled when given (async device work),
// otherwise the operation counts as pending until watchdog_end(id).
uint64_t watchdog_begin(std::string op, const Group& group, std::function<bool()> done = {});
// The same for operations that are not on a Group yet (making one is collective too).
uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done = {});
// detail() is called once, at the timeout, and its text replaces the generic
// "a peer is missing" in the message (e.g. which ranks did not arrive). grace_s:
// this rank waits that much longer than the timeout before it fires, so that a
// rank that knows more (the control plane's rank 0 above 64 ranks) aborts first.
uint64_t watchdog_begin(std::string op, std::string where, std::function<bool()> done,
                        std::function<std::string()> detail, double grace_s = 0);
void watchdog_end(uint64_t id);
// The world ranks an operation waits on, when fewer than its group's (a send or receive waits on its peer only).
void watchdog_set_ranks(uint64_t id, std::vector<int> world_ranks);

// An async operation on the host (MPI_I*): issued, it does not block this rank, which may be blocked elsewhere
// while MPI completes it; only once its wait() starts does it count as where this rank waits, and it times out
// when that wait lasts longer than the timeout.
void watchdog_async(uint64_t id);
void watchdog_waiting(uint64_t id);

// What the calling thread is doing, named in the timeout message and in the answers to peers of every operation
// it begins meanwhile (e.g. "saving the checkpoint of step 4"): a stuck collective is reported as part of it.
class WatchdogPhase {
 public:
  explicit WatchdogPhase(std::string text);
  ~WatchdogPhase();
  WatchdogPhase(const WatchdogPhase&) = delete;
  WatchdogPhase& operator=(const WatchdogPhase&) = delete;
};

// RAII form for blocking host-side calls.
class WatchdogScope {
 public:
  WatchdogScope(const char* op, const Group& g) : id_(watchdog_begin(op, g)) {}
  WatchdogScope(const char* op, std::string where) : id_(watchdog_begin(op, std::move(where))) {}
  // Point to point: waits on these world ranks of the group only.
  WatchdogScope(const char* op, const Group& g, std::vector<int> peers) : id_(watchdog_begin(op, g)) {
    watchdog_set_ranks(id_, std::move(peers));
  }
  ~WatchdogScope() { watchdog_end(id_); }
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  uint64_t id_;
};

void watchdog_start();  // idempotent; started by MpiEnv
void watchdog_stop();
// MPI is up (after MPI_Init): the watchdog thread starts answering peers that
// time out and ask where this rank is.
void watchdog_mpi_ready();
// From here on MPI may no longer be called: a timeout exits without MPI_Abort.
void watchdog_mpi_finalizing();

}  // namespace mt
