// Tests of the data layer: the HDF5 format, the IDX converter (on the real Fashion-MNIST, against a
// numpy reference), the synthetic dataset and the loader (order, resume, augmentation, sharding,
// errors).
#include <gtest/gtest.h>
#include <hdf5.h>

#include "data/samples/dataset.h"
#include "data/files/idx.h"
#include "data/files/hdf5_lock.h"
#include "data/files/image_h5.h"
#include "data/samples/loader.h"
#include "data/pixels/rng.h"
#include "test_util.h"
#include "trainer/memory/backend.h"

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_data {

namespace {

using testutil::TempDir;

// Expects `stmt` to throw an exception derived from std::exception whose message contains `text`.
#define EXPECT_THROW_WITH(stmt, text)                                                        \
  do {                                                                                       \
    try {                                                                                    \
      stmt;                                                                                  \
      ADD_FAILURE() << "no exception from " #stmt;                                           \
    } catch (const std::exception& e) {                                                      \
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos)                         \
          << "message: " << e.what() << "\nexpected to contain: " << (text);                 \
    }                                                                                        \
  } while (0)

// Deterministic uint8 images (n, c, h, w) and labels in [0, k) taken from the synthetic dataset.
std::pair<torch::Tensor, torch::Tensor> make_samples(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k,
                                                     uint64_t seed = 7) {
  data::SyntheticImageDataset ds(n, c, h, w, k, seed);
  auto images = torch::empty({n, c, h, w}, torch::kUInt8);
  auto labels = torch::empty({n}, torch::kInt64);
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), int64_t{0});
  ds.read(all, images.data_ptr<uint8_t>(), labels.data_ptr<int64_t>());
  return {images, labels};
}

data::ImageMeta make_meta(int64_t c, int64_t k) {
  data::ImageMeta m;
  m.num_classes = k;
  for (int64_t i = 0; i < k; ++i) m.class_names.push_back("class " + std::to_string(i) + " é");
  for (int64_t i = 0; i < c; ++i) {
    m.mean.push_back(0.25f + 0.125f * static_cast<float>(i));
    m.std.push_back(0.3f + 0.01f * static_cast<float>(i));
  }
  return m;
}

// Reads `indices` from a dataset into tensors.
std::pair<torch::Tensor, torch::Tensor> read_all(const data::ImageDataset& ds, const std::vector<int64_t>& indices) {
  const auto s = ds.sample_shape();
  auto images = torch::empty({static_cast<int64_t>(indices.size()), s[0], s[1], s[2]}, torch::kUInt8);
  auto labels = torch::empty({static_cast<int64_t>(indices.size())}, torch::kInt64);
  ds.read(indices, images.data_ptr<uint8_t>(), labels.data_ptr<int64_t>());
  return {images, labels};
}

std::vector<int64_t> range(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

// ---- HDF5 format -----------------------------------------------------------------------------------

// Edits an HDF5 file in place with the C API, under the project's HDF5 lock, to break it in one way.
template <typename F>
void h5_edit(const std::string& path, F edit) {
  std::lock_guard<std::mutex> lock(data::hdf5_lock());
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  edit(f);
  H5Fclose(f);
}

void replace_dataset(hid_t f, const char* name, const std::vector<hsize_t>& dims, hid_t type, const void* values) {
  if (H5Lexists(f, name, H5P_DEFAULT) > 0) H5Ldelete(f, name, H5P_DEFAULT);
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t d = H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (values) H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values);
  H5Dclose(d);
  H5Sclose(space);
}

void replace_format(hid_t f, const std::string& value) {
  H5Adelete(f, "format");
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(f, "format", type, space, H5P_DEFAULT, H5P_DEFAULT);
  const char* p = value.c_str();
  H5Awrite(a, type, &p);
  H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
}

class DataH5 : public ::testing::TestWithParam<int> {};  // parameter: gzip level

TEST_P(DataH5, RoundTripIsBitEqual) {
  TempDir dir("data_h5");
  const auto path = (dir / "a.h5").string();
  auto [images, labels] = make_samples(37, 3, 5, 4, 6);
  const auto meta = make_meta(3, 6);
  data::H5WriteOptions opt;
  opt.chunk_samples = 8;
  opt.gzip_level = GetParam();
  data::write_image_h5(path, images, labels, meta, opt);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  for (bool in_memory : {false, true}) {
    data::ImageH5Dataset ds(path, in_memory);
    EXPECT_EQ(ds.size(), 37);
    EXPECT_EQ(ds.sample_shape(), (std::array<int64_t, 3>{3, 5, 4}));
    EXPECT_EQ(ds.num_classes(), 6);
    EXPECT_EQ(ds.meta().class_names, meta.class_names);
    EXPECT_EQ(ds.mean(), meta.mean);  // float32 stored and read back exactly
    EXPECT_EQ(ds.std(), meta.std);
    EXPECT_EQ(ds.chunk_samples(), 8);
    EXPECT_EQ(ds.gzip_level(), GetParam());
    auto [x, y] = read_all(ds, range(37));
    EXPECT_TRUE(torch::equal(x, images)) << "in_memory " << in_memory;
    EXPECT_TRUE(torch::equal(y, labels));
    EXPECT_EQ(ds.labels(), std::vector<int64_t>(labels.data_ptr<int64_t>(), labels.data_ptr<int64_t>() + 37));
  }
}

