// Logging (spdlog: console + <run-dir>/train.log) and the metrics stream (<run-dir>/metrics.jsonl: one
// JSON object per line; optimizer steps carry "step", evaluations and events carry "event").
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <mutex>
#include <string>

namespace trainer {

/// Installs the default spdlog logger: colored stderr plus `<run_dir>/train.log` (appended, so a
/// resumed run keeps one log). `level` is trace|debug|info|warn|error. Empty run_dir: console only.
void setup_logging(const std::string& run_dir, const std::string& level);

/// An exception's message as one line: a c10::Error without its backtrace (LibTorch appends dozens of
/// frames), line breaks replaced by "; ".
std::string one_line(const std::exception& e);

/// Appends JSON lines to a file and flushes each one, so a killed run loses no line it wrote.
class MetricsLog {
 public:
  MetricsLog() = default;
  explicit MetricsLog(const std::string& path) { open(path); }
  /// Opens `path` for appending; throws std::runtime_error naming the path if it cannot.
  void open(const std::string& path);
  void write(const nlohmann::json& record);
  /// Writes {"event": kind, ...fields}; also used for evaluations.
  void event(const std::string& kind, nlohmann::json fields);
  /// Called with every record after it is written (telemetry, TensorBoard).
  void set_observer(std::function<void(const nlohmann::json&)> observer) { observer_ = std::move(observer); }

 private:
  std::ofstream out_;
  std::mutex mu_;
  std::function<void(const nlohmann::json&)> observer_;
};

/// `j` as JSON text (`indent` as nlohmann's dump). Strings that are not UTF-8 (a path from outside, an
/// error naming one) have their invalid bytes written as U+FFFD instead of making dump() throw.
std::string json_text(const nlohmann::json& j, int indent = -1);

/// "1h02m03s" / "4m05s" / "12.3s".
std::string format_duration(double seconds);

}  // namespace trainer
