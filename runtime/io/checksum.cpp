#include "runtime/io/checksum.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "runtime/core/error.h"

namespace mt {

namespace {
std::string format_sum(XXH64_hash_t h) { return fmt::format("xxh3-64:{:016x}", uint64_t(h)); }
}  // namespace

StreamChecksum::StreamChecksum() : state_(XXH3_createState()) {
  MT_CHECK(state_, "checksum", "out of memory");
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
StreamChecksum::~StreamChecksum() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void StreamChecksum::update(const void* data, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n);
}
std::string StreamChecksum::hex() const { return format_sum(XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_))); }

std::string file_checksum(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  MT_CHECK(fd >= 0, "checkpoint", "cannot read {}: {}", path, std::strerror(errno));
  StreamChecksum sum;
  std::vector<char> buf(size_t(8) << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("checkpoint", "cannot read {}: {}", path, std::strerror(err));
    }
    if (n == 0) break;
    sum.update(buf.data(), size_t(n));
  }
  ::close(fd);
  return sum.hex();
}

}  // namespace mt
