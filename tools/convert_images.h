// `trainer convert-images`: an ImageFolder tree (SRC/train/<class>/*, SRC/val/<class>/*) to one packed
// file per split (data/files/packed_images.h, docs/DATA.md).
#pragma once

#include <cstdint>
#include <string>

namespace trainer {

struct ConvertImagesOptions {
  std::string src, out;
  /// Images whose longer side is over this are resized (antialiased, aspect kept) and re-encoded; 0 = keep.
  int max_side = 0;
  /// Worker threads; 0 = the CPUs this process may use (the container's CPU quota).
  int threads = 0;
  /// JPEG quality of every image that is re-encoded (PNG, grayscale, CMYK, over max_side).
  int quality = 95;
  /// Largest width * height accepted (data.max_image_pixels).
  int64_t max_pixels = 100'000'000;
  /// Training images (every k-th) the mean and std are computed from.
  int64_t mean_std_images = 1000;
  /// A progress line (files/s, ETA) on stderr.
  bool progress = true;
};

/// Converts `train` (required) and `val` (when present) and returns a one-line summary. Files that
/// cannot be decoded are skipped and listed, with the reason, in OUT/<split>.skipped.txt (removed when
/// nothing was skipped); empty class folders are listed there too and keep their class index. val uses
/// train's class indices (by name); a val class that train lacks is an error. Throws std::runtime_error
/// with one line for a missing or empty source, an unwritable output folder, or a bad option.
std::string convert_images(const ConvertImagesOptions& options);

}  // namespace trainer
