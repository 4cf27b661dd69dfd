// The memory plan of a config (trainer/memory/plan.h), counted before anything is allocated: the model's
// parameters and activations from its shape (models/footprint.h), the optimizer's state in its
// optim.state_dtype (AdamMoments::bytes_for), the EMA, autocast's 16-bit weight copies, the batches in
// flight, and the cap memory.limit resolves to on this machine. When the job does not fit, the plan of each
// setting that changes only the numbers' storage (optim.state_dtype, then model.param_dtype) says which would. `trainer plan`, and
// `trainer --dry-run` under "# memory plan". docs/MEMORY.md "The memory plan".
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/memory/plan.h"

namespace trainer {

/// A setting the job could change, and its plan.
struct PlanAlternative {
  std::string setting;  ///< "optim.state_dtype: int8"
  StateDtype state_dtype = StateDtype::kFloat32;  ///< the moments' dtype it names
  ParamDtype param_dtype = ParamDtype::kFloat32;  ///< the weights' dtype it names
  PlanJob job;
  MemoryPlan plan;
};

struct PlanReport {
  std::string model;     ///< one line: the model, its parameters, the sample, the precision
  std::string cap_line;  ///< how memory.limit resolved (describe_memory_limit)
  PlanJob job;
  MemoryPlan plan;
  /// When the job does not fit: the settings that would, least change first; empty when it fits.
  std::vector<PlanAlternative> alternatives;
};

/// What the plan is computed from, for `cfg` under `cap` bytes (0: none). Throws ConfigError as the run
/// would for a config it cannot build.
PlanJob plan_job(const Config& cfg, int64_t cap);

/// The cap memory.limit resolves to on this machine now, as --dry-run describes it: a size as written;
/// `auto` on the CPU from the container's limit and the machine's memory; `auto` on CUDA from the GPU's
/// free memory when this machine has it, else 0 (not known here: the line says so).
int64_t planned_cap(const Config& cfg);

/// The plan of `cfg` on this machine (planned_cap), with the settings that would fit when it does not.
PlanReport plan_report(const Config& cfg);
/// The same under `cap` bytes (0: none): what the run's own cap is once resolved.
PlanReport plan_report(const Config& cfg, int64_t cap);

/// The table `trainer plan` prints (ends with a newline).
std::string render_plan_report(const PlanReport& report);

/// {model, cap_line, ...plan_to_json, alternatives: [{setting, peak_bytes, fits, rung}]}.
nlohmann::json plan_report_json(const PlanReport& report);

}  // namespace trainer
