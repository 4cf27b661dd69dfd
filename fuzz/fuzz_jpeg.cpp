// JPEG and PNG images (data/pixels/jpeg.h): read_header, decode_crop_resize and decode_rgb throw DecodeError for
// anything they do not accept. The limit is 4 M pixels so a header's claim cannot make an accepted input
// allocate past libFuzzer's memory limit; an accepted header is decoded through a train box (which
// takes DCT scaling and partial decoding where the box allows) and a whole-image box, and small images
// are decoded whole too. The crop box and the flip come from the input's last bytes.
#include "data/pixels/jpeg.h"
#include "data/pixels/transforms.h"
#include "fuzz_util.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  data::DecodeLimits limits;
  limits.max_pixels = 4'000'000;
  const uint64_t tail = size >= 2 ? (static_cast<uint64_t>(data[size - 1]) << 8 | data[size - 2]) : 0;
  std::vector<uint8_t> out;
  fuzz::expect_only<data::DecodeError>("read_header + decode_crop_resize", [&] {
    const data::ImageHeader h = data::read_header(data, size, limits);
    if (h.width <= 0 || h.height <= 0 || static_cast<int64_t>(h.width) * h.height > limits.max_pixels) std::abort();
    bool flip = false;
    const data::CropBox train = data::random_resized_crop(h.width, h.height, 0.08, 1.0, 3.0 / 4, 4.0 / 3, tail, 0, 0, &flip);
    const int side = 8 + static_cast<int>(tail % 57);
    out.assign(static_cast<size_t>(side) * side * 3, 0);
    data::decode_crop_resize(data, size, train, side, side, flip, out.data(), limits);
    data::decode_crop_resize(data, size, data::eval_center_crop(h.width, h.height, side), side, side, false, out.data(),
                             limits);
  });
  fuzz::expect_only<data::DecodeError>("decode_rgb", [&] {
    data::DecodeLimits small;
    small.max_pixels = 1 << 18;
    data::ImageHeader h;
    const auto rgb = data::decode_rgb(data, size, small, &h);
    if (rgb.size() != static_cast<size_t>(h.width) * h.height * 3) std::abort();
  });
  return 0;
}
