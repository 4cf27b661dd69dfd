#include "trainer/run/input_pipeline.h"

#include <ATen/record_function.h>

#include <chrono>

#include "common/clock.h"
#include "common/log.h"
#include "trainer/memory/backend.h"

namespace trainer {

void InputPipeline::set_sources(std::unique_ptr<data::TrainingSource> train, std::unique_ptr<data::EvalSource> eval) {
  source_ = std::move(train);
  eval_ = std::move(eval);
}

void InputPipeline::set_staging(const torch::Device& device, bool fetch_ahead) {
  // Off, each micro-batch crosses to the device inside the step, on the compute stream.
  fetch_ahead_on_ = fetch_ahead;
  stager_ = std::make_unique<BatchStager>(device, fetch_ahead_on_);
}

InputPipeline::Fetched InputPipeline::fetch_next() {
  Fetched f;
  const auto t = std::chrono::steady_clock::now();
  try {
    data::Batch batch = source_->next();
    f.after = source_->state();
    f.batch = stager_->stage(std::move(batch));  // on the host still where the device has no room for it
  } catch (const std::exception& e) {
    // The batch's tensors count against the cap. No rung of the ladder makes room for them (it shrinks
    // activations, which are gone between steps): the live bytes alone are over the cap.
    if (!is_oom_error(e)) throw;
    f.oom = error_message(e);
  }
  f.wait_s = seconds_since(t);
  return f;
}

std::optional<data::Batch> InputPipeline::fetch() {
  RECORD_USER_SCOPE("trainer.fetch");
  Fetched f;
  if (ahead_) {
    f = std::move(*ahead_);
    ahead_.reset();
    if (f.error) std::rethrow_exception(f.error);
    f.wait_s = 0;  // counted in the step that fetched it
  } else {
    f = fetch_next();
  }
  data_wait_s_ = f.wait_s;
  if (!f.batch) {
    batch_oom_ = f.oom;
    return std::nullopt;
  }
  batch_after_ = f.after;
  stager_->ready(*f.batch);
  return f.batch;
}

void InputPipeline::fetch_ahead() {
  if (ahead_) return;
  RECORD_USER_SCOPE("trainer.fetch_ahead");
  const auto t = std::chrono::steady_clock::now();
  try {
    ahead_ = fetch_next();
  } catch (...) {  // a broken dataset is the next step's error: this step completes and is recorded first
    ahead_.emplace();
    ahead_->error = std::current_exception();
  }
  ahead_wait_s_ = seconds_since(t);
}

}  // namespace trainer
