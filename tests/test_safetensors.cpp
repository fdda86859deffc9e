// safetensors files: round trips of every written dtype with metadata, f16 on
// read, the tmp + rename write, and the error messages of malformed files.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "check_error.h"
#include "runtime/io/safetensors.h"

#include "test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A file written by hand: the 8-byte header length (or `hl` when given), the header, the data.
std::string write_file(const test::TempDir& d, const std::string& name, const std::string& header,
                       const std::string& data, int64_t hl = -1) {
  uint64_t n = hl < 0 ? header.size() : uint64_t(hl);
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  bytes += header + data;
  std::ofstream(d / name, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  return d / name;
}

}  // namespace

TEST_CASE("safetensors: f32, bf16, f64, i32 and i64 round trip with metadata") {
  test::TempDir d("safetensors");
  Tensor a = from_values({1.5, -2.25, 3.0, 0.1}, {2, 2}, DType::f32);
  Tensor b = from_values({1.0, -0.5, 65504.0}, {3}, DType::bf16);
  Tensor c = from_values({1e-300, 2.0, -1.0 / 3}, {3, 1}, DType::f64);
  Tensor e = from_values({-7, double(1LL << 40)}, {1, 2}, DType::i64);
  Tensor i = from_values({-3, 2147483647}, {2}, DType::i32);
  Tensor z = empty({0, 4}, DType::f32);
  Tensor big = from_values({1, 2, 3, 4, 5, 6, 7, 8}, {8}, DType::f32);
  Tensor view = big.slice0(2, 5);  // a view at an element offset writes its own elements
  const std::string path = d / "m.safetensors";
  write_safetensors(path, {{"a", a}, {"b.weight", b}, {"c", c}, {"e", e}, {"i", i}, {"empty", z}, {"view", view}},
                    {{"format", "pt"}, {"step", "12"}});
  CHECK(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile f = read_safetensors(path);
  CHECK(f.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}});
  CHECK(f.tensors.size() == 7);
  CHECK(equal(f.tensors.at("a"), a));
  CHECK(f.tensors.at("b.weight").dtype() == DType::bf16);
  CHECK(equal(f.tensors.at("b.weight").bitcast(DType::u16), b.bitcast(DType::u16)));
  CHECK(equal(f.tensors.at("c"), c));
  CHECK(f.tensors.at("c").shape() == Shape{3, 1});
  CHECK(equal(f.tensors.at("e"), e));
  CHECK(f.tensors.at("e").at<int64_t>(1) == (1LL << 40));
  CHECK(equal(f.tensors.at("i"), i));
  CHECK(f.tensors.at("empty").shape() == Shape{0, 4});
  CHECK(to_f64(f.tensors.at("view")) == std::vector<double>{3, 4, 5});

  // The layout: a JSON header padded to 8 bytes, the tensors' bytes in the given order.
  std::string bytes = read_bytes(path);
  uint64_t hl;
  std::memcpy(&hl, bytes.data(), 8);
  CHECK(hl % 8 == 0);
  auto header = nlohmann::json::parse(bytes.substr(8, hl));
  CHECK(header["a"]["dtype"] == "F32");
  CHECK(header["b.weight"]["dtype"] == "BF16");
  CHECK(header["c"]["dtype"] == "F64");
  CHECK(header["e"]["dtype"] == "I64");
  CHECK(header["i"]["dtype"] == "I32");
  CHECK(header["a"]["data_offsets"] == nlohmann::json::array({0, 16}));
  CHECK(header["b.weight"]["data_offsets"] == nlohmann::json::array({16, 22}));
  CHECK(header["__metadata__"]["step"] == "12");
  CHECK(bytes.size() == 8 + hl + 16 + 6 + 24 + 16 + 8 + 0 + 12);

  // Overwriting goes through the tmp file too.
  write_safetensors(path, {{"a", b}});
  CHECK_FALSE(fs::exists(path + ".tmp"));
  SafetensorsFile g = read_safetensors(path);
  CHECK(g.tensors.size() == 1);
  CHECK(g.metadata.empty());
  CHECK(g.tensors.at("a").dtype() == DType::bf16);

  CHECK_ERROR_CONTAINS(write_safetensors(d / "dup.safetensors", {{"a", a}, {"a", b}}), "tensor 'a' given twice");
  CHECK_FALSE(fs::exists(d / "dup.safetensors.tmp"));
  CHECK_ERROR_CONTAINS(write_safetensors(d / "no_dir/x.safetensors", {{"a", a}}), "[checkpoint] cannot create");
}

