#include "runtime/train/memory_segment.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "runtime/core/error.h"
#include "runtime/core/fault.h"
#include "runtime/io/checksum.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

namespace {

constexpr char kMagic[8] = {'M', 'T', 'M', 'E', 'M', 'S', 'G', '1'};
constexpr uint64_t kHead = 24;  // magic, data bytes, meta bytes

uint64_t words_for(uint64_t bytes) { return (bytes + 7) / 8; }

// The checksum of a segment: its meta without "sum" (as parsing gives it back), then its data.
std::string segment_sum(json meta, const void* data, uint64_t n) {
  meta.erase("sum");
  const std::string text = meta.dump();
  StreamChecksum s;
  s.update(text.data(), text.size());
  s.update(data, n);
  return s.hex();
}

void write_all(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    MT_CHECK(w > 0, "checkpoint", "{}: cannot write the in-memory checkpoint: {}", path, std::strerror(errno));
    p += w, n -= size_t(w);
  }
}

}  // namespace

std::string memory_segment_dir() {
  const char* d = std::getenv("MT_SHM_DIR");
  return d && *d ? d : "/dev/shm";
}

std::string memory_job_key(const std::string& checkpoint_dir) {
  std::error_code ec;
  fs::path p = fs::absolute(checkpoint_dir, ec).lexically_normal();
  std::string text = p.string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  StreamChecksum s;
  s.update(text.data(), text.size());
  const std::string hex = s.hex();  // "xxh3-64:<16 hex>"
  return "meshtrain-" + hex.substr(hex.find(':') + 1);
}

std::string memory_segment_path(const std::string& checkpoint_dir, int owner, int holder) {
  std::string name = memory_job_key(checkpoint_dir) + "-r" + std::to_string(owner);
  if (holder != owner) name += "-peer" + std::to_string(holder);
  return (fs::path(memory_segment_dir()) / name).string();
}

int remove_memory_segments(const std::string& checkpoint_dir) {
  const std::string prefix = memory_job_key(checkpoint_dir) + "-r";
  std::error_code ec;
  int n = 0;
  for (auto& e : fs::directory_iterator(memory_segment_dir(), ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0 && fs::remove(e.path(), ec)) ++n;
  return n;
}

void build_segment(SegmentBytes& out, const std::vector<std::pair<const void*, size_t>>& pieces, json meta) {
  uint64_t data = 0;
  for (auto& [p, n] : pieces) data += n;
  const uint64_t data_words = words_for(data);
  out.resize(words_for(kHead) + data_words);
  auto* bytes = reinterpret_cast<unsigned char*>(out.data());
  unsigned char* at = bytes + kHead;
  for (auto& [p, n] : pieces) {
    std::memcpy(at, p, n);
    at += n;
  }
  meta["data_bytes"] = data;
  meta["sum"] = segment_sum(meta, bytes + kHead, data);
  const std::string text = meta.dump();
  const uint64_t meta_at = kHead + data_words * 8;
  out.resize(words_for(meta_at + text.size()), 0);
  bytes = reinterpret_cast<unsigned char*>(out.data());
  std::memcpy(bytes, kMagic, 8);
  std::memcpy(bytes + 8, &data, 8);
  const uint64_t meta_len = text.size();
  std::memcpy(bytes + 16, &meta_len, 8);
  std::memcpy(bytes + meta_at, text.data(), text.size());
}

SegmentView check_segment(const SegmentBytes& words, uint64_t size, const std::string& what) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(words.data());
  MT_CHECK(size >= kHead && std::memcmp(bytes, kMagic, 8) == 0, "checkpoint",
           "{}: not a meshtrain memory segment ({} bytes)", what, size);
  uint64_t data = 0, meta_len = 0;
  std::memcpy(&data, bytes + 8, 8);
  std::memcpy(&meta_len, bytes + 16, 8);
  const uint64_t meta_at = kHead + words_for(data) * 8, want = meta_at + meta_len;
  MT_CHECK(data < (uint64_t(1) << 48) && meta_len < (uint64_t(1) << 32) && size >= want, "checkpoint",
           "{}: truncated ({} of {} bytes)", what, size, want);
  SegmentView v;
  try {
    v.meta = json::parse(std::string(reinterpret_cast<const char*>(bytes + meta_at), meta_len));
  } catch (const json::exception& e) {
    fail("checkpoint", "{}: damaged (its meta is not JSON: {})", what, e.what());
  }
  MT_CHECK(v.meta.is_object() && v.meta.contains("sum") && v.meta["sum"].is_string(), "checkpoint",
           "{}: damaged (no checksum)", what);
  const std::string got = segment_sum(v.meta, bytes + kHead, data);
  MT_CHECK(got == v.meta["sum"].get<std::string>(), "checkpoint",
           "{}: checksum mismatch ({} of its content, {} recorded in it): damaged", what, got,
           v.meta["sum"].get<std::string>());
  v.meta.erase("sum");
  v.data = bytes + kHead;
  v.data_bytes = data;
  return v;
}

void write_segment_file(const std::string& path, const SegmentBytes& words, int64_t fault_step) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  MT_CHECK(fd >= 0, "checkpoint", "{}: cannot create the in-memory checkpoint: {}", tmp, std::strerror(errno));
  const char* p = reinterpret_cast<const char*>(words.data());
  const size_t n = words.size() * 8, half = n / 2;
  try {
    write_all(fd, p, half, tmp);
    if (fault_step >= 0) fault_memory_checkpoint(fault_step);
    write_all(fd, p + half, n - half, tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    fail("checkpoint", "cannot rename {} to {}: {}", tmp, path, std::strerror(e));
  }
}

std::optional<SegmentBytes> read_segment_file(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return std::nullopt;
  const off_t end = ::lseek(fd, 0, SEEK_END);
  SegmentBytes words(words_for(uint64_t(std::max<off_t>(end, 0))), 0);
  char* p = reinterpret_cast<char*>(words.data());
  uint64_t got = 0;
  while (end > 0 && got < uint64_t(end)) {
    const ssize_t r = ::pread(fd, p + got, size_t(end) - got, off_t(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += uint64_t(r);
  }
  ::close(fd);
  *size = got;
  return words;
}

}  // namespace mt
