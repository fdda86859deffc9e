// Token shards in llm.c's two formats and the batch convention built on them.
// A shard: a header of 256 little-endian int32 (magic, version, token count,
// the rest zero), then `count` tokens: magic 20240520 version 1 holds uint16
// tokens (GPT-2's vocabulary and anything up to 65,536), magic 20240801
// version 7 uint32 tokens (Llama 3's 128,256, Qwen2's 151,936); the file's size
// must be 1024 + width * count. Shards are matched by a glob and read in sorted
// order as one concatenated stream (formats may mix).
//
// Loss masks (supervised fine-tuning; written by scripts/prepare_data --chat): the mask of shard X.bin is
// X.mask beside it: a header of 256 little-endian int32 (magic 20241127, version 1, the token count, which must equal
// the shard's, the packing length T or 0 when not packed, the rest zero), then `count` uint8, each 0 or 1: 1 when
// token i of the shard is a trained target (its prediction from the tokens before it counts in the loss). A shard
// without a mask trains every token. Packed data (T > 0) holds whole conversations in each row of T tokens:
// training.seq_len must be a multiple of T, or conversations would straddle rows.
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
constexpr int32_t kMaskMagic = 20241127;  // uint8 loss mask beside a shard
constexpr int32_t kMaskVersion = 1;

struct ShardInfo {
  std::string path;
  int64_t tokens = 0;
};

// Sorted paths matching the glob; none is an error "[data] <key>: no file matches '<glob>'".
std::vector<std::string> glob_files(const std::string& pattern, const std::string& key);

// Writes a shard (used by scripts' tests and by tests): uint16 tokens as version 1, uint32 as version 7.
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);
void write_token_shard_u32(const std::string& path, const std::vector<uint32_t>& tokens);
// Writes a loss mask (values 0 or 1) with its packing length (0: not packed).
void write_loss_mask(const std::string& path, const std::vector<uint8_t>& mask, int32_t packed_len = 0);
// The mask file of a shard: X.bin -> X.mask (any other name gets ".mask" appended).
std::string mask_path_of(const std::string& shard);

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
  // Loss masks: empty when no shard has one (every target trained); else one value per token.
  bool masked() const { return !mask_.empty(); }
  const std::vector<uint8_t>& mask() const { return mask_; }
  int64_t masked_shards() const { return masked_shards_; }
  // The packing length the masks state (0: not packed), and the mask file that stated it.
  int64_t packed_len() const { return packed_len_; }
  const std::string& packed_file() const { return packed_file_; }
  // Trained targets among stream positions [begin, end).
  int64_t trained(int64_t begin, int64_t end) const;
  // Errors unless seq_len is a multiple of the packing length: "[data] data.train: packed in rows of 64 tokens
  // (chat_train_000000.mask) but training.seq_len = 96 is not a multiple: conversations would straddle rows".
  void check_packing(int64_t seq_len) const;
  // Errors when the shards hold no token at all (an empty split), what follows in the message saying what to do:
  // "[data] data.val: chat_val_000000.bin holds no token (an empty split): ...".
  void check_not_empty(const std::string& then) const;
  // Errors when the loss masks keep no target in the (B, T) batches 0 .. batches-1 (wrapping as the steps do), so
  // no step over them has anything to learn from (or to evaluate): "[data] data.train: the loss masks
  // (chat_train_000000.mask) keep no target in the 4 batches of an epoch (batch_size 8 x seq_len 64): ...". A
  // stream without masks trains every target.
  void check_trained(int64_t batches, const std::string& which, int64_t B, int64_t T, const std::string& then) const;

 private:
  std::string key_ = "data";
  std::vector<ShardInfo> shards_;
  std::vector<uint32_t> tokens_;  // both formats, widened
  std::vector<uint8_t> mask_;     // (size()) or empty
  int64_t masked_shards_ = 0, packed_len_ = 0;
  std::string packed_file_;
};

// llm.c's convention. With B sequences of length T per step, a step reads the
// B*T+1 tokens starting at offset s*B*T of the stream (s counted within the
// epoch); inputs are the first B*T, targets the next B*T shifted by one. An
// epoch holds floor((size-1) / (B*T)) steps; step `step` reads batch
// step % steps_per_epoch. A stream too short for one batch is an error:
//   "[data] data.train: 100 tokens are fewer than one batch of B*T+1 = 2049 (batch_size 8 x seq_len 256)"
//
// With loss masks, an untrained target is -1 (the cross-entropy ops ignore targets < 0), and the loss is
// normalised by the trained targets of the whole global batch (trained_targets), the same on every rank and for
// every micro-batch size.
struct Batch {
  Tensor inputs;   // (B, T) i32
  Tensor targets;  // (B, T) i32, -1 where the mask says untrained
  int64_t epoch = 0;
  int64_t offset = 0;  // token offset in the stream
};
int64_t steps_per_epoch(const TokenStream& s, int64_t B, int64_t T);
// Rows [row_begin, row_begin + rows) of the global (B, T) batch for `step`
// (a data-parallel rank takes its B/dp rows).
Batch get_batch(const TokenStream& s, int64_t step, int64_t B, int64_t T, int64_t row_begin, int64_t rows);
// The trained targets of step `step`'s whole (B, T) batch (B*T without masks): every rank computes it alone.
int64_t trained_targets(const TokenStream& s, int64_t step, int64_t B, int64_t T);

}  // namespace mt
