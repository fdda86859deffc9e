#include "runtime/io/token_data.h"

#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "runtime/core/error.h"

namespace mt {

std::vector<std::string> glob_files(const std::string& pattern, const std::string& key) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  MT_CHECK(!out.empty(), "data", "{}: no file matches '{}'", key, pattern);
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// A shard (or a mask: uint8 values and header[3] = the packing length).
template <class T>
void write_shard(const std::string& path, const std::vector<T>& tokens, int32_t magic, int32_t version,
                 int32_t packed_len = 0) {
  MT_CHECK(tokens.size() <= size_t(INT32_MAX), "data", "{}: {} values do not fit the header's int32 count", path,
           tokens.size());
  int32_t header[256] = {};  // little-endian on every host this builds for
  header[0] = magic;
  header[1] = version;
  header[2] = int32_t(tokens.size());
  header[3] = packed_len;
  std::ofstream f(path, std::ios::binary);
  MT_CHECK(f.is_open(), "data", "cannot create {}: {}", path, std::strerror(errno));
  f.write(reinterpret_cast<const char*>(header), sizeof(header));
  f.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(T)));
  f.close();
  MT_CHECK(!f.fail(), "data", "cannot write {} (disk full?)", path);
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_shard(path, tokens, kShardMagic, kShardVersion);
}

void write_token_shard_u32(const std::string& path, const std::vector<uint32_t>& tokens) {
  write_shard(path, tokens, kShardMagic32, kShardVersion32);
}

void write_loss_mask(const std::string& path, const std::vector<uint8_t>& mask, int32_t packed_len) {
  write_shard(path, mask, kMaskMagic, kMaskVersion, packed_len);
}

std::string mask_path_of(const std::string& shard) {
  const std::string ext = ".bin";
  if (shard.size() > ext.size() && shard.compare(shard.size() - ext.size(), ext.size(), ext) == 0)
    return shard.substr(0, shard.size() - ext.size()) + ".mask";
  return shard + ".mask";
}

