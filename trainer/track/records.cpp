#include "trainer/track/records.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <stdexcept>

namespace trainer::track {

namespace {

// The step line's keys that go to MLflow, under the same names.
const char* const kStepKeys[] = {"loss",         "lr",          "grad_norm",       "samples_per_s", "tokens_per_s",
                                 "step_time_s",  "data_wait_s", "micro_batch",     "accum_steps",   "mem_peak_bytes",
                                 "mem_limit_bytes", "rss_bytes", "oom_retries",    "loss_scale",    "model_flops_per_s",
                                 "epoch",        "samples_seen"};

// MLflow's limits (mlflow/utils/validation.py): per log-batch request, and a param value's length.
constexpr size_t kMaxMetrics = 1000, kMaxParams = 100, kMaxTags = 100, kMaxItems = 1000;
constexpr size_t kMaxParamValue = 6000;

bool number(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() && !it->is_boolean();
}

std::string event_of(const nlohmann::json& record) {
  const auto it = record.find("event");
  return it != record.end() && it->is_string() ? it->get<std::string>() : "";
}

void flatten(const YAML::Node& node, const std::string& prefix, std::map<std::string, std::string>& out) {
  if (node.IsMap()) {
    for (const auto& kv : node) flatten(kv.second, prefix.empty() ? kv.first.as<std::string>() : prefix + "." + kv.first.as<std::string>(), out);
    return;
  }
  std::string value;
  if (node.IsScalar()) {
    value = node.as<std::string>();
  } else if (node.IsSequence()) {
    YAML::Emitter e;
    e << YAML::Flow << node;
    value = e.c_str();
  } else {
    value = "";  // null
  }
  if (value.size() > kMaxParamValue) value.resize(kMaxParamValue);
  out[prefix] = value;
}

nlohmann::json key_values(const std::map<std::string, std::string>& m, std::map<std::string, std::string>::const_iterator& it,
                          size_t n) {
  nlohmann::json a = nlohmann::json::array();
  for (; it != m.end() && a.size() < n; ++it) a.push_back({{"key", it->first}, {"value", it->second}});
  return a;
}

}  // namespace

std::vector<Metric> metrics_of_record(const nlohmann::json& record, int64_t timestamp_ms) {
  std::vector<Metric> out;
  if (!record.is_object() || !number(record, "step")) return out;
  const int64_t step = record["step"].get<int64_t>();
  auto add = [&](const std::string& key, const char* field) {
    if (number(record, field)) out.push_back({key, record[field].get<double>(), step, timestamp_ms});
  };
  const std::string event = event_of(record);
  if (!record.contains("event")) {
    for (const char* k : kStepKeys) add(k, k);
  } else if (event == "eval") {
    add("eval_loss", "loss");
    add("eval_top1", "top1");
    add("eval_top5", "top5");
    add("eval_ema_loss", "ema_loss");  // train.ema_decay: the averaged weights' figures
    add("eval_ema_top1", "ema_top1");
    add("eval_ema_top5", "ema_top5");
  } else if (event == "resume") {
    add("resumed_at_step", "step");
  } else if (event == "end") {
    add("wall_time_s", "seconds");
  }
  return out;
}

std::string status_of_exit_code(int exit_code) {
  if (exit_code == 0) return "FINISHED";
  if (exit_code == 128 + SIGINT || exit_code == 128 + SIGTERM) return "KILLED";
  return "FAILED";
}

nlohmann::json metric_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

std::map<std::string, std::string> params_of_yaml(const std::string& yaml_text) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(std::string("the resolved config is not YAML (") + e.what() + ")");
  }
  std::map<std::string, std::string> out;
  if (root.IsMap()) flatten(root, "", out);
  return out;
}

std::vector<nlohmann::json> log_batch_bodies(const std::string& run_id, const std::vector<Metric>& metrics,
                                             const std::map<std::string, std::string>& params,
                                             const std::map<std::string, std::string>& tags) {
  std::vector<nlohmann::json> bodies;
  auto p = params.begin();
  auto t = tags.begin();
  size_t m = 0;
  while (p != params.end() || t != tags.end() || m < metrics.size()) {
    nlohmann::json body = {{"run_id", run_id}};
    body["params"] = key_values(params, p, kMaxParams);
    body["tags"] = key_values(tags, t, kMaxTags);
    nlohmann::json ms = nlohmann::json::array();
    const size_t room = std::min(kMaxMetrics, kMaxItems - body["params"].size() - body["tags"].size());
    for (; m < metrics.size() && ms.size() < room; ++m)
      ms.push_back({{"key", metrics[m].key}, {"value", metric_value(metrics[m].value)},
                    {"timestamp", metrics[m].timestamp_ms}, {"step", metrics[m].step}});
    body["metrics"] = std::move(ms);
    bodies.push_back(std::move(body));
  }
  return bodies;
}

void StepFilter::seen(const std::string& key, int64_t step) {
  auto [it, fresh] = last_.emplace(key, step);
  if (!fresh) it->second = std::max(it->second, step);
}

bool StepFilter::keep(const Metric& m) {
  auto it = last_.find(m.key);
  if (it != last_.end() && m.step <= it->second) return false;
  last_[m.key] = m.step;
  return true;
}

std::vector<nlohmann::json> records_from_history(const std::map<std::string, std::vector<Metric>>& history) {
  // Ordered by (step, rank in the step): a resume of step s comes before step s + 1's line, a step's eval
  // after its line, the end after everything.
  std::map<std::pair<int64_t, int>, nlohmann::json> at;
  auto record = [&](int64_t step, int rank, nlohmann::json init) -> nlohmann::json& {
    auto [it, fresh] = at.emplace(std::make_pair(step, rank), std::move(init));
    return it->second;
  };
  int64_t last_step = 0;
  for (const auto& [key, values] : history) {
    for (const Metric& m : values) {
      last_step = std::max(last_step, m.step);
      if (key == "resumed_at_step") {
        record(m.step, 0, {{"event", "resume"}, {"step", m.step}});
      } else if (key.rfind("eval_", 0) == 0) {
        record(m.step, 2, {{"event", "eval"}, {"step", m.step}})[key.substr(5)] = m.value;
      } else if (key != "wall_time_s" && std::find_if(std::begin(kStepKeys), std::end(kStepKeys), [&](const char* k) {
                   return key == k;
                 }) != std::end(kStepKeys)) {
        record(m.step, 1, {{"step", m.step}})[key] = m.value;
      }
    }
  }
  std::vector<nlohmann::json> out = {{{"event", "start"}}};
  for (auto& [k, r] : at) out.push_back(std::move(r));
  const auto wall = history.find("wall_time_s");
  if (wall != history.end() && !wall->second.empty())
    out.push_back({{"event", "end"}, {"step", last_step}, {"seconds", wall->second.back().value}});
  return out;
}

double retry_delay_s(int attempt, double max_s) {
  return std::min(max_s, 0.5 * std::pow(2.0, std::min(attempt, 30)));
}

}  // namespace trainer::track
