#include "trainer/track/tracker.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/files.h"
#include "trainer/track/mlflow_client.h"

namespace trainer::track {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStateFile = "mlflow.json";

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The path of a run's artifact folder under the server's mlflow-artifacts/artifacts/ ("1/<run id>/artifacts")
// from its artifact_uri ("mlflow-artifacts:/1/<run id>/artifacts", or "mlflow-artifacts://host:port/1/..."):
// "" for a store the tracking server does not proxy (s3://, a local path).
std::string proxied_artifact_path(const std::string& artifact_uri) {
  const std::string scheme = "mlflow-artifacts:";
  if (artifact_uri.rfind(scheme, 0) != 0) return "";
  std::string rest = artifact_uri.substr(scheme.size());
  if (rest.rfind("//", 0) == 0) {  // with a host: skip it
    const auto slash = rest.find('/', 2);
    rest = slash == std::string::npos ? "" : rest.substr(slash);
  }
  while (!rest.empty() && rest.front() == '/') rest.erase(0, 1);
  return rest;
}

// An int64 of MLflow's JSON: a number, or a string of one (protobuf's JSON mapping of int64).
int64_t int64_of(const nlohmann::json& j) {
  if (j.is_number()) return j.get<int64_t>();
  if (j.is_string()) return std::stoll(j.get<std::string>());
  return 0;
}

std::string string_at(const nlohmann::json& j, const nlohmann::json::json_pointer& p) {
  return j.contains(p) && j.at(p).is_string() ? j.at(p).get<std::string>() : "";
}

}  // namespace

MlflowTracker::MlflowTracker(TrackerOptions options) : o_(std::move(options)) {
  client_ = std::make_unique<MlflowClient>(o_.uri, o_.request_timeout_s);
  client_->set_abort_flag(&abort_);
  thread_ = std::thread([this] { loop(); });
}

MlflowTracker::~MlflowTracker() { close(); }

void MlflowTracker::observe(const nlohmann::json& record) {
  std::vector<Metric> ms = metrics_of_record(record, now_ms());
  const bool final_eval = record.is_object() && record.value("event", nlohmann::json()) == "eval" &&
                          record.value("final", false);
  if (ms.empty() && !final_eval) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || stats_.disabled) return;
  for (auto& m : ms) queue_.push_back(std::move(m));
  while (queue_.size() > o_.max_queued) {
    queue_.pop_front();
    ++stats_.dropped;
  }
  if (final_eval) artifacts_.push_back({"final_eval.json", record.dump(2) + "\n"});
  cv_.notify_all();
}

void MlflowTracker::set_tags(const std::map<std::string, std::string>& tags) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || stats_.disabled) return;
  for (const auto& [key, value] : tags) new_tags_[key] = value;
}

void MlflowTracker::end(int exit_code) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = status_of_exit_code(exit_code);
}

void MlflowTracker::close() {
  if (!thread_.joinable()) return;  // closed already
  {
    std::unique_lock<std::mutex> lock(mu_);
    closing_ = true;
    cv_.notify_all();
    // The thread sends what is left; past the deadline its request in flight is abandoned.
    if (!cv_.wait_for(lock, std::chrono::duration<double>(o_.close_timeout_s), [this] { return closed_; })) {
      abort_ = true;
      cv_.notify_all();
    }
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  const TrackerStats& s = stats_;
  if (s.run_id.empty()) return;  // the warning said why
  std::string line = fmt::format("mlflow: run {} ({}): {} metrics sent", s.run_id, status_, s.sent);
  if (s.skipped > 0) line += fmt::format(", {} already there from before the resume", s.skipped);
  if (s.dropped > 0) {
    spdlog::warn("{}, {} lost while the server was away or refused them (metrics.jsonl has every one)", line, s.dropped);
  } else {
    spdlog::info("{}", line);
  }
}

TrackerStats MlflowTracker::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MlflowTracker::loop() {
  bool connected = false;
  for (;;) {
    bool closing = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stats_.disabled || abort_) break;
      // Between two requests: at most one log-batch a send_every_s, unless the run is ending.
      if (connected && !closing_)
        cv_.wait_for(lock, std::chrono::duration<double>(o_.send_every_s), [this] { return closing_ || abort_.load(); });
      closing = closing_;
    }
    if (!connected) connected = connect();
    const bool ok = connected && send_pending();
    // At the end a server that failed once more is not waited for: what is queued is lost (counted).
    if (!ok && closing) break;
    if (!ok) {
      wait_for(retry_delay_s(attempt_ - 1, o_.retry_max_s));
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (closing && queue_.empty() && artifacts_.empty() && new_tags_.empty()) break;
  }
  if (connected && !abort_) send_status();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.dropped += static_cast<int64_t>(queue_.size() + batch_.size());
  queue_.clear();
  closed_ = true;
  cv_.notify_all();
}

void MlflowTracker::wait_for(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return closing_ || abort_.load(); });
}

