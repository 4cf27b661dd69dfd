// float32 to bfloat16 with stochastic rounding, for bfloat16 weights updated in float32 (model.param_dtype
// bfloat16 with optim.stochastic_rounding), as torchao's _AdamW(bf16_stochastic_round=True) rounds them.
//
// A float32 x has 16 bits more than a bfloat16: x = [upper 16 | lower 16]. Rounded towards zero it is
// [upper | 0]; away from zero [upper + 1 | 0]. Stochastic rounding goes away from zero with probability
// lower / 2^16, so that the rounded value is x on average: an update smaller than bfloat16's resolution
// (2^-8 of the weight) is not lost, only carried by chance. Round to nearest loses it every time.
//
// The 16 random bits of each value come from a counter-based hash of (key, index): the same key and
// index give the same bits on any thread and after a resume, with no generator state to save. The key
// names the step and the tensor (stochastic_key); the index is the value's place in the tensor.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace trainer {

/// SplitMix64's finalizer: a bijection of 64 bits whose outputs pass BigCrush as a counter hash.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The key of one tensor's roundings at one step, from the run's seed.
inline uint64_t stochastic_key(uint64_t seed, int64_t step, int64_t tensor) {
  return mix64(mix64(seed ^ 0x9E3779B97F4A7C15ull) + static_cast<uint64_t>(step) * 0x100000001B3ull + static_cast<uint64_t>(tensor));
}

/// 16 random bits for value `index` under `key`.
inline uint32_t random16(uint64_t key, int64_t index) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull) >> 48);
}

/// x rounded to bfloat16 away from zero when `r16` (16 random bits) is below x's lower 16 bits, towards
/// zero otherwise. NaN and infinity keep their class (an infinity's lower bits are 0; a NaN's upper half
/// is still a NaN).
inline c10::BFloat16 round_stochastic(float x, uint32_t r16) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t lower = bits & 0xFFFFu;
  uint32_t upper = bits >> 16;
  if ((upper & 0x7F80u) != 0x7F80u && r16 < lower) ++upper;  // finite: may carry into the exponent, as it should
  return c10::BFloat16(static_cast<uint16_t>(upper), c10::BFloat16::from_bits());
}

/// `n` values rounded stochastically into `out`, value i with random16(key, begin + i).
inline void round_stochastic(const float* x, int64_t n, uint64_t key, int64_t begin, c10::BFloat16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_stochastic(x[i], random16(key, begin + i));
}

}  // namespace trainer
