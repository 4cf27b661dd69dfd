#include "trainer/track/mlflow_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace trainer::track {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

bool env_true(const char* name) {
  const std::string v = env(name);
  return v == "1" || v == "true" || v == "True" || v == "TRUE" || v == "yes";
}

size_t append_body(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

// libcurl's progress callback: a non-zero return abandons the transfer.
int check_abort(void* flag, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const auto* abort = static_cast<const std::atomic<bool>*>(flag);
  return abort != nullptr && abort->load() ? 1 : 0;
}

// Python's json writes a non-finite float as the bare words NaN, Infinity and -Infinity, which are not
// JSON: outside strings they become null (a metric's value that was not a number).
std::string without_bare_non_finite(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    for (const char* word : {"-Infinity", "Infinity", "NaN"}) {
      const size_t n = std::strlen(word);
      if (text.compare(i, n, word) == 0) {
        out += "null";
        i += n;
        break;
      }
    }
    if (i < text.size()) out += text[i];
  }
  return out;
}

// MLflow answers an error as {"error_code": "...", "message": "..."}.
void read_answer(MlflowResponse& r, const std::string& text) {
  r.body = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (r.body.is_discarded()) r.body = nlohmann::json::parse(without_bare_non_finite(text), nullptr, false);
  if (r.body.is_discarded()) r.body = nullptr;
  if (r.ok()) return;
  if (r.body.is_object() && r.body.contains("error_code") && r.body["error_code"].is_string()) {
    r.error_code = r.body["error_code"].get<std::string>();
    const auto m = r.body.find("message");
    r.error = r.error_code + (m != r.body.end() && m->is_string() ? ": " + m->get<std::string>() : "");
  } else {
    r.error = "HTTP " + std::to_string(r.status) + (text.empty() ? "" : ": " + text.substr(0, 200));
  }
  for (char& c : r.error)
    if (c == '\n' || c == '\r') c = ' ';
}

}  // namespace

std::string check_tracking_uri(const std::string& uri) {
  const auto scheme_end = uri.find("://");
  const std::string scheme = scheme_end == std::string::npos ? "" : uri.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https")
    return "'" + uri + "' is not an http:// or https:// URI of an MLflow tracking server";
  const std::string rest = uri.substr(scheme_end + 3);
  if (rest.empty() || rest[0] == '/' || rest[0] == ':') return "'" + uri + "' names no host";
  return "";
}

MlflowClient::MlflowClient(std::string uri, double timeout_s) : uri_(std::move(uri)), timeout_s_(timeout_s) {
  while (!uri_.empty() && uri_.back() == '/') uri_.pop_back();
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  curl_ = curl_easy_init();
}

MlflowClient::~MlflowClient() {
  if (curl_ != nullptr) curl_easy_cleanup(static_cast<CURL*>(curl_));
}

std::string MlflowClient::encode(const std::string& text) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

MlflowResponse MlflowClient::post(const std::string& path, const nlohmann::json& body) {
  // Non-finite numbers as protobuf's JSON mapping spells them ("NaN", "Infinity"): records.cpp writes
  // them as strings already; dump() would write null, which MLflow refuses.
  return request("POST", uri_ + "/api/2.0/mlflow/" + path, body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                 "application/json");
}

MlflowResponse MlflowClient::get(const std::string& path, const std::string& query) {
  return request("GET", uri_ + "/api/2.0/mlflow/" + path + (query.empty() ? "" : "?" + query), "", "");
}

MlflowResponse MlflowClient::put_artifact(const std::string& artifact_path, const std::string& bytes) {
  return request("PUT", uri_ + "/api/2.0/mlflow-artifacts/artifacts/" + artifact_path, bytes,
                 "application/octet-stream");
}

MlflowResponse MlflowClient::request(const std::string& method, const std::string& url, const std::string& body,
                                     const std::string& content_type) {
  MlflowResponse r;
  auto* c = static_cast<CURL*>(curl_);
  if (c == nullptr) {
    r.error = "libcurl could not be initialized";
    return r;
  }
  curl_easy_reset(c);
  std::string answer;
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for name lookups: the loop's thread has handlers
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_s_ * 1000));
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min(timeout_s_, 10.0) * 1000));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, check_abort);
  curl_easy_setopt(c, CURLOPT_XFERINFODATA, const_cast<std::atomic<bool>*>(abort_));
  curl_easy_setopt(c, CURLOPT_USERAGENT, "trainer/" TRAINER_VERSION);
  if (method == "POST" || method == "PUT") {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  curl_slist* headers = nullptr;
  if (!content_type.empty()) headers = curl_slist_append(headers, ("Content-Type: " + content_type).c_str());
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip before a body
  const std::string token = env("MLFLOW_TRACKING_TOKEN");
  if (!token.empty()) headers = curl_slist_append(headers, ("Authorization: Bearer " + token).c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  const std::string user = env("MLFLOW_TRACKING_USERNAME"), password = env("MLFLOW_TRACKING_PASSWORD");
  if (token.empty() && !user.empty()) {
    curl_easy_setopt(c, CURLOPT_HTTPAUTH, CURLAUTH_BASIC);
    curl_easy_setopt(c, CURLOPT_USERNAME, user.c_str());
    curl_easy_setopt(c, CURLOPT_PASSWORD, password.c_str());
  }
  if (env_true("MLFLOW_TRACKING_INSECURE_TLS")) {
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
  }
  const std::string ca = env("MLFLOW_TRACKING_SERVER_CERT_PATH");
  if (!ca.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, ca.c_str());

  const CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  if (rc != CURLE_OK) {
    r.error = rc == CURLE_ABORTED_BY_CALLBACK ? "aborted" : curl_easy_strerror(rc);
    return r;
  }
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
  read_answer(r, answer);
  return r;
}

}  // namespace trainer::track
