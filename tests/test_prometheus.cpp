// deploy/prometheus and deploy/grafana against the real tools and a real training run: promtool checks
// the configs and unit-tests the alert rules; every metric name the rules and the dashboard read is one
// the trainer's /metrics serves; Debian's Prometheus scrapes a training run (the step rises from scrape to
// scrape, the rules evaluate, every dashboard query answers, the Kubernetes relabelling keeps the
// trainer's pod and drops the others).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <regex>
#include <set>
#include <thread>

#include "data/files/image_h5.h"
#include "http_client.h"
#include "test_util.h"
#include "train_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_prometheus {

using nlohmann::json;
using testutil::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kDeploy = testutil::source_dir() + "/deploy";
const std::string kRules = kDeploy + "/prometheus/trainer-rules.yml";
const std::string kRuleTests = kDeploy + "/prometheus/trainer-rules.test.yml";
const std::string kDashboard = kDeploy + "/grafana/trainer-dashboard.json";
/// The series of NVIDIA's DCGM exporter the rules and the dashboard may read beside the trainer's: in its
/// default counters (etc/default-counters.csv), labelled gpu, UUID, device, modelName, Hostname (and
/// GPU_I_PROFILE, GPU_I_ID on a MIG slice); the trainer's GPU series carry UUID and GPU_I_ID to join them.
const std::set<std::string> kDcgmSeries = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL",
                                           "DCGM_FI_DEV_XID_ERRORS"};

using testutil::seconds_since;

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
using testutil::free_port;
using testutil::http10_get;

std::string url_encode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') out += static_cast<char>(c);
    else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

/// A child process that is killed (SIGKILL) and reaped when the guard goes out of scope, whatever
/// assertion ended the test.
struct Child {
  pid_t pid = -1;
  std::string log;
  Child(const std::string& cmd, std::string log_path) : log(std::move(log_path)) { pid = testutil::spawn(cmd, log); }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      testutil::wait_exit(pid);
    }
  }
  /// Sends `sig` and waits; returns the exit code (or 128 + signal), -1 if it had already exited.
  int stop(int sig) {
    if (pid <= 0) return -1;
    ::kill(pid, sig);
    int code = testutil::wait_exit(pid);
    pid = -1;
    return code;
  }
  /// False once it exited (then it is reaped here, and the destructor leaves the pid alone).
  bool running() {
    if (pid <= 0) return false;
    if (waitpid(pid, nullptr, WNOHANG) == 0) return true;
    pid = -1;
    return false;
  }
  std::string output() const { return testutil::read_file(log); }
};

bool have_program(const std::string& name) { return testutil::run("command -v " + name).exit_code == 0; }

// ---- metric names in PromQL ---------------------------------------------------------------------------

/// The metric names a PromQL expression reads. Quoted strings (label values such as "$instance") are
/// removed first; then every identifier that starts with trainer_ is a trainer metric, wherever it
/// stands (before `{`, `[`, `)`, an operator or the end). Any other identifier directly followed by `{`
/// or `[` is a metric too and goes to `others` (e.g. Prometheus's own `up`), and so is every `DCGM_FI_`
/// name (NVIDIA's DCGM exporter's series) wherever it stands; function names (followed by
/// `(`), label names, keywords, durations and Grafana's `$variables` are not metrics.
std::set<std::string> trainer_metrics_in(const std::string& promql, std::set<std::string>* others = nullptr) {
  std::string s = promql;
  for (size_t i = 0; i < s.size(); ++i) {
    const char q = s[i];
    if (q != '"' && q != '\'' && q != '`') continue;
    size_t j = i + 1;
    while (j < s.size() && s[j] != q) j += (s[j] == '\\' && q != '`') ? 2 : 1;
    for (size_t k = i; k <= std::min(j, s.size() - 1); ++k) s[k] = ' ';
    i = j;
  }
  std::set<std::string> found;
  static const std::regex ident(R"([A-Za-z_:][A-Za-z0-9_:]*)");
  for (auto it = std::sregex_iterator(s.begin(), s.end(), ident); it != std::sregex_iterator(); ++it) {
    const size_t pos = static_cast<size_t>(it->position());
    const std::string name = it->str();
    if (pos > 0) {
      const char before = s[pos - 1];
      if (std::isalnum(static_cast<unsigned char>(before)) || before == '.' || before == '$') continue;  // 5m, 1e3, $var
    }
    if (name.rfind("trainer_", 0) == 0) {
      found.insert(name);
      continue;
    }
    size_t next = pos + name.size();
    while (next < s.size() && std::isspace(static_cast<unsigned char>(s[next]))) ++next;
    // NVIDIA's DCGM exporter's series are metrics wherever they stand (DCGM_FI_DEV_FB_USED / ...).
    if (others && (name.rfind("DCGM_FI_", 0) == 0 || (next < s.size() && (s[next] == '{' || s[next] == '['))))
      others->insert(name);
  }
  return found;
}

