// trainer convert-images, the packed image format, the image_folder and packed_images datasets and their
// uint8 NHWC batches (issue 21). References: the source files' own bytes, a plain mean/std over decoded
// pixels, the folder read directly against the converted file, and uninterrupted streams against resumed
// ones.
#include <gtest/gtest.h>

#include "data/samples/image_folder.h"
#include "data/pixels/jpeg.h"
#include "data/samples/loader.h"
#include "data/files/packed_images.h"
#include "data/pixels/transforms.h"
#include "train_util.h"

#include <cmath>
#include <map>
#include <mutex>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include "data/pixels/rng.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_images {

using namespace testutil;

namespace {

// A smooth random RGB image (a gradient plus a little noise): compresses like a photo, not like noise.
std::vector<uint8_t> photo(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, 255), n(-8, 8);
  const int r0 = d(rng), g0 = d(rng), b0 = d(rng);
  std::vector<uint8_t> px(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &px[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>(std::clamp(r0 + x - y + n(rng), 0, 255));
      p[1] = static_cast<uint8_t>(std::clamp(g0 + y + n(rng), 0, 255));
      p[2] = static_cast<uint8_t>(std::clamp(b0 - x + n(rng), 0, 255));
    }
  return px;
}


std::vector<uint8_t> jpeg(int w, int h, uint32_t seed) { return data::encode_jpeg(photo(w, h, seed).data(), w, h, 90); }

// `per_class` good JPEGs of different sizes in each of the classes, under root/split/<class>/.
void make_split(const fs::path& root, const std::vector<std::string>& classes, int per_class, uint32_t seed) {
  for (size_t c = 0; c < classes.size(); ++c)
    for (int i = 0; i < per_class; ++i)
      write_bytes(root / classes[c] / ("img" + std::to_string(i) + ".JPEG"),
                  jpeg(40 + 7 * i, 30 + 5 * static_cast<int>(c), seed + static_cast<uint32_t>(100 * c + i)));
}

CommandResult convert(const fs::path& src, const fs::path& out, const std::string& extra = "") {
  return run(trainer_bin() + " convert-images --src " + src.string() + " --out " + out.string() + " --threads 2 " + extra);
}

data::ImageTransform transform(bool train, int size = 32) {
  data::ImageTransform t;
  t.size = size;
  t.train = train;
  t.seed = 7;
  return t;
}

}  // namespace

