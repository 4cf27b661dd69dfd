// The data layer's own random numbers: splitmix64 streams keyed by small tuples of integers
// ((seed, epoch) for an epoch's order, (seed, epoch, index) for a sample's augmentation, (seed, index)
// for a synthetic sample). Nothing here touches torch's global generator, so the sample order and the
// augmentation do not depend on what else the process draws, on the thread that runs, or on the
// library version.
#pragma once

#include <cstdint>
#include <vector>

namespace data {

/// splitmix64's output function: a bijective 64-bit mix (Steele, Lea, Flood 2014).
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// A key from an ordered tuple of integers: key(a, b) != key(b, a) in general.
inline uint64_t hash_key(uint64_t a, uint64_t b) { return mix64(mix64(a) + 0x9e3779b97f4a7c15ULL * (b + 1)); }
inline uint64_t hash_key(uint64_t a, uint64_t b, uint64_t c) { return hash_key(hash_key(a, b), c); }

/// splitmix64: a 64-bit generator with a 64-bit state; every state gives a full-period stream.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() { return mix64(state_ += 0x9e3779b97f4a7c15ULL); }
  /// Uniform integer in [0, n), n >= 1, without modulo bias (Lemire's multiply-and-reject).
  uint64_t below(uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  uint64_t state_;
};

/// The order of epoch `epoch`: a permutation of [0, n) from (seed, epoch) alone, by Fisher-Yates.
inline std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  SplitMix64 rng(hash_key(seed, 0x6f72646572ULL /* "order" */, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

}  // namespace data
