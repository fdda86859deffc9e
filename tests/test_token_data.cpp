// Token shards (llm.c's format and batch convention): round trips, glob order,
// exact batch contents, the epoch wrap, a data-parallel rank's rows, and the
// error messages of malformed shards and short streams.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "check_error.h"
#include "runtime/io/token_data.h"
#include "skip.h"

#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// A shard written by hand: header fields, tokens, and `cut` bytes removed from the end.
void write_raw(const std::string& path, std::vector<int32_t> header, const std::vector<uint16_t>& tokens,
               size_t cut = 0) {
  header.resize(256, 0);
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size() - cut));
}

std::vector<uint16_t> iota_tokens(int n, int start = 0) {
  std::vector<uint16_t> t;
  for (int i = 0; i < n; ++i) t.push_back(uint16_t(start + i));
  return t;
}

std::vector<int32_t> values(const Tensor& t) {
  std::vector<int32_t> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = t.at<int32_t>(i);
  return v;
}

// The stream's tokens (uint32) as the uint16 values they were written from.
std::vector<uint32_t> wide(const std::vector<uint16_t>& v) { return std::vector<uint32_t>(v.begin(), v.end()); }

}  // namespace

TEST_CASE("data: a shard round trips and its bytes follow llm.c's layout") {
  test::TempDir d("data");
  std::vector<uint16_t> tokens = {0, 1, 255, 65535, 7};
  write_token_shard(d / "a.bin", tokens);
  CHECK(fs::file_size(d / "a.bin") == 1024 + 2 * tokens.size());
  std::ifstream f(d / "a.bin", std::ios::binary);
  int32_t header[256];
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 5);
  for (int i = 3; i < 256; ++i) REQUIRE(header[i] == 0);

  TokenStream ts(d / "a.bin", 0);  // vocab_size 0: no vocabulary check
  CHECK(ts.size() == 5);
  CHECK(ts.tokens() == wide(tokens));
  REQUIRE(ts.shards().size() == 1);
  CHECK(ts.shards()[0].path == d / "a.bin");
  CHECK(ts.shards()[0].tokens == 5);
  CHECK(ts.key() == "data.train");

  write_token_shard(d / "empty.bin", std::vector<uint16_t>{});  // an empty shard is valid
  CHECK(TokenStream(d / "empty.bin", 256).size() == 0);
}

TEST_CASE("data: a glob reads several shards in sorted order as one stream") {
  test::TempDir d("data");
  // Written out of order: 2, 0, 10, 1 (zero-padded names sort numerically).
  for (int s : {2, 0, 10, 1}) {
    char name[64];
    std::snprintf(name, sizeof(name), "tiny_train_%06d.bin", s);
    write_token_shard(d / name, iota_tokens(4 + s, 100 * s));
  }
  write_token_shard(d / "tiny_val_000000.bin", std::vector<uint16_t>{9, 9});  // not matched
  CHECK(glob_files(d / "tiny_train_*.bin", "data.train") ==
        std::vector<std::string>{d / "tiny_train_000000.bin", d / "tiny_train_000001.bin", d / "tiny_train_000002.bin",
                                 d / "tiny_train_000010.bin"});
  TokenStream ts(d / "tiny_train_*.bin", 2000);
  std::vector<uint16_t> want;
  for (int s : {0, 1, 2, 10}) {
    auto t = iota_tokens(4 + s, 100 * s);
    want.insert(want.end(), t.begin(), t.end());
  }
  CHECK(ts.tokens() == wide(want));
  REQUIRE(ts.shards().size() == 4);
  CHECK(ts.shards()[3].path == d / "tiny_train_000010.bin");
  CHECK(ts.shards()[3].tokens == 14);
  CHECK(ts.size() == 4 + 5 + 6 + 14);
}

