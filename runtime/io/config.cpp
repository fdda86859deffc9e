// The generic YAML side of the config (config_reader.h), the shared value checks and the sections' rules across
// their keys (config.h).
#include "runtime/io/config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "runtime/io/config_reader.h"

namespace mt {

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

namespace config_io {

void apply_override(YAML::Node& root, const std::string& ov, std::set<std::string>& from_set) {
  auto eq = ov.find('=');
  if (eq == std::string::npos || eq == 0)
    fail("config", "bad --set '{}': expected key.path=value, e.g. --set comm.timeout_s=60", ov);
  std::string key = ov.substr(0, eq), value = ov.substr(eq + 1);
  std::vector<std::string> parts;
  std::stringstream ss(key);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (part.empty()) fail("config", "bad --set '{}': empty part in key '{}'", ov, key);
    parts.push_back(part);
  }
  YAML::Node parsed;
  try {
    parsed = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail("config", "bad --set '{}': the value is not valid YAML ({})", ov, e.msg);
  }
  from_set.insert(key);
  YAML::Node cur;
  cur.reset(root);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (cur[parts[i]] && !cur[parts[i]].IsMap() && !cur[parts[i]].IsNull())
      fail("config", "bad --set '{}': '{}' is not a section", ov, parts[i]);
    YAML::Node next = cur[parts[i]];
    cur.reset(next);
  }
  cur[parts.back()] = parsed;
}

// Whether msg names key as a whole key path ("training.steps" but not "training.steps_x" or "a.training.steps").
static bool names_key(const std::string& msg, const std::string& key) {
  auto word = [](char ch) { return std::isalnum((unsigned char)ch) || ch == '_' || ch == '.'; };
  for (size_t at = msg.find(key); at != std::string::npos; at = msg.find(key, at + 1)) {
    size_t end = at + key.size();
    bool open = at == 0 || !word(msg[at - 1]);
    bool close = end == msg.size() || !(std::isalnum((unsigned char)msg[end]) || msg[end] == '_' ||
                                        (msg[end] == '.' && end + 1 < msg.size() && word(msg[end + 1])));
    if (open && close) return true;
  }
  return false;
}

void fail_with_origin(const Error& e, const std::string& path, const std::vector<std::string>& overrides) {
  const std::string prefix = "[config] ";
  std::string body = e.what();
  if (body.rfind(prefix, 0) == 0) body = body.substr(prefix.size());
  std::string origin;
  if (body.find("--set") == std::string::npos) {  // "bad --set ..." and "... given by --set" say so already
    for (auto& ov : overrides) {
      auto eq = ov.find('=');
      if (eq != std::string::npos && eq > 0 && names_key(body, ov.substr(0, eq)))
        origin += (origin.empty() ? "--set " : ", --set ") + ov;
    }
  }
  if (origin.empty()) origin = path;
  throw Error(prefix + (origin.empty() ? "" : origin + ": ") + body);
}


YAML::Node load_yaml_string(const std::string& yaml) {
  try {
    return YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    fail("config", "YAML error at line {}, column {}: {}", e.mark.line + 1, e.mark.column + 1, e.msg);
  }
}

YAML::Node load_yaml_file(const std::string& path) {
  if (path.empty()) return YAML::Node();
  std::ifstream in(path);
  if (!in) fail("config", "cannot read config file '{}': {}", path, std::strerror(errno));
  try {
    return YAML::Load(in);
  } catch (const YAML::ParserException& e) {
    fail("config", "{}: YAML error at line {}, column {}: {}", path, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
}

}  // namespace config_io

std::string nearest_name(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  size_t best_d = 1000;
  for (auto& n : names) {
    size_t d = edit_distance(word, n);
    if (d < best_d) best_d = d, best = n;
  }
  return best_d <= std::max<size_t>(2, word.size() / 3) ? best : "";
}

void require_one_of(const std::string& key, const std::string& value, std::initializer_list<const char*> allowed) {
  for (auto& a : allowed)
    if (a == value) return;
  std::string names;
  for (auto& a : allowed) names += (names.empty() ? "'" : ", '") + std::string(a) + "'";
  fail("config", "{} = '{}': expected one of {}", key, value, names);
}

void require_at_least(const std::string& key, double value, double min, const char* what) {
  if (!(value >= min) || !std::isfinite(value)) fail("config", "{} = {}: expected {} >= {}", key, value, what, min);
}

void require_product_fits(std::initializer_list<std::pair<const char*, int64_t>> factors) {
  int64_t prod = 32;  // bytes per element, with room: f64 values, gradients and optimizer state
  std::string keys, values;
  bool overflow = false;
  for (auto& [key, v] : factors) {
    keys += (keys.empty() ? "" : " x ") + std::string(key);
    values += (values.empty() ? "" : " x ") + std::to_string(v);
    overflow = overflow || __builtin_mul_overflow(prod, v, &prod);
  }
  if (overflow)
    fail("config", "{} = {}: the product overflows 64 bits (a tensor of that many elements cannot exist)", keys,
         values);
}

void require_divisible(const std::string& key, int64_t value, const std::string& by_key, int64_t by) {
  if (by <= 0 || value % by != 0) fail("config", "{} = {} must be divisible by {} = {}", key, value, by_key, by);
}

void require_non_empty(const std::string& key, const std::string& value, const char* what) {
  if (value.empty()) fail("config", "{} is empty: expected {}", key, what);
}

// ---- The sections' rules across their keys (each key's own are its constraints in visit()) ----

void RecomputeConfig::check() const {
  if (!keep.empty() && patterns.empty())
    fail("config", "parallel.recompute.keep is set but parallel.recompute.patterns is empty: nothing is recomputed");
}

void TrainingConfig::check() const {
  require_product_fits({{"training.batch_size", batch_size}, {"training.seq_len", seq_len}});
  if (fp8 != "none" && dtype != "bf16")
    fail("config",
         "training.fp8 = {} needs training.dtype = bf16 (FP8 GEMMs take bf16 activations and give bf16 outputs), "
         "got training.dtype = {}",
         fp8, dtype);
}

void CheckpointConfig::check() const {
  if (interval.automatic && !(mtbf_s > 0))
    fail("config",
         "checkpoint.interval = auto needs checkpoint.mtbf_s, the job's mean time between failures in "
         "seconds (e.g. 3600): the interval is sqrt(2 x save cost x mtbf_s)");
  if (interval.automatic && interval_s > 0)
    fail("config", "checkpoint.interval = auto and checkpoint.interval_s = {} both choose the interval: set one",
         interval_s);
  if (dir.empty() && resume != "auto" && resume != "never")
    fail("config",
         "checkpoint.resume = {} but checkpoint.dir is empty: a resumed run needs a checkpoint.dir to "
         "write its own checkpoints into",
         resume);
  const std::string mem = memory.interval.automatic ? "auto" : std::to_string(memory.interval.steps);
  if (memory.on() && dir.empty())
    fail("config",
         "checkpoint.memory.interval = {} but checkpoint.dir is empty: the in-memory checkpoints are named after "
         "checkpoint.dir, and the disk's checkpoint is their fallback",
         mem);
  if (memory.on() && resume != "auto")
    fail("config",
         "checkpoint.memory.interval = {} needs checkpoint.resume = auto (it is {}): only resume: auto loads an "
         "in-memory checkpoint",
         mem, resume);
}

void ProfileConfig::check() const {
  MT_CHECK(steps.empty() || !dir.empty(), "config",
           "profile.steps is set but profile.dir is empty: where do traces go?");
}

}  // namespace mt
