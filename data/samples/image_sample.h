// What the two encoded-image datasets (data/files/packed_images.h, data/samples/image_folder.h) share: the transform
// a sample is decoded with, the decode itself with its failure rule, and the ImageFolder layout
// (torchvision's class and file order).
//
// A sample is decoded straight to the network's input: RGB, uint8, (size, size, 3), channels last.
//   train: RandomResizedCrop(size, scale, ratio) + a horizontal flip with probability 1/2, box and flip
//          from (seed, epoch, index) alone (data/pixels/transforms.h);
//          or, with crop_padding > 0, the stored-pixel recipe (CIFAR's): the eval view below, padded
//          with crop_padding zero pixels and cropped back at a random offset, then the flip, drawn by
//          data/samples/loader.h's draw_augment from (seed, epoch, index) exactly as the HDF5 path draws it;
//          then, with auto_augment, RandAugment or TrivialAugmentWide on the uint8 crop (data/pixels/augment.h,
//          from (seed, epoch, index) as the HDF5 path draws it);
//   eval:  resize the shorter side to round(size / crop_pct) (crop_pct 0.875: 256 for 224), center crop
//          size x size.
// A sample that cannot be decoded becomes a zero image with label kIgnoreLabel (data/samples/dataset.h): it keeps
// its place in the batch, adds nothing to the loss, and is reported as a SampleFailure.
#pragma once

#include "data/samples/batch.h"
#include "data/pixels/augment.h"
#include "data/pixels/jpeg.h"

#include <cstdint>
#include <string>
#include <vector>

namespace data {

/// How every sample of a dataset is decoded.
struct ImageTransform {
  /// Output side: samples are (size, size, 3).
  int size = 224;
  /// true: RandomResizedCrop + flip (training); false: resize + center crop (evaluation).
  bool train = true;
  /// RandomResizedCrop's area fraction and aspect-ratio ranges.
  double scale_lo = 0.08, scale_hi = 1.0;
  double ratio_lo = 3.0 / 4.0, ratio_hi = 4.0 / 3.0;
  /// Mirror left-right with probability 1/2 (train only).
  bool hflip = true;
  /// The eval view's crop fraction: the shorter side is resized to round(size / crop_pct).
  double crop_pct = 0.875;
  /// > 0: train with the stored-pixel recipe (pad, random crop, flip) on the eval view instead of
  /// RandomResizedCrop.
  int crop_padding = 0;
  /// Train only: RandAugment or TrivialAugmentWide on the decoded uint8 crop (kind None: off).
  AutoAugmentOptions auto_augment;
  /// Seeds the crop boxes and flips.
  uint64_t seed = 0;
  /// Largest width * height of an image accepted; bigger headers are refused before any allocation.
  DecodeLimits limits;
};

/// Checks the transform (size in [1, 65536], 0 < scale_lo <= scale_hi <= 1, 0 < ratio_lo <= ratio_hi,
/// 0 < crop_pct <= 1, crop_padding in [0, size], max_pixels >= 1, auto_augment's ranges); throws std::invalid_argument naming
/// the field.
void check_transform(const ImageTransform& t);

/// Decodes sample `index` of epoch `epoch` from its encoded bytes into `out` (size * size * 3 bytes).
/// `width` and `height` are the image's size when known (from a packed file), else 0 (read from the
/// header). Returns "" on success; otherwise fills `out` with zeros and returns the decoder's one-line
/// reason (an image of the wrong size for its header, a truncated file, ...).
std::string decode_sample(const uint8_t* bytes, size_t size, int width, int height, int64_t index, int64_t epoch,
                          const ImageTransform& t, uint8_t* out);

/// One split of an ImageFolder tree: DIR/<class>/**/<file>.
struct ImageFolderIndex {
  /// Every sub-folder name of DIR, sorted byte-wise (Python's sorted() on str for UTF-8 names): class
  /// k is classes[k], also for a class folder that holds no image.
  std::vector<std::string> classes;
  /// Image files (extensions .jpg, .jpeg, .png in any case), sorted by path within each class, classes
  /// in order; labels[k] is files[k]'s class.
  std::vector<std::string> files;
  std::vector<int64_t> labels;
  /// Class folders with no image file.
  std::vector<std::string> empty_classes;
  /// Files under the class folders with another extension (not read).
  int64_t other_files = 0;
  /// Paths with an image extension that are not regular files (a link to a device such as /dev/zero, a
  /// FIFO, a socket, a dangling link): passed over, never opened, and listed so the user is told.
  std::vector<std::string> not_regular;
};

/// Lists `dir` as torchvision's ImageFolder does (classes = sorted sub-folder names, files found
/// recursively, sorted), following symbolic links. Throws std::runtime_error naming `dir` when it is
/// missing, not a folder or has no class folder.
ImageFolderIndex scan_image_folder(const std::string& dir);

/// A file or folder name for a message, an attribute or a list file: valid UTF-8 as is, every byte of
/// an invalid sequence as \xNN.
std::string printable_name(const std::string& bytes);

/// Reads a whole file; throws DecodeError ("cannot read the file: ...") when it cannot.
std::vector<uint8_t> read_file_bytes(const std::string& path);

}  // namespace data
