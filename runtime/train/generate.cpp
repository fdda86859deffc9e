#include "runtime/train/generate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "attention/attention.h"
#include "models/model.h"
#include "runtime/core/philox.h"
#include "runtime/kernels/ops.h"

namespace mt {

std::vector<int32_t> generate(CausalLM& model, const StepExecutor& executor, std::vector<int32_t> toks, int64_t n,
                              double temperature, uint64_t seed, uint64_t stream, int64_t pad_multiple,
                              int64_t document_separator, int32_t stop_id) {
  // Every rank runs the whole context: no cp split while generating; the training positions, documents
  // and cp settings come back afterwards.
  struct Restore {
    CausalLM& m;
    Tensor positions, documents;
    std::shared_ptr<const Attention> a;
    ~Restore() {
      m.set_attention(a);
      m.set_documents(documents);
      if (positions.defined()) m.set_positions(positions);
    }
  } restore{model, model.positions(), model.documents(), model.attention()};
  model.set_attention(make_attention());
  const int64_t V = model.config.vocab_size, ctx_max = model.config.max_seq_len;
  for (int32_t& t : toks) t = int32_t(int64_t(t) % V);
  if (toks.empty()) toks.push_back(int32_t(int64_t('\n') % V));
  const bool has_output = model.has_output();
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    int64_t len = std::min<int64_t>(int64_t(toks.size()), ctx_max);
    // Sequence parallel splits the sequence over tp: pad at the end (causal: the padding does not
    // change the logits before it) to a multiple of tp.
    int64_t padded = (len + pad_multiple - 1) / pad_multiple * pad_multiple;
    Tensor ctx = zeros({1, padded}, DType::i32);
    std::copy(toks.end() - len, toks.end(), ctx.data<int32_t>());
    Tensor pos = empty({padded}, DType::i64);
    for (int64_t t = 0; t < padded; ++t) pos.at<int64_t>(t) = t;
    model.set_positions(pos);
    model.set_documents(document_separator >= 0 ? document_starts(ctx, int32_t(document_separator)) : Tensor());
    const Tensor logits = executor.sample_logits(model, ctx);  // (1, padded, V or V/tp) where the output is
    int32_t next = 0;
    if (has_output) {
      const DTensor& w = model.output_weight().value;  // (V, C), rows sharded on tp under tensor parallel
      Tensor last = logits.reshape({padded, -1}).slice0(len - 1, len).clone();  // (1, V_local)
      if (last.size(1) != V) {  // vocab-sharded (loss parallel): gather the row
        Placements pl(size_t(w.mesh.ndim()), Placement::Replicate());
        pl[size_t(w.mesh.dim_index(dim::tp))] = Placement::Shard(1);
        last = full_tensor(from_local(last, w.mesh, pl, Shape{1, V}));
      }
      std::vector<double> row = to_f64(last);  // (V)
      if (temperature <= 0) {
        next = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      } else {
        double mx = *std::max_element(row.begin(), row.end()), total = 0;
        for (double& x : row) total += (x = std::exp((x - mx) / temperature));
        double u = double(philox::uniform(seed, stream, uint64_t(i))) * total, acc = 0;
        next = int32_t(V - 1);
        for (int64_t v = 0; v < V; ++v)
          if ((acc += row[size_t(v)]) > u) {
            next = int32_t(v);
            break;
          }
      }
    }
    next = executor.share_token(next);  // the output's rank's token on every rank
    toks.push_back(next);
    out.push_back(next);
    if (next == stop_id) break;
  }
  return out;
}

std::vector<int32_t> TextCodec::encode(const std::string& text) const {
  if (tokenizer) return tokenizer->encode(text);
  std::vector<int32_t> ids;
  for (unsigned char ch : text) ids.push_back(int32_t(int64_t(ch) % vocab_size));
  return ids;
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
  if (!tokenizer) {
    std::string s;
    for (int32_t id : ids) s.push_back(char(id & 0xff));
    return s;
  }
  std::string s;
  std::vector<int32_t> run;
  for (int32_t id : ids) {
    if (id >= 0 && id < tokenizer->vocab_size()) {
      run.push_back(id);
      continue;
    }
    s += tokenizer->decode(run) + "\xef\xbf\xbd";  // U+FFFD: a row of the model past its tokenizer
    run.clear();
  }
  return s + tokenizer->decode(run);
}

std::string TextCodec::describe() const { return tokenizer ? tokenizer->describe() : "bytes"; }

std::string tokenizer_file_in(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return "";
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (fs::is_regular_file(fs::path(dir) / name, ec)) return (fs::path(dir) / name).string();
  return "";
}

TextCodec text_codec(const Config& cfg, const std::string& path, const std::string& fallback_dir) {
  namespace fs = std::filesystem;
  TextCodec c;
  c.vocab_size = cfg.model.vocab_size;
  std::string file = !path.empty() ? path : cfg.data.tokenizer;
  std::string key = !path.empty() ? "--tokenizer" : "data.tokenizer";
  if (file.empty() && !cfg.model.init_from.empty()) {
    std::error_code ec;
    const fs::path init(cfg.model.init_from);
    file = tokenizer_file_in((fs::is_directory(init, ec) ? init : init.parent_path()).string());
    key = "model.init_from's tokenizer";
  }
  if (file.empty()) {
    file = tokenizer_file_in(fallback_dir);
    key = "the checkpoint's tokenizer";
  }
  if (file.empty()) return c;
  c.tokenizer = Tokenizer::load(file);
  c.file = file;
  MT_CHECK(c.tokenizer->vocab_size() <= cfg.model.vocab_size, "config",
           "{} = {}: the tokenizer has {} ids but model.vocab_size = {}: it is not this model's tokenizer", key, file,
           c.tokenizer->vocab_size(), cfg.model.vocab_size);
  return c;
}

}  // namespace mt