bool MlflowTracker::handle_failure(const std::string& what, const MlflowResponse& r) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.failures;
  }
  if (r.refused()) {
    disable("the server refused the login (" + r.error + "; MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD)");
    return false;
  }
  if (!r.retryable()) {
    if (r.status == 404 && r.error_code.empty()) {
      disable(o_.uri + " is not an MLflow tracking server (" + what + ": " + r.error + ")");
      return false;
    }
    return true;  // the request itself was refused: the caller drops it
  }
  ++attempt_;
  if (!warned_ && r.error != "aborted")
    spdlog::warn("mlflow: {} failed at {} ({}); training goes on, and the tracker tries again (metrics.jsonl has "
                 "every record)",
                 what, o_.uri, r.error);
  warned_ = true;
  return false;
}

void MlflowTracker::disable(const std::string& why) {
  spdlog::warn("mlflow: {}; this run is not tracked", why);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.disabled = true;
  stats_.dropped += static_cast<int64_t>(queue_.size());
  queue_.clear();
}

bool MlflowTracker::connect() {
  if (!find_experiment() || !open_run()) return false;
  if (warned_) spdlog::info("mlflow: {} answers again", o_.uri);
  warned_ = false;
  attempt_ = 0;
  return true;
}

bool MlflowTracker::find_experiment() {
  if (!stats().experiment_id.empty()) return true;
  MlflowResponse r = client_->get("experiments/get-by-name", "experiment_name=" + MlflowClient::encode(o_.experiment));
  if (r.error_code == "RESOURCE_DOES_NOT_EXIST") {
    r = client_->post("experiments/create", {{"name", o_.experiment}});
    // Another job made it first: read it.
    if (r.error_code == "RESOURCE_ALREADY_EXISTS")
      r = client_->get("experiments/get-by-name", "experiment_name=" + MlflowClient::encode(o_.experiment));
  }
  if (!r.ok()) {
    if (handle_failure("finding the experiment '" + o_.experiment + "'", r)) disable("the experiment '" + o_.experiment + "': " + r.error);
    return false;
  }
  std::string id = string_at(r.body, nlohmann::json::json_pointer("/experiment_id"));
  if (id.empty()) id = string_at(r.body, nlohmann::json::json_pointer("/experiment/experiment_id"));
  std::lock_guard<std::mutex> lock(mu_);
  stats_.experiment_id = id;
  return true;
}

bool MlflowTracker::open_run() {
  if (!stats().run_id.empty()) return true;
  const fs::path state = fs::path(o_.run_dir) / kStateFile;
  nlohmann::json saved = nlohmann::json::parse(read_file(state), nullptr, false);
  if (saved.is_object() && saved.value("tracking_uri", "") == o_.uri && !saved.value("run_id", "").empty())
    return resume_run(saved["run_id"].get<std::string>());
  if (saved.is_object())
    spdlog::warn("mlflow: {} names a run on {}, not on {}: a new MLflow run starts", state.string(),
                 saved.value("tracking_uri", "?"), o_.uri);
  return create_run();
}

bool MlflowTracker::create_run() {
  nlohmann::json tags = nlohmann::json::array();
  for (const auto& [k, v] : o_.tags) tags.push_back({{"key", k}, {"value", v}});
  const MlflowResponse r = client_->post("runs/create", {{"experiment_id", stats().experiment_id},
                                                         {"run_name", o_.run_name},
                                                         {"start_time", now_ms()},
                                                         {"tags", tags}});
  if (!r.ok()) {
    if (handle_failure("creating a run", r)) disable("creating a run: " + r.error);
    return false;
  }
  const std::string id = string_at(r.body, nlohmann::json::json_pointer("/run/info/run_id"));
  artifact_path_ = proxied_artifact_path(string_at(r.body, nlohmann::json::json_pointer("/run/info/artifact_uri")));
  try {
    write_file_atomically((fs::path(o_.run_dir) / kStateFile).string(),
                          nlohmann::json{{"tracking_uri", o_.uri}, {"experiment_id", stats().experiment_id}, {"run_id", id}}
                                  .dump(2) + "\n",
                          "mlflow");
  } catch (const std::exception& e) {
    spdlog::warn("mlflow: {}: a resumed process starts another MLflow run", e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.run_id = id;
  }
  spdlog::info("mlflow: run {} in experiment '{}' on {}", id, o_.experiment, o_.uri);
  log_run_settings(true);
  return true;
}

bool MlflowTracker::resume_run(const std::string& run_id) {
  const MlflowResponse r = client_->get("runs/get", "run_id=" + MlflowClient::encode(run_id));
  const bool gone = r.error_code == "RESOURCE_DOES_NOT_EXIST" ||
                    (r.ok() && string_at(r.body, nlohmann::json::json_pointer("/run/info/lifecycle_stage")) == "deleted");
  if (gone) {
    spdlog::warn("mlflow: run {} (from {}) is gone from {}: a new MLflow run starts", run_id, kStateFile, o_.uri);
    return create_run();
  }
  if (!r.ok()) {
    if (handle_failure("finding run " + run_id, r)) disable("finding run " + run_id + ": " + r.error);
    return false;
  }
  const auto metrics = nlohmann::json::json_pointer("/run/data/metrics");
  if (r.body.contains(metrics) && r.body.at(metrics).is_array())
    for (const auto& m : r.body.at(metrics))
      if (m.is_object() && m.contains("key") && m["key"].is_string() && m.contains("step"))
        filter_.seen(m["key"].get<std::string>(), int64_of(m["step"]));
  artifact_path_ = proxied_artifact_path(string_at(r.body, nlohmann::json::json_pointer("/run/info/artifact_uri")));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.run_id = run_id;
    stats_.resumed = true;
  }
  client_->post("runs/update", {{"run_id", run_id}, {"status", "RUNNING"}});
  spdlog::info("mlflow: run {} goes on in experiment '{}' on {}", run_id, o_.experiment, o_.uri);
  log_run_settings(false);
  return true;
}

