// What a run's records become in MLflow, and back: pure functions, tested alone (tests/test_mlflow.cpp).
//
// metrics.jsonl record                         MLflow metrics (at the record's step)
//   step line                                  loss, lr, grad_norm, samples_per_s, tokens_per_s, step_time_s,
//                                              data_wait_s, micro_batch, accum_steps, mem_peak_bytes,
//                                              mem_limit_bytes, rss_bytes, oom_retries, loss_scale,
//                                              model_flops_per_s, epoch, samples_seen
//   {"event": "eval", loss, top1, top5}        eval_loss, eval_top1, eval_top5
//     (with EMA: ema_loss, ema_top1, ema_top5)  eval_ema_loss, eval_ema_top1, eval_ema_top5
//   {"event": "resume", step}                  resumed_at_step (its value: the step resumed from)
//   {"event": "end", seconds}                  wall_time_s
// and the run's status from the process's exit code: 0 FINISHED, 128 + SIGINT or SIGTERM KILLED (the job
// is stopped or rescheduled, and resumes), anything else FAILED.
//
// records_from_history() is the inverse for what `trainer compare` summarizes: step lines, eval, resume
// and end events, in the order a metrics.jsonl has them.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainer::track {

struct Metric {
  std::string key;
  double value = 0;
  int64_t step = 0;
  int64_t timestamp_ms = 0;  ///< Unix time in milliseconds
};

/// The metrics of one record (the table above); empty for a record that carries none.
std::vector<Metric> metrics_of_record(const nlohmann::json& record, int64_t timestamp_ms);

/// "FINISHED", "KILLED" or "FAILED" for a process that exits with `exit_code` (the list above).
std::string status_of_exit_code(int exit_code);

/// A metric's value as MLflow's JSON takes it: a number, or "NaN", "Infinity", "-Infinity" (protobuf's
/// JSON mapping of a double; JSON itself has no such numbers).
nlohmann::json metric_value(double v);

/// A YAML document's scalars as MLflow params: {"train": {"lr": 0.1}} gives "train.lr" = "0.1"; a
/// sequence is one param, its flow YAML ("[1, 2]"); a value longer than MLflow's 6000 characters is cut
/// there. Throws std::runtime_error for text that is not YAML.
std::map<std::string, std::string> params_of_yaml(const std::string& yaml_text);

/// The bodies of runs/log-batch for `run_id`, within MLflow's limits per request: at most 1000 metrics,
/// 100 params and 100 tags, 1000 items in all. Params and tags go first, in the order of their maps.
std::vector<nlohmann::json> log_batch_bodies(const std::string& run_id, const std::vector<Metric>& metrics,
                                             const std::map<std::string, std::string>& params = {},
                                             const std::map<std::string, std::string>& tags = {});

/// Keeps each metric key's steps once across resumes: after a resume from a checkpoint older than what
/// an earlier process logged, the steps up to that process's last are not sent again (the retrained
/// steps are bit for bit the same). `seen` starts from the MLflow run's latest step per key.
class StepFilter {
 public:
  /// The highest step already logged for `key` (a run's data.metrics from runs/get: key, step).
  void seen(const std::string& key, int64_t step);
  /// True if `m` is past what was logged for its key; the key's mark then moves to m.step.
  bool keep(const Metric& m);

 private:
  std::map<std::string, int64_t> last_;
};

/// The records that metrics_of_record() made `history` (key -> that metric's values) from, as far as
/// `trainer compare` reads them (tools/compare.h, summarize_metrics): one step line per step with the
/// step-line keys, eval events, a resume event before the first step after each resume, a start event
/// first and an end event last (when wall_time_s is there).
std::vector<nlohmann::json> records_from_history(const std::map<std::string, std::vector<Metric>>& history);

/// Seconds to wait before try `attempt` (0-based) of a request that failed: 0.5 s doubling up to `max_s`.
double retry_delay_s(int attempt, double max_s);

}  // namespace trainer::track
