// The memory report, written on every OOM and on request (SIGUSR2, GET /memory): what the device
// allocator holds and why an allocation may have failed, in the spirit of torch.cuda.memory_summary().
// It is a block of text for the log and a JSON file in the run folder, memory_report_<step>.json.
//
//   allocated      tensor bytes handed out now
//   reserved       bytes the allocator holds from the system (CUDA cache; = allocated on CPU)
//   active         bytes in blocks in use (CUDA: allocated plus the unused tails of split blocks)
//   peak           highest allocated since the last reset (the loop resets it each step)
//   limit          the trainer's cap (0 = none); total and free: the device's (or host's) memory
//   fragmentation  reserved - allocated: held but not usable by a tensor of any size
//   largest free   the largest free block inside the cache (CUDA, from the allocator's snapshot): the
//                  largest tensor that fits without asking the driver for more
//   OOMs           out-of-memory failures reported to the reporter; allocator_ooms (CUDA num_ooms) and
//                  allocation_refusals (the capped CPU allocator's refusals) where the backend counts them
//   phase peaks    the peak per phase (forward, backward, optimizer) of the last few steps, when the loop
//                  records them
//
// On CPU, fragmentation and largest free block are "not applicable": the capped allocator caches
// nothing (every free goes back to malloc), and the report says so.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>

namespace trainer {

class MemoryBackend;
class Telemetry;

/// Device memory statistics for a report. Sizes in bytes; -1 = the backend cannot tell.
struct MemoryStats {
  std::string device;                ///< "cpu", "cuda:0"
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t active = 0;
  int64_t peak = 0;
  int64_t limit = 0;                 ///< 0 = none
  int64_t total = 0;
  int64_t free = 0;
  int64_t fragmentation = 0;         ///< reserved - allocated
  int64_t largest_free_block = -1;   ///< CUDA only
  int64_t segments = -1;             ///< CUDA: segments reserved from the driver
  int64_t allocator_ooms = -1;       ///< CUDA: the caching allocator's num_ooms
  int64_t alloc_retries = -1;        ///< CUDA: allocations that succeeded only after freeing the cache
  int64_t allocation_refusals = -1;  ///< CPU: allocations the capped allocator refused since start
  std::string note;                  ///< what does not apply on this backend, and why
};

/// Reads the statistics of `backend` (CUDA: DeviceStats and the allocator's snapshot, compiled under
/// TRAINER_WITH_CUDA only).
MemoryStats collect_memory_stats(const MemoryBackend& backend);

/// What write() produced.
struct MemoryReport {
  nlohmann::json json;  ///< the fields of the file (see MemoryReporter::build)
  std::string text;     ///< the log block (MemoryReporter::format)
  std::string path;     ///< the file written; "" if it could not be written
  std::string write_error;  ///< why the file could not be written ("" if it was)
};

/// Collects phase peaks and OOM counts during the run and writes reports. Thread-safe.
class MemoryReporter {
 public:
  /// Reports go into `run_dir`. With `telemetry`, each report's JSON also becomes what GET /memory
  /// returns. `keep_steps` (>= 1): how many recent steps' phase peaks a report lists.
  explicit MemoryReporter(std::string run_dir, Telemetry* telemetry = nullptr, int keep_steps = 8);

  /// The peak bytes of `phase` ("forward", "backward", "optimizer", or any name) in optimizer step
  /// `step`. A second value for the same step and phase keeps the larger one (micro-batches).
  void record_phase_peak(int64_t step, const std::string& phase, int64_t bytes);
  /// An out-of-memory failure happened (the loop calls it when it catches one; write(..., "oom") does it).
  void count_oom();
  int64_t ooms() const;

  /// The report as JSON: {"step", "reason", "time" (UTC ISO 8601), "device", "allocated_bytes",
  /// "reserved_bytes", "active_bytes", "peak_bytes", "limit_bytes", "total_bytes", "free_bytes",
  /// "fragmentation_bytes", "largest_free_block_bytes", "segments", "ooms", "allocator_ooms",
  /// "alloc_retries", "allocation_refusals", "note", "phase_peaks": [{"step", "<phase>": bytes, ...}],
  /// "error"}. Values the backend cannot tell are null. `error` (an exception's what()) is kept up to the
  /// C++ backtrace that c10::Error appends.
  nlohmann::json build(int64_t step, const MemoryBackend& backend, const std::string& reason,
                       const std::string& error = "") const;
  /// Builds the report and writes it atomically (a .tmp file, then rename) to
  /// <run_dir>/memory_report_<step>.json, or memory_report_<step>_<n>.json (n = 2, 3, ...) when that
  /// step already has one (several OOMs in one step). reason "oom" counts an OOM first. Never throws
  /// for the file: a report must not fail the run it describes; when the file cannot be written,
  /// `path` is empty and `write_error` names the file and the cause (log it with the text).
  MemoryReport write(int64_t step, const MemoryBackend& backend, const std::string& reason,
                     const std::string& error = "");

  /// The log block for a report built by build(): one aligned line per value.
  static std::string format(const nlohmann::json& report);

 private:
  std::string run_dir_;
  Telemetry* telemetry_;
  size_t keep_steps_;
  mutable std::mutex mu_;
  int64_t ooms_ = 0;
  std::deque<std::pair<int64_t, std::map<std::string, int64_t>>> phases_;  // oldest first
};

}  // namespace trainer
