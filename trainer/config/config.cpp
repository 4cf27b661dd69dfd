// The YAML side of the config: a file, a text or a --set assignment read into a Config through the field
// table (config_fields.cpp), each value checked against its key's type; the dump of a resolved Config
// (to_yaml); load_config, which layers defaults, file and overrides, then validates (config_checks.cpp).
#include "trainer/config/config.h"

#include "trainer/config/config_internal.h"
#include "trainer/config/default_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <variant>

namespace trainer {

using config_internal::fail;
using config_internal::Field;
using config_internal::fields;
using config_internal::ModeRef;

[[noreturn]] void config_internal::fail(const std::string& source, const std::string& key, const std::string& what) {
  throw ConfigError(source + ": " + (key.empty() ? "" : "key '" + key + "': ") + what);
}

namespace {

std::string describe(const YAML::Node& n) {
  if (n.IsScalar()) return "'" + n.Scalar() + "'";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

// Parses one scalar as T with yaml-cpp's own conversion, which rejects "12abc" for integers.
template <typename T>
T scalar_as(const YAML::Node& n, const std::string& source, const std::string& key, const char* type_name) {
  if (!n.IsScalar()) fail(source, key, std::string("expected ") + type_name + ", got " + describe(n));
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    fail(source, key, std::string("expected ") + type_name + ", got " + describe(n));
  }
}

// A mode key takes one of its enum's names, and nothing else (an empty value is the name "").
void assign_mode(const ModeRef& m, const YAML::Node& n, const std::string& source, const std::string& key) {
  const std::string name = n.IsNull() ? "" : scalar_as<std::string>(n, source, key, "a string");
  try {
    m.set(mode_index(*m.names, name));
  } catch (const std::invalid_argument& e) {
    fail(source, key, e.what());  // "'fast' is not one of: ..."
  }
}

void assign(Field& f, const YAML::Node& n, const std::string& source) {
  std::visit(
      [&](const auto& p) {  // a typed pointer, or a ModeRef
        using T = std::remove_pointer_t<std::decay_t<decltype(p)>>;
        if constexpr (std::is_same_v<T, ModeRef>) {
          assign_mode(p, n, source, f.key);
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (f.allow_auto && n.IsScalar() && n.Scalar() == "auto") *p = -1;
          else *p = scalar_as<int64_t>(n, source, f.key, f.allow_auto ? "an integer or 'auto'" : "an integer");
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          *p = scalar_as<uint64_t>(n, source, f.key, "a non-negative integer");
        } else if constexpr (std::is_same_v<T, double>) {
          // YAML's .nan and .inf are numbers to yaml-cpp; no key means anything by them, and NaN slips
          // through range checks (every comparison with it is false).
          *p = scalar_as<double>(n, source, f.key, "a number");
          if (!std::isfinite(*p)) fail(source, f.key, "expected a finite number, got " + describe(n));
        } else if constexpr (std::is_same_v<T, bool>) {
          *p = scalar_as<bool>(n, source, f.key, "true or false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (n.IsNull()) *p = "";
          else *p = scalar_as<std::string>(n, source, f.key, "a string");
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          if (!n.IsSequence()) fail(source, f.key, "expected a list of numbers, got " + describe(n));
          std::vector<double> v;
          for (const auto& e : n) {
            v.push_back(scalar_as<double>(e, source, f.key, "a list of numbers"));
            if (!std::isfinite(v.back())) fail(source, f.key, "expected finite numbers, got " + describe(e));
          }
          *p = std::move(v);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (!n.IsSequence()) fail(source, f.key, "expected a list of strings, got " + describe(n));
          std::vector<std::string> v;
          for (const auto& e : n) v.push_back(scalar_as<std::string>(e, source, f.key, "a list of strings"));
          *p = std::move(v);
        } else {  // std::vector<int64_t>
          if (!n.IsSequence()) fail(source, f.key, "expected a list of integers, got " + describe(n));
          std::vector<int64_t> v;
          for (const auto& e : n) v.push_back(scalar_as<int64_t>(e, source, f.key, "a list of integers"));
          *p = std::move(v);
        }
      },
      f.ref);
}

Field* find_field(std::vector<Field>& fs, const std::string& key) {
  for (auto& f : fs)
    if (f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::vector<Field>& fs, const std::string& prefix) {
  return std::any_of(fs.begin(), fs.end(), [&](const Field& f) { return f.key.rfind(prefix + ".", 0) == 0; });
}

// The keys of one section, for "did you mean" help in errors.
std::string section_keys(const std::vector<Field>& fs, const std::string& key) {
  auto dot = key.rfind('.');
  std::string prefix = dot == std::string::npos ? "" : key.substr(0, dot + 1);
  std::string out;
  std::set<std::string> seen;
  for (const auto& f : fs) {
    if (f.key.rfind(prefix, 0) != 0) continue;
    std::string rest = f.key.substr(prefix.size());
    rest = rest.substr(0, rest.find('.'));
    if (seen.insert(rest).second) out += (out.empty() ? "" : ", ") + rest;
  }
  return out;
}

void apply_node(std::vector<Field>& fs, const YAML::Node& node, const std::string& prefix,
                const std::string& source) {
  std::set<std::string> seen;
  for (const auto& kv : node) {
    std::string k = kv.first.Scalar();
    std::string key = prefix.empty() ? k : prefix + "." + k;
    // yaml-cpp keeps both entries of a repeated key; which one counts would be an accident of order.
    if (!seen.insert(k).second) fail(source, key, "appears twice; keep one");
    if (Field* f = find_field(fs, key)) {
      assign(*f, kv.second, source);
    } else if (is_section(fs, key)) {
      if (!kv.second.IsMap()) fail(source, key, "expected a mapping of keys, got " + describe(kv.second));
      apply_node(fs, kv.second, key, source);
    } else {
      fail(source, key, "unknown key (known here: " + section_keys(fs, key) + ")");
    }
  }
}

// The shortest decimal text that reads back as exactly `v` (0.1 rather than 0.10000000000000001), so a
// resolved config both reads well and reproduces the run bit for bit.
std::string shortest(double v) {
  char buf[64];
  for (int prec = 6; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stays a float when read back
  return s;
}

}  // namespace

void apply_yaml_text(Config& cfg, const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail(source, "", std::string("malformed YAML: ") + e.what());
  }
  if (root.IsNull()) return;  // an empty file changes nothing
  if (!root.IsMap()) fail(source, "", "expected a mapping at the top level, got " + describe(root));
  auto fs = fields(cfg);
  apply_node(fs, root, "", source);
}

// Read once, as a stream: a named pipe works (`--config <(render-config)`) and waits for its writer, as a
// shell's pipe would (common/files.h has the readers that refuse one).
void apply_yaml_file(Config& cfg, const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot read the config file (missing or unreadable)");
  std::stringstream ss;
  ss << in.rdbuf();
  apply_yaml_text(cfg, ss.str(), path);
}

void apply_override(Config& cfg, const std::string& assignment) {
  const std::string source = "--set " + assignment;
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) fail(source, "", "expected key=value");
  std::string key = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  auto fs = fields(cfg);
  Field* f = find_field(fs, key);
  if (!f) fail(source, key, "unknown key (known here: " + section_keys(fs, key) + ")");
  YAML::Node n;
  try {
    n = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail(source, key, std::string("malformed value: ") + e.what());
  }
  assign(*f, n, source);
}

std::string to_yaml(const Config& cfg) {
  Config copy = cfg;  // fields() takes mutable pointers; the dump only reads them
  auto fs = fields(copy);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string open;      // the section whose map is open
  std::string open_sub;  // the mapping open inside it, if any
  for (const auto& f : fs) {
    auto dot = f.key.find('.');
    std::string section = dot == std::string::npos ? "" : f.key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? f.key : f.key.substr(dot + 1);
    // A key of three parts (model.lora.rank) sits in a mapping inside its section's.
    const auto dot2 = leaf.find('.');
    const std::string sub = dot2 == std::string::npos ? "" : leaf.substr(0, dot2);
    if (dot2 != std::string::npos) leaf = leaf.substr(dot2 + 1);
    if (section != open || sub != open_sub) {
      if (!open_sub.empty()) out << YAML::EndMap;
      open_sub.clear();
    }
    if (section != open) {
      if (!open.empty()) out << YAML::EndMap;
      if (!section.empty()) out << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open = section;
    }
    if (sub != open_sub) {
      out << YAML::Key << sub << YAML::Value << YAML::BeginMap;
      open_sub = sub;
    }
    out << YAML::Key << leaf << YAML::Value;
    std::visit(
        [&](const auto& p) {  // a typed pointer, or a ModeRef
          using T = std::remove_pointer_t<std::decay_t<decltype(p)>>;
          if constexpr (std::is_same_v<T, ModeRef>) {
            out << YAML::DoubleQuoted << (*p.names)[p.get()];  // quoted, as when modes were strings
          } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (auto v : *p) out << v;
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, std::vector<double>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (auto v : *p) out << shortest(v);
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (const auto& v : *p) out << YAML::DoubleQuoted << v;
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, int64_t>) {
            if (f.allow_auto && *p == -1) out << "auto";
            else out << *p;
          } else if constexpr (std::is_same_v<T, std::string>) {
            out << YAML::DoubleQuoted << *p;
          } else if constexpr (std::is_same_v<T, double>) {
            out << shortest(*p);
          } else {
            out << *p;
          }
        },
        f.ref);
  }
  if (!open_sub.empty()) out << YAML::EndMap;
  if (!open.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config cfg;
  if (path.empty()) apply_yaml_text(cfg, kDefaultConfigYaml, std::string("built-in ") + kDefaultConfigName);
  else apply_yaml_file(cfg, path);
  for (const auto& o : overrides) apply_override(cfg, o);
  validate(cfg);
  return cfg;
}

}  // namespace trainer
