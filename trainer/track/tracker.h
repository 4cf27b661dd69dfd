// One MLflow run per run folder, fed from the run's records on a thread of its own (log.mlflow;
// docs/OPERATIONS.md, "Tracking in MLflow").
//
//   observe(record)   the loop's side: the record's metrics (trainer/track/records.h) go into a bounded
//                     queue under one mutex; no I/O, no waiting on the server
//   the thread        finds or makes the experiment and the run, then sends what is queued in log-batch
//                     requests (at most one a second, each up to MLflow's limit)
//   end(exit code)    the run's final status; close() waits up to close_timeout_s for what is queued,
//                     then abandons the request in flight
//
// The run's id is kept in <run_dir>/mlflow.json, so a resumed process continues the same MLflow run; the
// steps that run already has (a resume from a checkpoint older than the last logged step retrains them,
// bit for bit) are not sent again (StepFilter).
//
// The tracker never stops training. A server that is down, slow or answers 5xx: its requests are tried
// again after 0.5 s doubling up to retry_max_s, with one warning when it fails and one line when it
// answers again; while it is away up to max_queued metrics wait, and the oldest are dropped past that
// (counted, and said at the end). A server that refuses the login (401, 403), a URI that is not an MLflow
// server, or an answer that says the request itself is wrong: one warning, and the run goes on without it.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "trainer/track/records.h"

namespace trainer::track {

class MlflowClient;

struct TrackerOptions {
  std::string uri;         ///< the tracking server (check_tracking_uri)
  std::string experiment;  ///< its name; made when missing
  std::string run_name;    ///< a new run's name (the run folder's)
  std::string run_dir;     ///< mlflow.json goes here; resolved_config.yaml is read from here
  std::map<std::string, std::string> params;  ///< a new run's params (the resolved config)
  std::map<std::string, std::string> tags;    ///< set on the run by every process (versions, host, device)
  size_t max_queued = 100000;     ///< metrics waiting for the server; the oldest dropped past this
  double request_timeout_s = 30;  ///< one request, connection included
  double close_timeout_s = 15;    ///< the longest close() waits for the server
  double retry_max_s = 30;        ///< the longest wait between two tries
  double send_every_s = 1;        ///< the least time between two log-batch requests
};

/// What the tracker has done so far.
struct TrackerStats {
  std::string run_id;         ///< "" until the run is found or made
  std::string experiment_id;
  bool resumed = false;       ///< the run existed (mlflow.json) and goes on
  bool disabled = false;      ///< given up for this process (login refused, not an MLflow server, ...)
  int64_t sent = 0;           ///< metrics the server took
  int64_t skipped = 0;        ///< metrics of steps the run already had (StepFilter)
  int64_t dropped = 0;        ///< metrics lost: the queue was full, the server refused them, or close() timed out
  int64_t failures = 0;       ///< requests that failed
};

class MlflowTracker {
 public:
  /// Starts the thread; never throws for what the server does (the first contact is the thread's).
  explicit MlflowTracker(TrackerOptions options);
  /// close() if it was not called.
  ~MlflowTracker();
  MlflowTracker(const MlflowTracker&) = delete;
  MlflowTracker& operator=(const MlflowTracker&) = delete;

  /// A metrics.jsonl record (MetricsLog's observer). Thread-safe, never blocks on the server. An eval
  /// record marked final is also uploaded as the artifact final_eval.json.
  void observe(const nlohmann::json& record);
  /// Tags set on the run during it (a setting memory.state auto changed mid-run: params cannot change).
  /// Thread-safe; sent with the next request, a later value of a key replacing the earlier one.
  void set_tags(const std::map<std::string, std::string>& tags);
  /// The process ends with `exit_code`: the run's status (status_of_exit_code) is sent at close().
  /// Without it, close() marks the run FAILED (the process is ending on an error).
  void end(int exit_code);
  /// Sends what is queued and the status, for at most close_timeout_s, then stops the thread and says
  /// in one line what was sent and what was lost. Idempotent.
  void close();
  TrackerStats stats() const;

 private:
  struct Artifact {
    std::string name, bytes;
  };
  void loop();
  bool connect();  // experiment and run; false: try again later
  bool find_experiment();
  bool open_run();
  bool create_run();
  bool resume_run(const std::string& run_id);
  void log_run_settings(bool fresh);
  bool send_pending();  // false: the server failed (retry later)
  bool post_batch(const nlohmann::json& body, const std::string& what, int64_t metrics);
  bool upload(const Artifact& a);
  void send_status();
  void wait_for(double seconds);  // cut short by close()
  bool handle_failure(const std::string& what, const struct MlflowResponse& r);
  void disable(const std::string& why);

  TrackerOptions o_;
  std::unique_ptr<MlflowClient> client_;
  std::atomic<bool> abort_{false};
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Metric> queue_;
  std::vector<Artifact> artifacts_;
  std::map<std::string, std::string> new_tags_;  // set_tags' not yet taken by the thread
  std::string status_ = "FAILED";
  bool closing_ = false;
  bool closed_ = false;
  TrackerStats stats_;

  // The thread's own state.
  StepFilter filter_;
  std::vector<nlohmann::json> settings_;  // params and tags not yet taken by the server
  std::vector<Metric> batch_;             // taken from queue_ and filtered; sent again until the server takes it
  std::string artifact_path_;  // the run's artifact folder under mlflow-artifacts/artifacts/; "" = none
  int attempt_ = 0;            // consecutive failures
  bool warned_ = false;        // the failure warning was given (until the server answers again)
};

}  // namespace trainer::track
