// A language model through the executable: the token stream, the token-weighted loss, per-layer
// activation checkpointing with dropout, a resume that draws the same dropout masks; `convert-bin`,
// dry runs without a dataset, synthetic tokens (resumed exactly, and the same in bench/reference.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "data/files/token_h5.h"
#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/run/from_config.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_tokens_e2e {

using testutil::TempDir;
namespace fs = std::filesystem;

namespace {

// gpt_tiny with dropout on a small byte stream, checkpoints every 2 steps.
std::string token_job(const std::string& data_dir, int64_t steps, const std::string& extra = "") {
  return "--config " + testutil::source_dir() + "/configs/gpt_tiny_fortunes.yaml --set data.train=" + data_dir +
         "/train.h5 --set data.test=" + data_dir + "/val.h5 --set model.context=16 --set model.dropout=0.1"
         " --set train.global_batch=4 --set train.steps=" + std::to_string(steps) +
         " --set train.eval_every=0 --set train.eval_batch=8 --set train.eval_batches=2 --set train.threads=1"
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set schedule.warmup_steps=0 --set schedule.name=constant --set log.every=1000 " + extra;
}


}  // namespace

TEST(TokensE2E, CheckpointedDropoutRunResumesBitwise) {
  TempDir dir;
  const auto data = testutil::fox_tokens(dir);
  auto whole = (dir / "whole").string(), stopped = (dir / "stopped").string(), plain = (dir / "plain").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, token_job(data, 8, "--set memory.activation_checkpointing=all")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The same run without checkpointing: the recomputed layers draw the same dropout masks.
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(plain, token_job(data, 8))).exit_code, 0);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(whole), testutil::final_weights(plain)), 1e-6);

  // A 4-step run, then the same command asking for 8 steps continues from its checkpoint (a constant
  // schedule: a cosine one depends on the total).
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(stopped, token_job(data, 4, "--set memory.activation_checkpointing=all"))).exit_code, 0);
  auto r2 = testutil::run(testutil::trainer_cmd(stopped, token_job(data, 8, "--set memory.activation_checkpointing=all")));
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

namespace {

std::string last_line(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s.substr(s.rfind('\n') + 1);
}

int64_t count_lines(const std::string& out) { return std::count(out.begin(), out.end(), '\n'); }

void write_uint16(const fs::path& path, const std::vector<uint16_t>& tokens) {
  std::ofstream f(path, std::ios::binary);
  for (uint16_t t : tokens) {
    const char le[2] = {static_cast<char>(t & 0xff), static_cast<char>(t >> 8)};
    f.write(le, 2);
  }
}

// gpt_tiny on synthetic tokens, checkpoints every 2 steps.
std::string synthetic_job(int64_t steps) {
  return "--config " + testutil::source_dir() + "/configs/bench_gpt2_small_synthetic.yaml --set model.name=gpt_tiny"
         " --set model.vocab_size=300 --set model.context=16 --set model.dropout=0.1 --set data.synthetic_size=10"
         " --set train.global_batch=4 --set train.device=cpu --set amp.enabled=false --set train.threads=1"
         " --set train.steps=" + std::to_string(steps) + " --set train.deterministic=true --set checkpoint.every_steps=2"
         " --set schedule.name=constant --set schedule.warmup_steps=0 --set log.every=1000";
}

}  // namespace

