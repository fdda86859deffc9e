#include "comm/comm_counters.h"

#include <mutex>
#include <utility>

namespace mt {

namespace {
std::mutex g_mutex;
CommCounters g_counters;
thread_local std::string t_tag;

// "tag|group|kind" split into its three parts.
struct Key {
  std::string_view tag, group, kind;
};
Key split(std::string_view k) {
  size_t a = k.find('|'), b = k.find('|', a + 1);
  return {k.substr(0, a), k.substr(a + 1, b - a - 1), k.substr(b + 1)};
}
bool matches(const Key& k, std::string_view tag_prefix, std::string_view group, std::string_view kind) {
  return k.tag.substr(0, tag_prefix.size()) == tag_prefix && (group.empty() || k.group == group) &&
         (kind.empty() || k.kind == kind);
}
}  // namespace

int64_t CommCounters::total() const {
  int64_t s = 0;
  for (auto& [k, v] : bytes_by_dim) s += v;
  return s;
}

int64_t CommCounters::bytes(std::string_view tag_prefix, std::string_view group, std::string_view kind) const {
  int64_t s = 0;
  for (auto& [k, c] : entries)
    if (matches(split(k), tag_prefix, group, kind)) s += c.bytes;
  return s;
}

int64_t CommCounters::calls(std::string_view tag_prefix, std::string_view group, std::string_view kind) const {
  int64_t s = 0;
  for (auto& [k, c] : entries)
    if (matches(split(k), tag_prefix, group, kind)) s += c.calls;
  return s;
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
  std::string coll = std::string(group) + " " + std::string(kind);
  std::string key = t_tag + "|" + std::string(group) + "|" + std::string(kind);
  std::lock_guard<std::mutex> lock(g_mutex);
  CommCounters::Count& c = g_counters.entries[key];
  c.calls += 1, c.bytes += bytes;
  g_counters.bytes_by_dim[std::string(group)] += bytes;
  g_counters.bytes_by_collective[coll] += bytes;
  g_counters.calls_by_collective[coll] += 1;
}

CommTag::CommTag(std::string tag) : previous_(std::exchange(t_tag, std::move(tag))) {}
CommTag::~CommTag() { t_tag = std::move(previous_); }

const std::string& current_comm_tag() { return t_tag; }

}  // namespace mt
