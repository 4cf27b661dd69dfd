#include "tools/convert_images.h"

#include "data/samples/image_folder.h"
#include "data/files/packed_images.h"
#include "trainer/memory/resources.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

namespace trainer {

namespace {

namespace fs = std::filesystem;

struct Converted {
  std::vector<uint8_t> bytes;
  int width = 0, height = 0;
  bool reencoded = false;
  std::string error;  // non-empty: skipped
};

// One file: JPEG (3 components, within max_side) kept as it is, after a check that it decodes (at 1/8
// scale, which still reads all of its data); anything else decoded and re-encoded as RGB JPEG.
Converted convert_one(const std::string& path, const ConvertImagesOptions& o, const data::DecodeLimits& limits) {
  Converted c;
  try {
    c.bytes = data::read_file_bytes(path);
    const data::ImageHeader h = data::read_header(c.bytes.data(), c.bytes.size(), limits);
    const bool too_big = o.max_side > 0 && std::max(h.width, h.height) > o.max_side;
    if (h.format == data::ImageHeader::Jpeg && h.channels == 3 && !too_big) {
      const int w = std::max(1, h.width / 8), hh = std::max(1, h.height / 8);
      std::vector<uint8_t> probe(static_cast<size_t>(w) * hh * 3);
      data::decode_crop_resize(c.bytes.data(), c.bytes.size(), {0, 0, double(h.width), double(h.height)}, w, hh,
                               false, probe.data(), limits);
      c.width = h.width;
      c.height = h.height;
      return c;
    }
    data::ImageHeader dh;
    std::vector<uint8_t> rgb = data::decode_rgb(c.bytes.data(), c.bytes.size(), limits, &dh);
    int w = dh.width, hh = dh.height;
    if (too_big) {
      const double s = static_cast<double>(o.max_side) / std::max(w, hh);
      const int nw = std::max(1, static_cast<int>(std::lround(w * s))), nh = std::max(1, static_cast<int>(std::lround(hh * s)));
      rgb = data::resize_rgb(rgb.data(), w, hh, {0, 0, double(w), double(hh)}, nw, nh);
      w = nw;
      hh = nh;
    }
    c.bytes = data::encode_jpeg(rgb.data(), w, hh, o.quality);
    c.width = w;
    c.height = hh;
    c.reencoded = true;
  } catch (const std::exception& e) {
    c.bytes.clear();
    c.error = e.what();
    if (c.error.empty()) c.error = "cannot be decoded";
  }
  return c;
}

std::string seconds_text(double s) {
  char buf[32];
  if (s < 120) std::snprintf(buf, sizeof buf, "%.0f s", s);
  else if (s < 7200) std::snprintf(buf, sizeof buf, "%.0f min", s / 60);
  else std::snprintf(buf, sizeof buf, "%.1f h", s / 3600);
  return buf;
}

struct SplitResult {
  int64_t images = 0, reencoded = 0, skipped = 0, bytes = 0;
  double seconds = 0;
};

SplitResult convert_split(const std::string& split, const data::ImageFolderIndex& idx, const std::vector<int64_t>& labels,
                          const std::vector<std::string>& class_names, const data::ImageMeta& meta,
                          int64_t mean_std_images, const ConvertImagesOptions& o, int threads) {
  const data::DecodeLimits limits{o.max_pixels};
  const fs::path out = o.out;
  const std::string path = (out / (split + ".h5")).string();
  const std::string skipped_path = (out / (split + ".skipped.txt")).string();
  std::vector<std::string> skipped;
  for (const auto& c : idx.empty_classes) {
    const int64_t k = std::find(class_names.begin(), class_names.end(), c) - class_names.begin();
    skipped.push_back(data::printable_name(c) + "/\tempty class folder: class index " + std::to_string(k) +
                      " is kept for it, with no image");
    std::fprintf(stderr, "convert-images: %s: class folder %s holds no image; its class index %lld is kept\n",
                 split.c_str(), data::printable_name(c).c_str(), static_cast<long long>(k));
  }
  for (const auto& f : idx.not_regular)
    skipped.push_back(data::printable_name(f) + "\tnot a regular file (a link to a device, a FIFO, a socket or a "
                                                "dangling link): passed over, never opened");
  data::PackedImageWriter writer(path);
  SplitResult r;
  r.skipped = static_cast<int64_t>(idx.not_regular.size());
  const int64_t n = static_cast<int64_t>(idx.files.size());
  const int64_t block = std::max<int64_t>(64, 32 * threads);
  const bool tty = isatty(2) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  std::vector<Converted> done;
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    done.assign(static_cast<size_t>(end - begin), Converted{});
    std::atomic<int64_t> next{begin};
    auto work = [&] {
      for (int64_t i; (i = next.fetch_add(1)) < end;)
        done[static_cast<size_t>(i - begin)] = convert_one(idx.files[static_cast<size_t>(i)], o, limits);
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
    for (int64_t i = begin; i < end; ++i) {
      Converted& c = done[static_cast<size_t>(i - begin)];
      if (!c.error.empty()) {
        skipped.push_back(data::printable_name(idx.files[static_cast<size_t>(i)]) + "\t" + c.error);
        ++r.skipped;
        continue;
      }
      writer.append(c.bytes.data(), c.bytes.size(), labels[static_cast<size_t>(i)], c.width, c.height);
      ++r.images;
      r.reencoded += c.reencoded;
    }
    const auto now = std::chrono::steady_clock::now();
    const double since = std::chrono::duration<double>(now - last).count();
    if (o.progress && (end == n || since >= (tty ? 1.0 : 10.0))) {
      last = now;
      const double el = std::chrono::duration<double>(now - t0).count();
      const double rate = static_cast<double>(end) / std::max(el, 1e-9);
      std::fprintf(stderr, "%sconvert-images: %s %lld/%lld files (%.0f%%), %.0f files/s, ETA %s%s", tty ? "\r" : "",
                   split.c_str(), static_cast<long long>(end), static_cast<long long>(n), 100.0 * end / n, rate,
                   seconds_text(static_cast<double>(n - end) / std::max(rate, 1e-9)).c_str(), tty ? "   " : "\n");
      std::fflush(stderr);
    }
  }
  if (o.progress && tty) std::fprintf(stderr, "\n");
  if (r.images == 0) throw std::runtime_error("convert-images: " + split + ": none of the " + std::to_string(n) +
                                              " files could be decoded (see " + skipped_path + ")");
  std::error_code ec;
  if (!skipped.empty()) {
    std::ofstream list(skipped_path, std::ios::trunc);
    for (const auto& s : skipped) list << s << "\n";
    if (!list) throw std::runtime_error("convert-images: cannot write " + skipped_path);
  } else {
    fs::remove(skipped_path, ec);
  }
  r.bytes = writer.bytes();
  writer.finish(meta, mean_std_images);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace

std::string convert_images(const ConvertImagesOptions& o) {
  if (o.max_side < 0) throw std::runtime_error("convert-images: --max-side must be >= 0 (0 = keep every size)");
  if (o.threads < 0) throw std::runtime_error("convert-images: --threads must be >= 0 (0 = the CPUs this process may use)");
  if (o.quality < 1 || o.quality > 100) throw std::runtime_error("convert-images: the JPEG quality must be in [1, 100]");
  if (o.max_pixels < 1) throw std::runtime_error("convert-images: --max-pixels must be positive");
  const int threads = o.threads > 0 ? o.threads : std::max(1, usable_cpus(container_root()));
  const fs::path src = o.src, train_dir = src / "train", val_dir = src / "val";
  std::error_code ec;
  if (!fs::is_directory(train_dir, ec))
    throw std::runtime_error("convert-images: " + data::printable_name(train_dir.string()) +
                             " is not a folder (expected SRC/train/<class>/<image>, and optionally SRC/val/...)");
  fs::create_directories(o.out, ec);
  if (ec) throw std::runtime_error("convert-images: cannot create " + o.out + " (" + ec.message() + ")");

  const data::ImageFolderIndex train = data::scan_image_folder(train_dir.string());
  if (train.files.empty())
    throw std::runtime_error("convert-images: " + data::printable_name(train_dir.string()) + " has no .jpg, .jpeg or .png file");
  const data::MeanStd ms = data::mean_std_of_files(train.files, o.mean_std_images, threads, data::DecodeLimits{o.max_pixels});
  data::ImageMeta meta;
  meta.num_classes = static_cast<int64_t>(train.classes.size());
  for (const auto& c : train.classes) meta.class_names.push_back(data::printable_name(c));
  meta.mean = ms.mean;
  meta.std = ms.std;

  auto describe = [&](const std::string& split, const SplitResult& r) {
    std::string s = split + ".h5 " + std::to_string(r.images) + " images (" + std::to_string(r.reencoded) +
                    " re-encoded, " + std::to_string(r.skipped) + " skipped";
    if (r.skipped) s += ": " + (fs::path(o.out) / (split + ".skipped.txt")).string();
    char rate[64];
    std::snprintf(rate, sizeof rate, "; %.1f MB, %.0f files/s", r.bytes / 1e6, (r.images + r.skipped) / std::max(r.seconds, 1e-9));
    return s + rate + ")";
  };
  std::string summary = "converted " + o.src + " -> " + o.out + " with " + std::to_string(threads) + " threads: ";
  summary += describe("train", convert_split("train", train, train.labels, train.classes, meta, ms.images, o, threads));
  if (fs::is_directory(val_dir, ec)) {
    const data::ImageFolderIndex val = data::scan_image_folder(val_dir.string());
    std::vector<int64_t> labels;
    for (int64_t l : val.labels) {
      const std::string& name = val.classes[static_cast<size_t>(l)];
      const auto at = std::find(train.classes.begin(), train.classes.end(), name);
      if (at == train.classes.end())
        throw std::runtime_error("convert-images: val has the class folder " + data::printable_name(name) +
                                 ", which train lacks (class indices come from train)");
      labels.push_back(at - train.classes.begin());
    }
    for (const auto& name : val.classes)
      if (std::find(train.classes.begin(), train.classes.end(), name) == train.classes.end())
        throw std::runtime_error("convert-images: val has the class folder " + data::printable_name(name) +
                                 ", which train lacks (class indices come from train)");
    if (val.files.empty()) throw std::runtime_error("convert-images: " + data::printable_name(val_dir.string()) + " has no image file");
    summary += ", " + describe("val", convert_split("val", val, labels, train.classes, meta, ms.images, o, threads));
  }
  char stats[160];
  std::snprintf(stats, sizeof stats, "; %lld classes, mean %.4f %.4f %.4f, std %.4f %.4f %.4f (from %lld training images)",
                static_cast<long long>(meta.num_classes), meta.mean[0], meta.mean[1], meta.mean[2], meta.std[0],
                meta.std[1], meta.std[2], static_cast<long long>(ms.images));
  return summary + stats;
}

}  // namespace trainer
