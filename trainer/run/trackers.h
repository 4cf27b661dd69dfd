// What observes the run, one part of TrainingRun (run.h): metrics.jsonl (MetricsLog), whose every record
// goes on to the telemetry, TensorBoard and MLflow; the telemetry and the HTTP endpoint that serves it
// (log.http_port); the memory reports; the resource monitor (the GPU's identity, utilization and the
// resources line). Made at setup; each step's record and the events of the loop go through them.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/log.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/report.h"
#include "trainer/memory/resources.h"
#include "trainer/observe/http.h"
#include "trainer/observe/telemetry.h"
#include "trainer/observe/tensorboard.h"
#include "trainer/run/ranks.h"
#include "trainer/run/train.h"
#include "trainer/track/tracker.h"

namespace trainer {

class Trackers {
 public:
  Trackers(const Config& cfg, const RunOptions& opts) : cfg_(cfg), opts_(opts) {}

  /// TensorBoard (rank 0), the metrics file's observer, the memory reports in this rank's folder, the HTTP
  /// endpoint, resolved_config.yaml (rank 0) and the first lines of the log.
  void setup_observers(const Ranks& ranks);
  /// The resource monitor of `device`, and what the telemetry labels its series with.
  void setup_resources(const torch::Device& device);
  /// log.mlflow (or MLFLOW_TRACKING_URI): the MLflow tracker, on rank 0 after setup_resources() (the GPU's
  /// UUID is a tag). A tracker that cannot be reached is a warning.
  void setup_tracking(const torch::Device& device, const Ranks& ranks);
  /// On a resume: the step lines and evaluations of `rank_dir`'s metrics.jsonl up to step `upto` handed
  /// to the tracker again. A killed process may have trained and checkpointed steps whose metrics were
  /// still queued for MLflow (its tracker sends a batch a second); the tracker sends only what MLflow
  /// lacks (StepFilter).
  void backfill_tracker(int64_t upto, const std::string& rank_dir);
  /// After each step: the telemetry's memory, every log.every steps the resources line, and a memory
  /// report when one was asked for (SIGUSR2, GET /memory).
  void observe_resources(int64_t step, MemoryBackend& memory);

  /// A setting the run changed from the config (memory.state auto): resolved_config.yaml is written again
  /// with it (rank 0), and MLflow's params, made later by setup_tracking, name the change
  /// ("memory.state.changed.<key>" = "float32 -> int8").
  void set_changed_setting(const std::string& key, const std::string& from, const std::string& to);

  MetricsLog& metrics() { return metrics_; }
  Telemetry& telemetry() { return telemetry_; }
  MemoryReporter* memory_report() const { return memory_report_.get(); }
  track::MlflowTracker* tracker() const { return tracker_.get(); }  ///< log.mlflow, rank 0 only; else null

 private:
  const Config& cfg_;
  const RunOptions& opts_;
  MetricsLog metrics_;
  Telemetry telemetry_;  // before http_: the server reads it until destroyed
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<MemoryReporter> memory_report_;  // after telemetry_, its sink: destroyed before it
  std::unique_ptr<ResourceMonitor> resources_;
  std::unique_ptr<TensorboardWriter> tensorboard_;
  std::unique_ptr<track::MlflowTracker> tracker_;  // log.mlflow, rank 0 only
  std::map<std::string, std::string> changed_;      // set_changed_setting's, as MLflow params
  bool main_rank_ = false;
  void write_resolved_config() const;  // rank 0
};

}  // namespace trainer
