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

template <class T> void write_shard(const std::string& path, const std::vector<T>& tokens, int32_t magic, int32_t version) {
  MT_CHECK(tokens.size() <= size_t(INT32_MAX), "data", "{}: {} tokens do not fit a shard's int32 count", path,
           tokens.size());
  int32_t header[256] = {};  // little-endian on every host this builds for
  header[0] = magic;
  header[1] = version;
  header[2] = int32_t(tokens.size());
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

TokenStream::TokenStream(const std::string& glob, int64_t vocab_size, const std::string& key) : key_(key) {
  for (const std::string& path : glob_files(glob, key)) {
    std::error_code ec;
    int64_t size = int64_t(std::filesystem::file_size(path, ec));
    MT_CHECK(!ec, "data", "{}: cannot read ({})", path, ec.message());
    MT_CHECK(size >= 1024, "data", "{}: {} bytes is shorter than the 1024-byte header (truncated file?)", path, size);
    std::ifstream f(path, std::ios::binary);
    int32_t header[256];
    f.read(reinterpret_cast<char*>(header), sizeof(header));
    MT_CHECK(f.good(), "data", "{}: cannot read the header", path);
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
  return batch;
}

}  // namespace mt
