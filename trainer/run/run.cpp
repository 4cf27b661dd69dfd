// The training loop. It only sequences; each stage is a named call:
//
//   setup -> resume -> start -> [ fetch -> poll -> step -> record -> evaluate -> sample -> agree on save/stop ]* -> finish
//
// and the other ways a run ends: the OOM ladder gives up (checkpoint, exit 3), a signal stops it
// (checkpoint, exit 128 + signal), or checkpoints cannot be written (exit 4, saving.cpp).
#include "trainer/run/run.h"

#include <spdlog/spdlog.h>

#include <csignal>
#include <filesystem>

#include "common/clock.h"
#include "common/compat.h"
#include "common/signals.h"
#include "trainer/run/from_config.h"
#include "trainer/memory/search_findings.h"

namespace trainer {

namespace fs = std::filesystem;

TrainingRun::TrainingRun(const Config& cfg, const RunOptions& opts) : cfg_(cfg), opts_(opts) {}

TrainingRun::~TrainingRun() {
  if (store_) store_->wait();  // a failure nobody collected is logged by the store
  // Let go of train.log before the run folder's lock: the next owner's lines never mix with ours.
  if (run_lock_) setup_logging("", cfg_.log.level);
}

int TrainingRun::run() {
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
      std::optional<data::Batch> batch = fetch();
      poll(!batch);  // every rank gives up together if any rank's batch did not fit
      if (need_micro_batch_search_) {
        const MicroBatchSearch found = search_micro_batch(*batch);
        if (found.stopped) return stop_during_search(found);
      }
      if (need_pretune_) pretune(*batch);
      const auto t0 = std::chrono::steady_clock::now();
      StepResult r = step_runner_->run(*batch, step_ + 1, learning_rate(cfg_.schedule, cfg_.optim.lr, step_, total_steps_,
                                                                         warmup_steps_),
                                       agreed_limit_);
      record(r, *batch, seconds_since(t0));
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
                             {"torch", compat::torch_version()}, {"limit", limit_bytes_},
                             {"container_limit", bounds_.container_bytes}, {"host_limit", bounds_.host_bytes},
                             {"limit_source", limit_source_}, {"rss_at_limit", rss_at_limit_},
                             {"cudnn_policy", to_string(step_runner_->cudnn().options().mode)},
                             {"cudnn_benchmark_limit", cfg_.memory.cudnn_benchmark_limit},
                             // null: this LibTorch has no switch (common/compat.h)
                             {"cudnn_empty_cache", cudnn_empty_cache_switch_ ? nlohmann::json(cfg_.memory.cudnn_empty_cache)
                                                                            : nlohmann::json(nullptr)}});
  }
  need_micro_batch_search_ = need_micro_batch_search_ && !resumed;  // a resumed run keeps its learned size
  spdlog::info("training {} steps ({} per epoch) at global batch {} on {}; memory limit {}", total_steps_,
               steps_per_epoch_, cfg_.train.global_batch, device_.str(),
               limit_bytes_ ? format_bytes(limit_bytes_) : "none");
  model_->train();
  // The configured policy (or the ladder's state restored from a checkpoint) applies from the first step.
  step_runner_->apply_activation_checkpointing();
  start_time_ = last_ckpt_time_ = std::chrono::steady_clock::now();
  telemetry_.set_memory(device_memory_of(*memory_));
  telemetry_.set_total_steps(total_steps_);
  telemetry_.set_ready(true);
}

std::optional<data::Batch> TrainingRun::fetch() {
  const auto t = std::chrono::steady_clock::now();
  data::Batch batch;
  try {
    batch = loader_->next();
  } catch (const std::exception& e) {
    // The batch's tensors count against the cap. No rung of the ladder makes room for them (it shrinks
    // activations, which are gone between steps): the live bytes alone are over the cap.
    if (!is_oom_error(e)) throw;
    batch_oom_ = error_message(e);
    return std::nullopt;
  }
  data_wait_s_ = seconds_since(t);
  return batch;
}

int64_t TrainingRun::curve_start() const {
  if (!curve_ || cfg_.memory.activation_checkpointing == "every_k") return 0;  // no curve of that setting
  const auto it = curve_->fits.find(step_runner_->controller().checkpointing() ? "all" : "none");
  if (it == curve_->fits.end()) return 0;
  // Predicted not to fit at all: start at the floor, which the search then checks first.
  return std::max<int64_t>(1, predict_max_micro_batch(it->second, agreed_limit_, rank_batch()));
}

