// RandAugment, TrivialAugmentWide and RandomErasing (data/pixels/augment.h) against torchvision
// (tests/ref/augment_ref.py) and against the rules torchvision's get_params states; the loader's
// composition (crop/flip -> auto augment -> float -> erasing) on stored pixels and decoded images, the
// same bits from 1 and 4 threads; the device-side erasing of the step; the config keys' errors.
#include <gtest/gtest.h>

#include "data/pixels/augment.h"
#include "data/pixels/jpeg.h"
#include "data/samples/dataset.h"
#include "data/samples/image_folder.h"
#include "data/samples/loader.h"
#include "test_util.h"
#include "trainer/mix/device_augment.h"
#include "trainer/step/step.h"

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

namespace {

using data::AugmentOp;
using data::ImageU8;
using testutil::TempDir;

std::string ref_script() { return testutil::source_dir() + "/tests/ref/augment_ref.py"; }

// Operations whose output is torchvision's bit for bit; the others resample an affine grid.
bool exact_op(const std::string& name) {
  return name != "ShearX" && name != "ShearY" && name != "TranslateX" && name != "TranslateY" && name != "Rotate";
}

AugmentOp op_of(const std::string& name) {
  for (int k = 0; k < data::kAugmentOps; ++k)
    if (name == data::augment_op_name(static_cast<AugmentOp>(k))) return static_cast<AugmentOp>(k);
  throw std::runtime_error("unknown op " + name);
}

std::vector<uint8_t> chw_to_hwc(const std::vector<uint8_t>& x, int64_t C, int64_t H, int64_t W) {
  std::vector<uint8_t> y(x.size());
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < H * W; ++i) y[i * C + c] = x[c * H * W + i];
  return y;
}

// Pixels (all channels of one position) that differ.
int64_t differing_pixels(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t C, int64_t H, int64_t W) {
  int64_t n = 0;
  for (int64_t i = 0; i < H * W; ++i) {
    bool diff = false;
    for (int64_t c = 0; c < C; ++c) diff |= a[c * H * W + i] != b[c * H * W + i];
    n += diff;
  }
  return n;
}

}  // namespace

