// `meshtrain tokenize` (cmd_tokenize.h). Ids are written little-endian: u32 (the default) or u16 (an id above
// 65,535 is an error), or json: one array "[1,2,3]". --docs (for scripts/prepare_data): the input is a sequence
// of documents, each a little-endian u32 byte count then the bytes; each is encoded on its own (documents in
// parallel over --threads) and written as a u32 id count then the ids (u32/u16), or with json one array a line.
#include "runtime/cli/command.h"
#include <string>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/io/tokenizer.h"

namespace mt {

struct TokenizeArgs {
  std::string tokenizer, in = "-", out = "-", format = "u32";
  int threads = 1;
  bool decode = false, info = false, stats = false, docs = false;
};


void add_tokenize_options(CLI::App* app, TokenizeArgs& a) {
  app->add_option("--tokenizer", a.tokenizer,
                  "a Hugging Face tokenizer.json, a SentencePiece tokenizer.model, or a directory holding one")
      ->required();
  app->add_option("--in", a.in, "input file: text, or ids with --decode (default: stdin)");
  app->add_option("--out", a.out, "output file: ids, or text with --decode (default: stdout)");
  app->add_option("--format", a.format, "ids as u32 (little-endian, default), u16 or json")
      ->check(CLI::IsMember({"u32", "u16", "json"}));
  app->add_option("--threads", a.threads, "encoding threads (text cut at safe newlines, see tokenizer.h)")
      ->check(CLI::Range(1, 1024));
  app->add_flag("--decode", a.decode, "the input is ids; write the bytes they decode to");
  app->add_flag("--info", a.info, "print the tokenizer's description, vocab_size, bos_id, eos_id as one JSON line");
  app->add_flag("--stats", a.stats, "print sizes and throughput (MB/s) on stderr");
  app->add_flag("--docs", a.docs,
                "framed documents in and out: each a u32 byte count and the bytes; out a u32 id count and the ids "
                "(json: one array a line)");
}

namespace {

std::string read_all(const std::string& path) {
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

void write_all(FILE* f, const std::string& path, const void* p, size_t n) {
  if (n > 0 && std::fwrite(p, 1, n, f) != n)
    fail("tokenize", "cannot write {}: {}", path == "-" ? "stdout" : path, std::strerror(errno));
}

void append_u32(std::string& out, uint32_t v) {
  char b[4] = {char(v & 0xff), char((v >> 8) & 0xff), char((v >> 16) & 0xff), char(v >> 24)};
  out.append(b, 4);
}

// Ids in the output format (json without a newline).
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

std::vector<int32_t> parse_ids(const std::string& data, const std::string& format, const std::string& path) {
  std::vector<int32_t> ids;
  if (format == "json") {
    size_t i = data.find_first_not_of(" \t\r\n");
    MT_CHECK(i != std::string::npos && data[i] == '[', "tokenize", "{}: expected a JSON array of ids", path);
    ++i;
    while (true) {
      i = data.find_first_not_of(" \t\r\n,", i);
      MT_CHECK(i != std::string::npos, "tokenize", "{}: the JSON array of ids is not closed", path);
      if (data[i] == ']') break;
      char* end = nullptr;
      long long v = std::strtoll(data.c_str() + i, &end, 10);
      MT_CHECK(end != data.c_str() + i && v >= INT32_MIN && v <= INT32_MAX, "tokenize",
               "{}: byte {}: expected an id, got '{}'", path, i, data.substr(i, 12));
      ids.push_back(int32_t(v));
      i = size_t(end - data.c_str());
    }
    return ids;
  }
  const size_t w = format == "u16" ? 2 : 4;
  MT_CHECK(data.size() % w == 0, "tokenize", "{}: {} bytes are not a whole number of {} ids", path, data.size(),
           format);
  ids.resize(data.size() / w);
  const auto* p = reinterpret_cast<const uint8_t*>(data.data());
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = w == 2 ? int32_t(p[2 * i] | (p[2 * i + 1] << 8))
                    : int32_t(uint32_t(p[4 * i]) | (uint32_t(p[4 * i + 1]) << 8) | (uint32_t(p[4 * i + 2]) << 16) |
                              (uint32_t(p[4 * i + 3]) << 24));
  return ids;
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

// What a run produced: the bytes to write, and the sizes --stats reports (text bytes, ids).
struct Coded {
  std::string out;
  size_t n_ids = 0, n_bytes = 0;
};

// --decode: the ids of the input back to text.
Coded decode_ids(const Tokenizer& tok, const std::string& in, const TokenizeArgs& a) {
  Coded c;
  std::vector<int32_t> ids = parse_ids(in, a.format, a.in == "-" ? "stdin" : a.in);
  c.out = tok.decode(ids);
  c.n_ids = ids.size();
  c.n_bytes = c.out.size();
  return c;
}

// --docs: the framed documents of the input (a u32 byte count, then the bytes), as views into it.
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

// --docs: every document's ids, each a u32 id count then the ids (json: one array a line).
Coded encode_docs(const Tokenizer& tok, const std::string& in, const TokenizeArgs& a) {
  Coded c;
  const std::vector<std::string_view> docs = split_docs(in);
  for (std::string_view d : docs) c.n_bytes += d.size();
  for (const auto& d : encode_each(tok, docs, a.threads)) {
    c.n_ids += d.size();
    if (a.format != "json") append_u32(c.out, uint32_t(d.size()));
    append_ids(c.out, d, a.format);
    if (a.format == "json") c.out += '\n';
  }
  return c;
}

// The whole input as one text, cut at safe newlines over the threads.
Coded encode_text(const Tokenizer& tok, const std::string& in, const TokenizeArgs& a) {
  Coded c;
  std::vector<int32_t> ids = encode_parallel(tok, in, a.threads);
  append_ids(c.out, ids, a.format);
  if (a.format == "json") c.out += '\n';
  c.n_ids = ids.size();
  c.n_bytes = in.size();
  return c;
}

// The output to a file or stdout ("-"), every write and the close checked.
void write_output(const std::string& path, const std::string& out) {
  FILE* f = path == "-" ? stdout : std::fopen(path.c_str(), "wb");
  if (!f) fail("tokenize", "cannot write {}: {}", path, std::strerror(errno));
  write_all(f, path, out.data(), out.size());
  if (f != stdout ? std::fclose(f) != 0 : std::fflush(f) != 0)
    fail("tokenize", "cannot write {}: {}", path == "-" ? "stdout" : path, std::strerror(errno));
}

}  // namespace

int run_tokenize_command(const TokenizeArgs& a) {
  MT_CHECK(!(a.decode && a.docs), "tokenize", "--decode and --docs do not go together");
  auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(a.tokenizer);
  auto t1 = std::chrono::steady_clock::now();
  if (a.info) {
    std::printf("{\"describe\": %s, \"vocab_size\": %lld, \"bos_id\": %d, \"eos_id\": %d, \"parallel\": %s}\n",
                json_string(tok->describe()).c_str(), (long long)tok->vocab_size(), tok->bos_id(), tok->eos_id(),
                tok->splits_at_newlines() ? "true" : "false");
    return 0;
  }
  std::string in = read_all(a.in);
  auto t2 = std::chrono::steady_clock::now();
  Coded c = a.decode ? decode_ids(*tok, in, a) : a.docs ? encode_docs(*tok, in, a) : encode_text(*tok, in, a);
  auto t3 = std::chrono::steady_clock::now();
  write_output(a.out, c.out);
  if (a.stats) {
    auto sec = [](auto x, auto y) { return std::chrono::duration<double>(y - x).count(); };
    double s = sec(t2, t3);
    std::fprintf(stderr,
                 "tokenize: %s %zu bytes %s %zu ids in %.3f s, %.2f MB/s, %.3f bytes/token, %d thread%s%s "
                 "(%s; load %.3f s, read %.3f s)\n",
                 a.decode ? "decode:" : "encode:", c.n_bytes, a.decode ? "<-" : "->", c.n_ids, s,
                 s > 0 ? double(c.n_bytes) / 1e6 / s : 0.0, c.n_ids ? double(c.n_bytes) / double(c.n_ids) : 0.0,
                 a.threads, a.threads == 1 ? "" : "s",
                 a.threads > 1 && (a.decode || (!a.docs && !tok->splits_at_newlines()))
                     ? " given, 1 used (this tokenizer is not cut at newlines, see tokenizer.h)"
                     : "",
                 tok->describe().c_str(), sec(t0, t1), sec(t1, t2));
  }
  return 0;
}

Command tokenize_command() {
  return command_with<TokenizeArgs>(
      "tokenize", "encode text to token ids (or --decode ids) with a tokenizer.json or tokenizer.model; no config",
      add_tokenize_options, [](RunContext&, const TokenizeArgs& a) { return run_tokenize_command(a); },
      /*needs_config=*/false);
}

}  // namespace mt
