#include "data/pixels/transforms.h"

#include "data/pixels/rng.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace data {
namespace {

/// Python's round() on a double: half to even (std::nearbyint in the default rounding mode).
int64_t round_half_even(double v) { return static_cast<int64_t>(std::nearbyint(v)); }

/// Uniform double in [lo, hi) from 53 random bits.
double uniform(SplitMix64& rng, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(rng.next() >> 11) * 0x1.0p-53);
}

}  // namespace

CropBox random_resized_crop(int width, int height, double scale_lo, double scale_hi, double ratio_lo,
                            double ratio_hi, uint64_t seed, int64_t epoch, int64_t index, bool* hflip_out) {
  if (width < 1 || height < 1 || !(scale_lo > 0 && scale_lo <= scale_hi) || !(ratio_lo > 0 && ratio_lo <= ratio_hi))
    throw std::invalid_argument("random_resized_crop: needs a non-empty image, 0 < scale_lo <= scale_hi and "
                                "0 < ratio_lo <= ratio_hi (got " + std::to_string(width) + "x" +
                                std::to_string(height) + ", scale " + std::to_string(scale_lo) + ".." +
                                std::to_string(scale_hi) + ", ratio " + std::to_string(ratio_lo) + ".." +
                                std::to_string(ratio_hi) + ")");
  // One stream per sample: (seed, "rrc", epoch) then the index.
  SplitMix64 rng(hash_key(hash_key(seed, 0x727263ULL /* "rrc" */, static_cast<uint64_t>(epoch)),
                          static_cast<uint64_t>(index)));
  // The flip is drawn first, so it does not depend on how many tries the box took.
  const bool flip = (rng.next() >> 63) != 0;
  if (hflip_out) *hflip_out = flip;

  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(ratio_lo), log_hi = std::log(ratio_hi);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * uniform(rng, scale_lo, scale_hi);
    const double aspect = std::exp(uniform(rng, log_lo, log_hi));
    const int64_t w = round_half_even(std::sqrt(target_area * aspect));
    const int64_t h = round_half_even(std::sqrt(target_area / aspect));
    if (0 < w && w <= width && 0 < h && h <= height) {
      const int64_t i = static_cast<int64_t>(rng.below(static_cast<uint64_t>(height - h + 1)));
      const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(width - w + 1)));
      return {static_cast<double>(j), static_cast<double>(i), static_cast<double>(w), static_cast<double>(h)};
    }
  }
  // Fallback to a center crop with the image's ratio clamped to [ratio_lo, ratio_hi].
  const double in_ratio = static_cast<double>(width) / height;
  int64_t w = width, h = height;
  if (in_ratio < ratio_lo) {
    h = round_half_even(w / ratio_lo);
  } else if (in_ratio > ratio_hi) {
    w = round_half_even(h * ratio_hi);
  }
  w = std::clamp<int64_t>(w, 1, width);
  h = std::clamp<int64_t>(h, 1, height);
  return {static_cast<double>((width - w) / 2), static_cast<double>((height - h) / 2), static_cast<double>(w),
          static_cast<double>(h)};
}

CropBox eval_center_crop(int width, int height, int size, double resize_ratio) {
  if (width < 1 || height < 1 || size < 1 || !(resize_ratio > 0 && resize_ratio <= 1))
    throw std::invalid_argument("eval_center_crop: needs a non-empty image, size >= 1 and 0 < resize_ratio <= 1 "
                                "(got " + std::to_string(width) + "x" + std::to_string(height) + ", size " +
                                std::to_string(size) + ", ratio " + std::to_string(resize_ratio) + ")");
  const int64_t short_side = round_half_even(size / resize_ratio);
  int64_t new_w, new_h;
  if (width <= height) {
    new_w = short_side;
    new_h = static_cast<int64_t>(static_cast<double>(short_side) * height / width);  // int(): truncation
  } else {
    new_h = short_side;
    new_w = static_cast<int64_t>(static_cast<double>(short_side) * width / height);
  }
  // CenterCrop: offsets in the resized image; a crop larger than the image (only when size / ratio
  // rounds below size) is centered the same way and clipped by the decoder.
  const int64_t top = round_half_even((new_h - size) / 2.0);
  const int64_t left = round_half_even((new_w - size) / 2.0);
  const double sx = static_cast<double>(width) / new_w, sy = static_cast<double>(height) / new_h;
  return {left * sx, top * sy, size * sx, size * sy};
}

}  // namespace data
