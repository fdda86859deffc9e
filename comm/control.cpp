#include "comm/control.h"

#include "runtime/core/trace.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/watchdog.h"
#include "runtime/core/error.h"
#include "runtime/core/fault.h"

namespace mt {

namespace {

constexpr int kMarkerTag = 7190;
constexpr int kAllPairsUpTo = 64;  // above: markers only to and from the communicator's rank 0
constexpr int kLabelLen = 64;

struct Label {
  char text[kLabelLen] = {};
};

// What one rank knows, while it waits, of which peers reached the call.
struct Arrivals {
  std::mutex mu;
  std::vector<int> peers;  // communicator ranks markers come from
  std::vector<int> world;  // their world ranks
  std::vector<char> arrived;
  std::vector<Label> inbox;  // each peer's label, valid once arrived
  Label mine;
  bool partial = false;  // only rank 0 hears from everyone

  std::string describe() {
    std::lock_guard lock(mu);
    std::vector<int> missing;
    for (size_t i = 0; i < peers.size(); ++i)
      if (!arrived[i]) missing.push_back(world[i]);
    if (!missing.empty()) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 32; ++i) list += (i ? "," : "") + std::to_string(missing[i]);
      if (missing.size() > 32) list += fmt::format(" and {} more", missing.size() - 32);
      std::string who = partial ? fmt::format("world rank {} (which tracks the others) ", list)
                                : fmt::format("world rank{} {} ", missing.size() > 1 ? "s" : "", list);
      return who + "did not arrive (stopped, dead or stuck before this call)";
    }
    if (partial)
      return fmt::format("world rank {} arrived; with more than {} ranks only it knows who did not",
                         world.empty() ? 0 : world[0], kAllPairsUpTo);
    return "every peer arrived, so one stopped or died inside the call, or this rank came late and the peers have "
           "aborted already";
  }
};

std::string world_where(MPI_Comm comm) {
  int n = 1;
  MPI_Comm_size(comm, &n);
  return fmt::format("the world ({} ranks)", n);
}

// Runs one non-blocking collective (started by `start`) under the watchdog,
// with arrival markers exchanged beside it.
void run_control(MPI_Comm comm, std::string_view label, const std::string& where,
                 const std::function<int(MPI_Request*)>& start, double extra_wait_s = 0) {
  fault_stop_point(label);
  int n = 1, me = 0;
  MPI_Comm_size(comm, &n);
  MPI_Comm_rank(comm, &me);
  auto st = std::make_shared<Arrivals>();
  std::snprintf(st->mine.text, kLabelLen, "%.*s", int(std::min<size_t>(label.size(), kLabelLen - 1)), label.data());
  st->partial = n > kAllPairsUpTo && me != 0;
  for (int r = 0; r < n; ++r)
    if (r != me && (n <= kAllPairsUpTo || me == 0 || r == 0)) st->peers.push_back(r);
  size_t np = st->peers.size();
  st->arrived.assign(np, 0);
  st->inbox.resize(np);
  st->world.resize(np);
  if (np) {
    MPI_Group g, w;
    MPI_Comm_group(comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &w);
    MPI_Group_translate_ranks(g, int(np), st->peers.data(), w, st->world.data());
    MPI_Group_free(&g);
    MPI_Group_free(&w);
  }

  // reqs: [0, np) marker receives, [np, 2 np) marker sends, 2 np: the collective.
  std::vector<MPI_Request> reqs(2 * np + 1, MPI_REQUEST_NULL);
  for (size_t i = 0; i < np; ++i)
    MT_MPI_CHECK(MPI_Irecv(st->inbox[i].text, kLabelLen, MPI_CHAR, st->peers[i], kMarkerTag, comm, &reqs[i]));
  for (size_t i = 0; i < np; ++i)
    MT_MPI_CHECK(MPI_Isend(st->mine.text, kLabelLen, MPI_CHAR, st->peers[i], kMarkerTag, comm, &reqs[np + i]));
  MT_MPI_CHECK(start(&reqs[2 * np]));
  // Above kAllPairsUpTo ranks only rank 0 hears from everyone: the others give it a few seconds more to abort first
  // and name the missing ranks (they still fire, naming rank 0, when rank 0 is the one missing).
  const double grace =
      (st->partial ? std::min(10.0, 0.25 * std::max(watchdog_timeout(), 0.0)) : 0.0) + std::max(extra_wait_s, 0.0);
  uint64_t id = watchdog_begin(std::string(label), where.empty() ? world_where(comm) : where, {},
                               [st] { return st->describe(); }, grace);
  std::vector<int> ranks = st->world;
  ranks.push_back(process_rank());
  watchdog_set_ranks(id, std::move(ranks));
  // The trace's "control" span (trace.h): from the markers' start to the end of the wait.
  struct End {
    uint64_t id;
    std::string_view label;
    int64_t t0;
    ~End() {
      watchdog_end(id);
      if (t0 >= 0) trace::complete(std::string(label), "control", t0, trace::now_ns());
    }
  } end{id, label, trace::on() ? trace::now_ns() : -1};

  // Done when the collective is and every marker has gone both ways.
  std::vector<int> idx(reqs.size());
  int left = int(reqs.size()), spins = 0;
  while (left > 0) {
    int got = 0;
    MT_MPI_CHECK(MPI_Testsome(int(reqs.size()), reqs.data(), &got, idx.data(), MPI_STATUSES_IGNORE));
    if (got == MPI_UNDEFINED) break;
    for (int k = 0; k < got; ++k) {
      size_t i = size_t(idx[size_t(k)]);
      if (i >= np) continue;
      std::lock_guard lock(st->mu);
      st->arrived[i] = 1;
      Label& l = st->inbox[i];
      l.text[kLabelLen - 1] = '\0';
      if (std::strcmp(l.text, st->mine.text) != 0) {
        (void)new std::shared_ptr<Arrivals>(st);  // MPI may still write into its buffers: never freed
        fail("comm", "world rank {} is in '{}' while this rank is in '{}' on {}: the ranks took different paths",
             st->world[i], l.text, st->mine.text, where.empty() ? world_where(comm) : where);
      }
    }
    left -= got;
    if (left == 0) break;
    if (got == 0 && ++spins > 50) std::this_thread::sleep_for(std::chrono::microseconds(std::min(spins, 1000)));
  }
}

}  // namespace

