// What each step leaves behind: its line in metrics.jsonl, the progress line every log.every steps, the
// resources and memory the telemetry endpoint shows, and a memory report when one was asked for
// (Trackers::observe_resources). A run of non-finite steps without a GradScaler ends the run here
// (divergence).
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "trainer/run/run.h"

namespace trainer {

void TrainingRun::record(const StepResult& r, const data::Batch& batch, double step_time) {
  RECORD_USER_SCOPE("trainer.record");
  count_nonfinite(r);
  // The loader's state after this step's batch, taken when it was fetched: the loader itself may already
  // be past the next step's (fetched ahead).
  progress_.advance(batch.indices, input_.batch_after(), cfg_.train.global_batch, step_time + input_.data_wait_s());
  const double sps = cfg_.train.global_batch / (step_time + input_.data_wait_s());  // waiting for data counts
  trackers_.metrics().write(step_metrics(r, step_time, sps));
  const int64_t step = progress_.step();
  if (step % cfg_.log.every == 0 || step == progress_.total_steps() || step == 1) log_progress(r);
  trackers_.observe_resources(step, memory_.backend());
}

void TrainingRun::count_nonfinite(const StepResult& r) {
  const int64_t in_a_row = progress_.count_nonfinite(r.updated);
  if (r.updated) return;
  // With a GradScaler a skipped step is its normal backoff; without one, five in a row is divergence.
  const int64_t step = progress_.step() + 1;
  const bool scaler = trained_.scaler().is_enabled();
  trackers_.metrics().event("nonfinite",
                            {{"step", step}, {"loss", r.loss}, {"grad_norm", r.grad_norm}, {"scaler", scaler}});
  if (!scaler) spdlog::warn("step {}: non-finite loss or gradient norm, update skipped", step);
  if (in_a_row >= 5 && !scaler)
    throw std::runtime_error("training diverged: 5 steps in a row with a non-finite loss or gradient norm; "
                             "lower optim.lr or set optim.grad_clip");
}

nlohmann::json TrainingRun::step_metrics(const StepResult& r, double step_time, double sps) const {
  nlohmann::json j = {{"step", progress_.step()},
                      {"epoch", progress_.epochs()},
                      {"loss", r.loss},
                      {"lr", r.lr},
                      {"grad_norm", r.grad_norm},
                      {"samples_seen", progress_.samples_seen()},
                      {"micro_batch", r.micro_batch},
                      {"accum_steps", r.accum_steps},
                      {"samples_per_s", sps},
                      {"step_time_s", step_time},
                      {"data_wait_s", input_.data_wait_s()},
                      {"mem_peak_bytes", memory_.backend().peak_bytes()},
                      {"mem_start_bytes", r.mem_start_bytes},
                      {"mem_limit_bytes", memory_.limit().bytes()},
                      {"rss_bytes", host_rss_bytes()},            // the whole process: what a container counts
                      {"rss_peak_bytes", host_rss_peak_bytes()},  // its high-water mark so far
                      {"oom_retries", r.oom_retries},
                      {"batch_hash", progress_.batch_hash()},
                      {"updated", r.updated}};
  if (trained_.scaler().is_enabled()) j["loss_scale"] = r.loss_scale;  // the scale this step's losses were multiplied by
  // A fresh run's start: from the model built (and on its device) to this step's start, what the first
  // batch, the micro-batch search and cuDNN's pretuning cost before any training.
  if (progress_.step() == 1) j["since_model_built_s"] = progress_.since_model_built_s() - step_time;
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
  // This rank's optimizer state: the whole of it, or with dist.shard its slices' (about 1/world).
  j["optimizer_state_bytes"] = trained_.optimizer().state_bytes();
  if (ranks_.grad_sync()) {
    j["grad_buckets"] = ranks_.grad_sync()->num_buckets();
    j["grad_buckets_in_backward"] = r.grad_buckets_in_backward;
  }
  if (tokens()) j["tokens_per_s"] = sps * cfg_.model.context;
  j["model_flops_per_s"] = 3.0 * trained_.flops_per_sample() * sps;  // forward + backward (2x forward)
  return j;
}

void TrainingRun::log_progress(const StepResult& r) {
  const double window_sps = progress_.window_samples_per_s(cfg_.train.global_batch);
  spdlog::info("step {}/{} (epoch {:.2f}) loss {:.4f} lr {:.4g} | {:.1f} {}/s | mb {}x{} | mem peak {} | ETA {}",
               progress_.step(), progress_.total_steps(), progress_.epochs(), r.loss, r.lr,
               tokens() ? window_sps * cfg_.model.context : window_sps, tokens() ? "tokens" : "samples",
               r.micro_batch, r.accum_steps, format_bytes(memory_.backend().peak_bytes()),
               format_duration(progress_.eta_s()));
  progress_.reset_window();
}

}  // namespace trainer
