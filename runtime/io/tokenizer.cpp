// Tokenizers (tokenizer.h): the format of a file told apart and its tokenizer made (hf_tokenizer.cpp for
// tokenizer.json, sentencepiece_tokenizer.cpp for tokenizer.model), and encode_parallel.
#include "runtime/io/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "runtime/core/error.h"
#include "runtime/io/tokenizer_internal.h"

namespace fs = std::filesystem;

namespace mt {

namespace tokenizer_detail {

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

}  // namespace tokenizer_detail

using json = nlohmann::json;
using tokenizer_detail::is_ascii_space;
using tokenizer_detail::make_hf_tokenizer;
using tokenizer_detail::make_sentencepiece_tokenizer;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  std::string file = path;
  if (fs::is_directory(path)) {
    if (fs::is_regular_file(fs::path(path) / "tokenizer.json"))
      file = (fs::path(path) / "tokenizer.json").string();
    else if (fs::is_regular_file(fs::path(path) / "tokenizer.model"))
      file = (fs::path(path) / "tokenizer.model").string();
    else
      fail("tokenizer", "{}: the directory holds neither tokenizer.json nor tokenizer.model", path);
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("tokenizer", "cannot read {}: {}", file, std::strerror(errno));
  // JSON if the first non-blank byte is '{', else a SentencePiece model (a protobuf).
  char c = 0;
  while (in.get(c) && is_ascii_space(c)) {
  }
  if (c != '{') {
    // A .json file (tokenizer.json) is never read as a protobuf: say what is wrong with it as JSON.
    const bool blank = !in;
    const bool is_json = fs::path(file).extension() == ".json";
    if (blank)
      fail("tokenizer", "{}: the file is empty{}", file,
           is_json ? " (a tokenizer.json must hold a JSON object)" : " (neither a tokenizer.json nor a SentencePiece model)");
    if (is_json) fail("tokenizer", "{}: not valid JSON: a tokenizer.json must hold a JSON object, starting with '{{'", file);
    in.close();
    return make_sentencepiece_tokenizer(file);
  }
  in.seekg(0);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("tokenizer", "{}: not valid JSON: {}", file, e.what());
  }
  std::string dir = fs::path(file).parent_path().string();
  try {
    return make_hf_tokenizer(j, file, dir.empty() ? "." : dir);
  } catch (const json::exception& e) {
    fail("tokenizer", "{}: unexpected JSON value: {}", file, e.what());
  }
}

std::vector<int32_t> encode_parallel(const Tokenizer& t, std::string_view text, int threads) {
  constexpr size_t kChunk = 1 << 20;
  if (threads <= 1 || text.size() < 2 * kChunk || !t.splits_at_newlines()) return t.encode(text);
  auto printable = [](char c) { return c > 0x20 && c < 0x7f; };
  std::vector<size_t> cuts{0};
  size_t at = kChunk;
  while (at < text.size()) {
    size_t p = at;  // a cut at p: text[p-1] == '\n', text[p-2] and text[p] printable, no added token at p
    for (; p + 1 < text.size(); ++p)
      if (text[p - 1] == '\n' && p >= 2 && printable(text[p - 2]) && printable(text[p]) &&
          !t.added_token_at(text, p))
        break;
    if (p + 1 >= text.size()) break;
    cuts.push_back(p);
    at = p + kChunk;
  }
  cuts.push_back(text.size());
  const size_t n = cuts.size() - 1;
  std::vector<std::vector<int32_t>> parts(n);
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        parts[i] = t.encode_chunk(text.substr(cuts[i], cuts[i + 1] - cuts[i]), i == 0);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int k = 0; k < std::min<int>(threads, int(n)); ++k) pool.emplace_back(work);
  for (std::thread& th : pool) th.join();
  if (error) std::rethrow_exception(error);
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<int32_t> out;
  out.reserve(total);
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace mt
