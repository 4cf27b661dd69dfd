// A Llama-family model through the executable, with what the runner does for every model: gradient
// accumulation, per-layer activation checkpointing (recomputed layers draw the same dropout masks), a run
// cut and resumed bit for bit, train.sample_every, `trainer eval` and `trainer sample` on the run, and the
// OOM ladder under a real cap (the capped CPU allocator) keeping the experiment.
#include <gtest/gtest.h>

#include <cmath>

#include "train_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_llama_run {

using testutil::TempDir;
namespace fs = std::filesystem;

namespace {

// llama_tiny (4 query heads over 2 key/value heads) with attention dropout on a small byte stream,
// micro-batches of 2 in a global batch of 4, checkpoints every 2 steps, a sample every 4.
std::string job(const std::string& data_dir, int64_t steps, const std::string& extra = "") {
  return "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --set data.train=" + data_dir +
         "/train.h5 --set data.test=" + data_dir + "/val.h5 --set model.context=16 --set model.dropout=0.1"
         " --set train.global_batch=4 --set train.micro_batch=2 --set train.steps=" + std::to_string(steps) +
         " --set train.eval_every=0 --set train.eval_batch=8 --set train.eval_batches=2 --set train.threads=1"
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set schedule.warmup_steps=0 --set schedule.name=constant --set log.every=1000"
         " --set train.sample_every=4 --set train.sample_tokens=8 --set 'train.sample_prompt=The ' " + extra;
}


}  // namespace

TEST(LlamaRun, AccumulatedCheckpointedRunResumesBitwiseAndSamples) {
  TempDir dir;
  const auto data = testutil::fox_tokens(dir);
  const auto whole = (dir / "whole").string(), cut = (dir / "cut").string(), plain = (dir / "plain").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, job(data, 8, "--set memory.activation_checkpointing=all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Without checkpointing: the recomputed layers drew the same dropout masks.
  r = testutil::run(testutil::trainer_cmd(plain, job(data, 8)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(whole), testutil::final_weights(plain)), 1e-6);
  // Cut at step 4 and resumed: the same weights, bit for bit, and the same samples.
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(cut, job(data, 4, "--set memory.activation_checkpointing=all"))).exit_code, 0);
  r = testutil::run(testutil::trainer_cmd(cut, job(data, 8, "--set memory.activation_checkpointing=all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(cut)));

  const auto steps = testutil::step_lines(whole);
  ASSERT_EQ(steps.size(), 8u);
  for (const auto& s : steps) EXPECT_EQ(s["micro_batch"].get<int64_t>(), 2);
  EXPECT_LT(steps.back()["loss"].get<double>(), steps.front()["loss"].get<double>());
  EXPECT_NEAR(steps.front()["loss"].get<double>(), std::log(256.0), 0.5) << "a fresh model: about ln V";
  const auto samples = testutil::events(whole, "sample"), again = testutil::events(cut, "sample");
  ASSERT_EQ(samples.size(), 2u);
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(samples[1]["text"], again[1]["text"]);
  EXPECT_EQ(samples[0]["text"].get<std::string>().rfind("The", 0), 0u) << samples[0];

  // trainer eval on the run, and greedy trainer sample with the cache and without: the same tokens.
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + whole);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<nlohmann::json> drawn;
  for (const char* cache : {"", " --no-kv-cache"}) {
    const auto json = dir / "sample.json";
    r = testutil::run(testutil::trainer_bin() + " sample --run-dir " + whole + " --prompt 'The quick' --tokens 12 "
                      "--temperature 0 --json " + json.string() + cache);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    drawn.push_back(nlohmann::json::parse(testutil::read_file(json)));
  }
  EXPECT_EQ(drawn[0]["model"], "llama_tiny");
  EXPECT_EQ(drawn[0]["n_kv_head"], 2);
  EXPECT_EQ(drawn[0]["samples"][0]["tokens"], drawn[1]["samples"][0]["tokens"]);
}

namespace {

// llama_tiny on synthetic tokens, global batch 16 of 32 tokens.
std::string cap_job(const std::string& extra) {
  return "--set model.name=llama_tiny --set data.kind=synthetic --set model.context=32 --set data.synthetic_size=64"
         " --set data.test= --set train.global_batch=16 --set train.epochs=0 --set optim.name=sgd --set optim.lr=0.1"
         " --set schedule.warmup_steps=0 --set schedule.name=constant --set checkpoint.every_seconds=0"
         " --set log.every=1000 --set seed=5 --set train.threads=1 " + extra;
}

int64_t first_peak(const std::string& run_dir) {
  const auto steps = testutil::step_lines(run_dir);
  return steps.empty() ? 0 : steps[0]["mem_peak_bytes"].get<int64_t>();
}

}  // namespace

// Under a cap between the peaks of micro-batches 4 and 16, the run backs off and sees the same samples
// with the same losses as the uncapped run, ending with the same weights.
TEST(LlamaRun, UnderACapBacksOffAndKeepsTheExperiment) {
  TempDir dir;
  const auto p4 = (dir / "p4").string(), p16 = (dir / "p16").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(p4, cap_job("--set train.steps=1 --set train.micro_batch=4"))).exit_code, 0);
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(p16, cap_job("--set train.steps=1 --set train.micro_batch=16"))).exit_code, 0);
  const int64_t small = first_peak(p4), large = first_peak(p16);
  ASSERT_GT(large, small + 500000) << "the test needs a clear gap between micro-batches 4 and 16";
  const int64_t cap = (small + large) / 2;

  const auto free_dir = (dir / "free").string(), capped = (dir / "capped").string();
  auto r = testutil::run(testutil::trainer_cmd(free_dir, cap_job("--set train.steps=3")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(capped, cap_job("--set train.steps=3 --set memory.limit=" + std::to_string(cap))));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_GE(testutil::events(capped, "oom").size(), 1u) << "the cap must have been hit";
  const auto a = testutil::step_lines(free_dir), b = testutil::step_lines(capped);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a[i]["batch_hash"], b[i]["batch_hash"]) << "step " << i + 1;
    EXPECT_LT(b[i]["micro_batch"].get<int64_t>(), 16);
    EXPECT_LE(b[i]["mem_peak_bytes"].get<int64_t>(), cap);
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5);
  }
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(free_dir), testutil::final_weights(capped)), 1e-5);
}

}  // namespace test_llama_run
