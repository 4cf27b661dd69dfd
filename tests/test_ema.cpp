// The exponential moving average of the weights (trainer/numerics/ema.h, train.ema_*): its update against
// timm's ModelEmaV3 on the same weights (the 2.11 leg; the 1.13 leg has no timm), hand-computed decays and
// averages, the swap that evaluations use; through the executable, a run killed and resumed ends with both
// weight sets bitwise those of the uninterrupted run, a checkpoint without the average starts it from its
// weights, `trainer eval --weights` and `trainer export --weights` agree with the run's own evaluation, and
// bad values are one line and exit 2.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include "data/files/image_h5.h"
#include "train_util.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/store.h"
#include "trainer/numerics/ema.h"
#include "trainer/track/records.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_ema {

using testutil::TempDir;
using trainer::EmaOptions;
using trainer::ModelEma;
using trainer::NamedTensors;

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/ema_ref.py"; }

// tests/ref/ema_ref.py's Small: Conv2d, BatchNorm2d (float and integer buffers), Linear.
struct SmallImpl : torch::nn::Module {
  SmallImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(3))),
        fc(register_module("fc", torch::nn::Linear(3, 4))) {}
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(Small);

// One parameter, one float buffer, one integer buffer, each tiny: for averages computed by hand.
struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    w = register_parameter("w", torch::tensor({1.0f, 2.0f}));
    m = register_buffer("m", torch::tensor({10.0f}));
    n = register_buffer("n", torch::tensor(int64_t{0}));
  }
  void set(std::vector<float> wv, float mv, int64_t nv) {
    torch::NoGradGuard g;
    w.copy_(torch::tensor(wv));
    m.fill_(mv);
    n.fill_(nv);
  }
  torch::Tensor w, m, n;
};
TORCH_MODULE(Tiny);

// The weights of step s: every floating entry random (seeded by s), num_batches_tracked = 3 s.
NamedTensors weights_at(int s) {
  Small shape;
  torch::manual_seed(1000 + s);
  NamedTensors out;
  for (auto& [k, t] : trainer::named_state(*shape))
    out.emplace_back(k, t.is_floating_point() ? torch::randn(t.sizes()) : torch::full(t.sizes(), 3 * s, t.options()));
  return out;
}

std::map<std::string, torch::Tensor> as_map(const NamedTensors& t) { return {t.begin(), t.end()}; }

std::vector<float> values(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(testutil::read_file(path)); }

}  // namespace

// ---- the component -------------------------------------------------------------------------------

TEST(Ema, DecayOfTheWarmupStepsByHand) {
  EmaOptions o;
  o.decay = 0.999;
  o.warmup = true;
  // ModelEmaV3.get_decay: 0 at step 1, then 1 - (1 + (s - 1))^(-2/3): 1 - 2^(-2/3), 1 - 3^(-2/3), 1 - 4^(-2/3).
  EXPECT_EQ(trainer::ema_decay(o, 1), 0.0);
  EXPECT_NEAR(trainer::ema_decay(o, 2), 0.37003947505256340, 1e-15);
  EXPECT_NEAR(trainer::ema_decay(o, 3), 0.51925014323086380, 1e-15);
  EXPECT_NEAR(trainer::ema_decay(o, 4), 0.60314973700795020, 1e-15);
  EXPECT_EQ(trainer::ema_decay(o, 1000000000), 0.999);  // capped at decay
  o.decay = 0.5;
  EXPECT_EQ(trainer::ema_decay(o, 4), 0.5);
  o.decay = 0.999;
  o.min_decay = 0.45;
  EXPECT_EQ(trainer::ema_decay(o, 2), 0.45);  // raised to min_decay
  o.warmup = false;
  EXPECT_EQ(trainer::ema_decay(o, 1), 0.0);   // the first update copies the model, with or without warmup
  EXPECT_EQ(trainer::ema_decay(o, 2), 0.999);
}

