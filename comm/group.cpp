#include "comm/group.h"

#include <algorithm>
#include <numeric>

#include "comm/comm_counters.h"
#include "comm/watchdog.h"
#include "runtime/core/fault.h"

namespace mt {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

ReduceOp reduce_op_from_name(std::string_view s) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
    if (reduce_op_name(op) == s) return op;
  fail("comm", "unknown reduce op '{}' (expected sum, avg, max or min)", s);
}

std::string Group::describe() const {
  std::string r;
  size_t n = std::min<size_t>(world_ranks_.size(), 16);
  for (size_t i = 0; i < n; ++i) r += (i ? "," : "") + std::to_string(world_ranks_[i]);
  if (world_ranks_.size() > n) r += ",...";
  return fmt::format("group '{}' (world ranks {})", name_, r);
}

// ---- The collectives: checks, the count, then the backend ----

namespace {
int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t c : v) s += c;
  return s;
}
int64_t max_of(const std::vector<int64_t>& v) {
  int64_t m = 0;
  for (int64_t c : v) m = std::max(m, c);
  return m;
}
}  // namespace

Work Group::all_reduce(const Tensor& t, ReduceOp op, bool async) {
  // A ring all-reduce sends 2 (n-1)/n of the buffer per rank (reduce-scatter, then all-gather).
  const int64_t bytes = 2 * int64_t(t.nbytes()) * (size() - 1) / size();
  count("all_reduce", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_reduce", bytes, -1, async, t0, do_all_reduce(t, op, async));
}

Work Group::all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async) {
  check_same("all_reduce", out, in);
  check_count("all_reduce", "output", out, in.numel());
  const int64_t bytes = 2 * int64_t(in.nbytes()) * (size() - 1) / size();
  count("all_reduce", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_reduce", bytes, -1, async, t0, do_all_reduce(out, in, op, async));
}

Work Group::do_all_reduce(const Tensor& out, const Tensor& in, ReduceOp op, bool async) {
  copy_(out, in);
  return do_all_reduce(out, op, async);
}

Work Group::all_gather(const Tensor& out, const Tensor& in, bool async) {
  check_same("all_gather", out, in);
  check_count("all_gather", "output", out, in.numel() * size());
  const int64_t bytes = int64_t(in.nbytes()) * (size() - 1);
  count("all_gather", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_gather", bytes, -1, async, t0, do_all_gather(out, in, async));
}

Work Group::all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, bool async) {
  check_same("all_gather_v", out, in);
  check_counts("all_gather_v", counts);
  check_count("all_gather_v", "input", in, counts[size_t(rank())]);
  check_count("all_gather_v", "output", out, sum_of(counts));
  // Counted as the ring's bound: (n-1) of the largest piece (the planner's convention for uneven shards).
  const int64_t bytes = max_of(counts) * int64_t(dtype_size(in.dtype())) * (size() - 1);
  count("all_gather", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_gather", bytes, -1, async, t0, do_all_gather_v(out, in, counts, async));
}

Work Group::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async) {
  check_same("reduce_scatter", out, in);
  check_count("reduce_scatter", "input", in, out.numel() * size());
  const int64_t bytes = int64_t(in.nbytes()) * (size() - 1) / size();
  count("reduce_scatter", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("reduce_scatter", bytes, -1, async, t0, do_reduce_scatter(out, in, op, async));
}

Work Group::reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& counts, ReduceOp op,
                             bool async) {
  check_same("reduce_scatter_v", out, in);
  check_counts("reduce_scatter_v", counts);
  check_count("reduce_scatter_v", "input", in, sum_of(counts));
  check_count("reduce_scatter_v", "output", out, counts[size_t(rank())]);
  const int64_t bytes = int64_t(in.nbytes()) * (size() - 1) / size();
  count("reduce_scatter", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("reduce_scatter", bytes, -1, async, t0, do_reduce_scatter_v(out, in, counts, op, async));
}

Work Group::all_to_all(const Tensor& out, const Tensor& in, bool async) {
  check_same("all_to_all", out, in);
  check_count("all_to_all", "output", out, in.numel());
  MT_CHECK(in.numel() % size() == 0, "comm", "all_to_all on {}: {} elements do not split into {} equal chunks",
           describe(), in.numel(), size());
  const int64_t bytes = int64_t(in.nbytes()) * (size() - 1) / size();
  count("all_to_all", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_to_all", bytes, -1, async, t0, do_all_to_all(out, in, async));
}

Work Group::all_to_all_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& send_counts,
                         const std::vector<int64_t>& recv_counts, bool async) {
  check_same("all_to_all_v", out, in);
  check_counts("all_to_all_v", send_counts);
  check_counts("all_to_all_v", recv_counts);
  check_count("all_to_all_v", "input", in, sum_of(send_counts));
  check_count("all_to_all_v", "output", out, sum_of(recv_counts));
  // What this rank sends to the others (its own block stays): exact for uneven counts.
  const int64_t bytes = (sum_of(send_counts) - send_counts[size_t(rank())]) * int64_t(dtype_size(in.dtype()));
  count("all_to_all", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("all_to_all", bytes, -1, async, t0, do_all_to_all_v(out, in, send_counts, recv_counts, async));
}

Work Group::broadcast(const Tensor& t, int root, bool async) {
  MT_CHECK(root >= 0 && root < size(), "comm", "broadcast on {}: root {} is not a rank of a group of {}", describe(),
           root, size());
  const int64_t bytes = rank() == root ? int64_t(t.nbytes()) : 0;
  count("broadcast", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("broadcast", bytes, -1, async, t0, do_broadcast(t, root, async));
}

Work Group::send(const Tensor& t, int peer, bool async, int tag, const std::string& what) {
  check_peer("send", peer);
  MT_CHECK(tag >= 0, "comm", "send on {}: negative tag {}", describe(), tag);
  const int64_t bytes = int64_t(t.nbytes());
  count("send", bytes);
  if (fault_stop_armed()) fault_stop_point(fmt::format("send on group '{}'", name()));  // the stuck-rank drills
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("send", bytes, peer, async, t0, do_send(t, peer, async, tag, what));
}

Work Group::recv(const Tensor& t, int peer, bool async, int tag, const std::string& what) {
  check_peer("recv", peer);
  MT_CHECK(tag >= 0, "comm", "recv on {}: negative tag {}", describe(), tag);
  const int64_t bytes = 0;
  count("recv", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("recv", bytes, peer, async, t0, do_recv(t, peer, async, tag, what));
}

Work Group::ring_shift(const Tensor& out, const Tensor& in, int shift, bool async) {
  check_same("ring_shift", out, in);
  check_count("ring_shift", "output", out, in.numel());
  const int64_t bytes = int64_t(in.nbytes());
  count("ring_shift", bytes);
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  return traced("ring_shift", bytes, -1, async, t0, do_ring_shift(out, in, shift, async));
}

void Group::barrier() {
  const int64_t t0 = trace::timing() ? trace::now_ns() : -1;
  do_barrier();
  traced("barrier", 0, -1, false, t0, Work());
}

Work Group::traced(const char* kind, int64_t bytes, int peer, bool async, int64_t t0, Work w) const {
  if (t0 < 0) return w;
  const int64_t t1 = trace::now_ns();
  if (!async) trace::add_wait_ns(t1 - t0);
  if (trace::on() && size() > 1) {
    trace::Args a;
    a.tag = current_comm_tag(), a.group = name_, a.kind = kind, a.bytes = bytes, a.peer = peer;
    if (async) a.detail = "async";
    trace::complete(kind, "comm", t0, t1, std::move(a));
  }
  if (async) w.watch(this, kind);
  return w;
}

void Work::timed_wait() {
  const int64_t t0 = trace::now_ns();
  impl_->wait();
  const int64_t t1 = trace::now_ns();
  trace::add_wait_ns(t1 - t0);
  if (trace::on() && group_->size() > 1) {
    trace::Args a;
    a.tag = current_comm_tag(), a.group = group_->name(), a.kind = kind_;
    trace::complete(std::string("wait ") + kind_, "wait", t0, t1, std::move(a));
  }
}

void Group::count(const char* kind, int64_t bytes) const {
  if (size() > 1) count_collective(name_, kind, bytes);
}

void Group::check_peer(const char* op, int peer) const {
  MT_CHECK(peer >= 0 && peer < size(), "comm", "{} on {}: peer {} is not a rank of a group of {}", op, describe(), peer,
           size());
}

void Group::check_same(const char* op, const Tensor& a, const Tensor& b) const {
  MT_CHECK(a.dtype() == b.dtype() && a.device() == b.device(), "comm",
           "{} on {}: input is {} on {}, output is {} on {}; they must match", op, describe(), dtype_name(b.dtype()),
           b.device().str(), dtype_name(a.dtype()), a.device().str());
}

void Group::check_count(const char* op, const char* what, const Tensor& t, int64_t expected) const {
  MT_CHECK(t.numel() == expected, "comm", "{} on {}: {} has {} elements, expected {}", op, describe(), what, t.numel(),
           expected);
}

void Group::check_counts(const char* op, const std::vector<int64_t>& counts) const {
  MT_CHECK(int(counts.size()) == size(), "comm", "{} on {}: {} counts given for {} ranks", op, describe(),
           counts.size(), size());
  for (int64_t c : counts) MT_CHECK(c >= 0, "comm", "{} on {}: negative count {}", op, describe(), c);
}

}  // namespace mt
