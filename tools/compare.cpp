#include "tools/compare.h"

#include <spdlog/fmt/fmt.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tools/percentile.h"
#include "trainer/memory/backend.h"
#include "trainer/track/history.h"
#include "trainer/track/mlflow_client.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

// A small file's text; "" when it is not a regular file or cannot be read.
std::string read_text(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return "";
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string show(const std::string& metric, double v) {
  if (ends_with(metric, "_bytes")) return format_bytes(static_cast<int64_t>(std::llround(v)));
  return fmt::format("{:.6g}", v);
}

}  // namespace

Tolerances default_tolerances() {
  return {
      {"samples_per_s", {true, 0.10, 0}},
      {"tokens_per_s", {true, 0.10, 0}},
      {"step_time_p50_s", {false, 0.10, 0}},
      {"step_time_p90_s", {false, 0.20, 0}},
      {"peak_memory_bytes", {false, 0.05, 0}},
      {"final_loss", {false, 0.05, 0.02}},
      {"final_eval_loss", {false, 0.05, 0.02}},
      {"best_top1", {true, 0, 0.01}},
      {"final_top1", {true, 0, 0.01}},
  };
}

Tolerances load_tolerances(const std::string& path, Tolerances base) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const std::exception& e) {
    throw std::runtime_error("--tolerances " + path + ": cannot read the YAML file (" + e.what() + ")");
  }
  if (root.IsNull()) return base;
  if (!root.IsMap())
    throw std::runtime_error("--tolerances " + path + ": expected a mapping metric -> {better, rel, abs}");
  for (const auto& kv : root) {
    const std::string metric = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    auto where = [&](const std::string& key) { return "--tolerances " + path + ": " + metric + "." + key; };
    if (!v.IsMap()) throw std::runtime_error("--tolerances " + path + ": " + metric + " must be a mapping {better, rel, abs}");
    auto it = base.find(metric);
    Tolerance t = it != base.end() ? it->second : Tolerance{};
    bool has_better = it != base.end();
    for (const auto& f : v) {
      const std::string key = f.first.as<std::string>();
      if (key == "better") {
        const std::string b = f.second.as<std::string>();
        if (b != "higher" && b != "lower") throw std::runtime_error(where(key) + ": '" + b + "' is not higher or lower");
        t.higher_is_better = b == "higher";
        has_better = true;
      } else if (key == "rel" || key == "abs") {
        double x;
        try {
          x = f.second.as<double>();
        } catch (const std::exception&) {
          throw std::runtime_error(where(key) + ": not a number");
        }
        if (!(x >= 0) || !std::isfinite(x)) throw std::runtime_error(where(key) + ": must be a finite number >= 0");
        (key == "rel" ? t.rel : t.abs) = x;
      } else {
        throw std::runtime_error(where(key) + ": unknown key (expected better, rel, abs)");
      }
    }
    if (!has_better)
      throw std::runtime_error("--tolerances " + path + ": " + metric + " has no default; give better: higher or lower");
    base[metric] = t;
  }
  return base;
}

nlohmann::json summarize_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open the metrics file");
  return summarize_metrics_lines(in, path);
}

