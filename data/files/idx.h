// Conversion of IDX files (the format of MNIST and Fashion-MNIST, usually gzipped) to trainer.images
// HDF5 files.
#pragma once

#include "data/files/image_h5.h"

#include <string>
#include <vector>

namespace data {

/// Fashion-MNIST's ten class names, in label order (0 = "T-shirt/top" ... 9 = "Ankle boot").
const std::vector<std::string>& fashion_mnist_class_names();

/// Reads an IDX image file (magic 0x00000803: unsigned bytes, 3 dimensions N, H, W), gzipped or not,
/// into a uint8 tensor (N, 1, H, W). Throws std::runtime_error naming the path and the problem (missing
/// file, bad magic number, a size product that overflows, truncated data with the promised and present
/// byte counts, trailing bytes, corrupt gzip stream). Memory follows the bytes really present, never
/// the header's claim.
torch::Tensor read_idx_images(const std::string& path);

/// Reads an IDX label file (magic 0x00000801: unsigned bytes, 1 dimension N) into an int64 tensor (N).
torch::Tensor read_idx_labels(const std::string& path);

struct IdxConvertOptions {
  /// Class names written to both files; their number is num_classes, and every label must be below it.
  std::vector<std::string> class_names = fashion_mnist_class_names();
  /// Layout of the written files.
  H5WriteOptions h5;
};

/// Converts the four IDX files in `src_dir` (train-images-idx3-ubyte, train-labels-idx1-ubyte,
/// t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each with or without ".gz") into
/// `out_dir`/train.h5 and `out_dir`/test.h5 (out_dir is created). Both files carry the mean and std of
/// the training images. Returns a short human-readable summary. This is `trainer convert-idx`.
std::string convert_idx(const std::string& src_dir, const std::string& out_dir,
                        const IdxConvertOptions& options = {});

}  // namespace data
