// Mixup and CutMix (trainer/mix/mixing.h) and the losses of soft targets and BCE (trainer/numerics/loss.h):
// boxes by hand, mixed batches against timm's own Mixup given the same draws (the 2.11 leg, which has timm),
// the draws' distributions against Beta's moments, the losses against torch's own functions, and through
// the executable: micro-batches that mix as one batch, and bad keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/mix/mixing.h"
#include "trainer/numerics/loss.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_mix {

using testutil::TempDir;
using trainer::MixBox;
using trainer::MixDraw;
using trainer::MixOptions;

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/mix_ref.py"; }

MixOptions options(double mixup, double cutmix, const std::string& mode, double prob = 1.0) {
  MixOptions o;
  o.mixup_alpha = mixup;
  o.cutmix_alpha = cutmix;
  o.mode = trainer::mode_from_name<trainer::MixMode>(mode);
  o.prob = prob;
  return o;
}

void expect_box(const MixBox& b, int64_t y0, int64_t y1, int64_t x0, int64_t x1) {
  EXPECT_EQ(b.y0, y0);
  EXPECT_EQ(b.y1, y1);
  EXPECT_EQ(b.x0, x0);
  EXPECT_EQ(b.x1, x1);
}

// The micro-batches [0, 3), [3, 8), [8, B) of a batch, mixed as the step mixes them (each with the
// mirrored slice, reversed), concatenated.
torch::Tensor mixed_in_pieces(const torch::Tensor& x, const MixDraw& draw) {
  const int64_t b = x.size(0);
  std::vector<torch::Tensor> parts;
  for (auto [offset, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}, {8, b - 8}}) {
    auto partner = x.narrow(0, b - offset - n, n).flip(0);
    parts.push_back(trainer::mix_images(x.narrow(0, offset, n), partner, draw, offset));
  }
  return torch::cat(parts);
}

torch::Tensor targets_in_pieces(const torch::Tensor& y, const MixDraw& draw, int64_t classes, double smoothing) {
  const int64_t b = y.size(0);
  std::vector<torch::Tensor> parts;
  for (auto [offset, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 5}, {8, b - 8}})
    parts.push_back(trainer::mix_targets(y.narrow(0, offset, n), y.narrow(0, b - offset - n, n).flip(0), draw, offset,
                                         classes, smoothing));
  return torch::cat(parts);
}

}  // namespace

// timm's rand_bbox (margin 0) given the centre, by hand: cut = int(side * sqrt(1 - lam)), the box
// [c - cut // 2, c + (cut + 1) // 2) clipped to the image.
TEST(Mix, CutmixBoxByHand) {
  expect_box(trainer::cutmix_box(32, 32, 0.75, 16, 16), 8, 24, 8, 24);  // cut 16
  expect_box(trainer::cutmix_box(32, 32, 0.75, 0, 31), 0, 8, 23, 32);   // clipped at two borders
  expect_box(trainer::cutmix_box(28, 20, 0.5, 10, 3), 1, 20, 0, 10);    // cut 19 and 14: odd and even
  expect_box(trainer::cutmix_box(10, 10, 1.0, 5, 5), 5, 5, 5, 5);       // lam 1: an empty box
  expect_box(trainer::cutmix_box(10, 10, 0.0, 5, 5), 0, 10, 0, 10);     // lam 0: the whole image
  // Per element timm computes in float32: sqrt(1 - 0.36f) * 25 = 20.000002f where double gives 20 exactly.
  const double lam = 0.36;
  EXPECT_EQ(static_cast<int64_t>(25 * std::sqrt(1.0 - lam)), 20);
  const MixBox f = trainer::cutmix_box(25, 25, lam, 12, 12, /*in_float32=*/true);
  EXPECT_EQ(f.y1 - f.y0, static_cast<int64_t>(25.0f * std::sqrt(1.0f - static_cast<float>(lam))));
}

