// Training straight from an ImageFolder tree (DIR/<class>/<image>), without converting it first: the
// same samples, labels and transforms as the packed file trainer convert-images makes of it (class k is
// the k-th sorted folder name, files sorted), but each read opens a file and parses its header, and no
// mean/std is stored: they are computed at open time from a subsample (docs/DATA.md).
#pragma once

#include "data/samples/dataset.h"
#include "data/samples/image_sample.h"

#include <string>
#include <vector>

namespace data {

/// Per-channel mean and std (ddof 0) on the [0, 1] scale of the decoded pixels of `files`, using every
/// stride-th file with stride = ceil(N / max_images) (files that fail to decode are left out). Returns
/// {mean, std, images used}. Integer sums: the result does not depend on the order. `threads` >= 1.
struct MeanStd {
  std::vector<float> mean, std;
  int64_t images = 0;
};
MeanStd mean_std_of_files(const std::vector<std::string>& files, int64_t max_images, int threads,
                          const DecodeLimits& limits);

/// Images read from an ImageFolder split. read_epoch() reads and decodes each file with `transform`
/// (layout HWC, sample_shape (3, size, size)); a file that cannot be read or decoded is a zero image
/// with kIgnoreLabel, logged with its name and reported in `failures`. An empty class folder keeps its
/// class index (logged once at open).
class ImageFolderDataset : public ImageDataset {
 public:
  /// `mean`/`std`: the statistics to normalize with (from the training split); empty computes them from
  /// this split with mean_std_of_files(files, 1000, threads).
  ImageFolderDataset(std::string dir, ImageTransform transform, std::vector<float> mean = {},
                     std::vector<float> std = {}, int threads = 1);

  int64_t size() const override { return static_cast<int64_t>(index_.files.size()); }
  std::array<int64_t, 3> sample_shape() const override { return {3, transform_.size, transform_.size}; }
  const ImageMeta& meta() const override { return meta_; }
  PixelLayout layout() const override { return PixelLayout::HWC; }
  void read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const override {
    read_epoch(indices, 0, images_out, labels_out, nullptr);
  }
  void read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out, int64_t* labels_out,
                  std::vector<SampleFailure>* failures) const override;

  const ImageFolderIndex& index() const { return index_; }

 private:
  std::string dir_;
  ImageTransform transform_;
  ImageFolderIndex index_;
  ImageMeta meta_;
};

}  // namespace data
