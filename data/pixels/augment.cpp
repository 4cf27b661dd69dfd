#include "data/pixels/augment.h"

#include "data/pixels/rng.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace data {
namespace {

constexpr uint64_t kAutoAugmentTag = 0x6175746f617567ULL;  // "autoaug"
constexpr uint64_t kEraseTag = 0x6572617365ULL;            // "erase"
// CPython's math.radians / math.degrees factors (Modules/mathmodule.c), so the matrices match to the bit.
constexpr double kDegToRad = 3.14159265358979323846 / 180.0;
constexpr double kRadToDeg = 180.0 / 3.14159265358979323846;

SplitMix64 sample_rng(uint64_t tag, uint64_t seed, int64_t epoch, int64_t index) {
  return SplitMix64(hash_key(hash_key(seed, tag, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(index)));
}

double aug_uniform(SplitMix64& rng, double lo, double hi) {
  return lo + (hi - lo) * (static_cast<double>(rng.next() >> 11) * 0x1.0p-53);
}

// torch's .to(uint8) of a float32 in [0, 255] after clamp(0, 255): truncation toward zero.
uint8_t to_u8(float v) { return static_cast<uint8_t>(std::min(std::max(v, 0.0f), 255.0f)); }

// torchvision's _blend(img1, img2, ratio) for one value: ratio * x + (1 - ratio) * y, each product and the
// sum rounded to float32 (ratio and 1 - ratio are Python floats, cast to float32 by torch's kernels).
struct Blend {
  float r, q;
  explicit Blend(double ratio) : r(static_cast<float>(ratio)), q(static_cast<float>(1.0 - ratio)) {}
  uint8_t operator()(float x, float y) const {
    const float a = r * x;
    const float b = q * y;
    return to_u8(a + b);
  }
};

// rgb_to_grayscale of a uint8 pixel: (0.2989 r + 0.587 g + 0.114 b) in float32, left to right, truncated.
uint8_t gray_of(const ImageU8& img, int64_t y, int64_t x) {
  const float r = 0.2989f * static_cast<float>(img.at(0, y, x));
  const float g = 0.587f * static_cast<float>(img.at(1, y, x));
  const float b = 0.114f * static_cast<float>(img.at(2, y, x));
  const float s = r + g;
  return static_cast<uint8_t>(s + b);
}

// _get_inverse_affine_matrix(center, angle, translate, scale=1, shear), inverted, in Python's double
// operations and order.
std::array<double, 6> inverse_affine(double cx, double cy, double angle, double tx, double ty, double shear_x_deg,
                                     double shear_y_deg) {
  const double rot = angle * kDegToRad, sx = shear_x_deg * kDegToRad, sy = shear_y_deg * kDegToRad;
  const double a = std::cos(rot - sy) / std::cos(sy);
  const double b = -std::cos(rot - sy) * std::tan(sx) / std::cos(sy) - std::sin(rot);
  const double c = std::sin(rot - sy) / std::cos(sy);
  const double d = -std::sin(rot - sy) * std::tan(sx) / std::cos(sy) + std::cos(rot);
  std::array<double, 6> m = {d, -b, 0.0, -c, a, 0.0};
  m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
  m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
  m[2] += cx;
  m[5] += cy;
  return m;
}

// F_t.affine / F_t.rotate with NEAREST: torchvision's _gen_affine_grid in float32 (theta^T divided by
// (W/2, H/2), the base grid x - (W-1)/2 and y - (H-1)/2, which are exact), then grid_sample's
// unnormalization ((g + 1) * size/2 - 0.5, align_corners=False) and round half to even. Outside: 0.
void affine_nearest(ImageU8 img, const std::array<double, 6>& m) {
  const int64_t C = img.channels, H = img.height, W = img.width;
  thread_local std::vector<uint8_t> src_buf;
  src_buf.assign(img.data, img.data + img.bytes());
  ImageU8 src = img;
  src.data = src_buf.data();
  const float hw = static_cast<float>(0.5 * static_cast<double>(W)), hh = static_cast<float>(0.5 * static_cast<double>(H));
  const float r00 = static_cast<float>(m[0]) / hw, r10 = static_cast<float>(m[1]) / hw, r20 = static_cast<float>(m[2]) / hw;
  const float r01 = static_cast<float>(m[3]) / hh, r11 = static_cast<float>(m[4]) / hh, r21 = static_cast<float>(m[5]) / hh;
  const float sw = static_cast<float>(W) / 2, sh = static_cast<float>(H) / 2;
  for (int64_t y = 0; y < H; ++y) {
    const float by = static_cast<float>(static_cast<double>(y) - 0.5 * static_cast<double>(H - 1));
    for (int64_t x = 0; x < W; ++x) {
      const float bx = static_cast<float>(static_cast<double>(x) - 0.5 * static_cast<double>(W - 1));
      const float px = bx * r00, qx = by * r10, py = bx * r01, qy = by * r11;
      const float gx = (px + qx) + r20, gy = (py + qy) + r21;
      const float ix = std::nearbyint((gx + 1.0f) * sw - 0.5f), iy = std::nearbyint((gy + 1.0f) * sh - 0.5f);
      const bool inside = ix > -1.0f && ix < static_cast<float>(W) && iy > -1.0f && iy < static_cast<float>(H);
      for (int64_t c = 0; c < C; ++c)
        img.at(c, y, x) = inside ? src.at(c, static_cast<int64_t>(iy), static_cast<int64_t>(ix)) : uint8_t{0};
    }
  }
}

void shear(ImageU8 img, double magnitude, bool along_x) {
  const double deg = std::atan(magnitude) * kRadToDeg;  // math.degrees(math.atan(magnitude))
  // center=[0, 0] in pixel coordinates: (0 - W/2, 0 - H/2) relative to the image centre.
  const double cx = 0.0 - static_cast<double>(img.width) * 0.5, cy = 0.0 - static_cast<double>(img.height) * 0.5;
  affine_nearest(img, inverse_affine(cx, cy, 0.0, 0.0, 0.0, along_x ? deg : 0.0, along_x ? 0.0 : deg));
}

// The per-channel float32 blend of the image with `other(c, y, x)`.
template <class Other>
void blend_with(ImageU8 img, double ratio, Other other) {
  const Blend blend(ratio);
  for (int64_t c = 0; c < img.channels; ++c)
    for (int64_t y = 0; y < img.height; ++y)
      for (int64_t x = 0; x < img.width; ++x) {
        uint8_t& v = img.at(c, y, x);
        v = blend(static_cast<float>(v), other(c, y, x));
      }
}

}  // namespace

const char* augment_op_name(AugmentOp op) {
  static const char* const names[kAugmentOps] = {"Identity",   "ShearX",   "ShearY",       "TranslateX", "TranslateY",
                                                 "Rotate",     "Brightness", "Color",      "Contrast",   "Sharpness",
                                                 "Posterize",  "Solarize", "AutoContrast", "Equalize"};
  return names[static_cast<int>(op)];
}

void shear_x(ImageU8 img, double magnitude) { shear(img, magnitude, true); }
void shear_y(ImageU8 img, double magnitude) { shear(img, magnitude, false); }

void translate_x(ImageU8 img, double magnitude) {
  affine_nearest(img, inverse_affine(0.0, 0.0, 0.0, static_cast<double>(static_cast<int64_t>(magnitude)), 0.0, 0.0, 0.0));
}

void translate_y(ImageU8 img, double magnitude) {
  affine_nearest(img, inverse_affine(0.0, 0.0, 0.0, 0.0, static_cast<double>(static_cast<int64_t>(magnitude)), 0.0, 0.0));
}

void rotate(ImageU8 img, double degrees) {
  // F.rotate passes -angle: affine's angle is clockwise, rotate's counter-clockwise.
  affine_nearest(img, inverse_affine(0.0, 0.0, -degrees, 0.0, 0.0, 0.0, 0.0));
}

void brightness(ImageU8 img, double magnitude) {
  blend_with(img, 1.0 + magnitude, [](int64_t, int64_t, int64_t) { return 0.0f; });
}

void color(ImageU8 img, double magnitude) {
  if (img.channels != 3) return;  // torchvision: "Match PIL behaviour"
  thread_local std::vector<uint8_t> gray;
  gray.resize(static_cast<size_t>(img.height * img.width));
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) gray[y * img.width + x] = gray_of(img, y, x);
  const int64_t W = img.width;
  blend_with(img, 1.0 + magnitude, [&](int64_t, int64_t y, int64_t x) { return static_cast<float>(gray[y * W + x]); });
}

