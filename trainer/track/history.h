// A finished MLflow run read back, for `trainer compare mlflow:...` (tools/compare.h): which run a spec
// names, and every metric's history.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "trainer/track/records.h"

namespace trainer::track {

class MlflowClient;

/// The run `spec` names: a run id, or "experiment/NAME": the experiment's latest run that FINISHED (by
/// end time) other than `exclude` (the run being compared with it: tonight's, logged as finished before
/// the comparison). Throws std::runtime_error naming the server and what is missing.
std::string resolve_run(MlflowClient& client, const std::string& spec, const std::string& exclude = "");

/// Every metric of run `run_id`, each with its whole history (metrics/get-history, page by page). Throws
/// std::runtime_error naming the server and the run.
std::map<std::string, std::vector<Metric>> read_history(MlflowClient& client, const std::string& run_id);

}  // namespace trainer::track