TEST_P(DataH5, ShuffledReadEqualsOneByOneAndInMemory) {
  TempDir dir("data_h5");
  const auto path = (dir / "a.h5").string();
  auto [images, labels] = make_samples(300, 2, 6, 7, 4);
  data::H5WriteOptions opt;
  opt.chunk_samples = 16;
  opt.gzip_level = GetParam();
  data::write_image_h5(path, images, labels, make_meta(2, 4), opt);
  data::ImageH5Dataset chunked(path, false), memory(path, true);

  // Runs, gaps, repeats and reversed order, across chunk boundaries.
  std::vector<int64_t> idx = {299, 5, 6, 7, 8, 0, 15, 16, 17, 6, 250, 1, 2, 3, 100, 99, 98, 299, 31, 32};
  const auto perm = data::epoch_permutation(300, 3, 0);
  idx.insert(idx.end(), perm.begin(), perm.begin() + 64);

  auto [x, y] = read_all(chunked, idx);
  auto [xm, ym] = read_all(memory, idx);
  EXPECT_TRUE(torch::equal(x, xm));
  EXPECT_TRUE(torch::equal(y, ym));
  for (size_t k = 0; k < idx.size(); ++k) {
    auto [one, one_label] = read_all(chunked, {idx[k]});
    ASSERT_TRUE(torch::equal(x[k], one[0])) << "sample " << idx[k];
    ASSERT_TRUE(torch::equal(x[k], images[idx[k]])) << "sample " << idx[k];
    ASSERT_EQ(y[k].item<int64_t>(), labels[idx[k]].item<int64_t>());
  }
  EXPECT_THROW_WITH(read_all(chunked, {3, 300}), "sample index 300 is outside [0, 300)");
}

INSTANTIATE_TEST_SUITE_P(Data, DataH5, ::testing::Values(0, 4));

TEST(DataH5Writer, StreamingAppendEqualsOneWrite) {
  TempDir dir("data_h5");
  auto [images, labels] = make_samples(50, 1, 4, 4, 3);
  const auto meta = make_meta(1, 3);
  {
    data::ImageH5Writer w((dir / "s.h5").string(), {1, 4, 4});
    w.append(images.slice(0, 0, 7), labels.slice(0, 0, 7));
    w.append(images.slice(0, 7, 50), labels.slice(0, 7, 50));
    EXPECT_EQ(w.size(), 50);
    EXPECT_FALSE(std::filesystem::exists(dir / "s.h5"));  // only "<path>.tmp" until finish()
    w.finish(meta);
  }
  data::ImageH5Dataset ds((dir / "s.h5").string());
  auto [x, y] = read_all(ds, range(50));
  EXPECT_TRUE(torch::equal(x, images));
  EXPECT_TRUE(torch::equal(y, labels));
  EXPECT_EQ(ds.chunk_samples(), 256);  // automatic: 1 MiB / 16 bytes, capped at 256

  {
    data::ImageH5Writer w((dir / "abandoned.h5").string(), {1, 4, 4});
    w.append(images, labels);
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "abandoned.h5"));
  EXPECT_FALSE(std::filesystem::exists(dir / "abandoned.h5.tmp"));
}

TEST(DataH5Writer, RejectsInconsistentMetaAndShapes) {
  TempDir dir("data_h5");
  auto [images, labels] = make_samples(10, 2, 3, 3, 5);
  auto meta = make_meta(2, 3);  // labels go up to 4
  EXPECT_THROW_WITH(data::write_image_h5((dir / "a.h5").string(), images, labels, meta),
                    "is outside [0, num_classes = 3)");
  meta = make_meta(1, 5);
  EXPECT_THROW_WITH(data::write_image_h5((dir / "a.h5").string(), images, labels, meta),
                    "mean and std need one value per channel (2), got 1 and 1");
  EXPECT_THROW_WITH(data::write_image_h5((dir / "a.h5").string(), images.to(torch::kFloat32), labels, make_meta(2, 5)),
                    "expected uint8 images (N, 2, 3, 3), got Float");
  EXPECT_THROW_WITH(data::write_image_h5((dir / "no/such/dir/a.h5").string(), images, labels, make_meta(2, 5)),
                    "image file '" + (dir / "no/such/dir/a.h5").string() + "': cannot create");
}

class DataH5Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    path = (dir / "bad.h5").string();
    auto [images, labels] = make_samples(20, 1, 4, 4, 3);
    data::write_image_h5(path, images, labels, make_meta(1, 3));
  }
  std::string prefix() const { return "image file '" + path + "': "; }
  TempDir dir{"data_h5_err"};
  std::string path;
};

TEST_F(DataH5Errors, MissingFileAndNotHdf5) {
  const auto missing = (dir / "nope.h5").string();
  EXPECT_THROW_WITH(data::ImageH5Dataset(missing, false), "image file '" + missing + "': file not found");
  testutil::write_file(dir / "text.h5", "just text\n");
  EXPECT_THROW_WITH(data::ImageH5Dataset((dir / "text.h5").string()),
                    "image file '" + (dir / "text.h5").string() + "': not an HDF5 file");
}

TEST_F(DataH5Errors, WrongFormatName) {
  h5_edit(path, [](hid_t f) { replace_format(f, "something.else"); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path},
                    prefix() + "root attribute 'format' is \"something.else\", expected \"trainer.images\" (make "
                               "trainer.images files with `trainer convert-idx`, or as docs/DATA.md describes)");
  h5_edit(path, [](hid_t f) { H5Adelete(f, "format"); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path}, prefix() + "missing root attribute 'format' (make");
}

TEST_F(DataH5Errors, MissingDataset) {
  h5_edit(path, [](hid_t f) { H5Ldelete(f, "labels", H5P_DEFAULT); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path}, prefix() + "missing dataset 'labels'");
}