TEST(ConvertImages, RoundTripClassOrderAndEveryBadFile) {
  TempDir dir("convert_images");
  const fs::path train = dir / "src/train";
  make_split(train, {"zebra", "apple"}, 3, 1);
  make_split(dir / "src/val", {"apple", "zebra"}, 2, 50);
  fs::create_directories(train / "mango");  // an empty class folder: sorted between apple and zebra
  // Bad or unusual files, all in class "apple".
  const auto good = jpeg(64, 48, 9);
  write_bytes(train / "apple/truncated.jpg", std::vector<uint8_t>(good.begin(), good.begin() + good.size() / 2));
  write_bytes(train / "apple/zero.jpg", {});
  const auto px = photo(20, 10, 3);
  write_bytes(train / "apple/png_named.jpg", data::encode_png(px.data(), 20, 10, 3));
  std::vector<uint8_t> gray(20 * 10), cmyk(20 * 10 * 4);
  for (size_t i = 0; i < gray.size(); ++i) gray[i] = static_cast<uint8_t>(i);
  for (size_t i = 0; i < cmyk.size(); ++i) cmyk[i] = static_cast<uint8_t>(37 * i);
  write_bytes(train / "apple/gray.jpg", data::encode_jpeg(gray.data(), 20, 10, 90, 1));
  write_bytes(train / "apple/cmyk.jpg", data::encode_jpeg(cmyk.data(), 20, 10, 90, 4));
  write_bytes(train / "apple/name_\xff\xfe.jpg", good);  // not UTF-8
  // A header that claims 65,500 x 65,500: patch the SOF0 marker's height and width.
  auto huge = good;
  for (size_t i = 2; i + 8 < huge.size(); ++i)
    if (huge[i] == 0xFF && huge[i + 1] == 0xC0) {
      huge[i + 5] = huge[i + 7] = 0xFF;
      huge[i + 6] = huge[i + 8] = 0xDC;
      break;
    }
  write_bytes(train / "apple/huge.jpg", huge);

  const CommandResult r = convert(dir / "src", dir / "out");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train.h5 10 images (3 re-encoded, 3 skipped"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("class folder mango holds no image; its class index 1 is kept"), std::string::npos) << r.output;
  const std::string skipped = read_file(dir / "out/train.skipped.txt");
  for (const char* s : {"apple/truncated.jpg\t", "apple/zero.jpg\t", "apple/huge.jpg\t", "mango/\tempty class folder"})
    EXPECT_NE(skipped.find(s), std::string::npos) << s << " in\n" << skipped;
  EXPECT_NE(skipped.find("65500"), std::string::npos) << skipped;
  EXPECT_FALSE(fs::exists(dir / "out/val.skipped.txt"));

  data::PackedImageDataset ds((dir / "out/train.h5").string(), transform(false), /*in_memory=*/true);
  EXPECT_EQ(ds.meta().class_names, (std::vector<std::string>{"apple", "mango", "zebra"}));
  // The order: apple's files sorted by name (bad ones dropped), then zebra's.
  const std::vector<std::string> apple = {"cmyk.jpg", "gray.jpg", "img0.JPEG", "img1.JPEG", "img2.JPEG",
                                          "name_\xff\xfe.jpg", "png_named.jpg"};
  ASSERT_EQ(ds.size(), 10);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const bool is_apple = i < 7;
    EXPECT_EQ(ds.labels()[i], is_apple ? 0 : 2);
    const fs::path file = is_apple ? train / "apple" / apple[i] : train / "zebra" / ("img" + std::to_string(i - 7) + ".JPEG");
    const std::vector<uint8_t> bytes = ds.encoded(i), original = data::read_file_bytes(file.string());
    const bool converted = is_apple && (apple[i] == "cmyk.jpg" || apple[i] == "gray.jpg" || apple[i] == "png_named.jpg");
    if (converted) {
      EXPECT_NE(bytes, original) << file;
      data::ImageHeader h;
      data::decode_rgb(bytes.data(), bytes.size(), {}, &h);
      EXPECT_EQ(h.format, data::ImageHeader::Jpeg);
      EXPECT_EQ(h.channels, 3);
      EXPECT_EQ(ds.image_size(i), (std::pair<int, int>{20, 10}));
    } else {
      EXPECT_EQ(bytes, original) << file << ": JPEG bytes are kept as they are";
      const auto h = data::read_header(original.data(), original.size());
      EXPECT_EQ(ds.image_size(i), (std::pair<int, int>{h.width, h.height}));
    }
  }
  // The PNG's pixels survive the re-encoding at quality 95 within JPEG's error.
  {
    const auto bytes = ds.encoded(6);
    const auto rgb = data::decode_rgb(bytes.data(), bytes.size());
    double err = 0;
    for (size_t k = 0; k < rgb.size(); ++k) err += std::abs(int(rgb[k]) - int(px[k]));
    EXPECT_LT(err / rgb.size(), 6.0);
  }
  // mean and std: every decodable training file (fewer than 1000), the plain way.
  double sum[3] = {0, 0, 0}, sq[3] = {0, 0, 0}, count = 0;
  for (const auto& e : fs::recursive_directory_iterator(train)) {
    if (!e.is_regular_file()) continue;
    try {
      const auto b = data::read_file_bytes(e.path().string());
      const auto rgb = data::decode_rgb(b.data(), b.size());
      for (size_t k = 0; k < rgb.size(); ++k) {
        sum[k % 3] += rgb[k] / 255.0;
        sq[k % 3] += (rgb[k] / 255.0) * (rgb[k] / 255.0);
      }
      count += rgb.size() / 3;
    } catch (const data::DecodeError&) {
    }
  }
  EXPECT_EQ(ds.mean_std_images(), 10);
  for (int c = 0; c < 3; ++c) {
    const double m = sum[c] / count;
    EXPECT_NEAR(ds.meta().mean[c], m, 1e-5);
    EXPECT_NEAR(ds.meta().std[c], std::sqrt(sq[c] / count - m * m), 1e-5);
  }
  data::PackedImageDataset val((dir / "out/val.h5").string(), transform(false), true);
  EXPECT_EQ(val.size(), 4);
  EXPECT_EQ(val.labels(), (std::vector<int64_t>{0, 0, 2, 2}));  // train's indices, by name
  EXPECT_EQ(val.meta().mean, ds.meta().mean);
}

