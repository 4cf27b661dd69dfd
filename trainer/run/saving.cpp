// When a run saves, and what it does when a save fails. A failed save never goes unreported and never
// stops the next one from being tried:
//
//   periodic, SIGUSR1   written in the background (checkpoint.async); the loop learns how it ended at
//                       the next step boundary (collect_saves): a failure is a warning line and a
//                       `checkpoint_failed` event at once, and the save is retried at the next step (a
//                       new step, so a fresh folder). checkpoint.max_failures failures in a row: exit 4.
//   SIGTERM/SIGINT,     written in the foreground, up to checkpoint.max_failures attempts a second apart,
//   final, OOM give-up  each under a fresh folder name (step-N, step-N-r1, ...). If every attempt fails:
//                       exit 4, with one line naming what was not saved and the last good checkpoint.
//
// The `checkpoint` event is written when a checkpoint is on disk, not when it was handed to the
// background writer: metrics and the /metrics endpoint count only saves that happened.
#include <spdlog/spdlog.h>

#include <thread>

#include "common/clock.h"
#include "common/signals.h"
#include "trainer/run/run.h"

namespace trainer {

namespace {
const char* const kAtNextStep = "saving again at the next step";
}  // namespace

void TrainingRun::save_in_background(const std::string& reason) {
  const auto t0 = std::chrono::steady_clock::now();
  retry_save_ = false;
  if (main_rank()) {
    store_->wait();  // the previous background save ends first, and is reported as itself
    collect_saves();
    retry_save_ = false;  // this save is the retry
  }
  std::optional<CheckpointFiles> files;
  try {
    files = serialize_checkpoint();
  } catch (const std::exception& e) {
    if (dist_) throw;  // a failed collective leaves the ranks out of step: not a save to retry
    on_save_failed(step_, reason, e.what(), kAtNextStep);
    return;
  }
  last_ckpt_time_ = std::chrono::steady_clock::now();
  if (!files) return;  // ranks other than 0 only contribute their generators
  const nlohmann::json extra = {{"reason", reason}, {"device", device_.str()}};
  if (cfg_.checkpoint.async) {
    store_->save_async(step_, std::move(*files), extra);
    pending_save_ = PendingSave{step_, reason, t0};
    spdlog::info("checkpoint: step {} ({}) serialized in {:.2f}s, writing in the background", step_, reason,
                 seconds_since(t0));
    return;
  }
  try {
    on_saved(step_, reason, store_->save(step_, *files, extra), seconds_since(t0));
  } catch (const std::exception& e) {
    on_save_failed(step_, reason, e.what(), kAtNextStep);
  }
}

bool TrainingRun::save_before_exit(const std::string& reason) {
  const auto t0 = std::chrono::steady_clock::now();
  bool ok = true;
  if (main_rank()) {
    store_->wait();  // a background save that succeeds now is the last good checkpoint the line names
    collect_saves();
  }
  std::optional<CheckpointFiles> files;
  std::string serialize_error;
  try {
    files = serialize_checkpoint();
  } catch (const std::exception& e) {
    if (dist_) throw;
    serialize_error = e.what();
  }
  last_ckpt_time_ = std::chrono::steady_clock::now();
  if (main_rank()) {
    ok = false;
    const int64_t attempts = files ? cfg_.checkpoint.max_failures : 0;
    if (!files) on_save_failed(step_, reason, serialize_error, "nothing to retry");
    const nlohmann::json extra = {{"reason", reason}, {"device", device_.str()}};
    for (int64_t a = 0; a < attempts && !ok; ++a) {
      // A fresh folder name per attempt: what the failed one could not replace is not in the way.
      if (a > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
      try {
        on_saved(step_, reason, store_->save(step_, *files, extra, static_cast<int>(a)), seconds_since(t0));
        ok = true;
      } catch (const std::exception& e) {
        on_save_failed(step_, reason, e.what(),
                       a + 1 < attempts ? "retrying under a fresh folder name" : "no attempts left");
      }
    }
  }
  // Every rank ends the same way (4, or the code of its ending).
  if (dist_) ok = dist_->all_max({ok ? 0.0 : 1.0}, "the checkpoint outcome")[0] == 0.0;
  return ok;
}

void TrainingRun::collect_saves() {
  while (auto o = store_->take_outcome()) {
    std::string reason = "background";
    double seconds = 0;
    if (pending_save_ && pending_save_->step == o->step) {
      reason = pending_save_->reason;
      seconds = seconds_since(pending_save_->started);
    }
    pending_save_.reset();
    if (o->ok()) on_saved(o->step, reason, o->path, seconds);
    else on_save_failed(o->step, reason, o->error, kAtNextStep);
  }
}

void TrainingRun::on_saved(int64_t step, const std::string& reason, const std::string& path, double seconds) {
  if (save_failures_ > 0) spdlog::info("checkpoint: saved again after {} failed attempts", save_failures_);
  last_saved_path_ = path;
  last_saved_step_ = step;
  save_failures_ = 0;
  last_save_error_.clear();
  spdlog::info("checkpoint: step {} ({}) written to {} in {:.2f}s", step, reason, path, seconds);
  metrics_.event("checkpoint", {{"step", step}, {"reason", reason}, {"seconds", seconds}, {"path", path}});
}

void TrainingRun::on_save_failed(int64_t step, const std::string& reason, const std::string& error,
                                 const std::string& next) {
  ++save_failures_;
  last_save_error_ = error;
  retry_save_ = true;
  const std::string then = save_failures_ >= cfg_.checkpoint.max_failures && next == kAtNextStep ? "stopping" : next;
  spdlog::warn("checkpoint: saving step {} ({}) failed, {} of {} attempts in a row: {}; {}", step, reason,
               save_failures_, cfg_.checkpoint.max_failures, error, then);
  metrics_.event("checkpoint_failed", {{"step", step}, {"at_step", step_}, {"reason", reason}, {"error", error},
                                      {"failures", save_failures_}, {"max_failures", cfg_.checkpoint.max_failures}});
}

int TrainingRun::exit_not_saved(const std::string& what, int64_t attempts) {
  std::string lost = "nothing since is lost";
  if (last_saved_step_ < step_)
    lost = "steps " + std::to_string(last_saved_step_ + 1) + "-" + std::to_string(step_) + " are not saved";
  const std::string last = last_saved_path_.empty()
                               ? "no checkpoint of this run was written"
                               : "the last good checkpoint is " + last_saved_path_ + " (step " +
                                     std::to_string(last_saved_step_) + ")";
  spdlog::error("checkpoint: {} could not be saved ({} attempts): {}; {}; {}; free space or fix the checkpoint "
                "folder, then run the same command to resume", what, attempts, last_save_error_, lost, last);
  metrics_.event("checkpoint_gave_up", {{"step", step_}, {"what", what}, {"error", last_save_error_},
                                       {"last_saved_step", last_saved_step_}, {"last_saved_path", last_saved_path_}});
  return kExitCheckpointFailed;
}

}  // namespace trainer