TEST_F(DataH5Errors, WrongRank) {
  h5_edit(path, [](hid_t f) { replace_dataset(f, "images", {20, 4, 4}, H5T_NATIVE_UINT8, nullptr); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path},
                    prefix() + "dataset 'images' has rank 3 (20, 4, 4), expected rank 4 (N, C, H, W)");
}

TEST_F(DataH5Errors, WrongDtype) {
  h5_edit(path, [](hid_t f) { replace_dataset(f, "images", {20, 1, 4, 4}, H5T_NATIVE_FLOAT, nullptr); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path}, prefix() + "dataset 'images' must hold uint8 pixels");
}

TEST_F(DataH5Errors, LengthMismatch) {
  const std::vector<int64_t> labels(19, 0);
  h5_edit(path, [&](hid_t f) { replace_dataset(f, "labels", {19}, H5T_NATIVE_INT64, labels.data()); });
  EXPECT_THROW_WITH(data::ImageH5Dataset{path}, prefix() + "dataset 'images' has 20 samples but 'labels' has 19");
}

TEST_F(DataH5Errors, LabelOutOfRange) {
  std::vector<int64_t> labels(20, 1);
  labels[11] = 3;
  h5_edit(path, [&](hid_t f) { replace_dataset(f, "labels", {20}, H5T_NATIVE_INT64, labels.data()); });
  EXPECT_THROW_WITH(data::ImageH5Dataset(path, true),
                    prefix() + "label 3 of sample 11 is outside [0, num_classes = 3)");
}

// ---- synthetic ---------------------------------------------------------------------------------------

TEST(DataSynthetic, SampleDependsOnlyOnSeedAndIndex) {
  data::SyntheticImageDataset a(1000, 3, 8, 9, 10, 42), b(1000, 3, 8, 9, 10, 42), c(1000, 3, 8, 9, 10, 43);
  auto [x1, y1] = read_all(a, {5, 999, 5, 0});
  auto [x2, y2] = read_all(b, {999});
  EXPECT_TRUE(torch::equal(x1[1], x2[0]));
  EXPECT_TRUE(torch::equal(x1[0], x1[2]));
  EXPECT_FALSE(torch::equal(x1[0], x1[3]));
  EXPECT_EQ(y1[1].item<int64_t>(), y2[0].item<int64_t>());
  auto [x3, y3] = read_all(c, {5});
  EXPECT_FALSE(torch::equal(x1[0], x3[0]));
  // Labels cover the classes; pixels are uniform bytes with the advertised mean and std.
  auto [x, y] = read_all(a, range(1000));
  EXPECT_EQ(std::get<0>(at::_unique(y)).numel(), 10);
  auto [mean, std] = data::compute_mean_std(x);
  EXPECT_NEAR(mean[0], a.mean()[0], 0.01);
  EXPECT_NEAR(std[2], a.std()[2], 0.01);
  EXPECT_THROW_WITH(read_all(a, {1000}), "SyntheticImageDataset: sample index 1000 is outside [0, 1000)");
}

TEST(DataMeanStd, EqualsPlainComputation) {
  // Channel 0: {0, 255, 0, 255} -> mean 0.5, std 0.5; channel 1: all 51 -> mean 0.2, std 0.
  auto x = torch::tensor({0, 255, 51, 51, 0, 255, 51, 51}, torch::kUInt8).reshape({2, 2, 1, 2});
  auto [mean, std] = data::compute_mean_std(x);
  EXPECT_FLOAT_EQ(mean[0], 0.5f);
  EXPECT_FLOAT_EQ(std[0], 0.5f);
  EXPECT_FLOAT_EQ(mean[1], 0.2f);
  EXPECT_FLOAT_EQ(std[1], 0.0f);
}

// ---- IDX conversion of the real Fashion-MNIST -------------------------------------------------------

using testutil::kFashionDir;

class DataIdx : public ::testing::Test {
 protected:
  // The conversion takes about a second: done once for the suite.
  static void SetUpTestSuite() {
    out_ = new TempDir("data_idx");
    summary_ = new std::string(data::convert_idx(kFashionDir, out_->str()));
  }
  static void TearDownTestSuite() {
    delete out_;
    delete summary_;
  }
  static TempDir* out_;
  static std::string* summary_;
};
TempDir* DataIdx::out_ = nullptr;
std::string* DataIdx::summary_ = nullptr;

TEST_F(DataIdx, ConvertsFashionMnist) {
  EXPECT_NE(summary_->find("train.h5 60000 samples, test.h5 10000 samples, each 1x28x28 uint8, 10 classes"),
            std::string::npos)
      << *summary_;
  data::ImageH5Dataset train((*out_ / "train.h5").string()), test((*out_ / "test.h5").string());
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(train.sample_shape(), (std::array<int64_t, 3>{1, 28, 28}));
  EXPECT_EQ(test.sample_shape(), (std::array<int64_t, 3>{1, 28, 28}));
  EXPECT_EQ(train.meta().class_names, data::fashion_mnist_class_names());
  EXPECT_EQ(train.meta().class_names[9], "Ankle boot");
  std::map<int64_t, int64_t> counts;
  for (int64_t l : train.labels()) ++counts[l];
  ASSERT_EQ(counts.size(), 10u);
  for (auto [label, n] : counts) EXPECT_EQ(n, 6000) << "class " << label;
  // Both splits carry the training statistics.
  EXPECT_EQ(test.mean(), train.mean());
  EXPECT_EQ(test.std(), train.std());
}

