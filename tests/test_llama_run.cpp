// A Llama-family model through the executable, with what the runner does for every model: gradient
// accumulation, per-layer activation checkpointing (recomputed layers draw the same dropout masks), a run
// cut and resumed bit for bit, train.sample_every, `trainer eval` and `trainer sample` on the run, and the
// OOM ladder under a real cap (the capped CPU allocator) keeping the experiment.
#include <gtest/gtest.h>

#include <csignal>
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

// The limit cut through control.yaml in the middle of a run: the run backs off, loses no step, and grows
// back to the whole micro-batch once the limit is raised again.
TEST(LlamaRun, ACutCapMidRunBacksOffAndGrowsBack) {
  TempDir dir;
  const std::string base = cap_job("--set memory.grow_after=3 --set memory.headroom=0.0");
  const auto p4 = (dir / "p4").string(), p16 = (dir / "p16").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(p4, base + " --set train.steps=1 --set train.micro_batch=4")).exit_code, 0);
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(p16, base + " --set train.steps=1 --set train.micro_batch=16")).exit_code, 0);
  const int64_t cap = (first_peak(p4) + first_peak(p16)) / 2, steps = 40;
  const auto run_dir = (dir / "run").string();
  const pid_t pid = testutil::spawn(testutil::trainer_cmd(run_dir, base + " --set train.steps=" + std::to_string(steps)),
                                    (dir / "log.txt").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](auto& l) { return testutil::last_step(l) >= 5; }));
  testutil::write_file(dir / "run" / "control.yaml", "memory:\n  limit: " + std::to_string(cap) + "\n");
  const bool cut_felt = testutil::wait_for_metrics(run_dir, [](auto& lines) {
    for (auto& l : lines)
      if (l.value("event", "") == "oom") return true;
    return false;
  });
  const int64_t step_at_raise = testutil::last_step(testutil::read_jsonl(run_dir + "/metrics.jsonl"));
  testutil::write_file(dir / "run" / "control.yaml", "memory:\n  limit: 1GiB\n");
  ASSERT_EQ(testutil::wait_exit(pid), 0) << testutil::read_file(dir / "log.txt");
  ASSERT_TRUE(cut_felt) << "no OOM after the limit was cut";
  ASSERT_LT(step_at_raise, steps) << "the run ended before the limit was raised; make the run longer";
  const auto s = testutil::step_lines(run_dir);
  ASSERT_EQ(static_cast<int64_t>(s.size()), steps) << "no step lost";
  int64_t smallest = 16;
  for (const auto& l : s) smallest = std::min<int64_t>(smallest, l["micro_batch"].get<int64_t>());
  EXPECT_LE(smallest, 8) << "backed off under the cut";
  EXPECT_EQ(s.back()["micro_batch"].get<int64_t>(), 16) << "grew back after the raise";
  EXPECT_GE(testutil::events(run_dir, "limit_changed").size(), 2u);
}

// Killed (SIGKILL) after step 10 and started again with the same command: the run resumes from a
// checkpoint and ends with the uninterrupted run's weights and losses, bit for bit.
TEST(LlamaRun, SigkillThenRestartIsBitwiseTheUninterruptedRun) {
  TempDir dir;
  const std::string job = cap_job("--set train.steps=30 --set model.dropout=0.1 --set train.deterministic=true"
                                  " --set checkpoint.every_steps=2 --set train.global_batch=8");
  const auto whole = (dir / "whole").string(), killed = (dir / "killed").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, job)).exit_code, 0);
  const pid_t pid = testutil::spawn(testutil::trainer_cmd(killed, job), (dir / "killed.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(killed, [](auto& l) { return testutil::last_step(l) >= 10; }));
  kill(pid, SIGKILL);
  ASSERT_EQ(testutil::wait_exit(pid), 128 + SIGKILL) << "the run finished before the kill; make it longer";
  const auto r = testutil::run(testutil::trainer_cmd(killed, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(testutil::events(killed, "resume").size(), 1u);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(killed)));
  const auto a = testutil::step_lines(whole), b = testutil::step_lines(killed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
}

}  // namespace test_llama_run
