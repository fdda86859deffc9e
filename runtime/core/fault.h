// Fault injection for the failure drills (tests/cli/, scripts/bench/): each MT_FAULT_* variable makes one rank
// misbehave at one point of the run, so that the watchdog, the supervisor and resume can be tested on purpose.
// Unset, every hook here is a no-op. The variables:
//   MT_FAULT_STOP_AT=<label prefix>:<world rank>  that rank raises SIGSTOP on itself the first time it reaches a
//                                                 fault_stop_point whose label starts with the prefix
//                                                 (e.g. "checkpoint barrier:1"): the stuck-rank drills
//   MT_FAULT_SLOW_RANK=<world rank>:<ms>          that rank sleeps ms milliseconds in every training step (inside
//                                                 the step, before forward): the slow-rank drill
//   MT_FAULT_SLOW_TRACE=<world rank>:<us>         that rank takes us microseconds longer per event to write its trace
//                                                 file (and, on rank 0, the merged trace.json): the slow-disk drill
//   MT_FAULT_CHECKPOINT=<step>                    rank 0 dies half way through writing that step's checkpoint
//   MT_FAULT_CHECKPOINT=<step>:error              that write fails with an error instead (a full disk)
//   MT_FAULT_MEMORY=<step>:<world rank>           that rank is killed (SIGKILL) half way through writing its own
//                                                 in-memory checkpoint segment of that step (memory_segment.h)
// The ground knows no MPI: before MPI_Init a rank is known from its launcher's variables.
#pragma once
#include <cstdint>
#include <string_view>

namespace mt {

// MT_FAULT_STOP_AT's hook at the point named by label; returns at once unless this rank stops here.
void fault_stop_point(std::string_view label);
// Whether MT_FAULT_STOP_AT is set and has not fired (a cheap test before building a label).
bool fault_stop_armed();

// MT_FAULT_SLOW_RANK's hook, called once per training step.
void fault_slow_rank();

// MT_FAULT_SLOW_TRACE's hook, called where a trace file of `events` events is written.
void fault_slow_trace(int64_t events);

// Whether MT_FAULT_CHECKPOINT asks the checkpoint of this step to fail: with an error (error true, ":error") or by
// killing the writer (error false).
bool fault_checkpoint_at(int64_t step, bool error);

// MT_FAULT_MEMORY's hook, called half way through writing this rank's segment of `step`; returns unless it kills.
void fault_memory_checkpoint(int64_t step);

}  // namespace mt