TEST_CASE("data: batches follow llm.c's convention, wrap to the next epoch, and split into a rank's rows") {
  test::TempDir d("data");
  // 30 tokens 0..29 in three shards; token value == stream position.
  for (int s = 0; s < 3; ++s) write_token_shard(d / ("s_" + std::to_string(s) + ".bin"), iota_tokens(10, 10 * s));
  TokenStream ts(d / "s_*.bin", 256);
  REQUIRE(ts.size() == 30);
  // B = 2, T = 3: 6 tokens a step, floor(29 / 6) = 4 steps an epoch.
  const int64_t B = 2, T = 3;
  CHECK(steps_per_epoch(ts, B, T) == 4);

  Batch b0 = get_batch(ts, 0, B, T, 0, B);
  CHECK(b0.inputs.shape() == Shape{2, 3});
  CHECK(b0.inputs.dtype() == DType::i32);
  CHECK(b0.targets.shape() == Shape{2, 3});
  CHECK(b0.epoch == 0);
  CHECK(b0.offset == 0);
  CHECK(values(b0.inputs) == std::vector<int32_t>{0, 1, 2, 3, 4, 5});
  CHECK(values(b0.targets) == std::vector<int32_t>{1, 2, 3, 4, 5, 6});

  Batch b1 = get_batch(ts, 1, B, T, 0, B);
  CHECK(b1.epoch == 0);
  CHECK(b1.offset == 6);
  CHECK(values(b1.inputs) == std::vector<int32_t>{6, 7, 8, 9, 10, 11});
  CHECK(values(b1.targets) == std::vector<int32_t>{7, 8, 9, 10, 11, 12});

  // The last batch of the epoch reads tokens 18..24; tokens 25..29 are never inputs.
  Batch b3 = get_batch(ts, 3, B, T, 0, B);
  CHECK(b3.epoch == 0);
  CHECK(values(b3.inputs) == std::vector<int32_t>{18, 19, 20, 21, 22, 23});
  CHECK(values(b3.targets) == std::vector<int32_t>{19, 20, 21, 22, 23, 24});

  // Step 4 wraps: epoch 1, batch 0 again; step 9 is epoch 2, batch 1.
  Batch b4 = get_batch(ts, 4, B, T, 0, B);
  CHECK(b4.epoch == 1);
  CHECK(b4.offset == 0);
  CHECK(values(b4.inputs) == values(b0.inputs));
  CHECK(values(b4.targets) == values(b0.targets));
  Batch b9 = get_batch(ts, 9, B, T, 0, B);
  CHECK(b9.epoch == 2);
  CHECK(b9.offset == 6);
  CHECK(values(b9.inputs) == values(b1.inputs));

  // A data-parallel rank's rows equal the corresponding rows of the full batch.
  for (int64_t step : {0, 1, 3, 4, 9}) {
    Batch full = get_batch(ts, step, B, T, 0, B);
    for (int64_t r = 0; r < B; ++r) {
      Batch mine = get_batch(ts, step, B, T, r, 1);
      CHECK(mine.inputs.shape() == Shape{1, 3});
      CHECK(mine.epoch == full.epoch);
      CHECK(mine.offset == full.offset);
      CHECK(values(mine.inputs) == values(full.inputs.slice0(r, r + 1)));
      CHECK(values(mine.targets) == values(full.targets.slice0(r, r + 1)));
    }
  }
  // B = 4, T = 2 over two ranks of 2 rows each.
  Batch full = get_batch(ts, 2, 4, 2, 0, 4);
  CHECK(full.offset == 16);
  Batch hi = get_batch(ts, 2, 4, 2, 2, 2);
  CHECK(values(hi.inputs) == std::vector<int32_t>{20, 21, 22, 23});
  CHECK(values(hi.targets) == std::vector<int32_t>{21, 22, 23, 24});
  CHECK(values(hi.inputs) == values(full.inputs.slice0(2, 4)));

  CHECK_ERROR_CONTAINS(get_batch(ts, 0, B, T, 1, 2), "[data] data.train: rows [1, 3) outside a batch of 2");
}

TEST_CASE("data: a stream exactly one batch long has one step; a shorter one is an error") {
  test::TempDir d("data");
  write_token_shard(d / "seven.bin", iota_tokens(7));
  TokenStream ts(d / "seven.bin", 256, "data.val");
  CHECK(steps_per_epoch(ts, 2, 3) == 1);  // B*T+1 = 7 tokens
  CHECK(get_batch(ts, 5, 2, 3, 0, 2).epoch == 5);
  CHECK_ERROR_CONTAINS(steps_per_epoch(ts, 2, 4),
                       "[data] data.val: 7 tokens are fewer than one batch of B*T+1 = 9 (batch_size 2 x seq_len 4)");
  write_token_shard(d / "hundred.bin", iota_tokens(100));
  TokenStream h(d / "hundred.bin", 256);
  CHECK_ERROR_CONTAINS(
      get_batch(h, 0, 8, 256, 0, 8),
      "[data] data.train: 100 tokens are fewer than one batch of B*T+1 = 2049 (batch_size 8 x seq_len 256)");
}