TEST_CASE("safetensors: f16 is converted to f32 on read") {
  test::TempDir d("safetensors");
  // 1.0, -2.5, 0, 65504 (the largest half), the smallest subnormal, -inf, 0.333251953125.
  uint16_t h[7] = {0x3c00, 0xc100, 0x0000, 0x7bff, 0x0001, 0xfc00, 0x3555};
  std::string data(reinterpret_cast<const char*>(h), sizeof(h));
  std::string path =
      write_file(d, "h.safetensors",
                 R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F16","shape":[7],"data_offsets":[0,14]}})", data);
  SafetensorsFile g = read_safetensors(path);
  const Tensor& x = g.tensors.at("x");
  CHECK(x.dtype() == DType::f32);
  CHECK(x.shape() == Shape{7});
  auto v = to_f64(x);
  CHECK(v[0] == 1.0);
  CHECK(v[1] == -2.5);
  CHECK(v[2] == 0.0);
  CHECK(v[3] == 65504.0);
  CHECK(v[4] == std::ldexp(1.0, -24));
  CHECK(std::isinf(v[5]));
  CHECK(v[5] < 0);
  CHECK(v[6] == 0.333251953125);
  CHECK(g.metadata.at("format") == "pt");
}

TEST_CASE("safetensors: malformed files name the file and what is wrong") {
  test::TempDir d("safetensors");
  const std::string one = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

  std::string p = write_file(d, "len.safetensors", "{}", "", 999);
  CHECK_ERROR_CONTAINS(read_safetensors(p), "[checkpoint] " + p + ": header length 999 exceeds file size 10");
  p = d / "tiny.safetensors";
  std::ofstream(p, std::ios::binary) << "abc";
  CHECK_ERROR_CONTAINS(read_safetensors(p), "[checkpoint] " + p + ": 3 bytes is too short");

  // Each file's header and data bytes, and the error it gives after "[checkpoint] <path>: ".
  struct Bad {
    const char* name;
    std::string header, data, error;
  };
  const std::string overlap = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  const std::string gap = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("y":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  const std::vector<Bad> bad{
      {"json", "{not json", "", "header is not valid JSON"},
      {"array", "[1, 2]", "", "header is not a JSON object"},
      {"range", one, "abcd", "tensor 'x' data_offsets [0, 8] out of range of the 4 data bytes"},  // 8 declared
      {"backwards", R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", "abcdefgh",
       "tensor 'x' data_offsets [8, 0] out of range"},
      {"shape", R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "abcdefgh",
       "tensor 'x' of F32 (3,) needs 12 bytes, data_offsets [0, 8] give 8"},
      {"dtype", R"({"x":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", "a", "tensor 'x' has unknown dtype 'Q8'"},
      {"overlap", overlap, "abcdefgh", "tensors 'x' [0, 8] and 'y' [4, 8] have overlapping data_offsets"},
      {"gap", gap, "abcdefghijkl", "data_offsets do not cover the data: bytes [4, 8) belong to no tensor"},
      {"tail", one, "abcdefghXXXX",  // 4 bytes after the last tensor
       "data_offsets do not cover the data: the tensors end at byte 8 of 12"},
      {"entry", R"({"x":{"dtype":"F32","shape":[2]}})", "abcdefgh", "tensor 'x': expected dtype, shape and data_offsets"},
      {"neg", R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd", "tensor 'x' has a negative size"},
      {"meta", R"({"__metadata__":{"step":12}})", "", "__metadata__ value 'step' is not a string"},
  };
  for (const Bad& b : bad) {
    p = write_file(d, std::string(b.name) + ".safetensors", b.header, b.data);
    CHECK_ERROR_CONTAINS(read_safetensors(p), "[checkpoint] " + p + ": " + b.error);
  }

  // A good file cut short: the last tensor's data_offsets run past the end.
  Tensor a = from_values({1, 2, 3, 4}, {4}, DType::f32);
  Tensor b = from_values({5, 6}, {2}, DType::f64);
  p = d / "cut.safetensors";
  write_safetensors(p, {{"a", a}, {"b", b}});
  CHECK(read_safetensors(p).tensors.size() == 2);
  fs::resize_file(p, fs::file_size(p) - 3);
  CHECK_ERROR_CONTAINS(read_safetensors(p), "[checkpoint] " + p +
                                                ": tensor 'b' data_offsets [16, 32] out of range of the 29 data bytes "
                                                "(truncated file?)");

  CHECK_ERROR_CONTAINS(read_safetensors(d / "missing.safetensors"), d / "missing.safetensors" + ": no such file");
}

// ---------------------------------------------------------------- bit patterns, scalars, f16 edge values, more errors

namespace {
std::string raw_bytes(const Tensor& t) { return std::string(static_cast<const char*>(t.data_ptr()), t.nbytes()); }

}  // namespace

TEST_CASE("safetensors: round trip is bit-exact for NaN payloads, -0, infinities, subnormals and integer limits") {
  test::TempDir d("safetensors");
  Tensor f = empty({2, 4}, DType::f32);
  const uint32_t fbits[8] = {0x7fc00001u, 0xff800000u, 0x7f800000u, 0x80000000u,
                             0x00000001u, 0x7f7fffffu, 0x3eaaaaabu, 0xffc12345u};
  std::memcpy(f.data_ptr(), fbits, sizeof(fbits));
  Tensor g = empty({3}, DType::f64);
  const uint64_t gbits[3] = {0x7ff8000000000123ull, 0x8000000000000000ull, 0x0000000000000001ull};
  std::memcpy(g.data_ptr(), gbits, sizeof(gbits));
  Tensor h = empty({5}, DType::bf16);
  const uint16_t hbits[5] = {0x7fc1, 0x8000, 0x0001, 0xff80, 0x3f80};
  std::memcpy(h.data_ptr(), hbits, sizeof(hbits));
  Tensor i64 = empty({2}, DType::i64);
  i64.at<int64_t>(0) = std::numeric_limits<int64_t>::min();
  i64.at<int64_t>(1) = std::numeric_limits<int64_t>::max();
  Tensor i32 = empty({3}, DType::i32);
  i32.at<int32_t>(0) = std::numeric_limits<int32_t>::min();
  i32.at<int32_t>(1) = std::numeric_limits<int32_t>::max();
  i32.at<int32_t>(2) = -1;
  Tensor scalar = from_values({2.5}, {}, DType::f32);  // shape []
  const std::string path = d / "bits.safetensors";
  const std::map<std::string, std::string> meta = {
      {"quote\"and\\backslash", "line\nbreak\ttab"}, {"unicode", "caf\xc3\xa9 \xe2\x82\xac"}, {"empty", ""}};
  write_safetensors(path, {{"model.layers.0/f", f}, {"g", g}, {"h", h}, {"i64", i64}, {"i32", i32}, {"s", scalar}},
                    meta);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  SafetensorsFile r = read_safetensors(path);
  CHECK(r.metadata == meta);
  REQUIRE(r.tensors.size() == 6);
  const std::pair<const char*, Tensor> want[] = {
      {"model.layers.0/f", f}, {"g", g}, {"h", h}, {"i64", i64}, {"i32", i32}, {"s", scalar}};
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    REQUIRE(r.tensors.count(name) == 1);
    const Tensor& got = r.tensors.at(name);
    CHECK(got.dtype() == t.dtype());
    CHECK(got.shape() == t.shape());
    CHECK(raw_bytes(got) == raw_bytes(t));
  }
  CHECK(r.tensors.at("s").numel() == 1);
  CHECK(r.tensors.at("s").at<float>(0) == 2.5f);
}

TEST_CASE("safetensors: F16 written by hand reads as f32: normals, the largest half, subnormals, -0, NaN") {
  test::TempDir d("safetensors");
  // 1.0, -2.5, 0.0, 65504, smallest subnormal 2^-24, largest subnormal 1023 * 2^-24, smallest normal 2^-14,
  // -smallest subnormal, -0.0, NaN, +inf, 0.1 (0x2e66 = 0.0999755859375).
  const uint16_t bits[12] = {0x3c00, 0xc100, 0x0000, 0x7bff, 0x0001, 0x03ff,
                             0x0400, 0x8001, 0x8000, 0x7e00, 0x7c00, 0x2e66};
  std::string data(reinterpret_cast<const char*>(bits), sizeof(bits));
  // Another tensor after it keeps the offsets honest.
  const float tail[2] = {3.0f, -4.0f};
  data.append(reinterpret_cast<const char*>(tail), sizeof(tail));
  std::string p = write_file(d, "h.safetensors",
                             R"({"x":{"dtype":"F16","shape":[3,4],"data_offsets":[0,24]},)"
                             R"("y":{"dtype":"F32","shape":[2],"data_offsets":[24,32]}})",
                             data);
  SafetensorsFile r = read_safetensors(p);
  const Tensor& x = r.tensors.at("x");
  CHECK(x.dtype() == DType::f32);
  CHECK(x.shape() == Shape{3, 4});
  const float* v = x.data<float>();
  CHECK(v[0] == 1.0f);
  CHECK(v[1] == -2.5f);
  CHECK(v[2] == 0.0f);
  CHECK_FALSE(std::signbit(v[2]));
  CHECK(v[3] == 65504.0f);
  CHECK(v[4] == std::ldexp(1.0f, -24));
  CHECK(v[5] == 1023.0f * std::ldexp(1.0f, -24));
  CHECK(v[6] == std::ldexp(1.0f, -14));
  CHECK(v[7] == -std::ldexp(1.0f, -24));
  CHECK(v[8] == 0.0f);
  CHECK(std::signbit(v[8]));
  CHECK(std::isnan(v[9]));
  CHECK(v[10] == std::numeric_limits<float>::infinity());
  CHECK(v[11] == 0.0999755859375f);
  CHECK(to_f64(r.tensors.at("y")) == std::vector<double>{3.0, -4.0});
}

TEST_CASE("safetensors: error messages by substring") {
  test::TempDir d("safetensors");
  // Header length larger than the file (also a huge one that would overflow size arithmetic).
  std::string p = write_file(d, "len.safetensors", "{}", "", 100);
  CHECK_ERROR_CONTAINS(read_safetensors(p), "exceeds file size 10");
  p = write_file(d, "huge.safetensors", "{}", "", int64_t(0x7fffffffffffffffLL));
  CHECK_ERROR_CONTAINS(read_safetensors(p), "exceeds file size");
  // Not JSON.
  p = write_file(d, "json.safetensors", "\x01\x02garbage", "");
  CHECK_ERROR_CONTAINS(read_safetensors(p), "not valid JSON");
  // data_offsets past the data.
  p = write_file(d, "range.safetensors", R"({"x":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})", "abcdefgh");
  CHECK_ERROR_CONTAINS(read_safetensors(p), "data_offsets [4, 12] out of range of the 8 data bytes");
  // Byte count not matching the shape.
  p = write_file(d, "needs.safetensors", R"({"x":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", "abcdefgh");
  CHECK_ERROR_CONTAINS(read_safetensors(p), "needs 12 bytes");
  p = write_file(d, "needs64.safetensors", R"({"x":{"dtype":"F64","shape":[],"data_offsets":[0,4]}})", "abcd");
  CHECK_ERROR_CONTAINS(read_safetensors(p), "needs 8 bytes");
  // Unknown dtype (a real safetensors dtype this reader does not take).
  p = write_file(d, "u8.safetensors", R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "a");
  CHECK_ERROR_CONTAINS(read_safetensors(p), "unknown dtype 'U8'");
  // Missing file; a directory is not a file either.
  CHECK_ERROR_CONTAINS(read_safetensors(d / "nope.safetensors"), "no such file");
  CHECK_ERROR_CONTAINS(read_safetensors(d.path.string()), "no such file");
  // Every error is a [checkpoint] error naming the file.
  CHECK_ERROR_CONTAINS(read_safetensors(p), "[checkpoint] " + p + ":");
}

// ---------------------------------------------------------------- the block reader: pread, nothing mapped

namespace {
// Lines of /proc/self/maps naming `path`: the reader's mappings of that file.
int mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find(path) != std::string::npos;
  return n;
}
}  // namespace

