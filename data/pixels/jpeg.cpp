#include "data/pixels/jpeg.h"

#include "data/pixels/resize.h"

#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

namespace data {
namespace {

bool is_jpeg(const uint8_t* b, size_t n) { return n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF; }
bool is_png(const uint8_t* b, size_t n) {
  static const uint8_t magic[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  return n >= 8 && std::memcmp(b, magic, 8) == 0;
}

void check_size(int64_t width, int64_t height, const DecodeLimits& limits) {
  if (width <= 0 || height <= 0)
    throw DecodeError("image has no pixels (" + std::to_string(width) + "x" + std::to_string(height) + ")");
  if (width * height > limits.max_pixels)
    throw DecodeError("image too large: " + std::to_string(width) + "x" + std::to_string(height) + " is over the " +
                      "limit of " + std::to_string(limits.max_pixels) + " pixels");
}

[[noreturn]] void not_an_image(const uint8_t* b, size_t n) {
  if (n == 0) throw DecodeError("empty file (0 bytes), not an image");
  char hex[40] = {0};
  size_t pos = 0;
  for (size_t i = 0; i < std::min<size_t>(n, 4); ++i) pos += std::snprintf(hex + pos, sizeof hex - pos, "%s%02x", i ? " " : "", b[i]);
  throw DecodeError(std::string("not a JPEG or PNG image (starts with bytes ") + hex + ")");
}

/// The box clipped to a width x height image; a box with no area inside is a DecodeError.
CropBox clip_box(const CropBox& b, double width, double height) {
  if (!(b.w > 0 && b.h > 0) || !std::isfinite(b.x) || !std::isfinite(b.y) || !std::isfinite(b.w) || !std::isfinite(b.h))
    throw DecodeError("crop box has no area");
  const double x0 = std::max(b.x, 0.0), y0 = std::max(b.y, 0.0);
  const double x1 = std::min(b.x + b.w, width), y1 = std::min(b.y + b.h, height);
  if (!(x1 > x0 && y1 > y0)) throw DecodeError("crop box lies outside the image");
  return {x0, y0, x1 - x0, y1 - y0};
}

void check_out(int out_w, int out_h) {
  if (out_w <= 0 || out_h <= 0 || static_cast<int64_t>(out_w) * out_h > (int64_t{1} << 28))
    throw DecodeError("bad output size " + std::to_string(out_w) + "x" + std::to_string(out_h));
}

// ---- JPEG -------------------------------------------------------------------------------------------------

/// libjpeg reports errors through error_exit, which must not return: it longjmps back to the setjmp
/// in the function that called libjpeg. Every C++ object of that function is declared before the
/// setjmp, so the jump skips no destructor.
struct JpegError {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {0};
};

void on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// A premature end of data is an error (libjpeg only warns and fills the rest with gray); other warnings
// (extraneous bytes before a marker, ...) are common in real photo collections and decode fine.
void on_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    auto* err = reinterpret_cast<JpegError*>(cinfo->err);
    std::snprintf(err->message, sizeof err->message, "truncated JPEG data");
    std::longjmp(err->jump, 1);
  }
}

// A progressive JPEG may carry thousands of tiny scans that each pass over the whole image (a known way
// to make a small file take minutes to decode). 500 scans is TurboJPEG's own limit.
constexpr int kMaxScans = 500;
void on_progress(j_common_ptr cinfo) {
  auto* d = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (cinfo->is_decompressor && d->input_scan_number > kMaxScans) {
    auto* err = reinterpret_cast<JpegError*>(cinfo->err);
    std::snprintf(err->message, sizeof err->message, "JPEG has more than %d progressive scans", kMaxScans);
    std::longjmp(err->jump, 1);
  }
}

struct JpegDecoder {
  jpeg_decompress_struct cinfo;
  JpegError err;
  jpeg_progress_mgr progress;
  bool created = false;
  ~JpegDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
  /// Sets up the decompressor on `bytes`; call right after setjmp(err.jump).
  void start(const uint8_t* bytes, size_t size, const DecodeLimits& limits) {
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    jpeg_create_decompress(&cinfo);
    created = true;
    progress.progress_monitor = on_progress;
    cinfo.progress = &progress;
    // libjpeg's own allocations (progressive coefficient buffers: 2 bytes a sample) stay under what the
    // pixel limit allows; past it libjpeg fails with "Backing store not supported".
    const double cap = static_cast<double>(limits.max_pixels) * 4 * 2 + (64 << 20);
    cinfo.mem->max_memory_to_use = static_cast<long>(std::min(cap, 0.25 * static_cast<double>(std::numeric_limits<long>::max())));
    jpeg_mem_src(&cinfo, bytes, static_cast<unsigned long>(size));
    jpeg_read_header(&cinfo, TRUE);
  }
};

ImageHeader jpeg_header(const jpeg_decompress_struct& cinfo) {
  ImageHeader h;
  h.width = static_cast<int>(cinfo.image_width);
  h.height = static_cast<int>(cinfo.image_height);
  h.channels = cinfo.num_components;
  h.format = ImageHeader::Jpeg;
  return h;
}

/// Sets the output color space: RGB from gray/YCbCr/RGB, CMYK from CMYK/YCCK (converted after).
bool set_color(jpeg_decompress_struct& cinfo) {
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    cinfo.out_color_space = JCS_CMYK;
    return true;
  }
  cinfo.out_color_space = JCS_RGB;
  return false;
}

