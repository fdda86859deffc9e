#include "runtime/io/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>

#include "runtime/core/error.h"

namespace mt {

namespace {

// A section is anything with visit(); probe it with a visitor that accepts any key.
struct ProbeVisitor {
  template <class F> void operator()(const char*, F&, const char*) {}
};
template <class T> constexpr bool is_section_v = requires(T& t, ProbeVisitor& p) { t.visit(p); };
// A list of sections (parallel.tp_plan).
template <class T> constexpr bool is_section_list_v = false;
template <class T> constexpr bool is_section_list_v<std::vector<T>> = is_section_v<T>;

std::string join_path(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

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

std::string describe_node(const YAML::Node& n) {
  if (n.IsMap()) return "a map";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing";
  return "'" + n.Scalar() + "'";
}

template <class T> T scalar_as(const YAML::Node& n, const std::string& path, const char* expected) {
  if (!n.IsScalar()) fail("config", "{}: expected {}, got {}", path, expected, describe_node(n));
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    fail("config", "{}: expected {}, got {}", path, expected, describe_node(n));
  }
}

void read_value(const YAML::Node& n, const std::string& path, int& out) { out = scalar_as<int>(n, path, "an integer"); }
[[maybe_unused]] void read_value(const YAML::Node& n, const std::string& path, int64_t& out) {
  out = scalar_as<int64_t>(n, path, "an integer");
}
void read_value(const YAML::Node& n, const std::string& path, double& out) {
  out = scalar_as<double>(n, path, "a number");
}
[[maybe_unused]] void read_value(const YAML::Node& n, const std::string& path, bool& out) {
  out = scalar_as<bool>(n, path, "true or false");
}
void read_value(const YAML::Node& n, const std::string& path, std::string& out) {
  out = n.IsNull() ? std::string() : scalar_as<std::string>(n, path, "a string");
}
template <class T> void read_list(const YAML::Node& n, const std::string& path, std::vector<T>& out) {
  if (n.IsNull()) {
    out.clear();
    return;
  }
  if (!n.IsSequence()) fail("config", "{}: expected a list, got {}", path, describe_node(n));
  out.clear();
  for (size_t i = 0; i < n.size(); ++i) {
    T v{};
    read_value(n[i], fmt::format("{}[{}]", path, i), v);
    out.push_back(v);
  }
}
void read_value(const YAML::Node& n, const std::string& path, std::vector<double>& out) { read_list(n, path, out); }
[[maybe_unused]] void read_value(const YAML::Node& n, const std::string& path, std::vector<std::string>& out) {
  read_list(n, path, out);
}

struct Reader {
  const YAML::Node& node;
  std::string path;
  const std::set<std::string>& from_set;  // key paths given by --set
  std::vector<std::string> known;

  template <class T> void operator()(const char* key, T& field, const char*) {
    known.push_back(key);
    const YAML::Node n = node[key];
    if (!n) return;
    std::string p = join_path(path, key);
    if constexpr (is_section_v<T>) {
      read_section(n, p, field, from_set);
    } else if constexpr (is_section_list_v<T>) {
      field.clear();
      if (n.IsNull()) return;
      if (!n.IsSequence()) fail("config", "{}: expected a list of maps, got {}", p, describe_node(n));
      for (size_t i = 0; i < n.size(); ++i) {
        typename T::value_type e{};
        std::string ep = fmt::format("{}[{}]", p, i);
        if (!n[i].IsMap()) fail("config", "{}: expected a map of keys, got {}", ep, describe_node(n[i]));
        read_section(n[i], ep, e, from_set);
        field.push_back(e);
      }
    } else {
      read_value(n, p, field);
    }
  }

