// The generic YAML side of the config: sections (anything with visit()) read with unknown-key, duplicate-key and
// type errors naming the key path, --set overrides applied first, and the canonical YAML written back. Used by
// runtime/train/run_config.cpp for the whole run's Config; what a key must satisfy is its constraints in visit(),
// checked by config.h's check_section.
#pragma once
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/io/config.h"

namespace mt {
inline YAML::Emitter& operator<<(YAML::Emitter& out, const StepsOrAuto& v) {
  return v.automatic ? out << "auto" : out << v.steps;
}
}  // namespace mt

namespace mt::config_io {

inline std::string describe_node(const YAML::Node& n) {
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

inline void read_value(const YAML::Node& n, const std::string& path, int& out) { out = scalar_as<int>(n, path, "an integer"); }
inline void read_value(const YAML::Node& n, const std::string& path, int64_t& out) {
  out = scalar_as<int64_t>(n, path, "an integer");
}
inline void read_value(const YAML::Node& n, const std::string& path, double& out) {
  out = scalar_as<double>(n, path, "a number");
}
inline void read_value(const YAML::Node& n, const std::string& path, bool& out) {
  out = scalar_as<bool>(n, path, "true or false");
}
inline void read_value(const YAML::Node& n, const std::string& path, std::string& out) {
  out = n.IsNull() ? std::string() : scalar_as<std::string>(n, path, "a string");
}
inline void read_value(const YAML::Node& n, const std::string& path, StepsOrAuto& out) {
  if (n.IsScalar() && n.Scalar() == "auto") {
    out = {0, true};
    return;
  }
  out = {scalar_as<int64_t>(n, path, "a step count or auto"), false};
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
inline void read_value(const YAML::Node& n, const std::string& path, std::vector<double>& out) { read_list(n, path, out); }
inline void read_value(const YAML::Node& n, const std::string& path, std::vector<int>& out) { read_list(n, path, out); }
inline void read_value(const YAML::Node& n, const std::string& path, std::vector<std::string>& out) {
  read_list(n, path, out);
}

struct Reader {
  const YAML::Node& node;
  std::string path;
  const std::set<std::string>& from_set;  // key paths given by --set
  std::set<std::string>* given;           // key paths present in the YAML (with the overrides)
  std::vector<std::string> known;

  template <class T, class... C> void operator()(const char* key, T& field, const char*, const C&...) {
    known.push_back(key);
    const YAML::Node n = node[key];
    if (!n) return;
    std::string p = join_path(path, key);
    if (given) given->insert(p);
    if constexpr (is_section_v<T>) {
      read_section(n, p, field, from_set, given);
    } else if constexpr (is_section_list_v<T>) {
      field.clear();
      if (n.IsNull()) return;
      if (!n.IsSequence()) fail("config", "{}: expected a list of maps, got {}", p, describe_node(n));
      for (size_t i = 0; i < n.size(); ++i) {
        typename T::value_type e{};
        std::string ep = fmt::format("{}[{}]", p, i);
        if (!n[i].IsMap()) fail("config", "{}: expected a map of keys, got {}", ep, describe_node(n[i]));
        read_section(n[i], ep, e, from_set, given);
        field.push_back(e);
      }
    } else {
      read_value(n, p, field);
    }
  }

  template <class S> static void read_section(const YAML::Node& n, const std::string& path, S& section,
                                              const std::set<std::string>& from_set,
                                              std::set<std::string>* given = nullptr) {
    if (n.IsNull()) return;  // "log:" with nothing under it keeps the defaults
    if (!n.IsMap())
      fail("config", "{}: expected a map of keys, got {}", path.empty() ? "the top level" : path, describe_node(n));
    Reader r{n, path, from_set, given, {}};
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
  template <class T, class... C> void operator()(const char* key, T& field, const char*, const C&...) {
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
    } else if constexpr (std::is_same_v<T, std::vector<double>> || std::is_same_v<T, std::vector<int>> ||
                         std::is_same_v<T, std::vector<std::string>>) {
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


// "a.b=c": the value parsed as YAML, placed at a.b (maps made as needed); the key path goes into from_set.
void apply_override(YAML::Node& root, const std::string& ov, std::set<std::string>& from_set);
// An error says where the bad value came from: the --set arguments whose keys it names, else the file.
// "[config] --set training.steps=-1: training.steps = -1: expected ...", "[config] configs/x.yaml: ...".
[[noreturn]] void fail_with_origin(const Error& e, const std::string& path, const std::vector<std::string>& overrides);
// The YAML of a file ("" = none) or of a string, as config errors naming the line.
YAML::Node load_yaml_file(const std::string& path);
YAML::Node load_yaml_string(const std::string& yaml);

// A whole config (a root section) from YAML: overrides applied, keys read, complete(root, the key paths the YAML
// gave) fills in what the YAML leaves to other files, then every key's constraints and each section's check()
// (check_section); every error names the file (path, "" = a string or defaults) or the --set that gave the bad
// value.
template <class Root>
Root from_node(YAML::Node root, const std::vector<std::string>& overrides, const std::string& path,
               void (*complete)(Root&, const std::set<std::string>& given)) {
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  Root c;
  std::set<std::string> given;
  try {
    // Before the overrides: yaml-cpp would turn a list into a map, or throw its own error on a scalar.
    if (!root.IsMap()) fail("config", "the top level: expected a map of keys, got {}", describe_node(root));
    try {
      std::set<std::string> from_set;
      for (auto& ov : overrides) apply_override(root, ov, from_set);
      Reader::read_section(root, "", c, from_set, &given);
    } catch (const YAML::Exception& e) {
      // A yaml-cpp corner not checked above still leaves as a config error, not a bare library one.
      fail("config", "{}", e.what());
    }
    complete(c, given);
    check_section(c, "");
  } catch (const Error& e) {
    fail_with_origin(e, path, overrides);
  }
  return c;
}

// The canonical YAML of a section: every key, defaults included.
template <class Root> std::string to_yaml(const Root& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  Writer w{out};
  const_cast<Root&>(c).visit(w);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace mt::config_io
