// The image-classification dataset interface the loader reads from, and a synthetic dataset that
// generates its samples on demand (for speed measurements without a file).
#pragma once

#include <torch/torch.h>

#include "data/samples/batch.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace data {

/// What an image dataset says about itself besides its samples.
struct ImageMeta {
  /// Labels lie in [0, num_classes).
  int64_t num_classes = 0;
  /// One name per class, or empty (then names are "0", "1", ...).
  std::vector<std::string> class_names;
  /// Per-channel mean and standard deviation of the pixels on the [0, 1] scale (pixel / 255), computed
  /// over the training split; size C. The loader normalizes with them.
  std::vector<float> mean, std;
};

/// The label of a sample that could not be decoded: LibTorch's cross-entropy ignores it (its default
/// ignore_index), so the sample keeps its place in the batch and adds nothing to the loss or gradients.
inline constexpr int64_t kIgnoreLabel = -100;

/// How read() lays out one sample's bytes.
enum class PixelLayout {
  CHW,  ///< (C, H, W): stored pixels (HDF5, synthetic); the loader augments and converts them to float
  HWC,  ///< (H, W, C): decoded to the network's input already; the loader passes them on as uint8 NHWC
};

/// A read-only, indexable set of uint8 images (C, H, W) with int64 labels. read() may be called from
/// several threads at once.
class ImageDataset {
 public:
  virtual ~ImageDataset() = default;

  /// The byte layout of read()'s samples (sample_shape() is (C, H, W) either way).
  virtual PixelLayout layout() const { return PixelLayout::CHW; }

  /// read() for the samples of epoch `epoch`: datasets whose samples depend on the epoch (a random crop
  /// drawn from (seed, epoch, index)) override it. A sample that cannot be decoded is written as zeros
  /// with label kIgnoreLabel and appended to `failures` (when not null) instead of throwing.
  /// The default ignores the epoch and calls read().
  virtual void read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out,
                          int64_t* labels_out, std::vector<SampleFailure>* failures) const {
    (void)epoch;
    (void)failures;
    read(indices, images_out, labels_out);
  }

  /// Number of samples N.
  virtual int64_t size() const = 0;
  /// (C, H, W) of every sample.
  virtual std::array<int64_t, 3> sample_shape() const = 0;
  /// Metadata: num_classes, class names, per-channel mean/std on the [0, 1] scale.
  virtual const ImageMeta& meta() const = 0;

  /// Reads samples `indices` (any order, repeats allowed, each in [0, size())) into `images_out`
  /// (indices.size() * C*H*W bytes, sample k at offset k*C*H*W, layout C, H, W) and `labels_out`
  /// (indices.size() values). Thread-safe. Throws std::out_of_range for an index outside [0, size()).
  virtual void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const = 0;

  int64_t num_classes() const { return meta().num_classes; }
  const std::vector<float>& mean() const { return meta().mean; }
  const std::vector<float>& std() const { return meta().std; }
  /// Bytes of one sample: C*H*W.
  int64_t sample_bytes() const {
    const auto s = sample_shape();
    return s[0] * s[1] * s[2];
  }
};

/// Checks that every index lies in [0, n); throws std::out_of_range naming `what`, the index and n.
void check_indices(const std::vector<int64_t>& indices, int64_t n, const std::string& what);

/// Per-channel mean and population standard deviation (ddof = 0) of uint8 images (N, C, H, W) on the
/// [0, 1] scale, accumulated exactly in integers. Returns {mean, std}, each of size C.
std::pair<std::vector<float>, std::vector<float>> compute_mean_std(const torch::Tensor& images);

/// `size` samples of shape (C, H, W) with `num_classes` classes, generated on demand: sample i's label
/// and pixels (uniform bytes) come from (seed, i) alone, so the same index always gives the same sample
/// and nothing is stored. The pixels carry no information about the label: this dataset measures speed,
/// not learning. mean = 0.5 and std = sqrt((256^2 - 1) / 12) / 255 per channel (uniform bytes).
class SyntheticImageDataset : public ImageDataset {
 public:
  SyntheticImageDataset(int64_t size, int64_t channels, int64_t height, int64_t width, int64_t num_classes,
                        uint64_t seed = 0);

  int64_t size() const override { return size_; }
  std::array<int64_t, 3> sample_shape() const override { return shape_; }
  const ImageMeta& meta() const override { return meta_; }
  void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const override;

 private:
  int64_t size_;
  std::array<int64_t, 3> shape_;
  uint64_t seed_;
  ImageMeta meta_;
};

}  // namespace data