TEST_F(DataIdx, MatchesNumpyReference) {
  const auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/tests/ref/read_idx_data.py " +
                               kFashionDir + " 0 1 59999");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  data::ImageH5Dataset train((*out_ / "train.h5").string()), test((*out_ / "test.h5").string());
  std::istringstream lines(r.output);
  std::string key;
  int samples = 0;
  while (lines >> key) {
    if (key == "sample") {
      int64_t i, label, sum;
      lines >> i >> label >> sum;
      auto [x, y] = read_all(train, {i});
      EXPECT_EQ(y[0].item<int64_t>(), label) << "sample " << i;
      EXPECT_EQ(x.to(torch::kInt64).sum().item<int64_t>(), sum) << "sample " << i;
      ++samples;
    } else if (key == "count") {
      int64_t c, n;
      lines >> c >> n;
      EXPECT_EQ(std::count(train.labels().begin(), train.labels().end(), c), n);
    } else if (key == "mean" || key == "std") {
      double v;
      lines >> v;
      EXPECT_NEAR(key == "mean" ? train.mean()[0] : train.std()[0], v, 1e-7) << key;
    } else if (key == "test") {
      int64_t n_images, n_labels, label_sum;
      lines >> n_images >> n_labels >> label_sum;
      EXPECT_EQ(test.size(), n_images);
      EXPECT_EQ(test.size(), n_labels);
      EXPECT_EQ(std::accumulate(test.labels().begin(), test.labels().end(), int64_t{0}), label_sum);
    } else {
      FAIL() << "unexpected reference output: " << r.output;
    }
  }
  EXPECT_EQ(samples, 3) << r.output;
}

TEST_F(DataIdx, MeanStdEqualPlainComputation) {
  data::ImageH5Dataset train((*out_ / "train.h5").string(), /*in_memory=*/true);
  auto [x, y] = read_all(train, range(train.size()));
  const auto xd = x.to(torch::kFloat64) / 255.0;
  EXPECT_NEAR(train.mean()[0], xd.mean().item<double>(), 1e-7);
  EXPECT_NEAR(train.std()[0], xd.std(/*unbiased=*/false).item<double>(), 1e-7);
}