// A new run gets the params and the resolved config; every process sets the tags (a resume may be on
// another host or device). Params are never sent again: MLflow refuses a changed value. They go first
// in send_pending(), tried again like metrics until the server takes them.
void MlflowTracker::log_run_settings(bool fresh) {
  settings_ = log_batch_bodies(stats().run_id, {}, fresh ? o_.params : decltype(o_.params){}, o_.tags);
  if (!fresh) return;
  const fs::path config = fs::path(o_.run_dir) / "resolved_config.yaml";
  std::lock_guard<std::mutex> lock(mu_);
  if (fs::exists(config)) artifacts_.insert(artifacts_.begin(), {"resolved_config.yaml", read_file(config)});
}

// One log-batch request; false when it is to be tried again (a failure the caller waits out).
bool MlflowTracker::post_batch(const nlohmann::json& body, const std::string& what, int64_t metrics) {
  const MlflowResponse r = client_->post("runs/log-batch", body);
  if (r.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.sent += metrics;
    return true;
  }
  if (!handle_failure("logging " + what, r)) return false;
  spdlog::warn("mlflow: the server refused {}: {}", what, r.error);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.dropped += metrics;
  return true;
}

bool MlflowTracker::send_pending() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!new_tags_.empty())
      for (auto& body : log_batch_bodies(stats_.run_id, {}, {}, new_tags_)) settings_.push_back(std::move(body));
    new_tags_.clear();
  }
  while (!settings_.empty()) {
    if (!post_batch(settings_.front(), "the run's params and tags", 0)) return false;
    settings_.erase(settings_.begin());
  }
  std::vector<Artifact> artifacts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The batch of a failed request is sent again as it is: filtered once, when it was taken.
    if (batch_.empty()) {
      while (!queue_.empty() && batch_.size() < 1000) {
        if (filter_.keep(queue_.front())) batch_.push_back(std::move(queue_.front()));
        else ++stats_.skipped;
        queue_.pop_front();
      }
    }
    artifacts.swap(artifacts_);
  }
  if (!batch_.empty()) {
    if (!post_batch(log_batch_bodies(stats().run_id, batch_).front(), "metrics", static_cast<int64_t>(batch_.size()))) {
      std::lock_guard<std::mutex> lock(mu_);
      artifacts_.insert(artifacts_.begin(), artifacts.begin(), artifacts.end());
      return false;
    }
    batch_.clear();
  }
  for (size_t i = 0; i < artifacts.size(); ++i) {
    if (upload(artifacts[i])) continue;
    std::lock_guard<std::mutex> lock(mu_);
    artifacts_.insert(artifacts_.begin(), artifacts.begin() + static_cast<std::ptrdiff_t>(i), artifacts.end());
    return false;
  }
  if (warned_) spdlog::info("mlflow: {} answers again", o_.uri);
  warned_ = false;
  attempt_ = 0;
  return true;
}

bool MlflowTracker::upload(const Artifact& a) {
  if (artifact_path_.empty()) {
    static std::once_flag once;
    std::call_once(once, [&] {
      spdlog::warn("mlflow: the run's artifact store is not served by {} (start the server with --serve-artifacts); "
                   "{} and other files stay in the run folder only", o_.uri, a.name);
    });
    return true;
  }
  const MlflowResponse r = client_->put_artifact(artifact_path_ + "/" + MlflowClient::encode(a.name), a.bytes);
  if (r.ok()) return true;
  if (handle_failure("uploading " + a.name, r)) {
    spdlog::warn("mlflow: the server refused the artifact {}: {}", a.name, r.error);
    return true;  // dropped
  }
  return false;
}

void MlflowTracker::send_status() {
  std::string status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = status_;
  }
  const MlflowResponse r = client_->post("runs/update", {{"run_id", stats().run_id}, {"status", status}, {"end_time", now_ms()}});
  if (!r.ok()) spdlog::warn("mlflow: the run's status ({}) was not set: {}", status, r.error);
}

}  // namespace trainer::track
