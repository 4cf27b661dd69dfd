// float32 to bfloat16 with stochastic rounding (trainer/numerics/stochastic_round.h): each rounding is one
// of the two neighbours, the mean of many is the value, an update below bfloat16's resolution survives on
// average where round to nearest loses it, the bits are the same for the same key and index.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "trainer/numerics/stochastic_round.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_stochastic_round {

using trainer::random16;
using trainer::round_stochastic;
using trainer::stochastic_key;

namespace {

// The two bfloat16 values around x: towards zero (x's upper 16 bits) and the next one away from zero.
std::pair<float, float> neighbours(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t down = bits & 0xFFFF0000u, up = down + 0x10000u;
  float a, b;
  std::memcpy(&a, &down, sizeof a);
  std::memcpy(&b, &up, sizeof b);
  return {a, b};
}

}  // namespace

// Over a million roundings of one value, every result is one of its two neighbours and their mean is
// within 3e-5 of the value (the standard error is at most 2^-9 / 1000 = 2e-6 for values near 1).
TEST(StochasticRound, TheMeanOfManyRoundingsIsTheValue) {
  const uint64_t key = stochastic_key(7, 3, 1);
  for (float x : {1.0f + 1e-3f, 0.3f, -0.7071f, 1.999f, 3.3e-3f}) {
    const auto [a, b] = neighbours(x);
    ASSERT_NE(a, x) << "a value bfloat16 holds exactly would not test the rounding";
    double sum = 0;
    const int64_t n = 1000000;
    int64_t away = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float r = static_cast<float>(round_stochastic(x, random16(key, i)));
      ASSERT_TRUE(r == a || r == b) << x << " rounded to " << r;
      away += r == b;
      sum += r;
    }
    EXPECT_NEAR(sum / n, x, 3e-5) << x;
    // The share rounded away is the lower 16 bits over 2^16.
    EXPECT_NEAR(static_cast<double>(away) / n, (x - a) / (b - a), 0.005) << x;
  }
}

// A weight of 1 moved by -1e-4 a step for 1,000 steps: bfloat16's spacing below 1 is 2^-8 = 0.0039, so
// round to nearest gives 1 back every step, and the 0.1 is lost. Rounded stochastically, 1,000 weights
// (each its own chain, each step its own key) end at 0.9 on average (the spread of the mean: about 0.002).
TEST(StochasticRound, AnUpdateBelowTheResolutionSurvivesOnAverage) {
  const int weights = 1000, steps = 1000;
  const float update = -1e-4f;
  c10::BFloat16 nearest(1.0f);
  std::vector<c10::BFloat16> w(weights, c10::BFloat16(1.0f));
  for (int s = 0; s < steps; ++s) {
    nearest = c10::BFloat16(static_cast<float>(nearest) + update);
    const uint64_t key = stochastic_key(0, s, 0);
    for (int i = 0; i < weights; ++i) w[i] = round_stochastic(static_cast<float>(w[i]) + update, random16(key, i));
  }
  EXPECT_EQ(static_cast<float>(nearest), 1.0f) << "round to nearest kept an update below the resolution";
  double mean = 0;
  for (const auto& v : w) mean += static_cast<float>(v);
  mean /= weights;
  EXPECT_NEAR(mean, 1.0 + steps * update, 0.01);
}

// The same key and index give the same bits; another step, tensor or seed gives others.
TEST(StochasticRound, BitsDependOnlyOnKeyAndIndex) {
  const uint64_t key = stochastic_key(1, 10, 2);
  EXPECT_EQ(random16(key, 5), random16(stochastic_key(1, 10, 2), 5));
  int same_step = 0, same_tensor = 0, same_seed = 0;
  for (int i = 0; i < 256; ++i) {
    same_step += random16(key, i) == random16(stochastic_key(1, 11, 2), i);
    same_tensor += random16(key, i) == random16(stochastic_key(1, 10, 3), i);
    same_seed += random16(key, i) == random16(stochastic_key(2, 10, 2), i);
  }
  EXPECT_LT(same_step, 4);
  EXPECT_LT(same_tensor, 4);
  EXPECT_LT(same_seed, 4);
  std::vector<float> x = {0.1f, 0.2f, 0.3f};
  std::vector<c10::BFloat16> a(3), b(3);
  round_stochastic(x.data(), 3, key, 100, a.data());
  for (int i = 0; i < 3; ++i) b[i] = round_stochastic(x[i], random16(key, 100 + i));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a[i].x, b[i].x) << i;
}

// Infinities and NaNs keep their class; the largest finite value may round away to infinity, as
// rounding up past the largest bfloat16 does.
TEST(StochasticRound, InfinitiesAndNaNs) {
  const float inf = std::numeric_limits<float>::infinity();
  for (uint32_t r : {0u, 0x8000u, 0xFFFFu}) {
    EXPECT_EQ(static_cast<float>(round_stochastic(inf, r)), inf);
    EXPECT_EQ(static_cast<float>(round_stochastic(-inf, r)), -inf);
    EXPECT_TRUE(std::isnan(static_cast<float>(round_stochastic(std::nanf(""), r))));
  }
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(static_cast<float>(round_stochastic(big, 0)), inf) << "lower bits all set: away unless r is 0xFFFF";
  EXPECT_TRUE(std::isfinite(static_cast<float>(round_stochastic(big, 0xFFFFu))));
}

}  // namespace test_stochastic_round
