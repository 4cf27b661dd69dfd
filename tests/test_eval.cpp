// `trainer eval` (trainer/commands/eval_command.h): its numbers equal the training run's own final evaluation of
// the same checkpoint (images and tokens, the latest and a chosen checkpoint), and torchvision weights
// saved by Python give torchvision's logits, loss and accuracies on the same images.
#include <gtest/gtest.h>

#include <cmath>

#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "data/samples/loader.h"
#include "train_util.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/commands/eval_command.h"
#include "trainer/run/from_config.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_eval {

using testutil::TempDir;

namespace {

std::string last_line(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s.substr(s.rfind('\n') + 1);
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(testutil::read_file(path)); }

// Random uint8 images with labels as a trainer.images file.
void write_images(const std::string& path, int64_t n, std::vector<int64_t> shape, int64_t classes, uint64_t seed) {
  torch::manual_seed(seed);
  auto images = torch::randint(0, 256, {n, shape[0], shape[1], shape[2]}).to(torch::kUInt8);
  auto labels = torch::randint(0, classes, {n}).to(torch::kLong);
  data::ImageMeta meta;
  meta.num_classes = classes;
  meta.mean.assign(shape[0], 0.5f);
  meta.std.assign(shape[0], 0.29f);
  data::write_image_h5(path, images, labels, meta);
}

// The eval numbers against a metrics.jsonl eval event: the same code on the same weights and batches.
void expect_same_numbers(const nlohmann::json& eval, const nlohmann::json& event) {
  EXPECT_EQ(eval["samples"], event["samples"]);
  EXPECT_EQ(eval["loss"].get<double>(), event["loss"].get<double>()) << "difference "
      << eval["loss"].get<double>() - event["loss"].get<double>();
  EXPECT_EQ(eval["top1"].get<double>(), event["top1"].get<double>());
  EXPECT_EQ(eval["top5"].get<double>(), event["top5"].get<double>());
}

// Trains `job` into `run` and returns its evaluation events.
std::vector<nlohmann::json> train_and_read_evals(const std::string& run, const std::string& job) {
  auto r = testutil::run(testutil::trainer_cmd(run, job));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return testutil::events(run, "eval");
}

}  // namespace

TEST(EvalCommand, ImagesEqualTheRunsFinalEvaluation) {
  TempDir dir;
  const auto train = (dir / "train.h5").string(), test = (dir / "test.h5").string(), run = (dir / "run").string();
  write_images(train, 64, {1, 12, 12}, 4, 1);
  write_images(test, 21, {1, 12, 12}, 4, 2);
  const std::string job = "--set data.train=" + train + " --set data.test=" + test +
                          " --set model.num_classes=4 --set train.global_batch=16 --set train.steps=3 --set train.epochs=0"
                          " --set train.eval_batch=8 --set train.threads=1 --set schedule.warmup_steps=0 --set log.every=1000";
  const auto finals = train_and_read_evals(run, job);
  ASSERT_EQ(finals.size(), 1u);

  auto r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(run + "/eval.json");
  expect_same_numbers(j, finals[0]);
  EXPECT_EQ(j["samples"], 21);
  EXPECT_EQ(j["step"], 3);
  EXPECT_EQ(j["kind"], "images");
  char numbers[120];
  std::snprintf(numbers, sizeof numbers, "loss %.4f, top1 %.2f%%, top5 %.2f%% over 21 images", j["loss"].get<double>(),
                100 * j["top1"].get<double>(), 100 * j["top5"].get<double>());
  EXPECT_EQ(r.output, "eval step 3 (" + run + "/checkpoints/step-00000003) on " + test + ": " + numbers + " -> " + run +
                          "/eval.json\n");

  // Another split, and the one-line errors.
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run + " --split train --out " + (dir / "t.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json((dir / "t.json").string())["samples"], 64);
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + (dir / "none").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: eval: " + (dir / "none").string() + " has no checkpoint to score\n");
  r = testutil::run(testutil::trainer_bin() + " eval");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: eval: nothing to score; give --run-dir, --checkpoint, or weights as --set model.init_from=FILE\n");
}

TEST(EvalCommand, TokensEqualTheRunsEvaluationsOfTheLatestAndAChosenCheckpoint) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "Pack my box with five dozen liquor jugs " + std::to_string(i * 7) + ".\n";
  testutil::write_file(dir / "text.txt", text);
  data::convert_text({(dir / "text.txt").string()}, (dir / "tokens").string(), 0.2);
  const auto run = (dir / "run").string();
  const std::string job = "--config " + testutil::source_dir() + "/configs/gpt_tiny_fortunes.yaml --set data.train=" +
                          (dir / "tokens/train.h5").string() + " --set data.test=" + (dir / "tokens/val.h5").string() +
                          " --set model.context=16 --set train.global_batch=4 --set train.steps=4 --set train.eval_every=2"
                          " --set train.eval_batch=8 --set train.eval_batches=3 --set train.threads=1"
                          " --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0 --set log.every=1000";
  const auto evals = train_and_read_evals(run, job);
  ASSERT_EQ(evals.size(), 2u);
  ASSERT_EQ(evals[0]["step"], 2);

  const auto latest = (dir / "latest.json").string(), chosen = (dir / "chosen.json").string();
  auto r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run + " --out " + latest);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_bin() + " eval --checkpoint " + run + "/checkpoints/step-00000002 --out " + chosen);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j4 = read_json(latest), j2 = read_json(chosen);
  expect_same_numbers(j4, evals[1]);
  expect_same_numbers(j2, evals[0]);
  EXPECT_EQ(j2["step"], 2);
  EXPECT_EQ(j4["samples"], 3 * 8 * 16) << "eval_batches x eval_batch x context tokens";
  EXPECT_EQ(j4["vocab_size"], 256);
  EXPECT_DOUBLE_EQ(j4["bits_per_byte"].get<double>(), j4["loss"].get<double>() / std::log(2.0));
  EXPECT_NE(last_line(r.output).find(" nats/token, "), std::string::npos) << r.output;
  EXPECT_NE(last_line(r.output).find(" bits/byte, "), std::string::npos) << r.output;
}