nlohmann::json summarize_metrics_lines(std::istream& in, const std::string& path) {
  std::vector<double> losses, sps, step_times;
  bool skip_next = true;  // the first step of a process pays for warm-up
  int64_t steps = 0, peak = -1, ooms = 0, eval_count = 0;
  double best_top1 = 0, final_top1 = 0, final_eval_loss = 0, wall = -1;
  std::vector<double> sps_all, step_times_all;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      continue;  // a line cut by a kill -9 mid-write
    }
    if (!j.is_object()) continue;
    if (j.contains("event")) {
      const std::string ev = j["event"].is_string() ? j["event"].get<std::string>() : "";
      if (ev == "start" || ev == "resume") skip_next = true;
      else if (ev == "oom") ++ooms;
      else if (ev == "end" && j.contains("seconds") && j["seconds"].is_number()) wall = j["seconds"].get<double>();
      else if (ev == "eval" && j.contains("top1") && j["top1"].is_number()) {
        final_top1 = j["top1"].get<double>();
        best_top1 = eval_count == 0 ? final_top1 : std::max(best_top1, final_top1);
        if (j.contains("loss") && j["loss"].is_number()) final_eval_loss = j["loss"].get<double>();
        ++eval_count;
      }
      continue;
    }
    if (!j.contains("step") || !j["step"].is_number()) continue;
    steps = j["step"].get<int64_t>();
    if (j.contains("loss") && j["loss"].is_number() && std::isfinite(j["loss"].get<double>()))
      losses.push_back(j["loss"].get<double>());
    if (j.contains("mem_peak_bytes") && j["mem_peak_bytes"].is_number())
      peak = std::max(peak, j["mem_peak_bytes"].get<int64_t>());
    const bool has_sps = j.contains("samples_per_s") && j["samples_per_s"].is_number();
    const bool has_time = j.contains("step_time_s") && j["step_time_s"].is_number();
    if (has_sps) sps_all.push_back(j["samples_per_s"].get<double>());
    if (has_time) step_times_all.push_back(j["step_time_s"].get<double>());
    if (!skip_next) {
      if (has_sps) sps.push_back(j["samples_per_s"].get<double>());
      if (has_time) step_times.push_back(j["step_time_s"].get<double>());
    }
    skip_next = false;
  }
  if (steps == 0 && losses.empty()) throw std::runtime_error(path + ": no step lines (is it a trainer metrics.jsonl?)");
  if (sps.empty()) sps = sps_all;
  if (step_times.empty()) step_times = step_times_all;
  nlohmann::json s;
  s["steps"] = steps;
  if (!losses.empty()) {
    const size_t n = std::min<size_t>(20, losses.size());
    double sum = 0;
    for (size_t i = losses.size() - n; i < losses.size(); ++i) sum += losses[i];
    s["final_loss"] = sum / static_cast<double>(n);
  }
  if (!sps.empty()) s["samples_per_s"] = percentile(sps, 50);
  if (!step_times.empty()) {
    s["step_time_p50_s"] = percentile(step_times, 50);
    s["step_time_p90_s"] = percentile(step_times, 90);
  }
  if (peak >= 0) s["peak_memory_bytes"] = peak;
  if (eval_count > 0) {
    s["best_top1"] = best_top1;
    s["final_top1"] = final_top1;
    s["final_eval_loss"] = final_eval_loss;
  }
  s["oom_events"] = ooms;
  if (wall >= 0) s["wall_time_s"] = wall;
  return s;
}

nlohmann::json summarize_mlflow_run(const std::string& spec, const std::string& uri, const std::string& exclude) {
  if (uri.empty())
    throw std::runtime_error(spec + ": no tracking server: set MLFLOW_TRACKING_URI or pass --mlflow-uri URI");
  if (const std::string why = track::check_tracking_uri(uri); !why.empty()) throw std::runtime_error("--mlflow-uri: " + why);
  track::MlflowClient client(uri);
  const std::string run_id = track::resolve_run(client, spec.substr(std::string("mlflow:").size()), exclude);
  std::stringstream lines;
  for (const auto& record : track::records_from_history(track::read_history(client, run_id))) lines << record.dump() << '\n';
  nlohmann::json s = summarize_metrics_lines(lines, spec + " (run " + run_id + " on " + uri + ")");
  s["mlflow_run_id"] = run_id;  // not a number: shown by --summarize, never compared
  return s;
}

