// Where the run stands, one part of TrainingRun (run.h): the optimizer steps done and to do, the epochs they
// make, where the next global batch starts in the training data, the samples seen, the non-finite steps in
// a row, and the clocks and window the progress line is timed over. What a checkpoint's state.json holds
// of the loop is write_state()'s; restore() reads it back. Pure bookkeeping: no tensors, no I/O.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <vector>

#include "data/samples/batch.h"
#include "trainer/config/config.h"

namespace trainer {

class Progress {
 public:
  /// After the data is open (setup_data): `steps_per_epoch` of the training source, and from them the
  /// steps to train (train.steps, else train.epochs' steps, at least 1) and to warm up (schedule.warmup_steps,
  /// else schedule.warmup_epochs' steps). A ConfigError names the key whose steps do not fit in a counter.
  void plan(const Config& cfg, int64_t steps_per_epoch);
  /// `epochs` epochs in steps, rounded to the nearest; `key` names the config key in the error.
  int64_t steps_of_epochs(double epochs, const char* key) const;

  /// One step done: the hash of its sample indices, the source's state after its batch (where the next
  /// global batch starts, in samples), `global_batch` samples more, and `seconds` (the step's and its
  /// wait for data) into the window of the progress line.
  void advance(const std::vector<int64_t>& indices, const data::LoaderState& after, int64_t global_batch,
               double seconds);
  /// A step's outcome for the divergence check: 0 after an update, else the non-finite steps in a row
  /// counting this one.
  int64_t count_nonfinite(bool updated);

  /// The window since the last progress line: samples per second at `global_batch` per step, and the
  /// time left at that pace. reset_window() starts the next one.
  double window_samples_per_s(int64_t global_batch) const;
  double eta_s() const;
  void reset_window();

  /// state.json's loop position: step, epoch, position (in samples), samples_seen, nonfinite_in_a_row.
  void write_state(nlohmann::json& j) const;
  /// The same read back (a resume); this process's training then starts at that step (start_step()).
  void restore(const nlohmann::json& st);

  /// The clocks: the training's start (the first step, or the resumed one) and the model's build (step 1's
  /// since_model_built_s, from the model built to the first step's start).
  void start_clock() { start_time_ = std::chrono::steady_clock::now(); }
  void model_built() { model_built_ = std::chrono::steady_clock::now(); }
  double seconds() const;                 ///< since start_clock()
  double since_model_built_s() const;     ///< since model_built()

  int64_t step() const { return step_; }                       ///< optimizer steps completed
  int64_t start_step() const { return start_step_; }           ///< step() when this process began
  int64_t total_steps() const { return total_steps_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  int64_t samples_seen() const { return samples_seen_; }
  int64_t epoch() const { return epoch_; }                     ///< where the next global batch starts
  int64_t position() const { return position_; }
  uint64_t batch_hash() const { return batch_hash_; }          ///< of the last step's sample indices
  bool done() const { return step_ >= total_steps_; }
  /// The epochs trained, fractional: what the progress line and metrics.jsonl show.
  double epochs() const { return static_cast<double>(step_) / steps_per_epoch_; }
  bool epoch_end() const { return step_ % steps_per_epoch_ == 0; }

 private:
  int64_t step_ = 0;          // optimizer steps completed
  int64_t start_step_ = 0;    // step_ when this process began: 0, or the resumed checkpoint's step
  int64_t total_steps_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t warmup_steps_ = 0;
  int64_t samples_seen_ = 0;
  int64_t epoch_ = 0, position_ = 0;  // where the next global batch starts
  int64_t nonfinite_in_a_row_ = 0;
  uint64_t batch_hash_ = 0;           // hash of the last step's sample indices
  double window_time_ = 0;            // seconds of the steps since the last log line
  int64_t window_steps_ = 0;
  std::chrono::steady_clock::time_point start_time_;
  std::chrono::steady_clock::time_point model_built_;  // setup_model() done: step 1's since_model_built_s
};

}  // namespace trainer
