#include "data/samples/image_sample.h"

#include "data/samples/loader.h"
#include "data/pixels/transforms.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace data {

namespace fs = std::filesystem;

void check_transform(const ImageTransform& t) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("image transform: " + what); };
  if (t.size < 1 || t.size > 65536) bad("size must be in [1, 65536], got " + std::to_string(t.size));
  if (!(t.scale_lo > 0 && t.scale_lo <= t.scale_hi && t.scale_hi <= 1))
    bad("scale must satisfy 0 < lo <= hi <= 1, got [" + std::to_string(t.scale_lo) + ", " +
        std::to_string(t.scale_hi) + "]");
  if (!(t.ratio_lo > 0 && t.ratio_lo <= t.ratio_hi))
    bad("ratio must satisfy 0 < lo <= hi, got [" + std::to_string(t.ratio_lo) + ", " + std::to_string(t.ratio_hi) + "]");
  if (!(t.crop_pct > 0 && t.crop_pct <= 1)) bad("crop_pct must be in (0, 1], got " + std::to_string(t.crop_pct));
  if (t.crop_padding < 0 || t.crop_padding > t.size)
    bad("crop_padding must be in [0, size], got " + std::to_string(t.crop_padding));
  if (t.limits.max_pixels < 1) bad("max_pixels must be >= 1, got " + std::to_string(t.limits.max_pixels));
  try {
    check_auto_augment(t.auto_augment);
  } catch (const std::invalid_argument& e) {
    bad(e.what());
  }
}

namespace {

// The crop (and flip) of a training sample, decoded into `out`.
void decode_train_or_eval(const uint8_t* bytes, size_t size, int width, int height, int64_t index, int64_t epoch,
                          const ImageTransform& t, uint8_t* out) {
  if (t.train && t.crop_padding > 0) {
    thread_local std::vector<uint8_t> view;
    view.resize(static_cast<size_t>(t.size) * t.size * 3);
    decode_crop_resize(bytes, size, eval_center_crop(width, height, t.size, t.crop_pct), t.size, t.size,
                       /*hflip=*/false, view.data(), t.limits);
    AugmentOptions a;
    a.random_crop_padding = t.crop_padding;
    a.hflip = t.hflip;
    augment_image_hwc(view.data(), t.size, t.size, 3, draw_augment(t.seed, epoch, index, a), t.crop_padding, out);
    return;
  }
  bool flip = false;
  const CropBox box = t.train ? random_resized_crop(width, height, t.scale_lo, t.scale_hi, t.ratio_lo, t.ratio_hi,
                                                    t.seed, epoch, index, &flip)
                              : eval_center_crop(width, height, t.size, t.crop_pct);
  decode_crop_resize(bytes, size, box, t.size, t.size, t.train && t.hflip && flip, out, t.limits);
}

}  // namespace

std::string decode_sample(const uint8_t* bytes, size_t size, int width, int height, int64_t index, int64_t epoch,
                          const ImageTransform& t, uint8_t* out) {
  try {
    if (width <= 0 || height <= 0) {
      const ImageHeader h = read_header(bytes, size, t.limits);
      width = h.width;
      height = h.height;
    }
    decode_train_or_eval(bytes, size, width, height, index, epoch, t, out);
    const AutoAugmentOptions& aa = t.auto_augment;
    if (t.train && aa.kind != AutoAugmentKind::None)
      auto_augment(ImageU8{out, 3, t.size, t.size, /*hwc=*/true}, aa,
                   *cached_augment_space(aa.kind, aa.bins, t.size, t.size), t.seed, epoch, index);
    return "";
  } catch (const std::exception& e) {  // DecodeError, or a size the transforms refuse
    std::memset(out, 0, static_cast<size_t>(t.size) * t.size * 3);
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    return what.empty() ? "cannot be decoded" : what;
  }
}

namespace {

bool image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

}  // namespace

ImageFolderIndex scan_image_folder(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error("image folder '" + printable_name(dir) + "': not found or not a folder");
  ImageFolderIndex idx;
  for (const auto& e : fs::directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec))
    if (e.is_directory(ec)) idx.classes.push_back(e.path().filename().string());
  if (ec) throw std::runtime_error("image folder '" + printable_name(dir) + "': cannot list it (" + ec.message() + ")");
  std::sort(idx.classes.begin(), idx.classes.end());
  if (idx.classes.empty())
    throw std::runtime_error("image folder '" + printable_name(dir) + "': no class folders (expected " +
                             printable_name(dir) + "/<class>/<image>)");
  for (size_t k = 0; k < idx.classes.size(); ++k) {
    std::vector<std::string> files;
    const fs::path cdir = fs::path(dir) / idx.classes[k];
    for (auto it = fs::recursive_directory_iterator(cdir, fs::directory_options::follow_directory_symlink, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code st;  // a dangling link has no status: it is passed over, not an error of the listing
      if (it->is_directory(st)) continue;
      const bool regular = it->is_regular_file(st);
      if (!image_extension(it->path())) ++idx.other_files;
      else if (regular) files.push_back(it->path().string());
      else idx.not_regular.push_back(it->path().string());  // a link to a device, a FIFO, a socket, a dangling link
    }
    if (ec) throw std::runtime_error("image folder '" + printable_name(cdir.string()) + "': cannot list it (" + ec.message() + ")");
    std::sort(files.begin(), files.end());
    std::sort(idx.not_regular.begin(), idx.not_regular.end());
    if (files.empty()) idx.empty_classes.push_back(idx.classes[k]);
    for (auto& f : files) {
      idx.files.push_back(std::move(f));
      idx.labels.push_back(static_cast<int64_t>(k));
    }
  }
  return idx;
}

std::string printable_name(const std::string& s) {
  std::string out;
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    // Length of a valid UTF-8 sequence starting at i, or 0.
    size_t len = 0;
    const unsigned char c = b[i];
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) len = 3;
    else if (c >= 0xF0 && c <= 0xF4) len = 4;
    if (len > 1) {
      if (i + len > n) len = 0;
      for (size_t k = 1; len && k < len; ++k)
        if ((b[i + k] & 0xC0) != 0x80) len = 0;
      // Overlong three-byte forms, UTF-16 surrogates, and code points past U+10FFFF are not UTF-8.
      if (len == 3 && ((c == 0xE0 && b[i + 1] < 0xA0) || (c == 0xED && b[i + 1] >= 0xA0))) len = 0;
      if (len == 4 && ((c == 0xF0 && b[i + 1] < 0x90) || (c == 0xF4 && b[i + 1] >= 0x90))) len = 0;
    }
    if (len == 1 && c < 0x20) len = 0;  // control characters (a newline would break a list file)
    if (len == 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
      ++i;
    } else {
      out.append(s, i, len);
      i += len;
    }
  }
  return out;
}

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DecodeError("cannot open the file");
  in.seekg(0, std::ios::end);
  const std::streamoff n = in.tellg();
  if (n < 0) throw DecodeError("cannot read the file's size");
  in.seekg(0);
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  if (n > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), n)) throw DecodeError("cannot read the file");
  return bytes;
}

}  // namespace data
