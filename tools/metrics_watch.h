// Watches a run's metrics.jsonl while train() writes it and hands over every line the moment it
// appears, so the bench can time steps and act on them (write control.yaml) without hooking into the
// loop. inotify on the folder wakes the watcher; where inotify is unavailable it polls every
// millisecond. MetricsLog flushes every line, so a line is seen within the wake-up latency of its write.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

namespace trainer::bench {

class MetricsWatcher {
 public:
  /// Called on the watcher's thread with every line of the file that is a JSON object (events too), in
  /// file order, with when it was seen: `unix_s` on the system clock (seconds since 1970, comparable with
  /// the trainer's time stamps) and `elapsed_s` on the steady clock (seconds since the watcher started,
  /// for durations).
  using LineCallback = std::function<void(const nlohmann::json& line, double unix_s, double elapsed_s)>;

  /// Starts watching `dir`/`name` (the file need not exist yet).
  MetricsWatcher(const std::filesystem::path& dir, const std::string& name, LineCallback on_line);
  ~MetricsWatcher();
  /// Reads what is left of the file and stops the thread; no callback runs after it returns.
  void stop();
  /// How lines are seen, for a result's wall_source: "metrics lines (inotify)" or "(polling)".
  std::string source() const;

 private:
  using Clock = std::chrono::steady_clock;
  void loop();
  void drain(double elapsed_s);

  std::string path_;
  Clock::time_point t0_;
  LineCallback on_line_;
  int fd_ = -1, file_ = -1;
  std::string pending_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace trainer::bench
