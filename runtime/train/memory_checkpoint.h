// In-memory checkpoints (checkpoint.memory, docs/design/checkpoints.md): every memory.interval steps each rank
// copies its state (its local shards of the parameters' f32 masters and of AdamW's moments, the optimizer's step
// count, the model's own state, the step: what a disk checkpoint holds for that rank) into a segment of its
// machine's shared memory (memory_segment.h), and with memory.peer sends it to a peer rank, which keeps it the same
// way: on several machines the next machine's rank of the same local index, on one the next rank. On a restart
// resume_or_init asks resume_from_memory first: each rank takes its own segment if whole, else its peer's copy
// (sent back over the world group), else every rank goes to the disk. All ranks resume one step or none does.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/env.h"
#include "runtime/train/memory_segment.h"
#include "runtime/train/run.h"

namespace mt {

// The rank that holds rank r's copy, for every r: on several hosts (hosts: by world rank) the next host's rank of
// the same local index when every host has as many ranks, else (and on one host) r + 1 mod world.
std::vector<int> memory_peers(const std::vector<std::string>& hosts);

class MemoryCheckpointer {
 public:
  // Collective when enabled (the host names).
  MemoryCheckpointer(const Config& cfg, const MpiEnv& env, TrainRun& run);
  bool enabled() const { return cfg_.checkpoint.memory.on(); }
  // interval: auto saves every step until it has measured kAutoSaves saves, then every every_ steps.
  bool due(int64_t steps_done) const { return enabled() && steps_done % every_ == 0; }
  // Collective with memory.peer (one all-gather of sizes): the state after next_step steps into this rank's
  // segment, and its send to the peer posted (the peer's receive too) without waiting: the copy travels while
  // training goes on and is published by poll() or the next save. Returns the seconds it held the loop. A segment
  // that cannot be written is a warning naming the file (the disk's checkpoints go on).
  // step_s: the step just done (interval: auto weighs the saves against it). Collective with interval: auto
  // until the interval is chosen (one all-reduce, at the last measured save).
  double save(int64_t next_step, double step_s);
  // The peer exchange in flight: completed when it is (wait: waits for it, under the watchdog), and the copy this
  // rank holds published. No collective.
  void poll(bool wait);
  // The exchange completed, then this rank's segment and the copy it holds removed (a run that ended: nothing is
  // left in shared memory).
  void finish();

 private:
  void post_exchange();
  void choose_interval();
  static constexpr int kAutoSaves = 4;  // the first touches new pages: the 2nd-4th are weighed
  const Config& cfg_;
  const MpiEnv& env_;
  TrainRun& run_;
  std::vector<int> to_;  // to_[r]: the rank holding r's copy
  int from_ = -1;        // the rank whose copy this rank holds
  std::unique_ptr<SegmentFile> own_, held_;  // mapped once, reused every save: no new pages touched
  std::vector<Work> pending_;                // the exchange in flight
  Tensor send_dev_, recv_dev_;               // on a GPU: the device buffers the exchange reads and writes
  uint64_t held_bytes_ = 0;
  int64_t every_ = 1;                      // the interval in steps (auto: 1 until chosen)
  std::vector<double> auto_stall_, auto_step_;  // interval: auto's measurements
  bool warned_ = false, noted_ = false;
  bool own_published_ = false, held_published_ = false;  // the stopped runs' spares are removed at the first
};

// Collective. Loads the newest step every rank has in memory (its own segment, else its peer's copy) when it is no
// older than disk_step (the newest disk checkpoint's, -1: none); says which source each rank used, and why a
// segment was not loaded. Returns false (nothing changed) when some rank has no copy of that step: the disk follows.
bool resume_from_memory(const Config& cfg, const MpiEnv& env, TrainRun& run, int64_t disk_step);

}  // namespace mt