TEST_CASE("data: malformed shards name the file and the offset") {
  test::TempDir d("data");
  write_raw(d / "magic.bin", {1234, 1, 2}, {1, 2});
  write_raw(d / "version.bin", {20240520, 7, 2}, {1, 2});
  write_raw(d / "size.bin", {20240520, 1, 600}, std::vector<uint16_t>(488, 1));  // 1024 + 976 = 2000 bytes
  write_raw(d / "trunc.bin", {20240520, 1, 2}, {1, 2}, 1);
  write_raw(d / "short.bin", {20240520, 1, 2}, {}, 600);
  write_raw(d / "negative.bin", {20240520, 1, -5}, {});
  write_raw(d / "vocab.bin", {20240520, 1, 5}, {1, 2, 3, 300, 4});
  CHECK_ERROR_CONTAINS(TokenStream(d / "magic.bin", 256),
                       "[data] " + d / "magic.bin" + ": bad magic 1234 at offset 0 (expected 20240520 for uint16 tokens");
  CHECK_ERROR_CONTAINS(TokenStream(d / "version.bin", 256),
                       "[data] " + d / "version.bin" + ": bad version 7 at offset 4 (expected 1 with magic 20240520)");
  CHECK_ERROR_CONTAINS(TokenStream(d / "size.bin", 256),
                       "[data] " + d / "size.bin" + ": size 2000 does not match header: 1024 + 2 x 600 = 2224 bytes");
  CHECK_ERROR_CONTAINS(TokenStream(d / "size.bin", 256), "truncated file?");
  CHECK_ERROR_CONTAINS(TokenStream(d / "trunc.bin", 256),
                       d / "trunc.bin" + ": size 1027 does not match header: 1024 + 2 x 2 = 1028 bytes");
  CHECK_ERROR_CONTAINS(TokenStream(d / "short.bin", 256),
                       d / "short.bin" + ": 424 bytes is shorter than the 1024-byte header (truncated file?)");
  CHECK_ERROR_CONTAINS(TokenStream(d / "negative.bin", 256),
                       d / "negative.bin" + ": negative token count -5 at offset 8");
  CHECK_ERROR_CONTAINS(TokenStream(d / "vocab.bin", 256),
                       "[data] " + d / "vocab.bin" + ": token 300 at offset 1030 >= vocab_size 256");
  CHECK(TokenStream(d / "vocab.bin", 301).size() == 5);
  CHECK(TokenStream(d / "vocab.bin", 0).size() == 5);  // no vocabulary check

  // A bad shard among good ones is named, not the first file.
  write_token_shard(d / "m_0.bin", {1, 2, 3});
  write_raw(d / "m_1.bin", {20240520, 1, 3}, {1, 2, 3}, 2);
  CHECK_ERROR_CONTAINS(TokenStream(d / "m_*.bin", 256), d / "m_1.bin" + ": size 1028 does not match header");
}

TEST_CASE("data: a glob matching no file is an error naming the key and the pattern") {
  test::TempDir d("data");
  CHECK_ERROR_CONTAINS(glob_files(d / "none_*.bin", "data.train"),
                       "[data] data.train: no file matches '" + d / "none_*.bin" + "'");
  CHECK_ERROR_CONTAINS(TokenStream(d / "none_*.bin", 256, "data.val"),
                       "[data] data.val: no file matches '" + d / "none_*.bin" + "'");
  CHECK_ERROR_CONTAINS(TokenStream("/nonexistent_dir_mt/x.bin", 256), "[data] data.train: no file matches");
}

