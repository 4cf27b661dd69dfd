// What each step leaves behind: its line in metrics.jsonl, the progress line every log.every steps, the
// resources and memory the telemetry endpoint shows, and a memory report when one was asked for. A run of
// non-finite steps without a GradScaler ends the run here (divergence).
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "common/signals.h"
#include "trainer/run/run.h"

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

void TrainingRun::record(const StepResult& r, const data::Batch& batch, double step_time) {
  RECORD_USER_SCOPE("trainer.record");
  count_nonfinite(r);
  batch_hash_ = indices_hash(batch.indices);
  ++step_;
  samples_seen_ += cfg_.train.global_batch;
  // Where the next step's samples start: what a checkpoint records (in samples, not batches, so a
  // resume may use any micro-batch).
  // The loader's state after this step's batch, taken when it was fetched: the loader itself may already
  // be past the next step's (fetched ahead).
  epoch_ = input_.batch_after().epoch;
  position_ = input_.batch_after().position;

  window_time_ += step_time + input_.data_wait_s();
  ++window_steps_;
  const double sps = cfg_.train.global_batch / (step_time + input_.data_wait_s());  // waiting for data counts
  metrics_.write(step_metrics(r, step_time, sps));
  if (step_ % cfg_.log.every == 0 || step_ == total_steps_ || step_ == 1) log_progress(r);
  observe_resources();
}

void TrainingRun::count_nonfinite(const StepResult& r) {
  if (r.updated) {
    nonfinite_in_a_row_ = 0;
    return;
  }
  // With a GradScaler a skipped step is its normal backoff; without one, five in a row is divergence.
  ++nonfinite_in_a_row_;
  metrics_.event("nonfinite", {{"step", step_ + 1}, {"loss", r.loss}, {"grad_norm", r.grad_norm},
                               {"scaler", scaler_->is_enabled()}});
  if (!scaler_->is_enabled()) spdlog::warn("step {}: non-finite loss or gradient norm, update skipped", step_ + 1);
  if (nonfinite_in_a_row_ >= 5 && !scaler_->is_enabled())
    throw std::runtime_error("training diverged: 5 steps in a row with a non-finite loss or gradient norm; "
                             "lower optim.lr or set optim.grad_clip");
}

nlohmann::json TrainingRun::step_metrics(const StepResult& r, double step_time, double sps) const {
  nlohmann::json j = {{"step", step_},
                      {"epoch", static_cast<double>(step_) / steps_per_epoch_},
                      {"loss", r.loss},
                      {"lr", r.lr},
                      {"grad_norm", r.grad_norm},
                      {"samples_seen", samples_seen_},
                      {"micro_batch", r.micro_batch},
                      {"accum_steps", r.accum_steps},
                      {"samples_per_s", sps},
                      {"step_time_s", step_time},
                      {"data_wait_s", input_.data_wait_s()},
                      {"mem_peak_bytes", memory_->peak_bytes()},
                      {"mem_start_bytes", r.mem_start_bytes},
                      {"mem_limit_bytes", limit_->bytes()},
                      {"rss_bytes", host_rss_bytes()},            // the whole process: what a container counts
                      {"rss_peak_bytes", host_rss_peak_bytes()},  // its high-water mark so far
                      {"oom_retries", r.oom_retries},
                      {"batch_hash", batch_hash_},
                      {"updated", r.updated}};
  if (scaler_->is_enabled()) j["loss_scale"] = r.loss_scale;  // the scale this step's losses were multiplied by
  // A fresh run's start: from the model built (and on its device) to this step's start, what the first
  // batch, the micro-batch search and cuDNN's pretuning cost before any training.
  if (step_ == 1) j["since_model_built_s"] = seconds_since(model_built_) - step_time;
  // The recovery of a step that ran out of memory (from the first OOM to this step's completion), a
  // grow-back probe, and the sizes met for the first time in this process (cuDNN chose their algorithms
  // in this step, timed or not): what a GPU run reads to tell a stall from a step.
  if (r.oom_retries > 0) j["recovery_s"] = r.recovery_s;
  if (!r.probe.empty()) j["probe"] = r.probe;
  if (r.graph != "eager") j["cuda_graph"] = r.graph;  // train.cuda_graph: "capture" or "replay"
  if (!r.new_sizes.empty()) {
    j["new_sizes"] = r.new_sizes;
    j["tuned_sizes"] = r.tuned_sizes;
  }
  if (grad_sync_) {
    j["grad_buckets"] = grad_sync_->num_buckets();
    j["grad_buckets_in_backward"] = r.grad_buckets_in_backward;
  }
  if (tokens()) j["tokens_per_s"] = sps * cfg_.model.context;
  j["model_flops_per_s"] = 3.0 * flops_per_sample_ * sps;  // forward + backward (2x forward)
  return j;
}

void TrainingRun::log_progress(const StepResult& r) {
  const double window_sps = cfg_.train.global_batch * window_steps_ / window_time_;
  const double eta = (total_steps_ - step_) * (window_time_ / window_steps_);
  spdlog::info("step {}/{} (epoch {:.2f}) loss {:.4f} lr {:.4g} | {:.1f} {}/s | mb {}x{} | mem peak {} | ETA {}",
               step_, total_steps_, static_cast<double>(step_) / steps_per_epoch_, r.loss, r.lr,
               tokens() ? window_sps * cfg_.model.context : window_sps, tokens() ? "tokens" : "samples",
               r.micro_batch, r.accum_steps, format_bytes(memory_->peak_bytes()), format_duration(eta));
  window_time_ = 0;
  window_steps_ = 0;
}

void TrainingRun::observe_resources() {
  telemetry_.set_memory(device_memory_of(*memory_));
  if (step_ % cfg_.log.every == 0) {
    ResourceSample rs = resources_->sample(memory_.get());
    telemetry_.set_gpu_utilization(rs.gpu_percent);
    spdlog::info("{}", ResourceMonitor::format(rs));
  }
  if (take_memory_report_request() || telemetry_.take_memory_report_request()) {
    MemoryReport rep = memory_report_->write(step_, *memory_, "request");
    spdlog::info("{}\n{}", rep.path.empty() ? rep.write_error : "memory report: " + rep.path, rep.text);
  }
}

}  // namespace trainer
