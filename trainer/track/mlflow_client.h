// MLflow's tracking server over its REST API (api/2.0/mlflow/...), from C++ through libcurl: the calls
// the trainer makes, each one request, with MLflow's own client's environment variables for the login.
//
//   experiments/get-by-name, experiments/create          the experiment a run goes in
//   runs/create, runs/get, runs/update, runs/search      the run: made, found again on resume, its status
//   runs/log-batch                                       params, tags and metrics (MLflow's per-request limits
//                                                        are kept by trainer/track/records.h's batches)
//   metrics/get-history                                  `trainer compare mlflow:...` reads a run back
//   mlflow-artifacts/artifacts/<path> (PUT)              a file into a run's proxied artifact store
//
// The login: MLFLOW_TRACKING_TOKEN (a bearer token) or MLFLOW_TRACKING_USERNAME and
// MLFLOW_TRACKING_PASSWORD (basic); MLFLOW_TRACKING_INSECURE_TLS=true skips the certificate check and
// MLFLOW_TRACKING_SERVER_CERT_PATH names a CA bundle, as MLflow's Python client reads them.
//
// No call throws for what the network or the server does: each returns an MlflowResponse that says what
// happened (transport error, HTTP status, MLflow's error_code), so that the caller decides between
// retrying, dropping and giving up. Not thread-safe: one client per thread.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <memory>
#include <string>

namespace trainer::track {

/// What one request came to.
struct MlflowResponse {
  long status = 0;            ///< HTTP status; 0 = no answer (the transport failed: see error)
  nlohmann::json body;        ///< the answer's JSON (null if it was not JSON)
  std::string error;          ///< one line: the transport error, or MLflow's "error_code: message"
  std::string error_code;     ///< MLflow's error_code ("RESOURCE_DOES_NOT_EXIST", ...) when it gave one
  bool ok() const { return status >= 200 && status < 300; }
  /// Worth another try later: no answer, a timeout, 429 or a 5xx.
  bool retryable() const { return status == 0 || status == 408 || status == 429 || status >= 500; }
  /// The server refused the login (401, 403): retrying cannot help.
  bool refused() const { return status == 401 || status == 403; }
};

/// "" when `uri` is one this client speaks to (http:// or https:// with a host); otherwise why not, one
/// line ("'databricks' is not an http(s) URI of a tracking server").
std::string check_tracking_uri(const std::string& uri);

class MlflowClient {
 public:
  /// `uri`: the tracking server, "http(s)://host[:port][/prefix]" (check_tracking_uri). `timeout_s`:
  /// the longest one request may take, connection included.
  explicit MlflowClient(std::string uri, double timeout_s = 30.0);
  ~MlflowClient();
  MlflowClient(const MlflowClient&) = delete;
  MlflowClient& operator=(const MlflowClient&) = delete;

  const std::string& uri() const { return uri_; }
  /// While `*flag` is true, a request in flight is abandoned within about 0.1 s (status 0, "aborted"):
  /// a tracker that must close by a deadline does not wait out a slow server. Null: never abandoned.
  void set_abort_flag(const std::atomic<bool>* flag) { abort_ = flag; }

  /// A JSON request to api/2.0/mlflow/<path>: POST with `body`, or GET with `query` (already encoded,
  /// without the '?').
  MlflowResponse post(const std::string& path, const nlohmann::json& body);
  MlflowResponse get(const std::string& path, const std::string& query);
  /// PUT `bytes` to api/2.0/mlflow-artifacts/artifacts/<artifact_path>.
  MlflowResponse put_artifact(const std::string& artifact_path, const std::string& bytes);

  /// `text` percent-encoded for a query string or a path segment (RFC 3986 unreserved kept).
  static std::string encode(const std::string& text);

 private:
  MlflowResponse request(const std::string& method, const std::string& url, const std::string& body,
                         const std::string& content_type);
  std::string uri_;
  double timeout_s_;
  void* curl_ = nullptr;  // CURL*, reused: one connection kept alive between requests
  const std::atomic<bool>* abort_ = nullptr;
};

}  // namespace trainer::track