TEST(DataIdxErrors, BadFilesAreNamed) {
  TempDir dir("data_idx_err");
  auto write = [&](const std::string& name, std::vector<uint8_t> bytes) {
    std::ofstream f(dir / name, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return (dir / name).string();
  };
  // A 2x2x2 image file has a 16-byte header and 8 bytes of pixels.
  const auto bad_magic = write("m", {0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2, 1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_THROW_WITH(data::read_idx_images(bad_magic),
                    "read_idx: " + bad_magic + ": bad magic number 0x00000801, expected 0x00000803");
  const auto short_file = write("s", {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2, 1, 2, 3});
  EXPECT_THROW_WITH(data::read_idx_images(short_file),
                    "read_idx: " + short_file + ": truncated: the header promises 8 bytes of data, the file has 3");
  const auto long_file = write("l", {0, 0, 8, 1, 0, 0, 0, 2, 4, 5, 6});
  EXPECT_THROW_WITH(data::read_idx_labels(long_file), "read_idx: " + long_file + ": has trailing bytes");
  const auto ok = write("ok", {0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6});
  EXPECT_TRUE(torch::equal(data::read_idx_images(ok), torch::arange(1, 7, torch::kUInt8).reshape({1, 1, 2, 3})));
  EXPECT_THROW_WITH(data::convert_idx(dir.str(), (dir / "out").string()),
                    "convert_idx: " + dir.str() + ": missing train-images-idx3-ubyte.gz");
}

// ---- augmentation ------------------------------------------------------------------------------------

// Identity table: the output equals the pixel value, so expected results are written as pixels.
std::vector<float> identity_table(int64_t channels) {
  std::vector<float> t(channels * 256);
  for (int64_t i = 0; i < channels * 256; ++i) t[i] = static_cast<float>(i % 256);
  return t;
}

torch::Tensor augment(const std::vector<uint8_t>& pixels, std::array<int64_t, 3> shape, data::AugmentParams p,
                      int64_t padding) {
  auto out = torch::empty({shape[0], shape[1], shape[2]}, torch::kFloat32);
  const auto table = identity_table(shape[0]);
  data::augment_image(pixels.data(), shape, p, padding, table.data(), out.data_ptr<float>());
  return out;
}

TEST(DataAugment, CropAndFlipHandComputed) {
  // 1 x 3 x 3:  1 2 3 / 4 5 6 / 7 8 9, padded by 1 to 5 x 5.
  const std::vector<uint8_t> img = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto expect = [](std::vector<float> v, int64_t c, int64_t h, int64_t w) {
    return torch::tensor(v).reshape({c, h, w});
  };
  // Crop at (0, 2) of the padded image: rows -1..1, columns 1..3 of the original.
  EXPECT_TRUE(torch::equal(augment(img, {1, 3, 3}, {0, 2, false}, 1), expect({0, 0, 0, 2, 3, 0, 5, 6, 0}, 1, 3, 3)));
  // The same crop mirrored.
  EXPECT_TRUE(torch::equal(augment(img, {1, 3, 3}, {0, 2, true}, 1), expect({0, 0, 0, 0, 3, 2, 0, 6, 5}, 1, 3, 3)));
  // Crop at (2, 1): rows 1..3, columns 0..2, mirrored.
  EXPECT_TRUE(torch::equal(augment(img, {1, 3, 3}, {2, 1, true}, 1), expect({6, 5, 4, 9, 8, 7, 0, 0, 0}, 1, 3, 3)));
  // Centre crop without flip is the identity; no padding with flip is a plain mirror.
  EXPECT_TRUE(torch::equal(augment(img, {1, 3, 3}, {1, 1, false}, 1), expect({1, 2, 3, 4, 5, 6, 7, 8, 9}, 1, 3, 3)));
  EXPECT_TRUE(torch::equal(augment(img, {1, 3, 3}, {0, 0, true}, 0), expect({3, 2, 1, 6, 5, 4, 9, 8, 7}, 1, 3, 3)));
  // Two channels, 2 x 3, padding 2, crop (4, 0) leaves only padding; crop (1, 3) flipped.
  const std::vector<uint8_t> two = {1, 2, 3, 4, 5, 6, 11, 12, 13, 14, 15, 16};
  EXPECT_TRUE(torch::equal(augment(two, {2, 2, 3}, {4, 0, false}, 2), torch::zeros({2, 2, 3})));
  // Crop (1, 3) reads rows -1..0 and columns 1..3; mirrored: row -1 is padding, row 0 is (0, 3, 2).
  EXPECT_TRUE(torch::equal(augment(two, {2, 2, 3}, {1, 3, true}, 2),
                           expect({0, 0, 0, 0, 3, 2, 0, 0, 0, 0, 13, 12}, 2, 2, 3)));
}

TEST(DataAugment, DrawsCoverTheRangeAndAreDeterministic) {
  data::AugmentOptions opt;
  opt.random_crop_padding = 2;
  opt.hflip = true;
  std::set<int64_t> dys, dxs;
  int flips = 0, changed = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    const auto p = data::draw_augment(9, 3, i, opt);
    const auto again = data::draw_augment(9, 3, i, opt);
    ASSERT_TRUE(p.dy == again.dy && p.dx == again.dx && p.flip == again.flip);
    ASSERT_TRUE(p.dy >= 0 && p.dy <= 4 && p.dx >= 0 && p.dx <= 4);
    dys.insert(p.dy);
    dxs.insert(p.dx);
    flips += p.flip;
    const auto other = data::draw_augment(9, 4, i, opt);
    changed += other.dy != p.dy || other.dx != p.dx || other.flip != p.flip;
  }
  EXPECT_EQ(dys.size(), 5u);
  EXPECT_EQ(dxs.size(), 5u);
  EXPECT_NEAR(flips / 2000.0, 0.5, 0.05);
  EXPECT_GT(changed, 1500);  // another epoch draws independently (equal by chance 1/50)
  data::AugmentOptions off;
  const auto p = data::draw_augment(9, 3, 7, off);
  EXPECT_TRUE(p.dy == 0 && p.dx == 0 && !p.flip);
}

// ---- loader ------------------------------------------------------------------------------------------

std::shared_ptr<data::SyntheticImageDataset> small_dataset(int64_t n = 100) {
  return std::make_shared<data::SyntheticImageDataset>(n, 3, 6, 5, 7, 11);
}

data::LoaderOptions train_options(int64_t batch = 8, int64_t workers = 2, int64_t prefetch = 3) {
  data::LoaderOptions o;
  o.global_batch = batch;
  o.seed = 1234;
  o.workers = workers;
  o.prefetch = prefetch;
  o.augment.random_crop_padding = 2;
  o.augment.hflip = true;
  return o;
}

void expect_same_batch(const data::Batch& a, const data::Batch& b, const std::string& where) {
  EXPECT_EQ(a.indices, b.indices) << where;
  EXPECT_EQ(a.epoch, b.epoch) << where;
  EXPECT_EQ(a.position, b.position) << where;
  EXPECT_EQ(a.global_size, b.global_size) << where;
  EXPECT_TRUE(torch::equal(a.images, b.images)) << where;
  EXPECT_TRUE(torch::equal(a.labels, b.labels)) << where;
}

TEST(DataLoader, OrderComesFromSeedAndEpochAndCoversEachSampleOnce) {
  auto ds = small_dataset(103);
  data::Loader a(ds, train_options(10)), b(ds, train_options(10, 0, 0));
  EXPECT_EQ(a.steps_per_epoch(), 10);
  EXPECT_EQ(a.epoch_order(2), b.epoch_order(2));
  EXPECT_EQ(a.epoch_order(0), data::epoch_permutation(103, 1234, 0));
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  auto other_seed = train_options(10);
  other_seed.seed = 1235;
  EXPECT_NE(data::Loader(ds, other_seed).epoch_order(0), a.epoch_order(0));

  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    const auto order = a.epoch_order(epoch);
    std::vector<int64_t> seen;
    for (int64_t step = 0; step < 10; ++step) {
      const auto batch = a.next();
      ASSERT_EQ(batch.epoch, epoch);
      ASSERT_EQ(batch.position, step * 10);
      ASSERT_EQ(batch.size(), 10);
      ASSERT_EQ(std::vector<int64_t>(order.begin() + step * 10, order.begin() + step * 10 + 10), batch.indices);
      seen.insert(seen.end(), batch.indices.begin(), batch.indices.end());
    }
    // 100 distinct samples; the 3 left over are dropped (drop_last).
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 100u);
    EXPECT_EQ(a.state(), (data::LoaderState{epoch + 1, 0}));
  }
  // Every index of [0, N) once per epoch in the full permutation.
  auto order = a.epoch_order(5);
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order, range(103));
}

