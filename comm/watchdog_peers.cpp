// The watchdog's conversation between ranks, all on MPI_COMM_WORLD under tags of its own: a rank that times out
// asks its peers where they are and each live one answers from its watchdog thread; a rank that aborts the job
// first sends every other rank a notice, so that a rank resumed from a suspension knows it was the late one.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "comm/watchdog_internal.h"
#include "runtime/core/error.h"

namespace mt::watchdog_detail {

namespace {
// An answer is sent as text: "W <ranks or *>|<description>" or "N|in no collective".
Answer parse_answer(const char* text) {
  Answer a;
  a.answered = true;
  std::string t(text);
  size_t bar = t.find('|');
  a.text = bar == std::string::npos ? t : t.substr(bar + 1);
  if (t.rfind("W ", 0) != 0 || bar == std::string::npos) return a;
  a.waiting = true;
  std::string list = t.substr(2, bar - 2);
  if (list == "*") a.all = true;
  for (size_t i = 0; i < list.size();) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    if (j > i && list[i] != '*') a.on.push_back(std::atoi(list.substr(i, j - i).c_str()));
    i = j + 1;
  }
  return a;
}

// This rank's answer: every pending operation, oldest first, and the union of the ranks they wait on.
std::string my_answer() {
  std::lock_guard lock(state().mu);
  std::vector<const Pending*> ps;
  for (auto& [id, p] : state().pending)
    if (p.waited) ps.push_back(&p);
  if (ps.empty()) return "N|in no collective";
  std::sort(ps.begin(), ps.end(), [](auto* a, auto* b) { return a->start < b->start; });
  auto now = Clock::now();
  bool all = false;
  std::vector<int> on;
  for (auto* p : ps) {
    if (p->ranks.empty()) all = true;
    for (int r : p->ranks)
      if (r != process_rank() && std::find(on.begin(), on.end(), r) == on.end()) on.push_back(r);
  }
  std::string list;
  if (all || on.size() > kMaxRanks) list = "*";
  else
    for (int r : on) list += (list.empty() ? "" : ",") + std::to_string(r);
  std::string text = describe_pending(*ps[0], now);
  for (size_t i = 1; i < ps.size(); ++i) {
    std::string more = fmt::format("; also {}", describe_pending(*ps[i], now));
    if (text.size() + more.size() > size_t(kReplyLen) - 80) {
      text += fmt::format("; and {} more", ps.size() - i);
      break;
    }
    text += more;
  }
  return fmt::format("W {}|{}", list, text);
}

// A peer aborted the job while this rank was searching: it has printed the report, so this one stays silent.
void leave_if_reported() {
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
  std::this_thread::sleep_for(std::chrono::seconds(3));  // its MPI_Abort ends this process first
  std::_Exit(124);
}
}  // namespace

// Sends are kept until they complete.
void answer_queries() {
  struct Reply {
    MPI_Request req;
    char text[kReplyLen];
  };
  static std::vector<std::unique_ptr<Reply>> replies;
  for (auto it = replies.begin(); it != replies.end();) {
    int done = 0;
    MPI_Test(&(*it)->req, &done, MPI_STATUS_IGNORE);
    it = done ? replies.erase(it) : it + 1;
  }
  for (;;) {
    int flag = 0, dummy = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
    MPI_Recv(&dummy, 1, MPI_INT, st.MPI_SOURCE, kQueryTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    auto r = std::make_unique<Reply>();
    std::snprintf(r->text, kReplyLen, "%s", my_answer().c_str());
    if (MPI_Isend(r->text, kReplyLen, MPI_CHAR, st.MPI_SOURCE, kReplyTag, MPI_COMM_WORLD, &r->req) == MPI_SUCCESS)
      replies.push_back(std::move(r));
  }
}

// Unanswered requests are left pending: the job is about to abort.
std::vector<Answer> query(const std::vector<int>& ranks) {
  static int q = 0;
  auto buffers = std::make_shared<std::vector<std::array<char, kReplyLen>>>(ranks.size());
  auto& text = *buffers;
  std::vector<MPI_Request> recvs(ranks.size(), MPI_REQUEST_NULL), sends(ranks.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ranks.size(); ++i) {
    MPI_Irecv(text[i].data(), kReplyLen, MPI_CHAR, ranks[i], kReplyTag, MPI_COMM_WORLD, &recvs[i]);
    MPI_Isend(&q, 1, MPI_INT, ranks[i], kQueryTag, MPI_COMM_WORLD, &sends[i]);
  }
  std::vector<Answer> out(ranks.size());
  auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kQueryWait_s));
  size_t got = 0;
  while (got < ranks.size() && Clock::now() < until) {
    answer_queries();  // peers timing out at the same moment ask this rank too
    leave_if_reported();
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (out[i].answered) continue;
      int flag = 0;
      MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
      if (!flag) continue;
      text[i][kReplyLen - 1] = '\0';
      out[i] = parse_answer(text[i].data());
      ++got;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // A late answer (a stopped rank resumed) still lands in these buffers: never freed when one is missing.
  if (got < ranks.size()) (void)new std::shared_ptr<std::vector<std::array<char, kReplyLen>>>(buffers);
  return out;
}

// Bounded to 200 ms, as peers may be stopped or dead.
void send_abort_notice() {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  static int notice = 0;
  notice = me;
  std::vector<MPI_Request> reqs;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    MPI_Request q;
    if (MPI_Isend(&notice, 1, MPI_INT, r, kAbortNoticeTag, MPI_COMM_WORLD, &q) == MPI_SUCCESS) reqs.push_back(q);
  }
  auto until = Clock::now() + std::chrono::milliseconds(200);
  int flag = 0;
  while (!flag && Clock::now() < until) {
    MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Says that this rank was the late one and leaves, rather than time out later blaming the peers.
void check_abort_notice(double suspended_s) {
  if (!mpi_usable()) return;
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, &flag, &st) != MPI_SUCCESS || !flag) return;
  int who = -1;
  MPI_Recv(&who, 1, MPI_INT, st.MPI_SOURCE, kAbortNoticeTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  std::fprintf(stderr,
               "[comm] %s was suspended for %.1f s (SIGSTOP or a paused machine); meanwhile rank %d aborted the job "
               "after a timeout: this rank was the late one, not its peers\n",
               rank_str().c_str(), suspended_s, who);
  std::fflush(stderr);
  std::_Exit(124);
}

}  // namespace mt::watchdog_detail