/// Adobe's inverted CMYK, as libjpeg returns it, to RGB in place (4 bytes in, 3 out, same buffer).
void cmyk_to_rgb(uint8_t* row, int n) {
  for (int i = 0; i < n; ++i) {
    const int c = row[4 * i], m = row[4 * i + 1], y = row[4 * i + 2], k = row[4 * i + 3];
    row[3 * i] = static_cast<uint8_t>((c * k + 127) / 255);
    row[3 * i + 1] = static_cast<uint8_t>((m * k + 127) / 255);
    row[3 * i + 2] = static_cast<uint8_t>((y * k + 127) / 255);
  }
}

/// DCT scale denominator (1, 2, 4, 8) for a crop of crop_w x crop_h source pixels resized to out_w x out_h:
/// the largest whose reduced crop is still at least the output's size in both directions.
int dct_denominator(double crop_w, double crop_h, int out_w, int out_h) {
  for (int d : {8, 4, 2})
    if (crop_w >= static_cast<double>(d) * out_w && crop_h >= static_cast<double>(d) * out_h) return d;
  return 1;
}

void jpeg_crop_resize(const uint8_t* bytes, size_t size, const CropBox& box_in, int out_w, int out_h, bool hflip,
                      uint8_t* out, const DecodeLimits& limits) {
  JpegDecoder dec;
  std::vector<uint8_t> region;
  std::vector<JSAMPROW> rows;
  ResizeCoeffs cx, cy;
  if (setjmp(dec.err.jump)) throw DecodeError(dec.err.message);
  dec.start(bytes, size, limits);
  check_size(dec.cinfo.image_width, dec.cinfo.image_height, limits);
  const bool cmyk = set_color(dec.cinfo);
  const CropBox box = clip_box(box_in, dec.cinfo.image_width, dec.cinfo.image_height);
  const int denom = dct_denominator(box.w, box.h, out_w, out_h);
  dec.cinfo.scale_num = 1;
  dec.cinfo.scale_denom = static_cast<unsigned>(denom);
  jpeg_start_decompress(&dec.cinfo);
  const int sw = static_cast<int>(dec.cinfo.output_width), sh = static_cast<int>(dec.cinfo.output_height);
  // The scaled image's pixel k covers source pixels [k * denom, (k + 1) * denom).
  cx = bilinear_coeffs(sw, box.x / denom, std::min((box.x + box.w) / denom, static_cast<double>(sw)), out_w);
  cy = bilinear_coeffs(sh, box.y / denom, std::min((box.y + box.h) / denom, static_cast<double>(sh)), out_h);
  int x0 = sw, x1 = 0, y0 = sh, y1 = 0;
  for (int i = 0; i < out_w; ++i) {
    x0 = std::min(x0, cx.first[i]);
    x1 = std::max(x1, cx.first[i] + cx.count[i]);
  }
  for (int i = 0; i < out_h; ++i) {
    y0 = std::min(y0, cy.first[i]);
    y1 = std::max(y1, cy.first[i] + cy.count[i]);
  }
  if (x1 <= x0 || y1 <= y0) throw DecodeError("crop box lies outside the image");
  // Columns: jpeg_crop_scanline widens the range to whole iMCU columns and reports what it decodes. Its
  // last column or two differ from a full decode (fancy chroma upsampling sees the crop's edge as the
  // image's edge), so the range asks for kColumnMargin more columns on each side than the filter reads;
  // then the pixels used equal a full decode's (tests/test_jpeg.cpp checks it for 4:2:0, 4:2:2, 4:4:4).
  constexpr int kColumnMargin = 4;
  const int mx0 = std::max(0, x0 - kColumnMargin), mx1 = std::min(sw, x1 + kColumnMargin);
  JDIMENSION col0 = static_cast<JDIMENSION>(mx0), cols = static_cast<JDIMENSION>(mx1 - mx0);
  if (cols < static_cast<JDIMENSION>(sw)) jpeg_crop_scanline(&dec.cinfo, &col0, &cols);
  const int comps = dec.cinfo.output_components;
  const size_t stride = static_cast<size_t>(cols) * comps;
  region.resize(stride * static_cast<size_t>(y1 - y0));
  if (y0 > 0 && jpeg_skip_scanlines(&dec.cinfo, static_cast<JDIMENSION>(y0)) != static_cast<JDIMENSION>(y0))
    throw DecodeError("truncated JPEG data");
  rows.resize(static_cast<size_t>(y1 - y0));
  for (int r = 0; r < y1 - y0; ++r) rows[r] = region.data() + static_cast<size_t>(r) * stride;
  while (static_cast<int>(dec.cinfo.output_scanline) < y1) {
    const int r = static_cast<int>(dec.cinfo.output_scanline) - y0;
    if (jpeg_read_scanlines(&dec.cinfo, &rows[r], static_cast<JDIMENSION>(y1 - y0 - r)) == 0)
      throw DecodeError("truncated JPEG data");
  }
  jpeg_abort_decompress(&dec.cinfo);
  if (cmyk)
    for (int r = 0; r < y1 - y0; ++r) cmyk_to_rgb(rows[r], static_cast<int>(cols));
  resample(region.data(), stride, region.data() + region.size(), static_cast<int>(col0), y0, cx, cy, out_w, out_h, hflip,
           out);
}

