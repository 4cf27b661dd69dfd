// The speed harness: the statistics against hand-computed values; `trainer bench` (training and
// --loader-only) and bench/compare.py on a tiny job, whose JSON must be complete and consistent (counts,
// orderings, FLOPs against the model's own count, figures against the run's metrics.jsonl), never fast;
// and the Python reference's config defaults and models against the trainer's.
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <vector>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "common/compat.h"
#include "data/files/token_h5.h"
#include "models/registry.h"
#include "models/summary.h"
#include "test_util.h"
#include "tools/bench/bench.h"
#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/memory/resources.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_bench {

using nlohmann::json;
using testutil::TempDir;

namespace {

// ResNet-20 on 1x16x16 synthetic samples, batch 8: a second or two for 5 steps on 2 cores. On the CPU on
// any host (a GPU host too): the tests check the CPU fields.
const char* kTinyJob = R"(model: {name: resnet20, num_classes: 10}
data: {kind: synthetic, shape: [1, 16, 16], synthetic_size: 64, test: ""}
optim: {lr: 0.01}
schedule: {name: constant}
train: {global_batch: 8, device: cpu}
log: {every: 1}
)";

std::string tiny_config(const TempDir& dir) {
  auto path = (dir / "tiny.yaml").string();
  testutil::write_file(path, kTinyJob);
  return path;
}

std::string bench_cmd(const std::string& args) { return testutil::trainer_bin() + " bench " + args; }

std::string reference_py() { return testutil::python() + " " + testutil::source_dir() + "/bench/reference.py"; }

json read_json(const std::string& path) { return json::parse(testutil::read_file(path)); }

// The last line of a failed command's output, which must be its one "error: ..." line.
std::string last_line(std::string out) {
  while (!out.empty() && out.back() == '\n') out.pop_back();
  auto nl = out.rfind('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

// The fields every training result has, trainer's and Python's alike (docs/BENCHMARKS.md).
const std::vector<std::string> kTrainFields = {
    "schema", "implementation", "mode", "model", "sample_shape", "global_batch", "timed_steps", "warmup_steps",
    "step_time_s_p50", "step_time_s_p90", "step_time_s_mean", "step_time_s_min", "step_time_s_max",
    "step_total_s_p50", "step_total_s_p90", "data_wait_s_sum", "data_wait_share", "samples_per_s_median",
    "samples_per_s_aggregate", "wall_s", "wall_source", "mem_peak_bytes", "rss_peak_bytes", "micro_batch",
    "precision", "channels_last", "threads", "flops_per_sample_forward", "flops_per_sample_train",
    "achieved_tflops", "peak_tflops", "mfu", "versions", "device", "device_name", "host", "date",
    "command_line", "config_yaml", "loss_first", "loss_last", "losses", "figures_basis", "achieved_tflops_median_step",
    "mfu_median_step"};

// The tiny GPT on a token file with a vocabulary of 300 (not gpt_tiny's 256: the trainer takes the file's,
// and Python must be given it), context 32, batch 4: well under a second a step on 2 cores.
std::string tiny_gpt_config(const TempDir& dir) {
  std::vector<int64_t> ids;
  uint64_t x = 12345;
  for (int i = 0; i < 4000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    ids.push_back(static_cast<int64_t>((x >> 33) % 300));
  }
  auto tokens = (dir / "tokens.h5").string();
  data::write_tokens(tokens, ids, 300, "tests/test_bench.cpp");
  auto path = (dir / "gpt.yaml").string();
  testutil::write_file(path, "model: {name: gpt_tiny, context: 32}\n"
                             "data: {kind: tokens, train: " + tokens + ", test: \"\"}\n"
                             "optim: {name: adamw, lr: 0.001, weight_decay: 0.1, grad_clip: 1.0}\n"
                             "schedule: {name: constant}\n"
                             "train: {global_batch: 4, device: cpu}\n"
                             "log: {every: 1}\n");
  return path;
}

double model_forward_flops(const std::string& name, const std::vector<int64_t>& shape, int64_t classes) {
  auto m = models::create_model(name, models::ModelOptions().num_classes(classes).in_channels(shape[0]));
  return m->forward_flops(shape);
}

}  // namespace

// ---- statistics -----------------------------------------------------------------------------------

TEST(BenchStats, PercentileInterpolatesLikeNumpy) {
  // numpy.percentile([4, 1, 3, 2], q): sorted 1 2 3 4, rank q/100 * 3.
  std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(trainer::percentile(v, 0), 1.0);
  EXPECT_DOUBLE_EQ(trainer::percentile(v, 50), 2.5);
  EXPECT_DOUBLE_EQ(trainer::percentile(v, 90), 3.7);
  EXPECT_DOUBLE_EQ(trainer::percentile(v, 100), 4.0);
  EXPECT_DOUBLE_EQ(trainer::percentile({7}, 90), 7.0);
  try {
    trainer::percentile({}, 50);
    FAIL() << "no values accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "percentile: no values");
  }
  try {
    trainer::percentile(v, 101);
    FAIL() << "q = 101 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("q must lie in [0, 100]"), std::string::npos) << e.what();
  }
}

TEST(BenchStats, SummarizesTheTimedStepsOfAMetricsFile) {
  TempDir dir;
  auto path = (dir / "metrics.jsonl").string();
  // Two warmup steps, three timed ones, events in between (skipped by the reader).
  testutil::write_file(path,
                       R"({"event":"start","total_steps":5}
{"step":1,"step_time_s":9.0,"data_wait_s":1.0,"mem_peak_bytes":999,"micro_batch":8,"oom_retries":0,"updated":true,"loss":3.0}
{"step":2,"step_time_s":0.5,"data_wait_s":0.0,"mem_peak_bytes":100,"micro_batch":8,"oom_retries":0,"updated":true,"loss":2.5}
{"step":3,"step_time_s":0.2,"data_wait_s":0.1,"mem_peak_bytes":300,"micro_batch":8,"oom_retries":1,"updated":true,"loss":2.0}
{"event":"oom","step":4}
{"step":4,"step_time_s":0.4,"data_wait_s":0.0,"mem_peak_bytes":500,"micro_batch":4,"oom_retries":2,"updated":false,"loss":1.5}
{"step":5,"step_time_s":0.3,"data_wait_s":0.1,"mem_peak_bytes":200,"micro_batch":4,"oom_retries":0,"updated":true,"loss":1.0}
{"event":"checkpoint","step":5}
)");
  auto records = trainer::read_step_records(path);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[3].step, 4);
  EXPECT_FALSE(records[3].updated);

  json s = trainer::summarize_steps(records, /*warmup=*/2, /*steps=*/3, /*global_batch=*/8, /*wall_s=*/1.0);
  // Timed step times 0.2, 0.4, 0.3; with data wait 0.3, 0.4, 0.4.
  EXPECT_EQ(s["timed_steps"], 3);
  EXPECT_NEAR(s["step_time_s_p50"].get<double>(), 0.3, 1e-12);
  EXPECT_NEAR(s["step_time_s_p90"].get<double>(), 0.3 + 0.8 * 0.1, 1e-12);  // rank 1.8
  EXPECT_NEAR(s["step_time_s_mean"].get<double>(), 0.3, 1e-12);
  EXPECT_NEAR(s["step_time_s_min"].get<double>(), 0.2, 1e-12);
  EXPECT_NEAR(s["step_time_s_max"].get<double>(), 0.4, 1e-12);
  EXPECT_NEAR(s["step_total_s_p50"].get<double>(), 0.4, 1e-12);
  EXPECT_NEAR(s["data_wait_s_sum"].get<double>(), 0.2, 1e-12);
  EXPECT_NEAR(s["data_wait_share"].get<double>(), 0.2 / 1.1, 1e-12);
  EXPECT_NEAR(s["samples_per_s_median"].get<double>(), 8 / 0.4, 1e-9);  // of 8/0.3, 8/0.4, 8/0.4
  EXPECT_NEAR(s["samples_per_s_aggregate"].get<double>(), 24.0, 1e-12);  // 3 x 8 samples in 1 s
  EXPECT_EQ(s["mem_peak_bytes"], 500);  // step 1's 999 is warmup
  EXPECT_EQ(s["micro_batch"], 4);
  EXPECT_EQ(s["oom_retries"], 3);
  EXPECT_EQ(s["skipped_updates"], 1);
  EXPECT_EQ(s["loss_first"], 2.0);
  EXPECT_EQ(s["loss_last"], 1.0);

  // Without a wall time, the sum of the timed steps stands in, and says so.
  json t = trainer::summarize_steps(records, 2, 3, 8, 0.0);
  EXPECT_NEAR(t["wall_s"].get<double>(), 1.1, 1e-12);
  EXPECT_EQ(t["wall_source"], "sum of step_time + data_wait");

  try {
    trainer::summarize_steps(records, 2, 4, 8, 1.0);
    FAIL() << "a missing step was not noticed";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "bench: expected 4 timed steps after 2 warmup steps in metrics.jsonl, found 3");
  }
  testutil::write_file(path, "{\"step\":1,\"step_time_s\":0.1}\nnot json\n");
  try {
    trainer::read_step_records(path);
    FAIL() << "a malformed line was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ":2: not a metrics line", 0), 0u) << e.what();
  }
}

TEST(BenchStats, KnownPeaksAgreeWithThePythonTable) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"NVIDIA H100 80GB HBM3", "bf16"}, {"NVIDIA H100 PCIe", "fp16"}, {"NVIDIA H200", "bf16"},
      {"NVIDIA H200 NVL", "bf16"},       {"NVIDIA A100-SXM4-80GB", "bf16"}, {"NVIDIA H100 80GB HBM3", "fp32"},
      {"NVIDIA GeForce RTX 4090", "bf16"}, {"", "bf16"}};
  EXPECT_DOUBLE_EQ(trainer::known_peak_tflops(cases[0].first, "bf16"), 989.4);
  EXPECT_DOUBLE_EQ(trainer::known_peak_tflops(cases[1].first, "fp16"), 756.0);
  EXPECT_DOUBLE_EQ(trainer::known_peak_tflops(cases[3].first, "bf16"), 0.0);
  EXPECT_DOUBLE_EQ(trainer::known_peak_tflops(cases[5].first, "fp32"), 0.0);
  std::string py = "import sys; sys.path.insert(0, '" + testutil::source_dir() +
                   "/bench'); import reference, json; print(json.dumps([";
  for (const auto& [name, prec] : cases) py += "reference.known_peak_tflops('" + name + "', '" + prec + "'),";
  py += "]))";
  auto r = testutil::run(testutil::python() + " -c \"" + py + "\"");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json got = json::parse(r.output);
  ASSERT_EQ(got.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_DOUBLE_EQ(got[i].get<double>(), trainer::known_peak_tflops(cases[i].first, cases[i].second))
        << cases[i].first << " " << cases[i].second;
}