void contrast(ImageU8 img, double magnitude) {
  // torch.mean of the (grayscale) image in float32: the sum of integers is exact below 2^24, then one
  // float32 division by the count.
  int64_t sum = 0;
  for (int64_t y = 0; y < img.height; ++y)
    for (int64_t x = 0; x < img.width; ++x) {
      if (img.channels == 3) sum += gray_of(img, y, x);
      else
        for (int64_t c = 0; c < img.channels; ++c) sum += img.at(c, y, x);
    }
  const int64_t count = img.height * img.width * (img.channels == 3 ? 1 : img.channels);
  const float mean = static_cast<float>(sum) / static_cast<float>(count);
  blend_with(img, 1.0 + magnitude, [mean](int64_t, int64_t, int64_t) { return mean; });
}

void sharpness(ImageU8 img, double magnitude) {
  const int64_t C = img.channels, H = img.height, W = img.width;
  if (H <= 2 || W <= 2) return;
  thread_local std::vector<uint8_t> blurred;
  blurred.assign(img.data, img.data + img.bytes());
  ImageU8 out = img;
  out.data = blurred.data();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t y = 1; y < H - 1; ++y)
      for (int64_t x = 1; x < W - 1; ++x) {
        int64_t s = 4 * img.at(c, y, x);  // the centre counts 5 times: 4 here, once in the loop
        for (int64_t dy = -1; dy <= 1; ++dy)
          for (int64_t dx = -1; dx <= 1; ++dx) s += img.at(c, y + dy, x + dx);
        // round(s / 13): s / 13 is never a half, so float32's conv2d rounds the same way as this.
        out.at(c, y, x) = static_cast<uint8_t>((2 * s + 13) / 26);
      }
  blend_with(img, 1.0 + magnitude, [&](int64_t c, int64_t y, int64_t x) { return static_cast<float>(out.at(c, y, x)); });
}

