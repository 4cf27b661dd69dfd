#include "data/samples/image_folder.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <thread>

namespace data {

MeanStd mean_std_of_files(const std::vector<std::string>& files, int64_t max_images, int threads,
                          const DecodeLimits& limits) {
  const int64_t n = static_cast<int64_t>(files.size());
  const int64_t stride = std::max<int64_t>(1, (n + max_images - 1) / std::max<int64_t>(1, max_images));
  std::vector<int64_t> picked;
  for (int64_t i = 0; i < n; i += stride) picked.push_back(i);
  struct Sums {
    uint64_t s[3] = {0, 0, 0}, q[3] = {0, 0, 0}, pixels = 0, images = 0;
  };
  const int t = std::max(1, threads);
  std::vector<Sums> part(static_cast<size_t>(t));
  auto work = [&](int w) {
    for (size_t k = static_cast<size_t>(w); k < picked.size(); k += static_cast<size_t>(t)) {
      try {
        const auto bytes = read_file_bytes(files[static_cast<size_t>(picked[k])]);
        const auto rgb = decode_rgb(bytes.data(), bytes.size(), limits);
        Sums& s = part[static_cast<size_t>(w)];
        for (size_t p = 0; p < rgb.size(); p += 3)
          for (int c = 0; c < 3; ++c) {
            s.s[c] += rgb[p + c];
            s.q[c] += static_cast<uint64_t>(rgb[p + c]) * rgb[p + c];
          }
        s.pixels += rgb.size() / 3;
        ++s.images;
      } catch (const std::exception&) {
        // Left out; the datasets report the file when it is read.
      }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < t; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& th : pool) th.join();
  Sums all;
  for (const auto& s : part) {
    for (int c = 0; c < 3; ++c) {
      all.s[c] += s.s[c];
      all.q[c] += s.q[c];
    }
    all.pixels += s.pixels;
    all.images += s.images;
  }
  MeanStd r;
  r.images = static_cast<int64_t>(all.images);
  if (all.pixels == 0) {  // nothing decoded: ImageNet's statistics would be a guess; use neutral ones
    r.mean.assign(3, 0.5f);
    r.std.assign(3, 0.25f);
    return r;
  }
  for (int c = 0; c < 3; ++c) {
    const double m = static_cast<double>(all.s[c]) / static_cast<double>(all.pixels);
    const double var = std::max(0.0, static_cast<double>(all.q[c]) / static_cast<double>(all.pixels) - m * m);
    r.mean.push_back(static_cast<float>(m / 255.0));
    // A constant channel (all images one colour) would divide by 0: floor at one grey level.
    r.std.push_back(static_cast<float>(std::max(std::sqrt(var), 1.0) / 255.0));
  }
  return r;
}

ImageFolderDataset::ImageFolderDataset(std::string dir, ImageTransform transform, std::vector<float> mean,
                                       std::vector<float> std, int threads)
    : dir_(std::move(dir)), transform_(transform), index_(scan_image_folder(dir_)) {
  check_transform(transform_);
  if (index_.files.empty())
    throw std::runtime_error("image folder '" + printable_name(dir_) + "': no .jpg, .jpeg or .png file in its " +
                             std::to_string(index_.classes.size()) + " class folders");
  for (const auto& c : index_.empty_classes)
    spdlog::warn("data: class folder {}/{} holds no image; class index {} stays reserved for it", printable_name(dir_),
                 printable_name(c),
                 std::find(index_.classes.begin(), index_.classes.end(), c) - index_.classes.begin());
  for (const auto& f : index_.not_regular)
    spdlog::warn("data: {}: not a regular file (a link to a device, a FIFO, a socket or a dangling link); passed over",
                 printable_name(f));
  meta_.num_classes = static_cast<int64_t>(index_.classes.size());
  for (const auto& c : index_.classes) meta_.class_names.push_back(printable_name(c));
  if (mean.size() == 3 && std.size() == 3) {
    meta_.mean = std::move(mean);
    meta_.std = std::move(std);
  } else {
    const MeanStd ms = mean_std_of_files(index_.files, 1000, threads, transform_.limits);
    meta_.mean = ms.mean;
    meta_.std = ms.std;
  }
}

void ImageFolderDataset::read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out,
                                    int64_t* labels_out, std::vector<SampleFailure>* failures) const {
  check_indices(indices, size(), "image folder '" + printable_name(dir_) + "'");
  const int64_t bytes_per_sample = int64_t{3} * transform_.size * transform_.size;
  for (size_t k = 0; k < indices.size(); ++k) {
    const int64_t i = indices[k];
    const std::string& path = index_.files[static_cast<size_t>(i)];
    uint8_t* out = images_out + static_cast<int64_t>(k) * bytes_per_sample;
    std::string error;
    try {
      const auto bytes = read_file_bytes(path);
      error = decode_sample(bytes.data(), bytes.size(), 0, 0, i, epoch, transform_, out);
    } catch (const std::exception& e) {
      std::fill(out, out + bytes_per_sample, uint8_t{0});
      error = e.what();
    }
    labels_out[k] = index_.labels[static_cast<size_t>(i)];
    if (!error.empty()) {
      labels_out[k] = kIgnoreLabel;
      SampleFailure f{i, printable_name(path) + " (sample " + std::to_string(i) + "): " + error};
      // Once per epoch that draws it (the prefetch may read the next epoch's first batches while this
      // one still trains): the line says which pass over the data it is, counted from 1.
      spdlog::warn("data: {}, read for epoch {}; a zero image with its label ignored takes its place", f.what, epoch + 1);
      if (failures) failures->push_back(std::move(f));
    }
  }
}

}  // namespace data
