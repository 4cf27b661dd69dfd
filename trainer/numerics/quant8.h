// Blockwise 8-bit dynamic quantization of optimizer state (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", 2021), as bitsandbytes' 8-bit Adam and torchao's AdamW8bit hold their moments.
//
// A tensor is cut into blocks of 256 consecutive values. Each block keeps one float32 scale, the largest
// |value| in it (at least 1e-12), and one uint8 code per value: the index of the nearest entry of a fixed
// 256-entry map to value / scale (ties to the larger entry). The maps are the "dynamic" data type of
// Dettmers (2015): a run of leading zero digits in base ten acts as an exponent, the bits after it as a
// fraction, so that small values keep relative precision (1e-6 .. 1 in 7 decades):
//
//   decade i = 0..6 spans 10^(i-6) x (0.1 .. 1); it holds the midpoints of a linspace(0.1, 1, n_i + 1),
//   n_i = 2^i entries in the signed map (and their negatives), 2^(i+1) in the unsigned one; plus 0 and 1.
//
//   signed   (first moment):  254 + 2 = 256 entries in [-0.99.., 1]
//   unsigned (second moment): 254 + 2 = 256 entries in [0, 1]
//
// Storage: 1 byte a value plus 4 bytes per 256 values: 1.016 bytes, against 4 for float32. torchao quantizes
// only tensors of at least 4,096 values whose size is a multiple of 256; others stay float32 (quantizes()).
//
// The code is the largest entry <= value / scale, then the nearer of it and the next one up (ties up, in
// float32 as torchao computes it): the same decisions as torchao's quantize_8bit_with_qmap (a binary
// search), so that codes agree bit for bit (tests/test_optim_state.cpp against torchao 0.18, and against a
// brute-force nearest-entry search). The largest entry is found from a table by the value's top bits
// (Codebook).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace trainer::quant8 {

constexpr int64_t kBlock = 256;      ///< values per scale
constexpr int64_t kMinNumel = 4096;  ///< smaller tensors stay float32 (torchao)

/// Whether a tensor of `numel` values is held quantized: at least kMinNumel, and whole blocks.
inline bool quantizes(int64_t numel) { return numel >= kMinNumel && numel % kBlock == 0; }

/// The 256 entries of the dynamic map, ascending: float32, on the CPU. Signed for a first moment (it may be
/// negative), unsigned for a second moment.
const torch::Tensor& dynamic_map(bool is_signed);

/// A map with what finds a code fast. `floor` has an entry for each of the 65,536 patterns of a float32's
/// top 16 bits (sign, exponent, 7 bits of mantissa): the code the binary search gives the smallest value
/// with those bits (0 where a NaN has them). A value's search then starts there and moves up at most a few
/// entries: the same code, in a few cycles instead of 8 dependent loads.
struct Codebook {
  const float* values = nullptr;  ///< the map's 256 entries, then +infinity
  const uint8_t* floor = nullptr; ///< 65,536 codes
};
const Codebook& codebook(bool is_signed);

/// Encodes `n` (<= kBlock) float32 values: writes their codes and returns the block's scale.
float encode_block(const float* x, int64_t n, const Codebook& book, uint8_t* codes);
/// Decodes `n` codes of a block with scale `absmax` into float32.
void decode_block(const uint8_t* codes, int64_t n, const Codebook& book, float absmax, float* out);

/// The codes (uint8, x's shape) and per-block scales (float32, numel / kBlock) of a float32 CPU tensor whose
/// size quantizes(); written into `codes` and `absmax` when they are defined and sized so, else allocated.
void quantize(const torch::Tensor& x, bool is_signed, torch::Tensor& codes, torch::Tensor& absmax);
/// The float32 values of quantize()'s codes and scales (the codes' shape).
torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, bool is_signed);

}  // namespace trainer::quant8