void posterize(ImageU8 img, double magnitude) {
  const int64_t bits = static_cast<int64_t>(magnitude);
  if (bits < 0 || bits > 8) throw std::invalid_argument("posterize: bits must be in [0, 8], got " + std::to_string(bits));
  const uint8_t mask = static_cast<uint8_t>((0xFF << (8 - bits)) & 0xFF);
  for (int64_t i = 0; i < img.bytes(); ++i) img.data[i] &= mask;
}

void solarize(ImageU8 img, double threshold) {
  const float t = static_cast<float>(threshold);  // img >= threshold compares in float32
  for (int64_t i = 0; i < img.bytes(); ++i)
    if (static_cast<float>(img.data[i]) >= t) img.data[i] = static_cast<uint8_t>(255 - img.data[i]);
}

void autocontrast(ImageU8 img) {
  for (int64_t c = 0; c < img.channels; ++c) {
    uint8_t lo = 255, hi = 0;
    for (int64_t y = 0; y < img.height; ++y)
      for (int64_t x = 0; x < img.width; ++x) lo = std::min(lo, img.at(c, y, x)), hi = std::max(hi, img.at(c, y, x));
    if (lo == hi) continue;  // scale is inf: minimum 0, scale 1, the channel as it is
    // bound / (max - min) is Tensor.__rtruediv__: reciprocal, then the product.
    const float mn = static_cast<float>(lo), inv = 1.0f / (static_cast<float>(hi) - mn), scale = inv * 255.0f;
    for (int64_t y = 0; y < img.height; ++y)
      for (int64_t x = 0; x < img.width; ++x) {
        uint8_t& v = img.at(c, y, x);
        v = to_u8((static_cast<float>(v) - mn) * scale);
      }
  }
}

