#include "runtime/train/memory_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <unistd.h>

#include "comm/watchdog.h"
#include "comm/world.h"
#include "runtime/core/log.h"
#include "runtime/core/trace.h"
#include "runtime/io/checksum.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

namespace {

constexpr int kTag = 7301;  // the peer exchange's messages

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// This rank's state, in a fixed order: each trainable parameter's f32 master, then each one's exp_avg and
// exp_avg_sq (with LoRA the adapters: the frozen base is drawn or loaded again, as from a disk checkpoint).
std::vector<std::pair<std::string, Tensor>> rank_tensors(TrainRun& run) {
  std::vector<std::pair<std::string, Tensor>> out;
  const std::vector<Parameter*> params = trainable(run.model->parameters());
  for (Parameter* p : params) out.emplace_back(p->name, p->value.local);
  if (run.opt)
    for (Parameter* p : params) {
      auto& s = run.opt->state().at(p->name);
      out.emplace_back(p->name + ".exp_avg", s.exp_avg);
      out.emplace_back(p->name + ".exp_avg_sq", s.exp_avg_sq);
    }
  return out;
}

// What a segment must match to be loaded here: the tensors' names, local shapes and dtypes, and the config but for
// what does not change the state (steps, logging, checkpoints, evaluation, samples, traces, comm).
std::string layout_hash(const std::vector<std::pair<std::string, Tensor>>& ts, const Config& cfg) {
  std::string text;
  for (auto& [name, t] : ts) text += fmt::format("{}:{}:{};", name, shape_str(t.shape()), dtype_name(t.dtype()));
  Config c = cfg;
  c.comm = {}, c.log = {}, c.eval = {}, c.sample = {}, c.checkpoint = {}, c.profile = {};
  c.training.steps = 0;
  text += std::to_string(config_hash(c));
  StreamChecksum s;
  s.update(text.data(), text.size());
  return s.hex();
}

Tensor as_words(SegmentBytes& b) { return from_blob(b.data(), {int64_t(b.size())}, DType::i64); }


// The spares a stopped run left beside a segment (NAME.tmp.<pid> of another process): the previous segment, whole,
// or one half written when the process was killed while writing.
std::vector<std::string> stale_spares(const std::string& path) {
  const std::string prefix = fs::path(path).filename().string() + ".tmp.";
  const std::string mine = prefix + std::to_string(::getpid());
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(memory_segment_dir(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && name != mine) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Those spares removed once this run has published its own segment at that name (they are older than it).
void remove_stale_spares(const std::string& path, int me) {
  int n = 0;
  std::error_code ec;
  for (const std::string& p : stale_spares(path)) n += fs::remove(p, ec) ? 1 : 0;
  if (n > 0) spdlog::info("rank {}: removed {} spare{} of {} a stopped run left", me, n, n > 1 ? "s" : "", path);
}

std::string list(const std::vector<int>& ranks) { return fmt::format("{}", fmt::join(ranks, ", ")); }

}  // namespace

std::vector<int> memory_peers(const std::vector<std::string>& hosts) {
  const int n = int(hosts.size());
  std::vector<std::string> nodes;           // in order of first appearance
  std::map<std::string, std::vector<int>> ranks;
  for (int r = 0; r < n; ++r) {
    if (!ranks.count(hosts[size_t(r)])) nodes.push_back(hosts[size_t(r)]);
    ranks[hosts[size_t(r)]].push_back(r);
  }
  std::vector<int> to(static_cast<size_t>(n), 0);
  for (int r = 0; r < n; ++r) to[size_t(r)] = (r + 1) % n;
  const size_t per = ranks[nodes[0]].size();
  const bool even = std::all_of(nodes.begin(), nodes.end(), [&](auto& h) { return ranks[h].size() == per; });
  if (nodes.size() < 2 || !even) return to;
  for (size_t k = 0; k < nodes.size(); ++k)
    for (size_t i = 0; i < per; ++i) to[size_t(ranks[nodes[k]][i])] = ranks[nodes[(k + 1) % nodes.size()]][i];
  return to;
}

namespace {

std::vector<int> peers_of_job(const MpiEnv& env) {
  struct Host {
    char name[64];
  } mine = {};
  std::snprintf(mine.name, sizeof mine.name, "%s", env.host().c_str());
  std::vector<std::string> hosts;
  for (const Host& h : world::all_gather(mine, "memory checkpoint: host names"))
    hosts.emplace_back(h.name, strnlen(h.name, 63));
  return memory_peers(hosts);
}

// Sends `send` to rank `to` and receives `recv` (resized to recv_words) from rank `from` over the world group,
// either side skipped with -1.
void exchange(TrainRun& run, SegmentBytes& send, int to, SegmentBytes& recv, int64_t recv_words, int from) {
  Group& g = run.world_mesh.group("world");
  const Device dev = run.mesh.device();
  Tensor out, in;
  if (to >= 0) out = dev.is_cuda() ? as_words(send).to(dev) : as_words(send);
  if (from >= 0) {
    recv.resize(size_t(recv_words));
    in = dev.is_cuda() ? empty({recv_words}, DType::i64, dev) : as_words(recv);
  }
  std::vector<Work> w;
  g.batch_begin();
  if (to >= 0) w.push_back(g.send(out, to, true, kTag, "an in-memory checkpoint to its peer"));
  if (from >= 0) w.push_back(g.recv(in, from, true, kTag, "an in-memory checkpoint from its peer"));
  g.batch_end();
  for (Work& x : w) x.wait();
  if (from >= 0 && dev.is_cuda()) copy_(as_words(recv), in.to(Device::cpu()));
}

}  // namespace

MemoryCheckpointer::MemoryCheckpointer(const Config& cfg, const MpiEnv& env, TrainRun& run)
    : cfg_(cfg), env_(env), run_(run) {
  if (!enabled()) return;
  if (!cfg.checkpoint.memory.interval.automatic) every_ = cfg.checkpoint.memory.interval.steps;
  const std::string& dir = cfg.checkpoint.dir;
  own_ = std::make_unique<SegmentFile>(memory_segment_path(dir, env.rank(), env.rank()));
  if (!cfg.checkpoint.memory.peer || env.size() < 2) return;
  to_ = peers_of_job(env);
  for (int r = 0; r < env.size(); ++r)
    if (to_[size_t(r)] == env.rank()) from_ = r;
  held_ = std::make_unique<SegmentFile>(memory_segment_path(dir, from_, env.rank()));
}

double MemoryCheckpointer::save(int64_t next_step, double step_s) {
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span span("memory checkpoint", "checkpoint");
  WatchdogPhase phase(fmt::format("saving the in-memory checkpoint of step {}", next_step));
  poll(true);  // the previous exchange's buffers are about to be reused
  const int me = env_.rank();
  try {
    const auto ts = rank_tensors(run_);
    std::vector<Tensor> host;  // on a GPU: the device's shards copied to the host first
    std::vector<std::pair<const void*, size_t>> pieces;
    for (auto& [name, t] : ts) {
      host.push_back(t.device().is_cuda() ? t.to(Device::cpu()) : t);
      pieces.emplace_back(host.back().data_ptr(), size_t(host.back().nbytes()));
    }
    json meta = {{"format", 1},           {"step", next_step},
                 {"owner", me},           {"world", env_.size()},
                 {"layout", layout_hash(ts, cfg_)},
                 {"optimizer_steps", run_.opt ? run_.opt->steps_taken() : next_step},
                 {"model_state", run_.model->extra_state()}};
    write_segment(*own_, pieces, std::move(meta), next_step);
    if (!own_published_) remove_stale_spares(own_->path(), me);
    own_published_ = true;
  } catch (const std::exception& e) {
    if (!warned_) spdlog::warn("rank {}: in-memory checkpoint of step {} not kept: {}", me, next_step, e.what());
    warned_ = true;
  }
  if (held_) post_exchange();
  const double s = seconds_since(t0);
  const bool automatic = cfg_.checkpoint.memory.interval.automatic;
  if (!noted_ && me == 0)
    spdlog::info("in-memory checkpoint of step {}: {:.1f} MiB a rank in {} (rank 0){}, in {:.3f} s; {}",
                 next_step, double(own_->published_bytes()) / (1 << 20), own_->path(),
                 to_.empty() ? "" : fmt::format(", a copy on rank {}", to_[0]), s,
                 automatic ? fmt::format("interval auto: weighing {} saves", kAutoSaves)
                           : fmt::format("every {} steps", every_));
  noted_ = true;
  if (automatic && int(auto_stall_.size()) < kAutoSaves) {
    auto_stall_.push_back(s), auto_step_.push_back(step_s);
    if (int(auto_stall_.size()) == kAutoSaves) choose_interval();
  }
  return s;
}

// interval: auto. A save's cost is what it holds the loop (its copy, and the wait for the previous peer exchange,
// which moves only inside MPI calls on a single-copy-less transport); the median of saves 2..kAutoSaves on the
// slowest rank against the median step. With checkpoint.mtbf_s, Young/Daly's interval for that cost, as the disk's
// auto interval does (a failure loses half an interval on average: more frequent saves cost more than they save);
// without it, every step when a save is under 2% of a step, else the fewest steps that keep it under 2%. Every rank
// chooses alike (the figures are all-reduced).
void MemoryCheckpointer::choose_interval() {
  auto median = [](std::vector<double> v) {
    v.erase(v.begin());  // the first save touches new pages
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  double cost[2] = {median(auto_stall_), median(auto_step_)};
  for (double& c : cost) c = world::all_reduce(c, ReduceOp::max, "memory checkpoint: interval auto");
  const double share = cost[1] > 0 ? cost[0] / cost[1] : 0;
  const double mtbf = cfg_.checkpoint.mtbf_s;
  std::string why;
  if (mtbf > 0 && cost[1] > 0) {
    const double yd_s = std::sqrt(2 * cost[0] * mtbf);
    every_ = std::max<int64_t>(1, std::llround(yd_s / cost[1]));
    why = fmt::format("sqrt(2 x {:.3f} x mtbf_s {:g}) = {:.1f} s, Young/Daly", cost[0], mtbf, yd_s);
  } else {
    every_ = std::max<int64_t>(1, int64_t(std::ceil(share / 0.02 - 1e-9)));
    why = every_ == 1 ? "under 2%" : fmt::format("every {} keeps it under 2%", every_);
  }
  if (env_.rank() == 0)
    spdlog::info("in-memory checkpoints every {} step{} (checkpoint.memory.interval auto: a save holds the loop "
                 "{:.3f} s, {:.1f}% of a {:.3f}-s step; {})",
                 every_, every_ > 1 ? "s" : "", cost[0], 100 * share, cost[1], why);
}

// Every rank takes part whatever its own write did (it sends what it last published): no rank is left waiting.
void MemoryCheckpointer::post_exchange() {
  const int me = env_.rank();
  const std::vector<int64_t> sizes =
      world::all_gather(int64_t(own_->published_bytes()), "memory checkpoint: sizes");
  held_bytes_ = uint64_t(sizes[size_t(from_)]);
  Group& g = run_.world_mesh.group("world");
  const Device dev = run_.mesh.device();
  auto* src = const_cast<unsigned char*>(own_->published());
  Tensor out = from_blob(src, {sizes[size_t(me)] / 8}, DType::i64);
  Tensor in = from_blob(held_->reserve(held_bytes_), {int64_t(held_bytes_ / 8)}, DType::i64);
  if (dev.is_cuda()) {
    send_dev_ = out.to(dev), out = send_dev_;
    recv_dev_ = empty(in.shape(), DType::i64, dev), in = recv_dev_;
  }
  g.batch_begin();
  if (src) pending_.push_back(g.send(out, to_[size_t(me)], true, kTag, "an in-memory checkpoint to its peer"));
  if (held_bytes_ > 0) pending_.push_back(g.recv(in, from_, true, kTag, "an in-memory checkpoint from its peer"));
  g.batch_end();
}

void MemoryCheckpointer::poll(bool wait) {
  if (pending_.empty()) return;
  for (Work& w : pending_)
    if (!wait && !w.test()) return;
  for (Work& w : pending_) w.wait();
  pending_.clear();
  try {
    if (recv_dev_.defined()) {
      copy_(from_blob(held_->reserve(held_bytes_), recv_dev_.shape(), DType::i64), recv_dev_.to(Device::cpu()));
      recv_dev_ = Tensor(), send_dev_ = Tensor();
    }
    held_->publish(held_bytes_);
    if (!held_published_) remove_stale_spares(held_->path(), env_.rank());
    held_published_ = true;
  } catch (const std::exception& e) {
    if (!warned_) spdlog::warn("rank {}: the peer's in-memory checkpoint not kept: {}", env_.rank(), e.what());
    warned_ = true;
  }
}

void MemoryCheckpointer::finish() {
  if (!enabled()) return;
  poll(true);
  own_->remove();
  remove_stale_spares(own_->path(), env_.rank());
  if (held_) held_->remove(), remove_stale_spares(held_->path(), env_.rank());
}

namespace {

// A segment read and checked: step -1 when there is none or it cannot be used (why says what).
struct Found {
  SegmentBytes bytes;
  uint64_t size = 0;
  int64_t step = -1;
  std::string why;
};

// Checks a segment's bytes for `owner` (the checksum; with `layout`, that it is this rank's state in this layout).
void check_found(Found& f, const std::string& what, int owner, int world, const std::string& layout,
                 uint64_t state_bytes) {
  try {
    const SegmentView v = check_segment(f.bytes.data(), f.size, what);
    const json& m = v.meta;
    MT_CHECK(m.value("owner", -1) == owner && m.value("world", -1) == world, "checkpoint",
             "{}: written by rank {} of {}, not rank {} of {}", what, m.value("owner", -1), m.value("world", -1),
             owner, world);
    MT_CHECK(layout.empty() || (m.value("layout", "") == layout && v.data_bytes == state_bytes), "checkpoint",
             "{}: written by another model, mesh or config ({} of state, {} here)", what, v.data_bytes, state_bytes);
    f.step = m.at("step").get<int64_t>();
  } catch (const std::exception& e) {
    f.why = e.what(), f.step = -1;
  }
}

Found read_found(const std::string& path, int owner, int world, const std::string& layout, uint64_t state_bytes) {
  Found f;
  std::optional<SegmentBytes> b = read_segment_file(path, &f.size);
  if (!b) return f;
  f.bytes = std::move(*b);
  check_found(f, path, owner, world, layout, state_bytes);
  return f;
}

// The whole segments one name offers, newest step first, at most two distinct steps (a segment and its spare): the
// published one and the spares stopped runs left. Why the published one is unusable is said (warn); a spare that is
// not whole was being written when its run stopped, and is said at the info level.
std::vector<Found> read_candidates(const std::string& path, int owner, int world, const std::string& layout,
                                   uint64_t state_bytes, int me, bool say) {
  std::vector<Found> out;
  Found f = read_found(path, owner, world, layout, state_bytes);
  if (!f.why.empty() && say) spdlog::warn("rank {}: {}: not loaded", me, f.why);
  if (f.step >= 0) out.push_back(std::move(f));
  for (const std::string& spare : stale_spares(path)) {
    Found g = read_found(spare, owner, world, layout, state_bytes);
    if (g.step < 0) {
      if (say && !g.why.empty())
        spdlog::info("rank {}: {} not loaded: half written by a run that stopped, or damaged", me, g.why);
      continue;
    }
    if (std::none_of(out.begin(), out.end(), [&](const Found& x) { return x.step == g.step; }))
      out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) { return a.step > b.step; });
  if (out.size() > 2) out.resize(2);
  return out;
}

// What a rank can offer: the steps of its own segments and of the copies it holds (newest first, -1: none) and
// each held copy's size in words.
struct Avail {
  int64_t own[2] = {-1, -1}, held[2] = {-1, -1}, held_words[2] = {0, 0};
  bool has_own(int64_t s) const { return s >= 0 && (own[0] == s || own[1] == s); }
  int held_index(int64_t s) const { return s < 0 ? -1 : held[0] == s ? 0 : held[1] == s ? 1 : -1; }
};

Avail avail_of(const std::vector<Found>& own, const std::vector<Found>& held) {
  Avail a;
  for (size_t i = 0; i < own.size(); ++i) a.own[i] = own[i].step;
  for (size_t i = 0; i < held.size(); ++i) a.held[i] = held[i].step, a.held_words[i] = int64_t(held[i].bytes.size());
  return a;
}

// The newest step every rank has: its own segment's (or spare's), or its peer's copy (held by to[r]); -1: none.
int64_t common_step(const std::vector<Avail>& a, const std::vector<int>& to) {
  std::vector<int64_t> steps;
  for (const Avail& x : a) steps.insert(steps.end(), {x.own[0], x.own[1], x.held[0], x.held[1]});
  std::sort(steps.rbegin(), steps.rend());
  for (int64_t s : steps) {
    if (s < 0) break;
    bool all = true;
    for (size_t r = 0; r < a.size() && all; ++r)
      all = a[r].has_own(s) || (!to.empty() && a[size_t(to[r])].held_index(s) >= 0);
    if (all) return s;
  }
  return -1;
}

// The checked segment's state into this rank's tensors.
void load_state(const Found& f, TrainRun& run) {
  const SegmentView v = check_segment(f.bytes.data(), f.size, "the in-memory checkpoint");
  const unsigned char* at = v.data;
  for (auto& [name, t] : rank_tensors(run)) {
    Tensor src = from_blob(const_cast<unsigned char*>(at), t.shape(), t.dtype());
    copy_(t, t.device().is_cuda() ? src.to(t.device()) : src);
    at += t.nbytes();
  }
  for (Parameter* p : run.model->parameters()) refresh_compute_copy(*p);
  if (run.opt) run.opt->set_steps_taken(v.meta.at("optimizer_steps").get<int64_t>());
  run.model->load_extra_state(v.meta.contains("model_state") ? v.meta["model_state"] : json(),
                              "the in-memory checkpoint");
  run.start_step = v.meta.at("step").get<int64_t>();
}

// Rank 0's lines: one per source used.
void say_sources(const std::vector<Avail>& a, const std::vector<int>& to, int64_t s, const std::string& dir) {
  std::vector<int> own, spare, peer;
  for (size_t r = 0; r < a.size(); ++r)
    (a[r].own[0] == s ? own : a[r].has_own(s) ? spare : peer).push_back(int(r));
  auto say = [&](const std::vector<int>& ranks, const char* what) {
    if (ranks.empty()) return;
    const bool many = ranks.size() > 1;
    spdlog::info("resuming step {} from memory: rank{} {} from {} {}{} ({})", s, many ? "s" : "", list(ranks),
                 many ? "their" : "its", what, many ? "s" : "", memory_segment_path(dir, ranks[0], ranks[0]));
  };
  say(own, "own segment");
  say(spare, "previous segment");
  for (int r : peer)
    spdlog::info("resuming step {} from memory: rank {} from its peer's copy, held by rank {} ({})", s, r,
                 to[size_t(r)], memory_segment_path(dir, r, to[size_t(r)]));
}

}  // namespace

bool resume_from_memory(const Config& cfg, const MpiEnv& env, TrainRun& run, int64_t disk_step) {
  if (!cfg.checkpoint.memory.on() || cfg.checkpoint.resume != "auto") return false;
  WatchdogPhase phase("looking for in-memory checkpoints");
  const int me = env.rank(), world = env.size();
  const std::string& dir = cfg.checkpoint.dir;
  const std::vector<int> to = cfg.checkpoint.memory.peer && world > 1 ? peers_of_job(env) : std::vector<int>{};
  int from = -1;
  for (int r = 0; r < int(to.size()); ++r)
    if (to[size_t(r)] == me) from = r;
  const auto ts = rank_tensors(run);
  uint64_t state_bytes = 0;
  for (auto& [n, t] : ts) state_bytes += uint64_t(t.nbytes());
  const std::string layout = layout_hash(ts, cfg);
  std::vector<Found> own = read_candidates(memory_segment_path(dir, me, me), me, world, layout, state_bytes, me, true);
  std::vector<Found> held = from >= 0 ? read_candidates(memory_segment_path(dir, from, me), from, world, "", 0, me, false)
                                      : std::vector<Found>{};
  const std::vector<Avail> all = world::all_gather(avail_of(own, held), "memory checkpoint: what each rank has");
  const int64_t s = common_step(all, to);
  auto steps = [&](bool o) {
    std::vector<std::string> v;
    for (const Avail& x : all) {
      const int64_t* st = o ? x.own : x.held;
      v.push_back(st[0] < 0 ? "-" : st[1] < 0 ? std::to_string(st[0]) : fmt::format("{}/{}", st[0], st[1]));
    }
    return fmt::format("[{}]", fmt::join(v, ", "));
  };
  const bool any =
      std::any_of(all.begin(), all.end(), [](const Avail& x) { return x.own[0] >= 0 || x.held[0] >= 0; });
  if (s < 0 || s < disk_step) {
    // A newer disk checkpoint is the normal case of a save that coincided with the failure: said, not warned.
    if (me == 0 && any)
      spdlog::log(s < 0 ? spdlog::level::warn : spdlog::level::info,
                  "in-memory checkpoints not used: {} (own segments' steps by rank {}, peers' copies' {}): resuming "
                  "from the disk",
                  s < 0 ? "no step that every rank has" : fmt::format("the disk's step {} is newer than {}", disk_step, s),
                  steps(true), steps(false));
    return false;
  }
  if (!own.empty() && !all[size_t(me)].has_own(s))
    spdlog::warn("rank {}: its own segment {} holds step {}, not step {} that every rank has: not loaded", me,
                 memory_segment_path(dir, me, me), own[0].step, s);
  // The peers' copies go back to the ranks that lack step s. The world group is made here by every rank (making a
  // group is collective): only the ranks that send or receive a copy call exchange(), and a group made there alone
  // left the others waiting in the next collective (a 4-rank drill's relaunches timed out until none needed a copy).
  run.world_mesh.group("world");
  const bool need = !all[size_t(me)].has_own(s);
  const bool give = from >= 0 && !all[size_t(from)].has_own(s);
  Found use;
  for (Found& f : own)
    if (f.step == s) use = std::move(f);
  if (!to.empty() && (need || give)) {
    SegmentBytes none;
    const int gi = give ? all[size_t(me)].held_index(s) : -1;
    const int ni = need ? all[size_t(to[size_t(me)])].held_index(s) : -1;
    Found got;
    exchange(run, gi >= 0 ? held[size_t(gi)].bytes : none, gi >= 0 ? from : -1, got.bytes,
             ni >= 0 ? all[size_t(to[size_t(me)])].held_words[ni] : 0, ni >= 0 ? to[size_t(me)] : -1);
    if (need) {
      got.size = got.bytes.size() * 8;
      check_found(got, memory_segment_path(dir, me, to[size_t(me)]) + " (sent back)", me, world, layout, state_bytes);
      if (got.step != s && got.why.empty()) got.why = fmt::format("holds step {}, not {}", got.step, s);
      use = std::move(got);
    }
  }
  const int ok = world::all_reduce(int(use.step == s), ReduceOp::min, "memory checkpoint: every rank has it");
  if (!ok) {
    if (use.step != s) spdlog::warn("rank {}: the peer's copy cannot be used: {}", me, use.why);
    if (me == 0) spdlog::warn("in-memory checkpoints not used (a rank's copy failed its checks): resuming from the disk");
    return false;
  }
  if (me == 0) say_sources(all, to, s, dir);
  load_state(use, run);
  return true;
}

}  // namespace mt
