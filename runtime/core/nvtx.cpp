// NVTX ranges for Nsight Systems (kernel_profile.h); header-only NVTX 3, a no-op without a tool attached.
#include <nvtx3/nvToolsExt.h>

#include "runtime/core/kernel_profile.h"

namespace mt {
void nvtx_push(const char* name) { nvtxRangePushA(name); }
void nvtx_pop() { nvtxRangePop(); }
}  // namespace mt