TEST(DataLoader, BatchesHoldTheRightLabelsAndNormalizedPixels) {
  // Without augmentation, the images are the plain normalization of the raw pixels.
  auto ds = small_dataset();
  auto opt = train_options(16);
  opt.augment = data::AugmentOptions{};
  data::Loader loader(ds, opt);
  for (int step = 0; step < 3; ++step) {
    const auto batch = loader.next();
    auto [raw, labels] = read_all(*ds, batch.indices);
    EXPECT_TRUE(torch::equal(batch.labels, labels));
    EXPECT_EQ(batch.images.scalar_type(), torch::kFloat32);
    const auto mean = torch::tensor(ds->mean()).reshape({1, 3, 1, 1});
    const auto std = torch::tensor(ds->std()).reshape({1, 3, 1, 1});
    const auto expected = (raw.to(torch::kFloat32) / 255.0f - mean) / std;
    EXPECT_TRUE(torch::allclose(batch.images, expected, /*rtol=*/0, /*atol=*/1e-6));
    // The same float operations element by element give the same bits.
    const uint8_t* r = raw.data_ptr<uint8_t>();
    const float* out = batch.images.data_ptr<float>();
    for (int64_t k = 0; k < raw.numel(); ++k) {
      const int64_t c = (k / 30) % 3;
      ASSERT_EQ(out[k], (static_cast<float>(r[k]) / 255.0f - ds->mean()[c]) / ds->std()[c]) << k;
    }
  }
  opt.augment.normalize = false;
  data::Loader plain(ds, opt);
  const auto batch = plain.next();
  auto [raw, labels] = read_all(*ds, batch.indices);
  EXPECT_TRUE(torch::allclose(batch.images, raw.to(torch::kFloat32) / 255.0f, 0, 1e-7));
}

TEST(DataLoader, AugmentedSamplesFollowDrawAugment) {
  auto ds = small_dataset();
  const auto opt = train_options(8);
  data::Loader loader(ds, opt);
  loader.next();
  const auto batch = loader.next();
  auto [raw, labels] = read_all(*ds, batch.indices);
  const auto table = data::pixel_table(ds->mean(), ds->std(), true);
  int flipped = 0;
  for (int64_t k = 0; k < batch.size(); ++k) {
    const auto p = data::draw_augment(opt.seed, batch.epoch, batch.indices[k], opt.augment);
    flipped += p.flip;
    auto expected = torch::empty({3, 6, 5});
    data::augment_image(raw[k].data_ptr<uint8_t>(), {3, 6, 5}, p, 2, table.data(), expected.data_ptr<float>());
    EXPECT_TRUE(torch::equal(batch.images[k], expected)) << "sample " << batch.indices[k];
  }
}

TEST(DataLoader, SeekResumeEqualsUninterrupted) {
  auto ds = small_dataset();  // 100 samples, batch 8: 12 steps per epoch, 4 samples dropped
  data::Loader full(ds, train_options(8, 2, 3));
  std::vector<data::Batch> reference;
  for (int i = 0; i < 30; ++i) reference.push_back(full.next());
  EXPECT_EQ(reference[12].epoch, 1);
  EXPECT_EQ(reference[12].position, 0);

  data::LoaderState saved;
  {
    data::Loader first(ds, train_options(8, 3, 1));
    for (int i = 0; i < 11; ++i) first.next();
    saved = first.state();
    EXPECT_EQ(saved, (data::LoaderState{0, 88}));
  }  // destroyed with batches in flight
  data::Loader resumed(ds, train_options(8, 1, 0));
  resumed.seek(saved);
  for (int i = 11; i < 30; ++i) expect_same_batch(resumed.next(), reference[i], "step " + std::to_string(i));

  // Seeking backwards in the same loader discards what was prefetched.
  resumed.seek(1, 16);
  expect_same_batch(resumed.next(), reference[14], "after seek back");
  // A position where no full batch fits is the next epoch's start.
  resumed.seek(0, 96);
  EXPECT_EQ(resumed.state(), (data::LoaderState{1, 0}));
  expect_same_batch(resumed.next(), reference[12], "after seek to the end");
  EXPECT_THROW_WITH(resumed.seek(0, 101), "image loader: seek to epoch 0, position 101 is outside the stream");
}

TEST(DataLoader, SeekAfterGlobalBatchChangeContinuesTheEpochOrder) {
  auto ds = small_dataset();
  data::Loader big(ds, train_options(8));
  for (int i = 0; i < 5; ++i) big.next();
  const auto saved = big.state();  // epoch 0, position 40
  data::Loader small(ds, train_options(6));
  small.seek(saved);
  const auto order = small.epoch_order(0);
  for (int64_t p = 40; p + 6 <= 100; p += 6) {
    const auto batch = small.next();
    ASSERT_EQ(batch.position, p);
    ASSERT_EQ(batch.indices, std::vector<int64_t>(order.begin() + p, order.begin() + p + 6));
  }
  EXPECT_EQ(small.state(), (data::LoaderState{1, 0}));

  // Changing the global batch in place equals a new loader seeked to the same state.
  big.set_global_batch(6);
  data::Loader fresh(ds, train_options(6));
  fresh.seek(saved);
  for (int i = 0; i < 12; ++i) expect_same_batch(big.next(), fresh.next(), "set_global_batch step " + std::to_string(i));
  EXPECT_THROW_WITH(big.set_global_batch(0), "image loader: global_batch must be positive, got 0");
  EXPECT_EQ(big.options().global_batch, 6);
}

TEST(DataLoader, RereadingABatchIsBitIdentical) {
  auto ds = small_dataset();
  data::Loader loader(ds, train_options(8, 3, 2));
  loader.next();
  const auto batch = loader.next();
  const auto again = loader.batch_at(batch.epoch, batch.position);
  expect_same_batch(batch, again, "batch_at");
  expect_same_batch(loader.batch_at(0, 8), again, "batch_at twice");
  // Any number of workers gives the same bits.
  data::Loader serial(ds, train_options(8, 0, 0));
  serial.next();
  expect_same_batch(serial.next(), batch, "workers 0");
}