// Every op on 1- and 3-channel images, square and not, positive and negative magnitudes, planar and
// interleaved, against torchvision's _apply_op on the same uint8 tensor. Tolerances: the nine colour and
// histogram ops are exact; the five geometric ops (nearest neighbour on an affine grid) may give at most
// 5% of an image's pixels their neighbour's value. Those are pixels whose source coordinate is a
// half-pixel tie (a 90-degree turn of a 24 x 31 image is all ties in one axis), rounded by float32
// noise: this grid is torch 2.x's (plain float32 products and sums), torch 1.13's matrix product fuses
// them (FMA) and sends some ties the other way.
TEST(AugmentOps, EqualTorchvisionFunctional) {
  const std::string missing = testutil::missing_module_of(ref_script());
  if (!missing.empty()) GTEST_SKIP() << "the reference Python lacks " << missing;
  TempDir dir;
  auto r = testutil::run(testutil::python() + " " + ref_script() + " ops " + dir.path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream manifest(dir / "manifest.txt");
  std::string line;
  int cases = 0;
  std::map<std::string, int64_t> worst;  // op -> most differing pixels in one case
  while (std::getline(manifest, line)) {
    std::istringstream in(line);
    std::string op, mag_hex, image;
    int64_t C, H, W, n;
    ASSERT_TRUE(in >> op >> mag_hex >> image >> C >> H >> W >> n) << line;
    const double magnitude = std::strtod(mag_hex.c_str(), nullptr);
    const auto src = testutil::read_bytes(dir / (image + ".bin"));
    const auto want = testutil::read_bytes(dir / (std::to_string(n) + ".bin"));
    ASSERT_EQ(src.size(), static_cast<size_t>(C * H * W));
    auto chw = src;
    data::apply_augment_op(ImageU8{chw.data(), C, H, W, false}, op_of(op), magnitude);
    auto hwc = chw_to_hwc(src, C, H, W);
    data::apply_augment_op(ImageU8{hwc.data(), C, H, W, true}, op_of(op), magnitude);
    EXPECT_EQ(hwc, chw_to_hwc(chw, C, H, W)) << op << " " << magnitude << ": planar and interleaved differ";
    const int64_t diff = differing_pixels(chw, want, C, H, W);
    worst[op] = std::max(worst[op], diff);
    if (exact_op(op)) EXPECT_EQ(diff, 0) << op << "(" << magnitude << ") on " << image;
    else EXPECT_LE(diff, H * W * 5 / 100) << op << "(" << magnitude << ") on " << image;
    ++cases;
  }
  EXPECT_EQ(cases, 404);
  EXPECT_EQ(worst.size(), static_cast<size_t>(data::kAugmentOps));
  for (const auto& [op, d] : worst) std::cout << "  " << op << ": at most " << d << " pixels differ\n";
}

// The magnitude tables are torchvision's _augmentation_space entries, bit for bit, for RandAugment (its
// translations scale with the image) and TrivialAugmentWide.
TEST(AugmentOps, TablesEqualTorchvision) {
  const std::string missing = testutil::missing_module_of(ref_script());
  if (!missing.empty()) GTEST_SKIP() << "the reference Python lacks " << missing;
  for (auto [H, W] : {std::pair<int64_t, int64_t>{28, 28}, {224, 160}}) {
    auto r = testutil::run(testutil::python() + " " + ref_script() + " tables " + std::to_string(H) + " " +
                           std::to_string(W));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream lines(r.output);
    std::string line;
    int rows = 0;
    while (std::getline(lines, line)) {
      std::istringstream in(line);
      std::string kind, op, v;
      int is_signed;
      ASSERT_TRUE(in >> kind >> op >> is_signed) << line;
      const auto k = kind == "RandAugment" ? data::AutoAugmentKind::RandAugment : data::AutoAugmentKind::TrivialAugmentWide;
      const auto space = data::cached_augment_space(k, 31, H, W);
      const int i = static_cast<int>(op_of(op));
      std::vector<float> want;
      while (in >> v)
        if (v != "-") want.push_back(static_cast<float>(std::strtod(v.c_str(), nullptr)));
      EXPECT_EQ(space->magnitudes[i], want) << kind << " " << op << " at " << H << "x" << W;
      EXPECT_EQ(space->is_signed[i], is_signed != 0) << kind << " " << op;
      // The scalar formula is within one float32 step of torch's kernel.
      const auto plain = data::augmentation_space(k, 31, H, W);
      for (size_t j = 0; j < want.size(); ++j)
        EXPECT_LE(std::fabs(plain.magnitudes[i][j] - want[j]), std::fabs(want[j]) * 1.2e-7f) << kind << " " << op;
      ++rows;
    }
    EXPECT_EQ(rows, 2 * data::kAugmentOps);
  }
}

// Hand-computed values of the ops whose rule is short enough to state.
TEST(AugmentOps, HandComputed) {
  std::vector<uint8_t> px = {0, 10, 100, 200, 255, 128};
  data::posterize(ImageU8{px.data(), 1, 2, 3, false}, 4);
  EXPECT_EQ(px, (std::vector<uint8_t>{0, 0, 96, 192, 240, 128}));
  px = {0, 10, 100, 200, 255, 128};
  data::solarize(ImageU8{px.data(), 1, 2, 3, false}, 128);
  EXPECT_EQ(px, (std::vector<uint8_t>{0, 10, 100, 55, 0, 127}));
  px = {50, 60, 70, 80, 90, 100};  // min 50, max 100: (v - 50) * 255 / 50 truncated
  data::autocontrast(ImageU8{px.data(), 1, 2, 3, false});
  EXPECT_EQ(px, (std::vector<uint8_t>{0, 51, 102, 153, 204, 255}));
  px = {1, 2, 3, 4, 5, 6};  // shifted right by one column, zeros enter on the left
  data::translate_x(ImageU8{px.data(), 1, 2, 3, false}, 1.7);
  EXPECT_EQ(px, (std::vector<uint8_t>{0, 1, 2, 0, 4, 5}));
}

// Draws: RandAugment's num_ops ops at the table's bin, TrivialAugmentWide's one op at any bin, signs both
// ways; a function of (seed, epoch, index) only.
TEST(AugmentDraws, FollowThePolicies) {
  const auto space = data::augmentation_space(data::AutoAugmentKind::RandAugment, 31, 32, 32);
  data::AutoAugmentOptions o;
  o.kind = data::AutoAugmentKind::RandAugment;
  o.num_ops = 3;
  o.magnitude = 9;
  std::map<int, int> ops;
  int negative = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    const auto d = data::draw_auto_augment(o, space, 7, 1, i);
    ASSERT_EQ(d.size(), 3u);
    for (const auto& x : d) {
      const int k = static_cast<int>(x.op);
      ++ops[k];
      const double m = space.magnitudes[k].empty() ? 0.0 : space.magnitudes[k][9];
      EXPECT_EQ(std::fabs(x.magnitude), m) << data::augment_op_name(x.op);
      negative += x.magnitude < 0;
    }
    EXPECT_EQ(d[0].op, data::draw_auto_augment(o, space, 7, 1, i)[0].op);
  }
  EXPECT_EQ(ops.size(), static_cast<size_t>(data::kAugmentOps));
  for (const auto& [k, n] : ops) EXPECT_NEAR(n, 6000.0 / 14, 90) << k;  // > 4 sigma
  EXPECT_GT(negative, 1000);  // 9 of 14 ops signed, half of them negative: about 1930
  const auto ta = data::augmentation_space(data::AutoAugmentKind::TrivialAugmentWide, 31, 32, 32);
  o.kind = data::AutoAugmentKind::TrivialAugmentWide;
  std::map<float, int> rotations;
  for (int64_t i = 0; i < 3000; ++i) {
    const auto d = data::draw_auto_augment(o, ta, 7, 0, i);
    ASSERT_EQ(d.size(), 1u);
    if (d[0].op == AugmentOp::Rotate) ++rotations[static_cast<float>(d[0].magnitude)];
  }
  EXPECT_GT(rotations.size(), 50u);  // 31 bins, two signs (0 once)
  EXPECT_LE(rotations.size(), 61u);
}