TEST(Ema, ThreeStepAverageOfATinyTensorByHand) {
  Tiny model;
  EmaOptions o;
  o.decay = 0.5;
  ModelEma ema(*model, o);  // starts at w [1, 2], m 10, n 0
  const void* w_storage = ema.state()[0].second.data_ptr();
  model->set({3, 4}, 20, 1);
  EXPECT_EQ(ema.update(*model, 1), 0.0);  // decay 0: a copy
  model->set({5, 8}, 30, 2);
  EXPECT_EQ(ema.update(*model, 2), 0.5);
  model->set({1, 0}, 2, 3);
  EXPECT_EQ(ema.update(*model, 3), 0.5);
  const auto s = as_map(ema.state());
  // w: [3, 4] -> [3 + (5 - 3) / 2, 4 + (8 - 4) / 2] = [4, 6] -> [4 + (1 - 4) / 2, 6 + (0 - 6) / 2] = [2.5, 3]
  EXPECT_EQ(values(s.at("w")), (std::vector<float>{2.5f, 3.0f}));
  EXPECT_EQ(values(s.at("m")), (std::vector<float>{13.5f}));  // 20 -> 25 -> 13.5: a float buffer is averaged
  EXPECT_EQ(s.at("n").item<int64_t>(), 3);                    // an integer buffer is copied
  EXPECT_EQ(ema.state()[0].second.data_ptr(), w_storage) << "updated in place";
  EXPECT_EQ(ema.bytes(), 2 * 4 + 4 + 8);

  // Every 2 steps: steps 1 and 3 change nothing; step 2 averages the start [1, 2] with [5, 8] at decay 0.5.
  Tiny model2;
  o.every = 2;
  ModelEma every2(*model2, o);
  model2->set({3, 4}, 20, 1);
  EXPECT_EQ(every2.update(*model2, 1), -1.0);
  model2->set({5, 8}, 30, 2);
  every2.update(*model2, 2);
  model2->set({1, 0}, 2, 3);
  every2.update(*model2, 3);
  EXPECT_EQ(values(as_map(every2.state()).at("w")), (std::vector<float>{3.0f, 5.0f}));
  EXPECT_EQ(as_map(every2.state()).at("n").item<int64_t>(), 2);
}

TEST(Ema, SwapExchangesValuesAndKeepsTheModelsTensors) {
  Tiny model;
  EmaOptions o;
  o.decay = 0.5;
  ModelEma ema(*model, o);
  model->set({3, 4}, 20, 1);
  ema.update(*model, 2);  // ema w = [2, 3]
  const auto* impl = model->w.unsafeGetTensorImpl();
  const void* data = model->w.data_ptr();
  {
    trainer::EmaSwap swapped(ema, *model);
    EXPECT_EQ(values(model->w), (std::vector<float>{2.0f, 3.0f}));
    EXPECT_EQ(values(model->m), (std::vector<float>{15.0f}));
    EXPECT_EQ(values(as_map(ema.state()).at("w")), (std::vector<float>{3.0f, 4.0f}));
    EXPECT_EQ(model->w.unsafeGetTensorImpl(), impl) << "the same parameter object (an optimizer holds it)";
    EXPECT_TRUE(model->w.requires_grad());
  }
  EXPECT_EQ(values(model->w), (std::vector<float>{3.0f, 4.0f}));
  EXPECT_EQ(model->w.data_ptr(), data);
  EXPECT_EQ(values(as_map(ema.state()).at("w")), (std::vector<float>{2.0f, 3.0f}));
  ema.update(*model, 3);  // still averages in place after the swaps: [2.5, 3.5]
  EXPECT_EQ(values(as_map(ema.state()).at("w")), (std::vector<float>{2.5f, 3.5f}));

  Tiny other;
  ema.copy_into(*other);
  EXPECT_EQ(values(other->w), (std::vector<float>{2.5f, 3.5f}));
  EXPECT_EQ(other->n.item<int64_t>(), 1);
}

TEST(Ema, LoadChecksNamesAndShapes) {
  Tiny model;
  EmaOptions o;
  o.decay = 0.9;
  ModelEma ema(*model, o);
  ema.load({{"w", torch::tensor({7.0f, 8.0f})}, {"m", torch::tensor({9.0f})}, {"n", torch::tensor(int64_t{4})}}, "a.pt");
  EXPECT_EQ(values(as_map(ema.state()).at("w")), (std::vector<float>{7.0f, 8.0f}));
  try {
    ema.load({{"w", torch::zeros({3})}, {"x", torch::zeros({1})}, {"n", torch::tensor(int64_t{4})}}, "b.pt");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "b.pt: the averaged weights do not fit the model: w has shape [3], the model [2]; "
                                     "missing m; unexpected x");
  }
  EXPECT_EQ(values(as_map(ema.state()).at("w")), (std::vector<float>{7.0f, 8.0f})) << "nothing changed";
  o.decay = 1.0;
  EXPECT_THROW(ModelEma(*model, o), std::invalid_argument);
}