namespace {

// Opens a shard or mask file and reads its 1024-byte header; returns the file's size.
int64_t open_with_header(const std::string& path, std::ifstream& f, int32_t (&header)[256]) {
  std::error_code ec;
  const int64_t size = int64_t(std::filesystem::file_size(path, ec));
  MT_CHECK(!ec, "data", "{}: cannot read ({})", path, ec.message());
  MT_CHECK(size >= 1024, "data", "{}: {} bytes is shorter than the 1024-byte header (truncated file?)", path, size);
  f.open(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  MT_CHECK(f.good(), "data", "{}: cannot read the header", path);
  return size;
}

// Reads shard `shard`'s mask (count values) into out; returns its packing length.
int64_t read_mask(const std::string& path, const std::string& shard, int64_t count, uint8_t* out) {
  int32_t header[256];
  std::ifstream f;
  const int64_t size = open_with_header(path, f, header);
  MT_CHECK(header[0] == kMaskMagic, "data", "{}: bad magic {} at offset 0 (expected {} for a loss mask)", path,
           header[0], kMaskMagic);
  MT_CHECK(header[1] == kMaskVersion, "data", "{}: bad version {} at offset 4 (expected {})", path, header[1],
           kMaskVersion);
  MT_CHECK(header[2] == count, "data", "{}: {} values at offset 8, but its shard {} holds {} tokens", path, header[2],
           shard, count);
  MT_CHECK(header[3] >= 0, "data", "{}: negative packing length {} at offset 12", path, header[3]);
  MT_CHECK(size == 1024 + count, "data", "{}: size {} does not match header: 1024 + {} = {} bytes (truncated file?)",
           path, size, count, 1024 + count);
  if (count > 0) f.read(reinterpret_cast<char*>(out), std::streamsize(count));
  MT_CHECK(f.good(), "data", "{}: cannot read {} values", path, count);
  for (int64_t i = 0; i < count; ++i)
    MT_CHECK(out[i] <= 1, "data", "{}: value {} at offset {} (expected 0 or 1)", path, int(out[i]), 1024 + i);
  return header[3];
}

}  // namespace

TokenStream::TokenStream(const std::string& glob, int64_t vocab_size, const std::string& key) : key_(key) {
  for (const std::string& path : glob_files(glob, key)) {
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".mask") == 0) continue;  // a mask, read beside its shard
    int32_t header[256];
    std::ifstream f;
    const int64_t size = open_with_header(path, f, header);
    MT_CHECK(header[0] == kShardMagic || header[0] == kShardMagic32, "data",
             "{}: bad magic {} at offset 0 (expected {} for uint16 tokens or {} for uint32 tokens)", path, header[0],
             kShardMagic, kShardMagic32);
    const bool wide = header[0] == kShardMagic32;
    const int32_t version = wide ? kShardVersion32 : kShardVersion;
    const int64_t width = wide ? 4 : 2;
    MT_CHECK(header[1] == version, "data", "{}: bad version {} at offset 4 (expected {} with magic {})", path, header[1],
             version, header[0]);
    int64_t count = header[2];
    MT_CHECK(count >= 0, "data", "{}: negative token count {} at offset 8", path, count);
    MT_CHECK(size == 1024 + width * count, "data",
             "{}: size {} does not match header: 1024 + {} x {} = {} bytes (token count at offset 8; truncated file?)",
             path, size, width, count, 1024 + width * count);
    size_t at = tokens_.size();
    tokens_.resize(at + size_t(count));
    uint32_t* t = tokens_.data() + at;
    if (count > 0 && wide) {
      f.read(reinterpret_cast<char*>(t), std::streamsize(4 * count));
    } else if (count > 0) {
      std::vector<uint16_t> narrow(static_cast<size_t>(count));
      f.read(reinterpret_cast<char*>(narrow.data()), std::streamsize(2 * count));
      std::copy(narrow.begin(), narrow.end(), t);
    }
    MT_CHECK(f.good(), "data", "{}: cannot read {} tokens", path, count);
    if (vocab_size > 0)
      for (int64_t i = 0; i < count; ++i)
        MT_CHECK(int64_t(t[i]) < vocab_size, "data", "{}: token {} at offset {} >= vocab_size {}", path, t[i],
                 1024 + width * i, vocab_size);
    shards_.push_back({path, count});
  }
  // Loss masks, where any shard has one (a shard without: every target trained).
  int64_t at = 0;
  for (const ShardInfo& sh : shards_) {
    const std::string mpath = mask_path_of(sh.path);
    std::error_code ec;
    if (std::filesystem::exists(mpath, ec)) {
      if (mask_.empty()) mask_.assign(tokens_.size(), 1);
      const int64_t packed = read_mask(mpath, sh.path, sh.tokens, mask_.data() + at);
      ++masked_shards_;
      if (packed > 0) {
        MT_CHECK(packed_len_ == 0 || packed_len_ == packed, "data",
                 "{}: {} is packed in rows of {} tokens, {} in rows of {}: prepare the shards with one --pack", key_,
                 mpath, packed, packed_file_, packed_len_);
        packed_len_ = packed;
        packed_file_ = mpath;
      }
    }
    at += sh.tokens;
  }
}

int64_t TokenStream::trained(int64_t begin, int64_t end) const {
  begin = std::max<int64_t>(begin, 0);
  end = std::min<int64_t>(end, size());
  if (end <= begin) return 0;
  if (mask_.empty()) return end - begin;
  int64_t n = 0;
  for (int64_t i = begin; i < end; ++i) n += mask_[size_t(i)];
  return n;
}

void TokenStream::check_packing(int64_t seq_len) const {
  MT_CHECK(packed_len_ == 0 || seq_len % packed_len_ == 0, "data",
           "{}: packed in rows of {} tokens ({}) but training.seq_len = {} is not a multiple: conversations would "
           "straddle rows (prepare the data with --pack {} or a divisor of it)",
           key_, packed_len_, packed_file_, seq_len, packed_len_, seq_len);
}

