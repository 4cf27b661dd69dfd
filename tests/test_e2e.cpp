// The executable end to end: short runs, metrics.jsonl, the run folder, dry-run, and the one-line
// errors for bad input.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "test_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_e2e {

using nlohmann::json;
using testutil::TempDir;

namespace {

std::vector<json> read_jsonl(const std::string& path) {
  std::vector<json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// A small synthetic job: ResNet-20 on 1x16x16 samples, fast on 2 cores.
std::string small_job(const std::string& run_dir, const std::string& extra = "") {
  return testutil::trainer_bin() + " --run-dir " + run_dir +
         " --set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=256 --set data.test= --set train.global_batch=16 --set train.epochs=0"
         " --set train.steps=6 --set log.every=2 --set checkpoint.every_seconds=0"
         " --set train.threads=1 --set data.workers=1 " +
         extra;
}

// Runs a command expected to fail on bad input: exit code 2, and the last line of the output is the one
// "error: ..." line, naming `fragment` (informational log lines may come before it).
void expect_bad_input(const std::string& cmd, const std::string& fragment) {
  auto r = testutil::run(cmd);
  EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  std::string last = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  EXPECT_EQ(last.rfind("error: ", 0), 0u) << "the last line is the error:\n" << r.output;
  EXPECT_NE(last.find(fragment), std::string::npos) << cmd << "\n" << r.output;
  EXPECT_EQ(out.find("error: "), out.rfind("error: ")) << "one error line:\n" << r.output;
}

}  // namespace

TEST(E2E, ShortRunWritesMetricsAndRunFolder) {
  TempDir dir;
  auto run_dir = (dir / "run").string();
  auto r = testutil::run(small_job(run_dir));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = read_jsonl(run_dir + "/metrics.jsonl");
  std::vector<json> steps;
  for (const auto& l : lines)
    if (!l.contains("event")) steps.push_back(l);
  ASSERT_EQ(steps.size(), 6u);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    for (const char* k : {"step", "epoch", "loss", "lr", "samples_seen", "micro_batch", "accum_steps", "samples_per_s",
                          "step_time_s", "mem_peak_bytes"})
      EXPECT_TRUE(s.contains(k)) << k << " missing in " << s.dump();
    EXPECT_EQ(s["step"].get<int64_t>(), static_cast<int64_t>(i + 1));
    EXPECT_EQ(s["samples_seen"].get<int64_t>(), 16 * static_cast<int64_t>(i + 1));
    EXPECT_EQ(s["micro_batch"].get<int64_t>(), 16);
    EXPECT_EQ(s["accum_steps"].get<int64_t>(), 1);
    EXPECT_TRUE(std::isfinite(s["loss"].get<double>()));
    EXPECT_GT(s["mem_peak_bytes"].get<int64_t>(), 0);
    EXPECT_GT(s["samples_per_s"].get<double>(), 0);
  }
  bool has_start = false, has_end = false;
  for (const auto& l : lines) {
    if (l.value("event", "") == "start") has_start = true;
    if (l.value("event", "") == "end") has_end = true;
  }
  EXPECT_TRUE(has_start && has_end);
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/resolved_config.yaml"));
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/train.log"));
  auto resolved = testutil::read_file(run_dir + "/resolved_config.yaml");
  EXPECT_NE(resolved.find("global_batch: 16"), std::string::npos) << resolved;
}

TEST(E2E, MicroBatchesKeepTheGlobalBatch) {
  TempDir dir;
  auto run_dir = (dir / "run").string();
  // 16 = 5 + 5 + 5 + 1: an uneven split.
  auto r = testutil::run(small_job(run_dir, "--set train.micro_batch=5"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& l : read_jsonl(run_dir + "/metrics.jsonl")) {
    if (l.contains("event")) continue;
    EXPECT_EQ(l["micro_batch"].get<int64_t>(), 5);
    EXPECT_EQ(l["accum_steps"].get<int64_t>(), 4);
    EXPECT_EQ(l["samples_seen"].get<int64_t>(), 16 * l["step"].get<int64_t>());
  }
}

TEST(E2E, DryRunPrintsConfigAndSummary) {
  auto r = testutil::run(testutil::trainer_bin() + " --dry-run --set model.name=resnet50 --set data.kind=synthetic"
                                                   " --set data.shape=[3,224,224] --set model.num_classes=1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("name: \"resnet50\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("25,557,032"), std::string::npos) << r.output;  // torchvision's count
}

TEST(E2E, BadInputIsOneLineAndExitCode2) {
  TempDir dir;
  const auto bin = testutil::trainer_bin();
  expect_bad_input(bin + " --config /nonexistent.yaml", "/nonexistent.yaml");
  testutil::write_file(dir / "typo.yaml", "train:\n  global_bach: 3\n");
  expect_bad_input(bin + " --dry-run --config " + (dir / "typo.yaml").string(), "train.global_bach");
  expect_bad_input(bin + " --dry-run --set model.name=resnet7 --set data.kind=synthetic", "resnet7");
  // A model's TORCH_CHECK reaches the user as its message alone, without LibTorch's C++ backtrace.
  const std::string vit = bin + " --dry-run --set model.name=vit_tiny --set data.kind=synthetic --set data.shape=[3,32,32]";
  expect_bad_input(vit, "ViT: expected a sample shape (3, 28, 28), got [3, 32, 32]");
  EXPECT_EQ(testutil::run(vit).output, "error: ViT: expected a sample shape (3, 28, 28), got [3, 32, 32]\n");
  expect_bad_input(bin + " --run-dir " + (dir / "r1").string() + " --set data.train=/nope/train.h5", "/nope/train.h5");
  // A run folder under a regular file cannot be created, even by root.
  testutil::write_file(dir / "file", "x");
  expect_bad_input(small_job((dir / "file" / "run").string()), (dir / "file").string());
  expect_bad_input(bin + " --bogus-flag", "bogus");
}

// memory.activation_checkpointing: all holds from the first step, not from the second (a regression: the
// policy used to be applied only after a step had run). Reference: the same step without checkpointing.
TEST(E2E, CheckpointingPolicyHoldsFromTheFirstStep) {
  testutil::TempDir dir;
  auto first_peak = [&](const std::string& policy) {
    const std::string run_dir = (dir / policy).string();
    auto r = testutil::run(small_job(run_dir, "--set train.steps=1 --set data.shape=[1,28,28] "
                                              "--set memory.activation_checkpointing=" + policy));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (const auto& l : read_jsonl(run_dir + "/metrics.jsonl"))
      if (!l.contains("event")) return l["mem_peak_bytes"].get<int64_t>();
    return int64_t{0};
  };
  const int64_t none = first_peak("none"), all = first_peak("all");
  ASSERT_GT(none, 0);
  // ResNet-20 keeps about a third of its activations when every stage block is recomputed.
  EXPECT_LT(all, none * 8 / 10) << "none " << none << ", all " << all;
}

}  // namespace test_e2e
