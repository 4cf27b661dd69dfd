// The automatic augmentations of published recipes on uint8 images, equal to torchvision's:
//   - RandAugment(num_ops, magnitude, num_magnitude_bins=31, interpolation=NEAREST, fill=0) and
//     TrivialAugmentWide(num_magnitude_bins=31, NEAREST, fill=0) (torchvision/transforms/autoaugment.py),
//     with their 14 operations, each the torchvision.transforms.functional op on a uint8 tensor that
//     _apply_op calls, with the same magnitude tables (_augmentation_space) and signed magnitudes;
//   - RandomErasing(p, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)'s box (get_params' rules), applied
//     to the normalized float image.
// What differs from torchvision is only where the random numbers come from: every draw here is a
// function of (seed, epoch, index) alone (data/pixels/rng.h), never of torch's generator, so a resumed
// run, or any number of loader threads, draws the same operations bit for bit.
//
// Images are uint8 with 1 or 3 channels, planar (C, H, W: stored pixels) or interleaved (H, W, C:
// decoded JPEG/PNG). Each operation is a plain function that rewrites the image in place. Equality with
// torchvision (tests/test_augment.cpp against tests/ref/augment_ref.py):
//   Identity, Brightness, Color, Contrast, Sharpness, Posterize, Solarize, AutoContrast, Equalize:
//     bit for bit (the same float32 operations in the same order, truncated to uint8 as torch's
//     .to(uint8) does; Contrast's mean is exact while H * W * 255 < 2^24, i.e. up to 256 x 256);
//   ShearX, ShearY, TranslateX, TranslateY, Rotate (nearest-neighbour resampling of an affine grid):
//     the same float32 grid; a pixel whose source coordinate lies within float32 rounding of a
//     half-pixel boundary may take its neighbour's value where torch's matrix product rounds the
//     other way (the tests bound the share of such pixels).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace data {

/// A uint8 image to rewrite in place: `channels` 1 or 3, planar (C, H, W) or interleaved (H, W, C).
struct ImageU8 {
  uint8_t* data = nullptr;
  int64_t channels = 0, height = 0, width = 0;
  bool hwc = false;  ///< true: (H, W, C); false: (C, H, W)

  int64_t offset(int64_t c, int64_t y, int64_t x) const {
    return hwc ? (y * width + x) * channels + c : (c * height + y) * width + x;
  }
  uint8_t& at(int64_t c, int64_t y, int64_t x) const { return data[offset(c, y, x)]; }
  int64_t bytes() const { return channels * height * width; }
};

/// torchvision's operations, in the order of its _augmentation_space dictionaries.
enum class AugmentOp : int {
  Identity, ShearX, ShearY, TranslateX, TranslateY, Rotate, Brightness, Color, Contrast, Sharpness, Posterize,
  Solarize, AutoContrast, Equalize
};
inline constexpr int kAugmentOps = 14;
/// torchvision's name of the op ("ShearX", ...).
const char* augment_op_name(AugmentOp op);

// ---- the operations: torchvision's _apply_op(img, name, magnitude, NEAREST, fill=0) ---------------------
// Geometric ops fill what comes from outside the image with 0.

/// F.affine(shear=[degrees(atan(m)), 0], center=[0, 0]): x' = x + m * y about the top-left corner.
void shear_x(ImageU8 img, double magnitude);
/// F.affine(shear=[0, degrees(atan(m))], center=[0, 0]).
void shear_y(ImageU8 img, double magnitude);
/// F.affine(translate=[int(m), 0]): int() truncates toward zero.
void translate_x(ImageU8 img, double magnitude);
/// F.affine(translate=[0, int(m)]).
void translate_y(ImageU8 img, double magnitude);
/// F.rotate(m degrees, counter-clockwise) about the image centre, same size.
void rotate(ImageU8 img, double degrees);
/// F.adjust_brightness(1 + m): blend with black.
void brightness(ImageU8 img, double magnitude);
/// F.adjust_saturation(1 + m): blend with the grayscale image (1 channel: unchanged).
void color(ImageU8 img, double magnitude);
/// F.adjust_contrast(1 + m): blend with the mean of the grayscale image.
void contrast(ImageU8 img, double magnitude);
/// F.adjust_sharpness(1 + m): blend with the 3x3 smoothing [1 1 1; 1 5 1; 1 1 1] / 13 of the interior
/// (border pixels are their own "blurred" value); images 2 pixels wide or high are unchanged.
void sharpness(ImageU8 img, double magnitude);
/// F.posterize(int(m) bits): keep the top bits, bits in [0, 8].
void posterize(ImageU8 img, double magnitude);
/// F.solarize(m): every value >= m becomes 255 - value.
void solarize(ImageU8 img, double threshold);
/// F.autocontrast: each channel stretched from [min, max] to [0, 255] (a flat channel unchanged).
void autocontrast(ImageU8 img);
/// F.equalize: each channel through torchvision's histogram-equalization table.
void equalize(ImageU8 img);
/// Dispatches to the op above (Identity: nothing; AutoContrast, Equalize ignore the magnitude).
void apply_augment_op(ImageU8 img, AugmentOp op, double magnitude);

