// A language model through the executable: the token stream, the token-weighted loss, per-layer
// activation checkpointing with dropout, and a resume that draws the same dropout masks.
#include <gtest/gtest.h>

#include "train_util.h"

using testutil::TempDir;

namespace {

// gpt_tiny with dropout on a small byte stream, checkpoints every 2 steps.
std::string job(const std::string& data_dir, int64_t steps, const std::string& extra = "") {
  return "--config " + testutil::source_dir() + "/configs/gpt_tiny_fortunes.yaml --set data.train=" + data_dir +
         "/train.h5 --set data.test=" + data_dir + "/val.h5 --set model.context=16 --set model.dropout=0.1"
         " --set train.global_batch=4 --set train.steps=" + std::to_string(steps) +
         " --set train.eval_every=0 --set train.eval_batch=8 --set train.eval_batches=2 --set train.threads=1"
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set schedule.warmup_steps=0 --set schedule.name=constant --set log.every=1000 " + extra;
}

std::string make_data(const TempDir& dir) {
  const auto text = dir / "text.txt";
  std::string s;
  for (int i = 0; i < 400; ++i) s += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ".\n";
  testutil::write_file(text, s);
  const auto out = (dir / "tokens").string();
  auto r = testutil::run(testutil::trainer_bin() + " convert-text --src " + text.string() + " --out " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

}  // namespace

TEST(TokensE2E, CheckpointedDropoutRunResumesBitwise) {
  TempDir dir;
  const auto data = make_data(dir);
  auto whole = (dir / "whole").string(), stopped = (dir / "stopped").string(), plain = (dir / "plain").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, job(data, 8, "--set memory.activation_checkpointing=all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The same run without checkpointing: the recomputed layers draw the same dropout masks.
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(plain, job(data, 8))).exit_code, 0);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(whole), testutil::final_weights(plain)), 1e-6);

  // A 4-step run, then the same command asking for 8 steps continues from its checkpoint (a constant
  // schedule: a cosine one depends on the total).
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(stopped, job(data, 4, "--set memory.activation_checkpointing=all"))).exit_code, 0);
  auto r2 = testutil::run(testutil::trainer_cmd(stopped, job(data, 8, "--set memory.activation_checkpointing=all")));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(stopped)));

  auto steps = testutil::step_lines(whole);
  ASSERT_EQ(steps.size(), 8u);
  for (auto& s : steps) {
    EXPECT_EQ(s["tokens_per_s"].get<double>(), s["samples_per_s"].get<double>() * 16);
    EXPECT_TRUE(std::isfinite(s["loss"].get<double>()));
  }
  EXPECT_LT(steps.back()["loss"].get<double>(), steps.front()["loss"].get<double>());
  auto evals = testutil::events(whole, "eval");
  ASSERT_EQ(evals.size(), 1u);
  EXPECT_EQ(evals[0]["samples"].get<int64_t>(), 2 * 8 * 16) << "eval_batches x eval_batch x context tokens";
}
