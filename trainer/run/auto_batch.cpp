// train.micro_batch: auto, once before the first step: where the search starts (a memory curve's
// prediction) and which activation checkpointing it searches under (RunMemory, run_memory.h), what it
// remembers across a restart (auto_search.json), and what a stop during it does. The search itself is the step's
// (MicroBatchSearcher, trainer/step/search.h).
#include <spdlog/spdlog.h>

#include <csignal>
#include <filesystem>

#include "common/clock.h"
#include "common/compat.h"
#include "common/signals.h"
#include "trainer/step/search_findings.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"

namespace trainer {

namespace fs = std::filesystem;

int64_t TrainingRun::curve_start() const {
  return memory_.curve_start(step_runner_->controller().checkpointing(), rank_batch());
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
  return {{"config", to_yaml(c)}, {"limit", memory_.agreed_limit()}, {"device", trained_.device().str()},
          {"torch", compat::torch_version()}, {"world_size", ranks_.env().world_size}, {"rank", ranks_.env().rank},
          {"checkpointing", checkpointing}, {"start", curve_start()}};
}

MicroBatchSearch TrainingRun::auto_micro_batch(const data::Batch& batch) {
  // train.micro_batch: auto, once before the first step, on the first batch's samples. After poll(): the
  // search is a collective, which a rank whose batch did not fit would not have entered.
  memory_.set_need_micro_batch_search(false);
  const auto t = std::chrono::steady_clock::now();
  MicroBatchOptions co = micro_batch_options(cfg_, rank_batch());
  std::string from = memory_.choose_checkpointing(co, rank_batch());  // the auto_micro_batch event's checkpointing_from
  // A stop is honoured within the search; what it found so far is kept for the restart (auto_search.json
  // in this rank's folder), and what an earlier process found under the same conditions is not probed again.
  SearchFindings findings((fs::path(ranks_.rank_dir()) / "auto_search.json").string());
  if (!findings.problem().empty()) spdlog::warn("{}", findings.problem());
  MicroBatchSearch found = search_once(batch, co, findings);
  if (found.stopped) return found;
  size_t other_setting = 0;  // the trace's first probes, of a search without checkpointing that found nothing
  if (cfg_.memory.activation_checkpointing == Checkpointing::kAuto && !found.floor_fits && !co.checkpointing) {
    co.checkpointing = true;
    from = "floor_does_not_fit";
    const MicroBatchSearch first = found;
    found = search_once(batch, co, findings);
    if (found.stopped) return found;
    found.probes += first.probes;
    found.reused += first.reused;
    found.trace.insert(found.trace.begin(), first.trace.begin(), first.trace.end());
    other_setting = first.trace.size();
    found.tuned_sizes.insert(found.tuned_sizes.end(), first.tuned_sizes.begin(), first.tuned_sizes.end());
  }
  const double search_s = seconds_since(t);
  co.micro_batch = found.micro_batch;
  // A size chosen below the largest that fits because it ran faster: grow-back returns to it after a
  // backoff and never probes past it, a rise of the limit included (speed, not memory, chose it).
  co.max_micro_batch = found.largest > found.micro_batch ? found.micro_batch : 0;
  MicroBatchController controller = make_controller(co, memory_.agreed_limit());
  // The probes that fitted are points of the step's memory curve: grow-back judges its probes on them
  // from the first step (trainer/memory/oom.h). In one process only: each rank probed its own sizes,
  // and every rank's controller must decide alike.
  if (!ranks_.dist()) {
    for (size_t i = other_setting; i < found.trace.size(); ++i)
      if (const auto& p = found.trace[i]; p.at("fits").get<bool>())
        controller.add_peak(p.at("micro_batch").get<int64_t>(), co.checkpointing, p.at("peak_bytes").get<int64_t>());
  }
  step_runner_->set_controller(std::move(controller));
  step_runner_->apply_activation_checkpointing();
  log_auto_micro_batch(found, co.checkpointing, from, search_s);
  return found;
}

MicroBatchSearch TrainingRun::search_once(const data::Batch& batch, const MicroBatchOptions& co,
                                          SearchFindings& findings) {
  step_runner_->set_controller(make_controller(co, memory_.agreed_limit()));
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
  return MicroBatchSearcher(*step_runner_).find(batch, cfg_.memory.min_micro_batch, memory_.agreed_limit(), curve_start(),
                                                control);
}

void TrainingRun::log_auto_micro_batch(const MicroBatchSearch& found, bool checkpointing, const std::string& from,
                                       double search_s) {
  std::string how = found.start ? "from the memory curve's " + std::to_string(found.start)
                     : found.method == "curve" ? "from its probes' memory curve, " + found.ended
                                               : std::string("doubling from the floor");
  // memory.auto_search: auto says which search it took and why, and which size among those that fit.
  if (found.method_from == "auto" && found.choice.contains("reason"))
    how = "search " + found.choice["reason"].get<std::string>();
  if (found.speed.is_object()) how += "; micro-batch " + found.speed["reason"].get<std::string>();
  spdlog::info("micro_batch auto: {} fits under {} (accumulation {}, checkpointing {}: {}; {} probes in {:.2f} s, {})",
               found.micro_batch, memory_.limit().bytes() ? format_bytes(memory_.limit().bytes()) : "no limit",
               step_runner_->controller().accum_steps(), checkpointing ? "on" : "off", from, found.probes, search_s,
               how);
  trackers_.metrics().event("auto_micro_batch", {{"micro_batch", found.micro_batch},
                                                 {"largest_fitting", found.largest},
                                                 {"method_from", found.method_from},
                                                 {"method_choice", found.choice},
                                                 {"speed", found.speed},
                                                 {"accum_steps", step_runner_->controller().accum_steps()},
                                                 {"checkpointing", checkpointing},
                                                 {"checkpointing_from", from},
                                                 {"floor_fits", found.floor_fits},
                                                 {"limit", memory_.limit().bytes()},
                                                 {"start", found.start},
                                                 {"probes", found.probes},
                                                 {"reused_probes", found.reused},
                                                 {"search_s", search_s},
                                                 {"method", found.method},
                                                 {"ended", found.ended},
                                                 {"tuned_sizes", found.tuned_sizes},
                                                 {"trace", found.trace}});
}

int TrainingRun::stop_during_search(const MicroBatchSearch& found) {
  // Nothing has trained and nothing needs saving: the probes' findings are already in auto_search.json,
  // and the restart (no checkpoint: a fresh start) resumes the search from them.
  const int sig = stop_requested() ? stop_signal() : SIGTERM;  // the stop came on another rank
  const std::string name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  trackers_.telemetry().set_stopping();
  spdlog::warn("stop requested by {} during micro_batch auto's search, {}: exiting before the first step; the "
               "probes that ran to their end are kept in {} for the restart",
               name, found.stopped_at, (fs::path(ranks_.rank_dir()) / "auto_search.json").string());
  trackers_.metrics().event("stop", {{"step", progress_.step()}, {"signal", name}, {"during", "auto_search"},
                                     {"at", found.stopped_at}, {"probes", found.probes}});
  return exit_code_for_signal(sig);
}

void TrainingRun::pretune(const data::Batch& batch) {
  // Once per process (LibTorch's cuDNN plans live as long as the process), at the size the run starts at:
  // after the auto search, before the first step.
  memory_.pretuned();
  MicroBatchSearcher(*step_runner_).pretune(batch, progress_.step());
}

}  // namespace trainer