/// Every PromQL expression of the Grafana dashboard: each panel target's "expr", and the template
/// variables' queries (Grafana's label_values(metric, label) is read the same way).
void collect_dashboard_queries(const json& j, std::vector<std::string>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if ((it.key() == "expr" || it.key() == "query" || it.key() == "definition") && it->is_string())
        out.push_back(it->get<std::string>());
      else collect_dashboard_queries(*it, out);
    }
  } else if (j.is_array()) {
    for (const auto& e : j) collect_dashboard_queries(e, out);
  }
}

struct Rule {
  std::string name, expr;
};

std::vector<Rule> alert_rules() {
  std::vector<Rule> out;
  YAML::Node doc = YAML::LoadFile(kRules);
  for (const auto& g : doc["groups"])
    for (const auto& r : g["rules"]) out.push_back({r["alert"].as<std::string>(""), r["expr"].as<std::string>()});
  return out;
}

/// The names /metrics serves (the sample lines' names).
std::set<std::string> exported_names(const std::string& exposition) {
  std::set<std::string> names;
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    names.insert(line.substr(0, line.find_first_of("{ ")));
  }
  return names;
}

/// The value of the first sample of `name` in an exposition; NaN if absent.
double exported_value(const std::string& exposition, const std::string& name) {
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name, 0) == 0 && line.size() > name.size() && (line[name.size()] == ' ' || line[name.size()] == '{'))
      return std::stod(line.substr(line.rfind(' ') + 1));
  return std::nan("");
}

// ---- a training run to scrape ---------------------------------------------------------------------------

/// Small HDF5 splits (1x16x16, 10 classes) so the run evaluates: trainer_eval_* exist only after an
/// evaluation.
void write_dataset(const fs::path& dir) {
  torch::manual_seed(3);
  data::ImageMeta meta;
  meta.num_classes = 10;
  meta.mean = {0.5f};
  meta.std = {0.25f};
  for (auto [name, n] : {std::pair{"train.h5", 512}, std::pair{"test.h5", 64}}) {
    auto images = torch::randint(0, 256, {n, 1, 16, 16}, torch::kUInt8);
    auto labels = torch::randint(0, 10, {n}, torch::kInt64);
    data::write_image_h5((dir / name).string(), images, labels, meta);
  }
}

std::string scraped_job(const fs::path& dir, int64_t steps) {
  return "--set model.name=plain_cnn --set model.num_classes=10 --set data.kind=hdf5 --set data.train=" +
         (dir / "train.h5").string() + " --set data.test=" + (dir / "test.h5").string() +
         " --set train.global_batch=32 --set train.epochs=0 --set train.steps=" + std::to_string(steps) +
         " --set train.eval_every=25 --set train.eval_batch=64 --set train.eval_batches=1"
         " --set train.threads=1 --set data.workers=1 --set memory.limit=1GiB --set schedule.name=constant"
         " --set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 --set log.every=100 --set seed=7";
}

/// A run that resumes: 2 steps and their final checkpoint, then the same run folder with a step count
/// it will not reach, serving /metrics on `port`, until the test stops it (SIGTERM, exit 143). It does
/// not checkpoint while it trains, so its last checkpoint stays the one it resumed from.
std::unique_ptr<Child> start_resumed_run(const TempDir& dir, int port) {
  write_dataset(dir.path);
  const std::string run_dir = (dir / "run").string();
  auto first = testutil::run(testutil::trainer_cmd(run_dir, scraped_job(dir.path, 2)));
  EXPECT_EQ(first.exit_code, 0) << first.output;
  return std::make_unique<Child>(
      testutil::trainer_cmd(run_dir, scraped_job(dir.path, 100000000) + " --set log.http_port=" + std::to_string(port)),
      (dir / "trainer.log").string());
}

