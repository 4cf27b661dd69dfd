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
//   phase peaks    the peak per phase (forward, backward, optimizer) of the attempts of the last few steps,
//                  when the loop records them (PhasePeakBackend + PhasePeakRecorder, below)
//
// On CPU, fragmentation and largest free block are "not applicable": the capped allocator caches
// nothing (every free goes back to malloc), and the report says so.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "trainer/memory/backend.h"

namespace trainer {

/// Where a written report goes besides its file: the telemetry (trainer/observe/telemetry.h), whose
/// GET /memory returns the last one. An interface here, so that memory/ does not depend on observe/.
class MemoryReportSink {
 public:
  virtual ~MemoryReportSink() = default;
  virtual void set_memory_report(const std::string& json_text) = 0;
};

/// Device memory statistics for a report. Sizes in bytes; -1 = the backend cannot tell.
struct MemoryStats : DeviceMemory {  // device, allocated, reserved, peak, limit
  int64_t active = 0;
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
  /// Reports go into `run_dir`. With `sink`, each report's JSON also goes there (GET /memory). `keep_steps` (>= 1): how many recent steps' phase peaks a report lists.
  explicit MemoryReporter(std::string run_dir, MemoryReportSink* sink = nullptr, int keep_steps = 8);

  /// Starts a new phase_peaks entry: an attempt at optimizer step `step` with micro-batches of
  /// `micro_batch` samples. Each OOM retry of a step is an attempt of its own, so a report shows the
  /// failed attempt's peaks next to the retry's.
  void begin_attempt(int64_t step, int64_t micro_batch);
  /// The peak bytes of `phase` ("forward", "backward", "optimizer", or any name) in optimizer step
  /// `step`, added to the current entry when it is the same step (else a new entry). A second value for
  /// the same phase keeps the larger one (micro-batches).
  void record_phase_peak(int64_t step, const std::string& phase, int64_t bytes);
  /// The current entry's attempt ended with an exception (an OOM) during `phase`.
  void mark_failed(const std::string& phase);
  /// An out-of-memory failure happened (the loop calls it when it catches one; write(..., "oom") does it).
  void count_oom();
  int64_t ooms() const;

  /// The report as JSON: {"step", "reason", "time" (UTC ISO 8601), "device", "allocated_bytes",
  /// "reserved_bytes", "active_bytes", "peak_bytes", "limit_bytes", "total_bytes", "free_bytes",
  /// "fragmentation_bytes", "largest_free_block_bytes", "segments", "ooms", "allocator_ooms",
  /// "alloc_retries", "allocation_refusals", "note", "phase_peaks", "error", "time_unix_s"}. Values the
  /// backend cannot tell are null. `error` (an exception's what()) is kept up to the C++ backtrace that
  /// c10::Error appends. `time_unix_s`: the same time as `time`, in seconds since 1970 with microseconds
  /// (for measuring how long a recovery took). `phase_peaks`: one object per attempt of the last
  /// `keep_steps` steps, oldest first: {"step", "micro_batch" (when begin_attempt gave it), "<phase>":
  /// bytes, ..., "failed_in": "<phase>" (when the attempt failed)}.
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
  MemoryReportSink* sink_;
  size_t keep_steps_;
  struct Attempt {
    int64_t step = 0;
    int64_t micro_batch = 0;  // 0: not given
    std::map<std::string, int64_t> peaks;
    std::string failed_in;
  };
  void add_attempt(int64_t step, int64_t micro_batch);  // with mu_ held

  mutable std::mutex mu_;
  int64_t ooms_ = 0;
  std::deque<Attempt> attempts_;  // oldest first
};

// ---- per-phase peaks ----------------------------------------------------------------------------------

/// A MemoryBackend that can measure the peak of each phase of a step without losing the step's peak.
/// A backend has one peak counter: to see a phase's own peak it must restart at the phase's start, which
/// would hide the earlier phases from whoever reads the step's peak afterwards (the metrics line's
/// mem_peak_bytes, the grow-back's headroom test). This wrapper carries the earlier phases: its
/// peak_bytes() is the peak since its own last reset_peak(), however many phases were started since.
/// Everything else is the wrapped backend's. Used from the training loop's thread.
class PhasePeakBackend : public MemoryBackend {
 public:
  /// Takes ownership of `inner` (std::invalid_argument if null).
  explicit PhasePeakBackend(std::unique_ptr<MemoryBackend> inner);

  /// Starts a phase: the peak so far is carried, the phase's peak starts from the current bytes.
  void start_phase();
  /// The peak since the last start_phase() or reset_peak().
  int64_t phase_peak_bytes() const { return inner_->peak_bytes(); }

  std::string name() const override { return inner_->name(); }
  c10::Device device() const override { return inner_->device(); }
  int64_t current_bytes() const override { return inner_->current_bytes(); }
  /// The larger of the carried peak and the phase in progress: the peak since reset_peak().
  int64_t peak_bytes() const override;
  int64_t reserved_bytes() const override { return inner_->reserved_bytes(); }
  /// Starts a new peak from the current bytes (forgets the carried phases too).
  void reset_peak() override;
  void set_limit(int64_t bytes) override { inner_->set_limit(bytes); }
  int64_t limit() const override { return inner_->limit(); }
  void empty_cache() override { inner_->empty_cache(); }
  int64_t total_bytes() const override { return inner_->total_bytes(); }
  int64_t free_bytes() const override { return inner_->free_bytes(); }

 private:
  std::unique_ptr<MemoryBackend> inner_;
  std::atomic<int64_t> carried_{0};
};

/// Records the peak of each phase of one step attempt into a MemoryReporter:
///
///     PhasePeakRecorder phases(*memory, *reporter, step, micro_batch);   // begin_attempt
///     for (...) { phases.enter("forward"); ...; phases.enter("backward"); ...; }
///     phases.enter("optimizer"); ...
///     // destroyed: the optimizer phase's peak is recorded
///
/// enter() ends the phase in progress (recording its peak) and starts the next. The destructor ends the
/// last one, also while an exception (an OOM) unwinds the attempt, and then marks the attempt as failed
/// in that phase: the report written for the OOM shows how far the attempt got and at what peak. A
/// phase's peak counts every tensor byte live during it (weights, optimizer state, batches, gradients),
/// not only what the phase allocated. Works only when `backend` is a PhasePeakBackend; with any other
/// backend it records nothing and resets no peak.
class PhasePeakRecorder {
 public:
  PhasePeakRecorder(MemoryBackend& backend, MemoryReporter& reporter, int64_t step, int64_t micro_batch);
  ~PhasePeakRecorder();
  PhasePeakRecorder(const PhasePeakRecorder&) = delete;
  PhasePeakRecorder& operator=(const PhasePeakRecorder&) = delete;

  /// Ends the phase in progress (if any) and starts `phase`.
  void enter(const std::string& phase);

 private:
  void end_phase();

  PhasePeakBackend* backend_;  // null: not a PhasePeakBackend
  MemoryReporter& reporter_;
  int64_t step_;
  std::string phase_;          // "" between phases
  int uncaught_;               // std::uncaught_exceptions() at construction
};

}  // namespace trainer