namespace {

struct EraseStats {
  double h = 0, w = 0, top = 0, left = 0, untouched = 0, sd_h = 0, sd_w = 0;
};

EraseStats erase_stats(int64_t H, int64_t W, double p, int n) {
  data::EraseOptions o;
  o.p = p;
  EraseStats s;
  double hh = 0, ww = 0;
  int boxes = 0;
  for (int i = 0; i < n; ++i) {
    const auto b = data::draw_erase_box(o, H, W, 3, 0, i);
    if (b.empty()) {
      s.untouched += 1;
      continue;
    }
    // get_params' rules, by hand: h < H, w < W, the box inside the image; sqrt(area * r) and sqrt(area / r)
    // round to h and w, so (h +- 1/2)(w +- 1/2) brackets area in [0.02, 0.33] * H * W and (h +- 1/2) /
    // (w -+ 1/2) brackets r in [0.3, 3.3].
    EXPECT_TRUE(b.height < H && b.width < W && b.top >= 0 && b.left >= 0 && b.top + b.height <= H &&
                b.left + b.width <= W);
    const double A = static_cast<double>(H * W), h = static_cast<double>(b.height), w = static_cast<double>(b.width);
    EXPECT_GE((h + 0.5) * (w + 0.5), 0.02 * A);
    EXPECT_LE((h - 0.5) * (w - 0.5), 0.33 * A);
    EXPECT_GE((h + 0.5) / (w - 0.5), 0.3);
    EXPECT_LE((h - 0.5) / (w + 0.5), 3.3);
    s.h += h, s.w += w, s.top += static_cast<double>(b.top), s.left += static_cast<double>(b.left);
    hh += h * h, ww += w * w;
    ++boxes;
  }
  s.h /= boxes, s.w /= boxes, s.top /= boxes, s.left /= boxes, s.untouched /= n;
  s.sd_h = std::sqrt(hh / boxes - s.h * s.h), s.sd_w = std::sqrt(ww / boxes - s.w * s.w);
  return s;
}

}  // namespace