// (a) timm's ModelEmaV3 on the same sequence of weights, without and with warmup.
TEST(EmaTimm, UpdatesEqualModelEmaV3) {
  const std::string missing = testutil::missing_module_of(ref_script());
  if (!missing.empty())
    GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing
                 << " (the 2.11 environment has timm)";
  const int steps = 6;
  for (const bool warmup : {false, true}) {
    TempDir dir;
    for (int s = 0; s <= steps; ++s)
      testutil::write_file(dir / ("w" + std::to_string(s) + ".pt"), trainer::tensors_to_bytes(weights_at(s)));
    const double decay = warmup ? 0.999 : 0.7;
    auto r = testutil::run(testutil::python() + " " + ref_script() + " timm " + dir.str() + " " + std::to_string(decay) +
                           (warmup ? " 1 " : " 0 ") + std::to_string(steps));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    Small model;
    trainer::load_state_dict(*model, weights_at(0));
    EmaOptions o;
    o.decay = decay;
    o.warmup = warmup;
    ModelEma ema(*model, o);
    for (int s = 1; s <= steps; ++s) {
      trainer::load_state_dict(*model, weights_at(s));
      ema.update(*model, s);
    }
    const auto ours = as_map(ema.state());
    const auto timm = as_map(trainer::read_tensors((dir / "ema.pt").string()));
    ASSERT_EQ(ours.size(), timm.size());
    ASSERT_EQ(ours.size(), 9u);
    for (const auto& [k, t] : timm) {
      ASSERT_TRUE(ours.count(k)) << k;
      if (!t.is_floating_point()) {
        EXPECT_TRUE(ours.at(k).equal(t)) << k << " (copied)";
        continue;
      }
      // float32 rounding: the same lerp of the same float32 values (2.11's CPU lerp is per tensor both ways)
      EXPECT_TRUE(torch::allclose(ours.at(k), t, 1e-6, 1e-7)) << k << (warmup ? " with" : " without") << " warmup: "
                                                               << (ours.at(k) - t).abs().max().item<double>();
    }
    // The average is not the last weights: it moved over the steps.
    EXPECT_FALSE(ours.at("fc.weight").equal(as_map(weights_at(steps)).at("fc.weight")));
  }
}

// ---- through the executable ---------------------------------------------------------------------

namespace {

// test_resume.cpp's job (ResNet-20 with augmentation on synthetic 1x16x16, checkpoints every 2 steps) with
// the average on: decay 0.9 with warmup, every 2 steps.
std::string ema_job(int64_t steps, const std::string& extra = "") {
  return "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=96 --set data.test= --set data.crop_padding=2 --set data.hflip=true"
         " --set train.global_batch=8 --set train.epochs=0 --set train.steps=" +
         std::to_string(steps) +
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set log.every=1000 --set seed=11 --set train.threads=1 --set data.workers=1"
         " --set train.ema_decay=0.9 --set train.ema_warmup=true --set train.ema_every=2 " +
         extra;
}

std::map<std::string, torch::Tensor> exported(const std::string& run_dir, const std::string& set) {
  const std::string out = run_dir + "/exported_" + set + ".pt";
  auto r = testutil::run(testutil::trainer_bin() + " export --run-dir " + run_dir + " --weights " + set + " --out " + out);
  if (r.exit_code != 0) throw std::runtime_error("export failed: " + r.output);
  return as_map(trainer::read_tensors(out));
}

// Random uint8 images with labels as a trainer.images file (test_eval.cpp's).
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

// Random 1x12x12 images of 4 classes in dir (64 to train, 21 to test), and the keys that train on them.
std::string image_data(const TempDir& dir) {
  const auto train = (dir / "train.h5").string(), test = (dir / "test.h5").string();
  write_images(train, 64, {1, 12, 12}, 4, 1);
  write_images(test, 21, {1, 12, 12}, 4, 2);
  return "--set data.train=" + train + " --set data.test=" + test +
         " --set model.num_classes=4 --set train.eval_batch=8 --set train.threads=1";
}

}  // namespace