TEST(ConvertImages, MaxSideResizesOnlyLargerImages) {
  TempDir dir("convert_images_max_side");
  write_bytes(dir / "src/train/a/big.jpg", jpeg(200, 100, 1));
  write_bytes(dir / "src/train/a/small.jpg", jpeg(50, 40, 2));
  const CommandResult r = convert(dir / "src", dir / "out", "--max-side 64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  data::PackedImageDataset ds((dir / "out/train.h5").string(), transform(false), false);
  EXPECT_EQ(ds.image_size(0), (std::pair<int, int>{64, 32}));
  EXPECT_EQ(ds.image_size(1), (std::pair<int, int>{50, 40}));
  EXPECT_EQ(ds.encoded(1), data::read_file_bytes((dir / "src/train/a/small.jpg").string()));
}

TEST(ConvertImages, BadSourceIsOneErrorLine) {
  TempDir dir("convert_images_bad");
  CommandResult r = convert(dir / "missing", dir / "out");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: convert-images: " + (dir / "missing/train").string() + " is not a folder"),
            std::string::npos) << r.output;
  r = run(trainer_bin() + " convert-images --src " + dir.str());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("error: convert-images: --out is required"), std::string::npos) << r.output;
}

TEST(ConvertImages, InterruptedConversionLeavesNoFileThatOpens) {
  TempDir dir("convert_images_kill");
  make_split(dir / "src/train", {"a", "b"}, 400, 3);
  // Killed (SIGKILL: nothing of the program runs) once it is writing the training file.
  const std::string cmd = trainer_bin() + " convert-images --src " + (dir / "src").string() + " --out " +
                          (dir / "out").string() + " --threads 1 & pid=$!; while [ ! -e " +
                          (dir / "out/train.h5.tmp").string() + " ]; do sleep 0.01; done; kill -9 $pid; wait $pid";
  const CommandResult r = run(cmd);
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out/train.h5"));
  EXPECT_TRUE(fs::exists(dir / "out/train.h5.tmp"));
  EXPECT_THROW(data::PackedImageDataset((dir / "out/train.h5").string(), transform(true)), std::runtime_error);
  EXPECT_THROW(data::PackedImageDataset((dir / "out/train.h5.tmp").string(), transform(true)), std::runtime_error);
}

namespace {

// A converted folder of good JPEGs and both datasets over it.
struct Converted {
  TempDir dir{"images_ds"};
  Converted(int per_class = 12) {
    make_split(dir / "src/train", {"b", "a", "c"}, per_class, 11);
    const CommandResult r = convert(dir / "src", dir / "out");
    if (r.exit_code != 0) throw std::runtime_error(r.output);
  }
  std::shared_ptr<data::ImageDataset> packed(bool train, bool in_memory = true) const {
    return std::make_shared<data::PackedImageDataset>((dir / "out/train.h5").string(), transform(train), in_memory);
  }
  std::shared_ptr<data::ImageDataset> folder(bool train) const {
    return std::make_shared<data::ImageFolderDataset>((dir / "src/train").string(), transform(train));
  }
};

data::LoaderOptions loader_options(int64_t batch = 8) {
  data::LoaderOptions o;
  o.global_batch = batch;
  o.seed = 5;
  o.workers = 2;
  o.prefetch = 2;
  return o;
}

void expect_same(const data::Batch& a, const data::Batch& b) {
  EXPECT_EQ(a.indices, b.indices);
  EXPECT_TRUE(a.labels.equal(b.labels));
  EXPECT_TRUE(a.images.equal(b.images));
}

}  // namespace

