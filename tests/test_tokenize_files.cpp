// Files through a tokenizer (runtime/io/tokenize_files.h) with a stand-in tokenizer (one id per byte): the id
// formats both ways, --docs' framing in and out over several threads, the errors naming the byte or document,
// and the --info line's escaping.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "check_error.h"
#include "runtime/io/tokenize_files.h"
#include "test_util.h"

using namespace mt;

namespace {

// Each byte is its own id; a '!' in a text is refused, to see a worker thread's error come back.
struct ByteTokenizer : Tokenizer {
  std::vector<int32_t> encode(std::string_view text) const override {
    if (text.find('!') != std::string_view::npos) throw std::runtime_error("no '!'");
    return std::vector<int32_t>(text.begin(), text.end());
  }
  std::string decode(std::span<const int32_t> ids) const override { return std::string(ids.begin(), ids.end()); }
  int64_t vocab_size() const override { return 256; }
  int32_t bos_id() const override { return -1; }
  int32_t eos_id() const override { return 10; }
  std::string describe() const override { return "bytes \"quoted\"\n"; }
};

std::string frame(const std::string& bytes) {
  const uint32_t n = uint32_t(bytes.size());
  return std::string{char(n & 0xff), char((n >> 8) & 0xff), char((n >> 16) & 0xff), char(n >> 24)} + bytes;
}

}  // namespace

TEST_CASE("ids round-trip in u32, u16 and json") {
  const std::vector<int32_t> ids = {0, 1, 255, 256, 65535};
  for (const char* format : {"u32", "u16", "json"}) {
    std::string out;
    append_ids(out, ids, format);
    CHECK(parse_ids(out, format, "x") == ids);
  }
  std::string u16;
  append_ids(u16, {0x1234}, "u16");
  CHECK(u16 == std::string("\x34\x12", 2));
  std::string json;
  append_ids(json, ids, "json");
  CHECK(json == "[0,1,255,256,65535]");
  CHECK(parse_ids(" [ 1, 2 ,3]\n", "json", "x") == std::vector<int32_t>{1, 2, 3});
}

TEST_CASE("ids that do not fit or do not parse are errors naming the place") {
  std::string out;
  CHECK_ERROR_CONTAINS(append_ids(out, {1, 65536}, "u16"),
                       "[tokenize] --format u16: id 65536 (token 1) does not fit in 16 bits; use --format u32");
  CHECK_ERROR_CONTAINS(parse_ids("abcde", "u32", "in.bin"), "in.bin: 5 bytes are not a whole number of u32 ids");
  CHECK_ERROR_CONTAINS(parse_ids("[1, 2", "json", "stdin"), "stdin: the JSON array of ids is not closed");
  CHECK_ERROR_CONTAINS(parse_ids("[1, x]", "json", "stdin"), "stdin: byte 4: expected an id, got 'x]'");
  CHECK_ERROR_CONTAINS(parse_ids("1, 2", "json", "stdin"), "stdin: expected a JSON array of ids");
}

TEST_CASE("framed documents are encoded one by one over the threads") {
  ByteTokenizer tok;
  const std::vector<std::string> docs = {"ab", "", "cde", "f"};
  std::string in;
  for (const auto& d : docs) in += frame(d);
  REQUIRE(split_docs(in).size() == docs.size());
  for (int threads : {1, 3}) {
    const Tokenized u32 = encode_docs(tok, in, "u32", threads);
    CHECK(u32.out == in.substr(0, 4) + std::string("a\0\0\0b\0\0\0", 8) + frame("") +
                         std::string("\3\0\0\0c\0\0\0d\0\0\0e\0\0\0", 16) + std::string("\1\0\0\0f\0\0\0", 8));
    CHECK(u32.n_bytes == 6);
    CHECK(u32.n_ids == 6);
    CHECK(encode_docs(tok, in, "json", threads).out == "[97,98]\n[]\n[99,100,101]\n[102]\n");
  }
  CHECK_THROWS_WITH(encode_docs(tok, frame("ok") + frame("no!"), "u32", 2), "no '!'");
}

TEST_CASE("a frame that runs past the input is an error naming its byte") {
  CHECK_ERROR_CONTAINS(split_docs(frame("ab") + "\1\0"), "--docs: the input ends inside a document's length at byte 6");
  CHECK_ERROR_CONTAINS(split_docs(frame("ab") + frame("cdef").substr(0, 6)),
                       "--docs: document 1 at byte 6 claims 4 bytes, 2 are left");
}

TEST_CASE("a text is encoded whole and decoded back") {
  ByteTokenizer tok;
  const Tokenized enc = encode_file(tok, "hi\n", "json", 1);
  CHECK(enc.out == "[104,105,10]\n");
  CHECK(enc.n_bytes == 3);
  CHECK(enc.n_ids == 3);
  const Tokenized dec = decode_file(tok, enc.out, "json", "stdin");
  CHECK(dec.out == "hi\n");
  CHECK(dec.n_ids == 3);
}

TEST_CASE("files and the --info line") {
  test::TempDir d("tokenize_files");
  write_output(d / "ids.bin", std::string("\0\1", 2));
  CHECK(read_input(d / "ids.bin") == std::string("\0\1", 2));
  CHECK_ERROR_CONTAINS(read_input(d / "missing"), "[tokenize] cannot read " + d / "missing");
  CHECK(tokenizer_info_json(ByteTokenizer()) ==
        "{\"describe\": \"bytes \\\"quoted\\\"\\u000a\", \"vocab_size\": 256, \"bos_id\": -1, \"eos_id\": 10, "
        "\"parallel\": false}");
}