std::vector<uint8_t> jpeg_decode_rgb(const uint8_t* bytes, size_t size, const DecodeLimits& limits, ImageHeader* header) {
  JpegDecoder dec;
  std::vector<uint8_t> pixels;
  if (setjmp(dec.err.jump)) throw DecodeError(dec.err.message);
  dec.start(bytes, size, limits);
  check_size(dec.cinfo.image_width, dec.cinfo.image_height, limits);
  if (header) *header = jpeg_header(dec.cinfo);
  const bool cmyk = set_color(dec.cinfo);
  jpeg_start_decompress(&dec.cinfo);
  const size_t w = dec.cinfo.output_width, h = dec.cinfo.output_height;
  const size_t comps = static_cast<size_t>(dec.cinfo.output_components);
  pixels.resize(w * h * comps);
  while (dec.cinfo.output_scanline < h) {
    JSAMPROW row = pixels.data() + static_cast<size_t>(dec.cinfo.output_scanline) * w * comps;
    if (jpeg_read_scanlines(&dec.cinfo, &row, 1) != 1) throw DecodeError("truncated JPEG data");
  }
  jpeg_finish_decompress(&dec.cinfo);
  if (cmyk) {
    // In place: row r's 3-byte output never overtakes its own 4-byte input or later rows.
    for (size_t r = 0; r < h; ++r) {
      uint8_t* src = pixels.data() + r * w * 4;
      cmyk_to_rgb(src, static_cast<int>(w));
      if (r > 0) std::memmove(pixels.data() + r * w * 3, src, w * 3);
    }
    pixels.resize(w * h * 3);
  }
  return pixels;
}

// ---- PNG --------------------------------------------------------------------------------------------------

struct PngImage {
  png_image img;
  PngImage() {
    std::memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
  }
  ~PngImage() { png_image_free(&img); }
};