TEST(DataLoader, RecycledBuffersNeverOverwriteAHeldBatch) {
  // The loader reuses an image tensor only once nothing refers to it or to its storage.
  auto ds = small_dataset();
  data::Loader loader(ds, train_options(8, 2, 2));
  data::Loader reference(ds, train_options(8, 0, 0));
  std::vector<data::Batch> held;
  std::vector<torch::Tensor> views;
  for (int step = 0; step < 40; ++step) {
    auto batch = loader.next();
    if (step < 10) held.push_back(batch);                         // whole batches kept
    else if (step < 20) views.push_back(batch.images.slice(0, 2, 5));  // only a view kept
  }
  for (int step = 0; step < 10; ++step) {
    expect_same_batch(held[step], reference.batch_at(step / 12, (step % 12) * 8), "held " + std::to_string(step));
  }
  for (int step = 10; step < 20; ++step) {
    const auto expected = reference.batch_at(step / 12, (step % 12) * 8).images.slice(0, 2, 5);
    EXPECT_TRUE(torch::equal(views[step - 10], expected)) << "view " << step;
  }
  // While every pooled tensor is held, batches get fresh tensors that the pool does not keep.
  EXPECT_EQ(loader.next().images.use_count(), 1);
  // Once the held batches are gone their tensors are reused (the pool keeps the other reference), and
  // the contents are still right.
  held.clear();
  views.clear();
  for (int step = 41; step < 50; ++step) {
    const auto batch = loader.next();
    expect_same_batch(batch, reference.batch_at(step / 12, (step % 12) * 8), "step " + std::to_string(step));
    if (step >= 45) EXPECT_EQ(batch.images.use_count(), 2) << "step " << step;
  }
}

TEST(DataLoader, RankSlicesAreDisjointAndFormTheGlobalBatch) {
  auto ds = small_dataset();
  const int64_t world = 3;
  data::Loader single(ds, train_options(10));
  std::vector<std::unique_ptr<data::Loader>> ranks;
  for (int64_t r = 0; r < world; ++r) {
    auto o = train_options(10);
    o.rank = r;
    o.world_size = world;
    ranks.push_back(std::make_unique<data::Loader>(ds, o));
  }
  for (int step = 0; step < 12; ++step) {  // crosses into epoch 1
    const auto whole = single.next();
    std::vector<int64_t> joined;
    std::vector<torch::Tensor> images;
    std::set<int64_t> distinct;
    for (int64_t r = 0; r < world; ++r) {
      const auto part = ranks[r]->next();
      EXPECT_EQ(part.size(), (r + 1) * 10 / world - r * 10 / world);  // 3, 3, 4
      EXPECT_EQ(part.position, whole.position);
      EXPECT_EQ(part.global_size, 10);
      joined.insert(joined.end(), part.indices.begin(), part.indices.end());
      distinct.insert(part.indices.begin(), part.indices.end());
      images.push_back(part.images);
    }
    EXPECT_EQ(distinct.size(), 10u) << "ranks overlap at step " << step;
    EXPECT_EQ(joined, whole.indices) << "step " << step;
    EXPECT_TRUE(torch::equal(torch::cat(images), whole.images)) << "step " << step;
  }
}

// Fails on one sample while `armed`, to test error propagation.
class FailingDataset : public data::SyntheticImageDataset {
 public:
  FailingDataset() : SyntheticImageDataset(100, 3, 6, 5, 7, 11) {}
  void read(const std::vector<int64_t>& indices, uint8_t* images, int64_t* labels) const override {
    for (int64_t i : indices) {
      if (armed && i == bad) throw std::runtime_error("cannot decode sample " + std::to_string(i));
    }
    SyntheticImageDataset::read(indices, images, labels);
  }
  std::atomic<bool> armed{true};
  int64_t bad = -1;
};

TEST(DataLoader, WorkerExceptionsReachNextAndTheBatchCanBeRetried) {
  auto failing = std::make_shared<FailingDataset>();
  data::Loader reference(small_dataset(), train_options(8));
  const auto order = reference.epoch_order(0);
  failing->bad = order[20];  // in the third batch (positions 16..23)
  data::Loader loader(failing, train_options(8, 2, 4));
  expect_same_batch(loader.next(), reference.next(), "batch 0");
  expect_same_batch(loader.next(), reference.next(), "batch 1");
  EXPECT_THROW_WITH(loader.next(), "image loader: reading the batch at epoch 0, position 16 failed: cannot decode "
                                   "sample " + std::to_string(order[20]));
  EXPECT_EQ(loader.state(), (data::LoaderState{0, 16}));
  EXPECT_THROW_WITH(loader.next(), "cannot decode sample");  // still the same batch
  failing->armed = false;
  expect_same_batch(loader.next(), reference.next(), "batch 2 retried");
  expect_same_batch(loader.next(), reference.next(), "batch 3");
}

TEST(DataLoader, OutOfMemoryPreparingABatchSkipsNoBatch) {
  // A real cap of the capped allocator at 1 byte: every batch tensor the loader allocates fails. The
  // stream must go on where it was once memory is back: no batch consumed by a call that failed.
  data::Loader reference(small_dataset(), train_options(8));
  data::Loader loader(small_dataset(), train_options(8, 2, 2));
  expect_same_batch(loader.next(), reference.next(), "batch 0");
  int failed = 0;
  {
    trainer::ScopedCpuCap cap(1);
    for (int k = 0; k < 4; ++k) {
      try {
        expect_same_batch(loader.next(), reference.next(), "a batch prepared before the cap");
      } catch (const std::exception& e) {
        EXPECT_TRUE(trainer::is_oom_error(e)) << e.what();
        ++failed;
      }
    }
  }
  EXPECT_GT(failed, 0) << "the cap never bit";
  for (int k = 0; k < 4; ++k) expect_same_batch(loader.next(), reference.next(), "after the cap");
}