namespace {
// The files of a stream for a message: "a.bin", or "a.bin and 3 more" (their masks: "a.mask ...").
std::string files_of(const std::vector<ShardInfo>& shards, bool masks) {
  std::vector<std::string> names;
  for (const ShardInfo& sh : shards) {
    const std::string path = masks ? mask_path_of(sh.path) : sh.path;
    std::error_code ec;
    if (!masks || std::filesystem::exists(path, ec)) names.push_back(path);
  }
  if (names.empty()) return "no file";
  return names.size() == 1 ? names[0] : fmt::format("{} and {} more", names[0], names.size() - 1);
}
}  // namespace

void TokenStream::check_not_empty(const std::string& then) const {
  MT_CHECK(size() > 0, "data", "{}: {} {} no token (an empty split): {}", key_, files_of(shards_, false),
           shards_.size() == 1 ? "holds" : "hold", then);
}

void TokenStream::check_trained(int64_t batches, const std::string& which, int64_t B, int64_t T,
                                const std::string& then) const {
  if (!masked()) return;
  const int64_t n = std::min(batches, steps_per_epoch(*this, B, T));
  int64_t kept = 0;
  for (int64_t i = 0; i < n && kept == 0; ++i) kept += trained_targets(*this, i, B, T);
  MT_CHECK(kept > 0, "data", "{}: the loss masks ({}) keep no target in {} (batch_size {} x seq_len {}): {}", key_,
           files_of(shards_, true), which, B, T, then);
}

int64_t steps_per_epoch(const TokenStream& s, int64_t B, int64_t T) {
  MT_CHECK(B > 0 && T > 0, "data", "{}: batch_size {} and seq_len {} must be positive", s.key(), B, T);
  MT_CHECK(s.size() >= B * T + 1, "data",
           "{}: {} tokens are fewer than one batch of B*T+1 = {} (batch_size {} x seq_len {})", s.key(), s.size(),
           B * T + 1, B, T);
  return (s.size() - 1) / (B * T);
}

Batch get_batch(const TokenStream& s, int64_t step, int64_t B, int64_t T, int64_t row_begin, int64_t rows) {
  int64_t per_epoch = steps_per_epoch(s, B, T);
  MT_CHECK(step >= 0, "data", "{}: negative step {}", s.key(), step);
  MT_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= B, "data", "{}: rows [{}, {}) outside a batch of {}",
           s.key(), row_begin, row_begin + rows, B);
  Batch batch;
  batch.epoch = step / per_epoch;
  batch.offset = (step % per_epoch) * B * T;
  batch.inputs = empty({rows, T}, DType::i32);   // (rows, T)
  batch.targets = empty({rows, T}, DType::i32);  // (rows, T)
  const uint32_t* src = s.tokens().data() + batch.offset + row_begin * T;
  int32_t* in = rows ? batch.inputs.data<int32_t>() : nullptr;
  int32_t* tg = rows ? batch.targets.data<int32_t>() : nullptr;
  for (int64_t i = 0; i < rows * T; ++i) {
    in[i] = int32_t(src[i]);  // < vocab_size <= INT32_MAX (checked at load and in the config)
    tg[i] = int32_t(src[i + 1]);
  }
  if (s.masked()) {  // an untrained target is -1: the cross-entropy ignores it
    const uint8_t* m = s.mask().data() + batch.offset + row_begin * T + 1;
    for (int64_t i = 0; i < rows * T; ++i)
      if (!m[i]) tg[i] = -1;
  }
  return batch;
}

int64_t trained_targets(const TokenStream& s, int64_t step, int64_t B, int64_t T) {
  const int64_t offset = (step % steps_per_epoch(s, B, T)) * B * T;
  return s.trained(offset + 1, offset + B * T + 1);  // the targets: positions 1..B*T past the offset
}

}  // namespace mt