void equalize(ImageU8 img) {
  for (int64_t c = 0; c < img.channels; ++c) {
    std::array<int64_t, 256> hist{};
    for (int64_t y = 0; y < img.height; ++y)
      for (int64_t x = 0; x < img.width; ++x) ++hist[img.at(c, y, x)];
    // step = (sum of the non-zero bins but the last one) // 255
    int last = 255;
    while (last > 0 && hist[last] == 0) --last;
    int64_t total = 0;
    for (int v = 0; v < 256; ++v) total += hist[v];
    const int64_t step = (total - hist[last]) / 255;
    if (step == 0) continue;
    std::array<uint8_t, 256> lut{};
    int64_t cum = 0;
    for (int v = 0; v < 255; ++v) {  // lut = pad(cumsum + step // 2) // step, [1, 0])[:-1].clamp(0, 255)
      cum += hist[v];
      lut[v + 1] = static_cast<uint8_t>(std::min<int64_t>((cum + step / 2) / step, 255));
    }
    for (int64_t y = 0; y < img.height; ++y)
      for (int64_t x = 0; x < img.width; ++x) img.at(c, y, x) = lut[img.at(c, y, x)];
  }
}

void apply_augment_op(ImageU8 img, AugmentOp op, double m) {
  switch (op) {
    case AugmentOp::Identity: return;
    case AugmentOp::ShearX: return shear_x(img, m);
    case AugmentOp::ShearY: return shear_y(img, m);
    case AugmentOp::TranslateX: return translate_x(img, m);
    case AugmentOp::TranslateY: return translate_y(img, m);
    case AugmentOp::Rotate: return rotate(img, m);
    case AugmentOp::Brightness: return brightness(img, m);
    case AugmentOp::Color: return color(img, m);
    case AugmentOp::Contrast: return contrast(img, m);
    case AugmentOp::Sharpness: return sharpness(img, m);
    case AugmentOp::Posterize: return posterize(img, m);
    case AugmentOp::Solarize: return solarize(img, m);
    case AugmentOp::AutoContrast: return autocontrast(img);
    case AugmentOp::Equalize: return equalize(img);
  }
}

std::vector<float> linspace_f32(double start, double end, int64_t steps) {
  // ATen's scalar formula: from the start for the first half, from the end for the second.
  const float s = static_cast<float>(start), e = static_cast<float>(end);
  const float step = (e - s) / static_cast<float>(steps - 1);
  std::vector<float> v(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i)
    v[i] = i < steps / 2 ? s + step * static_cast<float>(i) : e - step * static_cast<float>(steps - i - 1);
  return v;
}

AugmentSpace augmentation_space(AutoAugmentKind kind, int64_t bins, int64_t height, int64_t width,
                                const Linspace& linspace) {
  AugmentSpace s;
  if (kind == AutoAugmentKind::None) return s;
  if (bins < 2) throw std::invalid_argument("augmentation_space: needs at least 2 magnitude bins");
  const bool ra = kind == AutoAugmentKind::RandAugment;
  auto set = [&](AugmentOp op, std::vector<float> v, bool is_signed) {
    s.magnitudes[static_cast<int>(op)] = std::move(v);
    s.is_signed[static_cast<int>(op)] = is_signed;
  };
  const double shear_max = ra ? 0.3 : 0.99, color_max = ra ? 0.9 : 0.99;
  set(AugmentOp::ShearX, linspace(0.0, shear_max, bins), true);
  set(AugmentOp::ShearY, linspace(0.0, shear_max, bins), true);
  set(AugmentOp::TranslateX, linspace(0.0, ra ? 150.0 / 331.0 * static_cast<double>(width) : 32.0, bins), true);
  set(AugmentOp::TranslateY, linspace(0.0, ra ? 150.0 / 331.0 * static_cast<double>(height) : 32.0, bins), true);
  set(AugmentOp::Rotate, linspace(0.0, ra ? 30.0 : 135.0, bins), true);
  for (AugmentOp op : {AugmentOp::Brightness, AugmentOp::Color, AugmentOp::Contrast, AugmentOp::Sharpness})
    set(op, linspace(0.0, color_max, bins), true);
  // 8 - (arange(bins) / ((bins - 1) / k)).round().int(): float32 division, round half to even.
  std::vector<float> bits(static_cast<size_t>(bins));
  const float div = static_cast<float>(static_cast<double>(bins - 1) / (ra ? 4.0 : 6.0));
  for (int64_t i = 0; i < bins; ++i) bits[i] = 8.0f - std::nearbyint(static_cast<float>(i) / div);
  set(AugmentOp::Posterize, bits, false);
  set(AugmentOp::Solarize, linspace(255.0, 0.0, bins), false);
  return s;
}