nlohmann::json load_summary(const std::string& path, const std::string& mlflow_uri, const std::string& exclude) {
  if (path.rfind("mlflow:", 0) == 0) return summarize_mlflow_run(path, mlflow_uri, exclude);
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path m = fs::path(path) / "metrics.jsonl";
    if (!fs::exists(m)) throw std::runtime_error(path + ": a folder without metrics.jsonl (not a run folder?)");
    return summarize_metrics(m.string());
  }
  if (!fs::exists(path, ec)) throw std::runtime_error(path + ": no such file or folder");
  if (ends_with(path, ".jsonl")) return summarize_metrics(path);
  std::ifstream in(path);  // read once, as a stream: `<(trainer compare --summarize RUN)` works
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": not a JSON summary (" + e.what() + "); pass a run folder or metrics.jsonl to "
                             "summarize a run");
  }
  if (!j.is_object()) throw std::runtime_error(path + ": a summary must be a JSON object of metric: number");
  return j;
}

Comparison compare_summaries(const nlohmann::json& baseline, const nlohmann::json& run, const Tolerances& tolerances) {
  std::set<std::string> names;
  auto numeric = [](const nlohmann::json& j, const std::string& k) {
    return j.contains(k) && j[k].is_number() && !j[k].is_boolean();
  };
  for (const auto& j : {std::cref(baseline), std::cref(run)})
    for (const auto& [k, v] : j.get().items())
      if (v.is_number() && !v.is_boolean()) names.insert(k);
  Comparison c;
  for (const auto& name : names) {
    CompareRow r;
    r.metric = name;
    r.has_baseline = numeric(baseline, name);
    r.has_run = numeric(run, name);
    if (r.has_baseline) r.baseline = baseline[name].get<double>();
    if (r.has_run) r.run = run[name].get<double>();
    auto tol = tolerances.find(name);
    if (tol == tolerances.end()) {
      r.status = "info";
    } else if (!r.has_baseline || !r.has_run) {
      r.status = "missing";
    } else {
      const Tolerance& t = tol->second;
      r.judged = true;
      r.higher_is_better = t.higher_is_better;
      const double allowed = std::max(t.rel * std::abs(r.baseline), t.abs);
      r.threshold = t.higher_is_better ? r.baseline - allowed : r.baseline + allowed;
      const double gain = t.higher_is_better ? r.run - r.baseline : r.baseline - r.run;  // > 0: better
      if (!std::isfinite(r.run) || -gain > allowed) {
        r.status = "REGRESSION";
        c.regression = true;
      } else if (gain > allowed) {
        r.status = "improved";
      } else {
        r.status = "ok";
      }
    }
    c.rows.push_back(r);
  }
  return c;
}

std::string Comparison::table() const {
  std::vector<std::array<std::string, 6>> cells;
  cells.push_back({"metric", "baseline", "run", "change", "limit", "status"});
  for (const auto& r : rows) {
    std::string change = "-";
    if (r.has_baseline && r.has_run) {
      if (r.baseline != 0) change = fmt::format("{:+.2f}%", 100.0 * (r.run - r.baseline) / std::abs(r.baseline));
      else change = fmt::format("{:+.4g}", r.run - r.baseline);
    }
    std::string limit = "-";
    if (r.judged) limit = (r.higher_is_better ? ">= " : "<= ") + show(r.metric, r.threshold);
    std::string status = r.status;
    if (r.status == "REGRESSION") status += r.higher_is_better ? " (lower is worse)" : " (higher is worse)";
    cells.push_back({r.metric, r.has_baseline ? show(r.metric, r.baseline) : "-", r.has_run ? show(r.metric, r.run) : "-",
                     change, limit, status});
  }
  std::array<size_t, 6> w{};
  for (const auto& row : cells)
    for (size_t i = 0; i < 6; ++i) w[i] = std::max(w[i], row[i].size());
  std::string out;
  for (size_t n = 0; n < cells.size(); ++n) {
    const auto& row = cells[n];
    // The metric name left-aligned, numbers right-aligned, status last and left-aligned.
    out += fmt::format("{:<{}}  {:>{}}  {:>{}}  {:>{}}  {:>{}}  {}\n", row[0], w[0], row[1], w[1], row[2], w[2],
                       row[3], w[3], row[4], w[4], row[5]);
    if (n == 0) out += std::string(w[0] + w[1] + w[2] + w[3] + w[4] + 10 + w[5], '-') + "\n";
  }
  return out;
}

