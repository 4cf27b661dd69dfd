#include "trainer/numerics/quant8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace trainer::quant8 {

namespace {

// linspace(0.1, 1, n) in float32 as LibTorch 2.x's CPU kernel computes it, its multiply-add fused: from
// the start up to the middle, from the end after it. (Unfused, 42 entries of the signed map would differ
// from torchao's in the last bit; LibTorch 1.13's vectorized linspace differs again.)
std::vector<float> linspace(int64_t n) {
  const float start = 0.1f, end = 1.0f, step = (end - start) / static_cast<float>(n - 1);
  std::vector<float> out(n);
  for (int64_t k = 0; k < n; ++k)
    out[k] = k < n / 2 ? std::fma(step, static_cast<float>(k), start) : std::fma(-step, static_cast<float>(n - k - 1), end);
  return out;
}

// The map as quant8.h draws it, in float32 step by step as bitsandbytes' and torchao's create_dynamic_map
// computes it (midpoints of the linspace, times a power of ten), so that its entries are theirs bit for bit.
torch::Tensor make_map(bool is_signed) {
  constexpr int kExponentBits = 7;  // decades; the sign takes no bit of the 7 in either map
  std::vector<float> data;
  for (int i = 0; i < kExponentBits; ++i) {
    const int64_t items = is_signed ? (int64_t(1) << i) + 1 : (int64_t(1) << (i + 1)) + 1;
    const std::vector<float> bounds = linspace(items);
    const float decade = static_cast<float>(std::pow(10.0, -(kExponentBits - 1) + i));
    for (const float sign : {1.0f, -1.0f}) {
      if (sign < 0 && !is_signed) break;
      for (int64_t k = 0; k + 1 < items; ++k) data.push_back((bounds[k] + bounds[k + 1]) / 2.0f * (sign * decade));
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  if (data.size() != 256) throw std::logic_error("quant8: the dynamic map has " + std::to_string(data.size()) + " entries");
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kFloat);
}

// The largest code whose entry is <= v, or 0 when none is (v below them all, or NaN): the branchless
// binary search of torchao's quantize_8bit_with_qmap.
int search(const float* map, float v) {
  int c = v >= map[128] ? 128 : 0;
  for (int step = 64; step >= 1; step /= 2) c += v >= map[c + step] ? step : 0;
  return c;
}

struct Book {
  torch::Tensor map;
  std::vector<float> values;  // the map's entries and +infinity after them, so that c + 1 may be read
  std::vector<uint8_t> floor;
  Codebook view;
  explicit Book(bool is_signed) : map(make_map(is_signed)), floor(size_t(1) << 16) {
    const float* m = map.data_ptr<float>();
    values.assign(m, m + 256);
    values.push_back(std::numeric_limits<float>::infinity());
    for (uint32_t top = 0; top < (1u << 16); ++top) {
      // The smallest value with these top bits: the least low bits for a positive sign, the most for a
      // negative one. A NaN among them makes the entry 0, which is a NaN's code, and no larger than any.
      const uint32_t lo = top << 16, hi = lo | 0xFFFFu;
      const bool nan_inside = ((top >> 7) & 0xFFu) == 0xFFu;  // exponent all ones: infinity, NaNs

      float smallest;
      std::memcpy(&smallest, (top >> 15) ? &hi : &lo, sizeof smallest);
      floor[top] = static_cast<uint8_t>(nan_inside ? 0 : search(m, smallest));
      // encode_block moves at most one entry up from here: the largest value with these bits must be
      // within one entry.
      float largest;
      std::memcpy(&largest, (top >> 15) ? &lo : &hi, sizeof largest);
      if (!nan_inside && search(m, largest) > floor[top] + 1)
        throw std::logic_error("quant8: more than one map entry between two values with the same top 16 bits");
    }
    view.values = values.data();
    view.floor = floor.data();
  }
};

const Book& book(bool is_signed) {
  static const Book books[2] = {Book(false), Book(true)};
  return books[is_signed ? 1 : 0];
}

}  // namespace

const torch::Tensor& dynamic_map(bool is_signed) { return book(is_signed).map; }
const Codebook& codebook(bool is_signed) { return book(is_signed).view; }

float encode_block(const float* x, int64_t n, const Codebook& book, uint8_t* codes) {
  const float* map = book.values;
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = std::max(amax, 1e-12f);
  for (int64_t j = 0; j < n; ++j) {
    const float v = x[j] / scale;
    // The largest entry <= v (entry 0 when v lies below them all): from the table, then at most one up
    // for any finite v (checked over every bucket when the table is made); |v| <= 1 but for a NaN or an
    // infinity among the values, which take the binary search.
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    int c = book.floor[bits >> 16];
    c += v >= map[c + 1];  // map[256] is +infinity
    if (!(std::fabs(v) <= 1.0f)) c = search(map, v);
    // ... then the nearer of it and the next one up, ties up; without a branch, which would be mispredicted
    // half the time (torchao: up = min(c + 1, 255), where(v - lo >= (up - lo) / 2, up, c)).
    const int has_up = c < 255;
    const float lo = map[c], hi = map[c + has_up];
    c += has_up & static_cast<int>(v - lo >= (hi - lo) * 0.5f);
    codes[j] = static_cast<uint8_t>(c);
  }
  return scale;
}

void decode_block(const uint8_t* codes, int64_t n, const Codebook& book, float absmax, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = book.values[codes[j]] * absmax;
}

void quantize(const torch::Tensor& x, bool is_signed, torch::Tensor& codes, torch::Tensor& absmax) {
  if (x.scalar_type() != torch::kFloat || !x.device().is_cpu() || !quantizes(x.numel()))
    throw std::invalid_argument("quant8::quantize: needs a float32 CPU tensor of whole blocks, at least 4096 values");
  const torch::Tensor src = x.contiguous();
  const int64_t blocks = x.numel() / kBlock;
  if (!codes.defined() || codes.sizes() != x.sizes() || !codes.is_contiguous())
    codes = torch::empty(x.sizes(), torch::kUInt8);
  if (!absmax.defined() || absmax.numel() != blocks || !absmax.is_contiguous()) absmax = torch::empty({blocks}, torch::kFloat);
  const float* in = src.data_ptr<float>();
  const Codebook& map = codebook(is_signed);
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* scale = absmax.data_ptr<float>();
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) scale[b] = encode_block(in + b * kBlock, kBlock, map, out + b * kBlock);
  });
}

torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, bool is_signed) {
  if (codes.scalar_type() != torch::kUInt8 || absmax.scalar_type() != torch::kFloat ||
      codes.numel() != absmax.numel() * kBlock)
    throw std::invalid_argument("quant8::dequantize: needs uint8 codes and one float32 scale per 256 of them");
  const torch::Tensor c = codes.cpu().contiguous(), s = absmax.cpu().contiguous();
  torch::Tensor out = torch::empty(codes.sizes(), torch::kFloat);
  const Codebook& map = codebook(is_signed);
  const uint8_t* in = c.data_ptr<uint8_t>();
  const float* scale = s.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, s.numel(), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) decode_block(in + b * kBlock, kBlock, map, scale[b], o + b * kBlock);
  });
  return out;
}

}  // namespace trainer::quant8