TEST(ImageDatasets, FolderAndPackedGiveTheSameUint8NhwcBatches) {
  Converted c;
  for (bool train : {true, false}) {
    const auto p = c.packed(train, /*in_memory=*/!train), f = c.folder(train);
    EXPECT_EQ(p->meta().mean, f->meta().mean);
    EXPECT_EQ(p->meta().std, f->meta().std);
    EXPECT_EQ(p->meta().class_names, f->meta().class_names);
    data::Loader lp(p, loader_options()), lf(f, loader_options());
    for (int k = 0; k < 6; ++k) {  // two epochs of 36 samples
      const data::Batch a = lp.next(), b = lf.next();
      expect_same(a, b);
      EXPECT_EQ(a.images.scalar_type(), torch::kUInt8);
      EXPECT_EQ(a.images.sizes(), (std::vector<int64_t>{8, 3, 32, 32}));
      EXPECT_TRUE(a.images.is_contiguous(at::MemoryFormat::ChannelsLast));
      EXPECT_TRUE(a.failures.empty());
    }
  }
}

TEST(ImageDatasets, SampleIsTheTransformOfItsFileFromSeedEpochIndex) {
  Converted c(4);
  const auto p = c.packed(true);
  data::Loader loader(p, loader_options(4));
  loader.seek(1, 4);
  const data::Batch b = loader.next();
  for (int64_t k = 0; k < b.size(); ++k) {
    const int64_t i = b.indices[k];
    const auto bytes = static_cast<const data::PackedImageDataset&>(*p).encoded(i);
    const auto h = data::read_header(bytes.data(), bytes.size());
    bool flip = false;
    const data::CropBox box = data::random_resized_crop(h.width, h.height, 0.08, 1.0, 3.0 / 4, 4.0 / 3, 7, 1, i, &flip);
    std::vector<uint8_t> want(32 * 32 * 3);
    data::decode_crop_resize(bytes.data(), bytes.size(), box, 32, 32, flip, want.data());
    // (C, H, W) sizes over NHWC memory: permute back to (H, W, C) for the comparison.
    const auto got = b.images[k].permute({1, 2, 0}).contiguous();
    EXPECT_EQ(std::memcmp(got.data_ptr<uint8_t>(), want.data(), want.size()), 0) << "sample " << i;
  }
}