nlohmann::json TrainingRun::search_conditions(bool checkpointing) const {
  Config c = cfg_;
  // Not what a probe's memory depends on: how long the run is, its schedule, what it logs, when it saves.
  c.train.steps = 0;
  c.train.epochs = 0;
  c.train.eval_every = 0;
  c.schedule = ScheduleConfig{};
  c.log = LogConfig{};
  c.checkpoint = CheckpointConfig{};
  return {{"config", to_yaml(c)}, {"limit", agreed_limit_}, {"device", device_.str()},
          {"torch", compat::torch_version()}, {"world_size", env_.world_size}, {"rank", env_.rank},
          {"checkpointing", checkpointing}, {"start", curve_start()}};
}

MicroBatchSearch TrainingRun::search_micro_batch(const data::Batch& batch) {
  // train.micro_batch: auto, once before the first step, on the first batch's samples. After poll(): the
  // search is a collective, which a rank whose batch did not fit would not have entered.
  need_micro_batch_search_ = false;
  const auto t = std::chrono::steady_clock::now();
  MicroBatchOptions co = micro_batch_options(cfg_, rank_batch());
  // memory.activation_checkpointing: auto picks the setting with the size, before the first step: the
  // memory curve's faster setting under the limit; without a curve (or where it predicts nothing fits),
  // recomputation only where not even the floor fits without it, the ladder's order. Every rank reaches
  // the same choice: the curve, the agreed limit and the search's outcome are the same on all.
  const bool choose = cfg_.memory.activation_checkpointing == "auto";
  std::string from = choose ? "floor_fits" : "config";  // the auto_micro_batch event's checkpointing_from
  if (choose && curve_) {
    const CurveChoice c = choose_setting(*curve_, agreed_limit_, rank_batch());
    if (c.setting != "neither") {
      co.checkpointing = c.setting == "all";
      from = "curve";
    }
  }
  // A stop is honoured within the search; what it found so far is kept for the restart (auto_search.json
  // in this rank's folder), and what an earlier process found under the same conditions is not probed again.
  SearchFindings findings((fs::path(rank_dir_) / "auto_search.json").string());
  if (!findings.problem().empty()) spdlog::warn("{}", findings.problem());
  auto search = [&] {
    step_runner_->set_controller(make_controller(co, agreed_limit_));
    step_runner_->apply_activation_checkpointing();
    const nlohmann::json conditions = search_conditions(co.checkpointing);
    SearchControl control;
    control.stop = [] { return stop_requested(); };
    control.known = findings.known(conditions);
    control.on_probe = [&](int64_t mb, const ProbeOutcome& o) {
      try {
        findings.record(conditions, mb, o);
      } catch (const std::exception& e) {  // a cache: the search goes on without it
        spdlog::warn("{}", e.what());
      }
    };
    if (!control.known.empty())
      spdlog::info("micro_batch auto: {} probe(s) of an earlier process under the same conditions are taken from {}",
                   control.known.size(), findings.path());
    return step_runner_->find_micro_batch(batch, cfg_.memory.min_micro_batch, agreed_limit_, curve_start(), control);
  };
  MicroBatchSearch found = search();
  if (found.stopped) return found;
  if (choose && !found.floor_fits && !co.checkpointing) {
    co.checkpointing = true;
    from = "floor_does_not_fit";
    const MicroBatchSearch first = found;
    found = search();
    if (found.stopped) return found;
    found.probes += first.probes;
    found.reused += first.reused;
    found.trace.insert(found.trace.begin(), first.trace.begin(), first.trace.end());
    found.tuned_sizes.insert(found.tuned_sizes.end(), first.tuned_sizes.begin(), first.tuned_sizes.end());
  }
  const double search_s = seconds_since(t);
  co.micro_batch = found.micro_batch;
  step_runner_->set_controller(make_controller(co, agreed_limit_));
  step_runner_->apply_activation_checkpointing();
  const std::string how = found.start ? "from the memory curve's " + std::to_string(found.start)
                           : found.method == "curve" ? "from its probes' memory curve, " + found.ended
                                                     : std::string("doubling from the floor");
  spdlog::info("micro_batch auto: {} fits under {} (accumulation {}, checkpointing {}: {}; {} probes in {:.2f} s, {})",
               found.micro_batch, limit_bytes_ ? format_bytes(limit_bytes_) : "no limit",
               step_runner_->controller().accum_steps(), co.checkpointing ? "on" : "off", from, found.probes, search_s,
               how);
  metrics_.event("auto_micro_batch", {{"micro_batch", found.micro_batch},
                                      {"accum_steps", step_runner_->controller().accum_steps()},
                                      {"checkpointing", co.checkpointing},
                                      {"checkpointing_from", from},
                                      {"floor_fits", found.floor_fits},
                                      {"limit", limit_bytes_},
                                      {"start", found.start},
                                      {"probes", found.probes},
                                      {"reused_probes", found.reused},
                                      {"search_s", search_s},
                                      {"method", found.method},
                                      {"ended", found.ended},
                                      {"tuned_sizes", found.tuned_sizes},
                                      {"trace", found.trace}});
  return found;
}