TEST_CASE("data: scripts/prepare_data writes byte-level shards the reader accepts") {
  // From the repository root (scripts/test.sh) or the build directory.
  std::vector<fs::path> candidates = {"scripts/prepare_data", "../scripts/prepare_data"};
  if (fs::path(__FILE__).is_absolute())
    candidates.insert(candidates.begin(), fs::path(__FILE__).parent_path().parent_path() / "scripts/prepare_data");
  fs::path script;
  for (const fs::path& p : candidates)
    if (script.empty() && fs::exists(p)) script = p;
  if (script.empty() || !fs::exists("/usr/bin/python3"))
    MT_SKIP("scripts/prepare_data or /usr/bin/python3 not found from the working directory");
  test::TempDir d("data");
  fs::create_directories(d.path / "in");
  std::ofstream(d / "in/a.txt") << "hello world\n";
  std::ofstream(d / "in/b.txt") << "caf\xc3\xa9\n";  // a two-byte UTF-8 character
  std::string cmd = "/usr/bin/python3 " + script.string() + " --out " + d / "out" + " --name t --val-fraction 0.3 " +
                    "--shard-tokens 8 " + d / "in" + " > " + d / "log" + " 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  TokenStream train(d / "out/t_train_*.bin", 256);
  TokenStream val(d / "out/t_val_*.bin", 256, "data.val");
  CHECK(train.shards().size() >= 2);  // 8 tokens a shard
  for (const ShardInfo& s : train.shards()) CHECK(s.tokens <= 8);
  std::string all;
  for (uint32_t t : train.tokens()) all += char(t);
  for (uint32_t t : val.tokens()) all += char(t);
  CHECK(all.find("hello world\n") == 0);
  CHECK(all.find("caf\xc3\xa9\n") != std::string::npos);
  CHECK(val.size() > 0);
}

// ---------------------------------------------------------------- uneven shards, batches across shard edges, offsets

TEST_CASE("data: batches over three uneven shards equal the stream's tokens, across shard edges and epochs") {
  test::TempDir d("data");
  // Shards of 7, 11 and 5 tokens, written out of order; values are distinct and not their positions.
  std::vector<uint16_t> stream;
  std::vector<std::vector<uint16_t>> shards(3);
  const int sizes[3] = {7, 11, 5};
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < sizes[s]; ++i) shards[size_t(s)].push_back(uint16_t(1000 + 37 * s + 3 * i));
  for (int s : {2, 0, 1}) write_token_shard(d / ("part_" + std::to_string(s) + ".bin"), shards[size_t(s)]);
  for (const auto& sh : shards) stream.insert(stream.end(), sh.begin(), sh.end());
  TokenStream ts(d / "part_*.bin", 2000);
  REQUIRE(ts.size() == 23);
  CHECK(ts.tokens() == wide(stream));
  REQUIRE(ts.shards().size() == 3);
  for (int s = 0; s < 3; ++s) {
    CHECK(ts.shards()[size_t(s)].path == d / ("part_" + std::to_string(s) + ".bin"));
    CHECK(ts.shards()[size_t(s)].tokens == sizes[s]);
  }
  const int64_t B = 2, T = 4;
  const int64_t spe = steps_per_epoch(ts, B, T);
  CHECK(spe == (23 - 1) / (B * T));  // 2
  CHECK(spe == 2);
  for (int64_t step = 0; step < 7; ++step) {
    CAPTURE(step);
    Batch full = get_batch(ts, step, B, T, 0, B);
    const int64_t off = (step % spe) * B * T;
    CHECK(full.epoch == step / spe);
    CHECK(full.offset == off);
    REQUIRE(full.inputs.shape() == Shape{B, T});
    REQUIRE(full.targets.shape() == Shape{B, T});
    CHECK(full.targets.dtype() == DType::i32);
    for (int64_t i = 0; i < B * T; ++i) {
      CHECK(full.inputs.at<int32_t>(i) == stream[size_t(off + i)]);
      CHECK(full.targets.at<int32_t>(i) == stream[size_t(off + i + 1)]);
    }
    for (int64_t r = 0; r < B; ++r) {
      Batch mine = get_batch(ts, step, B, T, r, 1);
      for (int64_t i = 0; i < T; ++i) {
        CHECK(mine.inputs.at<int32_t>(i) == full.inputs.at<int32_t>(r * T + i));
        CHECK(mine.targets.at<int32_t>(i) == full.targets.at<int32_t>(r * T + i));
      }
    }
  }
  // Step steps_per_epoch is batch 0 of epoch 1, bit for bit.
  Batch b0 = get_batch(ts, 0, B, T, 0, B), bw = get_batch(ts, spe, B, T, 0, B);
  CHECK(bw.epoch == 1);
  CHECK(bw.offset == 0);
  CHECK(equal(bw.inputs, b0.inputs));
  CHECK(equal(bw.targets, b0.targets));
  // Exact values of step 1 (offset 8: crosses from shard 0 into shard 1 at stream position 7).
  Batch b1 = get_batch(ts, 1, B, T, 0, B);
  CHECK(b1.inputs.at<int32_t>(0) == 1000 + 37 * 1 + 3 * 1);  // stream[8] = shard 1, token 1
  CHECK(b0.inputs.at<int32_t>(6) == 1000 + 3 * 6);           // stream[6] = shard 0, last token
  CHECK(b0.inputs.at<int32_t>(7) == 1037);                   // stream[7] = shard 1, token 0
  CHECK(b0.targets.at<int32_t>(6) == 1037);
}

