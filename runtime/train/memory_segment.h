// In-memory checkpoints' segments (checkpoint.memory): one file per rank in shared memory (/dev/shm, a tmpfs that
// outlives the process on its machine), no MPI here. A segment holds one rank's state at one step, checksummed:
//   "MTMEMSG1" | u64 data bytes | u64 meta bytes | data (the rank's local tensors, raw) | meta (JSON: step, owner
//   rank, world, the layout's and the config's hashes, the model's own state; "sum": XXH3-64 of the meta without
//   "sum", then the data) | zero padding to 8 bytes
// Written under a temporary name and renamed, so the previous segment stays whole until the new one is: a process
// killed while writing leaves the old one and a .tmp file nobody loads. The names (memory_job_key) are one rule
// shared by the ranks and `meshtrain supervise`, which removes the segments of a job it gives up on.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace mt {

// Where segments live: $MT_SHM_DIR (tests), else /dev/shm.
std::string memory_segment_dir();
// The job's name prefix, the same across relaunches of the job: "meshtrain-" + 16 hex digits of XXH3-64 of
// checkpoint.dir made absolute. (Slurm's and Open MPI's job ids are not used: mpirun gives every relaunch a new one.)
std::string memory_job_key(const std::string& checkpoint_dir);
// owner's own segment (holder == owner): DIR/KEY-r<owner>; its peer's copy held by holder: DIR/KEY-r<owner>-peer<holder>.
std::string memory_segment_path(const std::string& checkpoint_dir, int owner, int holder);
// Removes every segment of the job in memory_segment_dir() (temporary ones too); returns the files removed.
int remove_memory_segments(const std::string& checkpoint_dir);

// A segment in memory: 8-byte words, the file's bytes.
using SegmentBytes = std::vector<uint64_t>;

// Fills `out` with a segment: data from `pieces` (pointer, bytes) in order, then meta with its checksum. The buffer
// is reused (its capacity kept), so a save every step does not touch new pages.
void build_segment(SegmentBytes& out, const std::vector<std::pair<const void*, size_t>>& pieces, nlohmann::json meta);

// A segment checked: its meta (without "sum") and where its data is. Throws Error naming `what` and what is wrong
// ("truncated: N of M bytes", "checksum mismatch", "not a meshtrain memory segment").
struct SegmentView {
  nlohmann::json meta;
  const unsigned char* data = nullptr;
  uint64_t data_bytes = 0;
};
SegmentView check_segment(const SegmentBytes& bytes, uint64_t size_bytes, const std::string& what);

// Writes path atomically (path.tmp.<pid>, then rename); fault_step: MT_FAULT_MEMORY's hook runs half way through
// (-1: none). Throws naming the file.
void write_segment_file(const std::string& path, const SegmentBytes& bytes, int64_t fault_step = -1);
// The file's bytes (size in *size_bytes), or nullopt when there is none.
std::optional<SegmentBytes> read_segment_file(const std::string& path, uint64_t* size_bytes);

}  // namespace mt
