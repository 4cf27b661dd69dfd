// Watches a run's metrics.jsonl while train() writes it, so the bench can see each line the moment it
// appears without hooking into the loop: the wall time of the timed steps is the time between the last
// warmup step's line and the last timed step's line. inotify on the folder wakes the watcher; where
// inotify is unavailable it polls every millisecond. MetricsLog flushes every line, so a line's stamp
// trails its write by the wake-up latency only.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace trainer::bench {

class MetricsWatcher {
 public:
  /// Called on the watcher's thread with every line of the file (events too) as it appears, and the wall
  /// time (seconds since 1970, the system clock) at which it was seen.
  using LineCallback = std::function<void(const nlohmann::json& line, double unix_s)>;

  /// Starts watching `dir`/`name` (the file need not exist yet).
  MetricsWatcher(const std::filesystem::path& dir, const std::string& name, LineCallback on_line = nullptr);
  ~MetricsWatcher();
  /// Reads what is left of the file and stops the thread.
  void stop();
  /// Seconds since construction (steady clock) at which each step's line was first seen.
  std::map<int64_t, double> stamps() const;
  /// How the stamps were taken, for the result's wall_source.
  std::string source() const;

 private:
  using Clock = std::chrono::steady_clock;
  void loop();
  void drain(double t);

  std::string path_;
  Clock::time_point t0_;
  LineCallback on_line_;
  int fd_ = -1, file_ = -1;
  std::string pending_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::map<int64_t, double> stamps_;
  std::thread thread_;
};

}  // namespace trainer::bench