TEST_CASE("data: a third token over the vocabulary names offset 1028; header-only and short files") {
  test::TempDir d("data");
  write_raw(d / "v.bin", {20240520, 1, 4}, {5, 6, 300, 7});
  CHECK_ERROR_CONTAINS(TokenStream(d / "v.bin", 256), "token 300 at offset 1028 >= vocab_size 256");
  CHECK_ERROR_CONTAINS(TokenStream(d / "v.bin", 300), "token 300 at offset 1028 >= vocab_size 300");
  CHECK(TokenStream(d / "v.bin", 301).size() == 4);

  write_raw(d / "header_only.bin", {20240520, 1, 0}, {});  // exactly 1024 bytes: a valid empty shard
  CHECK(fs::file_size(d / "header_only.bin") == 1024);
  CHECK(TokenStream(d / "header_only.bin", 256).size() == 0);

  write_raw(d / "h1023.bin", {20240520, 1, 0}, {}, 1);
  CHECK_ERROR_CONTAINS(TokenStream(d / "h1023.bin", 256), "shorter than the 1024-byte header");
  std::ofstream(d / "zero.bin", std::ios::binary).flush();
  CHECK_ERROR_CONTAINS(TokenStream(d / "zero.bin", 256), "shorter than the 1024-byte header");

  // Magic and version as given in the brief's examples, by substring.
  write_raw(d / "m.bin", {1234, 1, 0}, {});
  CHECK_ERROR_CONTAINS(TokenStream(d / "m.bin", 256), "bad magic 1234 at offset 0");
  write_raw(d / "ver.bin", {20240520, 7, 0}, {});
  CHECK_ERROR_CONTAINS(TokenStream(d / "ver.bin", 256), "version 7 at offset 4");
  write_raw(d / "count.bin", {20240520, 1, 3}, {1, 2});
  CHECK_ERROR_CONTAINS(TokenStream(d / "count.bin", 256), "does not match");

  // A stream of 1 token is shorter than any batch.
  write_token_shard(d / "one.bin", {42});
  TokenStream one(d / "one.bin", 256);
  CHECK_ERROR_CONTAINS(steps_per_epoch(one, 1, 1), "fewer than one batch");
  CHECK_ERROR_CONTAINS(get_batch(one, 0, 1, 1, 0, 1), "fewer than one batch");
  write_token_shard(d / "two.bin", {42, 43});
  TokenStream two(d / "two.bin", 256);
  CHECK(steps_per_epoch(two, 1, 1) == 1);
  Batch b = get_batch(two, 3, 1, 1, 0, 1);
  CHECK(b.inputs.at<int32_t>(0) == 42);
  CHECK(b.targets.at<int32_t>(0) == 43);
  CHECK(b.epoch == 3);

  CHECK_ERROR_CONTAINS(TokenStream(d / "nothing_*.bin", 256), "no file matches");
}

