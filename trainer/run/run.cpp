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
#include "trainer/numerics/forward.h"
#include "trainer/run/from_config.h"

namespace trainer {

namespace fs = std::filesystem;

TrainingRun::TrainingRun(const Config& cfg, const RunOptions& opts)
    : cfg_(cfg), opts_(opts), ranks_(cfg_), trained_(cfg_), memory_(cfg_), trackers_(cfg_, opts_), sampler_(cfg_) {}

TrainingRun::~TrainingRun() {
  if (saver_) saver_->store().wait();  // a failure nobody collected is logged by the store
  // The run's status and what is queued, for at most a few seconds.
  if (auto* tracker = trackers_.tracker()) tracker->close();
  // Let go of train.log before the run folder's lock: the next owner's lines never mix with ours.
  if (run_lock_) setup_logging("", mode_name(cfg_.log.level));
}

int TrainingRun::run() {
  const int code = run_stages();
  if (auto* tracker = trackers_.tracker()) tracker->end(code);
  return code;
}

int TrainingRun::run_stages() {
  setup();
  install_signal_handlers();
  const bool resumed = resume();
  if (resumed && progress_.done()) {
    spdlog::info("the run is complete: step {} of {} (raise train.steps or train.epochs to train on)", progress_.step(),
                 progress_.total_steps());
    return kExitOk;
  }
  start(resumed);
  try {
    while (!progress_.done()) {
      if (opts_.observer) opts_.observer->before_step(progress_.step() + 1);
      std::optional<data::Batch> batch = input_.fetch();
      poll(!batch);  // every rank gives up together if any rank's batch did not fit
      StepResult r;
      auto t0 = std::chrono::steady_clock::now();
      for (;;) {  // once, or again with the same batch after memory.state auto stored the moments in fewer bytes
        try {
          if (memory_.need_micro_batch_search()) {
            const MicroBatchSearch found = auto_micro_batch(*batch);
            if (found.stopped) return stop_during_search(found);
          }
          if (memory_.need_pretune()) pretune(*batch);
          t0 = std::chrono::steady_clock::now();
          input_.step_started();
          const double lr = learning_rate(cfg_.schedule, cfg_.optim.lr, progress_.step(), progress_.total_steps(),
                                          progress_.warmup_steps());
          r = step_runner_->run(*batch, progress_.step() + 1, lr, memory_.agreed_limit(), fetch_ahead_hook());
          break;
        } catch (const OomGaveUp& e) {
          if (!store_state_in_fewer_bytes(e)) throw;
        }
      }
      // The time in the source for the next step's batch is data time, as a wait for this one's is.
      const double ahead_wait_s = input_.step_ended();
      record(r, *batch, seconds_since(t0) - ahead_wait_s);
      trained_.update_ema(progress_.step());
      maybe_evaluate();
      sampler_.maybe_sample(progress_.step(), trained_.model(), trackers_.metrics(), trackers_.telemetry());
      if (opts_.observer) opts_.observer->after_step(progress_.step());
      if (auto code = agree_on_save_and_stop()) return *code;
    }
  } catch (const OomGaveUp& e) {
    return give_up(e);
  } catch (const std::exception& e) {
    // A kernel LibTorch lacks for bfloat16 weights is a setting this LibTorch cannot run: bad input, as the
    // config's own checks would say (the step that failed changed nothing).
    const std::string lacking = missing_bfloat16_kernel(e);
    if (!lacking.empty()) {
      spdlog::error("{}", lacking);
      trackers_.metrics().event("error", {{"step", progress_.step()}, {"message", lacking}});
      return kExitBadInput;
    }
    // Setup and resume errors (bad input) propagate; a failure while training is an error of the run.
    const std::string what = error_message(e);
    spdlog::error("training stopped at step {}: {}", progress_.step(), what);
    trackers_.metrics().event("error", {{"step", progress_.step()}, {"message", what}});
    return kExitError;
  }
  return finish();
}

void TrainingRun::start(bool resumed) {
  if (!resumed) {
    const LimitFollower& limit = memory_.limit();
    trackers_.metrics().event(
        "start", {{"total_steps", progress_.total_steps()}, {"steps_per_epoch", progress_.steps_per_epoch()},
                  {"global_batch", cfg_.train.global_batch}, {"device", trained_.device().str()},
                  {"torch", compat::torch_version()}, {"limit", limit.bytes()},
                  {"container_limit", limit.bounds().container_bytes},
                  {"host_limit", limit.bounds().host_bytes}, {"limit_source", limit.source()},
                  {"rss_at_limit", limit.rss_at_limit()},
                  {"cudnn_policy", mode_name(step_runner_->cudnn().options().mode)},
                  {"cudnn_benchmark_limit", cfg_.memory.cudnn_benchmark_limit},
                  // null: this LibTorch has no switch (common/compat.h)
                  {"cudnn_empty_cache", memory_.cudnn_empty_cache_switch() ? nlohmann::json(cfg_.memory.cudnn_empty_cache)
                                                                           : nlohmann::json(nullptr)}});
  }
  // A resumed run keeps its learned size.
  memory_.set_need_micro_batch_search(memory_.need_micro_batch_search() && !resumed);
  spdlog::info("training {} steps ({} per epoch) at global batch {} on {}; memory limit {}", progress_.total_steps(),
               progress_.steps_per_epoch(), cfg_.train.global_batch, trained_.device().str(),
               memory_.limit().bytes() ? format_bytes(memory_.limit().bytes()) : "none");
  trained_.model()->train();
  // The configured policy (or the ladder's state restored from a checkpoint) applies from the first step.
  step_runner_->apply_activation_checkpointing();
  progress_.start_clock();
  saver_->start_clock();
  trackers_.telemetry().set_memory(device_memory_of(memory_.backend()));
  trackers_.telemetry().set_total_steps(progress_.total_steps());
  trackers_.telemetry().set_ready(true);
}

std::function<void()> TrainingRun::fetch_ahead_hook() {
  if (!input_.fetches_ahead()) return {};
  return [this] {
    // Not after the last step (the source would move past what the final checkpoint records), nor when a
    // stop is on its way.
    if (progress_.step() + 1 >= progress_.total_steps() || stop_requested()) return;
    input_.fetch_ahead();
  };
}

EvalResult TrainingRun::evaluate() {
  if (!has_eval()) return {};
  EvalHooks hooks;
  hooks.heartbeat = [this] { trackers_.telemetry().heartbeat(); };
  hooks.backoff = [this](int64_t old, int64_t now) {
    trackers_.metrics().event("eval_backoff",
                              {{"step", progress_.step()}, {"old_micro_batch", old}, {"new_micro_batch", now},
                               {"limit", memory_.limit().bytes()}, {"current_bytes", memory_.backend().current_bytes()}});
  };
  trackers_.telemetry().set_phase("eval");
  // The evaluation batch is a size of its own: timed only under memory.cudnn_policy always.
  set_cudnn_benchmark(step_runner_->cudnn().evaluation_benchmark());
  EvalSettings settings = eval_settings(cfg_, trained_.device(), ranks_.env().rank, ranks_.env().world_size);
  settings.forward = trained_.forward();  // with the input statistics of uint8 images (setup_data)
  return evaluate_split(*trained_.model(), *input_.eval(), settings, memory_.backend(), eval_micro_batch_, ranks_.dist(),
                        hooks);
}

EvalResult TrainingRun::evaluate_ema() {
  return trained_.evaluate_ema([this] { return evaluate(); });
}

void TrainingRun::maybe_evaluate() {
  const bool due = cfg_.train.eval_every > 0 ? progress_.step() % cfg_.train.eval_every == 0 : progress_.epoch_end();
  if (!due || progress_.done() || !has_eval()) return;  // the last step's evaluation is finish()'s
  // A failed evaluation is reported and training goes on: the test split is not the run's state, and
  // the final evaluation reports it again (after the final checkpoint).
  if (const auto e = evaluate_and_log(false); !e.empty()) {
    spdlog::warn("evaluation at step {} failed, training goes on: {}", progress_.step(), e);
    trackers_.metrics().event("eval_failed", {{"step", progress_.step()}, {"message", e}});
  }
}

std::string TrainingRun::evaluate_and_log(bool final) {
  const auto t = std::chrono::steady_clock::now();
  EvalResult e, ema;
  try {
    e = evaluate();
    if (trained_.ema()) ema = evaluate_ema();
  } catch (const std::exception& err) {
    trained_.model()->train();
    if (ranks_.dist()) throw;  // the ranks would no longer agree on their collectives
    return error_message(err);
  }
  const std::string ema_text = trained_.ema() ? fmt::format("; ema: loss {:.4f} top1 {:.2f}% top5 {:.2f}%", ema.loss,
                                                            100 * ema.top1, 100 * ema.top5)
                                              : "";
  spdlog::info("{}eval at step {}: loss {:.4f} top1 {:.2f}% top5 {:.2f}%{} ({:.1f}s)", final ? "final " : "",
               progress_.step(), e.loss, 100 * e.top1, 100 * e.top5, ema_text, seconds_since(t));
  nlohmann::json j = {{"step", progress_.step()}, {"loss", e.loss}, {"top1", e.top1}, {"top5", e.top5},
                      {"samples", e.samples}, {"seconds", seconds_since(t)}};
  if (trained_.ema()) {  // the averaged weights' figures beside the trained weights' (whose keys stay as they were)
    j["ema_loss"] = ema.loss;
    j["ema_top1"] = ema.top1;
    j["ema_top5"] = ema.top5;
  }
  if (final) j["final"] = true;
  trackers_.metrics().event("eval", j);
  return "";
}

std::optional<int> TrainingRun::agree_on_save_and_stop() {
  RECORD_USER_SCOPE("trainer.agree");
  const int64_t step = progress_.step();
  if (main_rank()) saver_->collect(step);  // a background save that failed is reported now and retried below
  bool ckpt_now = saver_->due(step);
  bool ckpt_request = take_checkpoint_request();
  int stop_sig = stop_requested() ? stop_signal() : 0;
  bool cannot_save = saver_->cannot_save();
  if (ranks_.dist()) {
    // Saving is collective and a stop must happen at the same step everywhere: a signal or a timer
    // seen by any rank counts for all (torchrun forwards SIGTERM to every rank, not at the same instant).
    // Rank 0 alone knows how its saves went.
    auto a = ranks_.dist()->all_max({ckpt_now ? 1.0 : 0.0, ckpt_request ? 1.0 : 0.0, static_cast<double>(stop_sig),
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
    spdlog::warn("stop requested by {}: saving a checkpoint at step {} and exiting", sig, step);
    trackers_.telemetry().set_stopping();
    if (!save_before_exit(sig))
      return saver_->exit_not_saved(step, "the " + sig + " checkpoint of step " + std::to_string(step),
                                    cfg_.checkpoint.max_failures);
    trackers_.metrics().event("stop", {{"step", step}, {"signal", sig}});
    return exit_code_for_signal(stop_sig);
  }
  if (cannot_save) return saver_->exit_not_saved(step, "step " + std::to_string(step), saver_->failures());
  if ((ckpt_request || ckpt_now) && !progress_.done())
    saver_->save_in_background(step, ckpt_request ? "SIGUSR1" : saver_->retrying() ? "retry" : "periodic",
                               [this] { return serialize_checkpoint(); });
  return std::nullopt;
}

int TrainingRun::give_up(const OomGaveUp& e) {
  spdlog::error("{}", e.what());
  const std::string would_fit = what_would_fit();
  if (!would_fit.empty()) spdlog::error("{}", would_fit);
  const int64_t step = progress_.step();
  trackers_.metrics().event("oom_gave_up", {{"step", step},
                                            {"message", e.what()},
                                            {"would_fit", would_fit},
                                            {"mem_peak_bytes", memory_.backend().peak_bytes()}});
  // No step trained in this process: the state is the fresh start's or the resumed checkpoint's, which a
  // rerun rebuilds bit for bit. A save would only copy it (every weight and optimizer moment, outside
  // the cap), which for a model too large for its cap can be more than the machine has left.
  if (step == progress_.start_step()) {
    spdlog::info("no step trained in this process (step {}): nothing to save", step);
    return kExitOomGaveUp;
  }
  // serialize_checkpoint() lifts the cap while it copies the state: the cap may be below the live bytes.
  if (!save_before_exit("oom_gave_up"))
    return saver_->exit_not_saved(step,
                                  "the checkpoint of step " + std::to_string(step) + " before giving up on memory",
                                  cfg_.checkpoint.max_failures);
  return kExitOomGaveUp;
}

int TrainingRun::finish() {
  // The final checkpoint comes before the final evaluation: an error there must not cost the training.
  const int64_t step = progress_.step();
  if (cfg_.checkpoint.final && !save_before_exit("final"))
    return saver_->exit_not_saved(step, "the final checkpoint of step " + std::to_string(step),
                                  cfg_.checkpoint.max_failures);
  if (has_eval()) {
    if (const auto e = evaluate_and_log(true); !e.empty()) {
      spdlog::error("final evaluation at step {} failed: {}; the trained model is saved in {}", step, e,
                    saver_->last_saved_path());
      trackers_.metrics().event("error", {{"step", step}, {"message", "final evaluation: " + e}});
      return kExitError;
    }
  }
  const double total = progress_.seconds();
  trackers_.metrics().event("end", {{"step", step}, {"seconds", total}, {"samples_seen", progress_.samples_seen()}});
  spdlog::info("done: {} steps in {}", step, format_duration(total));
  return kExitOk;
}

int train(const Config& cfg, const RunOptions& opts) {
  TrainingRun run(cfg, opts);
  return run.run();
}

}  // namespace trainer
