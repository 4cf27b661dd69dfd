// data/pixels/transforms.h: RandomResizedCrop's boxes against torchvision's get_params (distributions), the eval
// box against torchvision's Resize + CenterCrop (exact), and the (seed, epoch, index) determinism.
#include "data/pixels/transforms.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_transforms {

namespace {

struct Box {
  double x, y, w, h;
};

/// Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical distribution functions.
double ks_statistic(std::vector<double> a, std::vector<double> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  size_t i = 0, j = 0;
  double d = 0;
  while (i < a.size() && j < b.size()) {
    const double v = std::min(a[i], b[j]);
    while (i < a.size() && a[i] <= v) ++i;
    while (j < b.size() && b[j] <= v) ++j;
    d = std::max(d, std::abs(static_cast<double>(i) / a.size() - static_cast<double>(j) / b.size()));
  }
  return d;
}

/// torchvision's boxes: n per shape, the shapes one after the other.
std::vector<Box> torchvision_boxes(const std::vector<std::pair<int, int>>& shapes, int n) {
  std::string args;
  for (const auto& [w, h] : shapes) args += " " + std::to_string(w) + "," + std::to_string(h);
  const auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/tests/ref/jpeg_ref.py rrc " +
                               std::to_string(n) + " 0" + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<Box> boxes;
  std::istringstream in(r.output);
  double i, j, bh, bw;
  while (in >> i >> j >> bh >> bw) boxes.push_back({j, i, bw, bh});
  EXPECT_EQ(boxes.size(), shapes.size() * n) << r.output.substr(0, 500);
  boxes.resize(shapes.size() * n);
  return boxes;
}

// Over 10,000 draws per image shape, our boxes and torchvision's RandomResizedCrop.get_params (default
// scale (0.08, 1) and ratio (3/4, 4/3)) have the same distributions of area fraction, aspect ratio and
// relative center position: the two-sample Kolmogorov-Smirnov statistic D stays under 0.035. For two
// samples of 10,000 from the same distribution, D exceeds 0.035 with probability about 1e-5 (Smirnov's
// asymptotic formula, 2 exp(-2 * 2.47^2)), so the 20 comparisons fail by chance about once in 5,000
// draws of the seeds; both generators are seeded, so the test is deterministic (measured D: 0.002 to
// 0.025). The shapes include extreme ones (10:1, 1:6), where most tries fail and the center fallback
// decides much of the distribution, and a tiny one (7x5), where the rounding of w and h does.
TEST(Transforms, RandomResizedCropMatchesTorchvisionDistribution) {
  const int n = 10000;
  const std::vector<std::pair<int, int>> shapes = {{500, 375}, {375, 500}, {1000, 100}, {60, 360}, {7, 5}};
  const auto all = torchvision_boxes(shapes, n);
  for (size_t s_i = 0; s_i < shapes.size(); ++s_i) {
    const auto [W, H] = shapes[s_i];
    const std::vector<Box> ref(all.begin() + s_i * n, all.begin() + (s_i + 1) * n);
    std::vector<double> area[2], ratio[2], cx[2], cy[2];
    for (int k = 0; k < n; ++k) {
      const data::CropBox b = data::random_resized_crop(W, H, 0.08, 1.0, 3.0 / 4, 4.0 / 3, 123, 0, k, nullptr);
      // Whole pixels, inside the image.
      ASSERT_EQ(b.x, std::floor(b.x));
      ASSERT_EQ(b.w, std::floor(b.w));
      ASSERT_TRUE(b.x >= 0 && b.y >= 0 && b.w >= 1 && b.h >= 1 && b.x + b.w <= W && b.y + b.h <= H)
          << b.x << "," << b.y << " " << b.w << "x" << b.h;
      for (int s = 0; s < 2; ++s) {
        const Box& v = s == 0 ? Box{b.x, b.y, b.w, b.h} : ref[k];
        area[s].push_back(v.w * v.h / (static_cast<double>(W) * H));
        ratio[s].push_back(v.w / v.h);
        cx[s].push_back((v.x + v.w / 2) / W);
        cy[s].push_back((v.y + v.h / 2) / H);
      }
    }
    EXPECT_LT(ks_statistic(area[0], area[1]), 0.035) << W << "x" << H << " area";
    EXPECT_LT(ks_statistic(ratio[0], ratio[1]), 0.035) << W << "x" << H << " ratio";
    EXPECT_LT(ks_statistic(cx[0], cx[1]), 0.035) << W << "x" << H << " center x";
    EXPECT_LT(ks_statistic(cy[0], cy[1]), 0.035) << W << "x" << H << " center y";
    std::printf("%dx%d: KS area %.4f ratio %.4f cx %.4f cy %.4f\n", W, H, ks_statistic(area[0], area[1]),
                ks_statistic(ratio[0], ratio[1]), ks_statistic(cx[0], cx[1]), ks_statistic(cy[0], cy[1]));
  }
}

// The center fallback alone, computed by hand: for a 1000x10 image no try can fit (an area of at least
// 800 pixels needs h >= 25 at ratio 4/3), so every draw is the fallback: ratio 100 > 4/3 gives h = 10,
// w = round(10 * 4/3) = 13, centered: x = (1000 - 13) // 2 = 493.
TEST(Transforms, RandomResizedCropFallbackIsTorchvisions) {
  for (int64_t i = 0; i < 100; ++i) {
    const data::CropBox b = data::random_resized_crop(1000, 10, 0.08, 1.0, 3.0 / 4, 4.0 / 3, 1, 0, i, nullptr);
    ASSERT_EQ(b.x, 493);
    ASSERT_EQ(b.y, 0);
    ASSERT_EQ(b.w, 13);
    ASSERT_EQ(b.h, 10);
  }
  // Tall: ratio 1/100 < 3/4 gives w = 10, h = round(10 / 0.75) = 13, y = (1000 - 13) // 2 = 493.
  const data::CropBox t = data::random_resized_crop(10, 1000, 0.08, 1.0, 3.0 / 4, 4.0 / 3, 1, 0, 5, nullptr);
  EXPECT_EQ(t.x, 0);
  EXPECT_EQ(t.y, 493);
  EXPECT_EQ(t.w, 10);
  EXPECT_EQ(t.h, 13);
}

// A sample's box and flip depend on (seed, epoch, index) alone: the same triple gives the same box in any
// order of calls; another epoch, index or seed gives other boxes; the flip is a fair coin (20,000 draws:
// 0.5 +- 0.015, over 4 standard deviations).
TEST(Transforms, RandomResizedCropIsAFunctionOfSeedEpochIndex) {
  auto draw = [](uint64_t seed, int64_t epoch, int64_t index) {
    bool flip = false;
    const data::CropBox b = data::random_resized_crop(640, 480, 0.08, 1.0, 3.0 / 4, 4.0 / 3, seed, epoch, index, &flip);
    return std::vector<double>{b.x, b.y, b.w, b.h, flip ? 1.0 : 0.0};
  };
  std::vector<std::vector<double>> first;
  for (int64_t i = 0; i < 50; ++i) first.push_back(draw(9, 3, i));
  for (int64_t i = 49; i >= 0; --i) EXPECT_EQ(draw(9, 3, i), first[i]);
  int same_epoch = 0, same_seed = 0, same_index = 0;
  for (int64_t i = 0; i < 50; ++i) {
    same_epoch += draw(9, 4, i) == first[i];
    same_seed += draw(10, 3, i) == first[i];
    same_index += draw(9, 3, i + 50) == first[i];
  }
  EXPECT_LE(same_epoch, 1);
  EXPECT_LE(same_seed, 1);
  EXPECT_LE(same_index, 1);
  int flips = 0;
  for (int64_t i = 0; i < 20000; ++i) flips += draw(1, 0, i)[4] > 0;
  EXPECT_NEAR(flips / 20000.0, 0.5, 0.015);
}

// The eval box is exactly torchvision's computation: for each shape, torchvision's Resize(256) output
// size and CenterCrop(224)'s offsets in it (read from torchvision itself) give the box in source pixels
// left * W / new_w, top * H / new_h, 224 * W / new_w, 224 * H / new_h. The shapes cover both
// orientations, the truncation of the longer side (333x500 -> 256x384.384 -> 384), a crop offset that
// rounds half to even (an odd difference), images smaller than 224 and a square.
TEST(Transforms, EvalCenterCropIsTorchvisions) {
  const std::vector<std::pair<int, int>> shapes = {{500, 375}, {375, 500}, {333, 500}, {500, 333}, {257, 300},
                                                   {100, 80},  {224, 224}, {1920, 1080}, {301, 299}, {3, 1000}};
  for (const int size : {224, 160}) {
    std::string args;
    for (const auto& [w, h] : shapes) args += " " + std::to_string(w) + "," + std::to_string(h);
    const auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/tests/ref/jpeg_ref.py evalbox " +
                                 std::to_string(size) + args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream in(r.output);
    for (const auto& [w, h] : shapes) {
      int64_t nw = 0, nh = 0, top = 0, left = 0;
      ASSERT_TRUE(in >> nw >> nh >> top >> left) << r.output;
      const data::CropBox b = data::eval_center_crop(w, h, size);
      const double sx = static_cast<double>(w) / nw, sy = static_cast<double>(h) / nh;
      EXPECT_DOUBLE_EQ(b.x, left * sx) << w << "x" << h << " size " << size;
      EXPECT_DOUBLE_EQ(b.y, top * sy) << w << "x" << h << " size " << size;
      EXPECT_DOUBLE_EQ(b.w, size * sx) << w << "x" << h << " size " << size;
      EXPECT_DOUBLE_EQ(b.h, size * sy) << w << "x" << h << " size " << size;
    }
  }
}

TEST(Transforms, BadArgumentsAreRefused) {
  EXPECT_THROW(data::random_resized_crop(0, 10, 0.08, 1, 0.75, 1.33, 0, 0, 0, nullptr), std::invalid_argument);
  EXPECT_THROW(data::random_resized_crop(10, 10, 0.5, 0.1, 0.75, 1.33, 0, 0, 0, nullptr), std::invalid_argument);
  EXPECT_THROW(data::random_resized_crop(10, 10, 0.08, 1, 0, 1.33, 0, 0, 0, nullptr), std::invalid_argument);
  EXPECT_THROW(data::eval_center_crop(10, 10, 0), std::invalid_argument);
  EXPECT_THROW(data::eval_center_crop(10, 10, 224, 1.5), std::invalid_argument);
  EXPECT_NE(testutil::error_text([] { data::eval_center_crop(-1, 10, 224); }).find("needs a non-empty image"),
            std::string::npos);
}

}  // namespace

}  // namespace test_transforms