TEST_CASE("safetensors: the block reader reads column, row and scalar blocks and maps nothing") {
  test::TempDir d("safetensors");
  // 1200 x 1000 f32 is 4.8 MB: larger than the staging buffer, so blocks are read in several windows.
  const int64_t R = 1200, C = 1000;
  Tensor big = empty({R, C}, DType::f32);
  float* p = static_cast<float*>(big.data_ptr());
  for (int64_t i = 0; i < R * C; ++i) p[i] = float(i % 100003) * 0.5f;
  Tensor h = from_values({1.0, -2.0, 0.25, 3.5, 5.0, -6.0}, {2, 3}, DType::bf16);
  Tensor s = from_values({7.0}, {}, DType::f64);
  const std::string path = d / "blocks.safetensors";
  write_safetensors(path, {{"big", big}, {"h", h}, {"s", s}});

  SafetensorsReader r(path);
  Tensor col = empty({1000, 300}, DType::f32), rows = empty({1100, C}, DType::f32);
  r.read_block("big", {150, 600}, col);
  r.read_block("big", {100, 0}, rows);
  const float* c = static_cast<const float*>(col.data_ptr());
  const float* w = static_cast<const float*>(rows.data_ptr());
  bool same = true;
  for (int64_t i = 0; i < 1000; ++i)
    for (int64_t j = 0; j < 300; ++j) same = same && c[i * 300 + j] == p[(150 + i) * C + 600 + j];
  for (int64_t i = 0; i < 1100 * C; ++i) same = same && w[i] == p[100 * C + i];
  CHECK(same);
  Tensor hf = empty({2, 2}, DType::f32), sf = empty({}, DType::f32);
  r.read_block("h", {0, 1}, hf);  // bf16 widened to f32
  r.read_block("s", {}, sf);
  CHECK(equal(hf, from_values({-2.0, 0.25, 5.0, -6.0}, {2, 2}, DType::f32)));
  CHECK(static_cast<const float*>(sf.data_ptr())[0] == 7.0f);
  double v = 0;
  CHECK(r.first_nonfinite("big", {0, 0}, {R, C}, &v) == -1);
  // The reader is still open, its blocks read: none of the file is mapped into the process.
  CHECK(mappings_of(path) == 0);
}

TEST_CASE("safetensors: the block reader finds a non-finite value and names a file truncated after its header") {
  test::TempDir d("safetensors");
  Tensor t = from_values({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f32);
  static_cast<float*>(t.data_ptr())[5] = std::numeric_limits<float>::infinity();
  const std::string path = d / "t.safetensors";
  write_safetensors(path, {{"t", t}});
  SafetensorsReader r(path);
  double v = 0;
  CHECK(r.first_nonfinite("t", {1, 0}, {2, 2}, &v) == 3);
  CHECK(std::isinf(v));
  fs::resize_file(path, fs::file_size(path) - 8);
  Tensor out = empty({3, 2}, DType::f32);
  CHECK_ERROR_CONTAINS(r.read_block("t", {0, 0}, out), "[checkpoint] " + path + ": cannot read");
  CHECK_ERROR_CONTAINS(r.read_block("t", {0, 0}, out), "(truncated file?)");
}
