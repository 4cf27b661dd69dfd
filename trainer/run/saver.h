// The run's checkpoints: when a save is due, how it is written, and what the run does when a write fails
// (saver.cpp says the rules). A part of TrainingRun (run.h) with its own state: the store, the save being
// written in the background, the last good checkpoint, the failures in a row.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/log.h"
#include "trainer/checkpoint/store.h"
#include "trainer/config/config.h"
#include "trainer/dist/dist.h"

namespace trainer {

class Saver {
 public:
  /// What a checkpoint holds, serialized: collective on every rank, the files on rank 0 only (nullopt on
  /// the others).
  using Serialize = std::function<std::optional<CheckpointFiles>()>;

  /// `store` is the run folder's (every rank has one; rank 0 writes). `device` goes into each checkpoint's
  /// metadata. `dist` null in a single process.
  Saver(const CheckpointConfig& cfg, std::unique_ptr<CheckpointStore> store, MetricsLog& metrics, Distributed* dist,
        bool main_rank, std::string device);
  /// Waits for the background save (a failure nobody collected is logged by the store).
  ~Saver();

  CheckpointStore& store() { return *store_; }

  /// Periodic, SIGUSR1 or a retry of `step` (the optimizer steps completed): written in the background
  /// under checkpoint.async; a failure is reported and the save is retried at the next step.
  void save_in_background(int64_t step, const std::string& reason, const Serialize& serialize);
  /// SIGTERM/SIGINT, final, OOM give-up: in the foreground, up to checkpoint.max_failures attempts under
  /// fresh folder names. Whether it was written, agreed by every rank.
  bool save_before_exit(int64_t step, const std::string& reason, const Serialize& serialize);
  /// The background saves that finished, reported (rank 0). `at_step`: the run's step now.
  void collect(int64_t at_step);
  /// The one line of a save that could not be written, and its event; returns exit 4.
  int exit_not_saved(int64_t step, const std::string& what, int64_t attempts);

  /// A save is due at `step`: every_steps, every_seconds since the last, or a failed save to retry.
  bool due(int64_t step) const;
  bool retrying() const { return retry_; }
  /// checkpoint.max_failures failed attempts in a row: the run stops with exit 4.
  bool cannot_save() const { return failures_ >= cfg_.max_failures; }
  int64_t failures() const { return failures_; }

  /// The clock of every_seconds starts (the first step).
  void start_clock() { last_time_ = std::chrono::steady_clock::now(); }
  /// A resumed run: `path` of `step` is the last good checkpoint until this run saves its own.
  void resumed_from(const std::string& path, int64_t step);
  const std::string& last_saved_path() const { return last_path_; }

 private:
  void on_saved(int64_t step, const std::string& reason, const std::string& path, double seconds);
  void on_failed(int64_t step, int64_t at_step, const std::string& reason, const std::string& error,
                 const std::string& next);

  CheckpointConfig cfg_;
  std::unique_ptr<CheckpointStore> store_;
  MetricsLog& metrics_;
  Distributed* dist_;
  bool main_rank_;
  std::string device_;
  // The newest checkpoint known to be written (the resumed one at first), the failed attempts in a row
  // since, and the background save being written.
  std::string last_path_;
  int64_t last_step_ = -1;
  int64_t failures_ = 0;
  std::string last_error_;
  bool retry_ = false;  // a save failed: save again at the next step
  std::chrono::steady_clock::time_point last_time_;
  struct Pending {
    int64_t step = 0;
    std::string reason;
    std::chrono::steady_clock::time_point started;
  };
  std::optional<Pending> pending_;
};

}  // namespace trainer