// (c) SIGKILL mid-run, then the same command: the losses and both weight sets are bitwise those of the
// uninterrupted run. `extra`: more keys for both runs.
void sigkill_then_restart_is_bitwise(const std::string& extra) {
  TempDir dir;
  const int64_t steps = 30;
  auto whole = (dir / "whole").string(), killed = (dir / "killed").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, ema_job(steps, extra)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ema: decay 0.9 with warmup, updated every 2 step(s)"), std::string::npos) << r.output;
  pid_t pid = testutil::spawn(testutil::trainer_cmd(killed, ema_job(steps, extra)), (dir / "killed.log").string());
  const bool reached = testutil::wait_for_metrics(killed, [](auto& l) { return testutil::last_step(l) >= 11; });
  std::mt19937 rng(std::random_device{}());
  std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 40));
  kill(pid, SIGKILL);
  ASSERT_EQ(testutil::wait_exit(pid), 128 + SIGKILL) << "the run finished before the kill; make it longer";
  ASSERT_TRUE(reached) << testutil::read_file(dir / "killed.log");
  r = testutil::run(testutil::trainer_cmd(killed, ema_job(steps, extra)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto resumes = testutil::events(killed, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_GE(resumes[0]["step"].get<int64_t>(), 2);
  EXPECT_LT(resumes[0]["step"].get<int64_t>(), steps);

  const auto a = testutil::step_lines(whole), b = testutil::step_lines(killed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << i + 1;
  const auto raw = exported(whole, "raw"), ema = exported(whole, "ema");
  EXPECT_TRUE(testutil::bitwise_equal(raw, exported(killed, "raw")));
  EXPECT_TRUE(testutil::bitwise_equal(ema, exported(killed, "ema")));
  EXPECT_FALSE(testutil::bitwise_equal(raw, ema)) << "the average is not the weights";
  EXPECT_TRUE(testutil::bitwise_equal(exported(whole, "auto"), ema)) << "auto exports the average where there is one";
  // The checkpoint says how the average was made.
  const auto ck = trainer::CheckpointStore(whole, 0).load_latest();
  ASSERT_TRUE(ck);
  EXPECT_EQ(nlohmann::json::parse(ck->file("state.json"))["ema"],
            (nlohmann::json{{"decay", 0.9}, {"warmup", true}, {"every", 2}}));
}

TEST(EmaRun, SigkillThenRestartIsBitwiseInBothWeightSets) { sigkill_then_restart_is_bitwise(""); }

// The image recipes all at once (docs/RECIPES.md): RandAugment and random erasing in the loader, Mixup and
// CutMix per sample with label smoothing in the step, the average after it. Their draws come from the seed
// and (epoch, index) or (step, rank), so the killed run resumes to the same losses and both weight sets.
TEST(EmaRun, SigkillWithTheWholeRecipeIsBitwise) {
  sigkill_then_restart_is_bitwise(
      "--set data.auto_augment=randaugment --set data.random_erasing=0.5 --set train.mixup_alpha=0.2"
      " --set train.cutmix_alpha=1.0 --set train.mix_mode=elem --set train.label_smoothing=0.1");
}

// A checkpoint without the average, resumed with it on: one line, and the average starts from the
// checkpoint's weights (step 4), then moves as ModelEmaV3 does over steps 5 and 6 (decay 0.9, no warmup).
TEST(EmaRun, CheckpointWithoutTheAverageStartsItFromItsWeights) {
  TempDir dir;
  const auto run = (dir / "run").string();
  const std::string plain = "--set train.ema_decay=0 --set checkpoint.every_steps=1";
  auto r = testutil::run(testutil::trainer_cmd(run, ema_job(4, plain)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(run, ema_job(6, "--set train.ema_warmup=false --set train.ema_every=1 "
                                                          "--set checkpoint.every_steps=1")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints/step-00000004 has no averaged weights (ema.pt); the average (train.ema_decay) "
                          "starts from its weights at step 4"),
            std::string::npos)
      << r.output;
  auto weights = [&](int step, const char* file) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08d", step);
    const auto ck = trainer::CheckpointStore::load(run + "/checkpoints/" + name);
    return as_map(trainer::tensors_from_bytes(ck.file(file)));
  };
  const auto w4 = weights(4, "model.pt"), w5 = weights(5, "model.pt"), w6 = weights(6, "model.pt");
  const auto e6 = weights(6, "ema.pt");
  ASSERT_EQ(e6.size(), w6.size());
  for (const auto& [k, t] : e6) {
    if (!t.is_floating_point()) {
      EXPECT_TRUE(t.equal(w6.at(k))) << k;
      continue;
    }
    const auto expected = w4.at(k).lerp(w5.at(k), 1 - 0.9).lerp(w6.at(k), 1 - 0.9);
    EXPECT_TRUE(t.equal(expected)) << k << ": " << (t - expected).abs().max().item<double>();
  }
}

// (d) `trainer eval --weights ema` and `raw` score different weights, each equal to the run's final
// evaluation of that set, and the average scores the same as its exported file given as model.init_from.
TEST(EmaRun, EvalAndExportOfEitherWeightSet) {
  TempDir dir;
  const auto run = (dir / "run").string();
  const std::string data = image_data(dir);
  auto r = testutil::run(testutil::trainer_cmd(run, data + " --set train.global_batch=16 --set train.steps=6 --set "
                                                           "train.epochs=0 --set schedule.warmup_steps=0 --set "
                                                           "log.every=1000 --set train.ema_decay=0.8"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("; ema: loss "), std::string::npos) << r.output;
  const auto evals = testutil::events(run, "eval");
  ASSERT_EQ(evals.size(), 2u) << "the end of epoch 1 (4 steps of 16 of 64 images) and the final one";
  ASSERT_TRUE(evals[0].contains("ema_loss")) << evals[0];
  const auto& final_eval = evals[1];
  ASSERT_TRUE(final_eval.value("final", false)) << final_eval;
  ASSERT_TRUE(final_eval.contains("ema_loss")) << final_eval;

  const auto ema_json = (dir / "ema.json").string(), raw_json = (dir / "raw.json").string();
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run + " --weights ema --out " + ema_json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(", averaged weights on "), std::string::npos) << r.output;
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run + " --weights raw --out " + raw_json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto je = read_json(ema_json), jr = read_json(raw_json);
  EXPECT_EQ(je["weight_set"], "ema");
  EXPECT_EQ(jr["weight_set"], "raw");
  EXPECT_NE(je["loss"].get<double>(), jr["loss"].get<double>());
  EXPECT_EQ(je["loss"].get<double>(), final_eval["ema_loss"].get<double>());
  EXPECT_EQ(je["top1"].get<double>(), final_eval["ema_top1"].get<double>());
  EXPECT_EQ(je["top5"].get<double>(), final_eval["ema_top5"].get<double>());
  EXPECT_EQ(jr["loss"].get<double>(), final_eval["loss"].get<double>());
  EXPECT_EQ(jr["top1"].get<double>(), final_eval["top1"].get<double>());
  // The default scores the average where the checkpoint has one.
  const auto auto_json = (dir / "auto.json").string();
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run + " --out " + auto_json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(auto_json)["loss"].get<double>(), je["loss"].get<double>());

  // The exported average, scored as plain weights, scores as the checkpoint's average.
  const auto file = (dir / "ema_weights.safetensors").string(), from_file = (dir / "file.json").string();
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + run + " --weights ema --out " + file);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(averaged weights)"), std::string::npos) << r.output;
  r = testutil::run(testutil::trainer_bin() + " eval " + data + " --set model.init_from=" + file + " --out " + from_file);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto jf = read_json(from_file);
  EXPECT_EQ(jf["weight_set"], "raw");
  EXPECT_EQ(jf["loss"].get<double>(), je["loss"].get<double>());
  EXPECT_EQ(jf["top1"].get<double>(), je["top1"].get<double>());

  // MLflow gets both sets' figures from the eval record (trainer/track/records.h).
  std::map<std::string, double> metrics;
  for (const auto& m : trainer::track::metrics_of_record(final_eval, 0)) metrics[m.key] = m.value;
  EXPECT_EQ(metrics.at("eval_loss"), final_eval["loss"].get<double>());
  EXPECT_EQ(metrics.at("eval_ema_loss"), final_eval["ema_loss"].get<double>());
  EXPECT_EQ(metrics.at("eval_ema_top1"), final_eval["ema_top1"].get<double>());
  EXPECT_EQ(metrics.at("eval_ema_top5"), final_eval["ema_top5"].get<double>());
  const auto back = trainer::track::records_from_history(
      {{"eval_ema_top1", {{"eval_ema_top1", 0.25, 6, 0}}}, {"eval_top1", {{"eval_top1", 0.5, 6, 0}}}});
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1]["ema_top1"].get<double>(), 0.25);
  EXPECT_EQ(back[1]["top1"].get<double>(), 0.5);

  // Asking for an average a checkpoint does not have: one line, exit 2.
  const auto plain = (dir / "plain").string();
  r = testutil::run(testutil::trainer_cmd(plain, data + " --set train.global_batch=16 --set train.steps=1 --set "
                                                        "train.epochs=0 --set log.every=1000"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + plain + " --weights ema");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: eval: " + plain + "/checkpoints/step-00000001 has no averaged weights for --weights ema "
                      "(ema.pt: a checkpoint of a run with train.ema_decay > 0); use --weights raw\n");
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + plain + " --weights bogus --out " + file);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: export: " + plain + "/checkpoints/step-00000001: --weights 'bogus' is not one of: ema, raw, auto\n");
}