TEST_CASE("data: uint32 shards (magic 20240801, version 7) round trip, mix with uint16 ones, and are checked") {
  test::TempDir d("data");
  // Llama 3 and Qwen2 ids, past uint16.
  std::vector<uint32_t> big = {0, 65535, 65536, 128255, 151935, 7};
  write_token_shard_u32(d / "m_1.bin", big);
  CHECK(fs::file_size(d / "m_1.bin") == 1024 + 4 * big.size());
  std::ifstream f(d / "m_1.bin", std::ios::binary);
  int32_t header[256];
  f.read(reinterpret_cast<char*>(header), sizeof(header));
  CHECK(header[0] == 20240801);
  CHECK(header[1] == 7);
  CHECK(header[2] == 6);
  write_token_shard(d / "m_0.bin", std::vector<uint16_t>{3, 4});  // a uint16 shard first in sorted order
  TokenStream ts(d / "m_*.bin", 151936);
  std::vector<uint32_t> want{3, 4};
  want.insert(want.end(), big.begin(), big.end());
  CHECK(ts.tokens() == want);
  Batch b = get_batch(ts, 1, 1, 3, 0, 1);  // tokens 3..5 and 4..6 of the stream
  CHECK(b.inputs.at<int32_t>(1) == 65536);
  CHECK(b.targets.at<int32_t>(2) == 151935);
  // A token past the vocabulary names the file and its byte offset (1024 + 4 x index).
  CHECK_ERROR_CONTAINS(TokenStream(d / "m_1.bin", 128256, "data.train"),
                       "m_1.bin: token 151935 at offset 1040 >= vocab_size 128256");
  // A version that does not go with the magic, and an unknown magic, name both formats.
  {
    std::fstream g(d / "m_1.bin", std::ios::in | std::ios::out | std::ios::binary);
    int32_t v = 1;
    g.seekp(4);
    g.write(reinterpret_cast<const char*>(&v), 4);
  }
  CHECK_ERROR_CONTAINS(TokenStream(d / "m_1.bin", 0), "bad version 1 at offset 4 (expected 7 with magic 20240801)");
  {
    std::fstream g(d / "m_1.bin", std::ios::in | std::ios::out | std::ios::binary);
    int32_t m = 1234;
    g.write(reinterpret_cast<const char*>(&m), 4);
  }
  CHECK_ERROR_CONTAINS(TokenStream(d / "m_1.bin", 0),
                       "bad magic 1234 at offset 0 (expected 20240520 for uint16 tokens or 20240801 for uint32 tokens)");
  // A truncated uint32 shard: its size against 1024 + 4 x count.
  write_token_shard_u32(d / "t.bin", big);
  fs::resize_file(d / "t.bin", 1024 + 4 * 5);
  CHECK_ERROR_CONTAINS(TokenStream(d / "t.bin", 0), "does not match header: 1024 + 4 x 6 = 1048 bytes");
}