// RandomErasing's boxes keep get_params' rules (above) and match torchvision's own draws in distribution:
// the mean height, width and corner within 5 standard errors of the difference, the share of images left
// alone (p and the ten failed tries) within 5 standard errors.
TEST(AugmentErasing, BoxesFollowGetParams) {
  const std::string missing = testutil::missing_module_of(ref_script());
  for (auto [H, W] : {std::pair<int64_t, int64_t>{28, 28}, {224, 224}, {32, 96}}) {
    const int n = 20000;
    const EraseStats s = erase_stats(H, W, 0.5, n);
    EXPECT_NEAR(s.untouched, 0.5, 5 * std::sqrt(0.25 / n) + (H == 32 ? 0.1 : 0.01)) << H << "x" << W;
    if (!missing.empty()) continue;
    auto r = testutil::run(testutil::python() + " " + ref_script() + " erase " + std::to_string(H) + " " +
                           std::to_string(W) + " " + std::to_string(n));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream in(r.output);
    EraseStats t;
    ASSERT_TRUE(in >> t.h >> t.w >> t.top >> t.left >> t.untouched) << r.output;
    const double se = std::sqrt(2.0 / (n / 2.0));
    EXPECT_NEAR(s.h, t.h, 5 * s.sd_h * se) << H << "x" << W;
    EXPECT_NEAR(s.w, t.w, 5 * s.sd_w * se) << H << "x" << W;
    EXPECT_NEAR(s.top, t.top, 5 * (H / 3.0) * se) << H << "x" << W;
    EXPECT_NEAR(s.left, t.left, 5 * (W / 3.0) * se) << H << "x" << W;
    EXPECT_NEAR(s.untouched, t.untouched, 5 * std::sqrt(0.5 / n)) << H << "x" << W;
  }
  data::EraseOptions never;
  EXPECT_TRUE(data::draw_erase_box(never, 28, 28, 1, 2, 3).empty());
}

// The step's device-side erasing (a tensor op on NHWC floats) sets the same pixels as the loader's
// erase_chw on planar floats.
TEST(AugmentErasing, StepEraseEqualsLoaderErase) {
  const int64_t B = 6, C = 3, H = 20, W = 17;
  auto x = torch::randn({B, C, H, W}).contiguous(at::MemoryFormat::ChannelsLast);
  auto planar = x.contiguous();
  auto boxes = torch::zeros({B, 4}, torch::kInt64);
  data::EraseOptions o;
  o.p = 0.8;
  int erased = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto e = data::draw_erase_box(o, H, W, 11, 0, b);
    erased += !e.empty();
    boxes[b] = torch::tensor({e.top, e.left, e.height, e.width});
    data::erase_chw(planar[b].data_ptr<float>(), C, H, W, e);
  }
  ASSERT_GT(erased, 2);
  auto y = trainer::erase_boxes(x.clone(), boxes);
  EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(torch::equal(y.contiguous(), planar));
  EXPECT_FALSE(torch::equal(y, x));
}