int TrainingRun::stop_during_search(const MicroBatchSearch& found) {
  // Nothing has trained and nothing needs saving: the probes' findings are already in auto_search.json,
  // and the restart (no checkpoint: a fresh start) resumes the search from them.
  const int sig = stop_requested() ? stop_signal() : SIGTERM;  // the stop came on another rank
  const std::string name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  telemetry_.set_stopping();
  spdlog::warn("stop requested by {} during micro_batch auto's search, {}: exiting before the first step; the "
               "probes that ran to their end are kept in {} for the restart",
               name, found.stopped_at, (fs::path(rank_dir_) / "auto_search.json").string());
  metrics_.event("stop", {{"step", step_}, {"signal", name}, {"during", "auto_search"}, {"at", found.stopped_at},
                          {"probes", found.probes}});
  return exit_code_for_signal(sig);
}

void TrainingRun::pretune(const data::Batch& batch) {
  // Once per process (LibTorch's cuDNN plans live as long as the process), at the size the run starts at:
  // after the auto search, before the first step.
  need_pretune_ = false;
  step_runner_->pretune(batch, step_);
}

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
  if (!r.updated) {
    // With a GradScaler a skipped step is its normal backoff; without one, five in a row is divergence.
    ++nonfinite_in_a_row_;
    metrics_.event("nonfinite", {{"step", step_ + 1}, {"loss", r.loss}, {"grad_norm", r.grad_norm},
                                 {"scaler", scaler_->is_enabled()}});
    if (!scaler_->is_enabled()) spdlog::warn("step {}: non-finite loss or gradient norm, update skipped", step_ + 1);
    if (nonfinite_in_a_row_ >= 5 && !scaler_->is_enabled())
      throw std::runtime_error("training diverged: 5 steps in a row with a non-finite loss or gradient norm; "
                               "lower optim.lr or set optim.grad_clip");
  } else {
    nonfinite_in_a_row_ = 0;
  }
  batch_hash_ = indices_hash(batch.indices);
  ++step_;
  samples_seen_ += cfg_.train.global_batch;
  // Where the next step's samples start: what a checkpoint records (in samples, not batches, so a
  // resume may use any micro-batch).
  epoch_ = loader_->state().epoch;
  position_ = loader_->state().position;

  window_time_ += step_time + data_wait_s_;
  ++window_steps_;
  const double sps = cfg_.train.global_batch / (step_time + data_wait_s_);  // waiting for data counts
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
                      {"data_wait_s", data_wait_s_},
                      {"mem_peak_bytes", memory_->peak_bytes()},
                      {"mem_start_bytes", r.mem_start_bytes},
                      {"mem_limit_bytes", limit_bytes_},
                      {"rss_bytes", host_rss_bytes()},            // the whole process: what a container counts
                      {"rss_peak_bytes", host_rss_peak_bytes()},  // its high-water mark so far
                      {"oom_retries", r.oom_retries},
                      {"batch_hash", batch_hash_},
                      {"updated", r.updated}};
  if (scaler_->is_enabled()) j["loss_scale"] = r.loss_scale;  // the scale this step's losses were multiplied by
  // The recovery of a step that ran out of memory (from the first OOM to this step's completion), a
  // grow-back probe, and the sizes met for the first time in this process (cuDNN chose their algorithms
  // in this step, timed or not): what a GPU run reads to tell a stall from a step.
  if (r.oom_retries > 0) j["recovery_s"] = r.recovery_s;
  if (!r.probe.empty()) j["probe"] = r.probe;
  if (!r.new_sizes.empty()) {
    j["new_sizes"] = r.new_sizes;
    j["tuned_sizes"] = r.tuned_sizes;
  }
  if (grad_sync_) {
    j["grad_buckets"] = grad_sync_->num_buckets();
    j["grad_buckets_in_backward"] = r.grad_buckets_in_backward;
  }
  if (tokens_) j["tokens_per_s"] = sps * cfg_.model.context;
  j["model_flops_per_s"] = 3.0 * flops_per_sample_ * sps;  // forward + backward (2x forward)
  metrics_.write(j);
  if (step_ % cfg_.log.every == 0 || step_ == total_steps_ || step_ == 1) {
    const double window_sps = cfg_.train.global_batch * window_steps_ / window_time_;
    const double eta = (total_steps_ - step_) * (window_time_ / window_steps_);
    spdlog::info("step {}/{} (epoch {:.2f}) loss {:.4f} lr {:.4g} | {:.1f} {}/s | mb {}x{} | mem peak {} | ETA {}",
                 step_, total_steps_, static_cast<double>(step_) / steps_per_epoch_, r.loss, r.lr,
                 tokens_ ? window_sps * cfg_.model.context : window_sps, tokens_ ? "tokens" : "samples",
                 r.micro_batch, r.accum_steps, format_bytes(memory_->peak_bytes()), format_duration(eta));
    window_time_ = 0;
    window_steps_ = 0;
  }

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

