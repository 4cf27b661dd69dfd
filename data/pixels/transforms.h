// The image transforms of the standard ResNet-50 recipe, as torchvision defines them, expressed as a
// crop box in the source image's pixel coordinates (data/pixels/jpeg.h's CropBox) that decode_crop_resize
// decodes and resizes in one go.
//
// Every random number comes from (seed, epoch, index) alone (data/pixels/rng.h), so a sample's crop and flip do
// not depend on the thread, the order of reads or what else the process drew: a resumed run draws the
// same boxes bit for bit.
#pragma once

#include "data/pixels/jpeg.h"

#include <cstdint>

namespace data {

/// torchvision's RandomResizedCrop.get_params for a width x height image, with its own generator:
/// up to 10 tries of area = U(scale_lo, scale_hi) * W * H and ratio = exp(U(log ratio_lo, log ratio_hi)),
/// w = round(sqrt(area * ratio)), h = round(sqrt(area / ratio)) (rounding half to even, like Python),
/// accepted if 0 < w <= W and 0 < h <= H, with the top-left corner i = randint(0, H - h),
/// j = randint(0, W - w) (both ends included); if no try is accepted, the center crop with the image's
/// ratio clamped to [ratio_lo, ratio_hi]. The box has whole-pixel coordinates. `hflip_out`, when not
/// null, receives a fair coin (the RandomHorizontalFlip(0.5) that follows in the recipe), drawn from the
/// same (seed, epoch, index) stream. Needs width, height >= 1, 0 < scale_lo <= scale_hi,
/// 0 < ratio_lo <= ratio_hi; throws std::invalid_argument otherwise.
CropBox random_resized_crop(int width, int height, double scale_lo, double scale_hi, double ratio_lo,
                            double ratio_hi, uint64_t seed, int64_t epoch, int64_t index, bool* hflip_out);

/// The eval transform torchvision writes as Resize(round(size / resize_ratio)) + CenterCrop(size)
/// (Resize(256) + CenterCrop(224) for size 224), as a box in source coordinates: the shorter side is
/// resized to s = round(size / resize_ratio) and the longer one to int(s * long / short) (torchvision's
/// truncation); the crop's offset in the resized image is round((resized - size) / 2) (half to even, as
/// Python's round). Resizing that box to size x size with decode_crop_resize is the same computation as
/// torchvision's on a PIL image. Throws std::invalid_argument for sizes < 1 or a ratio outside (0, 1].
CropBox eval_center_crop(int width, int height, int size, double resize_ratio = 0.875);

}  // namespace data