namespace {

std::vector<data::Batch> batches(const std::shared_ptr<const data::ImageDataset>& ds, data::LoaderOptions lo,
                                 int64_t workers, int count) {
  lo.workers = workers;
  data::Loader loader(ds, lo);
  std::vector<data::Batch> out;
  for (int i = 0; i < count; ++i) out.push_back(loader.next());
  return out;
}

void expect_same(const std::vector<data::Batch>& a, const std::vector<data::Batch>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].images, b[i].images)) << "batch " << i;
    EXPECT_EQ(a[i].erase.defined(), b[i].erase.defined());
    if (a[i].erase.defined()) EXPECT_TRUE(torch::equal(a[i].erase, b[i].erase)) << "batch " << i;
  }
}

}  // namespace

// Stored pixels: the loader's sample is crop/flip -> auto augment (uint8) -> normalize -> erase, computed
// by hand from the same (seed, epoch, index); 1 and 4 workers give the same bits, and so does a resumed
// stream.
TEST(AugmentLoader, StoredPixelsComposeAndRepeat) {
  for (int64_t C : {1, 3}) {
    auto ds = std::make_shared<data::SyntheticImageDataset>(64, C, 28, 28, 10, 5);
    data::LoaderOptions lo;
    lo.global_batch = 16;
    lo.seed = 9;
    lo.augment.random_crop_padding = 2;
    lo.augment.hflip = true;
    lo.augment.auto_augment.kind = data::AutoAugmentKind::RandAugment;
    lo.augment.random_erasing = 0.5;
    const auto one = batches(ds, lo, 1, 6), four = batches(ds, lo, 4, 6);
    expect_same(one, four);
    data::Loader resumed(ds, lo);
    resumed.seek(one[5].epoch, one[5].position);
    EXPECT_TRUE(torch::equal(resumed.next().images, one[5].images));
    // By hand, sample 0 of batch 5.
    const auto& b = one[5];
    const int64_t index = b.indices[0], n = C * 28 * 28;
    std::vector<uint8_t> raw(n), crop(n);
    int64_t label;
    ds->read({index}, raw.data(), &label);
    const auto p = data::draw_augment(9, b.epoch, index, lo.augment);
    for (int64_t c = 0; c < C; ++c) data::augment_image_hwc(raw.data() + c * 784, 28, 28, 1, p, 2, crop.data() + c * 784);
    const auto space = data::cached_augment_space(data::AutoAugmentKind::RandAugment, 31, 28, 28);
    data::auto_augment(ImageU8{crop.data(), C, 28, 28, false}, lo.augment.auto_augment, *space, 9, b.epoch, index);
    const auto table = data::pixel_table(ds->mean(), ds->std(), true);
    std::vector<float> want(n);
    data::augment_image(crop.data(), {C, 28, 28}, {}, 0, table.data(), want.data());
    data::EraseOptions eo;
    eo.p = 0.5;
    data::erase_chw(want.data(), C, 28, 28, data::draw_erase_box(eo, 28, 28, 9, b.epoch, index));
    EXPECT_TRUE(torch::equal(b.images[0], torch::from_blob(want.data(), {C, 28, 28})));
    lo.augment.auto_augment.kind = data::AutoAugmentKind::None;
    lo.augment.random_erasing = 0;
    EXPECT_FALSE(torch::equal(batches(ds, lo, 2, 6)[5].images, b.images)) << "the augmentation did something";
  }
}

