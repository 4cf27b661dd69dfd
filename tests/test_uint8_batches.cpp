// Stored pixels as uint8 batches (data::LoaderOptions::uint8_batches, data.uint8_batches): converted,
// normalized and erased by the step's own functions, they equal the loader's float batches; the config
// key is validated; a short training run gives the losses of the float path.
#include <gtest/gtest.h>

#include "data/samples/dataset.h"
#include "data/samples/loader.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/numerics/forward.h"
#include "trainer/run/from_config.h"
#include "trainer/mix/device_augment.h"
#include "trainer/step/step.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_uint8_batches {

namespace {

std::vector<data::Batch> batches_of(const std::shared_ptr<const data::ImageDataset>& ds, data::LoaderOptions lo,
                                    int n) {
  data::Loader loader(ds, lo);
  std::vector<data::Batch> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next());
  return out;
}

// Random crops (with `padding`) and flips, the loader's float path unless a test sets uint8_batches.
data::LoaderOptions crop_and_flip(int64_t global_batch, uint64_t seed, int64_t workers, int64_t padding) {
  data::LoaderOptions lo;
  lo.global_batch = global_batch;
  lo.seed = seed;
  lo.workers = workers;
  lo.augment.random_crop_padding = padding;
  lo.augment.hflip = true;
  return lo;
}

// The step's conversion of a uint8 batch on the CPU: images_to_float with the statistics
// set_input_normalization gives it, then erase_boxes.
torch::Tensor as_the_step_sees_it(const data::Batch& b, const data::ImageMeta& meta, bool normalize) {
  trainer::ForwardOptions fo;
  trainer::set_input_normalization(fo, meta, normalize, torch::Device(torch::kCPU));
  auto x = trainer::images_to_float(b.images, fo);
  if (b.erase.defined()) x = trainer::erase_boxes(x, b.erase);
  return x.contiguous();
}

}  // namespace

// Crop padding, flip, RandAugment and random erasing, 1 and 3 channels, normalized or not, 2 workers over
// 3 epochs' worth of batches: the uint8 batch converted as the step does equals the float batch.
TEST(Uint8Batches, EqualTheFloatBatchesOnceConverted) {
  for (int64_t C : {1, 3}) {
    for (bool normalize : {true, false}) {
      SCOPED_TRACE("C " + std::to_string(C) + (normalize ? ", normalized" : ", x / 255"));
      auto ds = std::make_shared<data::SyntheticImageDataset>(40, C, 12, 10, 7, 5);
      data::LoaderOptions lo = crop_and_flip(16, 9, 2, 2);
      lo.augment.normalize = normalize;
      lo.augment.auto_augment.kind = data::AutoAugmentKind::RandAugment;
      lo.augment.random_erasing = 0.5;
      const auto floats = batches_of(ds, lo, 6);
      lo.uint8_batches = true;
      const auto bytes = batches_of(ds, lo, 6);
      int64_t erased = 0;
      for (size_t i = 0; i < floats.size(); ++i) {
        const auto& f = floats[i];
        const auto& u = bytes[i];
        ASSERT_EQ(u.images.scalar_type(), torch::kUInt8);
        EXPECT_EQ(u.images.sizes(), f.images.sizes());
        EXPECT_TRUE(u.images.is_contiguous(at::MemoryFormat::ChannelsLast));
        EXPECT_FALSE(f.erase.defined());
        ASSERT_TRUE(u.erase.defined());
        EXPECT_EQ(u.erase.sizes(), (std::vector<int64_t>{u.size(), 4}));
        erased += (u.erase.select(1, 2) > 0).sum().item<int64_t>();
        EXPECT_EQ(u.indices, f.indices);
        EXPECT_EQ(u.epoch, f.epoch);
        EXPECT_TRUE(torch::equal(u.labels, f.labels));
        // On the CPU images_to_float divides by 255.0f, subtracts and divides as pixel_table does, in the
        // same float order: bit for bit. (On CUDA the kernel multiplies by 1/255.0f, one rounding away.)
        EXPECT_TRUE(torch::equal(as_the_step_sees_it(u, ds->meta(), normalize), f.images)) << "batch " << i;
      }
      EXPECT_GT(erased, 10) << "random erasing did something";
    }
  }
}