TEST(ImageDatasets, CropPaddingGivesTheStoredPixelPathsCropAndFlip) {
  // data.crop_padding on an encoded image: the eval view (crop_pct), then the HDF5 path's own padded
  // crop and flip (data/samples/loader.h's draw_augment and augment_image), as uint8 HWC.
  data::ImageTransform t = transform(true, 24);
  t.crop_padding = 3;
  t.crop_pct = 0.875;
  data::AugmentOptions a;
  a.random_crop_padding = 3;
  a.hflip = true;
  const std::vector<float> table = data::pixel_table({0, 0, 0}, {1, 1, 1}, /*normalize=*/false);
  std::set<std::pair<int64_t, bool>> seen;  // (dx, flip) pairs drawn: the draws do vary
  for (int64_t i = 0; i < 12; ++i)
    for (int64_t epoch : {0, 3}) {
      const int w = 30 + 3 * static_cast<int>(i), h = 26 + static_cast<int>(i);
      const auto bytes = jpeg(w, h, static_cast<uint32_t>(i));
      std::vector<uint8_t> got(24 * 24 * 3), view(24 * 24 * 3);
      ASSERT_EQ(data::decode_sample(bytes.data(), bytes.size(), 0, 0, i, epoch, t, got.data()), "");
      data::decode_crop_resize(bytes.data(), bytes.size(), data::eval_center_crop(w, h, 24, 0.875), 24, 24, false,
                               view.data());
      const auto chw = torch::from_blob(view.data(), {24, 24, 3}, torch::kUInt8).permute({2, 0, 1}).contiguous();
      const data::AugmentParams p = data::draw_augment(7, epoch, i, a);
      seen.insert({p.dx, p.flip});
      std::vector<float> want(3 * 24 * 24);
      data::augment_image(chw.data_ptr<uint8_t>(), {3, 24, 24}, p, 3, table.data(), want.data());
      for (int c = 0; c < 3; ++c)
        for (int y = 0; y < 24; ++y)
          for (int x = 0; x < 24; ++x)
            ASSERT_EQ(static_cast<float>(got[(y * 24 + x) * 3 + c]) / 255.0f, want[(c * 24 + y) * 24 + x])
                << "sample " << i << " epoch " << epoch << " at (" << c << ", " << y << ", " << x << ")";
    }
  EXPECT_GT(seen.size(), 4u);
  // At crop_pct 1 the eval view of a size x size image is the image itself: Fashion-MNIST's 28 x 28
  // PNGs train on their own pixels, as in the HDF5 file.
  const auto px = photo(24, 24, 9);
  const auto png = data::encode_png(px.data(), 24, 24, 3);
  t.crop_pct = 1.0;
  t.train = false;
  std::vector<uint8_t> same(px.size());
  ASSERT_EQ(data::decode_sample(png.data(), png.size(), 0, 0, 0, 0, t, same.data()), "");
  EXPECT_EQ(same, px);
}

TEST(ImageDatasets, ResumedStreamGivesTheSameCrops) {
  Converted c;
  data::Loader whole(c.packed(true), loader_options());
  std::vector<data::Batch> ref;
  for (int k = 0; k < 7; ++k) ref.push_back(whole.next());
  data::Loader resumed(c.packed(true, false), loader_options());
  resumed.seek(data::LoaderState{0, 24});  // after three batches
  for (int k = 3; k < 7; ++k) expect_same(resumed.next(), ref[k]);
  // Epoch 1 draws new crops for the same samples.
  const data::Batch e1 = resumed.batch_at(1, 0);
  data::Loader again(c.packed(true), loader_options());
  EXPECT_TRUE(again.batch_at(1, 0).images.equal(e1.images));
  EXPECT_FALSE(again.batch_at(0, 0).images.equal(e1.images));
}