// ---- the policies ---------------------------------------------------------------------------------------

/// data.auto_augment's policies (data/ does not see the config: trainer/run/from_config.cpp maps the key).
enum class AutoAugmentKind { None, RandAugment, TrivialAugmentWide };

/// An _augmentation_space: per op its magnitudes (float32, as torchvision's tensors; empty for the ops
/// whose magnitude is the scalar 0) and whether a draw flips the sign.
struct AugmentSpace {
  std::array<std::vector<float>, kAugmentOps> magnitudes;
  std::array<bool, kAugmentOps> is_signed{};
};

/// torch.linspace(start, end, steps) in float32. Pass LibTorch's own (data/samples/loader.h's
/// cached_augment_space does) for tables equal to torchvision's bit for bit: torch's CPU kernel
/// computes some entries with vector arithmetic whose rounding differs between versions by one unit in
/// the last place. linspace_f32 is its scalar formula.
using Linspace = std::function<std::vector<float>(double start, double end, int64_t steps)>;
std::vector<float> linspace_f32(double start, double end, int64_t steps);

/// RandAugment's (height and width size its translations) or TrivialAugmentWide's table with `bins`
/// magnitude bins (>= 2).
AugmentSpace augmentation_space(AutoAugmentKind kind, int64_t bins, int64_t height, int64_t width,
                                const Linspace& linspace = linspace_f32);

struct AutoAugmentOptions {
  AutoAugmentKind kind = AutoAugmentKind::None;
  int64_t num_ops = 2;    ///< RandAugment: ops applied in turn (drawn with replacement)
  int64_t magnitude = 9;  ///< RandAugment: the bin of every op's magnitude, in [0, bins)
  int64_t bins = 31;      ///< num_magnitude_bins
};
/// Checks num_ops in [0, 64], bins in [2, 1024], magnitude in [0, bins); throws std::invalid_argument.
void check_auto_augment(const AutoAugmentOptions& o);

/// One drawn operation and its signed magnitude.
struct AugmentDraw {
  AugmentOp op = AugmentOp::Identity;
  double magnitude = 0;
};

/// The operations sample `index` of epoch `epoch` gets, from (seed, epoch, index) alone, drawn as
/// torchvision draws them: RandAugment num_ops times {op uniform over the 14; magnitude = the table's
/// entry `magnitude`; for a signed op, negated with probability 1/2}; TrivialAugmentWide once {op; a bin
/// uniform over the op's table; the sign}. None: no draw.
std::vector<AugmentDraw> draw_auto_augment(const AutoAugmentOptions& o, const AugmentSpace& space, uint64_t seed,
                                           int64_t epoch, int64_t index);

/// draw_auto_augment, then each op in turn on `img`.
void auto_augment(ImageU8 img, const AutoAugmentOptions& o, const AugmentSpace& space, uint64_t seed, int64_t epoch,
                  int64_t index);

// ---- random erasing -------------------------------------------------------------------------------------

/// A rectangle of an image: rows [top, top + height), columns [left, left + width). Empty: no erasing.
struct EraseBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
  bool empty() const { return height <= 0 || width <= 0; }
};

struct EraseOptions {
  double p = 0;  ///< probability that a sample is erased at all
  double scale_lo = 0.02, scale_hi = 0.33;  ///< erased area / image area
  double ratio_lo = 0.3, ratio_hi = 3.3;    ///< aspect ratio range (log-uniform)
};

/// torchvision's RandomErasing box for an image of height x width, from (seed, epoch, index): with
/// probability p, up to 10 tries of area = U(scale) * H * W, r = exp(U(log ratio)), h = round(sqrt(area *
/// r)), w = round(sqrt(area / r)) (half to even, as Python), accepted if h < H and w < W, then
/// top = randint(0, H - h), left = randint(0, W - w) (ends included); no accepted try: empty (torchvision
/// returns the image unchanged).
EraseBox draw_erase_box(const EraseOptions& o, int64_t height, int64_t width, uint64_t seed, int64_t epoch,
                        int64_t index);

/// Sets the box of every channel of a float (C, H, W) image to `value` (RandomErasing's value=0).
void erase_chw(float* image, int64_t channels, int64_t height, int64_t width, const EraseBox& box, float value = 0);

}  // namespace data