std::vector<uint8_t> png_decode_rgb(const uint8_t* bytes, size_t size, const DecodeLimits& limits, ImageHeader* header) {
  PngImage png;
  if (!png_image_begin_read_from_memory(&png.img, bytes, size))
    throw DecodeError(std::string("bad PNG: ") + png.img.message);
  check_size(png.img.width, png.img.height, limits);
  if (header) {
    header->width = static_cast<int>(png.img.width);
    header->height = static_cast<int>(png.img.height);
    header->channels = static_cast<int>(PNG_IMAGE_SAMPLE_CHANNELS(png.img.format));
    header->format = ImageHeader::Png;
  }
  png.img.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(png.img));
  // With no background given, libpng composes (partly) transparent pixels onto black; opaque pixels keep
  // their color, as with PIL's convert("RGB").
  if (!png_image_finish_read(&png.img, nullptr, pixels.data(), 0, nullptr))
    throw DecodeError(std::string("bad PNG: ") + png.img.message);
  return pixels;
}

}  // namespace

ImageHeader read_header(const uint8_t* bytes, size_t size, const DecodeLimits& limits) {
  if (is_jpeg(bytes, size)) {
    JpegDecoder dec;
    if (setjmp(dec.err.jump)) throw DecodeError(dec.err.message);
    dec.start(bytes, size, limits);
    check_size(dec.cinfo.image_width, dec.cinfo.image_height, limits);
    return jpeg_header(dec.cinfo);
  }
  if (is_png(bytes, size)) {
    PngImage png;
    if (!png_image_begin_read_from_memory(&png.img, bytes, size))
      throw DecodeError(std::string("bad PNG: ") + png.img.message);
    check_size(png.img.width, png.img.height, limits);
    return {static_cast<int>(png.img.width), static_cast<int>(png.img.height),
            static_cast<int>(PNG_IMAGE_SAMPLE_CHANNELS(png.img.format)), ImageHeader::Png};
  }
  not_an_image(bytes, size);
}

std::vector<uint8_t> decode_rgb(const uint8_t* bytes, size_t size, const DecodeLimits& limits, ImageHeader* header_out) {
  if (is_jpeg(bytes, size)) return jpeg_decode_rgb(bytes, size, limits, header_out);
  if (is_png(bytes, size)) return png_decode_rgb(bytes, size, limits, header_out);
  not_an_image(bytes, size);
}

void decode_crop_resize(const uint8_t* bytes, size_t size, const CropBox& box, int out_w, int out_h, bool hflip,
                        uint8_t* out_hwc_rgb, const DecodeLimits& limits) {
  check_out(out_w, out_h);
  if (is_jpeg(bytes, size)) return jpeg_crop_resize(bytes, size, box, out_w, out_h, hflip, out_hwc_rgb, limits);
  if (!is_png(bytes, size)) not_an_image(bytes, size);
  ImageHeader h;
  const std::vector<uint8_t> rgb = png_decode_rgb(bytes, size, limits, &h);
  const CropBox b = clip_box(box, h.width, h.height);
  const ResizeCoeffs cx = bilinear_coeffs(h.width, b.x, b.x + b.w, out_w);
  const ResizeCoeffs cy = bilinear_coeffs(h.height, b.y, b.y + b.h, out_h);
  resample(rgb.data(), static_cast<size_t>(h.width) * 3, rgb.data() + rgb.size(), 0, 0, cx, cy, out_w, out_h, hflip,
           out_hwc_rgb);
}

std::vector<uint8_t> resize_rgb(const uint8_t* rgb_hwc, int width, int height, const CropBox& box, int out_w, int out_h,
                                bool hflip) {
  check_out(out_w, out_h);
  if (width <= 0 || height <= 0) throw DecodeError("image has no pixels");
  const CropBox b = clip_box(box, width, height);
  const ResizeCoeffs cx = bilinear_coeffs(width, b.x, b.x + b.w, out_w);
  const ResizeCoeffs cy = bilinear_coeffs(height, b.y, b.y + b.h, out_h);
  std::vector<uint8_t> out(static_cast<size_t>(out_w) * out_h * 3);
  resample(rgb_hwc, static_cast<size_t>(width) * 3, rgb_hwc + static_cast<size_t>(width) * height * 3, 0, 0, cx, cy,
           out_w, out_h, hflip, out.data());
  return out;
}

