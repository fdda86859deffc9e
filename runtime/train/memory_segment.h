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

// A segment read from a file: 8-byte words, the file's bytes.
using SegmentBytes = std::vector<uint64_t>;

// A segment written in place: two files mapped once and reused (no new pages touched by a save after the first two),
// the published one at `path` and a spare at path.tmp.<pid> (the previous segment, whole, until it is rewritten).
// publish() swaps the two names atomically (renameat2 RENAME_EXCHANGE), so `path` is always a whole segment; a
// process killed while it writes leaves `path` and a spare that nobody loads (the next run removes it).
class SegmentFile {
 public:
  explicit SegmentFile(std::string path);
  ~SegmentFile();  // unmaps; the files stay (remove() removes them)
  SegmentFile(const SegmentFile&) = delete;
  SegmentFile& operator=(const SegmentFile&) = delete;
  // The spare's mapping, `bytes` long (a multiple of 8), its content kept when it grows. Throws naming the file.
  unsigned char* reserve(uint64_t bytes);
  // The spare, `bytes` long, becomes the segment at path. Throws naming the file.
  void publish(uint64_t bytes);
  const unsigned char* published() const { return cur_.p; }  // null before the first publish
  uint64_t published_bytes() const { return cur_bytes_; }
  void remove();  // both files
  const std::string& path() const { return path_; }

 private:
  struct Map {
    int fd = -1;
    unsigned char* p = nullptr;
    uint64_t len = 0;
  };
  static void unmap(Map& m);
  std::string path_, spare_;
  Map cur_, spare_map_;
  uint64_t cur_bytes_ = 0;
};

// Writes a segment into f's spare (data from `pieces` (pointer, bytes) in order, then meta with its checksum;
// fault_step: MT_FAULT_MEMORY's hook half way through the data, -1: none) and publishes it. Returns its bytes.
uint64_t write_segment(SegmentFile& f, const std::vector<std::pair<const void*, size_t>>& pieces,
                       nlohmann::json meta, int64_t fault_step = -1);

// A segment checked: its meta (without "sum") and where its data is. Throws Error naming `what` and what is wrong
// ("truncated: N of M bytes", "checksum mismatch", "not a meshtrain memory segment").
struct SegmentView {
  nlohmann::json meta;
  const unsigned char* data = nullptr;
  uint64_t data_bytes = 0;
};
SegmentView check_segment(const void* bytes, uint64_t size_bytes, const std::string& what);

// The file's bytes (size in *size_bytes), or nullopt when there is none.
std::optional<SegmentBytes> read_segment_file(const std::string& path, uint64_t* size_bytes);

}  // namespace mt
