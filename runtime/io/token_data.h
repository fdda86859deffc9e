// Token shards in llm.c's two formats and the batch convention built on them.
// A shard: a header of 256 little-endian int32 (magic, version, token count,
// the rest zero), then `count` tokens: magic 20240520 version 1 holds uint16
// tokens (GPT-2's vocabulary and anything up to 65,536), magic 20240801
// version 7 uint32 tokens (Llama 3's 128,256, Qwen2's 151,936); the file's size
// must be 1024 + width * count. Shards are matched by a glob and read in sorted
// order as one concatenated stream (formats may mix).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace mt {

constexpr int32_t kShardMagic = 20240520;  // uint16 tokens
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShardMagic32 = 20240801;  // uint32 tokens
constexpr int32_t kShardVersion32 = 7;

struct ShardInfo {
  std::string path;
  int64_t tokens = 0;
};

// Sorted paths matching the glob; none is an error "[data] <key>: no file matches '<glob>'".
std::vector<std::string> glob_files(const std::string& pattern, const std::string& key);

// Writes a shard (used by scripts' tests and by tests): uint16 tokens as version 1, uint32 as version 7.
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);
void write_token_shard_u32(const std::string& path, const std::vector<uint32_t>& tokens);

// The concatenation of every shard matching a glob, validated when opened:
// wrong magic or version, size mismatch, truncated file, and (when vocab_size > 0)
// a token >= vocab_size are errors naming the file and the byte offset:
//   "[data] train.bin: bad magic 1234 at offset 0 (expected 20240520)"
// Tokens are read into memory (the datasets here are small; a memory-mapped
// reader can replace this without changing the interface).
class TokenStream {
 public:
  TokenStream() = default;
  TokenStream(const std::string& glob, int64_t vocab_size, const std::string& key = "data.train");
  int64_t size() const { return int64_t(tokens_.size()); }
  const std::vector<ShardInfo>& shards() const { return shards_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  const std::string& key() const { return key_; }  // the config key named in errors

 private:
  std::string key_ = "data";
  std::vector<ShardInfo> shards_;
  std::vector<uint32_t> tokens_;  // both formats, widened
};

// llm.c's convention. With B sequences of length T per step, a step reads the
// B*T+1 tokens starting at offset s*B*T of the stream (s counted within the
// epoch); inputs are the first B*T, targets the next B*T shifted by one. An
// epoch holds floor((size-1) / (B*T)) steps; step `step` reads batch
// step % steps_per_epoch. A stream too short for one batch is an error:
//   "[data] data.train: 100 tokens are fewer than one batch of B*T+1 = 2049 (batch_size 8 x seq_len 256)"
struct Batch {
  Tensor inputs;   // (B, T) i32
  Tensor targets;  // (B, T) i32
  int64_t epoch = 0;
  int64_t offset = 0;  // token offset in the stream
};
int64_t steps_per_epoch(const TokenStream& s, int64_t B, int64_t T);
// Rows [row_begin, row_begin + rows) of the global (B, T) batch for `step`
// (a data-parallel rank takes its B/dp rows).
Batch get_batch(const TokenStream& s, int64_t step, int64_t B, int64_t T, int64_t row_begin, int64_t rows);

}  // namespace mt