TEST_CASE("data: loss masks beside shards: masked targets are -1, the batch's trained count, packing, errors") {
  test::TempDir d("data");
  // Two shards, the first masked, the second without a mask (every target trained).
  std::vector<uint16_t> a{10, 11, 12, 13, 14, 15}, b{20, 21, 22, 23};
  write_token_shard(d / "s_0.bin", a);
  write_token_shard(d / "s_1.bin", b);
  write_loss_mask(d / "s_0.mask", {1, 0, 0, 1, 1, 0}, 0);
  CHECK(mask_path_of("x/s_0.bin") == "x/s_0.mask");
  CHECK(mask_path_of("x/s_0.dat") == "x/s_0.dat.mask");
  TokenStream ts(d / "s_*", 256);  // a glob that also matches the mask: the mask is not read as a shard
  REQUIRE(ts.shards().size() == 2);
  CHECK(ts.masked());
  CHECK(ts.masked_shards() == 1);
  CHECK(ts.mask() == std::vector<uint8_t>{1, 0, 0, 1, 1, 0, 1, 1, 1, 1});
  // B 2, T 2: step 0 reads stream positions 0..4; targets are positions 1..4, mask 0 0 1 1.
  Batch full = get_batch(ts, 0, 2, 2, 0, 2);
  CHECK(full.targets.at<int32_t>(0) == -1);
  CHECK(full.targets.at<int32_t>(1) == -1);
  CHECK(full.targets.at<int32_t>(2) == 13);
  CHECK(full.targets.at<int32_t>(3) == 14);
  CHECK(full.inputs.at<int32_t>(0) == 10);  // inputs are never masked
  CHECK(trained_targets(ts, 0, 2, 2) == 2);
  // Step 1: targets are positions 5..8, mask 0 1 1 1; a rank's rows see the same targets as the whole batch's.
  CHECK(trained_targets(ts, 1, 2, 2) == 3);
  Batch hi = get_batch(ts, 1, 2, 2, 1, 1);
  CHECK(hi.targets.at<int32_t>(0) == 21);
  CHECK(hi.targets.at<int32_t>(1) == 22);
  // Without masks every target counts.
  TokenStream plain(d / "s_1.bin", 256);
  CHECK(!plain.masked());
  CHECK(trained_targets(plain, 0, 1, 3) == 3);
  // Packing: seq_len must be a multiple of the rows the data was packed in.
  write_loss_mask(d / "s_0.mask", {1, 0, 0, 1, 1, 0}, 3);
  TokenStream packed(d / "s_*.bin", 256, "data.train");
  CHECK(packed.packed_len() == 3);
  packed.check_packing(6);
  CHECK_ERROR_CONTAINS(packed.check_packing(4), "[data] data.train: packed in rows of 3 tokens");
  CHECK_ERROR_CONTAINS(packed.check_packing(4), "s_0.mask) but training.seq_len = 4 is not a multiple");
  // Damaged masks name the file.
  write_loss_mask(d / "s_0.mask", {1, 0, 0}, 0);
  CHECK_ERROR_CONTAINS(TokenStream(d / "s_0.bin", 256), "s_0.mask: 3 values at offset 8, but its shard");
  write_loss_mask(d / "s_0.mask", {1, 0, 2, 1, 1, 0}, 0);
  CHECK_ERROR_CONTAINS(TokenStream(d / "s_0.bin", 256), "s_0.mask: value 2 at offset 1026 (expected 0 or 1)");
  write_token_shard(d / "s_0.mask", a);  // a token shard where the mask belongs
  CHECK_ERROR_CONTAINS(TokenStream(d / "s_0.bin", 256), "s_0.mask: bad magic 20240520 at offset 0 (expected 20241127");
  write_loss_mask(d / "s_0.mask", {1, 0, 0, 1, 1, 0}, 0);
  fs::resize_file(d / "s_0.mask", 1024 + 4);
  CHECK_ERROR_CONTAINS(TokenStream(d / "s_0.bin", 256), "s_0.mask: size 1028 does not match header");
}

TEST_CASE("data: masks that keep no target of the batches used, and an empty split, are errors naming the files") {
  test::TempDir d("data");
  // 9 tokens, B 2 x T 2: 2 batches an epoch (targets at positions 1..4 and 5..8); position 0 is never a target.
  write_token_shard(d / "s_0.bin", std::vector<uint16_t>{10, 11, 12, 13, 14, 15, 16, 17, 18});
  write_loss_mask(d / "s_0.mask", {1, 0, 0, 0, 0, 0, 0, 0, 0}, 0);
  TokenStream none(d / "s_0.bin", 256, "data.train");
  CHECK_ERROR_CONTAINS(none.check_trained(2, "both batches", 2, 2, "nothing to train on"),
                       "[data] data.train: the loss masks (");
  CHECK_ERROR_CONTAINS(none.check_trained(2, "both batches", 2, 2, "nothing to train on"),
                       "s_0.mask) keep no target in both batches (batch_size 2 x seq_len 2): nothing to train on");
  // One trained target in batch 1: the epoch trains (one empty batch is only skipped); its first batch alone not.
  write_loss_mask(d / "s_0.mask", {1, 0, 0, 0, 0, 0, 1, 0, 0}, 0);
  TokenStream late(d / "s_0.bin", 256, "data.val");
  late.check_trained(2, "an epoch", 2, 2, "");
  late.check_trained(5, "5 batches, wrapping", 2, 2, "");
  CHECK_ERROR_CONTAINS(late.check_trained(1, "the first batch", 2, 2, ""), "keep no target in the first batch");
  // Without masks every target trains.
  write_token_shard(d / "p_0.bin", std::vector<uint16_t>{1, 2, 3, 4, 5});
  TokenStream(d / "p_0.bin", 256).check_trained(1, "a batch", 2, 2, "");
  // An empty shard: its name and what to do.
  write_token_shard(d / "e_0.bin", std::vector<uint16_t>{});
  TokenStream empty(d / "e_0.bin", 256, "data.val");
  CHECK_ERROR_CONTAINS(empty.check_not_empty("set data.val: ''"),
                       "e_0.bin holds no token (an empty split): set data.val: ''");
  TokenStream(d / "p_0.bin", 256).check_not_empty("");
}