  template <class S> static void read_section(const YAML::Node& n, const std::string& path, S& section,
                                              const std::set<std::string>& from_set) {
    if (n.IsNull()) return;  // "log:" with nothing under it keeps the defaults
    if (!n.IsMap())
      fail("config", "{}: expected a map of keys, got {}", path.empty() ? "the top level" : path, describe_node(n));
    Reader r{n, path, from_set, {}};
    section.visit(r);
    std::set<std::string> seen;
    for (auto it = n.begin(); it != n.end(); ++it) {
      if (!it->first.IsScalar())
        fail("config", "{}: keys must be names, got {}", path.empty() ? "the top level" : path,
             describe_node(it->first));
      std::string key = it->first.Scalar();
      std::string full = join_path(path, key);
      // yaml-cpp keeps the first of two equal keys; silently dropping the second hides edits.
      if (!seen.insert(key).second) fail("config", "duplicate key '{}'", full);
      if (std::find(r.known.begin(), r.known.end(), key) != r.known.end()) continue;
      std::string names;
      for (auto& k : r.known) names += (names.empty() ? "" : ", ") + k;
      std::string best = nearest_name(key, r.known);
      std::string hint = best.empty() ? "" : fmt::format("; did you mean '{}'?", best);
      fail("config", "unknown key '{}'{} (known keys in '{}': {}){}", full,
           from_set.count(full) ? " given by --set" : "", path.empty() ? "the top level" : path, names, hint);
    }
  }
};

struct Writer {
  YAML::Emitter& out;
  template <class T> void operator()(const char* key, T& field, const char*) {
    out << YAML::Key << key << YAML::Value;
    if constexpr (is_section_v<T>) {
      out << YAML::BeginMap;
      field.visit(*this);
      out << YAML::EndMap;
    } else if constexpr (is_section_list_v<T>) {
      out << YAML::BeginSeq;
      for (auto& e : field) {
        out << YAML::BeginMap;
        e.visit(*this);
        out << YAML::EndMap;
      }
      out << YAML::EndSeq;
    } else if constexpr (std::is_same_v<T, std::vector<double>> || std::is_same_v<T, std::vector<std::string>>) {
      out << YAML::Flow << YAML::BeginSeq;
      // Strings quoted so that '', 'yes' or '[a' read back as the same strings.
      for (auto& x : field) {
        if constexpr (std::is_same_v<T, std::vector<std::string>>) out << YAML::DoubleQuoted;
        out << x;
      }
      out << YAML::EndSeq;
    } else if constexpr (std::is_same_v<T, std::string>) {
      out << YAML::DoubleQuoted << field;
    } else {
      out << field;
    }
  }
};

template <class T> void require_one_of(const std::string& key, const T& value, std::initializer_list<T> allowed) {
  for (auto& a : allowed)
    if (a == value) return;
  std::string names;
  for (auto& a : allowed) names += (names.empty() ? "'" : ", '") + fmt::format("{}", a) + "'";
  fail("config", "{} = '{}': expected one of {}", key, value, names);
}

void require_at_least(const std::string& key, double value, double min, const char* what) {
  if (!(value >= min) || !std::isfinite(value)) fail("config", "{} = {}: expected {} >= {}", key, value, what, min);
}

// Sizes multiplied into tensor sizes (elements, then bytes) must not overflow 64 bits: checked before any code
// multiplies them. factors: (key, value) pairs, each already >= 1.
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

// The model, training, data, eval, sample and checkpoint sections (mesh-dependent
// checks, such as the batch being divisible by dp, happen when the mesh exists).
void validate_training(const Config& c) {
  auto& m = c.model;
  require_at_least("model.dim", m.dim, 1, "a width");
  require_at_least("model.n_layers", m.n_layers, 1, "a layer count");
  require_at_least("model.n_heads", m.n_heads, 1, "a head count");
  require_at_least("model.n_kv_heads", m.n_kv_heads, 1, "a head count");
  require_at_least("model.ffn_dim", m.ffn_dim, 1, "a width");
  require_at_least("model.max_seq_len", m.max_seq_len, 1, "a length");
  if (m.vocab_size < 1 || m.vocab_size > INT32_MAX)
    fail("config", "model.vocab_size = {}: expected 1 ... {} (token ids are int32)", m.vocab_size, INT32_MAX);
  if (m.dim % m.n_heads != 0)
    fail("config", "model.dim = {} must be divisible by model.n_heads = {}", m.dim, m.n_heads);
  if (m.n_heads % m.n_kv_heads != 0)
    fail("config", "model.n_heads = {} must be divisible by model.n_kv_heads = {}", m.n_heads, m.n_kv_heads);
  if ((m.dim / m.n_heads) % 2 != 0)
    fail("config", "model.dim / model.n_heads = {} / {} = {}: RoPE needs an even head dim", m.dim, m.n_heads,
         m.dim / m.n_heads);
  if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps)) fail("config", "model.norm_eps = {}: expected > 0", m.norm_eps);
  if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta))
    fail("config", "model.rope_theta = {}: expected > 0", m.rope_theta);
  require_at_least("model.init_std", m.init_std, 0, "a standard deviation");
  require_product_fits({{"model.dim", m.dim}, {"model.vocab_size", m.vocab_size}});
  require_product_fits({{"model.dim", m.dim}, {"model.dim", m.dim}});
  require_product_fits({{"model.dim", m.dim}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits({{"model.n_layers", m.n_layers}, {"model.dim", m.dim}, {"model.dim", m.dim}});
  require_product_fits({{"model.n_layers", m.n_layers}, {"model.dim", m.dim}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits({{"model.max_seq_len", m.max_seq_len}, {"model.dim", m.dim}});

  auto& t = c.training;
  require_at_least("training.steps", t.steps, 0, "a step count");
  require_at_least("training.batch_size", t.batch_size, 1, "a number of sequences");
  require_at_least("training.seq_len", t.seq_len, 1, "a length");
  require_at_least("training.micro_batch_size", t.micro_batch_size, 0, "a number of sequences");
  // The step's activations: (batch x seq_len) rows of dim, ffn_dim and vocab_size (any mesh holds at most these).
  require_product_fits({{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}});
  require_product_fits({{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.dim", m.dim}});
  require_product_fits(
      {{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.ffn_dim", m.ffn_dim}});
  require_product_fits(
      {{"training.batch_size", t.batch_size}, {"training.seq_len", t.seq_len}, {"model.vocab_size", m.vocab_size}});
  if (t.seq_len > m.max_seq_len)
    fail("config", "training.seq_len = {} exceeds model.max_seq_len = {}", t.seq_len, m.max_seq_len);
  require_at_least("training.lr", t.lr, 0, "a learning rate");
  require_at_least("training.lr_min", t.lr_min, 0, "a learning rate");
  require_one_of<std::string>("training.schedule", t.schedule, {"constant", "cosine"});
  require_at_least("training.warmup_steps", t.warmup_steps, 0, "a step count");
  require_at_least("training.weight_decay", t.weight_decay, 0, "a decay");
  for (auto [key, b] : {std::pair{"training.beta1", t.beta1}, {"training.beta2", t.beta2}})
    if (!(b >= 0 && b < 1)) fail("config", "{} = {}: expected 0 <= beta < 1", key, b);
  if (!(t.eps > 0) || !std::isfinite(t.eps)) fail("config", "training.eps = {}: expected > 0", t.eps);
  require_at_least("training.grad_clip", t.grad_clip, 0, "a norm (0 = off)");
  require_one_of<std::string>("training.dtype", t.dtype, {"fp32", "fp64", "bf16"});
  require_one_of<std::string>("training.grad_reduce_dtype", t.grad_reduce_dtype, {"fp32", "bf16"});
  require_one_of<std::string>("parallel.cp_method", c.parallel.cp_method, {"ring", "all_gather", "alltoall"});
  if (c.parallel.fsdp.min_weight_size < 0)
    fail("config", "parallel.fsdp.min_weight_size = {}: expected a number of elements >= 0",
         c.parallel.fsdp.min_weight_size);
  require_one_of<std::string>("parallel.fsdp.param_dtype", c.parallel.fsdp.param_dtype, {"", "fp32", "bf16", "fp64"});
  require_one_of<std::string>("parallel.fsdp.reduce_dtype", c.parallel.fsdp.reduce_dtype, {"", "fp32", "bf16"});
  if (!c.parallel.fsdp.param_dtype.empty() && c.parallel.fsdp.param_dtype != t.dtype)
    fail("config",
         "parallel.fsdp.param_dtype = {} differs from training.dtype = {}: parameters are gathered in the "
         "dtype the model computes in; set training.dtype instead",
         c.parallel.fsdp.param_dtype, t.dtype);
  require_one_of<std::string>("parallel.cp_load_balance", c.parallel.cp_load_balance, {"head_tail", "none"});
  const RecomputeConfig& rc = c.parallel.recompute;
  for (size_t i = 0; i < rc.patterns.size(); ++i)
    if (rc.patterns[i].empty()) fail("config", "parallel.recompute.patterns[{}] is empty: expected a module path", i);
  if (rc.every < 1)
    fail("config", "parallel.recompute.every = {}: expected every N-th matched module, N >= 1", rc.every);
  for (size_t i = 0; i < rc.keep.size(); ++i)
    require_one_of<std::string>(fmt::format("parallel.recompute.keep[{}]", i), rc.keep[i], {"attention"});
  if (!rc.keep.empty() && rc.patterns.empty())
    fail("config", "parallel.recompute.keep is set but parallel.recompute.patterns is empty: nothing is recomputed");
  if (c.data.document_separator != -1 &&
      (c.data.document_separator < 0 || c.data.document_separator >= c.model.vocab_size))
    fail("config", "data.document_separator = {}: expected a token id in [0, model.vocab_size = {}), or -1 (off)",
         c.data.document_separator, c.model.vocab_size);
  require_at_least("training.grad_bucket_mb", t.grad_bucket_mb, 0, "a size in MiB (0 = per parameter)");
  require_at_least("training.threads", t.threads, 0, "a thread count (0 = auto)");
  if (t.threads > 1024) fail("config", "training.threads = {}: expected at most 1024 threads per rank", t.threads);
  require_one_of<std::string>("training.nonfinite", t.nonfinite, {"stop", "skip"});
  require_at_least("training.max_nonfinite_steps", t.max_nonfinite_steps, 1, "a step count");

  require_at_least("eval.interval", c.eval.interval, 0, "a step count (0 = never)");
  require_at_least("eval.steps", c.eval.steps, 1, "a batch count");
  require_at_least("sample.interval", c.sample.interval, 0, "a step count (0 = never)");
  require_at_least("sample.tokens", c.sample.tokens, 0, "a token count");
  require_at_least("sample.temperature", c.sample.temperature, 0, "a temperature");
  require_at_least("checkpoint.interval", c.checkpoint.interval, 0, "a step count (0 = at the end only)");
  require_at_least("checkpoint.keep", c.checkpoint.keep, 0, "a count (0 = all)");
  require_at_least("training.memory_limit_mb", c.training.memory_limit_mb, 0, "MiB (0 = no cap)");
  require_at_least("checkpoint.writers", double(c.checkpoint.writers), 0, "a count of ranks (0 = every rank)");
  if (c.checkpoint.resume.empty())
    fail("config", "checkpoint.resume is empty: expected auto, never or a checkpoint directory");
  if (c.checkpoint.dir.empty() && c.checkpoint.resume != "auto" && c.checkpoint.resume != "never")
    fail("config",
         "checkpoint.resume = {} but checkpoint.dir is empty: a resumed run needs a checkpoint.dir to "
         "write its own checkpoints into",
         c.checkpoint.resume);
}

void validate(const Config& c) {
  if (!(c.comm.timeout_s > 0) || !std::isfinite(c.comm.timeout_s))
    fail("config", "comm.timeout_s = {}: expected a finite number of seconds > 0", c.comm.timeout_s);
  require_one_of<std::string>("comm.backend", c.comm.backend, {"auto", "mpi", "nccl"});
  require_one_of<std::string>("comm.device", c.comm.device, {"cpu", "cuda"});
  for (size_t i = 0; i < c.comm.link_gbps.size(); ++i)
    if (!(c.comm.link_gbps[i] > 0) || !std::isfinite(c.comm.link_gbps[i]))
      fail("config", "comm.link_gbps[{}] = {}: expected a finite bandwidth in GB/s > 0", i, c.comm.link_gbps[i]);
  require_one_of<std::string>("log.level", c.log.level, {"", "trace", "debug", "info", "warn", "error", "off"});
  if (c.log.interval < 1) fail("config", "log.interval = {}: expected a number of steps >= 1", c.log.interval);
  require_one_of<std::string>("log.progress", c.log.progress, {"auto", "on", "off"});
  validate_training(c);
}

// "a.b=c": the value parsed as YAML, placed at a.b (maps made as needed).
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
bool names_key(const std::string& msg, const std::string& key) {
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

// An error says where the bad value came from: the --set arguments whose keys it names, else the file.
// "[config] --set training.steps=-1: training.steps = -1: expected ...", "[config] configs/x.yaml: ...".
[[noreturn]] void fail_with_origin(const Error& e, const std::string& path, const std::vector<std::string>& overrides) {
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

// path: the file the YAML came from, for messages ("" = a string or defaults).
Config from_node(YAML::Node root, const std::vector<std::string>& overrides, const std::string& path = "") {
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  Config c;
  try {
    // Before the overrides: yaml-cpp would turn a list into a map, or throw its own error on a scalar.
    if (!root.IsMap()) fail("config", "the top level: expected a map of keys, got {}", describe_node(root));
    try {
      std::set<std::string> from_set;
      for (auto& ov : overrides) apply_override(root, ov, from_set);
      Reader::read_section(root, "", c, from_set);
    } catch (const YAML::Exception& e) {
      // A yaml-cpp corner not checked above still leaves as a config error, not a bare library one.
      fail("config", "{}", e.what());
    }
    validate(c);
  } catch (const Error& e) {
    fail_with_origin(e, path, overrides);
  }
  return c;
}

}  // namespace

std::string nearest_name(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  size_t best_d = 1000;
  for (auto& n : names) {
    size_t d = edit_distance(word, n);
    if (d < best_d) best_d = d, best = n;
  }
  return best_d <= std::max<size_t>(2, word.size() / 3) ? best : "";
}

Config config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    fail("config", "YAML error at line {}, column {}: {}", e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  return from_node(root, overrides);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return from_node(YAML::Node(), overrides);
  std::ifstream in(path);
  if (!in) fail("config", "cannot read config file '{}': {}", path, std::strerror(errno));
  YAML::Node root;
  try {
    root = YAML::Load(in);
  } catch (const YAML::ParserException& e) {
    fail("config", "{}: YAML error at line {}, column {}: {}", path, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  return from_node(root, overrides, path);  // errors name the file, or the --set that gave the bad value
}

std::string config_to_yaml(const Config& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  Writer w{out};
  const_cast<Config&>(c).visit(w);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

uint64_t config_hash(const Config& c) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : config_to_yaml(c)) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}


void require_divisible(const std::string& key, int64_t value, const std::string& by_key, int64_t by) {
  if (by <= 0 || value % by != 0) fail("config", "{} = {} must be divisible by {} = {}", key, value, by_key, by);
}

}  // namespace mt