// ---- trainer bench --------------------------------------------------------------------------------

TEST(BenchHarness, TrainingResultIsCompleteAndMatchesTheRunsMetrics) {
  TempDir dir;
  auto cfg = tiny_config(dir);
  auto out = (dir / "r.json").string();
  auto run_dir = (dir / "run").string();
  auto r = testutil::run(bench_cmd("--config " + cfg + " --set seed=3 --warmup 2 --steps 3 --peak-tflops 0.5 --out " +
                                   out + " --run-dir " + run_dir));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("bench: resnet20 batch 8 on cpu: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" samples/s, MFU "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(wall time over the timed steps: 3 steps in "), std::string::npos) << r.output;
  json j = read_json(out);
  for (const auto& f : kTrainFields) EXPECT_TRUE(j.contains(f)) << "missing " << f;
  EXPECT_EQ(j["schema"], trainer::kBenchSchema);
  EXPECT_EQ(j["implementation"], "trainer");
  EXPECT_EQ(j["mode"], "train");
  EXPECT_EQ(j["model"], "resnet20");
  EXPECT_EQ(j["sample_shape"], json({1, 16, 16}));
  EXPECT_EQ(j["global_batch"], 8);
  EXPECT_EQ(j["micro_batch"], 8);
  EXPECT_EQ(j["warmup_steps"], 2);
  EXPECT_EQ(j["timed_steps"], 3);
  EXPECT_EQ(j["precision"], "fp32");
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["threads"], trainer::usable_cpus());
  EXPECT_EQ(j["overrides"], json({"seed=3"}));
  EXPECT_NE(j["config_yaml"].get<std::string>().find("seed: 3"), std::string::npos);
  EXPECT_NE(j["config_yaml"].get<std::string>().find("steps: 5"), std::string::npos);  // warmup + timed
  EXPECT_NE(j["command_line"].get<std::string>().find("bench --config"), std::string::npos);
  EXPECT_EQ(j["versions"]["torch"], trainer::compat::torch_version());
  EXPECT_EQ(j["versions"]["trainer"], TRAINER_VERSION);
  EXPECT_GE(j["host"]["nproc"].get<int>(), 1);
  EXPECT_EQ(j["date"].get<std::string>().size(), 20u);  // 2026-11-22T03:04:05Z

  // Orderings and positivity (no speed is asserted).
  const double p50 = j["step_time_s_p50"], p90 = j["step_time_s_p90"];
  EXPECT_GT(p50, 0);
  EXPECT_GE(p90, p50);
  EXPECT_LE(j["step_time_s_min"].get<double>(), p50);
  EXPECT_GE(j["step_time_s_max"].get<double>(), p90);
  EXPECT_GE(j["step_total_s_p50"].get<double>(), p50);
  EXPECT_GE(j["data_wait_share"].get<double>(), 0.0);
  EXPECT_LT(j["data_wait_share"].get<double>(), 1.0);
  EXPECT_GT(j["mem_peak_bytes"].get<int64_t>(), 0);
  EXPECT_GT(j["rss_peak_bytes"].get<int64_t>(), j["mem_peak_bytes"].get<int64_t>());
  // With an odd number of steps the median rate is the rate of the median step.
  EXPECT_NEAR(j["samples_per_s_median"].get<double>(), 8 / j["step_total_s_p50"].get<double>(), 1e-9);
  // The wall time spans the three timed steps, seen as their metrics lines appeared.
  EXPECT_EQ(j["wall_source"], "metrics lines (inotify)");
  EXPECT_GE(j["wall_s"].get<double>(), 0.9 * 3 * j["step_time_s_mean"].get<double>());
  EXPECT_NEAR(j["samples_per_s_aggregate"].get<double>(), 24 / j["wall_s"].get<double>(), 1e-9);

  // FLOPs: the model's own count, x3 for training; MFU against the given peak, by wall time (the median
  // step's beside it).
  const double fwd = model_forward_flops("resnet20", {1, 16, 16}, 10);
  EXPECT_EQ(j["flops_per_sample_forward"].get<double>(), fwd);
  EXPECT_EQ(j["flops_per_sample_train"].get<double>(), 3 * fwd);
  EXPECT_EQ(j["figures_basis"], "wall time over the timed steps");
  const double achieved = 3 * fwd * j["samples_per_s_aggregate"].get<double>() / 1e12;
  EXPECT_NEAR(j["achieved_tflops"].get<double>(), achieved, 1e-12 * achieved);
  EXPECT_EQ(j["peak_tflops"], 0.5);
  EXPECT_EQ(j["peak_tflops_source"], "--peak-tflops");
  EXPECT_NEAR(j["mfu"].get<double>(), achieved / 0.5, 1e-12);
  const double achieved_median = 3 * fwd * j["samples_per_s_median"].get<double>() / 1e12;
  EXPECT_NEAR(j["achieved_tflops_median_step"].get<double>(), achieved_median, 1e-12 * achieved_median);
  EXPECT_NEAR(j["mfu_median_step"].get<double>(), achieved_median / 0.5, 1e-12);

  // The figures are those of the run's own metrics.jsonl: steps 3..5, computed here the plain way; the
  // losses of all five steps; step 1's start after the model was built.
  std::vector<double> times;
  json losses = json::array();
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  int64_t lines = 0;
  while (std::getline(in, line)) {
    json l = json::parse(line);
    if (l.contains("event")) continue;
    ++lines;
    if (l["step"].get<int64_t>() > 2) times.push_back(l["step_time_s"].get<double>());
    losses.push_back(l["loss"]);
    EXPECT_EQ(l.contains("since_model_built_s"), l["step"] == 1) << line;
    if (l["step"] == 1) {
      EXPECT_EQ(j["since_model_built_s"], l["since_model_built_s"]);
      EXPECT_EQ(j["first_step_time_s"], l["step_time_s"]);
      EXPECT_GE(l["since_model_built_s"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(lines, 5);
  EXPECT_EQ(j["losses"], losses);
  ASSERT_EQ(times.size(), 3u);
  // A benchmark saves nothing: no checkpoint at all, the final one included (checkpoint.final=false).
  const testutil::fs::path saved = testutil::fs::path(run_dir) / "checkpoints";
  EXPECT_TRUE(!testutil::fs::exists(saved) || testutil::fs::is_empty(saved));
  EXPECT_EQ(std::count(j["bench_overrides"].begin(), j["bench_overrides"].end(), "checkpoint.final=false"), 1);
  std::sort(times.begin(), times.end());
  EXPECT_EQ(j["step_time_s_p50"].get<double>(), times[1]);
  EXPECT_EQ(j["step_time_s_max"].get<double>(), times[2]);
  EXPECT_EQ(j["run_dir"], run_dir);

  // A run folder that already has metrics is refused before anything runs.
  auto again = testutil::run(bench_cmd("--config " + cfg + " --steps 1 --run-dir " + run_dir));
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_EQ(last_line(again.output), "error: bench: " + run_dir + "/metrics.jsonl exists; give --run-dir a new folder "
                                     "(the bench reads back every step line)");
}

TEST(BenchHarness, LoaderOnlyMeasuresThePipeline) {
  TempDir dir;
  auto cfg = tiny_config(dir);
  // Without --out the JSON goes to stdout (test_util's run() merges the summary line from stderr in).
  auto r = testutil::run(bench_cmd("--loader-only --config " + cfg +
                                   " --set data.hflip=true --set data.crop_padding=2 --warmup 1 --steps 4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto begin = r.output.find("{\n"), end = r.output.rfind("\n}");
  ASSERT_NE(begin, std::string::npos) << r.output;
  json j = json::parse(r.output.substr(begin, end + 2 - begin));
  EXPECT_EQ(j["schema"], trainer::kBenchSchema);
  EXPECT_EQ(j["mode"], "loader");
  EXPECT_GT(j["samples_per_s"].get<double>(), 0);
  EXPECT_EQ(j["batches"], 4);
  EXPECT_EQ(j["global_batch"], 8);
  EXPECT_EQ(j["workers"], trainer::usable_cpus());  // data.workers: 0 = usable CPUs, as the loop
  EXPECT_EQ(j["augment"]["crop_padding"], 2);
  EXPECT_EQ(j["augment"]["hflip"], true);
  EXPECT_FALSE(j["augment"]["pin_memory"].get<bool>());
}

TEST(BenchHarness, BadArgumentsAreOneLineErrors) {
  TempDir dir;
  auto cfg = tiny_config(dir);
  auto r = testutil::run(bench_cmd("--config " + cfg + " --steps 0"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: bench: --steps must be >= 1, got 0");
  r = testutil::run(bench_cmd("--config " + cfg + " --warmup -1"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: bench: --warmup must be >= 0, got -1");
  r = testutil::run(bench_cmd("--config " + cfg + " --set train.global_bach=4"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(last_line(r.output).find("key 'train.global_bach': unknown key"), std::string::npos) << r.output;
  r = testutil::run(bench_cmd("--config " + cfg + " stray"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: command line: unexpected argument 'stray' (see trainer bench --help)");
}

// ---- the Python reference -------------------------------------------------------------------------

TEST(BenchReference, DefaultsAreTheTrainers) {
  auto r = testutil::run(reference_py() + " --print-defaults");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json py = json::parse(r.output);
  YAML::Node cpp = YAML::Load(trainer::to_yaml(trainer::Config{}));
  // Leaves of the nested sections (model.lora.rank is py["model"]["lora"]["rank"]).
  std::function<size_t(const json&)> leaves = [&](const json& v) -> size_t {
    if (!v.is_object()) return 1;
    size_t n = 0;
    for (const auto& [k, child] : v.items()) n += leaves(child);
    return n;
  };
  EXPECT_EQ(leaves(py), trainer::config_keys().size());
  for (const auto& key : trainer::config_keys()) {
    std::vector<std::string> p;
    std::stringstream parts(key);
    for (std::string part; std::getline(parts, part, '.');) p.push_back(part);
    json pv = py;
    for (const auto& part : p) pv = pv.is_object() ? pv.value(part, json()) : json();
    // Indexed in one expression: assigning a YAML::Node to another rewrites the node it refers to.
    const YAML::Node cv = p.size() == 1 ? cpp[p[0]] : p.size() == 2 ? cpp[p[0]][p[1]] : cpp[p[0]][p[1]][p[2]];
    ASSERT_FALSE(pv.is_null()) << key << " is missing in bench/reference.py's DEFAULTS";
    if (pv.is_boolean()) EXPECT_EQ(pv.get<bool>(), cv.as<bool>()) << key;
    else if (pv.is_number_integer()) EXPECT_EQ(pv.get<int64_t>(), cv.as<int64_t>()) << key;
    else if (pv.is_number_float()) EXPECT_EQ(pv.get<double>(), cv.as<double>()) << key;
    else if (pv.is_string()) EXPECT_EQ(pv.get<std::string>(), cv.as<std::string>()) << key;
    else if (pv.is_array() && std::all_of(pv.begin(), pv.end(), [](const json& e) { return e.is_number_integer(); }))
      EXPECT_EQ(pv.get<std::vector<int64_t>>(), cv.as<std::vector<int64_t>>()) << key;
    else if (pv.is_array()) EXPECT_EQ(pv.get<std::vector<double>>(), cv.as<std::vector<double>>()) << key;
    else ADD_FAILURE() << key << ": unexpected type in bench/reference.py's DEFAULTS";
  }
}

TEST(BenchReference, ModelsHaveTheTrainersStructureAndFlops) {
  struct Case {
    std::string name;
    std::vector<int64_t> shape;
    std::string models;  // reference.py --models: torchvision's ResNets (auto) or the script's own copy
  };
  // ResNet-50 on one channel: bottleneck blocks, and torchvision's conv1 rebuilt for the channels; the
  // script's own ImageNet ResNets (for hosts without torchvision) both ways.
  for (const auto& c : {Case{"resnet20", {1, 16, 16}, "auto"}, Case{"resnet50", {1, 32, 32}, "auto"},
                        Case{"resnet50", {3, 32, 32}, "builtin"}, Case{"resnet18", {1, 32, 32}, "builtin"}}) {
    std::string shape = "[" + std::to_string(c.shape[0]) + "," + std::to_string(c.shape[1]) + "," +
                        std::to_string(c.shape[2]) + "]";
    auto r = testutil::run(reference_py() + " --describe --models " + c.models + " --set model.name=" + c.name +
                           " --set data.shape=" + shape + " --set model.num_classes=7");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    json py = json::parse(r.output);
    auto model = models::create_model(c.name, models::ModelOptions().num_classes(7).in_channels(c.shape[0]));
    std::map<std::string, std::vector<int64_t>> cpp;
    for (const auto& p : model->named_parameters()) cpp[p.key()] = p.value().sizes().vec();
    for (const auto& b : model->named_buffers()) cpp[b.key()] = b.value().sizes().vec();
    std::map<std::string, std::vector<int64_t>> pys;
    for (auto& [k, v] : py["state"].items()) pys[k] = v.get<std::vector<int64_t>>();
    EXPECT_EQ(pys, cpp) << c.name << " " << c.models;
    EXPECT_EQ(py["flops_per_sample_forward"].get<double>(), model->forward_flops(c.shape)) << c.name << " " << c.models;
  }
}

TEST(BenchReference, GptHasTheTrainersStructureCountAndFlops) {
  // gpt_tiny with a context and a vocabulary of its own (as a token file would give it), and GPT-2 small
  // (built on the meta device by the script): every parameter name and shape, the parameter count (the
  // tied output projection once) and the forward FLOPs of one sequence must be the trainer's.
  struct Case {
    std::string name;
    int64_t context, vocab;  // vocab 0: the registered one
  };
  for (const auto& c : {Case{"gpt_tiny", 64, 300}, Case{"gpt_tiny", 128, 0}, Case{"gpt2", 1024, 0}}) {
    auto r = testutil::run(reference_py() + " --describe --set model.name=" + c.name + " --set data.kind=tokens" +
                           " --set model.context=" + std::to_string(c.context) +
                           (c.vocab ? " --vocab-size " + std::to_string(c.vocab) : std::string()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    json py = json::parse(r.output);
    auto mo = models::ModelOptions().context(c.context);
    if (c.vocab) mo.vocab_size(c.vocab);
    auto model = models::create_model(c.name, mo);
    std::map<std::string, std::vector<int64_t>> cpp, pys;
    for (const auto& p : model->named_parameters()) cpp[p.key()] = p.value().sizes().vec();
    for (const auto& b : model->named_buffers()) cpp[b.key()] = b.value().sizes().vec();
    for (auto& [k, v] : py["state"].items()) pys[k] = v.get<std::vector<int64_t>>();
    EXPECT_EQ(pys, cpp) << c.name;
    EXPECT_EQ(py["num_parameters"].get<int64_t>(), models::count_parameters(*model)) << c.name;
    EXPECT_EQ(py["sample_shape"], json({c.context})) << c.name;
    EXPECT_EQ(py["flops_per_sample_forward"].get<double>(), model->forward_flops({c.context})) << c.name;
    if (c.name == "gpt2") {
      // The hand figures of docs/TRANSFORMERS.md: GPT-2 small's count and forward FLOPs at T = 1024.
      EXPECT_EQ(py["num_parameters"].get<int64_t>(), 124439808);
      EXPECT_EQ(py["flops_per_sample_forward"].get<double>(),
                2.0 * 1024 * (12 * 12 * 768.0 * 768 + 768.0 * 50257) + 4.0 * 12 * 1024 * 1024 * 768);
    }
  }
}

TEST(BenchReference, LlamaIsTransformersModelWithTheTrainersNamesCountAndFlops) {
  // The Llama-family shapes are mirrored by transformers' own LlamaForCausalLM / Qwen2ForCausalLM: every
  // parameter name and shape, the count (tied output once) and the forward FLOPs of one sequence must be
  // the trainer's. llama_tiny is counted by the forward hooks, the others (built on the meta device) by
  // the script's static count, so the two ways of counting are held to the same figure. Qwen2.5-0.5B's
  // shape is transformers' Qwen2ForCausalLM, with the q/k/v biases.
  const auto missing = testutil::missing_module_of(testutil::source_dir() + "/tests/ref/llama_ref.py");
  if (!missing.empty())
    GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing
                 << " (scripts/install-torch.sh installs transformers into the 2.11 venv)";
  struct Case {
    std::string name;
    int64_t context;
  };
  for (const auto& c : {Case{"llama_tiny", 64}, Case{"qwen2_5_0_5b", 96}}) {
    auto r = testutil::run(reference_py() + " --describe --set model.name=" + c.name + " --set data.kind=tokens" +
                           " --set model.context=" + std::to_string(c.context));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    json py = json::parse(r.output.substr(r.output.find('{')));
    auto model = models::create_model(c.name, models::ModelOptions().context(c.context));
    std::map<std::string, std::vector<int64_t>> cpp, pys;
    for (const auto& p : model->named_parameters()) cpp[p.key()] = p.value().sizes().vec();
    for (auto& [k, v] : py["state"].items()) pys[k] = v.get<std::vector<int64_t>>();
    EXPECT_EQ(pys, cpp) << c.name;
    EXPECT_EQ(py["num_parameters"].get<int64_t>(), models::count_parameters(*model)) << c.name;
    EXPECT_EQ(py["flops_per_sample_forward"].get<double>(), model->forward_flops({c.context})) << c.name;
  }
}

TEST(BenchReference, RefusesWhatItDoesNotMirror) {
  auto r = testutil::run(reference_py() + " --set data.kind=hdf5 --steps 1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: config: key 'data.kind': the Python reference runs on synthetic images or "
                                 "token streams only; set data.kind: synthetic or tokens (got 'hdf5')");
  r = testutil::run(reference_py() + " --set data.kind=tokens --steps 1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: config: key 'data.kind': resnet20 trains on images (synthetic), got data.kind "
                                 "'tokens'");
  // A GPT reads tokens from a file or synthetic ones, and needs a context either way.
  for (const char* kind : {"tokens", "synthetic"}) {
    r = testutil::run(reference_py() + " --set model.name=gpt_tiny --set data.kind=" + kind + " --steps 1");
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(last_line(r.output), "error: config: key 'model.context': a language model needs the tokens per sample");
  }
  r = testutil::run(reference_py() + " --set train.bogus=1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: --set train.bogus=1: key 'train.bogus': unknown key");
  r = testutil::run(reference_py() + " --set optim.lr=fast");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: --set optim.lr=fast: key 'optim.lr': expected a number, got 'fast'");
}

// The fair reference's loss over a padded vocabulary: over every column, the padding ones masked to -inf
// in place (nanoGPT's cost: no slice, no zero-filled copy in backward), is the loss of the real columns
// alone, as the trainer's (trainer/numerics/loss.h): the same losses step for step as the sliced loss on
// the same model, whose gradients (steps 2..) and values (step 1) therefore agree too. Without the mask the
// six padding logits (0: zero rows) would add about ln(1 + 6/250) = 0.024 to each loss.
TEST(BenchReference, PaddedVocabularyLossIsTheRealColumnsLoss) {
  TempDir dir;
  const std::string job = " --set model.name=gpt_tiny --set data.kind=synthetic --set model.context=16"
                          " --set model.vocab_size=250 --set model.vocab_multiple=64 --set train.global_batch=4"
                          " --set train.threads=1 --set optim.name=adamw --set optim.lr=0.01 --warmup 1 --steps 5";
  std::map<std::string, json> res;
  for (const char* how : {"full", "slice"}) {
    const std::string out = (dir / (std::string(how) + ".json")).string();
    auto r = testutil::run(reference_py() + job + " --padded-loss " + how + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    res[how] = read_json(out);
    EXPECT_EQ(res[how]["padded_loss"], json({{"columns", 250}, {"width", 256}, {"how", how}})) << how;
  }
  const json &full = res["full"]["losses"], &slice = res["slice"]["losses"];
  ASSERT_EQ(full.size(), 6u);
  ASSERT_EQ(slice.size(), 6u);
  EXPECT_NEAR(full[0].get<double>(), std::log(250.0), 0.3) << "uniform tokens: about ln V";
  for (size_t i = 0; i < full.size(); ++i)
    EXPECT_NEAR(full[i].get<double>(), slice[i].get<double>(), 1e-6 * slice[i].get<double>()) << "step " << i + 1;
  EXPECT_GT(std::abs(full[5].get<double>() - full[0].get<double>()), 1e-4) << "the model trained: the steps differ";
}

// ---- bench/optim_quality.py -----------------------------------------------------------------------

// Each precision trained on one small token job: the summary's losses are the runs' final evaluations,
// float32 is the reference, and the bounds are checked.
TEST(BenchOptimQuality, EachPrecisionAgainstFloat32) {
  TempDir dir;
  std::vector<int64_t> train, val;
  uint64_t x = 7;
  for (int i = 0; i < 6000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    (i < 5000 ? train : val).push_back(static_cast<int64_t>((x >> 33) % 64));
  }
  data::write_tokens((dir / "train.h5").string(), train, 256, "tests/test_bench.cpp");
  data::write_tokens((dir / "val.h5").string(), val, 256, "tests/test_bench.cpp");
  const std::string script = testutil::python() + " " + testutil::source_dir() + "/bench/optim_quality.py";
  const std::string args =
      " --config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --trainer " + testutil::trainer_bin() +
      " --runs " + (dir / "runs").string() + " --set data.train=" + (dir / "train.h5").string() +
      " --set data.test=" + (dir / "val.h5").string() +
      " --set model.context=16 --set train.global_batch=4 --set train.steps=12 --set train.eval_every=12"
      " --set schedule.warmup_steps=2 --set checkpoint.every_seconds=0 --set log.every=6 --jobs 1";
  const std::string out = (dir / "summary.json").string();
  auto r = testutil::run(script + args + " --variants float32,int8,bf16_weights_sr --out " + out);
  ASSERT_TRUE(r.exit_code == 0 || r.exit_code == 1) << r.output;
  const json s = read_json(out);
  EXPECT_EQ(s["schema"], "trainer-bench-optim-quality/1");
  ASSERT_EQ(s["variants"].size(), 3u) << s.dump(1);
  bool all = true;
  for (const char* v : {"float32", "int8", "bf16_weights_sr"}) {
    const json& run = s["variants"][v];
    const auto evals = testutil::events((dir / "runs" / v).string(), "eval");
    ASSERT_FALSE(evals.empty()) << v;
    EXPECT_EQ(run["final_val_loss"].get<double>(), evals.back()["loss"].get<double>()) << v;
    EXPECT_EQ(run["final_step"], 12) << v;
    EXPECT_NEAR(run["vs_float32"].get<double>(),
                run["final_val_loss"].get<double>() / s["variants"]["float32"]["final_val_loss"].get<double>() - 1, 1e-12);
    if (run["within_bound"].is_boolean()) all = all && run["within_bound"].get<bool>();
  }
  EXPECT_EQ(s["variants"]["float32"]["vs_float32"].get<double>(), 0.0);
  EXPECT_TRUE(s["variants"]["float32"]["within_bound"].is_null());
  EXPECT_EQ(s["variants"]["int8"]["bound"].get<double>(), 0.01);
  EXPECT_EQ(s["variants"]["bf16_weights_sr"]["bound"].get<double>(), 0.02);
  EXPECT_EQ(s["all_within_bounds"].get<bool>(), all);
  EXPECT_EQ(r.exit_code, all ? 0 : 1) << r.output;
  // --reuse trains nothing again; bad input is one line, exit 2.
  r = testutil::run(script + args + " --variants float32,int8 --reuse --out " + out);
  EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 1) << r.output;
  EXPECT_EQ(read_json(out)["variants"]["int8"]["wall_s"], nullptr);
  r = testutil::run(script + args + " --variants float32,int4");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown int4"), std::string::npos) << r.output;
  r = testutil::run(script + args + " --variants int8,float32");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

// ---- bench/compare.py -----------------------------------------------------------------------------

TEST(BenchCompare, AlternatingRoundsOnATinyJob) {
  TempDir dir;
  auto cfg = tiny_config(dir);
  auto out = (dir / "summary.json").string();
  // The trainer's temporary run folders go to a TMPDIR of this test's own: tests running beside it
  // make and remove theirs in the shared one.
  const auto tmp = dir / "tmp";
  testutil::fs::create_directories(tmp);
  auto bench_folders = [&] {
    int n = 0;
    for (const auto& e : testutil::fs::directory_iterator(tmp))
      n += e.path().filename().string().rfind("trainer-bench-", 0) == 0;
    return n;
  };
  const int folders_before = bench_folders();
  auto r = testutil::run("TMPDIR=" + tmp.string() + " " + testutil::python() + " " + testutil::source_dir() + "/bench/compare.py --config " + cfg +
                         " --rounds 2 --warmup 2 --steps 3 --min-wall-s 0.3 --calibration-steps 2 --loader-steps 3"
                         " --trainer-b-set train.snapshot=per_buffer --trainer " + testutil::trainer_bin() +
                         " --python " + testutil::python() + " --workdir " + (dir / "runs").string() + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("median ratio trainer/python step time p50 over 2 rounds"), std::string::npos) << r.output;
  json s = read_json(out);
  EXPECT_EQ(s["schema"], "trainer-bench-compare/2");
  EXPECT_EQ(s["basis"], "wall time over the timed steps");
  ASSERT_EQ(s["rounds"].size(), 2u);
  // The calibration: each side's wall time a step from its own run, and the steps that give the faster
  // side 1.2 x 0.3 s (at least --steps).
  const json& cal = s["calibration"];
  ASSERT_TRUE(cal.is_object()) << s.dump(1);
  const double fastest = std::min(cal["trainer_step_wall_s"].get<double>(), cal["python_step_wall_s"].get<double>());
  EXPECT_EQ(s["steps"].get<int64_t>(), std::max<int64_t>(3, static_cast<int64_t>(std::ceil(1.2 * 0.3 / fastest))));
  std::vector<double> ratios, wall_ratios;
  for (const auto& round : s["rounds"]) {
    json t = read_json(round["trainer_file"]), p = read_json(round["python_file"]);
    for (const auto& f : kTrainFields) EXPECT_TRUE(p.contains(f)) << "python result misses " << f;
    EXPECT_EQ(t["implementation"], "trainer");
    EXPECT_EQ(p["implementation"], "pytorch");
    EXPECT_EQ(t["timed_steps"], s["steps"]);
    EXPECT_EQ(p["timed_steps"], s["steps"]);
    EXPECT_EQ(p["micro_batch"], 8);
    EXPECT_GE(p["step_time_s_p90"].get<double>(), p["step_time_s_p50"].get<double>());
    EXPECT_EQ(p["threads"], t["threads"]);
    EXPECT_TRUE(t["run_dir"].is_null());     // a temporary run folder (removed: see below)
    EXPECT_TRUE(t["peak_tflops"].is_null());  // a CPU: no known peak, so no MFU
    EXPECT_TRUE(t["mfu"].is_null());
    EXPECT_TRUE(p["mfu"].is_null());
    // Both count the same FLOPs for the same model, each its own way.
    EXPECT_EQ(p["flops_per_sample_forward"].get<double>(), t["flops_per_sample_forward"].get<double>());
    double ratio = t["step_time_s_p50"].get<double>() / p["step_time_s_p50"].get<double>();
    EXPECT_DOUBLE_EQ(round["ratio_step_time_p50"].get<double>(), ratio);
    ratios.push_back(ratio);
    // The headline ratio: samples/s by wall time over the timed steps.
    EXPECT_EQ(t["figures_basis"], "wall time over the timed steps");
    EXPECT_DOUBLE_EQ(t["samples_per_s_aggregate"].get<double>(),
                     t["timed_steps"].get<double>() * 8 / t["wall_s"].get<double>());
    EXPECT_DOUBLE_EQ(round["ratio_samples_per_s"].get<double>(),
                     t["samples_per_s_aggregate"].get<double>() / p["samples_per_s_aggregate"].get<double>());
    wall_ratios.push_back(round["ratio_samples_per_s"].get<double>());
    // The second arm (the per-buffer snapshot: the same arithmetic): the same losses, step for step.
    const json b = read_json(round["trainer_b_file"]);
    EXPECT_NE(b["config_yaml"].get<std::string>().find("snapshot: \"per_buffer\""), std::string::npos);
    EXPECT_EQ(b["losses"], t["losses"]);
    EXPECT_EQ(t["losses"].size(), 2u + s["steps"].get<size_t>()) << "every step's, the warmup's first";
    EXPECT_EQ(round["losses_against_b"]["equal"], true) << round;
    EXPECT_EQ(round["losses_against_b"]["max_abs_diff"], 0.0) << round;
    // Step 1's start after the model was built, from its metrics line.
    EXPECT_GE(t["since_model_built_s"].get<double>(), 0.0);
    EXPECT_GT(t["first_step_time_s"].get<double>(), 0.0);
  }
  EXPECT_DOUBLE_EQ(s["median_ratio_step_time_p50"].get<double>(), (ratios[0] + ratios[1]) / 2);
  EXPECT_DOUBLE_EQ(s["speed_ratio"].get<double>(), (wall_ratios[0] + wall_ratios[1]) / 2);
  EXPECT_EQ(s["trainer_b"]["losses_equal"], true) << s["trainer_b"];
  ASSERT_TRUE(s.contains("loader"));
  EXPECT_NEAR(s["loader_headroom"].get<double>(),
              s["loader"]["samples_per_s"].get<double>() / s["trainer_samples_per_s"].get<double>(), 1e-9);
  EXPECT_EQ(s["commands"].size(), 3u);  // trainer, python, trainer_b
  EXPECT_EQ(bench_folders(), folders_before) << "a temporary run folder was left behind";
}

TEST(BenchCompare, TokenJobReportsTokensPerSecondOnBothSides) {
  TempDir dir;
  auto cfg = tiny_gpt_config(dir);
  auto out = (dir / "summary.json").string();
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/bench/compare.py --config " + cfg +
                         " --rounds 1 --warmup 1 --steps 3 --min-wall-s 0 --loader-steps 5 --trainer " + testutil::trainer_bin() +
                         " --python " + testutil::python() + " --workdir " + (dir / "runs").string() + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json s = read_json(out);
  ASSERT_EQ(s["rounds"].size(), 1u);
  json t = read_json(s["rounds"][0]["trainer_file"]), p = read_json(s["rounds"][0]["python_file"]);
  auto model = models::create_model("gpt_tiny", models::ModelOptions().context(32).vocab_size(300));
  for (const json& j : {t, p}) {
    const std::string who = j["implementation"];
    for (const auto& f : kTrainFields) EXPECT_TRUE(j.contains(f)) << who << " misses " << f;
    EXPECT_EQ(j["model"], "gpt_tiny") << who;
    EXPECT_EQ(j["sample_shape"], json({32})) << who;  // a sample is a sequence of 32 tokens
    EXPECT_EQ(j["context"], 32) << who;
    EXPECT_EQ(j["vocab_size"], 300) << who;  // the file's, handed to Python by compare.py
    EXPECT_EQ(j["global_batch"], 4) << who;
    EXPECT_NEAR(j["tokens_per_s_median"].get<double>(), 32 * j["samples_per_s_median"].get<double>(), 1e-9) << who;
    EXPECT_NEAR(j["tokens_per_s_aggregate"].get<double>(), 32 * j["samples_per_s_aggregate"].get<double>(), 1e-9) << who;
    EXPECT_EQ(j["flops_per_sample_forward"].get<double>(), model->forward_flops({32})) << who;
    EXPECT_NE(j["versions"]["blas"].get<std::string>(), "") << who;  // whichever libblas is mapped, it is named
  }
  // The token-weighted mean loss: on random ids about ln 300 at the start, on both sides.
  EXPECT_NEAR(t["loss_first"].get<double>(), std::log(300.0), 0.3);
  EXPECT_NEAR(p["loss_first"].get<double>(), std::log(300.0), 0.3);
  EXPECT_NEAR(s["trainer_tokens_per_s"].get<double>(), 32 * s["trainer_samples_per_s"].get<double>(), 1e-6);
  EXPECT_NEAR(s["trainer_tokens_per_s_median_step"].get<double>(),
              32 * s["trainer_samples_per_s_median_step"].get<double>(), 1e-6);
  // The token loader alone (no workers: windows are cut in the caller's thread).
  ASSERT_TRUE(s.contains("loader"));
  json l = read_json(s["loader"]["file"]);
  EXPECT_EQ(l["mode"], "loader");
  EXPECT_EQ(l["workers"], 0);
  EXPECT_NEAR(l["tokens_per_s"].get<double>(), 32 * l["samples_per_s"].get<double>(), 1e-6);
  EXPECT_GT(s["loader_headroom"].get<double>(), 0);
}

// configs/bench_gpt2_small_synthetic.yaml needs no file on either side: both train on synthetic tokens
// of GPT-2's vocabulary (here gpt_tiny's layers at context 16 in fp32, to stay quick on the CPU).
TEST(BenchCompare, SyntheticGpt2VocabularyOnBothSides) {
  TempDir dir;
  auto out = (dir / "summary.json").string();
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/bench/compare.py --config " +
                         testutil::source_dir() + "/configs/bench_gpt2_small_synthetic.yaml --set model.name=gpt_tiny"
                         " --set model.context=16 --set train.global_batch=2 --set train.device=cpu --set amp.enabled=false"
                         " --rounds 1 --warmup 1 --steps 2 --min-wall-s 0 --loader-steps 3 --trainer " + testutil::trainer_bin() +
                         " --python " + testutil::python() + " --workdir " + (dir / "runs").string() + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json s = read_json(out);
  json t = read_json(s["rounds"][0]["trainer_file"]), p = read_json(s["rounds"][0]["python_file"]);
  auto model = models::create_model("gpt_tiny", models::ModelOptions().context(16).vocab_size(50257));
  for (const json& j : {t, p}) {
    const std::string who = j["implementation"];
    EXPECT_EQ(j["sample_shape"], json({16})) << who;
    EXPECT_EQ(j["vocab_size"], 50257) << who;
    EXPECT_EQ(j["flops_per_sample_forward"].get<double>(), model->forward_flops({16})) << who;
    // Uniform tokens: about ln 50257 = 10.8 at the start.
    EXPECT_NEAR(j["loss_first"].get<double>(), std::log(50257.0), 0.3) << who;
  }
  json l = read_json(s["loader"]["file"]);
  EXPECT_EQ(l["mode"], "loader");
  EXPECT_NEAR(l["tokens_per_s"].get<double>(), 16 * l["samples_per_s"].get<double>(), 1e-6);
}

// ---- the OOM recovery benchmark -------------------------------------------------------------------------

namespace {

std::vector<json> jsonl_of(const testutil::fs::path& path) { return testutil::read_jsonl(path.string()); }

double median_of(std::vector<double> v) { return v.empty() ? 0.0 : trainer::percentile(v, 50); }

}  // namespace

// The whole benchmark on configs/bench_oom_tiny.yaml, one round, with the run folders kept: every figure
// of the JSON is checked against the runs' own metrics.jsonl and memory reports, and the scenario (cut,
// OOMs down the ladder, raise, grow-back) against what the calibrated limits imply. No speed is asserted.
TEST(BenchOom, TinyJobResultAgreesWithItsRuns) {
  TempDir dir;
  const auto runs = dir / "runs";
  const auto out = (dir / "oom.json").string();
  auto r = testutil::run(bench_cmd("--oom --config " + testutil::source_dir() + "/configs/bench_oom_tiny.yaml" +
                                   " --rounds 2 --warmup 2 --steps 3 --run-dir " + runs.string() + " --out " + out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("bench --oom: plain_cnn batch 16: recovery "), std::string::npos) << r.output;
  const json j = read_json(out);
  EXPECT_EQ(j["schema"], "trainer-bench/1");
  EXPECT_EQ(j["mode"], "oom");
  EXPECT_EQ(j["model"], "plain_cnn");
  EXPECT_EQ(j["global_batch"], 16);
  EXPECT_EQ(j["run_dir"], runs.string());
  for (const char* k : {"date", "host", "versions", "device", "config_yaml", "command_line", "wall_s", "options"})
    EXPECT_TRUE(j.contains(k)) << k;

  // Calibration: the largest step peak of each uncapped run; the limits placed between them.
  std::map<int64_t, int64_t> peak;
  for (int64_t m : {16, 8, 4}) {
    for (const auto& l : jsonl_of(runs / ("calibrate_mb" + std::to_string(m)) / "metrics.jsonl"))
      if (!l.contains("event")) peak[m] = std::max(peak[m], l["mem_peak_bytes"].get<int64_t>());
    EXPECT_EQ(j["calibration_peak_bytes"][std::to_string(m)].get<int64_t>(), peak[m]) << m;
  }
  ASSERT_LT(peak[4], peak[8]);
  ASSERT_LT(peak[8], peak[16]);
  const auto& lim = j["limits_bytes"];
  EXPECT_EQ(lim["high"].get<int64_t>(), peak[16] + peak[16] / 4);
  EXPECT_EQ(lim["cut"].get<int64_t>(), (peak[4] + peak[8]) / 2);
  EXPECT_EQ(lim["mid"].get<int64_t>(), (peak[8] + peak[16]) / 2);

  // auto against the exhaustive search: every size from 16 down to half the largest that fits, each run's
  // verdict its own (an OOM event or none); the largest that fits is at least the calibrated size under
  // the cap, and the calibrated size over it does not fit. (The peak need not be monotone in the
  // micro-batch, so nothing else is implied.)
  ASSERT_EQ(j["auto_vs_exhaustive"].size(), 2u);
  for (const auto& a : j["auto_vs_exhaustive"]) {
    const std::string cap = a["cap"];
    const bool cut = cap == "cut";
    EXPECT_EQ(a["limit_bytes"], cut ? lim["cut"] : lim["mid"]);
    const int64_t largest = a["largest_fitting_micro_batch"].get<int64_t>();
    const auto& searched = a["searched"];
    ASSERT_EQ(static_cast<int64_t>(searched.size()), 16 - (largest + 1) / 2 + 1);
    json failing_below = json::array();
    for (int64_t i = 0; i < static_cast<int64_t>(searched.size()); ++i) {
      const int64_t m = 16 - i;
      EXPECT_EQ(searched[i]["micro_batch"].get<int64_t>(), m);
      const bool fits = searched[i]["fits"].get<bool>();
      bool oom = false;
      for (const auto& l : jsonl_of(runs / ("search_" + cap + "_mb" + std::to_string(m)) / "metrics.jsonl"))
        oom = oom || l.value("event", "") == "oom";
      EXPECT_EQ(fits, !oom) << cap << " " << m;
      if (m > largest) EXPECT_FALSE(fits) << cap << " " << m;
      if (m == largest) EXPECT_TRUE(fits) << cap << " " << m;
      if (m < largest && !fits) failing_below.push_back(m);
    }
    EXPECT_EQ(a["failing_below_largest"], failing_below);
    EXPECT_GE(largest, cut ? 4 : 8);
    EXPECT_FALSE(searched[16 - (cut ? 8 : 16)]["fits"].get<bool>());
    // The pick is what the auto run logged, and the figures are its ratios.
    auto autorun = jsonl_of(runs / ("auto_" + a["cap"].get<std::string>()) / "metrics.jsonl");
    int64_t picked = 0;
    for (const auto& l : autorun)
      if (l.value("event", "") == "auto_micro_batch") picked = l["micro_batch"].get<int64_t>();
    EXPECT_EQ(a["auto_micro_batch"].get<int64_t>(), picked);
    EXPECT_GE(picked, 1);
    EXPECT_DOUBLE_EQ(a["auto_fraction"].get<double>(), static_cast<double>(picked) / largest);
    EXPECT_LE(a["micro_batch_after_3_steps"].get<int64_t>(), picked);
    EXPECT_GT(a["auto_search_s"].get<double>(), 0.0);
  }

  // Recovery, from the backoff run's own files (round 1 in detail; round 2 ran the fresh run first).
  ASSERT_EQ(j["rounds"].size(), 2u);
  const auto& round = j["rounds"][0];
  EXPECT_EQ(round["order"], "backoff first");
  EXPECT_EQ(j["rounds"][1]["order"], "fresh first");
  EXPECT_EQ(j["rounds"][1]["final_micro_batch"], 16);
  EXPECT_EQ(j["rounds"][1]["ooms_in_step"], 2);
  for (const auto& l : jsonl_of(runs / "round2_fresh" / "metrics.jsonl"))
    if (!l.contains("event")) EXPECT_EQ(l["micro_batch"], 16);
  EXPECT_DOUBLE_EQ(j["recovery"]["recovery_s_median"].get<double>(),
                   (j["rounds"][0]["recovery_s"].get<double>() + j["rounds"][1]["recovery_s"].get<double>()) / 2);
  const auto a_lines = jsonl_of(runs / "round1_backoff" / "metrics.jsonl");
  std::vector<json> a_steps, ooms;
  for (const auto& l : a_lines) {
    if (!l.contains("event")) a_steps.push_back(l);
    else if (l["event"] == "oom") ooms.push_back(l);
  }
  ASSERT_FALSE(ooms.empty());
  const int64_t oom_step = ooms.front()["step"].get<int64_t>();
  EXPECT_EQ(round["oom_step"], oom_step);
  EXPECT_GT(oom_step, 2) << "the cut comes after the 2 warmup steps";
  // The cut limit fits a quarter of the batch and not half: the ladder went 16 -> 8 -> 4 in one step.
  EXPECT_EQ(round["ooms_in_step"], 2);
  EXPECT_EQ(ooms[0]["new_micro_batch"], 8);
  EXPECT_EQ(ooms[1]["new_micro_batch"], 4);
  EXPECT_EQ(ooms[1]["step"], oom_step);
  EXPECT_EQ(round["micro_batch_after"], 4);
  EXPECT_TRUE(testutil::fs::exists(runs / "round1_backoff" / ("memory_report_" + std::to_string(oom_step) + ".json")));
  const double oom_step_time = a_steps[oom_step - 1]["step_time_s"].get<double>();
  EXPECT_DOUBLE_EQ(round["oom_step_time_s"].get<double>(), oom_step_time);
  // From the first OOM to the step's line: within the step (plus the time to write its line).
  EXPECT_GT(round["recovery_s"].get<double>(), 0.0);
  EXPECT_LT(round["recovery_s"].get<double>(), oom_step_time + 2.0);
  // Two reports, each with its time: the span between them lies inside the recovery.
  double t_first = 1e300, t_last = 0;
  for (const char* f : {".json", "_2.json"}) {
    const double t = read_json((runs / "round1_backoff" / ("memory_report_" + std::to_string(oom_step) + f)).string())
                         ["time_unix_s"].get<double>();
    t_first = std::min(t_first, t);
    t_last = std::max(t_last, t);
  }
  EXPECT_DOUBLE_EQ(round["first_to_last_oom_s"].get<double>(), t_last - t_first);
  EXPECT_LT(round["first_to_last_oom_s"].get<double>(), round["recovery_s"].get<double>());
  // A normal step: the clean steps at 4 between the OOM step and the raise, per round and pooled.
  std::vector<double> pooled;
  for (int r = 1; r <= 2; ++r) {
    const auto& rd = j["rounds"][r - 1];
    std::vector<double> normal;
    for (const auto& l : jsonl_of(runs / ("round" + std::to_string(r) + "_backoff") / "metrics.jsonl")) {
      if (l.contains("event")) continue;
      const int64_t s = l["step"].get<int64_t>();
      if (s > rd["oom_step"].get<int64_t>() && s <= rd["raised_after_step"].get<int64_t>() && l["micro_batch"] == 4 &&
          l["oom_retries"] == 0)
        normal.push_back(l["step_time_s"].get<double>());
    }
    ASSERT_FALSE(normal.empty());
    EXPECT_EQ(rd["normal_steps"].get<size_t>(), normal.size());
    EXPECT_DOUBLE_EQ(rd["normal_step_s"].get<double>(), median_of(normal));
    pooled.insert(pooled.end(), normal.begin(), normal.end());
  }
  EXPECT_DOUBLE_EQ(j["recovery"]["normal_step_s_pooled_median"].get<double>(), median_of(pooled));
  EXPECT_DOUBLE_EQ(round["step_before_cut_s"].get<double>(), a_steps[1]["step_time_s"].get<double>())
      << "with --warmup 2, step 2 is the one step before the cut that is not the first";

  // Grow-back: the raised limit fits the whole batch again; the compared steps are the last 3 of both runs.
  EXPECT_EQ(round["final_micro_batch"], 16);
  EXPECT_EQ(a_steps.back()["micro_batch"], 16);
  const int64_t total = j["options"]["steps_per_run"].get<int64_t>();
  EXPECT_EQ(static_cast<int64_t>(a_steps.size()), total);
  EXPECT_EQ(round["compared_steps"], json::array({total - 2, total}));
  EXPECT_LE(round["settled_at_step"].get<int64_t>(), total - 2);
  EXPECT_GT(round["settled_at_step"].get<int64_t>(), round["raised_after_step"].get<int64_t>());
  const auto b_lines = jsonl_of(runs / "round1_fresh" / "metrics.jsonl");
  std::vector<double> a_win, b_win;
  for (const auto& l : a_steps)
    if (l["step"].get<int64_t>() > total - 3) a_win.push_back(l["step_time_s"].get<double>());
  for (const auto& l : b_lines) {
    if (l.contains("event")) continue;
    EXPECT_EQ(l["micro_batch"], 16) << "the fresh run starts at the grown-back size and stays there";
    if (l["step"].get<int64_t>() > total - 3) b_win.push_back(l["step_time_s"].get<double>());
  }
  ASSERT_EQ(a_win.size(), 3u);
  ASSERT_EQ(b_win.size(), 3u);
  EXPECT_DOUBLE_EQ(round["backoff_run_step_time_s_p50"].get<double>(), median_of(a_win));
  EXPECT_DOUBLE_EQ(round["fresh_run_step_time_s_p50"].get<double>(), median_of(b_win));
  EXPECT_DOUBLE_EQ(round["step_time_ratio"].get<double>(), median_of(a_win) / median_of(b_win));
  EXPECT_EQ(round["fresh_run_ooms"], 0);
  EXPECT_GE(round["backoff_run_page_faults_per_step"].get<double>(), 0.0);
  EXPECT_GE(round["fresh_run_page_faults_per_step"].get<double>(), 0.0);
  EXPECT_GT(j["grow_back"]["throughput_ratio_median"].get<double>(), 0.0);
}

// --search bisect finds the largest size the exhaustive search finds on the tiny job, in fewer runs, and
// every verdict it lists is its run's own; the sizes within the window above the largest all fail.
TEST(BenchOom, BisectFindsWhatTheExhaustiveSearchFinds) {
  TempDir dir;
  const std::string cfg = testutil::source_dir() + "/configs/bench_oom_tiny.yaml";
  std::map<std::string, json> found;
  for (const std::string search : {"exhaustive", "bisect"}) {
    const auto runs = dir / ("runs_" + search);
    const auto out = (dir / (search + ".json")).string();
    auto r = testutil::run(bench_cmd("--oom --config " + cfg + " --rounds 1 --warmup 2 --steps 2 --search " + search +
                                     " --run-dir " + runs.string() + " --out " + out));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    found[search] = read_json(out)["auto_vs_exhaustive"];
    for (const auto& a : found[search]) {
      EXPECT_EQ(a["search"], search);
      for (const auto& t : a["searched"]) {
        const int64_t m = t["micro_batch"].get<int64_t>();
        bool oom = false;
        for (const auto& l : jsonl_of(runs / ("search_" + a["cap"].get<std::string>() + "_mb" + std::to_string(m)) /
                                      "metrics.jsonl"))
          oom = oom || l.value("event", "") == "oom";
        EXPECT_EQ(t["fits"].get<bool>(), !oom) << search << " " << a["cap"] << " " << m;
      }
    }
  }
  ASSERT_EQ(found["bisect"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const json &b = found["bisect"][i], &e = found["exhaustive"][i];
    const int64_t largest = b["largest_fitting_micro_batch"].get<int64_t>();
    EXPECT_EQ(largest, e["largest_fitting_micro_batch"].get<int64_t>()) << b["cap"];
    EXPECT_LE(b["searched"].size(), 5u + 2 * 4) << "log2(16) + 1 bisection runs and 4 either side";
    EXPECT_LT(b["searched"].size(), e["searched"].size()) << b["cap"];
    std::map<int64_t, bool> verdict;
    for (const auto& t : b["searched"]) verdict[t["micro_batch"].get<int64_t>()] = t["fits"].get<bool>();
    EXPECT_TRUE(verdict.at(largest));
    for (int64_t m = largest + 1; m <= std::min<int64_t>(16, largest + 4); ++m) EXPECT_FALSE(verdict.at(m)) << m;
  }
  auto r = testutil::run(bench_cmd("--oom --config " + cfg + " --search binary"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: bench --oom: --search must be exhaustive or bisect, got 'binary'");
}

TEST(BenchOom, BadArgumentsAreOneLineErrors) {
  TempDir dir;
  const std::string cfg = testutil::source_dir() + "/configs/bench_oom_tiny.yaml";
  auto r = testutil::run(bench_cmd("--oom --config " + cfg + " --set train.global_batch=3"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output),
            "error: bench --oom: train.global_batch must be at least 4 (the cut backs off to a quarter of it), got 3");
  r = testutil::run(bench_cmd("--oom --config " + cfg + " --rounds 0"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: bench --oom: --rounds must be >= 1, got 0");
  testutil::write_file(dir / "x", "");
  r = testutil::run(bench_cmd("--oom --config " + cfg + " --run-dir " + dir.str()));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: bench --oom: " + dir.str() + " is not empty; give --run-dir a new folder");
}

// scripts/gpu-check.sh, the GPU proof, in the CPU mode it takes on a host without a GPU: every phase
// runs on its small job and the summary holds their figures. The CUDA-only tests skip here, each named;
// none of them passes without a device. The script runs once for the suite, every phase (fixes too, which
// a GPU run names on its own), and each test reads what its phases wrote.
// It is rehearsed with the build that goes to a GPU host (scripts/bundle-gpu.sh takes a CUDA build): a
// build without CUDA never runs it, and its four minutes of set-up are spent on the CUDA build's leg.
#ifdef TRAINER_WITH_CUDA
constexpr bool kGpuCheckBuild = true;
#else
constexpr bool kGpuCheckBuild = false;
#endif
class GpuCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kGpuCheckBuild)
      GTEST_SKIP() << "the GPU window runs a CUDA build (scripts/bundle-gpu.sh); its CPU rehearsal runs with the "
                      "CUDA build's tests, not with this build's";
  }
  static void SetUpTestSuite() {
    if (!kGpuCheckBuild) return;
    dir_ = new TempDir("gpu_check");
    out_ = new std::string((*dir_ / "out").string());
    const std::string build = testutil::fs::path(testutil::trainer_bin()).parent_path().string();
    run_ = new testutil::CommandResult(testutil::run(
        "env TMPDIR=" + dir_->str() + " TRAINER_GPU_CHECK_MODE=cpu TRAINER_BUNDLE=" + (*dir_ / "no-bundle").string() +
        " TRAINER_BUILD=" + build + " TRAINER_PYTHON=" + testutil::python() + " TRAINER_GPU_PACK=" +
        (*dir_ / "pack").string() + " bash " + testutil::source_dir() + "/scripts/gpu-check.sh " + *out_ +
        " env tests profile cap speed llama compile jpeg fixes share summary"));
  }
  static void TearDownTestSuite() {
    delete run_;
    delete out_;
    delete dir_;
  }
  // A phase's exit code, from the record gpu-check.sh writes for it.
  static int phase_rc(const std::string& phase) {
    return read_json(*out_ + "/" + phase + ".phase.json")["rc"].get<int>();
  }
  static double op_count(const json& side, const std::string& op) { return side["op_counts_per_step"].value(op, 0.0); }
  static TempDir* dir_;
  static std::string* out_;
  static testutil::CommandResult* run_;
};
TempDir* GpuCheck::dir_ = nullptr;
std::string* GpuCheck::out_ = nullptr;
testutil::CommandResult* GpuCheck::run_ = nullptr;

TEST_F(GpuCheck, CpuModeRunsEveryPhaseAndWritesTheSummary) {
  const testutil::CommandResult& r = *run_;
  const std::string& out = *out_;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("== gpu-check (cpu): every phase passed"), std::string::npos) << r.output;
  const json s = read_json(out + "/summary.json");
  EXPECT_EQ(s["mode"], "cpu");
  for (const char* phase : {"env", "tests", "cap", "speed", "jpeg", "share"}) EXPECT_EQ(s["phases"][phase]["rc"], 0) << phase;
  // env names each Python module the later phases import, with its version: the reference Python has
  // PyYAML (bench/reference.py) and Pillow (jpeg), as the GPU hosts do.
  const std::string env_log = testutil::read_file(out + "/env.log");
  for (const char* module : {"yaml", "PIL", "torchvision", "transformers"})
    EXPECT_NE(env_log.find("python: " + std::string(module) + " "), std::string::npos) << module << ": " << env_log;
  for (const char* needed : {"python: yaml missing", "python: PIL missing"})
    EXPECT_EQ(env_log.find(needed), std::string::npos) << env_log;
  // The input path off and on (the fixes phase's `input` pairs): in CPU mode the same machinery with nothing
  // to overlap, so only that the figure is there.
  for (const char* job : {"resnet50", "gpt2"})
    EXPECT_GT(s["input_path"][job]["median_speedup_b"].get<double>(), 0.0) << job << ": " << s.value("input_path", json());

  EXPECT_GE(s["tests"]["run"].get<int>(), 20);
  EXPECT_TRUE(s["tests"]["failed"].empty()) << s["tests"];
  const auto& skipped = s["tests"]["skipped"];
  for (const char* cuda_only : {"GradScaler.CudaStepWithPlantedInf", "StepSnapshot.PutsBackTheCudaGeneratorOfTheDevice",
                                "ActivationCheckpointCuda.TransformerLayerWithDropoutGradientsEqualPlain"})
    EXPECT_NE(std::find(skipped.begin(), skipped.end(), cuda_only), skipped.end()) << cuda_only << " did not skip";

  // bench/cap_check.py's stages: the job's default search under the cut cap (verified against the sizes
  // above it), the curve and the doubling search under it and under a middle cap; each cuDNN policy's cut,
  // backoff and grow-back, the default's first; no target is judged on the CPU.
  const json& cap = s["cap"];
  EXPECT_TRUE(cap["failed"].empty()) << cap;
  EXPECT_TRUE(cap["skipped"].empty()) << cap;
  ASSERT_EQ(cap["auto"].size(), 2u) << cap;
  for (const auto& [limit, a] : cap["auto"].items())
    for (const char* how : {"default", "curve", "doubling"}) {
      if (std::string(how) == "default" && limit != "cut") continue;
      ASSERT_TRUE(a[how].is_object()) << limit << " " << how << ": " << a;
      EXPECT_GT(a[how]["micro_batch"].get<int64_t>(), 0) << limit << " " << how;
      EXPECT_EQ(a[how]["ooms_in_3_steps"], 0) << limit << " " << how;
    }
  EXPECT_FALSE(cap["default_policy"].get<std::string>().empty()) << cap["defaults"];
  EXPECT_TRUE(cap["policies"][cap["default_policy"].get<std::string>()].is_object()) << "the default's cut runs first";
  const json& verify = cap["auto"]["cut"]["verify"];
  ASSERT_TRUE(verify.is_object()) << cap["auto"];
  EXPECT_GE(verify["largest_fitting_micro_batch"].get<int64_t>(), cap["auto"]["cut"]["default"]["micro_batch"].get<int64_t>());
  EXPECT_GE(verify["largest_fitting_micro_batch"].get<int64_t>(), cap["auto"]["cut"]["curve"]["micro_batch"].get<int64_t>());
  ASSERT_TRUE(verify.contains("curve_fraction")) << verify;
  EXPECT_GE(verify["curve_fraction"].get<double>(), 0.9) << verify;
  EXPECT_GT(verify["default_fraction"].get<double>(), 0.0) << verify;
  for (const char* policy : {"always", "off", "start", "pretune", "settle"}) {
    ASSERT_TRUE(cap["policies"][policy].is_object()) << policy << ": " << cap["policies"];
    EXPECT_GT(cap["policies"][policy]["recovery_s"].get<double>(), 0.0) << policy;
    EXPECT_LT(cap["policies"][policy]["micro_batch_after"].get<int64_t>(), cap["global_batch"].get<int64_t>()) << policy;
  }
  EXPECT_TRUE(cap["policies"]["off"]["tuned_sizes"].empty()) << cap["policies"]["off"];
  for (const auto& [name, t] : cap["targets"].items()) EXPECT_TRUE(t["met"].is_null()) << name << ": " << t;
  EXPECT_FALSE(cap["report"]["failed_in"].empty()) << "the memory report names the phase: " << cap["report"];
  EXPECT_NE(cap["report"]["error"].get<std::string>().find("out of memory"), std::string::npos) << cap["report"];

  EXPECT_EQ(cap["cap_basis"], "allocated_peak") << "on the CPU reserved is allocated";
  // The speed jobs: every figure by wall time over at least 1 s of timed steps a side in CPU mode (3 s on
  // a GPU); the trainer again with train.cuda_graph=off (on the CPU the default is off too: the on arm is
  // recorded as skipped); torch.compile skipped in CPU mode, saying why.
  for (const char* job : {"speed_resnet50", "speed_gpt2"}) {
    const json& x = s[job];
    EXPECT_GT(x["speed_ratio"].get<double>(), 0.0) << job;
    EXPECT_EQ(x["basis"], "wall time over the timed steps") << job;
    EXPECT_EQ(x["per_round_speed_ratio"].size(), 2u) << job;
    EXPECT_TRUE(x["min_wall_met"].is_boolean()) << job;  // whether it was: timing, not asserted
    EXPECT_GE(x["timed_steps"].get<int64_t>(), 20) << job;
    EXPECT_TRUE(x["trainer_mfu"].is_null()) << job << ": no peak on a CPU";
    EXPECT_GE(x["first_step"]["since_model_built_s"].get<double>(), 0.0) << job;
    const json& g = x["cuda_graph_off"];
    ASSERT_TRUE(g.is_object()) << job << ": " << x;
    EXPECT_NE(g["on_arm"].get<std::string>().find("no CUDA device"), std::string::npos) << job;
    EXPECT_FALSE(x["compile"]["skipped"].get<std::string>().empty()) << job;
  }
  EXPECT_GT(s["speed_gpt2"]["trainer_tokens_per_s"].get<double>(), 0.0);
  // The floors: six, none judged on the CPU; the figures CPU mode measures are there.
  ASSERT_EQ(s["floors"].size(), 6u) << s["floors"];
  for (const auto& f : s["floors"]) {
    EXPECT_TRUE(f["met"].is_null()) << f;
    EXPECT_FALSE(f["floor"].get<std::string>().empty()) << f;
  }
  EXPECT_DOUBLE_EQ(s["floors"][0]["value"].get<double>(), s["speed_resnet50"]["speed_ratio"].get<double>());
  EXPECT_GT(s["floors"][3]["value"].get<double>(), 0.0) << "the recovery of the default policy's cut";
  EXPECT_GT(s["floors"][4]["value"].get<double>(), 0.0) << "the default search's time";

  // The JPEG phase: a folder made, packed, and trained from against synthetic data.
  const json& jp = s["jpeg"];
  EXPECT_GT(jp["packed_samples_per_s"].get<double>(), 0.0) << jp;
  EXPECT_GT(jp["synthetic_samples_per_s"].get<double>(), 0.0) << jp;
  EXPECT_DOUBLE_EQ(jp["ratio"].get<double>(),
                   jp["packed_samples_per_s"].get<double>() / jp["synthetic_samples_per_s"].get<double>());
  EXPECT_GE(jp["packed_data_wait_share"].get<double>(), 0.0) << jp;
  EXPECT_GT(jp["packed_run"]["cores_used"].get<double>(), 0.0) << jp;
  EXPECT_TRUE(jp["met"].is_null()) << "no target is judged on the CPU";
}

// The profile phase: both models' traces on both sides and the tables, the jobs as they are (the fixes
// phase measures each candidate fix).
TEST_F(GpuCheck, ProfilePhaseInCpuModeWritesBothTables) {
  const std::string& out = *out_;
  ASSERT_EQ(phase_rc("profile"), 0) << run_->output << testutil::read_file(out + "/profile.log");
  for (const char* job : {"resnet50", "gpt2"}) {
    const json t = read_json(out + "/profile_" + job + ".json");
    EXPECT_EQ(t["kind"], "cpu") << job;
    const json& a = t["sides"]["trainer"];
    const json& b = t["sides"]["python"];
    EXPECT_EQ(a["steps"], b["steps"]) << job;
    for (const char* op : {"aten::convolution", "aten::batch_norm", "aten::addmm", "aten::layer_norm"})
      EXPECT_EQ(op_count(a, op), op_count(b, op)) << job << " " << op;
    EXPECT_NE(testutil::read_file(out + "/profile_" + std::string(job) + ".md").find("| per step | trainer | python |"),
              std::string::npos)
        << job;
  }
  EXPECT_EQ(op_count(read_json(out + "/profile_resnet50.json")["sides"]["trainer"], "aten::convolution"), 20)
      << "CPU mode profiles ResNet-18";
}

// The fixes phase: every switch measured off and on through bench/ab.py, each side's runs made with the
// setting it names (read back from the run's own resolved config).
TEST_F(GpuCheck, FixesPhaseInCpuModeRunsEachSwitchOffAndOn) {
  const std::string& out = *out_;
  ASSERT_EQ(phase_rc("fixes"), 0) << run_->output << testutil::read_file(out + "/fixes.log");
  struct Case {
    const char* file;
    const char* a;
    const char* b;
  };
  for (const Case& c : {Case{"resnet50_snapshot", "snapshot: \"per_buffer\"", "snapshot: \"batched\""},
                        Case{"resnet50_optimizer", "implementation: \"auto\"", "implementation: \"foreach\""},
                        Case{"gpt2_optimizer", "implementation: \"auto\"", "implementation: \"foreach\""},
                        Case{"gpt2_vocab", "vocab_multiple: 1\n", "vocab_multiple: 64\n"},
                        Case{"gpt2_fused_bias", "fused_bias: false\n", "fused_bias: true\n"},
                        Case{"resnet50_input", "fetch_ahead: \"off\"", "fetch_ahead: \"on\""},
                        Case{"gpt2_input", "fetch_ahead: \"off\"", "fetch_ahead: \"on\""}}) {
    const json j = read_json(out + "/fixes_" + c.file + ".json");
    ASSERT_EQ(j["rounds"].size(), 1u) << c.file;
    EXPECT_GT(j["median_speedup_b"].get<double>(), 0.0) << c.file;
    const json& round = j["rounds"][0];
    auto config_of = [&](const char* side) {
      return read_json(round[side]["file"].get<std::string>())["config_yaml"].get<std::string>();
    };
    EXPECT_NE(config_of("a").find(c.a), std::string::npos) << c.file;
    EXPECT_NE(config_of("b").find(c.b), std::string::npos) << c.file;
    // By wall time over the timed steps, as every speed figure; the step-time ratio beside it.
    EXPECT_EQ(j["schema"], "trainer-bench-ab/2");
    EXPECT_DOUBLE_EQ(round["speedup_b"].get<double>(), round["b"]["samples_per_s_aggregate"].get<double>() /
                                                          round["a"]["samples_per_s_aggregate"].get<double>());
    EXPECT_DOUBLE_EQ(round["speedup_b_step_p50"].get<double>(),
                     round["a"]["step_time_s_p50"].get<double>() / round["b"]["step_time_s_p50"].get<double>());
  }
  // The input pairs' sides: uint8 batches and the fetch-ahead on one side only.
  for (const char* job : {"resnet50_input", "gpt2_input"}) {
    const json round = read_json(out + "/fixes_" + job + ".json")["rounds"][0];
    EXPECT_NE(read_json(round["a"]["file"].get<std::string>())["config_yaml"].get<std::string>().find(
                  "uint8_batches: \"off\""), std::string::npos) << job;
    EXPECT_NE(read_json(round["b"]["file"].get<std::string>())["config_yaml"].get<std::string>().find(
                  "uint8_batches: \"on\""), std::string::npos) << job;
  }
}

// The share phase: two jobs on one device, both `memory.limit: auto`, the second started while the first
// trains; neither crashes nor loses a step, and the summary carries the check's own result.
TEST_F(GpuCheck, SharePhaseInCpuModeRunsTwoJobsAndLosesNoStep) {
  ASSERT_EQ(phase_rc("share"), 0) << run_->output << testutil::read_file(*out_ + "/share.log");
  const json j = read_json(*out_ + "/share.json");
  EXPECT_TRUE(j["passed"].get<bool>()) << j.dump(1);
  EXPECT_FALSE(j["crashed"].get<bool>());
  EXPECT_FALSE(j["lost_steps"].get<bool>());
  for (const char* job : {"a", "b"}) {
    const json& x = j["jobs"][job];
    EXPECT_EQ(x["exit_code"], 0) << job;
    EXPECT_EQ(x["last_step"], x["steps_configured"]) << job;
    EXPECT_EQ(x["missing_count"], 0) << job;
    const std::string source = x["start"]["limit_source"].get<std::string>();
    EXPECT_TRUE(source == "host" || source == "container") << job << ": auto on the CPU, resolved from " << source;
  }
  EXPECT_EQ(read_json(*out_ + "/summary.json")["share"]["passed"], true);
}

// The Llama-family row: the trainer against transformers' LlamaForCausalLM of the same shape (llama_tiny in
// CPU mode), one round after the calibration, by wall time; the summary carries it beside the floors.
TEST_F(GpuCheck, LlamaPhaseInCpuModeComparesWithTransformers) {
  ASSERT_EQ(phase_rc("llama"), 0) << run_->output << testutil::read_file(*out_ + "/llama.log");
  const json r = read_json(*out_ + "/llama_speed.json");
  EXPECT_EQ(r["model"], "llama_tiny") << r.dump(1);
  ASSERT_EQ(r["rounds"].size(), 1u) << r.dump(1);
  EXPECT_GE(r["steps"].get<int64_t>(), 20);
  const json x = read_json(*out_ + "/summary.json")["speed_llama"];
  ASSERT_TRUE(x.is_object()) << x;
  EXPECT_GT(x["speed_ratio"].get<double>(), 0.0) << x;
  EXPECT_DOUBLE_EQ(x["speed_ratio"].get<double>(), r["speed_ratio"].get<double>());
  EXPECT_GT(x["trainer_tokens_per_s"].get<double>(), 0.0) << x;
  EXPECT_GT(x["python_tokens_per_s"].get<double>(), 0.0) << x;
  EXPECT_EQ(x["basis"], "wall time over the timed steps") << x;
  EXPECT_FALSE(x.contains("compile")) << "torch.compile is measured for the speed phase's jobs only: " << x;
  EXPECT_NE(x["versions"]["python"].dump().find("transformers"), std::string::npos)
      << "the reference is transformers' model: " << x["versions"];
}

// With TRAINER_GPU_PACK, every phase's small files are packed as soon as it ends, without checkpoints or
// datasets, and the summary beside them is the last one written.
TEST_F(GpuCheck, EachPhaseIsPackedWithItsRecordAndTheSummaryIsKeptCurrent) {
  const std::string pack = (*dir_ / "pack").string();
  for (const char* phase : {"env", "tests", "profile", "cap", "speed", "llama", "compile", "jpeg", "fixes", "share"}) {
    const std::string tgz = pack + "/" + phase + ".tgz";
    ASSERT_TRUE(testutil::fs::exists(tgz)) << tgz;
    const auto list = testutil::run("tar -tzf " + tgz);
    ASSERT_EQ(list.exit_code, 0) << list.output;
    EXPECT_NE(list.output.find("./" + std::string(phase) + ".phase.json"), std::string::npos) << phase << ": " << list.output;
    EXPECT_EQ(list.output.find("/checkpoints/"), std::string::npos) << phase;
    EXPECT_EQ(list.output.find("jpeg_src/"), std::string::npos) << phase;
  }
  for (const char* job : {"resnet50", "gpt2"}) {
    const auto list = testutil::run("tar -tf " + pack + "/traces_" + job + ".tar");
    EXPECT_NE(list.output.find("profile_" + std::string(job) + ".trainer.trace.json.gz"), std::string::npos) << list.output;
    EXPECT_NE(list.output.find("profile_" + std::string(job) + ".python.trace.json.gz"), std::string::npos) << list.output;
  }
  EXPECT_EQ(testutil::read_file(pack + "/summary.json"), testutil::read_file(*out_ + "/summary.json"));
}

// scripts/py-wheels.py, how the GPU window gives the host's Python the transformers it lacks: a wheel whose
// modules that Python lacks is unpacked (its version readable through importlib.metadata), one whose modules
// it has is left out (here a wheel of `json`, which would break the interpreter if it were unpacked first).
TEST(PyWheels, UnpacksOnlyWhatThePythonLacks) {
  TempDir dir("py_wheels");
  const std::string py = testutil::python();
  const std::string make =
      "import sys, zipfile\n"
      "d = sys.argv[1]\n"
      "with zipfile.ZipFile(d + '/trainer_wheel_probe-1.2.3-py3-none-any.whl', 'w') as z:\n"
      "    z.writestr('trainer_wheel_probe/__init__.py', 'VALUE = 7\\n')\n"
      "    z.writestr('trainer_wheel_probe-1.2.3.dist-info/METADATA',\n"
      "               'Metadata-Version: 2.1\\nName: trainer-wheel-probe\\nVersion: 1.2.3\\n')\n"
      "with zipfile.ZipFile(d + '/json-0.1-py3-none-any.whl', 'w') as z:\n"
      "    z.writestr('json/__init__.py', 'raise ImportError(\"the wheel shadowed json\")\\n')\n";
  testutil::write_file(dir / "make.py", make);
  ASSERT_EQ(testutil::run(py + " " + (dir / "make.py").string() + " " + dir.str()).exit_code, 0);
  const std::string dest = (dir / "lib").string();
  const std::string script = testutil::source_dir() + "/scripts/py-wheels.py";
  auto r = testutil::run(py + " " + script + " " + dest + " " + (dir / "trainer_wheel_probe-1.2.3-py3-none-any.whl").string() +
                         " " + (dir / "json-0.1-py3-none-any.whl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("unpacked into " + dest + ": trainer_wheel_probe; already importable: json"), std::string::npos)
      << r.output;
  EXPECT_FALSE(testutil::fs::exists(dir / "lib" / "json"));
  r = testutil::run("env PYTHONPATH=" + dest + " " + py +
                    " -c 'import importlib.metadata as m, json, trainer_wheel_probe as p; "
                    "print(p.VALUE, m.version(\"trainer-wheel-probe\"), json.dumps([1]))'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(last_line(r.output), "7 1.2.3 [1]");

  testutil::write_file(dir / "broken-1.0-py3-none-any.whl", "not a zip");
  r = testutil::run(py + " " + script + " " + dest + " " + (dir / "broken-1.0-py3-none-any.whl").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: wheel " + (dir / "broken-1.0-py3-none-any.whl").string() +
                                     ": File is not a zip file");
}

}  // namespace test_bench