// Without random erasing no boxes travel; without auto augment the crop of the uint8 path is the float
// path's too; and a decoded-style batch of stored pixels repeats bit for bit with any number of workers.
TEST(Uint8Batches, CropAloneNoErasingAndWorkers) {
  auto ds = std::make_shared<data::SyntheticImageDataset>(50, 3, 9, 11, 4, 2);
  data::LoaderOptions lo = crop_and_flip(10, 3, 0, 3);
  const auto floats = batches_of(ds, lo, 5);
  lo.uint8_batches = true;
  const auto none = batches_of(ds, lo, 5);
  lo.workers = 3;
  const auto three = batches_of(ds, lo, 5);
  for (size_t i = 0; i < floats.size(); ++i) {
    EXPECT_FALSE(none[i].erase.defined());
    EXPECT_TRUE(torch::equal(as_the_step_sees_it(none[i], ds->meta(), true), floats[i].images)) << "batch " << i;
    EXPECT_TRUE(torch::equal(none[i].images, three[i].images)) << "batch " << i;
  }
}

TEST(Uint8Batches, ConfigKey) {
  trainer::Config c;
  EXPECT_EQ(c.data.uint8_batches, trainer::Switch::kAuto);
  trainer::apply_override(c, "train.steps=1");
  trainer::apply_override(c, "data.uint8_batches=on");
  trainer::validate(c);
  EXPECT_TRUE(trainer::uint8_image_batches(c, torch::Device(torch::kCPU)));
  trainer::apply_override(c, "data.uint8_batches=off");
  EXPECT_FALSE(trainer::uint8_image_batches(c, torch::Device(torch::kCUDA)));
  trainer::apply_override(c, "data.uint8_batches=auto");
  EXPECT_FALSE(trainer::uint8_image_batches(c, torch::Device(torch::kCPU)));
  EXPECT_TRUE(trainer::uint8_image_batches(c, torch::Device(torch::kCUDA)));
  EXPECT_NE(trainer::to_yaml(c).find("uint8_batches: \"auto\""), std::string::npos);
  try {
    trainer::apply_override(c, "data.uint8_batches=maybe");  // refused as it is read
    FAIL() << "expected a ConfigError";
  } catch (const trainer::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data.uint8_batches"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'maybe' is not one of: auto, on, off"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// A few steps of resnet20 on synthetic images with crop, flip and random erasing, on the CPU: the same
// losses with uint8 batches as with float ones. The inputs are the same floats (the test above), so the
// only room for a difference is the order of a reduction in kernels that see another memory format on the
// way in; 1e-4 relative covers that, and in practice they are equal.
TEST(Uint8Batches, TrainingLossesEqualTheFloatPath) {
  testutil::TempDir dir;
  const std::string job =
      "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[3,16,16] --set data.synthetic_size=64"
      " --set data.test= --set data.crop_padding=2 --set data.hflip=true --set data.random_erasing=0.5"
      " --set train.global_batch=16 --set train.epochs=0 --set train.steps=4 --set optim.lr=0.05"
      " --set schedule.warmup_steps=0 --set schedule.name=constant --set checkpoint.every_seconds=0"
      " --set log.every=1 --set seed=4 --set train.threads=1 --set data.workers=1 --set train.device=cpu";
  std::map<std::string, std::vector<double>> losses;
  for (const std::string mode : {"off", "on"}) {
    const auto run_dir = (dir / mode).string();
    const auto r = testutil::run(testutil::trainer_cmd(run_dir, job + " --set data.uint8_batches=" + mode));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const auto& l : testutil::step_lines(run_dir)) losses[mode].push_back(l["loss"].get<double>());
  }
  ASSERT_EQ(losses["off"].size(), 4u);
  ASSERT_EQ(losses["on"].size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(losses["on"][i], losses["off"][i], 1e-4 * std::abs(losses["off"][i])) << "step " << i + 1;
}

}  // namespace test_uint8_batches
