#include "trainer/track/history.h"

#include <cmath>
#include <stdexcept>

#include "trainer/track/mlflow_client.h"

namespace trainer::track {

namespace {

nlohmann::json ok_or_throw(const MlflowResponse& r, const MlflowClient& client, const std::string& what) {
  if (!r.ok()) throw std::runtime_error("mlflow: " + what + " on " + client.uri() + ": " + r.error);
  return r.body;
}

double value_of(const nlohmann::json& j) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) return std::stod(j.get<std::string>());  // "NaN", "Infinity" as protobuf writes them
  return std::nan("");
}

int64_t int_of(const nlohmann::json& j) {
  if (j.is_number()) return j.get<int64_t>();
  if (j.is_string()) return std::stoll(j.get<std::string>());
  return 0;
}

}  // namespace

std::string resolve_run(MlflowClient& client, const std::string& spec, const std::string& exclude) {
  const std::string prefix = "experiment/";
  if (spec.rfind(prefix, 0) != 0) {
    if (spec.empty()) throw std::runtime_error("mlflow: no run id after 'mlflow:'");
    ok_or_throw(client.get("runs/get", "run_id=" + MlflowClient::encode(spec)), client, "run " + spec);
    return spec;
  }
  const std::string name = spec.substr(prefix.size());
  const nlohmann::json exp = ok_or_throw(
      client.get("experiments/get-by-name", "experiment_name=" + MlflowClient::encode(name)), client,
      "the experiment '" + name + "'");
  const std::string id = exp.at("experiment").at("experiment_id").get<std::string>();
  const nlohmann::json found = ok_or_throw(
      client.post("runs/search", {{"experiment_ids", {id}},
                                  {"filter", "attributes.status = 'FINISHED'"},
                                  {"order_by", {"attributes.end_time DESC"}},
                                  {"max_results", 2}}),
      client, "searching the experiment '" + name + "'");
  for (const auto& run : found.value("runs", nlohmann::json::array())) {
    const std::string id = run["info"]["run_id"].get<std::string>();
    if (id != exclude) return id;
  }
  throw std::runtime_error("mlflow: the experiment '" + name + "' on " + client.uri() + " has no finished run" +
                           (exclude.empty() ? "" : " but " + exclude + ", the one compared with it"));
}

std::map<std::string, std::vector<Metric>> read_history(MlflowClient& client, const std::string& run_id) {
  const nlohmann::json run =
      ok_or_throw(client.get("runs/get", "run_id=" + MlflowClient::encode(run_id)), client, "run " + run_id);
  std::map<std::string, std::vector<Metric>> out;
  const auto latest = nlohmann::json::json_pointer("/run/data/metrics");
  if (!run.contains(latest)) return out;
  for (const auto& m : run.at(latest)) {
    const std::string key = m.at("key").get<std::string>();
    std::vector<Metric>& values = out[key];
    std::string page;
    do {
      std::string query = "run_id=" + MlflowClient::encode(run_id) + "&metric_key=" + MlflowClient::encode(key) +
                          "&max_results=25000";
      if (!page.empty()) query += "&page_token=" + MlflowClient::encode(page);
      const nlohmann::json h = ok_or_throw(client.get("metrics/get-history", query), client,
                                            "the history of " + key + " in run " + run_id);
      for (const auto& v : h.value("metrics", nlohmann::json::array()))
        values.push_back({key, value_of(v.at("value")), int_of(v.value("step", nlohmann::json(0))),
                          int_of(v.value("timestamp", nlohmann::json(0)))});
      page = h.value("next_page_token", "");
    } while (!page.empty());
  }
  return out;
}

}  // namespace trainer::track
