// Checksums of checkpoint files: XXH3-64 written as "xxh3-64:<16 hex digits>". A save hashes each file as it writes
// it (StreamChecksum, no second read), records the sums in meta.json, and a load verifies them before trusting a
// byte (checkpoint.h): a flipped bit, a truncated file or a file from another save is caught by name.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mt {

class StreamChecksum {
 public:
  StreamChecksum();
  ~StreamChecksum();
  StreamChecksum(const StreamChecksum&) = delete;
  StreamChecksum& operator=(const StreamChecksum&) = delete;
  void update(const void* data, size_t n);
  std::string hex() const;  // "xxh3-64:..." of everything given so far

 private:
  void* state_;
};

// The checksum of a whole file, read in 8 MiB pieces; throws naming the file when it cannot be read.
std::string file_checksum(const std::string& path);

}  // namespace mt
