// memory.state: before the model is built, the memory plan decides whether the optimizer's state (and then
// the weights) are stored in fewer bytes (auto), and a run that gives up on memory names the settings the
// plan finds would fit. After a give-up the plan did not foresee, the same rungs are taken mid-run, one at
// a time: the moments in bfloat16, in int8, then the weights in bfloat16 (stochastic rounding).
#include <spdlog/spdlog.h>

#include "trainer/memory/backend.h"
#include "common/log.h"
#include "trainer/run/from_config.h"
#include "trainer/run/memory_plan.h"
#include "trainer/run/run.h"

namespace trainer {

namespace {

// The least change of `report` that fits, as "optim.state_dtype: int8 (peak 14.81 GiB)"; "" when none does.
std::string fitting(const PlanReport& report) {
  for (const auto& a : report.alternatives)
    if (a.plan.fits) return a.setting + " (peak " + format_bytes(a.plan.peak_bytes) + ")";
  return "";
}

}  // namespace

void TrainingRun::choose_memory_state() {
  if (cfg_.memory.state != MemoryState::kAuto) return;
  if (trained_.device().is_cuda()) {
    spdlog::info("memory.state auto: the moments stay {} on {} (fewer bytes run on the CPU only)",
                 mode_name(cfg_.optim.state_dtype), trained_.device().str());
    return;
  }
  const int64_t cap = memory_.limit().bytes();
  const PlanReport report = plan_report(cfg_, cap);
  const PlanAlternative* chosen = nullptr;
  for (const auto& a : report.alternatives)
    if (!chosen && a.plan.fits) chosen = &a;
  // The rungs in order: as configured, bfloat16 moments, int8 moments, bfloat16 weights (with int8 moments).
  // Every rank takes the highest any rank needs: replicas must take the same steps.
  const auto level = [](StateDtype s, ParamDtype p) { return p == ParamDtype::kBfloat16 ? 3 : static_cast<int>(s); };
  const int now = level(cfg_.optim.state_dtype, cfg_.model.param_dtype);
  int to = chosen ? level(chosen->state_dtype, chosen->param_dtype) : now;
  if (ranks_.dist())
    to = static_cast<int>(ranks_.dist()->all_max({static_cast<double>(to)}, "memory.state auto")[0]);
  const std::string from = mode_name(cfg_.optim.state_dtype);
  if (to == now) {
    if (report.plan.fits)
      spdlog::info("memory.state auto: the plan fits with {} moments ({}, peak {} under {})", from, report.plan.rung,
                   format_bytes(report.plan.peak_bytes), cap ? format_bytes(cap) : std::string("no cap"));
    else
      spdlog::warn("memory.state auto: the job does not fit under {} (peak {}), and no optim.state_dtype or "
                   "model.param_dtype makes it fit; it runs as configured", format_bytes(cap),
                   format_bytes(report.plan.peak_bytes));
    return;
  }
  const bool chosen_here = chosen && level(chosen->state_dtype, chosen->param_dtype) == to;
  const std::string planned =
      chosen_here ? chosen->plan.rung + ", peak " + format_bytes(chosen->plan.peak_bytes) : "as another rank needs";
  const nlohmann::json common = {{"reason", "plan"}, {"limit", cap},
                                 {"planned_peak_bytes", chosen_here ? chosen->plan.peak_bytes : 0},
                                 {"planned_peak_bytes_before", report.plan.peak_bytes}};
  const auto changed = [&](const std::string& setting, const std::string& was, const std::string& is) {
    nlohmann::json fields = common;
    fields.update({{"setting", setting}, {"from", was}, {"to", is}});
    trackers_.metrics().event("memory_state", fields);
    trackers_.set_changed_setting(setting, was, is);
  };
  const StateDtype state = to == 3 ? StateDtype::kInt8 : static_cast<StateDtype>(to);
  spdlog::warn("memory.state auto: the job does not fit under {} with {} moments (peak {}); {} ({})", format_bytes(cap),
               from, format_bytes(report.plan.peak_bytes),
               to == 3 ? "the weights are stored in bfloat16, rounded stochastically, and the moments in int8"
                       : "they are stored in " + mode_name(state),
               planned);
  // The config first: each change is recorded with the resolved config as it now is.
  const Config before = cfg_;
  cfg_.optim.state_dtype = state;
  if (to == 3) cfg_.model.param_dtype = ParamDtype::kBfloat16, cfg_.optim.stochastic_rounding = true;
  if (state != before.optim.state_dtype) changed("optim.state_dtype", from, mode_name(state));
  if (cfg_.model.param_dtype != before.model.param_dtype)
    changed("model.param_dtype", mode_name(before.model.param_dtype), mode_name(cfg_.model.param_dtype));
  if (cfg_.optim.stochastic_rounding != before.optim.stochastic_rounding) changed("optim.stochastic_rounding", "false", "true");
}

bool TrainingRun::store_state_in_fewer_bytes(const OomGaveUp& e) {
  // One process on the CPU, batches fetched inside the step: a second attempt at the same batch is the
  // first one again. Data parallel replicas would have to agree on it; they give up instead.
  if (cfg_.memory.state != MemoryState::kAuto || trained_.device().is_cuda() || ranks_.dist() ||
      fetches_ahead(cfg_, trained_.device()))
    return false;
  return cfg_.optim.state_dtype == StateDtype::kInt8 ? store_weights_in_bfloat16(e) : store_moments_in_fewer_bytes(e);
}

bool TrainingRun::store_moments_in_fewer_bytes(const OomGaveUp& e) {
  const std::string from = mode_name(cfg_.optim.state_dtype);
  OptimConfig next = cfg_.optim;
  next.state_dtype = cfg_.optim.state_dtype == StateDtype::kFloat32 ? StateDtype::kBfloat16 : StateDtype::kInt8;
  try {
    // Tensor by tensor: beyond the old moments, one parameter's new ones at a time (AdamMoments::convert).
    const LiftedCap lifted(memory_.backend());
    trained_.optimizer().convert_state(next);
  } catch (const std::exception& failed) {
    spdlog::warn("memory.state auto: the moments could not be stored in {} ({})", mode_name(next.state_dtype),
                 error_message(failed));
    return false;
  }
  cfg_.optim.state_dtype = next.state_dtype;
  step_runner_->controller().on_state_shrank();
  const std::string to = mode_name(next.state_dtype);
  spdlog::warn("memory.state auto: {}; the moments are stored in {} from now on, and the step runs again", e.what(), to);
  trackers_.metrics().event("memory_state", {{"setting", "optim.state_dtype"}, {"from", from}, {"to", to},
                                             {"reason", "gave_up"}, {"limit", memory_.agreed_limit()},
                                             {"step", progress_.step() + 1}});
  trackers_.set_changed_setting("optim.state_dtype", from, to);
  return true;
}

bool TrainingRun::store_weights_in_bfloat16(const OomGaveUp& e) {
  if (cfg_.model.param_dtype == ParamDtype::kBfloat16) return false;  // nothing left to store in fewer bytes
  Config next = cfg_;
  next.model.param_dtype = ParamDtype::kBfloat16;
  next.optim.stochastic_rounding = true;
  try {
    validate(next);  // AdamW, plain, without autocast or an EMA: what bfloat16 weights train with
  } catch (const ConfigError& why) {
    spdlog::warn("memory.state auto: the weights stay float32 ({})", why.what());
    return false;
  }
  try {
    const LiftedCap lifted(memory_.backend());
    trained_.store_weights_in_bfloat16();
  } catch (const std::exception& failed) {
    spdlog::warn("memory.state auto: the weights could not be stored in bfloat16 ({})", error_message(failed));
    return false;
  }
  step_runner_->set_param_dtype(torch::kBFloat16);
  step_runner_->controller().on_state_shrank();
  const bool was_stochastic = cfg_.optim.stochastic_rounding;
  cfg_.model.param_dtype = ParamDtype::kBfloat16;
  cfg_.optim.stochastic_rounding = true;
  spdlog::warn("memory.state auto: {}; the weights are stored in bfloat16 from now on, rounded stochastically after "
               "each update, and the step runs again", e.what());
  const nlohmann::json common = {{"reason", "gave_up"}, {"limit", memory_.agreed_limit()}, {"step", progress_.step() + 1}};
  const auto changed = [&](const std::string& setting, const std::string& was, const std::string& is) {
    nlohmann::json fields = common;
    fields.update({{"setting", setting}, {"from", was}, {"to", is}});
    trackers_.metrics().event("memory_state", fields);
    trackers_.set_changed_setting(setting, was, is);
  };
  changed("model.param_dtype", "float32", "bfloat16");
  if (!was_stochastic) changed("optim.stochastic_rounding", "false", "true");
  return true;
}

std::string TrainingRun::what_would_fit() const {
  if (cfg_.optim.name == OptimKind::kSgd) return "";
  try {
    const int64_t cap = memory_.agreed_limit();
    if (cap == 0) return "";
    PlanReport report = plan_report(cfg_, cap);
    if (report.plan.fits) return "";  // the plan expected it to fit: it has nothing to name
    const std::string fits = fitting(report);
    return fits.empty() ? "the memory plan finds no optim.state_dtype or model.param_dtype that fits under " + format_bytes(cap)
                        : "the memory plan under " + format_bytes(cap) + " finds that " + fits + " would fit" +
                              (cfg_.memory.state == MemoryState::kFixed ? " (memory.state: auto moves to it by itself)" : "");
  } catch (const std::exception&) {
    return "";  // the plan is advice: a failure to make it never hides why the run stopped
  }
}

}  // namespace trainer