// Weights that torchvision made and Python saved: the trainer's model (built by the eval command) gives
// torchvision's logits on the same images, and the eval command torchvision's loss and accuracies.
TEST(EvalCommand, TorchvisionWeightsGiveTorchvisionsLogitsAndLoss) {
  TempDir dir;
  const auto h5 = (dir / "images.h5").string();
  torch::manual_seed(5);
  auto images = torch::randint(0, 256, {10, 3, 48, 48}).to(torch::kUInt8);
  auto labels = torch::randint(0, 10, {10}).to(torch::kLong);
  data::ImageMeta meta;
  meta.num_classes = 10;
  meta.mean = {0.45f, 0.5f, 0.55f};
  meta.std = {0.2f, 0.25f, 0.3f};
  data::write_image_h5(h5, images, labels, meta);
  trainer::NamedTensors for_python = {{"images", images}, {"labels", labels}, {"mean", torch::tensor(meta.mean)},
                                      {"std", torch::tensor(meta.std)}};
  testutil::write_file(dir / "in.pt", trainer::tensors_to_bytes(for_python));
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/tests/ref/torchvision_models.py --models resnet18"
                         " --eval-reference " + (dir / "in.pt").string() + " " + dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, torch::Tensor> ref;
  for (auto& [k, v] : trainer::read_tensors((dir / "resnet18_eval.pt").string())) ref[k] = v;

  trainer::EvalCommand cmd;
  cmd.overrides = {"model.name=resnet18", "model.num_classes=10", "model.init_from=" + (dir / "resnet18_weights.pt").string(),
                   "data.train=" + h5, "data.test=" + h5, "train.eval_batch=4", "train.device=cpu"};
  trainer::EvalTarget target = trainer::prepare_eval(cmd);
  // The logits of the model that is scored, on the loader's normalized images (batches of 4, 4, 2).
  data::EvalOptions eo;
  eo.batch = 4;
  data::EvalLoader loader(static_cast<const data::ImageEvalSource&>(*target.split).dataset(), eo);
  std::vector<torch::Tensor> logits;
  torch::NoGradGuard no_grad;
  while (auto b = loader.next())
    logits.push_back(trainer::forward_logits(*target.model, b->images, b->labels, trainer::eval_settings(target.cfg, target.device).forward).logits);
  const double diff = (torch::cat(logits) - ref.at("logits")).abs().max().item<double>();
  std::cout << "trainer vs torchvision resnet18 logits: max abs diff " << diff << " (logits up to "
            << ref.at("logits").abs().max().item<double>() << ")\n";
  EXPECT_LT(diff, 1e-4);

  const auto j = trainer::score(target);
  std::cout << "eval loss " << j["loss"].get<double>() << ", torchvision's differs by "
            << j["loss"].get<double>() - ref.at("loss").item<double>() << "\n";
  EXPECT_NEAR(j["loss"].get<double>(), ref.at("loss").item<double>(), 1e-5);
  EXPECT_EQ(j["top1"].get<double>(), ref.at("top1").item<double>());
  EXPECT_EQ(j["top5"].get<double>(), ref.at("top5").item<double>());
  EXPECT_EQ(j["samples"], 10);
  EXPECT_TRUE(j["step"].is_null());
}

}  // namespace test_eval