void check_auto_augment(const AutoAugmentOptions& o) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("auto augment: " + what); };
  if (o.num_ops < 0 || o.num_ops > 64) bad("num_ops must be in [0, 64], got " + std::to_string(o.num_ops));
  if (o.bins < 2 || o.bins > 1024) bad("bins must be in [2, 1024], got " + std::to_string(o.bins));
  if (o.magnitude < 0 || o.magnitude >= o.bins)
    bad("magnitude must be in [0, " + std::to_string(o.bins - 1) + "], got " + std::to_string(o.magnitude));
}

std::vector<AugmentDraw> draw_auto_augment(const AutoAugmentOptions& o, const AugmentSpace& space, uint64_t seed,
                                           int64_t epoch, int64_t index) {
  std::vector<AugmentDraw> draws;
  if (o.kind == AutoAugmentKind::None) return draws;
  SplitMix64 rng = sample_rng(kAutoAugmentTag, seed, epoch, index);
  const bool ra = o.kind == AutoAugmentKind::RandAugment;
  for (int64_t k = 0; k < (ra ? o.num_ops : 1); ++k) {
    AugmentDraw d;
    d.op = static_cast<AugmentOp>(rng.below(kAugmentOps));
    const auto& table = space.magnitudes[static_cast<int>(d.op)];
    if (!table.empty()) {
      const size_t bin = ra ? static_cast<size_t>(o.magnitude) : static_cast<size_t>(rng.below(table.size()));
      d.magnitude = static_cast<double>(table.at(bin));
      if (space.is_signed[static_cast<int>(d.op)] && (rng.next() >> 63) != 0) d.magnitude *= -1.0;
    }
    draws.push_back(d);
  }
  return draws;
}

void auto_augment(ImageU8 img, const AutoAugmentOptions& o, const AugmentSpace& space, uint64_t seed, int64_t epoch,
                  int64_t index) {
  for (const AugmentDraw& d : draw_auto_augment(o, space, seed, epoch, index)) apply_augment_op(img, d.op, d.magnitude);
}

EraseBox draw_erase_box(const EraseOptions& o, int64_t height, int64_t width, uint64_t seed, int64_t epoch,
                        int64_t index) {
  if (!(o.p > 0) || height < 1 || width < 1) return {};
  SplitMix64 rng = sample_rng(kEraseTag, seed, epoch, index);
  if (!(aug_uniform(rng, 0.0, 1.0) < o.p)) return {};
  const double area = static_cast<double>(height) * static_cast<double>(width);
  const double log_lo = std::log(o.ratio_lo), log_hi = std::log(o.ratio_hi);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double erase_area = area * aug_uniform(rng, o.scale_lo, o.scale_hi);
    const double aspect = std::exp(aug_uniform(rng, log_lo, log_hi));
    const auto h = static_cast<int64_t>(std::nearbyint(std::sqrt(erase_area * aspect)));
    const auto w = static_cast<int64_t>(std::nearbyint(std::sqrt(erase_area / aspect)));
    if (!(h < height && w < width)) continue;
    EraseBox b;
    b.height = h;
    b.width = w;
    b.top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(height - h + 1)));
    b.left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(width - w + 1)));
    return b;
  }
  return {};
}

void erase_chw(float* image, int64_t channels, int64_t height, int64_t width, const EraseBox& box, float value) {
  if (box.empty()) return;
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t y = box.top; y < box.top + box.height && y < height; ++y) {
      float* row = image + (c * height + y) * width;
      std::fill(row + box.left, row + std::min(width, box.left + box.width), value);
    }
}

}  // namespace data
