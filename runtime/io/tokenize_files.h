// Files through a tokenizer, as `meshtrain tokenize` reads and writes them. Ids are little-endian u32 ("u32"),
// u16 ("u16": an id above 65,535 is an error) or one JSON array "[1,2,3]" ("json"). Framed documents (--docs, for
// scripts/prepare_data): in, each a little-endian u32 byte count then the bytes; out, each document's ids on their
// own, a u32 id count then the ids (u32/u16), or with json one array a line. Errors are "[tokenize] ..." naming
// the file, the byte or the document.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/io/tokenizer.h"

namespace mt {

// The whole of a file, or of stdin for "-".
std::string read_input(const std::string& path);
// data to a file, or to stdout for "-": every write and the close (stdout's flush) checked.
void write_output(const std::string& path, const std::string& data);

// ids appended to out in `format` (json without a newline); u16 refuses an id it cannot hold, naming it.
void append_ids(std::string& out, const std::vector<int32_t>& ids, const std::string& format);
// The ids in data, written in `format`; name: the input as messages call it ("stdin" or the path).
std::vector<int32_t> parse_ids(const std::string& data, const std::string& format, const std::string& name);
// The framed documents of in, as views into it; a frame that runs past the end is an error naming its byte.
std::vector<std::string_view> split_docs(const std::string& in);

// What a run through the tokenizer gives: the bytes to write, and its sizes (text bytes, ids) for --stats.
struct Tokenized {
  std::string out;
  size_t n_ids = 0, n_bytes = 0;
};
// The ids of in (written in format) back to text.
Tokenized decode_file(const Tokenizer& tok, const std::string& in, const std::string& format, const std::string& name);
// in as one text, cut at safe newlines over `threads` (encode_parallel); json ends with a newline.
Tokenized encode_file(const Tokenizer& tok, const std::string& in, const std::string& format, int threads);
// Each framed document of in encoded on its own, the documents shared out over `threads`.
Tokenized encode_docs(const Tokenizer& tok, const std::string& in, const std::string& format, int threads);

// The tokenizer as one JSON object (no newline): describe, vocab_size, bos_id, eos_id and whether it encodes in
// parallel (splits_at_newlines).
std::string tokenizer_info_json(const Tokenizer& tok);

}  // namespace mt