TEST(DataLoader, OptionErrorsNameTheOption) {
  auto ds = small_dataset();
  auto o = train_options(101);
  EXPECT_THROW_WITH(data::Loader(ds, o), "image loader: global_batch 101 exceeds the dataset's 100 samples");
  o = train_options(8);
  o.rank = 2;
  o.world_size = 2;
  EXPECT_THROW_WITH(data::Loader(ds, o), "image loader: rank 2 is outside [0, world_size = 2)");
  o = train_options(8);
  o.augment.random_crop_padding = -1;
  EXPECT_THROW_WITH(data::Loader(ds, o), "random_crop_padding must be >= 0, got -1");
}

TEST(DataLoader, PinMemoryIsANoOpWithoutCuda) {
  auto o = train_options(8);
  o.pin_memory = true;
  data::Loader loader(small_dataset(), o);
  EXPECT_EQ(loader.pinned(), torch::cuda::is_available());
  const auto batch = loader.next();
  EXPECT_EQ(batch.images.is_pinned(), torch::cuda::is_available());
  data::Loader unpinned(small_dataset(), train_options(8));
  EXPECT_TRUE(torch::equal(batch.images, unpinned.next().images));
}

TEST(DataEvalLoader, OnePassInOrderWithThePartialBatch) {
  auto ds = small_dataset(103);
  data::EvalOptions o;
  o.batch = 10;
  data::EvalLoader eval(ds, o);
  EXPECT_EQ(eval.num_batches(), 11);
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<int64_t> seen;
    int batches = 0;
    while (auto b = eval.next()) {
      EXPECT_EQ(b->position, batches * 10);
      auto [raw, labels] = read_all(*ds, b->indices);
      EXPECT_TRUE(torch::equal(b->labels, labels));
      const auto mean = torch::tensor(ds->mean()).reshape({1, 3, 1, 1});
      const auto std = torch::tensor(ds->std()).reshape({1, 3, 1, 1});
      EXPECT_TRUE(torch::allclose(b->images, (raw.to(torch::kFloat32) / 255.0f - mean) / std, 0, 1e-6));
      seen.insert(seen.end(), b->indices.begin(), b->indices.end());
      ++batches;
    }
    EXPECT_EQ(batches, 11);
    EXPECT_EQ(seen, range(103));
    EXPECT_FALSE(eval.next().has_value());
    eval.reset();
  }
}

TEST(DataEvalLoader, RanksSplitThePass) {
  auto ds = small_dataset(23);
  std::vector<int64_t> all;
  for (int64_t r = 0; r < 4; ++r) {
    data::EvalOptions o;
    o.batch = 10;
    o.rank = r;
    o.world_size = 4;
    data::EvalLoader eval(ds, o);
    while (auto b = eval.next()) all.insert(all.end(), b->indices.begin(), b->indices.end());
  }
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, range(23));  // the last batch of 3 leaves rank 0 empty
}

// Not a test: the loader throughput that docs/DATA.md reports. Run with
//   ./build/tests/trainer_tests --gtest_also_run_disabled_tests --gtest_filter='DataBench*'
// (FMNIST_H5 may point at an existing train.h5; otherwise Fashion-MNIST is converted to a temp dir.)
TEST(DataBench, DISABLED_LoaderThroughput) {
  TempDir dir("data_bench");
  std::string path = std::getenv("FMNIST_H5") ? std::getenv("FMNIST_H5") : "";
  if (path.empty()) {
    data::convert_idx(kFashionDir, dir.str());
    path = (dir / "train.h5").string();
  }
  data::H5WriteOptions gz;
  gz.gzip_level = 4;
  {
    data::ImageH5Dataset src(path, true);
    auto [x, y] = read_all(src, range(src.size()));
    data::write_image_h5((dir / "train_gzip4.h5").string(), x, y, src.meta(), gz);
  }
  for (int64_t workers : {1, 2}) {
    for (const std::string file : {path, (dir / "train_gzip4.h5").string()}) {
      for (bool in_memory : {true, false}) {
        auto ds = std::make_shared<data::ImageH5Dataset>(file, in_memory);
        data::LoaderOptions o;
        o.global_batch = 256;
        o.workers = workers;
        o.prefetch = 4;
        o.augment.random_crop_padding = 4;
        o.augment.hflip = true;
        data::Loader loader(ds, o);
        std::printf("fashion-mnist 1x28x28 batch 256 crop+flip+normalize, gzip %d, in_memory %d, workers %lld: "
                    "%.0f samples/s\n",
                    ds->gzip_level(), in_memory, static_cast<long long>(workers),
                    data::measure_loader_throughput(loader, 100));
      }
    }
  }
  for (int64_t workers : {1, 2}) {
    auto ds = std::make_shared<data::SyntheticImageDataset>(100000, 3, 224, 224, 1000);
    data::LoaderOptions o;
    o.global_batch = 64;
    o.workers = workers;
    o.prefetch = 4;
    o.augment.random_crop_padding = 16;
    o.augment.hflip = true;
    data::Loader loader(ds, o);
    std::printf("synthetic 3x224x224 batch 64 crop+flip+normalize, workers %lld: %.0f samples/s\n",
                static_cast<long long>(workers), data::measure_loader_throughput(loader, 20));
  }
}

}  // namespace

}  // namespace test_data
