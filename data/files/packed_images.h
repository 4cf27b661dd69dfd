// The packed image format ("trainer.packed_images", version 1; docs/DATA.md has the full description):
// one HDF5 file per split holding every image's encoded bytes (JPEG as it came, or re-encoded), what
// `trainer convert-images` (tools/convert_images.h) writes; and the dataset that decodes its samples
// with the train or eval transform (data/samples/image_sample.h).
//
// Layout of a file:
//   /bytes    uint8  (total bytes)  every image's encoded bytes, back to back, chunked (1 MiB)
//   /offsets  int64  (N + 1)        image i is bytes[offsets[i], offsets[i + 1]); offsets[0] = 0
//   /labels   int64  (N)            each in [0, num_classes)
//   /sizes    int32  (N, 2)         (width, height) of each image
//   root attributes: format = "trainer.packed_images", format_version = 1 (int64), num_classes (int64),
//                    class_names (string array), mean, std (float32, size 3, RGB on the [0, 1] scale,
//                    from the training split), mean_std_images (int64: images the statistics come from)
#pragma once

#include "data/samples/dataset.h"
#include "data/samples/image_sample.h"

#include <string>
#include <vector>

namespace data {

inline constexpr const char* kPackedImagesFormat = "trainer.packed_images";
inline constexpr int64_t kPackedImagesVersion = 1;

/// Writes a packed file image by image. The file is written as `path + ".tmp"` and renamed to `path` by
/// finish() after the attributes, so an interrupted conversion never leaves a file that opens.
class PackedImageWriter {
 public:
  /// Creates the file; throws std::runtime_error naming the path if it cannot.
  explicit PackedImageWriter(std::string path);
  /// Without finish(), closes and removes "<path>.tmp".
  ~PackedImageWriter();
  PackedImageWriter(const PackedImageWriter&) = delete;
  PackedImageWriter& operator=(const PackedImageWriter&) = delete;

  /// Appends one image: its encoded bytes, label and (width, height).
  void append(const uint8_t* bytes, size_t size, int64_t label, int width, int height);
  /// Writes offsets, labels, sizes and the attributes (meta: num_classes >= 1 and above every label,
  /// class_names of size num_classes, mean/std of size 3 with std > 0), closes and renames the file.
  /// `mean_std_images` is stored as the attribute of that name.
  void finish(const ImageMeta& meta, int64_t mean_std_images);

  int64_t size() const { return static_cast<int64_t>(labels_.size()); }
  int64_t bytes() const { return offsets_.back(); }

 private:
  std::string path_, tmp_path_;
  std::vector<int64_t> offsets_{0}, labels_;
  std::vector<int32_t> sizes_;
  bool finished_ = false;
  int64_t file_ = -1, bytes_ = -1;  // hid_t
};

/// A packed file as an ImageDataset: read_epoch() decodes each sample with `transform` (layout HWC,
/// sample_shape (3, size, size)); a sample that fails to decode is a zero image with kIgnoreLabel, is
/// logged (one warning line naming the file and index) and is reported in `failures`.
///
/// Opening checks the format and version, dtypes and ranks, that /bytes is stored in full
/// (dataset_size_problem, before anything that size is allocated), that offsets start at 0, never
/// decrease and end at /bytes' length, the labels, the sizes (positive), and the attributes; any failure
/// throws std::runtime_error "packed image file '<path>': <what is wrong>". Offsets, labels and sizes are
/// kept in memory (20 bytes per image). With in_memory the whole /bytes is loaded once; otherwise each
/// sample is one hyperslab read under hdf5_lock().
class PackedImageDataset : public ImageDataset {
 public:
  PackedImageDataset(std::string path, ImageTransform transform, bool in_memory = false);
  ~PackedImageDataset() override;
  PackedImageDataset(const PackedImageDataset&) = delete;
  PackedImageDataset& operator=(const PackedImageDataset&) = delete;

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  std::array<int64_t, 3> sample_shape() const override { return {3, transform_.size, transform_.size}; }
  const ImageMeta& meta() const override { return meta_; }
  PixelLayout layout() const override { return PixelLayout::HWC; }
  /// Epoch 0's samples.
  void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const override {
    read_epoch(indices, 0, images_out, labels_out, nullptr);
  }
  void read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out, int64_t* labels_out,
                  std::vector<SampleFailure>* failures) const override;

  /// Image i's encoded bytes, as stored.
  std::vector<uint8_t> encoded(int64_t i) const;
  /// (width, height) of image i.
  std::pair<int, int> image_size(int64_t i) const { return {sizes_[2 * i], sizes_[2 * i + 1]}; }
  const std::vector<int64_t>& labels() const { return labels_; }
  const std::string& path() const { return path_; }
  int64_t mean_std_images() const { return mean_std_images_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  ImageTransform transform_;
  bool in_memory_;
  ImageMeta meta_;
  std::vector<int64_t> offsets_, labels_;
  std::vector<int32_t> sizes_;
  std::vector<uint8_t> bytes_;  // in_memory only
  int64_t mean_std_images_ = 0;
  int64_t file_ = -1, dset_ = -1;  // hid_t, open for file reads only
};

}  // namespace data