EvalResult TrainingRun::evaluate() {
  if (!has_eval()) return {};
  EvalHooks hooks;
  hooks.heartbeat = [this] { telemetry_.heartbeat(); };
  hooks.backoff = [this](int64_t old, int64_t now) {
    metrics_.event("eval_backoff", {{"step", step_}, {"old_micro_batch", old}, {"new_micro_batch", now},
                                    {"limit", limit_bytes_}, {"current_bytes", memory_->current_bytes()}});
  };
  telemetry_.set_phase("eval");
  // The evaluation batch is a size of its own: timed only under memory.cudnn_policy always.
  set_cudnn_benchmark(step_runner_->cudnn().evaluation_benchmark());
  EvalSettings settings = eval_settings(cfg_, device_, env_.rank, env_.world_size);
  settings.forward = forward_;  // with the input statistics of uint8 images (setup_data)
  return evaluate_split(*model_, {test_images_, test_tokens_}, settings, *memory_, eval_micro_batch_, dist_.get(), hooks);
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
  EvalResult e;
  try {
    e = evaluate();
  } catch (const std::exception& err) {
    model_->train();
    if (dist_) throw;  // the ranks would no longer agree on their collectives
    return error_message(err);
  }
  spdlog::info("{}eval at step {}: loss {:.4f} top1 {:.2f}% top5 {:.2f}% ({:.1f}s)", final ? "final " : "", step_,
               e.loss, 100 * e.top1, 100 * e.top5, seconds_since(t));
  nlohmann::json j = {{"step", step_}, {"loss", e.loss}, {"top1", e.top1}, {"top5", e.top5},
                      {"samples", e.samples}, {"seconds", seconds_since(t)}};
  if (final) j["final"] = true;
  metrics_.event("eval", j);
  return "";
}

std::optional<int> TrainingRun::agree_on_save_and_stop() {
  if (main_rank()) collect_saves();  // a background save that failed is reported now and retried below
  bool ckpt_now = (cfg_.checkpoint.every_steps > 0 && step_ % cfg_.checkpoint.every_steps == 0) ||
                  (cfg_.checkpoint.every_seconds > 0 && seconds_since(last_ckpt_time_) >= cfg_.checkpoint.every_seconds) ||
                  retry_save_;
  bool ckpt_request = take_checkpoint_request();
  int stop_sig = stop_requested() ? stop_signal() : 0;
  bool cannot_save = save_failures_ >= cfg_.checkpoint.max_failures;
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
      return exit_not_saved("the " + sig + " checkpoint of step " + std::to_string(step_), cfg_.checkpoint.max_failures);
    metrics_.event("stop", {{"step", step_}, {"signal", sig}});
    return exit_code_for_signal(stop_sig);
  }
  if (cannot_save) return exit_not_saved("step " + std::to_string(step_), save_failures_);
  if ((ckpt_request || ckpt_now) && step_ < total_steps_)
    save_in_background(ckpt_request ? "SIGUSR1" : retry_save_ ? "retry" : "periodic");
  return std::nullopt;
}

int TrainingRun::give_up(const OomGaveUp& e) {
  spdlog::error("{}", e.what());
  metrics_.event("oom_gave_up", {{"step", step_}, {"message", e.what()}, {"mem_peak_bytes", memory_->peak_bytes()}});
  // serialize_checkpoint() lifts the cap while it copies the state: the cap may be below the live bytes.
  if (!save_before_exit("oom_gave_up"))
    return exit_not_saved("the checkpoint of step " + std::to_string(step_) + " before giving up on memory",
                          cfg_.checkpoint.max_failures);
  return kExitOomGaveUp;
}

int TrainingRun::finish() {
  // The final checkpoint comes before the final evaluation: an error there must not cost the training.
  if (cfg_.checkpoint.final && !save_before_exit("final"))
    return exit_not_saved("the final checkpoint of step " + std::to_string(step_), cfg_.checkpoint.max_failures);
  if (has_eval()) {
    if (const auto e = evaluate_and_log(true); !e.empty()) {
      spdlog::error("final evaluation at step {} failed: {}; the trained model is saved in {}", step_, e,
                    last_saved_path_);
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