TEST(ImageDatasets, UndecodableSampleKeepsItsSlotAsAnIgnoredZeroImage) {
  TempDir dir("images_bad_sample");
  make_split(dir / "train", {"a", "b"}, 4, 2);
  const auto good = data::read_file_bytes((dir / "train/a/img1.JPEG").string());
  write_bytes(dir / "train/a/img1.JPEG", std::vector<uint8_t>(good.begin(), good.begin() + 40));  // truncated
  auto ds = std::make_shared<data::ImageFolderDataset>((dir / "train").string(), transform(true));
  auto o = loader_options(8);
  o.shuffle = false;
  data::Loader loader(ds, o);
  const data::Batch b = loader.next();
  ASSERT_EQ(b.failures.size(), 1u);
  EXPECT_EQ(b.failures[0].index, 1);
  EXPECT_NE(b.failures[0].what.find("img1.JPEG (sample 1): "), std::string::npos) << b.failures[0].what;
  EXPECT_EQ(b.indices, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(b.labels[1].item<int64_t>(), data::kIgnoreLabel);
  EXPECT_EQ(b.images[1].count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(b.labels[0].item<int64_t>(), 0);
  EXPECT_GT(b.images[0].count_nonzero().item<int64_t>(), 0);
  // The loss ignores it: cross-entropy over the batch equals cross-entropy over the other samples.
  const auto logits = torch::randn({8, 2});
  const auto sum = torch::nn::functional::cross_entropy(
      logits, b.labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(0.1));
  const auto keep = torch::tensor({0, 2, 3, 4, 5, 6, 7});
  const auto ref = torch::nn::functional::cross_entropy(
      logits.index_select(0, keep), b.labels.index_select(0, keep),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(0.1));
  EXPECT_NEAR(sum.item<double>(), ref.item<double>(), 1e-5);
}

namespace {

// Counts every sample a dataset decodes, by (epoch, index), and passes the call on.
class CountingDataset : public data::ImageDataset {
 public:
  explicit CountingDataset(std::shared_ptr<data::ImageDataset> inner) : inner_(std::move(inner)) {}
  data::PixelLayout layout() const override { return inner_->layout(); }
  void read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out, int64_t* labels_out,
                  std::vector<data::SampleFailure>* failures) const override {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int64_t i : indices) ++decodes_[{epoch, i}];
    }
    inner_->read_epoch(indices, epoch, images_out, labels_out, failures);
  }
  int64_t size() const override { return inner_->size(); }
  std::array<int64_t, 3> sample_shape() const override { return inner_->sample_shape(); }
  const data::ImageMeta& meta() const override { return inner_->meta(); }
  void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const override {
    read_epoch(indices, 0, images_out, labels_out, nullptr);
  }
  std::map<std::pair<int64_t, int64_t>, int> decodes() const {
    std::lock_guard<std::mutex> g(mu_);
    return decodes_;
  }

 private:
  std::shared_ptr<data::ImageDataset> inner_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<int64_t, int64_t>, int> decodes_;
};

}  // namespace

// A bad sample warned about twice in the first epoch of a 54-file folder was the prefetch reading the
// next epoch's first batches (a new order that draws the sample again), not a second decode: within an
// epoch every drawn sample is decoded exactly once, with the prefetch and its workers running.
TEST(ImageDatasets, OneEpochDecodesEachSampleExactlyOnce) {
  TempDir dir("images_decode_count");
  make_split(dir / "train", {"a", "b"}, 27, 4);  // 54 files: 6 steps of 8 per epoch, 6 samples left over
  auto counting = std::make_shared<CountingDataset>(
      std::make_shared<data::ImageFolderDataset>((dir / "train").string(), transform(true)));
  data::Loader loader(counting, loader_options(8));
  std::map<int64_t, std::vector<int64_t>> drawn;  // epoch -> indices the consumer got
  for (int k = 0; k < 12; ++k) {  // two epochs
    const data::Batch b = loader.next();
    auto& d = drawn[b.epoch];
    d.insert(d.end(), b.indices.begin(), b.indices.end());
  }
  const auto decodes = counting->decodes();
  for (int64_t epoch : {0, 1}) {
    ASSERT_EQ(drawn[epoch].size(), 48u) << "epoch " << epoch;
    std::set<int64_t> distinct(drawn[epoch].begin(), drawn[epoch].end());
    EXPECT_EQ(distinct.size(), 48u) << "an epoch draws each sample at most once";
    for (int64_t i : drawn[epoch]) EXPECT_EQ(decodes.at({epoch, i}), 1) << "epoch " << epoch << ", sample " << i;
    int64_t decoded = 0;
    for (const auto& [key, n] : decodes) decoded += key.first == epoch ? n : 0;
    EXPECT_EQ(decoded, 48) << "nothing of epoch " << epoch << " decoded but what it draws";
  }
  // What the prefetch read ahead belongs to epoch 2, each sample once.
  for (const auto& [key, n] : decodes) {
    EXPECT_LE(key.first, 2);
    EXPECT_EQ(n, 1) << "epoch " << key.first << ", sample " << key.second;
  }
}

