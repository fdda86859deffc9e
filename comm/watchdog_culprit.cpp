// At a timeout, before it aborts, the watchdog follows the chain of waiting ranks from the operation's peers (each
// waiting peer says on which ranks it waits) to the ranks that are not waiting, the culprits: those that do not
// answer (stopped or dead), else those in no collective. The healthy ranks between are named only as the path, so
// that the first line of a hang names the stopped rank, never a rank that waits on it.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "comm/watchdog_internal.h"

namespace mt::watchdog_detail {

namespace {
std::vector<int> world(int n) {
  std::vector<int> v;
  for (int r = 0; r < n; ++r) v.push_back(r);
  return v;
}

std::string rank_list(const std::vector<int>& r) {
  std::string s;
  for (size_t i = 0; i < r.size() && i < 16; ++i) s += (i ? "," : "") + std::to_string(r[i]);
  if (r.size() > 16) s += fmt::format(" and {} more", r.size() - 16);
  return fmt::format("world rank{} {}", r.size() > 1 ? "s" : "", s);
}

// The ranks this rank waits on: the operation's peers, and those of its other pending operations (a receive beside
// an async collective), itself left out.
std::vector<int> waited_on(const Pending& p, int me, int n) {
  std::vector<int> ranks = p.ranks.empty() ? world(n) : p.ranks;
  {
    std::lock_guard lock(state().mu);
    for (auto& [id, q] : state().pending)
      if (q.waited)
        for (int r : q.ranks.empty() ? world(n) : q.ranks)
          if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
  }
  ranks.erase(std::remove(ranks.begin(), ranks.end(), me), ranks.end());
  return ranks;
}

// The answers of these ranks. A healthy rank between two calls soon waits again: the ones in no collective are
// asked twice more.
std::vector<Answer> ask(const std::vector<int>& ranks) {
  std::vector<Answer> a = query(ranks);
  for (int again = 0; again < 2; ++again) {
    std::vector<size_t> idle;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].answered && !a[i].waiting) idle.push_back(i);
    if (idle.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    std::vector<int> again_ranks;
    for (size_t i : idle) again_ranks.push_back(ranks[i]);
    std::vector<Answer> b = query(again_ranks);
    for (size_t k = 0; k < idle.size(); ++k)
      if (b[k].answered) a[idle[k]] = b[k];
  }
  return a;
}

// What the search learned: each rank asked with its answer, and the waiting rank that led to it (-1: a peer of
// the operation itself).
struct Chain {
  std::map<int, Answer> known;
  std::map<int, int> via;

  // From the operation's peers, level by level (8 at most, kMaxQueried ranks at most), to the ranks that the
  // waiting ones wait on.
  void follow(std::vector<int> frontier, int me, int n) {
    for (int r : frontier) via[r] = -1;
    for (int level = 0; !frontier.empty() && level < 8 && known.size() < kMaxQueried; ++level) {
      std::vector<Answer> a = ask(frontier);
      std::vector<int> next;
      for (size_t i = 0; i < frontier.size(); ++i) {
        known[frontier[i]] = a[i];
        if (!a[i].waiting) continue;
        for (int r : a[i].all ? world(n) : a[i].on)
          if (r != me && r >= 0 && r < n && !via.count(r) && known.size() + next.size() < kMaxQueried) {
            via[r] = frontier[i];
            next.push_back(r);
          }
      }
      frontier = std::move(next);
    }
  }

  // "world rank A (what it does), which waits on world rank B (...)": the waiting ranks that lead to a culprit.
  std::string path(int culprit) {
    std::vector<int> chain;
    for (int r = via[culprit]; r >= 0; r = via[r]) chain.push_back(r);
    std::reverse(chain.begin(), chain.end());
    std::string s;
    for (int r : chain)
      s += fmt::format("{}world rank {} ({})", s.empty() ? "" : ", which waits on ", r, known[r].text);
    return s;
  }

  // The culprits with what they do: the operation's own peers first, then those reached through waiting ranks.
  std::string name(const std::vector<int>& culprits, const std::string& what) {
    std::vector<int> near, far;
    for (int r : culprits) (via[r] < 0 ? near : far).push_back(r);
    std::string s;
    if (!near.empty()) s = fmt::format("{} did not arrive and {}", rank_list(near), what);
    if (!far.empty())
      s += fmt::format("{}{} {}; this rank waits on {} through {}", s.empty() ? "" : "; ", rank_list(far), what,
                       far.size() > 1 ? "them" : "it", path(far[0]));
    return s;
  }
};

// Everyone reached waits: on each other, in the same call (a peer stuck inside it) or in different ones.
std::string all_waiting(const std::map<int, Answer>& known, const std::string& same_prefix, const std::string& tail) {
  std::string calls;
  int shown = 0;
  bool differ = false;
  for (auto& [r, a] : known) {
    if (a.text.rfind(same_prefix, 0) != 0) differ = true;
    if (shown++ < 8) calls += fmt::format("; world rank {} is {}", r, a.text);
  }
  if (differ)
    return "every rank reached waits on another, in different calls (the ranks took different paths)" + calls;
  return "every peer answered from inside this call (a peer stuck inside it?)" + tail;
}
}  // namespace

std::string find_culprit(const Pending& p, bool* found, bool* silent_found) {
  int me = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const std::vector<int> direct = waited_on(p, me, n);
  *found = false;
  if (silent_found) *silent_found = false;
  if (direct.empty()) return "a peer is missing, dead or stuck";
  Chain c;
  c.follow(direct, me, n);
  std::vector<int> silent, idle;
  for (auto& [r, a] : c.known)
    if (!a.answered) silent.push_back(r);
    else if (!a.waiting) idle.push_back(r);
  int same = 0;
  const std::string same_prefix = fmt::format("in {} on {}", p.op, p.group);
  for (int r : direct)
    if (c.known.count(r) && c.known[r].text.rfind(same_prefix, 0) == 0) ++same;
  std::string tail = direct.size() > 1 ? fmt::format(" ({} of {} peers wait in it too)", same, direct.size()) : "";
  if (!silent.empty()) {
    *found = true;
    if (silent_found) *silent_found = true;
    return c.name(silent, fmt::format("did not answer within {:g} s (stopped or dead)", kQueryWait_s)) + tail;
  }
  if (!idle.empty()) {
    *found = true;
    return c.name(idle, "is in no collective (busy, or stuck outside communication)") + tail;
  }
  return all_waiting(c.known, same_prefix, tail);
}

}  // namespace mt::watchdog_detail
