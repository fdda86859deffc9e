#include "comm/comm_counters.h"

#include <mutex>
#include <utility>

namespace mt {

namespace {
std::mutex g_mutex;
CommCounters g_counters;
thread_local std::string t_tag;

bool matches(const CommCounters::Key& k, std::string_view tag_prefix, std::string_view group, std::string_view kind) {
  const auto& [t, g, c] = k;
  return std::string_view(t).substr(0, tag_prefix.size()) == tag_prefix && (group.empty() || g == group) &&
         (kind.empty() || c == kind);
}
}  // namespace

int64_t CommCounters::bytes(std::string_view tag_prefix, std::string_view group, std::string_view kind) const {
  int64_t s = 0;
  for (auto& [k, c] : entries)
    if (matches(k, tag_prefix, group, kind)) s += c.bytes;
  return s;
}

int64_t CommCounters::calls(std::string_view tag_prefix, std::string_view group, std::string_view kind) const {
  int64_t s = 0;
  for (auto& [k, c] : entries)
    if (matches(k, tag_prefix, group, kind)) s += c.calls;
  return s;
}

std::map<std::string, CommCounters::Count> CommCounters::by_collective() const {
  std::map<std::string, Count> out;
  for (auto& [k, c] : entries) {
    Count& o = out[std::get<1>(k) + " " + std::get<2>(k)];
    o.calls += c.calls, o.bytes += c.bytes;
  }
  return out;
}

CommCounters comm_counters() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_counters;
}

void reset_comm_counters() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters = CommCounters{};
}

void count_collective(std::string_view group, std::string_view kind, int64_t bytes) {
  const std::tuple<std::string_view, std::string_view, std::string_view> key{t_tag, group, kind};
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_counters.entries.find(key);  // no allocation once the entry exists
  if (it == g_counters.entries.end())
    it = g_counters.entries.emplace(CommCounters::Key{t_tag, group, kind}, CommCounters::Count{}).first;
  it->second.calls += 1, it->second.bytes += bytes;
}

CommTag::CommTag(std::string tag) : previous_(std::exchange(t_tag, std::move(tag))) {}
CommTag::~CommTag() { t_tag = std::move(previous_); }

const std::string& current_comm_tag() { return t_tag; }

}  // namespace mt
