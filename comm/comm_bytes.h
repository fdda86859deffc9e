// The analytic bytes of one kind of collective a parallelism issues in a step, on one rank: what each parallelism
// declares beside its code (the family's tp plan, attention's cp, fully_shard, GradSync, the pp schedule) so that
// `estimate` times them and `plan` sets them beside what the runtime counts, from the same function.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

// comm_counters.h's convention: the bytes a rank sends under the ring algorithms, summed over the step's calls.
struct CommBytes {
  std::string tag;          // "layout", "cp.kv", "fsdp.gather", ...: the CommTag the runtime counts them under
  std::string group;        // a mesh dim ("tp"), or the dims of a bucket's group ("dp_replicate,tp")
  std::string kind;         // "all_gather", "ring_shift", "send", ...
  double bytes = 0;         // per step
  int64_t calls = 0;        // per step
  bool overlapped = false;  // the runtime issues them non-blocking
};

}  // namespace mt
