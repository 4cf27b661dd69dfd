// Time stamps and durations shared by checkpoints, memory reports, metrics and benchmarks.
#pragma once

#include <chrono>
#include <string>

namespace trainer {

/// The current time in UTC, ISO 8601 to the second ("2026-11-22T03:35:28Z"): a checkpoint manifest's
/// "created", the time stamp of bench results and memory reports.
std::string utc_now_iso();

/// Wall-clock seconds since 1970, with microseconds: what Prometheus's time() and a report's
/// time_unix_s compare.
double unix_now();

/// Seconds on the steady clock since `t`.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace trainer