int compare_main(int argc, char** argv) {
  const std::string usage =
      "usage: trainer compare BASELINE RUN [--tolerances FILE.yaml] [--json] [--mlflow-uri URI]\n"
      "       trainer compare --summarize RUN [--mlflow-uri URI]\n"
      "BASELINE and RUN: a summary JSON file (e.g. from the benchmark harness), a metrics.jsonl, a run folder,\n"
      "or an MLflow run: mlflow:RUN_ID, or mlflow:experiment/NAME for the experiment's latest finished run, on\n"
      "the server --mlflow-uri names (default: MLFLOW_TRACKING_URI).\n"
      "Exit codes: 0 no regression, 5 a metric regressed beyond its tolerance, 2 bad input.\n"
      "Default tolerances and the tolerance file format: docs/OPERATIONS.md.\n";
  std::vector<std::string> positional;
  std::string tolerances_path, summarize;
  const char* env_uri = std::getenv("MLFLOW_TRACKING_URI");
  std::string mlflow_uri = env_uri != nullptr ? env_uri : "";
  bool as_json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << usage;
      return 0;
    } else if (a == "--tolerances" && i + 1 < argc) {
      tolerances_path = argv[++i];
    } else if (a.rfind("--tolerances=", 0) == 0) {
      tolerances_path = a.substr(13);
    } else if (a == "--summarize" && i + 1 < argc) {
      summarize = argv[++i];
    } else if (a == "--mlflow-uri" && i + 1 < argc) {
      mlflow_uri = argv[++i];
    } else if (a.rfind("--mlflow-uri=", 0) == 0) {
      mlflow_uri = a.substr(13);
    } else if (a == "--json") {
      as_json = true;
    } else if (!a.empty() && a[0] == '-') {
      throw std::runtime_error("compare: unknown option '" + a + "'\n" + usage);
    } else {
      positional.push_back(a);
    }
  }
  if (!summarize.empty()) {
    std::cout << load_summary(summarize, mlflow_uri).dump(2) << std::endl;
    return 0;
  }
  if (positional.size() != 2) throw std::runtime_error("compare: expected BASELINE and RUN\n" + usage);
  const Tolerances tol = tolerances_path.empty() ? default_tolerances() : load_tolerances(tolerances_path);
  const nlohmann::json run = load_summary(positional[1], mlflow_uri);
  // The run's own MLflow run (a run folder's mlflow.json) is never its baseline.
  const nlohmann::json own = nlohmann::json::parse(read_text((fs::path(positional[1]) / "mlflow.json").string()), nullptr, false);
  const nlohmann::json base = load_summary(positional[0], mlflow_uri, own.is_object() ? own.value("run_id", "") : "");
  const Comparison c = compare_summaries(base, run, tol);
  if (as_json) {
    nlohmann::json out = {{"regression", c.regression}, {"metrics", nlohmann::json::array()}};
    for (const auto& r : c.rows) {
      nlohmann::json m = {{"metric", r.metric}, {"status", r.status}};
      if (r.has_baseline) m["baseline"] = r.baseline;
      if (r.has_run) m["run"] = r.run;
      if (r.judged) m["limit"] = r.threshold;
      out["metrics"].push_back(m);
    }
    std::cout << out.dump(2) << std::endl;
  } else {
    auto named = [](const std::string& arg, const nlohmann::json& summary) {  // an MLflow run: which one
      return summary.contains("mlflow_run_id") ? arg + " (run " + summary["mlflow_run_id"].get<std::string>() + ")" : arg;
    };
    std::cout << "baseline: " << named(positional[0], base) << "\nrun:      " << named(positional[1], run) << "\n\n"
              << c.table();
    int n = 0;
    for (const auto& r : c.rows) n += r.status == "REGRESSION";
    std::cout << "\n" << (c.regression ? fmt::format("REGRESSION: {} metric(s) beyond tolerance", n) : "no regression")
              << std::endl;
  }
  return c.regression ? kExitRegression : 0;
}

}  // namespace trainer