// The draws: Beta(alpha, alpha)'s mean 1/2 and variance 1 / (4 (2 alpha + 1)) over 20,000 variates, for
// the alphas recipes use (0.1 to 1) and one above 1; each within 5 standard errors (seeded: deterministic).
TEST(Mix, BetaMoments) {
  for (double alpha : {0.1, 0.2, 0.8, 1.0, 2.5}) {
    const int n = 20000;
    double sum = 0, sum2 = 0;
    for (int i = 0; i < n; ++i) {
      const double v = trainer::beta_sample(alpha, 1000003ULL * i + 17);
      ASSERT_GE(v, 0.0);
      ASSERT_LE(v, 1.0);
      sum += v, sum2 += v * v;
    }
    const double mean = sum / n, var = sum2 / n - mean * mean;
    const double want_var = 1.0 / (4.0 * (2.0 * alpha + 1.0));
    EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(want_var / n)) << "alpha " << alpha;
    // The variance's standard error for a Beta(a, a): sqrt((mu4 - var^2) / n), bounded here by var / sqrt(n) * 2.
    EXPECT_NEAR(var, want_var, 5 * 2 * want_var / std::sqrt(n)) << "alpha " << alpha;
  }
}

// What is mixed, and how often: with prob p a batch is mixed; with both alphas CutMix takes switch_prob of
// them; per element each sample decides alone. The same (seed, step, rank) draws the same; another step or
// rank draws otherwise.
TEST(Mix, DrawRatesAndDeterminism) {
  const auto both = options(0.2, 1.0, "batch", 0.6);
  int mixed = 0, cut = 0;
  const int steps = 4000;
  for (int s = 1; s <= steps; ++s) {
    const MixDraw d = trainer::draw_mix(both, 8, 32, 32, 7, s, 0);
    ASSERT_EQ(d.size(), 8);
    for (int k = 1; k < 8; ++k) ASSERT_EQ(d.lam[k], d.lam[0]);  // one decision per batch
    if (d.drawn[0] != 1.0) ++mixed, cut += d.cutmix[0];
  }
  const double p = 0.6, se = std::sqrt(p * (1 - p) / steps);
  EXPECT_NEAR(static_cast<double>(mixed) / steps, p, 5 * se);
  EXPECT_NEAR(static_cast<double>(cut) / mixed, 0.5, 5 * std::sqrt(0.25 / mixed));

  const auto elem = options(1.0, 0.0, "elem", 0.5);
  const MixDraw e = trainer::draw_mix(elem, 4000, 16, 16, 7, 1, 0);
  int64_t elem_mixed = 0;
  for (int64_t k = 0; k < e.size(); ++k) {
    elem_mixed += e.lam[k] != 1.0;
    EXPECT_FALSE(e.cutmix[k]);
    EXPECT_EQ(e.lam[k], static_cast<double>(static_cast<float>(e.lam[k])));  // float32, as timm's array
  }
  EXPECT_NEAR(static_cast<double>(elem_mixed) / 4000, 0.5, 5 * std::sqrt(0.25 / 4000));

  const MixDraw a = trainer::draw_mix(both, 8, 32, 32, 7, 12, 1), again = trainer::draw_mix(both, 8, 32, 32, 7, 12, 1);
  EXPECT_EQ(a.lam, again.lam);
  EXPECT_EQ(a.cy, again.cy);
  int differ = 0;
  for (int s = 1; s <= 20; ++s)
    differ += trainer::draw_mix(both, 8, 32, 32, 7, s, 0).drawn != trainer::draw_mix(both, 8, 32, 32, 7, s, 1).drawn;
  EXPECT_GE(differ, 15);  // ranks draw their own (a batch left unmixed on both ranks draws alike)
  EXPECT_FALSE(trainer::draw_mix(MixOptions{}, 8, 32, 32, 7, 1, 0).any());
}