namespace {

// configs/resnet50_imagefolder.yaml on a small generated folder: images of 32 px, 2 steps of 8.
std::string recipe_args(const fs::path& root, const std::string& kind, const std::string& train, const std::string& test) {
  return "--config " + source_dir() + "/configs/resnet50_imagefolder.yaml --set data.kind=" + kind +
         " --set data.train=" + train + " --set data.test=" + test + " --set data.size=32" +
         " --set train.global_batch=8 --set train.micro_batch=0 --set train.epochs=0 --set train.steps=2" +
         " --set train.eval_batch=16 --set schedule.warmup_epochs=0 --set schedule.warmup_steps=1" +
         " --set amp.enabled=false --set memory.limit=none --set log.every=1 --set data.workers=2 --no-resume";
  (void)root;
}

}  // namespace

TEST(ImageRecipe, DryRunsAndTrainsFromAFolderWithABadFileAndFromItsPackedFile) {
  TempDir dir("images_recipe");
  make_split(dir / "src/train", {"a", "b", "c"}, 6, 21);
  make_split(dir / "src/val", {"a", "b", "c"}, 2, 71);
  const auto good = data::read_file_bytes((dir / "src/train/b/img2.JPEG").string());
  write_bytes(dir / "src/train/b/img2.JPEG", std::vector<uint8_t>(good.begin(), good.begin() + 50));
  // A link to a character device with an image's name: never opened (reading /dev/zero would not end),
  // named by the dataset and listed by the converter.
  fs::create_symlink("/dev/zero", dir / "src/train/c/zero.jpg");

  const std::string folder = recipe_args(dir.path, "image_folder", (dir / "src/train").string(), (dir / "src/val").string());
  CommandResult r = run(trainer_cmd((dir / "dry").string(), folder + " --dry-run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("kind: \"image_folder\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("scale: [0.08, 1.0]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("label_smoothing: 0.1"), std::string::npos) << r.output;

  r = run(trainer_cmd((dir / "run_folder").string(), folder));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("c/zero.jpg: not a regular file (a link to a device, a FIFO, a socket or a dangling link); "
                          "passed over"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("img2.JPEG (sample 8): truncated JPEG data, read for epoch "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("; a zero image with its label ignored takes its place"), std::string::npos) << r.output;
  // Warned once per epoch that reads it (the prefetch may read epoch 2's first batches), never twice.
  for (const char* epoch : {"epoch 1;", "epoch 2;"}) {
    const std::string line = std::string("img2.JPEG (sample 8): truncated JPEG data, read for ") + epoch;
    const size_t first = r.output.find(line);
    EXPECT_TRUE(first == std::string::npos || r.output.find(line, first + 1) == std::string::npos) << line << "\n" << r.output;
  }
  const auto steps = step_lines((dir / "run_folder").string());
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& s : steps) EXPECT_TRUE(std::isfinite(s["loss"].get<double>())) << s;
  // Sample 8 is in one of the two batches of epoch 0 (16 of its 18 samples): one event, never a crash.
  const auto bad = events((dir / "run_folder").string(), "bad_sample");
  const auto perm = data::epoch_permutation(18, 0, 0);
  const bool in_batches = std::find(perm.begin(), perm.begin() + 16, 8) != perm.begin() + 16;
  ASSERT_EQ(bad.size(), in_batches ? 1u : 0u);
  if (in_batches) EXPECT_EQ(bad[0]["index"], 8);
  EXPECT_FALSE(events((dir / "run_folder").string(), "eval").empty());

  r = convert(dir / "src", dir / "out");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train.h5 17 images (0 re-encoded, 2 skipped"), std::string::npos) << r.output;
  const std::string skipped = read_file(dir / "out/train.skipped.txt");
  EXPECT_NE(skipped.find("c/zero.jpg\tnot a regular file"), std::string::npos) << skipped;
  EXPECT_NE(skipped.find("b/img2.JPEG\t"), std::string::npos) << skipped;
  r = run(trainer_cmd((dir / "run_packed").string(),
                      recipe_args(dir.path, "packed_images", (dir / "out/train.h5").string(), (dir / "out/val.h5").string()) +
                          " --set data.eval_size=48"));  // trained at 32, evaluated at 48 (as RSB: 160 and 224)
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(step_lines((dir / "run_packed").string()).size(), 2u);

  // bench --loader-only on both kinds: the decoding pipeline alone, uint8 NHWC batches at data.size.
  for (const auto& [kind, train] : std::vector<std::pair<std::string, std::string>>{
           {"image_folder", (dir / "src/train").string()}, {"packed_images", (dir / "out/train.h5").string()}}) {
    const std::string out = (dir / (kind + "_loader.json")).string();
    r = run(trainer_bin() + " bench --loader-only --config " + source_dir() + "/configs/resnet50_imagefolder.yaml" +
            " --set data.kind=" + kind + " --set data.train=" + train + " --set data.test= --set data.size=32" +
            " --set train.global_batch=8 --set data.workers=2 --warmup 1 --steps 2 --out " + out);
    ASSERT_EQ(r.exit_code, 0) << kind << ": " << r.output;
    const nlohmann::json j = nlohmann::json::parse(read_file(out));
    EXPECT_EQ(j["mode"], "loader") << kind;
    EXPECT_EQ(j["batch_dtype"], "uint8 NHWC") << kind;
    EXPECT_EQ(j["sample_shape"], nlohmann::json({3, 32, 32})) << kind;
    EXPECT_EQ(j["batches"], 2) << kind;
    EXPECT_EQ(j["transform"]["size"], 32) << kind;
    EXPECT_GT(j["samples_per_s"].get<double>(), 0.0) << kind;
  }

  // trainer eval on both runs: the same numbers as each run's own final evaluation (eval transform, the
  // training split's mean and std), bit for bit; the bad file in the folder is not in the val split.
  for (const char* name : {"run_folder", "run_packed"}) {
    const std::string run_dir = (dir / name).string();
    const auto finals = events(run_dir, "eval");
    ASSERT_FALSE(finals.empty()) << name;
    r = run(trainer_bin() + " eval --run-dir " + run_dir);
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.output;
    const nlohmann::json j = nlohmann::json::parse(read_file(run_dir + "/eval.json"));
    EXPECT_EQ(j["samples"], 6) << name;
    EXPECT_EQ(j["samples"], finals.back()["samples"]) << name;
    EXPECT_EQ(j["loss"].get<double>(), finals.back()["loss"].get<double>()) << name;
    EXPECT_EQ(j["top1"].get<double>(), finals.back()["top1"].get<double>()) << name;
    EXPECT_EQ(j["top5"].get<double>(), finals.back()["top5"].get<double>()) << name;
  }
}

TEST(ImageRecipe, NewKeysAreValidatedWithOneLine) {
  for (const auto& [set, want] : std::vector<std::pair<std::string, std::string>>{
           {"data.scale=[0.5,0.1]", "key 'data.scale': must be two numbers [lo, hi] with 0 < lo <= hi <= 1"},
           {"data.ratio=[1]", "key 'data.ratio': must be two numbers [lo, hi] with 0 < lo <= hi"},
           {"data.size=0", "key 'data.size': must be in [1, 4096]"},
           {"data.eval_size=-1", "key 'data.eval_size': must be in [1, 4096], or 0 (= data.size)"},
           {"data.eval_size=64 --set model.name=vit_tiny", "key 'data.eval_size': a ViT takes one image size"},
           {"data.max_image_pixels=0", "key 'data.max_image_pixels': must be at least 1"},
           {"data.crop_pct=0", "key 'data.crop_pct': must be in (0, 1]"},
           {"data.crop_pct=1.5", "key 'data.crop_pct': must be in (0, 1]"},
           {"data.crop_padding=225", "key 'data.crop_padding': must be at most data.size (224)"},
           {"data.scale=[a,1]", "key 'data.scale': expected a list of numbers"}}) {
    const CommandResult r = run(trainer_bin() + " --config " + source_dir() + "/configs/resnet50_imagefolder.yaml --set " +
                                set + " --dry-run");
    EXPECT_EQ(r.exit_code, 2) << set << "\n" << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << set << "\n" << r.output;
  }
}

}  // namespace test_images
