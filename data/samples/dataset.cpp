#include "data/samples/dataset.h"

#include "data/pixels/rng.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace data {

void check_indices(const std::vector<int64_t>& indices, int64_t n, const std::string& what) {
  for (int64_t i : indices) {
    if (i < 0 || i >= n) {
      throw std::out_of_range(what + ": sample index " + std::to_string(i) + " is outside [0, " +
                              std::to_string(n) + ")");
    }
  }
}

std::pair<std::vector<float>, std::vector<float>> compute_mean_std(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == torch::kUInt8,
              "compute_mean_std: expected uint8 images (N, C, H, W), got ", images.scalar_type(), " ",
              images.sizes());
  const auto x = images.contiguous();
  const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  TORCH_CHECK(n > 0 && hw > 0, "compute_mean_std: no pixels in images of shape ", images.sizes());
  // Integer sums are exact (255^2 * 2^40 pixels still fits in 64 bits), so the result does not depend
  // on the summation order; the division happens once, in double.
  std::vector<uint64_t> sum(c, 0), sum_sq(c, 0);
  const uint8_t* p = x.data_ptr<uint8_t>();
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t ch = 0; ch < c; ++ch, p += hw) {
      uint64_t s1 = 0, s2 = 0;
      for (int64_t k = 0; k < hw; ++k) {
        s1 += p[k];
        s2 += static_cast<uint64_t>(p[k]) * p[k];
      }
      sum[ch] += s1;
      sum_sq[ch] += s2;
    }
  }
  std::vector<float> mean(c), std(c);
  const double count = static_cast<double>(n) * static_cast<double>(hw);
  for (int64_t ch = 0; ch < c; ++ch) {
    const double m = static_cast<double>(sum[ch]) / count;
    const double var = std::max(0.0, static_cast<double>(sum_sq[ch]) / count - m * m);
    mean[ch] = static_cast<float>(m / 255.0);
    std[ch] = static_cast<float>(std::sqrt(var) / 255.0);
  }
  return {mean, std};
}

SyntheticImageDataset::SyntheticImageDataset(int64_t size, int64_t channels, int64_t height, int64_t width,
                                             int64_t num_classes, uint64_t seed)
    : size_(size), shape_{channels, height, width}, seed_(seed) {
  if (size <= 0 || channels <= 0 || height <= 0 || width <= 0 || num_classes <= 0) {
    throw std::invalid_argument("SyntheticImageDataset: size, channels, height, width and num_classes must be "
                                "positive, got size " + std::to_string(size) + ", shape (" +
                                std::to_string(channels) + ", " + std::to_string(height) + ", " +
                                std::to_string(width) + "), " + std::to_string(num_classes) + " classes");
  }
  meta_.num_classes = num_classes;
  for (int64_t k = 0; k < num_classes; ++k) meta_.class_names.push_back(std::to_string(k));
  meta_.mean.assign(channels, 0.5f);
  meta_.std.assign(channels, static_cast<float>(std::sqrt((256.0 * 256.0 - 1.0) / 12.0) / 255.0));
}

void SyntheticImageDataset::read(const std::vector<int64_t>& indices, uint8_t* images_out,
                                 int64_t* labels_out) const {
  check_indices(indices, size_, "SyntheticImageDataset");
  const int64_t bytes = sample_bytes();
  for (size_t k = 0; k < indices.size(); ++k) {
    SplitMix64 rng(hash_key(seed_, static_cast<uint64_t>(indices[k])));
    labels_out[k] = static_cast<int64_t>(rng.below(static_cast<uint64_t>(meta_.num_classes)));
    uint8_t* out = images_out + static_cast<int64_t>(k) * bytes;
    // Eight pixels per draw: the generator costs about as much as a memcpy of the image.
    int64_t j = 0;
    for (; j + 8 <= bytes; j += 8) {
      const uint64_t r = rng.next();
      std::memcpy(out + j, &r, 8);
    }
    if (j < bytes) {
      const uint64_t r = rng.next();
      std::memcpy(out + j, &r, static_cast<size_t>(bytes - j));
    }
  }
}

}  // namespace data
