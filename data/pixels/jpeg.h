// Decoding of JPEG and PNG images from bytes in memory, straight to the pixels one sample needs: the crop
// box of a transform (data/pixels/transforms.h) resized to the network's input, RGB, uint8, (H, W, C).
//
// JPEG goes through libjpeg-turbo's libjpeg API and decodes only what the crop needs:
//   - DCT-domain downscaling (scale 1/2, 1/4, 1/8) when the crop is at least that many times larger than
//     the output in both directions;
//   - of the (scaled) image, only the rows and columns the resize filter reads (jpeg_skip_scanlines,
//     jpeg_crop_scanline).
// PNG goes through libpng's simplified API and is decoded whole.
//
// The resize is an antialiasing triangle (bilinear) filter whose support widens with the reduction,
// computed like Pillow's Image.resize(..., BILINEAR) (the filter torchvision applies to PIL images):
// a horizontal pass into 8-bit rows, then a vertical pass, both with 22-bit fixed-point weights
// (data/pixels/resize.h, where an AVX2 kernel computes the same bytes as the plain one). A box
// with fractional coordinates is resized as if the whole image were resized so that the box maps onto
// the output; the filter reads pixels around the box where the image has them.
//
// Every function here refuses bad input with DecodeError, and never allocates for pixels before it has
// checked the header's width * height against DecodeLimits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace data {

/// What a decoder may allocate for one image.
struct DecodeLimits {
  /// Largest width * height accepted; a header that claims more is refused before any pixel buffer is
  /// allocated. 100 M pixels is 300 MB of RGB (and up to 600 MB of DCT coefficients for a progressive
  /// JPEG, which libjpeg keeps whole).
  int64_t max_pixels = 100'000'000;
};

/// An image that cannot be decoded. The message is one line naming the problem ("truncated JPEG data",
/// "not a JPEG or PNG image", "image too large: ..."); callers add the file name.
class DecodeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What an image's header says.
struct ImageHeader {
  int width = 0, height = 0;
  /// Channels as stored: 1 (grayscale), 3 (RGB / YCbCr), 4 (CMYK / YCCK, or PNG with alpha), 2 (PNG
  /// gray + alpha). Every decoder here outputs RGB whatever this is.
  int channels = 0;
  enum Format { Jpeg, Png } format = Jpeg;
};

/// Reads the header of a JPEG or PNG image. The format comes from the magic bytes, not from a file name
/// (a PNG named .jpg is read as PNG). Throws DecodeError for an empty buffer, anything that is neither,
/// a damaged header, a zero size, or width * height > limits.max_pixels.
ImageHeader read_header(const uint8_t* bytes, size_t size, const DecodeLimits& limits = {});

/// A crop box in source pixel coordinates: the pixel (col, row) covers [col, col + 1) x [row, row + 1);
/// x, y is the top-left corner, w, h the size (> 0). Floating point, so the eval transform's box (a
/// resize of the whole image followed by a crop) is exact.
struct CropBox {
  double x = 0, y = 0, w = 0, h = 0;
};

/// Decodes `bytes` and writes the part under `box`, resized to out_w x out_h (> 0) and mirrored left to
/// right if `hflip`, to `out_hwc_rgb` (out_h * out_w * 3 bytes, row-major, RGB). Grayscale is expanded
/// to RGB; CMYK and YCCK JPEGs are converted with the Adobe convention libjpeg reports (inverted CMYK:
/// R = C * K / 255, ...); a PNG's alpha is dropped. A box reaching outside the image is clipped to it
/// (a box with no area inside the image is a DecodeError). Throws DecodeError for any bad input (see
/// read_header; truncated or corrupt data). A JPEG whose data stops after the rows the crop needs is
/// decoded, since those rows are intact.
void decode_crop_resize(const uint8_t* bytes, size_t size, const CropBox& box, int out_w, int out_h, bool hflip,
                        uint8_t* out_hwc_rgb, const DecodeLimits& limits = {});

/// Decodes the whole image to RGB, (H, W, 3) row-major; `header_out`, when not null, receives its
/// header. Throws DecodeError like decode_crop_resize.
std::vector<uint8_t> decode_rgb(const uint8_t* bytes, size_t size, const DecodeLimits& limits = {},
                                ImageHeader* header_out = nullptr);

/// The resize filter of decode_crop_resize applied to decoded pixels: `rgb_hwc` is width x height RGB;
/// returns out_h * out_w * 3 bytes. decode_crop_resize without DCT scaling gives exactly this on
/// decode_rgb's output.
std::vector<uint8_t> resize_rgb(const uint8_t* rgb_hwc, int width, int height, const CropBox& box, int out_w,
                                int out_h, bool hflip = false);

/// Encodes (H, W, components) pixels as a JPEG. components: 3 = RGB (stored as YCbCr with the chroma
/// subsampling `chroma`: 420, 422 or 444), 1 = grayscale, 4 = CMYK given as ink amounts and written the
/// Adobe way (inverted, with an Adobe marker, as Photoshop does; decode_rgb reads it back to RGB).
/// quality in [1, 100]; `progressive` writes a progressive JPEG instead of a baseline one. Throws
/// std::invalid_argument for bad arguments.
std::vector<uint8_t> encode_jpeg(const uint8_t* pixels, int width, int height, int quality, int components = 3,
                                 int chroma = 420, bool progressive = false);

/// Encodes (H, W, channels) pixels as an 8-bit PNG; channels: 1 gray, 2 gray + alpha, 3 RGB, 4 RGBA.
std::vector<uint8_t> encode_png(const uint8_t* pixels, int width, int height, int channels);

}  // namespace data
