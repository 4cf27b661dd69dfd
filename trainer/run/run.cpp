// The training loop. It only sequences; each stage is a named call:
//
//   setup -> resume -> start -> [ fetch -> poll -> step -> record -> ema -> evaluate -> sample -> agree on save/stop ]* -> finish
//
// Under data.fetch_ahead (on by default for a CUDA device), the step fetches the next step's batch and
// queues its copy to the device (InputPipeline::fetch_ahead, BatchStager) once its own work is queued and
// before it waits for its values; the next fetch then takes that batch.
//
// and the other ways a run ends: the OOM ladder gives up (checkpoint, exit 3), a signal stops it
// (checkpoint, exit 128 + signal), or checkpoints cannot be written (exit 4, saver.cpp).
//
// fetch, poll, step, record and the agreement are each a "trainer.<stage>" scope in a profile (`trainer
// bench --profile`): bench/profile_table.py names the host time between two steps' kernels by stage.
#include "trainer/run/run.h"

#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <filesystem>
#include <functional>

#include "common/clock.h"
#include "common/compat.h"
#include "common/signals.h"
#include "trainer/step/search_findings.h"
#include "trainer/run/from_config.h"

namespace trainer {

namespace fs = std::filesystem;

TrainingRun::TrainingRun(const Config& cfg, const RunOptions& opts) : cfg_(cfg), opts_(opts) {}

TrainingRun::~TrainingRun() {
  if (saver_) saver_->store().wait();  // a failure nobody collected is logged by the store
  if (tracker_) tracker_->close();  // the run's status and what is queued, for at most a few seconds
  // Let go of train.log before the run folder's lock: the next owner's lines never mix with ours.
  if (run_lock_) setup_logging("", mode_name(cfg_.log.level));
}

int TrainingRun::run() {
  const int code = run_stages();
  if (tracker_) tracker_->end(code);
  return code;
}

int TrainingRun::run_stages() {
  setup();
  install_signal_handlers();
  const bool resumed = resume();
  if (resumed && step_ >= total_steps_) {
    spdlog::info("the run is complete: step {} of {} (raise train.steps or train.epochs to train on)", step_, total_steps_);
    return kExitOk;
  }
  start(resumed);
  try {
    while (step_ < total_steps_) {
      if (opts_.observer) opts_.observer->before_step(step_ + 1);
      std::optional<data::Batch> batch = input_.fetch();
      poll(!batch);  // every rank gives up together if any rank's batch did not fit
      if (need_micro_batch_search_) {
        const MicroBatchSearch found = auto_micro_batch(*batch);
        if (found.stopped) return stop_during_search(found);
      }
      if (need_pretune_) pretune(*batch);
      const auto t0 = std::chrono::steady_clock::now();
      input_.step_started();
      StepResult r = step_runner_->run(*batch, step_ + 1, learning_rate(cfg_.schedule, cfg_.optim.lr, step_, total_steps_,
                                                                         warmup_steps_),
                                       agreed_limit_, fetch_ahead_hook());
      // The time in the source for the next step's batch is data time, as a wait for this one's is.
      const double ahead_wait_s = input_.step_ended();
      record(r, *batch, seconds_since(t0) - ahead_wait_s);
      update_ema();
      maybe_evaluate();
      maybe_sample();
      if (opts_.observer) opts_.observer->after_step(step_);
      if (auto code = agree_on_save_and_stop()) return *code;
    }
  } catch (const OomGaveUp& e) {
    return give_up(e);
  } catch (const std::exception& e) {
    // Setup and resume errors (bad input) propagate; a failure while training is an error of the run.
    const std::string what = error_message(e);
    spdlog::error("training stopped at step {}: {}", step_, what);
    metrics_.event("error", {{"step", step_}, {"message", what}});
    return kExitError;
  }
  return finish();
}

void TrainingRun::start(bool resumed) {
  if (!resumed) {
    metrics_.event("start", {{"total_steps", total_steps_}, {"steps_per_epoch", steps_per_epoch_},
                             {"global_batch", cfg_.train.global_batch}, {"device", device_.str()},
                             {"torch", compat::torch_version()}, {"limit", limit_->bytes()},
                             {"container_limit", limit_->bounds().container_bytes},
                             {"host_limit", limit_->bounds().host_bytes}, {"limit_source", limit_->source()},
                             {"rss_at_limit", limit_->rss_at_limit()},
                             {"cudnn_policy", mode_name(step_runner_->cudnn().options().mode)},
                             {"cudnn_benchmark_limit", cfg_.memory.cudnn_benchmark_limit},
                             // null: this LibTorch has no switch (common/compat.h)
                             {"cudnn_empty_cache", cudnn_empty_cache_switch_ ? nlohmann::json(cfg_.memory.cudnn_empty_cache)
                                                                            : nlohmann::json(nullptr)}});
  }
  need_micro_batch_search_ = need_micro_batch_search_ && !resumed;  // a resumed run keeps its learned size
  spdlog::info("training {} steps ({} per epoch) at global batch {} on {}; memory limit {}", total_steps_,
               steps_per_epoch_, cfg_.train.global_batch, device_.str(),
               limit_->bytes() ? format_bytes(limit_->bytes()) : "none");
  model_->train();
  // The configured policy (or the ladder's state restored from a checkpoint) applies from the first step.
  step_runner_->apply_activation_checkpointing();
  start_time_ = std::chrono::steady_clock::now();
  saver_->start_clock();
  telemetry_.set_memory(device_memory_of(*memory_));
  telemetry_.set_total_steps(total_steps_);
  telemetry_.set_ready(true);
}

std::function<void()> TrainingRun::fetch_ahead_hook() {
  if (!input_.fetches_ahead()) return {};
  return [this] {
    // Not after the last step (the source would move past what the final checkpoint records), nor when a
    // stop is on its way.
    if (step_ + 1 >= total_steps_ || stop_requested()) return;
    input_.fetch_ahead();
  };
}

EvalResult TrainingRun::evaluate() {
  if (!has_eval()) return {};
  EvalHooks hooks;
  hooks.heartbeat = [this] { telemetry_.heartbeat(); };
  hooks.backoff = [this](int64_t old, int64_t now) {
    metrics_.event("eval_backoff", {{"step", step_}, {"old_micro_batch", old}, {"new_micro_batch", now},
                                    {"limit", limit_->bytes()}, {"current_bytes", memory_->current_bytes()}});
  };
  telemetry_.set_phase("eval");
  // The evaluation batch is a size of its own: timed only under memory.cudnn_policy always.
  set_cudnn_benchmark(step_runner_->cudnn().evaluation_benchmark());
  EvalSettings settings = eval_settings(cfg_, device_, env_.rank, env_.world_size);
  settings.forward = forward_;  // with the input statistics of uint8 images (setup_data)
  return evaluate_split(*model_, *input_.eval(), settings, *memory_, eval_micro_batch_, dist_.get(), hooks);
}

void TrainingRun::update_ema() {
  // After every optimizer step, also one the GradScaler or the finite check skipped: timm's train.py calls
  // ModelEmaV3.update(model, step=num_updates) after each optimizer.step() whatever the scaler did. Outside
  // the backward's peak; in place, nothing allocated.
  if (ema_) ema_->update(*model_, step_);
}

EvalResult TrainingRun::evaluate_ema() {
  const EmaSwap swapped(*ema_, *model_);  // back to the trained weights when this returns or throws
  return evaluate();
}

void TrainingRun::maybe_evaluate() {
  const bool epoch_end = step_ % steps_per_epoch_ == 0;
  const bool due = cfg_.train.eval_every > 0 ? step_ % cfg_.train.eval_every == 0 : epoch_end;
  if (!due || step_ >= total_steps_ || !has_eval()) return;  // the last step's evaluation is finish()'s
  // A failed evaluation is reported and training goes on: the test split is not the run's state, and
  // the final evaluation reports it again (after the final checkpoint).
  if (const auto e = evaluate_and_log(false); !e.empty()) {
    spdlog::warn("evaluation at step {} failed, training goes on: {}", step_, e);
    metrics_.event("eval_failed", {{"step", step_}, {"message", e}});
  }
}

std::string TrainingRun::evaluate_and_log(bool final) {
  const auto t = std::chrono::steady_clock::now();
  EvalResult e, ema;
  try {
    e = evaluate();
    if (ema_) ema = evaluate_ema();
  } catch (const std::exception& err) {
    model_->train();
    if (dist_) throw;  // the ranks would no longer agree on their collectives
    return error_message(err);
  }
  const std::string ema_text =
      ema_ ? fmt::format("; ema: loss {:.4f} top1 {:.2f}% top5 {:.2f}%", ema.loss, 100 * ema.top1, 100 * ema.top5) : "";
  spdlog::info("{}eval at step {}: loss {:.4f} top1 {:.2f}% top5 {:.2f}%{} ({:.1f}s)", final ? "final " : "", step_,
               e.loss, 100 * e.top1, 100 * e.top5, ema_text, seconds_since(t));
  nlohmann::json j = {{"step", step_}, {"loss", e.loss}, {"top1", e.top1}, {"top5", e.top5},
                      {"samples", e.samples}, {"seconds", seconds_since(t)}};
  if (ema_) {  // the averaged weights' figures beside the trained weights' (whose keys stay as they were)
    j["ema_loss"] = ema.loss;
    j["ema_top1"] = ema.top1;
    j["ema_top5"] = ema.top5;
  }
  if (final) j["final"] = true;
  metrics_.event("eval", j);
  return "";
}

std::optional<int> TrainingRun::agree_on_save_and_stop() {
  RECORD_USER_SCOPE("trainer.agree");
  if (main_rank()) saver_->collect(step_);  // a background save that failed is reported now and retried below
  bool ckpt_now = saver_->due(step_);
  bool ckpt_request = take_checkpoint_request();
  int stop_sig = stop_requested() ? stop_signal() : 0;
  bool cannot_save = saver_->cannot_save();
  if (dist_) {
    // Saving is collective and a stop must happen at the same step everywhere: a signal or a timer
    // seen by any rank counts for all (torchrun forwards SIGTERM to every rank, not at the same instant).
    // Rank 0 alone knows how its saves went.
    auto a = dist_->all_max({ckpt_now ? 1.0 : 0.0, ckpt_request ? 1.0 : 0.0, static_cast<double>(stop_sig),
                             cannot_save ? 1.0 : 0.0},
                            "the checkpoint and stop agreement");
    ckpt_now = a[0] > 0;
    ckpt_request = a[1] > 0;
    stop_sig = static_cast<int>(a[2]);
    cannot_save = a[3] > 0;
  }
  if (stop_sig != 0) {
    // SIGTERM/SIGINT: the step in progress was finished; save and exit with 128 + signal so a scheduler
    // restarts the job, which then resumes from this checkpoint. Earlier failed saves do not matter here.
    const std::string sig = stop_sig == SIGINT ? "SIGINT" : "SIGTERM";
    spdlog::warn("stop requested by {}: saving a checkpoint at step {} and exiting", sig, step_);
    telemetry_.set_stopping();
    if (!save_before_exit(sig))
      return saver_->exit_not_saved(step_, "the " + sig + " checkpoint of step " + std::to_string(step_),
                                    cfg_.checkpoint.max_failures);
    metrics_.event("stop", {{"step", step_}, {"signal", sig}});
    return exit_code_for_signal(stop_sig);
  }
  if (cannot_save) return saver_->exit_not_saved(step_, "step " + std::to_string(step_), saver_->failures());
  if ((ckpt_request || ckpt_now) && step_ < total_steps_)
    saver_->save_in_background(step_, ckpt_request ? "SIGUSR1" : saver_->retrying() ? "retry" : "periodic",
                               [this] { return serialize_checkpoint(); });
  return std::nullopt;
}

int TrainingRun::give_up(const OomGaveUp& e) {
  spdlog::error("{}", e.what());
  metrics_.event("oom_gave_up", {{"step", step_}, {"message", e.what()}, {"mem_peak_bytes", memory_->peak_bytes()}});
  // No step trained in this process: the state is the fresh start's or the resumed checkpoint's, which a
  // rerun rebuilds bit for bit. A save would only copy it (every weight and optimizer moment, outside
  // the cap), which for a model too large for its cap can be more than the machine has left.
  if (step_ == start_step_) {
    spdlog::info("no step trained in this process (step {}): nothing to save", step_);
    return kExitOomGaveUp;
  }
  // serialize_checkpoint() lifts the cap while it copies the state: the cap may be below the live bytes.
  if (!save_before_exit("oom_gave_up"))
    return saver_->exit_not_saved(step_,
                                  "the checkpoint of step " + std::to_string(step_) + " before giving up on memory",
                                  cfg_.checkpoint.max_failures);
  return kExitOomGaveUp;
}

int TrainingRun::finish() {
  // The final checkpoint comes before the final evaluation: an error there must not cost the training.
  if (cfg_.checkpoint.final && !save_before_exit("final"))
    return saver_->exit_not_saved(step_, "the final checkpoint of step " + std::to_string(step_),
                                  cfg_.checkpoint.max_failures);
  if (has_eval()) {
    if (const auto e = evaluate_and_log(true); !e.empty()) {
      spdlog::error("final evaluation at step {} failed: {}; the trained model is saved in {}", step_, e,
                    saver_->last_saved_path());
      metrics_.event("error", {{"step", step_}, {"message", "final evaluation: " + e}});
      return kExitError;
    }
  }
  const double total = seconds_since(start_time_);
  metrics_.event("end", {{"step", step_}, {"seconds", total}, {"samples_seen", samples_seen_}});
  spdlog::info("done: {} steps in {}", step_, format_duration(total));
  return kExitOk;
}

int train(const Config& cfg, const RunOptions& opts) {
  TrainingRun run(cfg, opts);
  return run.run();
}

}  // namespace trainer