// Decoded images: TrivialAugmentWide runs on the decoded uint8 crop (HWC) inside the dataset, the erasing
// boxes travel with the batch; 1 and 4 workers agree bit for bit.
TEST(AugmentLoader, DecodedImagesComposeAndRepeat) {
  TempDir dir;
  std::vector<uint8_t> rgb(48 * 40 * 3);
  for (int cls = 0; cls < 2; ++cls)
    for (int i = 0; i < 8; ++i) {
      for (size_t k = 0; k < rgb.size(); ++k) rgb[k] = static_cast<uint8_t>((k * (7 + i) + 31 * cls) % 251);
      testutil::write_bytes(dir / ("c" + std::to_string(cls)) / ("i" + std::to_string(i) + ".jpg"),
                            data::encode_jpeg(rgb.data(), 48, 40, 90));
    }
  data::ImageTransform t;
  t.size = 24;
  t.seed = 4;
  auto plain = std::make_shared<data::ImageFolderDataset>(dir.path.string(), t);
  t.auto_augment.kind = data::AutoAugmentKind::TrivialAugmentWide;
  auto ta = std::make_shared<data::ImageFolderDataset>(dir.path.string(), t, plain->mean(), plain->std());
  data::LoaderOptions lo;
  lo.global_batch = 8;
  lo.seed = 4;
  lo.augment.random_erasing = 0.7;
  const auto one = batches(ta, lo, 1, 4), four = batches(ta, lo, 4, 4);
  expect_same(one, four);
  ASSERT_TRUE(one[0].erase.defined());
  EXPECT_EQ(one[0].erase.sizes(), (std::vector<int64_t>{8, 4}));
  // The augmented sample is the plain decode with the drawn ops applied to it.
  const auto& b = one[3];
  std::vector<uint8_t> want(24 * 24 * 3);
  int64_t label;
  plain->read_epoch({b.indices[1]}, b.epoch, want.data(), &label, nullptr);
  data::auto_augment(ImageU8{want.data(), 3, 24, 24, true}, t.auto_augment,
                     *data::cached_augment_space(t.auto_augment.kind, 31, 24, 24), 4, b.epoch, b.indices[1]);
  const auto got = b.images[1].permute({1, 2, 0}).contiguous();  // (H, W, C)
  EXPECT_TRUE(torch::equal(got, torch::from_blob(want.data(), {24, 24, 3}, torch::kUInt8)));
  data::EraseOptions eo;
  eo.p = 0.7;
  const auto e = data::draw_erase_box(eo, 24, 24, 4, b.epoch, b.indices[1]);
  EXPECT_TRUE(torch::equal(b.erase[1], torch::tensor({e.top, e.left, e.height, e.width})));
  // The loader refuses to augment decoded images itself: the dataset does.
  lo.augment.auto_augment.kind = data::AutoAugmentKind::RandAugment;
  EXPECT_THROW(data::Loader(ta, lo), std::invalid_argument);
}

// Bad values: one line naming the key, exit 2.
TEST(AugmentConfig, BadValuesExitTwoNamingTheKey) {
  TempDir dir;
  const std::string job = testutil::trainer_bin() + " --run-dir " + (dir / "run").string() +
                          " --set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16]"
                          " --set data.synthetic_size=64 --set data.test= --set train.global_batch=16"
                          " --set train.epochs=0 --set train.steps=2 --set checkpoint.every_seconds=0"
                          " --set train.threads=1 --set data.workers=1 ";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"data.auto_augment=autoaugment", "data.auto_augment"},
      {"data.randaugment_magnitude=31", "data.randaugment_magnitude"},
      {"data.randaugment_magnitude=-1", "data.randaugment_magnitude"},
      {"data.randaugment_ops=-2", "data.randaugment_ops"},
      {"data.random_erasing=1.5", "data.random_erasing"},
      {"data.random_erasing=-0.1", "data.random_erasing"},
  };
  for (const auto& [set, key] : bad) {
    auto r = testutil::run(job + "--set " + set);
    EXPECT_EQ(r.exit_code, 2) << set << "\n" << r.output;
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    const std::string last = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
    EXPECT_EQ(last.rfind("error: ", 0), 0u) << r.output;
    EXPECT_NE(last.find(key), std::string::npos) << r.output;
    EXPECT_EQ(out.find("error: "), out.rfind("error: ")) << "one error line:\n" << r.output;
  }
  // And the good ones train (the stored-pixel path of the run).
  auto r = testutil::run(job + "--set data.auto_augment=randaugment --set data.random_erasing=0.5");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}
