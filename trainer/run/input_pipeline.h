// The run's input, one part of TrainingRun: the training source (images or tokens, data/samples/source.h),
// the batch's way to the device (BatchStager, trainer/step/batch_stager.h) with data.fetch_ahead, and the
// split the run evaluates.
//
//   fetch()        this step's batch, staged and ready on the compute stream: the one fetched ahead during
//                  the last step, else the source's next
//   fetch_ahead()  during a step (Step::run's while_device_runs): the next step's batch fetched and its
//                  copy to the device queued while the device finishes this one
//
// and what the run records of a step's input: where the source stands after the step's batch (what a
// checkpoint of the step records), the host's time waiting for data, and why a batch did not fit under
// the cap.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "data/samples/source.h"
#include "trainer/step/batch_stager.h"

namespace trainer {

class InputPipeline {
 public:
  /// The sources, once the data is open (setup_data). `eval` null: no test split.
  void set_sources(std::unique_ptr<data::TrainingSource> train, std::unique_ptr<data::EvalSource> eval);
  /// How batches go to the device (setup_step): `fetch_ahead` is data.fetch_ahead, resolved.
  void set_staging(const torch::Device& device, bool fetch_ahead);

  data::TrainingSource& source() { return *source_; }
  const data::TrainingSource& source() const { return *source_; }
  /// The test split, or null when there is none.
  const data::EvalSource* eval() const { return eval_.get(); }
  /// data.fetch_ahead, resolved: the step calls fetch_ahead() while the device runs.
  bool fetches_ahead() const { return fetch_ahead_on_; }

  /// This step's batch, staged for the device and ready on the compute stream: the one fetched ahead
  /// during the last step, else the source's next. nullopt: it did not fit under the cap (batch_oom()).
  /// An error of the source during fetch_ahead() is rethrown here, for the step that needs the batch.
  std::optional<data::Batch> fetch();
  /// The next step's batch fetched and its copy to the device queued (BatchStager). The caller decides
  /// whether there is a next step; once per step (a batch fetched ahead and not yet taken stays).
  void fetch_ahead();
  /// Around a step: its time in fetch_ahead() counts from step_started(); step_ended() adds it to
  /// data_wait_s() (the wait for the next step's batch is data time, as a wait for this one's is) and
  /// returns it.
  void step_started() { ahead_wait_s_ = 0; }
  double step_ended() {
    data_wait_s_ += ahead_wait_s_;
    return ahead_wait_s_;
  }

  /// The source's state after the batch of the step in progress.
  const data::LoaderState& batch_after() const { return batch_after_; }
  /// Why this rank's batch did not fit under the cap.
  const std::string& batch_oom() const { return batch_oom_; }
  /// The last step's time in the source: its own batch and the next one's (fetched ahead); not in
  /// step_time_s.
  double data_wait_s() const { return data_wait_s_; }

 private:
  // The source's next batch, staged, and where the source stands after it.
  struct Fetched {
    std::optional<data::Batch> batch;  // nullopt: it did not fit under the cap (`oom` says why)
    std::string oom;
    data::LoaderState after;           // the source's state after this batch: what a checkpoint of its step records
    double wait_s = 0;                 // the host's time in the source and the staging
    std::exception_ptr error;          // fetch_ahead(): what fetch() rethrows for the step that needs the batch
  };
  Fetched fetch_next();

  std::unique_ptr<data::TrainingSource> source_;
  std::unique_ptr<data::EvalSource> eval_;
  std::unique_ptr<BatchStager> stager_;  // batches to the device on a side stream (CUDA), else as they are
  bool fetch_ahead_on_ = false;          // data.fetch_ahead, resolved
  std::optional<Fetched> ahead_;         // the next step's batch, fetched during this step
  double ahead_wait_s_ = 0;              // this step's time in fetch_ahead()
  data::LoaderState batch_after_;        // the source's state after the batch of the step in progress
  std::string batch_oom_;                // why this rank's batch did not fit under the cap
  double data_wait_s_ = 0;               // the last step's time in the source, its own batch and the next one's
};

}  // namespace trainer