// The command writes what data::TokenDataset reads back; a bad file is one line naming the command.
TEST(TokensE2E, ConvertBinCommand) {
  TempDir dir;
  const std::vector<uint16_t> train = {0, 1, 50256, 300, 42}, val = {7, 50000};
  write_uint16(dir / "train.bin", train);
  write_uint16(dir / "val.bin", val);
  const std::string out = (dir / "owt").string();
  auto r = testutil::run(testutil::trainer_bin() + " convert-bin --src " + (dir / "train.bin").string() + "," +
                         (dir / "val.bin").string() + " --vocab 50257 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(last_line(r.output), "converted " + (dir / "val.bin").string() + " -> " + out + "/val.h5: 2 tokens (vocab 50257)");
  for (const auto& [name, want] : {std::pair{"train", train}, std::pair{"val", val}}) {
    data::TokenDataset ds(out + "/" + name + ".h5", false);
    EXPECT_EQ(ds.vocab_size(), 50257);
    EXPECT_TRUE(torch::equal(ds.slice(0, ds.size()), torch::tensor(std::vector<int64_t>(want.begin(), want.end()))));
  }

  r = testutil::run(testutil::trainer_bin() + " convert-bin --src " + (dir / "train.bin").string() + " --vocab 1000 --out " + out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_EQ(last_line(r.output), "error: convert-bin: token 50256 at position 2 of '" + (dir / "train.bin").string() +
                                      "' is >= vocab_size 1000");
  testutil::write_file(dir / "odd.bin", "abc");
  r = testutil::run(testutil::trainer_bin() + " convert-bin --src " + (dir / "odd.bin").string() + " --vocab 50257 --out " + out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: convert-bin: '" + (dir / "odd.bin").string() +
                                      "' has an odd size (3 bytes); expected raw uint16 tokens");
  r = testutil::run(testutil::trainer_bin() + " convert-bin --src " + (dir / "train.bin").string() + " --out " + out);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: convert-bin: --vocab is required (see trainer convert-bin --help)\n");
}

// Without any file: GPT-2 small's vocabulary from the config, and a missing dataset is a warning. The
// GPT-2 configs pad the vocabulary to a multiple of 64 (model.vocab_multiple): 50304 rows of wte, 47 x 768
// parameters more than GPT-2's 124,439,808.
TEST(TokensE2E, DryRunWithoutADataset) {
  auto r = testutil::run(testutil::trainer_bin() + " --dry-run --config " + testutil::source_dir() +
                         "/configs/bench_gpt2_small_synthetic.yaml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("124,475,904"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("warning"), std::string::npos);

  r = testutil::run(testutil::trainer_bin() + " --dry-run --config " + testutil::source_dir() +
                    "/configs/gpt2_small.yaml --set data.train=/nonexistent/train.h5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: data.train '/nonexistent/train.h5' does not exist; the model summary assumes "
                          "model.vocab_size 50257\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("124,475,904"), std::string::npos);
  r = testutil::run(testutil::trainer_bin() + " --dry-run --config " + testutil::source_dir() +
                    "/configs/gpt2_small.yaml --set data.train=/nonexistent/train.h5 --set model.vocab_multiple=1");
  EXPECT_NE(r.output.find("124,439,808"), std::string::npos) << r.output;
  // model.vocab_size reaches the model: nanoGPT's padded 50304 adds 47 x 768 parameters.
  r = testutil::run(testutil::trainer_bin() + " --dry-run --config " + testutil::source_dir() +
                    "/configs/gpt2_small.yaml --set data.train=/nonexistent/train.h5 --set model.vocab_size=50304" +
                    " --set model.vocab_multiple=1");
  EXPECT_NE(r.output.find("124,475,904"), std::string::npos) << "124,439,808 + 47 x 768: " << r.output;

  // An image job without its file: the summary takes data.shape.
  r = testutil::run(testutil::trainer_bin() + " --dry-run --set data.train=/nonexistent/x.h5 --set data.shape=[1,28,28]");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the model summary assumes data.shape [1, 28, 28]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("269,434"), std::string::npos) << "resnet20's 269,722 less 2 x 16 x 3 x 3 of conv1: " << r.output;
  // A file that is there but not the right kind is still an error.
  r = testutil::run(testutil::trainer_bin() + " --dry-run --set data.train=" + testutil::source_dir() + "/README.md");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

// A language model on synthetic tokens: a run cut at step 4 and resumed ends with the weights of the
// uninterrupted run, bit for bit, having seen the same windows.
TEST(TokensE2E, SyntheticTokensRunResumesBitwise) {
  TempDir dir;
  const auto whole = (dir / "whole").string(), cut = (dir / "cut").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, synthetic_job(8)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(cut, synthetic_job(4))).exit_code, 0);
  r = testutil::run(testutil::trainer_cmd(cut, synthetic_job(8)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(cut)));
  const auto a = testutil::step_lines(whole), b = testutil::step_lines(cut);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["batch_hash"], b[i]["batch_hash"]) << "step " << i + 1;
  EXPECT_NEAR(a.front()["loss"].get<double>(), std::log(300.0), 0.3) << "uniform tokens: about ln V";
  EXPECT_EQ(a.front()["tokens_per_s"].get<double>(), a.front()["samples_per_s"].get<double>() * 16);
}

// bench/reference.py trains on the trainer's own synthetic batches: its pool equals the TokenLoader's
// first four global batches (crossing three epoch boundaries), token for token.
TEST(TokensE2E, PythonReferenceBuildsTheSameSyntheticBatches) {
  TempDir dir;
  const std::vector<std::string> sets = {"model.name=gpt_tiny", "model.context=8", "model.vocab_size=50257",
                                         "data.kind=synthetic", "data.synthetic_size=5", "train.global_batch=3",
                                         "seed=11"};
  std::string args;
  for (const auto& s : sets) args += " --set " + s;
  const std::string out = (dir / "pool.pt").string();
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/bench/reference.py" + args +
                         " --dump-batches " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, torch::Tensor> pool;
  for (auto& [k, v] : trainer::read_tensors(out)) pool[k] = v;

  const trainer::Config cfg = trainer::load_config("", sets);
  data::TokenLoaderOptions o;
  o.global_batch = 3;
  o.context = 8;
  o.seed = 11;
  data::TokenLoader loader(trainer::synthetic_tokens(cfg), o);
  for (int i = 0; i < 4; ++i) {
    const auto b = loader.next();
    EXPECT_EQ(b.epoch, i) << "5 windows hold one batch of 3 per epoch";
    EXPECT_TRUE(torch::equal(pool.at("x" + std::to_string(i)), b.images)) << i;
    EXPECT_TRUE(torch::equal(pool.at("y" + std::to_string(i)), b.labels)) << i;
  }
  EXPECT_GT(pool.at("x0").max().item<int64_t>(), 256) << "the GPT-2 vocabulary, not bytes";
}

}  // namespace test_tokens_e2e
