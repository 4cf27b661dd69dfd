// The project's HDF5 format for image classification ("trainer.images", version 1; docs/DATA.md has
// the full description), its writers, and a reader that serves samples from the file (hyperslab reads)
// or from memory.
//
// Layout of a file:
//   /images  uint8  (N, C, H, W)  chunked along N (a chunk holds whole samples), optionally gzip
//   /labels  int64  (N)           each in [0, num_classes)
//   root attributes: format = "trainer.images", format_version = 1 (int64), num_classes (int64),
//                    class_names (string array, size num_classes), mean, std (float32, size C, pixels on
//                    the [0, 1] scale, from the training split)
//
// Debian's libhdf5 is the serial build, which is not thread-safe: every HDF5 call in the process must be
// made while holding hdf5_lock() (data/files/hdf5_lock.h).
#pragma once

#include "data/samples/dataset.h"

#include <array>
#include <mutex>
#include <string>
#include <vector>

namespace data {

/// The format's name and version, written as root attributes `format` and `format_version`.
inline constexpr const char* kImageH5Format = "trainer.images";
inline constexpr int64_t kImageH5Version = 1;


/// How a file is laid out on disk.
struct H5WriteOptions {
  /// Samples per chunk of /images. 0 picks as many as fit in 1 MiB, between 1 and 256.
  int64_t chunk_samples = 0;
  /// gzip level 1..9, or 0 for no compression. Compression shrinks files but a random read has to
  /// inflate a whole chunk; docs/DATA.md has the measured cost.
  int gzip_level = 0;
};

/// Writes a trainer.images file sample by sample (for datasets that do not fit in memory). The file is
/// written under `path + ".tmp"` and renamed to `path` by finish(), so an interrupted conversion never
/// leaves a file that looks complete.
class ImageH5Writer {
 public:
  /// Creates the file for samples of shape (C, H, W). Throws std::runtime_error naming the path if the
  /// file cannot be created.
  ImageH5Writer(std::string path, std::array<int64_t, 3> sample_shape, const H5WriteOptions& options = {});
  /// Closes the file; without finish() the partial "<path>.tmp" is removed.
  ~ImageH5Writer();
  ImageH5Writer(const ImageH5Writer&) = delete;
  ImageH5Writer& operator=(const ImageH5Writer&) = delete;

  /// Appends `n` samples: `images` holds n*C*H*W bytes (layout N, C, H, W), `labels` n values.
  void append(const uint8_t* images, const int64_t* labels, int64_t n);
  /// Appends uint8 images (n, C, H, W) and integer labels (n).
  void append(const torch::Tensor& images, const torch::Tensor& labels);
  /// Checks `meta` (num_classes > 0, every label below it, class_names empty or of size num_classes,
  /// mean/std of size C with std > 0), writes the root attributes, closes and renames the file.
  void finish(const ImageMeta& meta);

  /// Samples appended so far.
  int64_t size() const { return size_; }

 private:
  std::string path_, tmp_path_;
  std::array<int64_t, 3> shape_;
  int64_t size_ = 0;
  int64_t max_label_ = -1;
  bool finished_ = false;
  int64_t file_ = -1, images_ = -1, labels_ = -1;  // hid_t (int64_t in HDF5 >= 1.10)
};

/// Writes uint8 images (N, C, H, W) and integer labels (N) with `meta` to `path` in one go.
void write_image_h5(const std::string& path, const torch::Tensor& images, const torch::Tensor& labels,
                    const ImageMeta& meta, const H5WriteOptions& options = {});

/// A trainer.images file as an ImageDataset.
///
/// Opening checks the format name and version, the datasets' ranks and dtypes (images: 1-byte unsigned
/// integers of rank 4; labels: integers of rank 1 and the same length), that the file stores the bytes
/// both datasets' extents claim (dataset_size_problem, before anything that size is allocated), the
/// attributes, and that every label lies in [0, num_classes); any failure throws std::runtime_error with
/// one line "image file '<path>': <what is wrong>". Labels are always kept in memory (8 bytes per sample).
///
/// With in_memory = false, read() fetches the requested samples from the file: the indices are sorted,
/// runs of consecutive indices coalesced, and each run read as one hyperslab (the HDF5 chunk cache is
/// off for uncompressed files, so a read touches only the requested bytes). HDF5 calls hold
/// hdf5_lock() (data/files/hdf5_lock.h), so reads from several threads take turns. With in_memory = true
/// the whole /images dataset is loaded at construction and read() copies from memory (no lock).
class ImageH5Dataset : public ImageDataset {
 public:
  explicit ImageH5Dataset(std::string path, bool in_memory = false);
  ~ImageH5Dataset() override;
  ImageH5Dataset(const ImageH5Dataset&) = delete;
  ImageH5Dataset& operator=(const ImageH5Dataset&) = delete;

  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  std::array<int64_t, 3> sample_shape() const override { return shape_; }
  const ImageMeta& meta() const override { return meta_; }
  void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const override;

  const std::string& path() const { return path_; }
  bool in_memory() const { return in_memory_; }
  /// Every label, in sample order.
  const std::vector<int64_t>& labels() const { return labels_; }
  /// Samples per chunk of /images in the file (0 if not chunked).
  int64_t chunk_samples() const { return chunk_samples_; }
  /// gzip level of /images (0 if none).
  int gzip_level() const { return gzip_level_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  bool in_memory_;
  std::array<int64_t, 3> shape_{};
  ImageMeta meta_;
  std::vector<int64_t> labels_;
  std::vector<uint8_t> images_;  // in_memory only: N*C*H*W bytes
  int64_t chunk_samples_ = 0;
  int gzip_level_ = 0;
  int64_t file_ = -1, dset_ = -1;  // hid_t, open for file reads only
};

}  // namespace data
