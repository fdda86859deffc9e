// What this rank's collectives sent, counted by Group as it runs them (group.h): one entry per
// (tag, group, kind). The bytes are those a rank sends under the ring algorithms, the convention of the
// analytic counts each parallelism declares beside its code (ring_attention.h, fully_shard.h, grad_sync.h,
// the Llama plan): all_gather (n-1) x the input, reduce_scatter and all_to_all (n-1)/n of the input,
// all_reduce 2 (n-1)/n of the buffer, ring_shift and send the buffer, broadcast the buffer from the root,
// recv nothing. A group of one rank sends nothing and is not counted.
//
// The tag names what the bytes are for ("cp.kv", "fsdp.gather", "grad.reduce", "layout"): the caller sets it
// with a CommTag around its collectives; untagged ones count under "".
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

namespace mt {

struct CommCounters {
  struct Count {
    int64_t calls = 0, bytes = 0;
  };
  using Key = std::tuple<std::string, std::string, std::string>;  // tag, group, kind
  std::map<Key, Count, std::less<>> entries;

  // Bytes (calls) of the entries whose tag starts with tag_prefix and, when given, whose group and kind match
  // ("" = any).
  int64_t bytes(std::string_view tag_prefix, std::string_view group = "", std::string_view kind = "") const;
  int64_t calls(std::string_view tag_prefix, std::string_view group = "", std::string_view kind = "") const;
  int64_t total() const { return bytes(""); }
  // Per "group kind" ("tp all_gather"), whatever the tag: what `meshtrain plan` summarises.
  std::map<std::string, Count> by_collective() const;
};

// This process's counts since the last reset (every thread's).
CommCounters comm_counters();
void reset_comm_counters();
// Adds one collective (Group calls this; nothing else should).
void count_collective(std::string_view group, std::string_view kind, int64_t bytes);

// Names the collectives this thread issues while it lives; nests (the innermost wins).
class CommTag {
 public:
  explicit CommTag(std::string tag);
  ~CommTag();
  CommTag(const CommTag&) = delete;
  CommTag& operator=(const CommTag&) = delete;

 private:
  std::string previous_;
};
// The tag collectives issued now are counted under.
const std::string& current_comm_tag();

}  // namespace mt
