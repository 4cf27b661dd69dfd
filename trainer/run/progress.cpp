// Progress: the loop's counters (progress.h).
#include "trainer/run/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "common/clock.h"

namespace trainer {

namespace {
// FNV-1a over the step's sample indices: two runs saw the same samples in a step iff these agree.
uint64_t indices_hash(const std::vector<int64_t>& indices) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i : indices) {
    h ^= static_cast<uint64_t>(i);
    h *= 1099511628211ull;
  }
  return h;
}
}  // namespace

void Progress::plan(const Config& cfg, int64_t steps_per_epoch) {
  steps_per_epoch_ = steps_per_epoch;
  total_steps_ = cfg.train.steps > 0 ? cfg.train.steps
                                     : std::max<int64_t>(1, steps_of_epochs(cfg.train.epochs, "train.epochs"));
  warmup_steps_ = cfg.schedule.warmup_steps > 0 ? cfg.schedule.warmup_steps
                                                : steps_of_epochs(cfg.schedule.warmup_epochs, "schedule.warmup_epochs");
}

int64_t Progress::steps_of_epochs(double epochs, const char* key) const {
  // llround of a product past int64's range is unspecified (here: the run trained 1 step of 1e300 epochs).
  const double steps = epochs * static_cast<double>(steps_per_epoch_);
  if (!(steps < 4.6e18)) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", epochs);
    throw ConfigError(std::string(key) + ": " + text + " epochs of " + std::to_string(steps_per_epoch_) +
                      " steps do not fit in a step counter (2^62); ask for fewer");
  }
  return std::llround(steps);
}

void Progress::advance(const std::vector<int64_t>& indices, const data::LoaderState& after, int64_t global_batch,
                       double seconds) {
  batch_hash_ = indices_hash(indices);
  ++step_;
  samples_seen_ += global_batch;
  // Where the next step's samples start: what a checkpoint records (in samples, not batches, so a
  // resume may use any micro-batch).
  epoch_ = after.epoch;
  position_ = after.position;
  window_time_ += seconds;
  ++window_steps_;
}

int64_t Progress::count_nonfinite(bool updated) {
  if (updated) return nonfinite_in_a_row_ = 0;
  return ++nonfinite_in_a_row_;
}

double Progress::window_samples_per_s(int64_t global_batch) const {
  return global_batch * window_steps_ / window_time_;
}

double Progress::eta_s() const { return (total_steps_ - step_) * (window_time_ / window_steps_); }

void Progress::reset_window() {
  window_time_ = 0;
  window_steps_ = 0;
}

void Progress::write_state(nlohmann::json& j) const {
  j["step"] = step_;
  j["epoch"] = epoch_;
  j["position"] = position_;
  j["samples_seen"] = samples_seen_;
  j["nonfinite_in_a_row"] = nonfinite_in_a_row_;
}

void Progress::restore(const nlohmann::json& st) {
  step_ = st.at("step");
  epoch_ = st.at("epoch");
  position_ = st.at("position");
  samples_seen_ = st.at("samples_seen");
  nonfinite_in_a_row_ = st.value("nonfinite_in_a_row", 0);
  start_step_ = step_;
}

double Progress::seconds() const { return seconds_since(start_time_); }

double Progress::since_model_built_s() const { return seconds_since(model_built_); }

}  // namespace trainer
