// MLflow tracking (trainer/track/): the records' mapping against hand-computed values, then the trainer
// against a real MLflow server (MLflow from PyPI, on the loopback, SQLite backend, started by the suite),
// read back through MLflow's own Python client (tests/ref/mlflow_ref.py).
//
// The server's MLflow comes from scripts/install-mlflow.sh; CMake's TRAINER_MLFLOW_PYTHON (or the
// environment's) names its interpreter. Without it the server tests skip, unless TRAINER_REQUIRE_MLFLOW=1
// (scripts/test.sh sets it), where a missing MLflow fails them.
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <sstream>

#include "http_client.h"
#include "tools/compare.h"
#include "train_util.h"
#include "data/files/image_h5.h"
#include "trainer/config/config.h"
#include "trainer/track/mlflow_client.h"
#include "trainer/track/records.h"

namespace test_mlflow {

using testutil::TempDir;
namespace track = trainer::track;

namespace {

std::string mlflow_python() { return testutil::env_or("TRAINER_MLFLOW_PYTHON", TRAINER_MLFLOW_PYTHON); }

std::string ref_script() { return testutil::source_dir() + "/tests/ref/mlflow_ref.py"; }

// Skips (or fails, under TRAINER_REQUIRE_MLFLOW=1) when no MLflow is installed.
#define REQUIRE_MLFLOW()                                                                                         \
  do {                                                                                                           \
    if (mlflow_python().empty() || !std::filesystem::exists(mlflow_python())) {                                \
      if (std::getenv("TRAINER_REQUIRE_MLFLOW") != nullptr) FAIL() << "no MLflow: scripts/install-mlflow.sh";   \
      GTEST_SKIP() << "MLflow is not installed (scripts/install-mlflow.sh, then configure with "                \
                      "-DTRAINER_MLFLOW_PYTHON=$(scripts/install-mlflow.sh --python))";                          \
    }                                                                                                            \
  } while (0)

// A real MLflow tracking server on a free loopback port, its SQLite database and artifacts in `dir`.
class Server {
 public:
  explicit Server(const std::filesystem::path& dir, int port = 0) : dir_(dir), port_(port ? port : testutil::free_port()) {}
  ~Server() { stop(SIGKILL); }
  bool start() {
    // setsid: the server's own process group, which holds its uvicorn worker too.
    pid_ = testutil::spawn("setsid " + mlflow_python() + " -m mlflow server --backend-store-uri sqlite:///" +
                               (dir_ / "mlflow.db").string() + " --artifacts-destination " + (dir_ / "artifacts").string() +
                               " --host 127.0.0.1 --port " + std::to_string(port_) + " --workers 1",
                           (dir_ / ("server." + std::to_string(++starts_) + ".log")).string());
    for (int i = 0; i < 1200; ++i) {  // 120 s: an import of MLflow on a loaded machine
      if (testutil::http_get(port_, "/health").status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  void stop(int sig) {
    if (pid_ <= 0) return;
    // The whole group: the worker would outlive a kill of the parent alone, holding the port.
    kill(-pid_, sig);
    testutil::wait_exit(pid_);
    pid_ = -1;
  }
  std::string uri() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  std::string log() const { return testutil::read_file(dir_ / ("server." + std::to_string(starts_) + ".log")); }

 private:
  std::filesystem::path dir_;
  int port_;
  pid_t pid_ = -1;
  int starts_ = 0;
};

// One server for the suite's tests (each test its own experiment or run folder).
class MlflowServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (mlflow_python().empty() || !std::filesystem::exists(mlflow_python())) return;
    dir_ = new TempDir("trainer_mlflow");
    server_ = new Server(dir_->path);
    started_ = server_->start();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete dir_;
    server_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    REQUIRE_MLFLOW();
    ASSERT_TRUE(started_) << server_->log();
  }
  static TempDir* dir_;
  static Server* server_;
  static bool started_;
};
TempDir* MlflowServer::dir_ = nullptr;
Server* MlflowServer::server_ = nullptr;
bool MlflowServer::started_ = false;

// Random uint8 images with labels as a trainer.images file.
void write_images(const std::string& path, int64_t n, int64_t size, uint64_t seed) {
  torch::manual_seed(seed);
  auto images = torch::randint(0, 256, {n, 1, size, size}).to(torch::kUInt8);
  auto labels = torch::randint(0, 4, {n}).to(torch::kLong);
  data::ImageMeta meta;
  meta.num_classes = 4;
  meta.mean.assign(1, 0.5f);
  meta.std.assign(1, 0.29f);
  data::write_image_h5(path, images, labels, meta);
}

// ResNet-20 on 12x12 images of 4 classes with a test split, `steps` steps, checkpoints every `ckpt`.
std::string job(const TempDir& dir, int64_t steps, int64_t ckpt, const std::string& extra = "") {
  if (!std::filesystem::exists(dir / "train.h5")) {
    write_images((dir / "train.h5").string(), 128, 12, 1);
    write_images((dir / "test.h5").string(), 24, 12, 2);
  }
  return "--set data.train=" + (dir / "train.h5").string() + " --set data.test=" + (dir / "test.h5").string() +
         " --set model.num_classes=4 --set train.global_batch=16 --set train.epochs=0 --set train.steps=" +
         std::to_string(steps) + " --set train.eval_batch=8 --set train.threads=1 --set data.workers=1"
         " --set train.deterministic=true --set checkpoint.every_seconds=0 --set checkpoint.every_steps=" +
         std::to_string(ckpt) + " --set log.every=1000 --set seed=5 " + extra;
}

// MLflow's view of a run (tests/ref/mlflow_ref.py read).
nlohmann::json read_run(const std::string& uri, const std::string& run_id) {
  auto r = testutil::run(mlflow_python() + " " + ref_script() + " read " + uri + " " + run_id);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return nlohmann::json::parse(r.output.substr(r.output.find("{\"status\"")));
}

std::string run_id_of(const std::string& run_dir) {
  return nlohmann::json::parse(testutil::read_file(run_dir + "/mlflow.json"))["run_id"].get<std::string>();
}

// Every step line's metric `key` appears in `history` exactly once, with the line's value (the last line
// of each step: a resumed run repeats steps, bit for bit).
void expect_every_step_once(const nlohmann::json& history, const std::string& run_dir, const std::string& key) {
  const auto lines = testutil::step_lines(run_dir);
  ASSERT_TRUE(history.contains(key)) << history.dump();
  std::map<int64_t, std::vector<double>> seen;
  for (const auto& sv : history[key]) seen[sv[0].get<int64_t>()].push_back(sv[1].get<double>());
  EXPECT_EQ(seen.size(), lines.size());
  for (const auto& l : lines) {
    const int64_t step = l["step"].get<int64_t>();
    ASSERT_EQ(seen[step].size(), 1u) << key << " at step " << step << " logged " << seen[step].size() << " times";
    EXPECT_EQ(seen[step][0], l[key].get<double>()) << key << " at step " << step;
  }
}

}  // namespace

// ---- the records, alone -------------------------------------------------------------------------------

TEST(MlflowRecords, StepLinesEvalsResumesAndEndsBecomeTheirMetrics) {
  const nlohmann::json step = {{"step", 7}, {"loss", 0.25}, {"lr", 0.1}, {"samples_per_s", 40.5}, {"micro_batch", 8},
                               {"batch_hash", 123456789}, {"updated", true}, {"probe", "grow"}};
  auto ms = track::metrics_of_record(step, 1000);
  std::map<std::string, double> got;
  for (const auto& m : ms) {
    EXPECT_EQ(m.step, 7);
    EXPECT_EQ(m.timestamp_ms, 1000);
    got[m.key] = m.value;
  }
  // Numbers of the table only: not the hash (an id, not a measure), not booleans or strings.
  EXPECT_EQ(got, (std::map<std::string, double>{{"loss", 0.25}, {"lr", 0.1}, {"samples_per_s", 40.5}, {"micro_batch", 8}}));

  ms = track::metrics_of_record({{"event", "eval"}, {"step", 9}, {"loss", 1.5}, {"top1", 0.5}, {"top5", 1.0}, {"samples", 24}}, 5);
  ASSERT_EQ(ms.size(), 3u);
  EXPECT_EQ(ms[0].key, "eval_loss");
  EXPECT_EQ(ms[1].key, "eval_top1");
  EXPECT_EQ(ms[2].key, "eval_top5");
  EXPECT_EQ(ms[1].value, 0.5);
  EXPECT_EQ(ms[2].step, 9);

  ms = track::metrics_of_record({{"event", "resume"}, {"step", 20}, {"micro_batch", 4}}, 5);
  ASSERT_EQ(ms.size(), 1u);
  EXPECT_EQ(ms[0].key, "resumed_at_step");
  EXPECT_EQ(ms[0].value, 20);
  ms = track::metrics_of_record({{"event", "end"}, {"step", 30}, {"seconds", 12.5}}, 5);
  ASSERT_EQ(ms.size(), 1u);
  EXPECT_EQ(ms[0].key, "wall_time_s");
  EXPECT_EQ(ms[0].value, 12.5);
  EXPECT_TRUE(track::metrics_of_record({{"event", "oom"}, {"step", 3}}, 5).empty());
  EXPECT_TRUE(track::metrics_of_record({{"event", "start"}, {"total_steps", 3}}, 5).empty());
  EXPECT_TRUE(track::metrics_of_record(nlohmann::json::array({1, 2}), 5).empty());
}

TEST(MlflowRecords, ExitCodesGiveTheRunsStatusAndNonFiniteValuesTheirNames) {
  EXPECT_EQ(track::status_of_exit_code(0), "FINISHED");
  EXPECT_EQ(track::status_of_exit_code(128 + SIGTERM), "KILLED");
  EXPECT_EQ(track::status_of_exit_code(128 + SIGINT), "KILLED");
  EXPECT_EQ(track::status_of_exit_code(3), "FAILED");  // gave up on memory
  EXPECT_EQ(track::status_of_exit_code(1), "FAILED");
  EXPECT_EQ(track::metric_value(std::nan("")), "NaN");
  EXPECT_EQ(track::metric_value(INFINITY), "Infinity");
  EXPECT_EQ(track::metric_value(-INFINITY), "-Infinity");
  EXPECT_EQ(track::metric_value(2.5), 2.5);
  EXPECT_EQ(track::retry_delay_s(0, 30), 0.5);
  EXPECT_EQ(track::retry_delay_s(3, 30), 4.0);
  EXPECT_EQ(track::retry_delay_s(10, 30), 30.0);
  EXPECT_EQ(track::check_tracking_uri("http://127.0.0.1:5000"), "");
  EXPECT_EQ(track::check_tracking_uri("https://mlflow.example.org/prefix"), "");
  EXPECT_NE(track::check_tracking_uri("databricks"), "");
  EXPECT_NE(track::check_tracking_uri("file:///tmp/mlruns"), "");
  EXPECT_NE(track::check_tracking_uri("http://"), "");
  EXPECT_EQ(track::MlflowClient::encode("a b/é"), "a%20b%2F%C3%A9");
}

TEST(MlflowRecords, LogBatchBodiesKeepMlflowsLimitsAndSendEveryItemOnce) {
  std::map<std::string, std::string> params, tags;
  for (int i = 0; i < 250; ++i) params["p" + std::to_string(1000 + i)] = std::to_string(i);
  for (int i = 0; i < 150; ++i) tags["t" + std::to_string(1000 + i)] = std::to_string(i);
  std::vector<track::Metric> metrics;
  for (int i = 0; i < 2500; ++i) metrics.push_back({"loss", i * 0.5, i, 7});
  const auto bodies = track::log_batch_bodies("r1", metrics, params, tags);
  size_t np = 0, nt = 0, nm = 0;
  for (const auto& b : bodies) {
    EXPECT_EQ(b["run_id"], "r1");
    EXPECT_LE(b["params"].size(), 100u);
    EXPECT_LE(b["tags"].size(), 100u);
    EXPECT_LE(b["metrics"].size(), 1000u);
    EXPECT_LE(b["params"].size() + b["tags"].size() + b["metrics"].size(), 1000u);
    for (const auto& m : b["metrics"]) {  // in order, each once
      EXPECT_EQ(m["step"].get<size_t>(), nm);
      EXPECT_EQ(m["value"].get<double>(), nm * 0.5);
      EXPECT_EQ(m["timestamp"], 7);
      ++nm;
    }
    for (const auto& p : b["params"]) EXPECT_EQ(p["key"], "p" + std::to_string(1000 + np++));
    nt += b["tags"].size();
  }
  EXPECT_EQ(np, 250u);
  EXPECT_EQ(nt, 150u);
  EXPECT_EQ(nm, 2500u);
  // 250 params at 100 a request need 3 requests, which carry the 2500 metrics too: 800, 850 and 850 fit
  // beside their params and tags.
  EXPECT_EQ(bodies.size(), 3u);
}

TEST(MlflowRecords, StepFilterSendsEachStepOnceAcrossResumes) {
  track::StepFilter f;
  f.seen("loss", 37);  // what an earlier process logged before SIGKILL
  f.seen("loss", 12);  // a lower mark does not lower it
  f.seen("eval_loss", 30);
  // The resumed process starts again after its checkpoint at 30.
  EXPECT_FALSE(f.keep({"loss", 0, 31, 0}));
  EXPECT_FALSE(f.keep({"loss", 0, 37, 0}));
  EXPECT_TRUE(f.keep({"loss", 0, 38, 0}));
  EXPECT_FALSE(f.keep({"loss", 0, 38, 0}));  // and each step only once in this process too
  EXPECT_TRUE(f.keep({"lr", 0, 31, 0}));     // a key the run did not have yet
  EXPECT_TRUE(f.keep({"eval_loss", 0, 40, 0}));
}

TEST(MlflowRecords, ParamsAreTheResolvedConfigsKeys) {
  trainer::Config cfg;
  cfg.train.global_batch = 96;
  const auto params = track::params_of_yaml(trainer::to_yaml(cfg));
  EXPECT_EQ(params.at("train.global_batch"), "96");
  EXPECT_EQ(params.at("model.name"), cfg.model.name);
  EXPECT_EQ(params.at("data.shape"), "[3, 224, 224]");
  EXPECT_EQ(params.at("seed"), std::to_string(cfg.seed));
  EXPECT_EQ(params.count("train"), 0u);  // only leaves
  EXPECT_THROW(track::params_of_yaml("a: [1, 2"), std::runtime_error);
  std::string long_value(7000, 'x');
  EXPECT_EQ(track::params_of_yaml("k: " + long_value).at("k").size(), 6000u);  // MLflow's limit
}

TEST(MlflowRecords, AHistoryReadBackSummarizesAsTheMetricsFileDoes) {
  // A run's records, resumed once at step 4 (steps 5 and 6 were retrained; MLflow keeps each once).
  std::vector<nlohmann::json> records = {{{"event", "start"}, {"total_steps", 8}}};
  auto step = [](int64_t s, double loss, double sps) {
    return nlohmann::json{{"step", s}, {"loss", loss}, {"samples_per_s", sps}, {"step_time_s", 1.0 / sps},
                          {"mem_peak_bytes", 1000 + s}};
  };
  for (int64_t s = 1; s <= 6; ++s) records.push_back(step(s, 2.0 - 0.1 * s, 10.0 + s));
  records.push_back({{"event", "resume"}, {"step", 4}});
  for (int64_t s = 5; s <= 8; ++s) records.push_back(step(s, 2.0 - 0.1 * s, 10.0 + s));
  records.push_back({{"event", "eval"}, {"step", 8}, {"loss", 1.1}, {"top1", 0.75}, {"top5", 1.0}, {"final", true}});
  records.push_back({{"event", "end"}, {"step", 8}, {"seconds", 9.5}});
  std::map<std::string, std::vector<track::Metric>> history;
  track::StepFilter filter;
  filter.seen("loss", 6);  // the first process logged up to 6
  for (const auto& r : records)
    for (const auto& m : track::metrics_of_record(r, 0))
      if (r.value("event", "") == "resume" || m.step <= 6 || filter.keep(m)) history[m.key].push_back(m);
  for (auto& [k, v] : history)  // the second process's 5 and 6 are not in MLflow
    v.erase(std::unique(v.begin(), v.end(), [](auto& a, auto& b) { return a.step == b.step; }), v.end());

  std::stringstream original, read_back;
  for (const auto& r : records) original << r.dump() << "\n";
  for (const auto& r : track::records_from_history(history)) read_back << r.dump() << "\n";
  const auto a = trainer::summarize_metrics_lines(original, "original");
  const auto b = trainer::summarize_metrics_lines(read_back, "read back");
  for (const char* k : {"steps", "samples_per_s", "step_time_p50_s", "peak_memory_bytes", "best_top1", "final_top1",
                        "final_eval_loss", "wall_time_s"})
    EXPECT_EQ(a.at(k), b.at(k)) << k;
  // final_loss: the mean of the last 20 step lines, which the file has twice for steps 5 and 6.
  EXPECT_DOUBLE_EQ(b.at("final_loss").get<double>(), (1.9 + 1.8 + 1.7 + 1.6 + 1.5 + 1.4 + 1.3 + 1.2) / 8);
}

// ---- against a real MLflow server ----------------------------------------------------------------------

TEST_F(MlflowServer, ARunsParamsMetricsAndArtifactsReadBackThroughMlflowsClient) {
  TempDir dir;
  const std::string run = (dir / "run-a").string();
  auto r = testutil::run(testutil::trainer_cmd(run, job(dir, 6, 3, "--set log.mlflow=" + server_->uri() +
                                                                      " --set log.mlflow_experiment=readback")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mlflow: run "), std::string::npos) << r.output;
  const auto m = read_run(server_->uri(), run_id_of(run));
  EXPECT_EQ(m["status"], "FINISHED");
  EXPECT_EQ(m["experiment"], "readback");
  EXPECT_EQ(m["run_name"], "run-a");
  // The params are the resolved config's keys.
  const auto params = track::params_of_yaml(testutil::read_file(run + "/resolved_config.yaml"));
  EXPECT_EQ(m["params"].size(), params.size());
  for (const auto& [k, v] : params) EXPECT_EQ(m["params"].value(k, "<missing>"), v) << k;
  EXPECT_EQ(m["params"]["train.steps"], "6");
  EXPECT_EQ(m["tags"]["trainer.model"], "resnet20");
  EXPECT_EQ(m["tags"]["trainer.device"], "cpu");
  EXPECT_EQ(m["tags"]["mlflow.source.git.commit"].get<std::string>().size() == 40 ||
                m["tags"]["mlflow.source.git.commit"] == "unknown",
            true);
  for (const char* k : {"loss", "lr", "samples_per_s", "step_time_s", "micro_batch", "mem_peak_bytes"})
    expect_every_step_once(m["history"], run, k);
  const auto evals = testutil::events(run, "eval");
  ASSERT_EQ(evals.size(), 1u);
  ASSERT_EQ(m["history"]["eval_top1"].size(), 1u);
  EXPECT_EQ(m["history"]["eval_top1"][0][1].get<double>(), evals[0]["top1"].get<double>());
  EXPECT_EQ(m["history"]["eval_loss"][0][0], 6);
  // The artifacts: the resolved config as it is in the run folder, the final evaluation as its record.
  EXPECT_EQ(m["artifacts"]["resolved_config.yaml"], testutil::read_file(run + "/resolved_config.yaml"));
  EXPECT_EQ(nlohmann::json::parse(m["artifacts"]["final_eval.json"].get<std::string>()), evals[0]);
}

// memory.state auto changes a setting mid-run: MLflow refuses a param's new value, so the change is a tag
// (the latest one of each key), and the params stay the config the run started with.
TEST_F(MlflowServer, AMidRunMemoryStateChangeIsATag) {
  TempDir dir;
  const std::string run = (dir / "run").string();
  const std::string job = "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml" +
                          " --set data.kind=synthetic --set data.test= --set model.context=16 --set train.global_batch=1"
                          " --set train.steps=100000 --set train.epochs=0 --set log.every=1 --set checkpoint.every_steps=0"
                          " --set memory.limit=64MiB --set memory.state=auto --set log.mlflow=" + server_->uri();
  const pid_t pid = testutil::spawn(testutil::trainer_cmd(run, job), (dir / "train.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run, [&](auto& l) {
    return testutil::last_step(l) >= 5 && std::filesystem::exists(run + "/mlflow.json");
  })) << testutil::read_file(dir / "train.log");
  testutil::write_file(dir / "run" / "control.yaml", "memory:\n  limit: 8.3MiB\n");  // only int8 moments fit
  std::string last_to;
  const bool changed = testutil::wait_for_metrics(run, [&](auto& lines) {
    for (auto& l : lines)
      if (l.value("event", "") == "memory_state") last_to = l.value("to", "");
    return last_to == "int8" && testutil::last_step(lines) >= 3;
  });
  kill(pid, SIGTERM);
  const int code = testutil::wait_exit(pid);
  const std::string out = testutil::read_file(dir / "train.log");
  ASSERT_TRUE(changed) << out;
  ASSERT_EQ(code, 128 + SIGTERM) << out;
  const auto changes = testutil::events(run, "memory_state");
  ASSERT_FALSE(changes.empty());
  const auto m = read_run(server_->uri(), run_id_of(run));
  EXPECT_EQ(m["params"]["optim.state_dtype"], "float32") << "the params are the config the run started with";
  EXPECT_FALSE(m["params"].contains("memory.state.changed.optim.state_dtype"));
  EXPECT_EQ(m["tags"].value("memory.state.changed.optim.state_dtype", "<missing>"),
            changes.back()["from"].get<std::string>() + " -> int8") << m["tags"].dump();
}

TEST_F(MlflowServer, SigkillAndResumeIsOneRunWithEveryStepOnce) {
  TempDir dir;
  const std::string run = (dir / "run").string();
  // 600 steps: on an idle machine the job trains about 50 steps a second while the tracker sends a batch a
  // second, so a shorter job (160) had trained to its end, with steps still queued, before MLflow had 70.
  const std::string args = job(dir, 600, 60, "--set log.mlflow=" + server_->uri() + " --set log.mlflow_experiment=resume");
  pid_t pid = testutil::spawn(testutil::trainer_cmd(run, args), (dir / "killed.log").string());
  // Killed once MLflow has steps past the checkpoint at 60, mid-run: the resumed process retrains them.
  int64_t logged = 0;
  for (int i = 0; i < 1200 && logged < 70; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!std::filesystem::exists(run + "/mlflow.json")) continue;
    track::MlflowClient c(server_->uri());
    auto got = c.get("runs/get", "run_id=" + run_id_of(run));
    for (const auto& mt : got.body["run"]["data"].value("metrics", nlohmann::json::array()))
      if (mt["key"] == "loss") logged = mt["step"].get<int64_t>();
  }
  kill(pid, SIGKILL);
  ASSERT_EQ(testutil::wait_exit(pid), 128 + SIGKILL) << "the run ended before MLflow had step 70; make it longer\n"
                                                     << testutil::read_file(dir / "killed.log");
  const std::string first_id = run_id_of(run);
  auto r = testutil::run(testutil::trainer_cmd(run, args));  // the same command resumes
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto resumes = testutil::events(run, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  const int64_t from = resumes[0]["step"].get<int64_t>();
  EXPECT_EQ(run_id_of(run), first_id);  // one MLflow run
  EXPECT_NE(r.output.find("mlflow: run " + first_id + " goes on"), std::string::npos) << r.output;
  if (logged > from)  // the steps the first process logged past the checkpoint were not sent again
    EXPECT_NE(r.output.find("already there from before the resume"), std::string::npos) << r.output;
  const auto m = read_run(server_->uri(), first_id);
  EXPECT_EQ(m["status"], "FINISHED");
  for (const char* k : {"loss", "lr", "samples_seen"}) expect_every_step_once(m["history"], run, k);
  ASSERT_EQ(m["history"]["resumed_at_step"].size(), 1u);
  EXPECT_EQ(m["history"]["resumed_at_step"][0][1].get<int64_t>(), from);
}

TEST_F(MlflowServer, CompareTakesAnMlflowRunAsItsBaseline) {
  TempDir dir;
  // Two nights of the same job in one experiment.
  const std::string night1 = (dir / "night1").string(), night2 = (dir / "night2").string();
  for (const auto& run : {night1, night2}) {
    auto r = testutil::run(testutil::trainer_cmd(run, job(dir, 8, 4, "--set log.mlflow=" + server_->uri() +
                                                                        " --set log.mlflow_experiment=nightly")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::string bin = testutil::trainer_bin() + " compare ";
  const std::string uri = " --mlflow-uri " + server_->uri();
  // Speed moves between two runs on a shared machine: only the figures of the computation are judged here.
  testutil::write_file(dir / "tolerances.yaml", "samples_per_s: {rel: 0.95}\nstep_time_p50_s: {rel: 20}\n"
                                                "step_time_p90_s: {rel: 20}\n");
  const std::string tol = " --tolerances " + (dir / "tolerances.yaml").string();
  // Tonight against last night: the experiment's latest finished run other than tonight's own.
  auto r = testutil::run(bin + "mlflow:experiment/nightly " + night2 + uri + tol);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("baseline: mlflow:experiment/nightly (run " + run_id_of(night1) + ")"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("no regression"), std::string::npos) << r.output;
  // By id, with the server from the environment.
  r = testutil::run("MLFLOW_TRACKING_URI=" + server_->uri() + " " + bin + "mlflow:" + run_id_of(night1) + " " + night1 +
                    " --json");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // The summaries agree on what they are made from.
  auto from_mlflow = nlohmann::json::parse(testutil::run(bin + "--summarize mlflow:" + run_id_of(night2) + uri).output);
  const auto from_folder = trainer::load_summary(night2);
  for (const char* k : {"steps", "final_loss", "samples_per_s", "step_time_p50_s", "peak_memory_bytes", "final_top1",
                        "final_eval_loss", "wall_time_s"})
    EXPECT_EQ(from_mlflow.at(k), from_folder.at(k)) << k;
  // A regressed run: twice the loss of the latest night (night2, as a summary file is no MLflow run).
  nlohmann::json worse = from_folder;
  worse["final_loss"] = from_folder["final_loss"].get<double>() * 2 + 1;
  testutil::write_file(dir / "worse.json", worse.dump());
  r = testutil::run(bin + "mlflow:experiment/nightly " + (dir / "worse.json").string() + uri + tol);
  EXPECT_EQ(r.exit_code, trainer::kExitRegression) << r.output;
  EXPECT_NE(r.output.find("(run " + run_id_of(night2) + ")"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("REGRESSION"), std::string::npos) << r.output;
  // A run or an experiment the server does not have, or no server named: one line, exit 2.
  r = testutil::run(bin + "mlflow:0123456789abcdef " + night1 + uri);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("run 0123456789abcdef on " + server_->uri()), std::string::npos) << r.output;
  r = testutil::run(bin + "mlflow:experiment/no-such-experiment " + night1 + uri);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = testutil::run("env -u MLFLOW_TRACKING_URI " + bin + "mlflow:" + run_id_of(night1) + " " + night1);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("MLFLOW_TRACKING_URI"), std::string::npos) << r.output;
}

TEST_F(MlflowServer, ASlowServerDoesNotSlowTheSteps) {
  TempDir dir;
  // Every request to MLflow waits 5 s in a proxy first.
  const int port = testutil::free_port();
  pid_t proxy = testutil::spawn(mlflow_python() + " " + ref_script() + " proxy " + std::to_string(port) + " " +
                                    server_->uri() + " --delay 5",
                                (dir / "proxy.log").string());
  for (int i = 0; i < 100 && testutil::read_file(dir / "proxy.log").find("ready") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string run = (dir / "run").string();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = testutil::run(testutil::trainer_cmd(
      run, job(dir, 24, 100, "--set log.mlflow=http://127.0.0.1:" + std::to_string(port) + " --set log.mlflow_experiment=slow")));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kill(proxy, SIGKILL);
  testutil::wait_exit(proxy);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A logger in the loop would add 5 s to a step at least (one request a step, or one a second). No step
  // waited for it: the slowest is far below one request's delay.
  double slowest = 0;
  for (const auto& l : testutil::step_lines(run))
    slowest = std::max(slowest, l["step_time_s"].get<double>() + l["data_wait_s"].get<double>());
  EXPECT_LT(slowest, 2.5) << r.output;
  // The end waits for the server at most close_timeout_s (15 s) beyond the training.
  EXPECT_LT(wall, 24 * 2.5 + 15 + 20) << r.output;
}

TEST_F(MlflowServer, ARefusedLoginOrAWrongUriIsAWarningNotAnExit) {
  TempDir dir;
  const int port = testutil::free_port();
  pid_t proxy = testutil::spawn(mlflow_python() + " " + ref_script() + " proxy " + std::to_string(port) + " " +
                                    server_->uri() + " --status 401",
                                (dir / "proxy.log").string());
  for (int i = 0; i < 100 && testutil::read_file(dir / "proxy.log").find("ready") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto r = testutil::run(testutil::trainer_cmd((dir / "refused").string(),
                                               job(dir, 3, 100, "--set log.mlflow=http://127.0.0.1:" + std::to_string(port))));
  kill(proxy, SIGKILL);
  testutil::wait_exit(proxy);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mlflow: the server refused the login"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("this run is not tracked"), std::string::npos) << r.output;
  // Nothing listens there: training goes on, the tracker warns once.
  r = testutil::run(testutil::trainer_cmd((dir / "nobody").string(),
                                          job(dir, 3, 100, "--set log.mlflow=http://127.0.0.1:" + std::to_string(testutil::free_port()))));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mlflow: finding the experiment"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "nobody/mlflow.json"));
  // Not an http(s) URI (MLflow's local file store, Databricks), from the environment too.
  r = testutil::run("MLFLOW_TRACKING_URI=databricks " +
                    testutil::trainer_cmd((dir / "databricks").string(), job(dir, 2, 100)));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("mlflow: MLFLOW_TRACKING_URI 'databricks' is not an http"), std::string::npos) << r.output;
  // log.mlflow: off wins over the environment.
  r = testutil::run("MLFLOW_TRACKING_URI=" + server_->uri() + " " +
                    testutil::trainer_cmd((dir / "off").string(), job(dir, 2, 100, "--set log.mlflow=off")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("mlflow"), std::string::npos) << r.output;
}

TEST_F(MlflowServer, DataParallelLogsFromRankZeroOnly) {
  if (testutil::run(testutil::python() + " -c 'import torch.distributed.run'").exit_code != 0)
    GTEST_SKIP() << "no torchrun in " << testutil::python();
  TempDir dir;
  const std::string run = (dir / "run").string();
  // Debian's torchrun (torch 1.13) needs --redirects/--tee given (docs/DISTRIBUTED.md).
  auto r = testutil::run(testutil::python() + " -m torch.distributed.run --nproc_per_node 2 --master_port " +
                         std::to_string(testutil::free_port()) + " --redirects 2 --tee 2 --no_python " +
                         testutil::trainer_bin() + " --run-dir " + run + " " +
                         job(dir, 4, 100, "--set log.mlflow=" + server_->uri() + " --set log.mlflow_experiment=dp"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(run + "/mlflow.json"));
  EXPECT_FALSE(std::filesystem::exists(run + "/rank1/mlflow.json"));
  EXPECT_EQ(testutil::read_file(run + "/rank1/train.log").find("mlflow"), std::string::npos);
  track::MlflowClient c(server_->uri());
  const auto exp = c.get("experiments/get-by-name", "experiment_name=dp");
  ASSERT_TRUE(exp.ok()) << exp.error;
  const auto runs = c.post("runs/search", {{"experiment_ids", {exp.body["experiment"]["experiment_id"]}}});
  ASSERT_TRUE(runs.ok()) << runs.error;
  ASSERT_EQ(runs.body["runs"].size(), 1u);
  expect_every_step_once(read_run(server_->uri(), run_id_of(run))["history"], run, "loss");
}

TEST(MlflowRestart, AServerKilledMidRunMissesNothingAfterItReturns) {
  REQUIRE_MLFLOW();
  TempDir dir;
  Server server(dir.path);
  ASSERT_TRUE(server.start()) << server.log();
  const std::string run = (dir / "run").string();
  // Long enough to outlast the outage; stopped with SIGTERM once MLflow has steps from after it.
  pid_t pid = testutil::spawn(testutil::trainer_cmd(run, job(dir, 100000, 100000, "--set log.mlflow=" + server.uri())),
                              (dir / "train.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run, [&](auto& l) {
    return testutil::last_step(l) >= 10 && std::filesystem::exists(run + "/mlflow.json");  // the run is made
  }));
  server.stop(SIGKILL);
  const int64_t down_at = testutil::last_step(testutil::read_jsonl(run + "/metrics.jsonl"));
  ASSERT_TRUE(server.start()) << server.log();  // the same port and database, 15 s or more later
  const int64_t back_at = testutil::last_step(testutil::read_jsonl(run + "/metrics.jsonl"));
  int64_t logged = 0;
  for (int i = 0; i < 1200 && logged <= back_at; ++i) {  // the tracker's next try: within 30 s
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    track::MlflowClient c(server.uri());
    auto got = c.get("runs/get", "run_id=" + run_id_of(run));
    for (const auto& mt : got.body["run"]["data"].value("metrics", nlohmann::json::array()))
      if (mt["key"] == "loss") logged = mt["step"].get<int64_t>();
  }
  kill(pid, SIGTERM);
  const int code = testutil::wait_exit(pid);
  const std::string out = testutil::read_file(dir / "train.log");
  ASSERT_EQ(code, 128 + SIGTERM) << out;
  ASSERT_GT(logged, back_at) << "MLflow got no step from after the outage\n" << out;
  EXPECT_NE(out.find("failed at " + server.uri() + " (Couldn't connect to server); training goes on"), std::string::npos)
      << out;
  EXPECT_NE(out.find("answers again"), std::string::npos) << out;
  const auto m = read_run(server.uri(), run_id_of(run));
  EXPECT_EQ(m["status"], "KILLED");  // stopped by a signal: the job resumes
  EXPECT_EQ(m["params"]["train.steps"], "100000");  // sent again after the outage if it cut them off
  // Every step is there once with the run's values: the ones of the outage too, which waited in the
  // queue (it holds 100000 metrics, far more than the outage's).
  expect_every_step_once(m["history"], run, "loss");
  // No step waited for the tracker while the server was away (its tries back off up to 30 s).
  double slowest = 0;
  for (const auto& l : testutil::step_lines(run))
    slowest = std::max(slowest, l["step_time_s"].get<double>() + l["data_wait_s"].get<double>());
  EXPECT_LT(slowest, 2.5);
  std::cout << "server down at step " << down_at << ", back at step " << back_at << ", stopped after step "
            << testutil::last_step(testutil::read_jsonl(run + "/metrics.jsonl")) << "\n";
}

}  // namespace test_mlflow