// bench/fmnist_strong.py --record (docs/RESULTS.md's record of the strong Fashion-MNIST recipe) on a finished
// run with the average: both sets' final figures and every evaluation's, the run's own training time, its
// recipe, and the gain over a baseline record by hand or over a baseline run folder; a resumed run's record
// has no training time. A run without the average, or one that has not finished, exit 2.
TEST(EmaRun, TheRecipeRecordHoldsBothWeightSetsAgainstTheBaseline) {
  TempDir dir;
  const auto run = (dir / "run").string();
  const std::string job = image_data(dir) + " --set train.global_batch=16 --set train.steps=6 --set train.epochs=0"
                                            " --set schedule.warmup_steps=0 --set log.every=1000 ";
  auto r = testutil::run(testutil::trainer_cmd(run, job + "--set train.ema_decay=0.8"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto evals = testutil::events(run, "eval");
  ASSERT_EQ(evals.size(), 2u);
  const auto& last = evals.back();
  const double base_top1 = 0.125;  // hand-picked: the record's gains are (top1 - 0.125) in points
  const auto base = (dir / "base.json").string(), out = (dir / "rec.json").string();
  std::ofstream(base) << R"({"final": {"top1": 0.125}})";
  const std::string script = testutil::python() + " " + testutil::source_dir() + "/bench/fmnist_strong.py --record" +
                             " --trainer " + testutil::trainer_bin() + " --baseline " + base;
  r = testutil::run(script + " --run-dir " + run + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(out);
  for (const char* k : {"top1", "top5", "loss", "ema_top1", "ema_top5", "ema_loss", "step"})
    EXPECT_EQ(j["final"][k], last[k]) << k;
  EXPECT_EQ(j["epochs_top1"], nlohmann::json({evals[0]["top1"], last["top1"]}));
  EXPECT_EQ(j["epochs_ema_top1"], nlohmann::json({evals[0]["ema_top1"], last["ema_top1"]}));
  EXPECT_EQ(j["steps"], 6);
  EXPECT_EQ(j["processes"], 1);
  EXPECT_EQ(j["training_s"], testutil::events(run, "end").at(0)["seconds"]);
  EXPECT_NEAR(j["samples_per_s"].get<double>(), 96 / j["training_s"].get<double>(), 0.1);
  const double ema_gain = std::round(10000 * (last["ema_top1"].get<double>() - base_top1)) / 100;
  const double raw_gain = std::round(10000 * (last["top1"].get<double>() - base_top1)) / 100;
  EXPECT_NEAR(j["gain_points"]["ema"].get<double>(), ema_gain, 1e-9);
  EXPECT_NEAR(j["gain_points"]["raw"].get<double>(), raw_gain, 1e-9);
  EXPECT_EQ(j["target_met"].get<bool>(), std::max(ema_gain, raw_gain) >= 1.0);
  EXPECT_EQ(j["machine"]["threads"], 1);
  EXPECT_TRUE(j["baseline"]["same_isa"].is_null()) << "a baseline record without its machine";
  // The recipe as the run resolved it, --set overrides included.
  EXPECT_EQ(j["recipe"]["train.ema_decay"], 0.8);
  EXPECT_EQ(j["recipe"]["train.global_batch"], 16);
  EXPECT_EQ(j["recipe"]["train.label_smoothing"], 0.0);

  // A run that was stopped and resumed: two processes, and no training time (the end event's is the last
  // process's only).
  const auto resumed = (dir / "resumed").string();
  testutil::fs::create_directories(resumed);
  for (const char* f : {"resolved_config.yaml", "train.log"}) testutil::fs::copy_file(run + "/" + f, resumed + "/" + f);
  {
    const std::string metrics = testutil::read_file(run + "/metrics.jsonl");
    const auto first = metrics.find('\n') + 1;
    std::ofstream(resumed + "/metrics.jsonl")
        << metrics.substr(0, first) << R"({"event":"stop","signal":"SIGTERM","step":3})" << "\n"
        << R"({"event":"resume","step":3})" << "\n" << metrics.substr(first);
  }
  r = testutil::run(script + " --run-dir " + resumed + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto k = read_json(out);
  EXPECT_EQ(k["processes"], 2);
  EXPECT_FALSE(k.contains("training_s"));
  EXPECT_FALSE(k.contains("samples_per_s"));
  EXPECT_EQ(k["final"], j["final"]);

  // Without the average, and a folder whose run never finished: exit 2, no record.
  const auto plain = (dir / "plain").string(), bad_out = (dir / "bad.json").string();
  r = testutil::run(testutil::trainer_cmd(plain, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(script + " --run-dir " + plain + " --out " + bad_out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("no evaluation of the average"), std::string::npos) << r.output;
  // Against the built-in job trained here (a run folder): the gain over its final top-1, its fingerprint and
  // recipe kept.
  const std::string against_run = testutil::python() + " " + testutil::source_dir() + "/bench/fmnist_strong.py --record" +
                                   " --trainer " + testutil::trainer_bin() + " --run-dir " + run + " --out " + out;
  r = testutil::run(against_run + " --baseline-run " + plain);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto b = read_json(out);
  const double plain_top1 = testutil::events(plain, "eval").back()["top1"].get<double>();
  EXPECT_EQ(b["baseline"]["top1"].get<double>(), plain_top1);
  EXPECT_NEAR(b["gain_points"]["ema"].get<double>(), std::round(10000 * (last["ema_top1"].get<double>() - plain_top1)) / 100, 1e-9);
  EXPECT_EQ(b["baseline"]["steps"], 6);
  EXPECT_EQ(b["baseline"]["fingerprint"].get<std::string>().size(), 64u);
  // The average changes no step: the baseline, the same job without it, trained the same numbers.
  EXPECT_EQ(b["baseline"]["fingerprint"], j["fingerprint"]);
  EXPECT_EQ(b["baseline"]["recipe"]["train.ema_decay"], 0.0);  // the baseline folder's own recipe
  EXPECT_TRUE(b["baseline"]["same_machine"].get<bool>());
  const auto unfinished = (dir / "unfinished").string();
  testutil::fs::create_directories(unfinished);
  const std::string metrics = testutil::read_file(run + "/metrics.jsonl");
  std::ofstream(unfinished + "/metrics.jsonl") << metrics.substr(0, metrics.find('\n') + 1);  // the start event only
  r = testutil::run(script + " --run-dir " + unfinished + " --out " + bad_out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("holds no finished run"), std::string::npos) << r.output;
  r = testutil::run(against_run + " --baseline-run " + unfinished);  // a baseline that never finished
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("holds no finished run"), std::string::npos) << r.output;
  EXPECT_FALSE(testutil::fs::exists(bad_out));
}

// (e) Bad values: one line naming the key, exit 2.
TEST(EmaRun, BadValuesAreOneLineAndExit2) {
  struct Case {
    std::string set, line;
  };
  const std::string decay = "error: config: key 'train.ema_decay': must be in (0, 1), or 0 (off)\n";
  for (const Case& c : {Case{"train.ema_decay=1", decay}, Case{"train.ema_decay=1.5", decay},
                        Case{"train.ema_decay=-0.1", decay},
                        Case{"train.ema_every=0",
                             "error: config: key 'train.ema_every': must be at least 1 (optimizer steps between updates)\n"}}) {
    auto r = testutil::run(testutil::trainer_bin() + " --dry-run --set data.kind=synthetic --set " + c.set);
    EXPECT_EQ(r.exit_code, 2) << c.set;
    EXPECT_EQ(r.output, c.line) << c.set;
  }
}

}  // namespace test_ema