void control_barrier(MPI_Comm comm, std::string_view label, const std::string& where, double extra_wait_s) {
  run_control(comm, label, where, [&](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, extra_wait_s);
}

void control_all_reduce(MPI_Comm comm, void* buf, int count, MPI_Datatype type, MPI_Op op, std::string_view label,
                        const std::string& where) {
  run_control(comm, label, where,
              [&](MPI_Request* r) { return MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, comm, r); });
}

template <class T>
void control_all_reduce(MPI_Comm comm, std::span<T> values, ReduceOp op, std::string_view label,
                        const std::string& where) {
  static_assert(world::Reducible<T>);
  MT_CHECK(values.size() <= size_t(INT_MAX), "comm", "'{}': {} values exceed MPI's int count", label, values.size());
  const MPI_Datatype type = std::is_same_v<T, int>       ? MPI_INT
                            : std::is_same_v<T, int64_t> ? MPI_INT64_T
                            : std::is_same_v<T, uint64_t> ? MPI_UINT64_T
                                                          : MPI_DOUBLE;
  const MPI_Op mop = op == ReduceOp::max ? MPI_MAX : op == ReduceOp::min ? MPI_MIN : MPI_SUM;
  control_all_reduce(comm, values.data(), int(values.size()), type, mop, label, where);
  if (op != ReduceOp::avg) return;
  int n = 1;
  MPI_Comm_size(comm, &n);
  for (T& v : values) v /= T(n);
}
template void control_all_reduce(MPI_Comm, std::span<int>, ReduceOp, std::string_view, const std::string&);
template void control_all_reduce(MPI_Comm, std::span<int64_t>, ReduceOp, std::string_view, const std::string&);
template void control_all_reduce(MPI_Comm, std::span<uint64_t>, ReduceOp, std::string_view, const std::string&);
template void control_all_reduce(MPI_Comm, std::span<double>, ReduceOp, std::string_view, const std::string&);

void control_all_gather(MPI_Comm comm, void* out, const void* in, int count, MPI_Datatype type, std::string_view label,
                        const std::string& where) {
  run_control(comm, label, where,
              [&](MPI_Request* r) { return MPI_Iallgather(in, count, type, out, count, type, comm, r); });
}

void control_broadcast(MPI_Comm comm, void* buf, int count, MPI_Datatype type, int root, std::string_view label,
                       const std::string& where) {
  run_control(comm, label, where, [&](MPI_Request* r) { return MPI_Ibcast(buf, count, type, root, comm, r); });
}

void control_gather(MPI_Comm comm, void* out, const void* in, int count, MPI_Datatype type, int root,
                    std::string_view label, const std::string& where) {
  run_control(comm, label, where,
              [&](MPI_Request* r) { return MPI_Igather(in, count, type, out, count, type, root, comm, r); });
}

ClockSync control_clock_sync(MPI_Comm comm, int rounds) {
  int n = 1, me = 0;
  MPI_Comm_size(comm, &n);
  MPI_Comm_rank(comm, &me);
  control_barrier(comm, "clock sync");
  ClockSync r;
  constexpr int kClockTag = 7342;
  {
    WatchdogScope watch("clock sync", world_where(comm));
    if (me == 0) {
      for (int peer = 1; peer < n; ++peer)
        for (int k = 0; k < rounds; ++k) {
          int64_t t = 0;
          MT_MPI_CHECK(MPI_Recv(&t, 1, MPI_INT64_T, peer, kClockTag, comm, MPI_STATUS_IGNORE));
          t = trace::now_ns();
          MT_MPI_CHECK(MPI_Send(&t, 1, MPI_INT64_T, peer, kClockTag, comm));
        }
    } else {
      r.rtt_ns = -1;
      for (int k = 0; k < rounds; ++k) {
        int64_t t0 = trace::now_ns(), t_root = 0;
        MT_MPI_CHECK(MPI_Send(&t0, 1, MPI_INT64_T, 0, kClockTag, comm));
        MT_MPI_CHECK(MPI_Recv(&t_root, 1, MPI_INT64_T, 0, kClockTag, comm, MPI_STATUS_IGNORE));
        const int64_t t1 = trace::now_ns();
        if (r.rtt_ns < 0 || t1 - t0 < r.rtt_ns) r.rtt_ns = t1 - t0, r.offset_ns = t_root - (t0 + (t1 - t0) / 2);
      }
    }
  }
  r.zero_ns = me == 0 ? trace::now_ns() : 0;
  control_broadcast(comm, &r.zero_ns, 1, MPI_INT64_T, 0, "clock sync zero");
  return r;
}

}  // namespace mt
