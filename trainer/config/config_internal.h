// Internal to trainer/config/: the table of keys (config_fields.cpp) and the error that names a bad key,
// shared by the YAML reading (config.cpp) and the checks (config_checks.cpp). Nothing outside the folder
// includes it.
#pragma once

#include "trainer/config/config.h"

#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace trainer::config_internal {

// A mode key (an enum field, config.h): read and written by its names, mode_names<E>(), through the value's
// index in them. mode() makes one.
struct ModeRef {
  const std::vector<std::string>* names;  // the enum's names, in its order
  std::function<size_t()> get;            // the value's index in names
  std::function<void(size_t)> set;
};

template <class E>
ModeRef mode(E* value) {
  return {&mode_names<E>(), [value] { return static_cast<size_t>(*value); },
          [value](size_t i) { *value = static_cast<E>(i); }};
}

// A typed pointer into a Config: the one table (config_fields.cpp) drives parsing, overrides and the dump.
using FieldRef = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, std::vector<int64_t>*,
                              std::vector<double>*, std::vector<std::string>*, ModeRef>;

struct Field {
  std::string key;    // dotted: "train.global_batch"
  FieldRef ref;
  bool allow_auto;    // integer keys that also take `auto` (stored as -1)
};

/// Every key of `c`, section by section, in the order of the YAML dump.
std::vector<Field> fields(Config& c);

/// Throws ConfigError "<source>: key '<key>': <what>" (without the key part when `key` is empty).
[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& what);

}  // namespace trainer::config_internal
