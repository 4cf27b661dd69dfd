// When a run saves, and what it does when a save fails (saver.h). A failed save never goes unreported and never
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
#include "trainer/run/saver.h"

#include <spdlog/spdlog.h>

#include <thread>

#include "common/clock.h"
#include "common/signals.h"

namespace trainer {

namespace {
const char* const kAtNextStep = "saving again at the next step";
}  // namespace

Saver::Saver(const CheckpointConfig& cfg, std::unique_ptr<CheckpointStore> store, MetricsLog& metrics,
             Distributed* dist, bool main_rank, std::string device)
    : cfg_(cfg),
      store_(std::move(store)),
      metrics_(metrics),
      dist_(dist),
      main_rank_(main_rank),
      device_(std::move(device)),
      last_time_(std::chrono::steady_clock::now()) {}

Saver::~Saver() {
  if (store_) store_->wait();
}

bool Saver::due(int64_t step) const {
  return (cfg_.every_steps > 0 && step % cfg_.every_steps == 0) ||
         (cfg_.every_seconds > 0 && seconds_since(last_time_) >= cfg_.every_seconds) || retry_;
}

void Saver::resumed_from(const std::string& path, int64_t step) {
  last_path_ = path;
  last_step_ = step;
}

void Saver::save_in_background(int64_t step, const std::string& reason, const Serialize& serialize) {
  const auto t0 = std::chrono::steady_clock::now();
  retry_ = false;
  if (main_rank_) {
    store_->wait();  // the previous background save ends first, and is reported as itself
    collect(step);
    retry_ = false;  // this save is the retry
  }
  std::optional<CheckpointFiles> files;
  try {
    files = serialize();
  } catch (const std::exception& e) {
    if (dist_) throw;  // a failed collective leaves the ranks out of step: not a save to retry
    on_failed(step, step, reason, e.what(), kAtNextStep);
    return;
  }
  last_time_ = std::chrono::steady_clock::now();
  if (!files) return;  // ranks other than 0 only contribute their generators
  const nlohmann::json extra = {{"reason", reason}, {"device", device_}};
  if (cfg_.async) {
    store_->save_async(step, std::move(*files), extra);
    pending_ = Pending{step, reason, t0};
    spdlog::info("checkpoint: step {} ({}) serialized in {:.2f}s, writing in the background", step, reason,
                 seconds_since(t0));
    return;
  }
  try {
    on_saved(step, reason, store_->save(step, *files, extra), seconds_since(t0));
  } catch (const std::exception& e) {
    on_failed(step, step, reason, e.what(), kAtNextStep);
  }
}

bool Saver::save_before_exit(int64_t step, const std::string& reason, const Serialize& serialize) {
  const auto t0 = std::chrono::steady_clock::now();
  bool ok = true;
  if (main_rank_) {
    store_->wait();  // a background save that succeeds now is the last good checkpoint the line names
    collect(step);
  }
  std::optional<CheckpointFiles> files;
  std::string serialize_error;
  try {
    files = serialize();
  } catch (const std::exception& e) {
    if (dist_) throw;
    serialize_error = e.what();
  }
  last_time_ = std::chrono::steady_clock::now();
  if (main_rank_) {
    ok = false;
    const int64_t attempts = files ? cfg_.max_failures : 0;
    if (!files) on_failed(step, step, reason, serialize_error, "nothing to retry");
    const nlohmann::json extra = {{"reason", reason}, {"device", device_}};
    for (int64_t a = 0; a < attempts && !ok; ++a) {
      // A fresh folder name per attempt: what the failed one could not replace is not in the way.
      if (a > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
      try {
        on_saved(step, reason, store_->save(step, *files, extra, static_cast<int>(a)), seconds_since(t0));
        ok = true;
      } catch (const std::exception& e) {
        on_failed(step, step, reason, e.what(),
                  a + 1 < attempts ? "retrying under a fresh folder name" : "no attempts left");
      }
    }
  }
  // Every rank ends the same way (4, or the code of its ending).
  if (dist_) ok = dist_->all_max({ok ? 0.0 : 1.0}, "the checkpoint outcome")[0] == 0.0;
  return ok;
}

void Saver::collect(int64_t at_step) {
  while (auto o = store_->take_outcome()) {
    std::string reason = "background";
    double seconds = 0;
    if (pending_ && pending_->step == o->step) {
      reason = pending_->reason;
      seconds = seconds_since(pending_->started);
    }
    pending_.reset();
    if (o->ok()) on_saved(o->step, reason, o->path, seconds);
    else on_failed(o->step, at_step, reason, o->error, kAtNextStep);
  }
}

void Saver::on_saved(int64_t step, const std::string& reason, const std::string& path, double seconds) {
  if (failures_ > 0) spdlog::info("checkpoint: saved again after {} failed attempts", failures_);
  last_path_ = path;
  last_step_ = step;
  failures_ = 0;
  last_error_.clear();
  spdlog::info("checkpoint: step {} ({}) written to {} in {:.2f}s", step, reason, path, seconds);
  metrics_.event("checkpoint", {{"step", step}, {"reason", reason}, {"seconds", seconds}, {"path", path}});
}

void Saver::on_failed(int64_t step, int64_t at_step, const std::string& reason, const std::string& error,
                      const std::string& next) {
  ++failures_;
  last_error_ = error;
  retry_ = true;
  const std::string then = failures_ >= cfg_.max_failures && next == kAtNextStep ? "stopping" : next;
  spdlog::warn("checkpoint: saving step {} ({}) failed, {} of {} attempts in a row: {}; {}", step, reason,
               failures_, cfg_.max_failures, error, then);
  metrics_.event("checkpoint_failed", {{"step", step}, {"at_step", at_step}, {"reason", reason}, {"error", error},
                                      {"failures", failures_}, {"max_failures", cfg_.max_failures}});
}

int Saver::exit_not_saved(int64_t step, const std::string& what, int64_t attempts) {
  std::string lost = "nothing since is lost";
  if (last_step_ < step)
    lost = "steps " + std::to_string(last_step_ + 1) + "-" + std::to_string(step) + " are not saved";
  const std::string last = last_path_.empty() ? "no checkpoint of this run was written"
                                              : "the last good checkpoint is " + last_path_ + " (step " +
                                                    std::to_string(last_step_) + ")";
  spdlog::error("checkpoint: {} could not be saved ({} attempts): {}; {}; {}; free space or fix the checkpoint "
                "folder, then run the same command to resume", what, attempts, last_error_, lost, last);
  metrics_.event("checkpoint_gave_up", {{"step", step}, {"what", what}, {"error", last_error_},
                                       {"last_saved_step", last_step_}, {"last_saved_path", last_path_}});
  return kExitCheckpointFailed;
}

}  // namespace trainer
