#include "runtime/train/memory_segment.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
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

SegmentFile::SegmentFile(std::string path)
    : path_(std::move(path)), spare_(path_ + ".tmp." + std::to_string(::getpid())) {}

SegmentFile::~SegmentFile() {
  unmap(cur_);
  unmap(spare_map_);
}

void SegmentFile::unmap(Map& m) {
  if (m.p) ::munmap(m.p, m.len);
  if (m.fd >= 0) ::close(m.fd);
  m = Map{};
}

unsigned char* SegmentFile::reserve(uint64_t bytes) {
  Map& m = spare_map_;
  if (m.fd < 0) m.fd = ::open(spare_.c_str(), O_RDWR | O_CREAT, 0600);
  MT_CHECK(m.fd >= 0, "checkpoint", "{}: cannot create the in-memory checkpoint: {}", spare_, std::strerror(errno));
  MT_CHECK(::ftruncate(m.fd, off_t(bytes)) == 0, "checkpoint", "{}: cannot size the in-memory checkpoint to {} bytes: {}",
           spare_, bytes, std::strerror(errno));
  if (bytes > m.len) {  // a file mapping: growing keeps what was written
    if (m.p) ::munmap(m.p, m.len);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
    MT_CHECK(p != MAP_FAILED, "checkpoint", "{}: cannot map {} bytes: {}", spare_, bytes, std::strerror(errno));
    m.p = static_cast<unsigned char*>(p), m.len = bytes;
  }
  return m.p;
}

void SegmentFile::publish(uint64_t bytes) {
  MT_CHECK(spare_map_.fd >= 0 && ::ftruncate(spare_map_.fd, off_t(bytes)) == 0, "checkpoint",
           "{}: cannot size the in-memory checkpoint: {}", spare_, std::strerror(errno));
  if (::renameat2(AT_FDCWD, spare_.c_str(), AT_FDCWD, path_.c_str(), RENAME_EXCHANGE) != 0) {
    // No segment at path yet (or a file system without the exchange): a plain rename.
    MT_CHECK(::rename(spare_.c_str(), path_.c_str()) == 0, "checkpoint", "cannot rename {} to {}: {}", spare_, path_,
             std::strerror(errno));
  }
  // The inode written is the published one; the spare's name now holds the previous segment (mapped, or opened by
  // name at the next reserve), or nothing.
  std::swap(cur_, spare_map_);
  cur_bytes_ = bytes;
  if (spare_map_.fd >= 0 && ::access(spare_.c_str(), F_OK) != 0) unmap(spare_map_);
}

void SegmentFile::remove() {
  unmap(cur_);
  unmap(spare_map_);
  ::unlink(spare_.c_str());
  ::unlink(path_.c_str());
}

uint64_t write_segment(SegmentFile& f, const std::vector<std::pair<const void*, size_t>>& pieces, json meta,
                       int64_t fault_step) {
  uint64_t data = 0;
  for (auto& [p, n] : pieces) data += n;
  const uint64_t meta_at = kHead + words_for(data) * 8;
  unsigned char* bytes = f.reserve(meta_at + 4096);
  StreamChecksum sum;
  meta["data_bytes"] = data;
  // The checksum covers the meta without "sum" as parsing gives it back (check_segment's view), then the data.
  std::string text = json::parse(meta.dump()).dump();
  sum.update(text.data(), text.size());
  unsigned char* at = bytes + kHead;
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::memcpy(at, pieces[i].first, pieces[i].second);
    sum.update(at, pieces[i].second);
    at += pieces[i].second;
    if (fault_step >= 0 && i == pieces.size() / 2) fault_memory_checkpoint(fault_step);
  }
  meta["sum"] = sum.hex();
  text = meta.dump();
  const uint64_t total = words_for(meta_at + text.size()) * 8;
  bytes = f.reserve(total);
  std::memcpy(bytes, kMagic, 8);
  std::memcpy(bytes + 8, &data, 8);
  const uint64_t meta_len = text.size();
  std::memcpy(bytes + 16, &meta_len, 8);
  std::memcpy(bytes + meta_at, text.data(), text.size());
  std::memset(bytes + meta_at + text.size(), 0, total - meta_at - text.size());
  f.publish(total);
  return total;
}

SegmentView check_segment(const void* raw, uint64_t size, const std::string& what) {
  const auto* bytes = static_cast<const unsigned char*>(raw);
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