/// Polls `pred` every 100 ms until it holds, the child exits, or `timeout_s` passes.
template <typename Pred>
bool wait_until(Child& child, Pred pred, double timeout_s = 120) {
  const auto t0 = std::chrono::steady_clock::now();
  while (seconds_since(t0) < timeout_s) {
    if (pred()) return true;
    if (!child.running()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

/// Ready (setup and resume done) and at least one evaluation written.
bool wait_trained_and_evaluated(Child& trainer, int port, const std::string& run_dir) {
  return wait_until(trainer, [&] {
    if (http10_get(port, "/readyz").status != 200) return false;
    std::vector<json> lines;
    try {
      lines = testutil::read_jsonl(run_dir + "/metrics.jsonl");
    } catch (...) {  // a line being written
      return false;
    }
    int evals_after_resume = 0;
    bool resumed = false;
    for (const auto& l : lines) {
      if (l.value("event", "") == "resume") resumed = true;
      if (resumed && l.value("event", "") == "eval") ++evals_after_resume;
    }
    return evals_after_resume > 0;
  });
}

// ---- Prometheus's HTTP API --------------------------------------------------------------------------------

json api(int port, const std::string& path) {
  auto r = http10_get(port, path);
  if (r.status != 200) return json{{"status", "http " + std::to_string(r.status)}, {"body", r.body}};
  return json::parse(r.body, nullptr, false);
}

json query(int port, const std::string& promql) { return api(port, "/api/v1/query?query=" + url_encode(promql)); }

}  // namespace

// ---- the name extraction itself ---------------------------------------------------------------------------

TEST(PrometheusDeploy, MetricNamesAreExtractedFromPromQL) {
  std::set<std::string> others;
  EXPECT_EQ(trainer_metrics_in(R"(sum by (device) (rate(trainer_oom_total{job="trainer_x"}[5m])) / max(trainer_ready))",
                               &others),
            (std::set<std::string>{"trainer_oom_total", "trainer_ready"}));
  EXPECT_EQ(trainer_metrics_in(R"(deriv(trainer_step{instance=~"$instance"}[$__rate_interval]))"),
            std::set<std::string>{"trainer_step"});
  EXPECT_EQ(trainer_metrics_in("time() - trainer_last_checkpoint_timestamp_seconds > 3600"),
            std::set<std::string>{"trainer_last_checkpoint_timestamp_seconds"});
  EXPECT_EQ(trainer_metrics_in("trainer_uptime_seconds>1e3 unless on(job, instance) trainer_info{rank!~'|0'}"),
            (std::set<std::string>{"trainer_uptime_seconds", "trainer_info"}));
  EXPECT_EQ(trainer_metrics_in("label_values(trainer_info, instance)"), std::set<std::string>{"trainer_info"});
  EXPECT_TRUE(trainer_metrics_in(R"(up{job="trainer"} == 0)", &others).empty());
  EXPECT_TRUE(trainer_metrics_in(R"(increase(node_oom_kills_total [5m]))", &others).empty());
  EXPECT_EQ(others, (std::set<std::string>{"up", "node_oom_kills_total"}));
  // The DCGM exporter's series, bare or selected, are others; the labels UUID and GPU_I_ID are not metrics.
  others.clear();
  EXPECT_EQ(trainer_metrics_in("max by (UUID) (DCGM_FI_DEV_XID_ERRORS > 0) + on(UUID, GPU_I_ID) group_right() "
                               "(0 * trainer_device_memory_limit_bytes)", &others),
            std::set<std::string>{"trainer_device_memory_limit_bytes"});
  trainer_metrics_in("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE{gpu=\"0\"})", &others);
  EXPECT_EQ(others, (std::set<std::string>{"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"}));
  // A misspelt name is found, so the comparison below can fail.
  EXPECT_EQ(trainer_metrics_in("rate(trainer_backoffs_total[5m])"), std::set<std::string>{"trainer_backoffs_total"});
}

// ---- promtool ---------------------------------------------------------------------------------------------

TEST(PrometheusDeploy, PromtoolChecksTheConfigsAndUnitTestsEveryAlertRule) {
  if (!have_program("promtool")) GTEST_SKIP() << "promtool not installed (Debian package prometheus; scripts/install-deps.sh)";
  auto r = testutil::run("promtool check rules " + kRules);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::cout << r.output;
  r = testutil::run("promtool test rules " + kRuleTests);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::cout << r.output;
  r = testutil::run("promtool check config " + kDeploy + "/prometheus/prometheus.yml");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // Debian builds Prometheus without Kubernetes discovery, so its promtool rejects the Kubernetes config
  // at kubernetes_sd_configs. The rest of it (the relabelling, which is where such configs go wrong) is
  // checked with file-based discovery in its place; the live test below runs that relabelling.
  TempDir dir("trainer_promtool");
  YAML::Node k8s = YAML::LoadFile(kDeploy + "/prometheus/prometheus-kubernetes.yml");
  r = testutil::run("promtool check config " + kDeploy + "/prometheus/prometheus-kubernetes.yml");
  if (r.exit_code != 0)
    EXPECT_NE(r.output.find("field kubernetes_sd_configs not found"), std::string::npos) << r.output;
  for (auto sc : k8s["scrape_configs"]) {
    ASSERT_TRUE(sc["kubernetes_sd_configs"]) << "the Kubernetes config discovers pods";
    sc.remove("kubernetes_sd_configs");
    sc["file_sd_configs"].push_back(YAML::Load("{files: [pods.json]}"));
  }
  k8s["rule_files"][0] = kRules;
  testutil::write_file(dir / "k8s.yml", YAML::Dump(k8s));
  testutil::write_file(dir / "pods.json", "[]");
  r = testutil::run("promtool check config " + (dir / "k8s.yml").string());
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // promtool has no coverage report: every alert must have a case where it fires and one where it does
  // not (an empty exp_alerts) in the tests file.
  std::map<std::string, std::pair<int, int>> cases;  // alert -> (firing, silent)
  for (const auto& t : YAML::LoadFile(kRuleTests)["tests"])
    for (const auto& a : t["alert_rule_test"]) {
      auto& c = cases[a["alertname"].as<std::string>()];
      (a["exp_alerts"].size() > 0 ? c.first : c.second)++;
    }
  const auto rules = alert_rules();
  ASSERT_GE(rules.size(), 5u);
  for (const auto& rule : rules) {
    EXPECT_GT(cases[rule.name].first, 0) << rule.name << " has no test where it fires";
    EXPECT_GT(cases[rule.name].second, 0) << rule.name << " has no test where it stays silent";
  }
}

// ---- names against a real /metrics -----------------------------------------------------------------------

TEST(PrometheusDeploy, DashboardAndRulesReadOnlyMetricsTheTrainerExports) {
  TempDir dir("trainer_prom_names");
  const int port = free_port();
  ASSERT_GT(port, 0);
  auto trainer = start_resumed_run(dir, port);
  const std::string run_dir = (dir / "run").string();
  ASSERT_TRUE(wait_trained_and_evaluated(*trainer, port, run_dir)) << trainer->output();
  auto m = http10_get(port, "/metrics");
  ASSERT_EQ(m.status, 200);
  const auto exported = exported_names(m.body);

  // The resumed process reports its checkpoint's time, as the checkpoint's manifest has it.
  const std::string latest = testutil::read_file(fs::path(run_dir) / "checkpoints" / "latest");
  const json manifest = json::parse(testutil::read_file(fs::path(run_dir) / "checkpoints" /
                                                        latest.substr(0, latest.find('\n')) / "manifest.json"));
  EXPECT_EQ(exported_value(m.body, "trainer_last_checkpoint_timestamp_seconds"),
            manifest["created_unix"].get<double>())
      << m.body;
  auto resumes = testutil::events(run_dir, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["checkpoint_created_unix"], manifest["created_unix"]);
  EXPECT_EQ(trainer->stop(SIGTERM), 143) << trainer->output();

  std::vector<std::pair<std::string, std::string>> queries;  // where, expression
  for (const auto& r : alert_rules()) queries.emplace_back("rule " + r.name, r.expr);
  std::vector<std::string> dash;
  collect_dashboard_queries(json::parse(testutil::read_file(kDashboard)), dash);
  ASSERT_GE(dash.size(), 15u) << "the dashboard's queries were not found";
  for (const auto& q : dash) queries.emplace_back("dashboard", q);

  std::set<std::string> used, used_dcgm;
  for (const auto& [where, q] : queries) {
    std::set<std::string> others;
    auto names = trainer_metrics_in(q, &others);
    for (const auto& o : others) {
      EXPECT_TRUE(o == "up" || kDcgmSeries.count(o)) << where << " reads " << o << ", which is not the trainer's: " << q;
      if (o != "up") used_dcgm.insert(o);
    }
    // "prometheus" is the datasource variable's type, not a query.
    if (q != "prometheus") EXPECT_FALSE(names.empty() && others.empty()) << where << " reads no metric: " << q;
    for (const auto& n : names) {
      used.insert(n);
      EXPECT_TRUE(exported.count(n)) << where << " reads " << n << ", which /metrics does not serve: " << q;
    }
  }
  // The dashboard shows what the issue asks for.
  for (const char* n : {"trainer_step", "trainer_loss", "trainer_samples_per_second", "trainer_device_memory_peak_bytes",
                        "trainer_device_memory_limit_bytes", "trainer_host_rss_bytes",
                        "trainer_container_memory_limit_bytes", "trainer_oom_total", "trainer_backoff_total",
                        "trainer_micro_batch", "trainer_last_checkpoint_timestamp_seconds", "trainer_ready"})
    EXPECT_TRUE(used.count(n)) << n << " is read by no panel and no rule";
  // Beside them, the card's own memory and errors from NVIDIA's DCGM exporter (joined by UUID, GPU_I_ID).
  EXPECT_EQ(used_dcgm, (std::set<std::string>{"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_XID_ERRORS"}));
  std::cout << "[prometheus] " << used.size() << " trainer metrics read by the rules and the dashboard, all among the "
            << exported.size() << " that /metrics served\n";
}

// ---- Debian's Prometheus scraping a training run ------------------------------------------------------------

TEST(PrometheusDeploy, PrometheusScrapesATrainingRunAndSeesTheStepRise) {
  if (!have_program("prometheus"))
    GTEST_SKIP() << "prometheus not installed (Debian package prometheus; scripts/install-deps.sh installs it)";
  TempDir dir("trainer_prom_live");
  const int trainer_port = free_port();
  ASSERT_GT(trainer_port, 0);
  auto trainer = start_resumed_run(dir, trainer_port);
  const std::string run_dir = (dir / "run").string();
  ASSERT_TRUE(wait_trained_and_evaluated(*trainer, trainer_port, run_dir)) << trainer->output();

  // The configuration: the trainer as a static target every second, the real rules, and the Kubernetes
  // scrape job with file-based discovery in place of the API server: four pods as the pod role would
  // describe them, of which only the running, annotated trainer pod may be kept.
  const std::string target = "127.0.0.1:" + std::to_string(trainer_port);
  const json pod = {{"__meta_kubernetes_namespace", "ml"},
                    {"__meta_kubernetes_pod_name", "trainer-resnet50-x7k2p"},
                    {"__meta_kubernetes_pod_label_app", "trainer"},
                    {"__meta_kubernetes_pod_label_job_name", "trainer-resnet50"},
                    {"__meta_kubernetes_pod_annotation_prometheus_io_scrape", "true"},
                    {"__meta_kubernetes_pod_annotation_prometheus_io_port", std::to_string(trainer_port)},
                    {"__meta_kubernetes_pod_annotation_prometheus_io_path", "/metrics"},
                    {"__meta_kubernetes_pod_phase", "Running"}};
  json failed = pod, other_app = pod, unannotated = pod;
  failed["__meta_kubernetes_pod_phase"] = "Failed";  // the Job's previous pod (exit 143)
  failed["__meta_kubernetes_pod_name"] = "trainer-resnet50-q4r8s";
  other_app["__meta_kubernetes_pod_label_app"] = "web";
  unannotated.erase("__meta_kubernetes_pod_annotation_prometheus_io_scrape");
  json pods = json::array();
  // The pod role's address is the pod IP and the container port (8080 in deploy/k8s-job.yaml).
  pods.push_back({{"targets", {"127.0.0.1:8080"}}, {"labels", pod}});
  pods.push_back({{"targets", {"127.0.0.2:8080"}}, {"labels", failed}});
  pods.push_back({{"targets", {"127.0.0.3:8080"}}, {"labels", other_app}});
  pods.push_back({{"targets", {"127.0.0.4:8080"}}, {"labels", unannotated}});
  testutil::write_file(dir / "pods.json", pods.dump(2));

  YAML::Node k8s_job = YAML::LoadFile(kDeploy + "/prometheus/prometheus-kubernetes.yml")["scrape_configs"][0];
  k8s_job["job_name"] = "trainer_k8s";
  k8s_job.remove("kubernetes_sd_configs");
  k8s_job["file_sd_configs"].push_back(YAML::Load("{files: [" + (dir / "pods.json").string() + "]}"));
  YAML::Node cfg;
  cfg["global"]["scrape_interval"] = "1s";
  cfg["global"]["scrape_timeout"] = "1s";
  cfg["global"]["evaluation_interval"] = "1s";
  cfg["rule_files"].push_back(kRules);
  YAML::Node static_job;
  static_job["job_name"] = "trainer";
  static_job["static_configs"].push_back(YAML::Load("{targets: ['" + target + "']}"));
  cfg["scrape_configs"].push_back(static_job);
  cfg["scrape_configs"].push_back(k8s_job);
  testutil::write_file(dir / "prometheus.yml", YAML::Dump(cfg));

  const int prom_port = free_port();
  ASSERT_GT(prom_port, 0);
  Child prom("prometheus --config.file=" + (dir / "prometheus.yml").string() + " --storage.tsdb.path=" +
                 (dir / "tsdb").string() + " --web.listen-address=127.0.0.1:" + std::to_string(prom_port) +
                 " --log.level=warn",
             (dir / "prometheus.log").string());
  ASSERT_TRUE(wait_until(prom, [&] { return http10_get(prom_port, "/-/ready").status == 200; }, 60))
      << prom.output();

  // trainer_step as Prometheus stored it: every second the newest raw sample (a range selector returns
  // the samples with their scrape times), until four different scrapes were seen.
  auto raw_samples = [&](const std::string& window) {
    std::vector<std::pair<double, double>> out;  // (scrape time, value)
    json q = query(prom_port, "trainer_step{job=\"trainer\"}[" + window + "]");
    EXPECT_EQ(q.value("status", ""), "success") << q.dump();
    if (q.value("status", "") != "success" || q["data"]["result"].empty()) return out;
    EXPECT_EQ(q["data"]["result"].size(), 1u) << q.dump();
    for (const auto& p : q["data"]["result"][0]["values"])
      out.emplace_back(p[0].get<double>(), std::stod(p[1].get<std::string>()));
    return out;
  };
  std::vector<std::pair<double, double>> seen;
  const auto t0 = std::chrono::steady_clock::now();
  while (seen.size() < 4 && seconds_since(t0) < 60 && trainer->running()) {
    auto s = raw_samples("5s");
    if (!s.empty() && (seen.empty() || s.back().first > seen.back().first)) seen.push_back(s.back());
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  }
  ASSERT_GE(seen.size(), 4u) << prom.output() << trainer->output();
  std::set<double> distinct;
  for (size_t i = 0; i < seen.size(); ++i) {
    std::cout << "[prometheus] trainer_step scraped at " << std::fixed << std::setprecision(3) << seen[i].first
              << ": " << static_cast<int64_t>(seen[i].second) << "\n";
    if (i > 0) EXPECT_GE(seen[i].second, seen[i - 1].second) << "the step fell between two scrapes";
    distinct.insert(seen[i].second);
  }
  EXPECT_GT(seen.back().second, seen.front().second) << "the step did not rise";
  EXPECT_GE(distinct.size(), 3u) << "the step rose in fewer than 3 of 4 scrapes";

  // Every sample stored since Prometheus started: about one a second, never falling.
  auto all = raw_samples("5m");
  ASSERT_GE(all.size(), seen.size());
  for (size_t i = 1; i < all.size(); ++i) {
    EXPECT_GE(all[i].second, all[i - 1].second);
    EXPECT_LT(all[i].first - all[i - 1].first, 3.0) << "scrapes more than 3 s apart";
  }
  std::cout << "[prometheus] " << all.size() << " scrapes stored over " << std::setprecision(1)
            << all.back().first - all.front().first << " s: trainer_step " << static_cast<int64_t>(all.front().second)
            << " -> " << static_cast<int64_t>(all.back().second) << "\n" << std::defaultfloat;
  json up = query(prom_port, "up");
  ASSERT_EQ(up.value("status", ""), "success") << up.dump();
  std::map<std::string, double> up_by_job;
  for (const auto& s : up["data"]["result"])
    up_by_job[s["metric"]["job"].get<std::string>()] = std::stod(s["value"][1].get<std::string>());
  EXPECT_EQ(up_by_job, (std::map<std::string, double>{{"trainer", 1}, {"trainer_k8s", 1}})) << up.dump();

  // The Kubernetes relabelling kept the running trainer pod, on the annotation's port and path, with
  // its namespace, pod and Job as labels, and dropped the three others.
  json targets = api(prom_port, "/api/v1/targets");
  ASSERT_EQ(targets.value("status", ""), "success") << targets.dump();
  std::vector<json> active, dropped;
  for (const auto& t : targets["data"]["activeTargets"])
    if (t["labels"].value("job", "") == "trainer_k8s") active.push_back(t);
  for (const auto& t : targets["data"]["droppedTargets"])
    if (t["discoveredLabels"].value("job", "") == "trainer_k8s") dropped.push_back(t);
  ASSERT_EQ(active.size(), 1u) << targets.dump(2);
  EXPECT_EQ(active[0]["scrapeUrl"], "http://" + target + "/metrics");
  EXPECT_EQ(active[0]["labels"],
            (json{{"instance", target}, {"job", "trainer_k8s"}, {"namespace", "ml"}, {"pod", "trainer-resnet50-x7k2p"},
                  {"k8s_job", "trainer-resnet50"}}));
  EXPECT_EQ(dropped.size(), 3u) << targets.dump(2);

  // The real rules, evaluated on the real series: every one healthy (a rule that cannot be evaluated,
  // e.g. a many-to-many match, reports "err"). None should fire on a healthy run.
  const auto rules = alert_rules();
  json groups;
  ASSERT_TRUE(wait_until(prom, [&] {
    groups = api(prom_port, "/api/v1/rules");
    size_t evaluated = 0;
    for (const auto& g : groups["data"]["groups"])
      for (const auto& r : g["rules"]) evaluated += r.value("health", "") != "unknown";
    return evaluated == rules.size();
  }, 30)) << groups.dump(2);
  for (const auto& g : groups["data"]["groups"])
    for (const auto& r : g["rules"]) {
      EXPECT_EQ(r["health"], "ok") << r.dump(2);
      EXPECT_EQ(r["state"], "inactive") << r.dump(2);
    }

  // Every dashboard query, with Grafana's variables filled in, evaluates; every panel shows data.
  const json dashboard = json::parse(testutil::read_file(kDashboard));
  for (const auto& panel : dashboard["panels"]) {
    size_t with_data = 0;
    for (const auto& t : panel["targets"]) {
      std::string e = t["expr"];
      e = std::regex_replace(e, std::regex(R"(\$__rate_interval)"), "30s");
      e = std::regex_replace(e, std::regex(R"(\$instance)"), ".*");
      json q = query(prom_port, e);
      EXPECT_EQ(q.value("status", ""), "success") << panel["title"] << ": " << e << "\n" << q.dump();
      with_data += q.value("status", "") == "success" && !q["data"]["result"].empty();
    }
    EXPECT_GT(with_data, 0u) << "panel \"" << panel["title"].get<std::string>() << "\" would be empty";
  }

  // The trainer's own count after it stopped bounds what Prometheus saw.
  EXPECT_EQ(trainer->stop(SIGTERM), 143) << trainer->output();
  const int64_t final_step = testutil::last_step(testutil::read_jsonl(run_dir + "/metrics.jsonl"));
  EXPECT_LE(seen.back().second, static_cast<double>(final_step));
  std::cout << "[prometheus] the trainer stopped at step " << final_step << "\n";
  EXPECT_EQ(prom.stop(SIGTERM), 0) << prom.output();
}

}  // namespace test_prometheus