// ---- encoders ---------------------------------------------------------------------------------------------

namespace {
struct JpegEncoder {
  jpeg_compress_struct cinfo;
  JpegError err;
  bool created = false;
  unsigned char* buf = nullptr;
  unsigned long len = 0;
  ~JpegEncoder() {
    if (created) jpeg_destroy_compress(&cinfo);
    std::free(buf);
  }
};
}  // namespace

std::vector<uint8_t> encode_jpeg(const uint8_t* pixels, int width, int height, int quality, int components, int chroma,
                                 bool progressive) {
  if (width <= 0 || height <= 0 || quality < 1 || quality > 100 || (components != 1 && components != 3 && components != 4) ||
      (chroma != 420 && chroma != 422 && chroma != 444))
    throw std::invalid_argument("encode_jpeg: bad arguments (" + std::to_string(width) + "x" + std::to_string(height) +
                                ", quality " + std::to_string(quality) + ", " + std::to_string(components) +
                                " components)");
  JpegEncoder enc;
  std::vector<uint8_t> inverted;
  if (setjmp(enc.err.jump)) throw std::runtime_error(std::string("encode_jpeg: ") + enc.err.message);
  enc.cinfo.err = jpeg_std_error(&enc.err.pub);
  enc.err.pub.error_exit = on_error;
  jpeg_create_compress(&enc.cinfo);
  enc.created = true;
  jpeg_mem_dest(&enc.cinfo, &enc.buf, &enc.len);
  enc.cinfo.image_width = static_cast<JDIMENSION>(width);
  enc.cinfo.image_height = static_cast<JDIMENSION>(height);
  enc.cinfo.input_components = components;
  enc.cinfo.in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&enc.cinfo);
  jpeg_set_quality(&enc.cinfo, quality, TRUE);
  if (components == 4) enc.cinfo.write_Adobe_marker = TRUE;
  if (components == 3) {
    enc.cinfo.comp_info[0].h_samp_factor = chroma == 444 ? 1 : 2;
    enc.cinfo.comp_info[0].v_samp_factor = chroma == 420 ? 2 : 1;
  }
  if (progressive) jpeg_simple_progression(&enc.cinfo);
  jpeg_start_compress(&enc.cinfo, TRUE);
  const size_t stride = static_cast<size_t>(width) * components;
  if (components == 4) {
    // Adobe's convention: CMYK is stored inverted (0 = full ink).
    inverted.resize(stride);
  }
  while (enc.cinfo.next_scanline < enc.cinfo.image_height) {
    const uint8_t* src = pixels + static_cast<size_t>(enc.cinfo.next_scanline) * stride;
    JSAMPROW row = const_cast<JSAMPROW>(src);
    if (components == 4) {
      for (size_t i = 0; i < stride; ++i) inverted[i] = static_cast<uint8_t>(255 - src[i]);
      row = inverted.data();
    }
    jpeg_write_scanlines(&enc.cinfo, &row, 1);
  }
  jpeg_finish_compress(&enc.cinfo);
  return std::vector<uint8_t>(enc.buf, enc.buf + enc.len);
}

std::vector<uint8_t> encode_png(const uint8_t* pixels, int width, int height, int channels) {
  if (width <= 0 || height <= 0 || channels < 1 || channels > 4)
    throw std::invalid_argument("encode_png: bad arguments");
  PngImage png;
  png.img.width = static_cast<png_uint_32>(width);
  png.img.height = static_cast<png_uint_32>(height);
  png.img.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 2 ? PNG_FORMAT_GA : channels == 3 ? PNG_FORMAT_RGB
                                                                                                    : PNG_FORMAT_RGBA;
  png_alloc_size_t len = 0;
  if (!png_image_write_to_memory(&png.img, nullptr, &len, 0, pixels, 0, nullptr))
    throw std::runtime_error(std::string("encode_png: ") + png.img.message);
  std::vector<uint8_t> out(len);
  if (!png_image_write_to_memory(&png.img, out.data(), &len, 0, pixels, 0, nullptr))
    throw std::runtime_error(std::string("encode_png: ") + png.img.message);
  out.resize(len);
  return out;
}

}  // namespace data