// Images and soft targets against timm's Mixup, called on the same batch with its draws replaced by ours:
// per batch and per element, Mixup alone, CutMix alone and both, with label smoothing. Bit for bit, both
// for the batch mixed whole and for it mixed in micro-batches of 3, 5 and 8 (each with its mirrored slice).
TEST(Mix, EqualsTimmGivenTheSameDraws) {
  const std::string missing = testutil::missing_module_of(ref_script());
  if (!missing.empty())
    GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing
                 << " (scripts/install-torch.sh installs timm into the 2.11 venv)";
  TempDir dir;
  torch::manual_seed(5);
  const int64_t b = 16, classes = 10;
  const double smoothing = 0.1;
  auto x = torch::randn({b, 3, 24, 20});
  auto y = torch::randint(0, classes, {b}, torch::kLong);
  // Every case's batch and draw written first; one Python process mixes them all (timm imports slowly).
  struct Case {
    MixOptions o;
    int64_t step;
    MixDraw d;
  };
  std::vector<Case> cases;
  std::ofstream list(dir / "cases.txt");
  for (const auto& o : {options(0.8, 0, "batch"), options(0, 1.0, "batch"), options(0.2, 1.0, "batch"),
                        options(0.8, 0, "elem"), options(0, 1.0, "elem"), options(0.2, 1.0, "elem", 0.7)}) {
    for (int64_t step : {1, 2, 3}) {
      const MixDraw d = trainer::draw_mix(o, b, 24, 20, 11, step, 0);
      if (!d.any()) continue;
      const std::string k = std::to_string(cases.size());
      auto vec = [&](auto v, auto dtype) { return torch::tensor(v, dtype); };
      std::vector<int64_t> cut(d.cutmix.begin(), d.cutmix.end());
      trainer::write_safetensors((dir / ("in" + k + ".safetensors")).string(),
                                 {{"x", x}, {"target", y}, {"drawn", vec(d.drawn, torch::kDouble)},
                                  {"cutmix", vec(cut, torch::kLong).to(torch::kUInt8)}, {"cy", vec(d.cy, torch::kLong)},
                                  {"cx", vec(d.cx, torch::kLong)}});
      list << k << " " << trainer::mode_name(o.mode) << "\n";
      cases.push_back({o, step, d});
    }
  }
  list.close();
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " mix " + dir.path.string() + " " +
                               std::to_string(smoothing) + " " + std::to_string(classes));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [o, step, d] = cases[i];
    std::map<std::string, torch::Tensor> ref;
    for (auto& [name, t] : trainer::read_safetensors((dir / ("out" + std::to_string(i) + ".safetensors")).string()).tensors)
      ref[name] = t;
    const std::string what = trainer::mode_name(o.mode) + " mixup " + std::to_string(o.mixup_alpha) + " cutmix " +
                             std::to_string(o.cutmix_alpha) + " step " + std::to_string(step);
    EXPECT_TRUE(trainer::mix_images(x, x.flip(0), d, 0).equal(ref.at("x"))) << what;
    EXPECT_TRUE(mixed_in_pieces(x, d).equal(ref.at("x"))) << what;
    EXPECT_TRUE(trainer::mix_targets(y, y.flip(0), d, 0, classes, smoothing).equal(ref.at("target"))) << what;
    EXPECT_TRUE(targets_in_pieces(y, d, classes, smoothing).equal(ref.at("target"))) << what;
  }
  const auto cut_cases = std::count_if(cases.begin(), cases.end(), [](const Case& c) {
    return std::find(c.d.cutmix.begin(), c.d.cutmix.end(), 1) != c.d.cutmix.end();
  });
  EXPECT_GE(cases.size(), 12u);
  EXPECT_GE(cut_cases, 4);  // CutMix's boxes were compared, not only Mixup's blends
}

// An undecodable sample (label -100) adds nothing of its own share: its one-hot row is zeros.
TEST(Mix, IgnoredLabelsAddNothing) {
  auto t = trainer::smoothed_one_hot(torch::tensor({2, -100, 0}, torch::kLong), 4, 0.2);
  auto want = torch::tensor({0.05f, 0.05f, 0.85f, 0.05f, 0.f, 0.f, 0.f, 0.f, 0.85f, 0.05f, 0.05f, 0.05f}).view({3, 4});
  EXPECT_TRUE(t.allclose(want, 0, 1e-7)) << t;
}

