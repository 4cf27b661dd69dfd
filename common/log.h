// Logging (spdlog: console + <run-dir>/train.log) and the metrics stream (<run-dir>/metrics.jsonl: one
// JSON object per line; optimizer steps carry "step", evaluations and events carry "event").
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>

namespace trainer {

/// Installs the default spdlog logger: colored stderr plus `<run_dir>/train.log` (appended, so a
/// resumed run keeps one log). `level` is trace|debug|info|warn|error. Empty run_dir: console only.
void setup_logging(const std::string& run_dir, const std::string& level);

/// Appends JSON lines to a file, one write(2) per line, so a killed run loses no line it wrote.
///
/// A line that cannot be written (disk full, I/O error) is dropped, and a line cut short is taken back
/// (the file is truncated to its last whole line), so the file stays valid JSON lines. The first
/// failure is logged once at error level, naming the file and the reason; training goes on, and each
/// later line is tried again. The first line written after a failure logs, at warn level, that writing
/// resumed and how many lines were lost.
class MetricsLog {
 public:
  MetricsLog() = default;
  explicit MetricsLog(const std::string& path) { open(path); }
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  /// Opens `path` for appending; throws std::runtime_error naming the path if it cannot.
  void open(const std::string& path);
  void write(const nlohmann::json& record);
  /// Writes {"event": kind, ...fields}; also used for evaluations.
  void event(const std::string& kind, nlohmann::json fields);
  /// Called with every record, written or dropped (telemetry, TensorBoard).
  void set_observer(std::function<void(const nlohmann::json&)> observer) { observer_ = std::move(observer); }

 private:
  void append(const std::string& line);  // under mu_

  int fd_ = -1;
  std::string path_;
  std::string failure_;  // why the last line could not be written; "" while lines are written
  int64_t lost_ = 0;     // lines dropped since the failure began
  std::mutex mu_;
  std::function<void(const nlohmann::json&)> observer_;
};

/// An exception's message as one line for a user or a log: a c10::Error's without its C++ backtrace
/// (what_without_backtrace(); what() appends one), the text of a backtrace carried inside another
/// exception's message cut off too, and any remaining line breaks joined with "; ".
std::string error_message(const std::exception& e);

/// `j` as JSON text (`indent` as nlohmann's dump). Strings that are not UTF-8 (a path from outside, an
/// error naming one) have their invalid bytes written as U+FFFD instead of making dump() throw.
std::string json_text(const nlohmann::json& j, int indent = -1);

/// "1h02m03s" / "4m05s" / "12.3s".
std::string format_duration(double seconds);

}  // namespace trainer
