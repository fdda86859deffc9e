// The memory track's peak by part (trace.h): the sample of trace::memory_sample with the most
// bytes in use by training (a checkpoint's snapshot apart) since the last reset, split as the track is (the model state's fixed parts, the rest).
#pragma once
#include <cstdint>

namespace mt::trace {

struct MemoryParts {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t buffers = 0;  // communication buffers: the gradient buckets' flat buffers
  int64_t units = 0;    // fully_shard's gathered units and their full-size gradients (allocated under UnitScope)
  int64_t snapshot = 0;  // an asynchronous checkpoint's host copies, held until its writer has them on disk
  int64_t other = 0;     // activations and temporaries: the rest
  int64_t total() const { return parameters + gradients + optimizer + buffers + units + snapshot + other; }
  // What the step itself holds: the total less a checkpoint's snapshot (which `estimate` does not count).
  int64_t training() const { return total() - snapshot; }
};
MemoryParts memory_peak();
void reset_memory_peak();

}  // namespace mt::trace
