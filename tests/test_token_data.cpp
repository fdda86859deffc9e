// Token shards (llm.c's format and batch convention) and safetensors files:
// exact batch contents, the epoch wrap, a data-parallel rank's rows, round
// trips, and the error messages of malformed files.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "check_error.h"
#include "runtime/io/safetensors.h"
#include "runtime/io/token_data.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("mt_test_io_" + std::to_string(::getpid()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& n) const { return (path / n).string(); }
};

void write_raw(const std::string& path, std::vector<int32_t> header, const std::vector<uint16_t>& tokens, size_t cut = 0) {
  header.resize(256, 0);
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size() - cut));
}

}  // namespace

TEST_CASE("data: shards in sorted order, batches, the epoch wrap, a rank's rows") {
  TempDir d;
  std::vector<uint16_t> all;
  for (int s = 2; s >= 0; --s) {  // written in reverse: read back sorted
    std::vector<uint16_t> t;
    for (int i = 0; i < 10; ++i) t.push_back(uint16_t(s * 10 + i));
    write_token_shard(d / ("s_" + std::to_string(s) + ".bin"), t);
  }
  for (int i = 0; i < 30; ++i) all.push_back(uint16_t(i));
  TokenStream ts(d / "s_*.bin", 256);
  REQUIRE(ts.size() == 30);
  CHECK(ts.tokens() == all);
  CHECK(ts.shards().size() == 3);
  // B = 2, T = 3: 6 tokens a step, floor(29 / 6) = 4 steps an epoch.
  CHECK(steps_per_epoch(ts, 2, 3) == 4);
  for (int64_t step : {0, 1, 3, 4, 9}) {
    Batch b = get_batch(ts, step, 2, 3, 0, 2);
    int64_t off = (step % 4) * 6;
    CHECK(b.epoch == step / 4);
    CHECK(b.offset == off);
    for (int64_t i = 0; i < 6; ++i) {
      CHECK(b.inputs.at<int32_t>(i) == off + i);
      CHECK(b.targets.at<int32_t>(i) == off + i + 1);
    }
    Batch r1 = get_batch(ts, step, 2, 3, 1, 1);  // dp rank 1 of 2: the second row
    for (int64_t i = 0; i < 3; ++i) CHECK(r1.inputs.at<int32_t>(i) == b.inputs.at<int32_t>(3 + i));
  }
  CHECK_ERROR_CONTAINS(TokenStream(d / "s_*.bin", 25), "token 25 at offset 1034 >= vocab_size 25");
  CHECK_ERROR_CONTAINS(steps_per_epoch(ts, 5, 6), "30 tokens are fewer than one batch of B*T+1 = 31");
  CHECK_ERROR_CONTAINS(TokenStream(d / "none_*.bin", 256, "data.val"), "data.val: no file matches");
}

TEST_CASE("data: malformed shards name the file and the offset") {
  TempDir d;
  write_raw(d / "magic.bin", {1234, 1, 2}, {1, 2});
  write_raw(d / "version.bin", {20240520, 7, 2}, {1, 2});
  write_raw(d / "size.bin", {20240520, 1, 5}, {1, 2});
  write_raw(d / "trunc.bin", {20240520, 1, 2}, {1, 2}, 1);
  write_raw(d / "short.bin", {20240520, 1, 2}, {}, 600);
  write_raw(d / "vocab.bin", {20240520, 1, 3}, {1, 2, 300});
  CHECK_ERROR_CONTAINS(TokenStream(d / "magic.bin", 256), "magic.bin: bad magic 1234 at offset 0");
  CHECK_ERROR_CONTAINS(TokenStream(d / "version.bin", 256), "version.bin: version 7 at offset 4");
  CHECK_ERROR_CONTAINS(TokenStream(d / "size.bin", 256), "size 1028 does not match");
  CHECK_ERROR_CONTAINS(TokenStream(d / "trunc.bin", 256), "trunc.bin: size 1027 does not match");
  CHECK_ERROR_CONTAINS(TokenStream(d / "short.bin", 256), "shorter than the 1024-byte header");
  CHECK_ERROR_CONTAINS(TokenStream(d / "vocab.bin", 256), "vocab.bin: token 300 at offset 1028 >= vocab_size 256");
}

TEST_CASE("safetensors: round trip, f16 on read, and malformed files") {
  TempDir d;
  Tensor a = from_values({1.5, -2.25, 3.0, 0.1}, {2, 2}, DType::f32);
  Tensor b = from_values({1.0, -0.5, 65504.0}, {3}, DType::bf16);
  Tensor c = from_values({1e-300, 2.0}, {2}, DType::f64);
  Tensor e = from_values({-7, 1LL << 40}, {1, 2}, DType::i64);
  write_safetensors(d / "m.safetensors", {{"a", a}, {"b.weight", b}, {"c", c}, {"e", e}}, {{"step", "12"}});
  CHECK_FALSE(fs::exists(d / "m.safetensors.tmp"));
  SafetensorsFile f = read_safetensors(d / "m.safetensors");
  CHECK(f.metadata.at("step") == "12");
  CHECK(equal(f.tensors.at("a"), a));
  CHECK(equal(f.tensors.at("b.weight").bitcast(DType::u16), b.bitcast(DType::u16)));
  CHECK(equal(f.tensors.at("c"), c));
  CHECK(equal(f.tensors.at("e"), e));

  auto write_file = [&](const std::string& name, const std::string& header, const std::string& data,
                        int64_t hl = -1) {
    uint64_t n = hl < 0 ? header.size() : uint64_t(hl);
    std::string bytes(reinterpret_cast<const char*>(&n), 8);
    bytes += header + data;
    std::ofstream(d / name, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    return d / name;
  };
  // f16: 1.0, -2.5, 0, 65504 and the smallest subnormal.
  uint16_t h[5] = {0x3c00, 0xc100, 0x0000, 0x7bff, 0x0001};
  std::string hdata(reinterpret_cast<const char*>(h), 10);
  SafetensorsFile g = read_safetensors(
      write_file("h.safetensors", R"({"x":{"dtype":"F16","shape":[5],"data_offsets":[0,10]}})", hdata));
  auto v = to_f64(g.tensors.at("x"));
  CHECK(v[0] == 1.0);
  CHECK(v[1] == -2.5);
  CHECK(v[2] == 0.0);
  CHECK(v[3] == 65504.0);
  CHECK(v[4] == doctest::Approx(std::ldexp(1.0, -24)));

  CHECK_ERROR_CONTAINS(read_safetensors(write_file("l.safetensors", "{}", "", 999)), "header length 999 exceeds");
  CHECK_ERROR_CONTAINS(read_safetensors(write_file("j.safetensors", "{not json", "")), "not valid JSON");
  CHECK_ERROR_CONTAINS(
      read_safetensors(write_file("o.safetensors", R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcd")),
      "outside the 4 data bytes");
  CHECK_ERROR_CONTAINS(
      read_safetensors(write_file("s.safetensors", R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "abcdefgh")),
      "needs 12 bytes");
  CHECK_ERROR_CONTAINS(
      read_safetensors(write_file("t.safetensors", R"({"x":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", "a")),
      "unsupported dtype Q8");
  CHECK_ERROR_CONTAINS(read_safetensors(d / "missing.safetensors"), "no such file");
}