// The losses against torch's own: soft-target cross-entropy against cross_entropy with probability targets
// (reduction sum); class ids under BCE against binary_cross_entropy_with_logits on the smoothed one-hot (the
// mean over rows and classes, times the rows), thresholded as RSB does, and summed over classes.
TEST(MixLoss, SoftTargetsAndBceEqualTorch) {
  namespace F = torch::nn::functional;
  torch::manual_seed(3);
  const int64_t n = 6, c = 5;
  auto logits = torch::randn({n, c}) * 3;
  auto labels = torch::tensor({0, 4, 2, 2, 1, 3}, torch::kLong);
  auto soft = torch::softmax(torch::randn({n, c}), 1);
  trainer::LossOptions ce;
  auto mine = trainer::summed_loss(logits, soft, ce);
  auto theirs = F::cross_entropy(logits, soft, F::CrossEntropyFuncOptions().reduction(torch::kSum));
  EXPECT_NEAR(mine.item<double>(), theirs.item<double>(), 1e-5 * theirs.item<double>());
  // Class ids under cross-entropy: unchanged (PyTorch's label smoothing).
  ce.label_smoothing = 0.1;
  auto ids = trainer::summed_loss(logits, labels, ce);
  auto torch_ids = F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(0.1));
  EXPECT_TRUE(ids.equal(torch_ids));

  trainer::LossOptions bce;
  bce.kind = trainer::LossKind::kBce;
  bce.label_smoothing = 0.1;
  auto smooth = torch::full({n, c}, 0.1 / c);
  smooth.scatter_(1, labels.unsqueeze(1), 1 - 0.1 + 0.1 / c);
  auto want = F::binary_cross_entropy_with_logits(logits, smooth) * n;  // mean over n * c, times n
  EXPECT_NEAR(trainer::summed_loss(logits, labels, bce).item<double>(), want.item<double>(), 1e-5 * want.item<double>());
  bce.bce_target_threshold = 0.2;
  auto binary = (smooth > 0.2).to(torch::kFloat);
  want = F::binary_cross_entropy_with_logits(logits, binary) * n;
  EXPECT_NEAR(trainer::summed_loss(logits, labels, bce).item<double>(), want.item<double>(), 1e-5 * want.item<double>());
  bce.bce_sum_classes = true;
  want = F::binary_cross_entropy_with_logits(logits, binary, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kSum));
  EXPECT_NEAR(trainer::summed_loss(logits, labels, bce).item<double>(), want.item<double>(), 1e-5 * want.item<double>());
  // Soft targets under BCE are thresholded as they are, not smoothed again.
  bce.bce_target_threshold = 0;
  bce.bce_sum_classes = false;
  want = F::binary_cross_entropy_with_logits(logits, soft) * n;
  EXPECT_NEAR(trainer::summed_loss(logits, soft, bce).item<double>(), want.item<double>(), 1e-5 * want.item<double>());
}

// ---- through the executable ---------------------------------------------------------------------------

using testutil::exact_job;
using testutil::run_and_export;

// The step mixes the rank's whole batch whatever its micro-batches: micro-batches of 12, 5 + 5 + 2 and 3 x 4
// end at the same weights, per batch and per element. And mixing did change the training: the weights differ
// from the unmixed run's.
TEST(MixRun, MicroBatchesMixAsOneBatch) {
  TempDir dir;
  const std::string mix = "--set train.mixup_alpha=0.4 --set train.cutmix_alpha=1.0 --set train.label_smoothing=0.1 ";
  for (const std::string mode : {"batch", "elem"}) {
    const std::string m = mix + "--set train.mix_mode=" + mode + " ";
    auto one = run_and_export(dir, mode + "one", exact_job(m + "--set train.micro_batch=12"));
    auto uneven = run_and_export(dir, mode + "uneven", exact_job(m + "--set train.micro_batch=5"));
    auto four = run_and_export(dir, mode + "four", exact_job(m + "--set train.micro_batch=3"));
    EXPECT_LT(testutil::max_abs_diff(one, uneven), 1e-5) << mode;
    EXPECT_LT(testutil::max_abs_diff(one, four), 1e-5) << mode;
    auto plain = run_and_export(dir, mode + "plain", exact_job("--set train.label_smoothing=0.1 --set train.micro_batch=12"));
    EXPECT_GT(testutil::max_abs_diff(one, plain), 1e-4) << mode;
  }
  // BCE trains, and is another loss than cross-entropy.
  auto bce = run_and_export(dir, "bce", exact_job("--set train.loss=bce --set train.bce_target_threshold=0.2"));
  auto ce = run_and_export(dir, "ce", exact_job(""));
  EXPECT_GT(testutil::max_abs_diff(bce, ce), 1e-4);
}

// Bad values: one line naming the key, exit 2.
TEST(MixRun, BadKeysExitTwo) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--set train.mixup_alpha=-0.1", "train.mixup_alpha"},
      {"--set train.cutmix_alpha=-1", "train.cutmix_alpha"},
      {"--set train.mix_prob=1.5", "train.mix_prob"},
      {"--set train.mix_switch_prob=-0.5", "train.mix_switch_prob"},
      {"--set train.mix_mode=pair", "train.mix_mode"},
      {"--set train.loss=focal", "train.loss"},
      {"--set train.bce_target_threshold=1", "train.bce_target_threshold"},
      {"--set model.name=gpt_tiny --set train.mixup_alpha=0.2", "train.mixup_alpha"},
  };
  for (const auto& [args, key] : cases) {
    auto r = testutil::run(testutil::trainer_cmd((dir / "bad").string(), exact_job(args)));
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(key), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << "\n" << r.output;
  }
}

}  // namespace test_mix
