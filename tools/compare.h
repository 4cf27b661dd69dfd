// `trainer compare BASELINE RUN [--tolerances FILE.yaml]`: compares two summaries metric by metric and
// fails (exit kExitRegression) when a metric got worse by more than its tolerance. A summary is a flat
// JSON object of numbers: the benchmark harness's ({"samples_per_s", "step_time_p50_s",
// "peak_memory_bytes", ...}), or one derived from a run's metrics.jsonl (summarize_metrics). Either
// side may be a summary file, a metrics.jsonl or a run folder.
//
// Default tolerances (allowed worsening = max(rel * |baseline|, abs)):
//   samples_per_s, tokens_per_s           higher is better   rel 0.10
//   step_time_p50_s                       lower is better    rel 0.10
//   step_time_p90_s                       lower is better    rel 0.20
//   peak_memory_bytes                     lower is better    rel 0.05
//   final_loss, final_eval_loss           lower is better    rel 0.05, abs 0.02
//   best_top1, final_top1                 higher is better   abs 0.01 (one point of accuracy)
// Other numeric metrics are shown as "info" and never fail. A metric with a tolerance that only one
// side has is shown as "missing" and does not fail either.
#pragma once

#include <nlohmann/json.hpp>

#include <istream>
#include <map>
#include <string>
#include <vector>

namespace trainer {

/// The exit code of `trainer compare` when at least one metric regressed (0: none; 2: bad input).
constexpr int kExitRegression = 5;

/// Which direction is better for a metric, and how much worse it may get.
struct Tolerance {
  bool higher_is_better = true;
  double rel = 0;  ///< fraction of |baseline| (>= 0)
  double abs = 0;  ///< absolute amount in the metric's unit (>= 0)
};
using Tolerances = std::map<std::string, Tolerance>;

/// The table in the file comment.
Tolerances default_tolerances();

/// Reads a YAML mapping of metric -> {better: higher|lower, rel: number, abs: number} over `base`: a
/// metric already in `base` may give only rel or abs; a new one needs `better`. Throws
/// std::runtime_error naming the file and the metric for an unknown key, a bad value or a missing
/// `better`.
Tolerances load_tolerances(const std::string& path, Tolerances base = default_tolerances());

/// The summary of a run from its metrics.jsonl (lines that are not JSON objects are skipped):
///   steps               the last step line's step
///   final_loss          mean loss of the last min(20, n) step lines
///   samples_per_s       median samples_per_s of the step lines, without the first step after each
///                       start or resume event (warm-up), unless that leaves none
///   step_time_p50_s     median step_time_s of the same lines; step_time_p90_s their 90th percentile
///   peak_memory_bytes   the largest mem_peak_bytes
///   best_top1, final_top1, final_eval_loss   from the eval events (absent when there is none)
///   oom_events          the number of "oom" events
///   wall_time_s         the "seconds" of the last end event (absent before the run ended)
/// Throws std::runtime_error naming the path if it cannot be read or has no step line.
nlohmann::json summarize_metrics(const std::string& metrics_jsonl);
/// The same from lines already open; `path` names them in errors.
nlohmann::json summarize_metrics_lines(std::istream& in, const std::string& path);

/// The summary of an MLflow run (`spec`: "mlflow:RUN_ID", or "mlflow:experiment/NAME" for the
/// experiment's latest finished run) on the tracking server `uri`, from its metrics' histories
/// (trainer/track/history.h) read back into the records summarize_metrics reads. It has one more field,
/// mlflow_run_id (a string, never compared). `exclude`: a run id that "experiment/NAME" passes over (the
/// run compared with it). Throws std::runtime_error naming the server and the run.
nlohmann::json summarize_mlflow_run(const std::string& spec, const std::string& uri, const std::string& exclude = "");

/// A summary from `path`: a run folder (its metrics.jsonl), a .jsonl file, an MLflow run ("mlflow:...",
/// on `mlflow_uri`, passing over run `exclude`), or a JSON object file (used as it is). Throws
/// std::runtime_error naming the path.
nlohmann::json load_summary(const std::string& path, const std::string& mlflow_uri = "", const std::string& exclude = "");

/// One metric of a comparison.
struct CompareRow {
  std::string metric;
  bool has_baseline = false, has_run = false;
  double baseline = 0, run = 0;
  bool judged = false;     ///< a tolerance exists and both sides have the metric
  bool higher_is_better = true;
  double threshold = 0;    ///< judged: the worst value still accepted
  std::string status;      ///< "ok", "improved", "REGRESSION", "info", "missing"
};

struct Comparison {
  std::vector<CompareRow> rows;  ///< sorted by metric name
  bool regression = false;       ///< at least one row is REGRESSION
  /// An aligned table: metric, baseline, run, change, limit, status (byte metrics in MiB/GiB).
  std::string table() const;
};

/// Compares every numeric top-level field of the two summaries (booleans and non-numbers skipped).
Comparison compare_summaries(const nlohmann::json& baseline, const nlohmann::json& run,
                             const Tolerances& tolerances = default_tolerances());

/// The `trainer compare` command line (argv[0] is "compare"). Prints the table; returns 0, or
/// kExitRegression on a regression. Throws std::runtime_error for bad input (the executable exits 2).
int compare_main(int argc, char** argv);

}  // namespace trainer
