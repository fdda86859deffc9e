// Files through a tokenizer (tokenize_files.h).
#include "runtime/io/tokenize_files.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <mutex>
#include <thread>

#include "runtime/core/error.h"

namespace mt {

namespace {

void write_all(FILE* f, const std::string& path, const void* p, size_t n) {
  if (n > 0 && std::fwrite(p, 1, n, f) != n)
    fail("tokenize", "cannot write {}: {}", path == "-" ? "stdout" : path, std::strerror(errno));
}

void append_u32(std::string& out, uint32_t v) {
  char b[4] = {char(v & 0xff), char((v >> 8) & 0xff), char((v >> 16) & 0xff), char(v >> 24)};
  out.append(b, 4);
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (uint8_t(c) < 0x20) {
      out += fmt::format("\\u{:04x}", int(uint8_t(c)));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Each document encoded on its own, the documents shared out over the threads; the first error is rethrown.
std::vector<std::vector<int32_t>> encode_each(const Tokenizer& tok, const std::vector<std::string_view>& docs,
                                              int threads) {
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < docs.size();) {
      try {
        ids[i] = tok.encode(docs[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int k = 0; k < std::min<int>(threads, int(docs.size())); ++k) pool.emplace_back(work);
  for (std::thread& th : pool) th.join();
  if (error) std::rethrow_exception(error);
  return ids;
}

}  // namespace

std::string read_input(const std::string& path) {
  FILE* f = path == "-" ? stdin : std::fopen(path.c_str(), "rb");
  if (!f) fail("tokenize", "cannot read {}: {}", path, std::strerror(errno));
  std::string data;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) data.append(buf, n);
  bool err = std::ferror(f);
  if (f != stdin) std::fclose(f);
  if (err) fail("tokenize", "error reading {}", path == "-" ? "stdin" : path);
  return data;
}

void write_output(const std::string& path, const std::string& out) {
  FILE* f = path == "-" ? stdout : std::fopen(path.c_str(), "wb");
  if (!f) fail("tokenize", "cannot write {}: {}", path, std::strerror(errno));
  write_all(f, path, out.data(), out.size());
  if (f != stdout ? std::fclose(f) != 0 : std::fflush(f) != 0)
    fail("tokenize", "cannot write {}: {}", path == "-" ? "stdout" : path, std::strerror(errno));
}

void append_ids(std::string& out, const std::vector<int32_t>& ids, const std::string& format) {
  if (format == "json") {
    out += '[';
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(ids[i]);
    }
    out += ']';
  } else if (format == "u16") {
    for (size_t i = 0; i < ids.size(); ++i) {
      MT_CHECK(ids[i] >= 0 && ids[i] <= 65535, "tokenize",
               "--format u16: id {} (token {}) does not fit in 16 bits; use --format u32", ids[i], i);
      char b[2] = {char(ids[i] & 0xff), char(ids[i] >> 8)};
      out.append(b, 2);
    }
  } else {
    for (int32_t id : ids) append_u32(out, uint32_t(id));
  }
}

std::vector<int32_t> parse_ids(const std::string& data, const std::string& format, const std::string& name) {
  std::vector<int32_t> ids;
  if (format == "json") {
    size_t i = data.find_first_not_of(" \t\r\n");
    MT_CHECK(i != std::string::npos && data[i] == '[', "tokenize", "{}: expected a JSON array of ids", name);
    ++i;
    while (true) {
      i = data.find_first_not_of(" \t\r\n,", i);
      MT_CHECK(i != std::string::npos, "tokenize", "{}: the JSON array of ids is not closed", name);
      if (data[i] == ']') break;
      char* end = nullptr;
      long long v = std::strtoll(data.c_str() + i, &end, 10);
      MT_CHECK(end != data.c_str() + i && v >= INT32_MIN && v <= INT32_MAX, "tokenize",
               "{}: byte {}: expected an id, got '{}'", name, i, data.substr(i, 12));
      ids.push_back(int32_t(v));
      i = size_t(end - data.c_str());
    }
    return ids;
  }
  const size_t w = format == "u16" ? 2 : 4;
  MT_CHECK(data.size() % w == 0, "tokenize", "{}: {} bytes are not a whole number of {} ids", name, data.size(),
           format);
  ids.resize(data.size() / w);
  const auto* p = reinterpret_cast<const uint8_t*>(data.data());
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = w == 2 ? int32_t(p[2 * i] | (p[2 * i + 1] << 8))
                    : int32_t(uint32_t(p[4 * i]) | (uint32_t(p[4 * i + 1]) << 8) | (uint32_t(p[4 * i + 2]) << 16) |
                              (uint32_t(p[4 * i + 3]) << 24));
  return ids;
}

std::vector<std::string_view> split_docs(const std::string& in) {
  std::vector<std::string_view> docs;
  for (size_t at = 0; at < in.size();) {
    MT_CHECK(at + 4 <= in.size(), "tokenize", "--docs: the input ends inside a document's length at byte {}", at);
    const auto* p = reinterpret_cast<const uint8_t*>(in.data() + at);
    size_t len = size_t(p[0]) | (size_t(p[1]) << 8) | (size_t(p[2]) << 16) | (size_t(p[3]) << 24);
    MT_CHECK(at + 4 + len <= in.size(), "tokenize", "--docs: document {} at byte {} claims {} bytes, {} are left",
             docs.size(), at, len, in.size() - at - 4);
    docs.push_back(std::string_view(in).substr(at + 4, len));
    at += 4 + len;
  }
  return docs;
}

Tokenized decode_file(const Tokenizer& tok, const std::string& in, const std::string& format, const std::string& name) {
  Tokenized c;
  std::vector<int32_t> ids = parse_ids(in, format, name);
  c.out = tok.decode(ids);
  c.n_ids = ids.size();
  c.n_bytes = c.out.size();
  return c;
}

Tokenized encode_file(const Tokenizer& tok, const std::string& in, const std::string& format, int threads) {
  Tokenized c;
  std::vector<int32_t> ids = encode_parallel(tok, in, threads);
  append_ids(c.out, ids, format);
  if (format == "json") c.out += '\n';
  c.n_ids = ids.size();
  c.n_bytes = in.size();
  return c;
}

Tokenized encode_docs(const Tokenizer& tok, const std::string& in, const std::string& format, int threads) {
  Tokenized c;
  const std::vector<std::string_view> docs = split_docs(in);
  for (std::string_view d : docs) c.n_bytes += d.size();
  for (const auto& d : encode_each(tok, docs, threads)) {
    c.n_ids += d.size();
    if (format != "json") append_u32(c.out, uint32_t(d.size()));
    append_ids(c.out, d, format);
    if (format == "json") c.out += '\n';
  }
  return c;
}

std::string tokenizer_info_json(const Tokenizer& tok) {
  return fmt::format("{{\"describe\": {}, \"vocab_size\": {}, \"bos_id\": {}, \"eos_id\": {}, \"parallel\": {}}}",
                     json_string(tok.describe()), tok.vocab_size(), tok.bos_id(), tok.eos_id(),
                     tok.splits_at_newlines() ? "true" : "false");
}

}  // namespace mt
