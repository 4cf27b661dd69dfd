// memory.auto_search: auto (trainer/step/search_choice.h): which search after the first two probes, timed
// with a fake clock on a simulated device whose passes cost a known fixed + per-sample time; and which
// size among those that fit, from a speed table. Every expected figure is worked by hand here.
#include "trainer/step/search_choice.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "trainer/memory/oom.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_auto_search {

using trainer::PassCost;
using trainer::PassTimer;
using trainer::SpeedPoint;
using V = std::vector<int64_t>;

namespace {

// A device that only keeps time: a pass of m samples advances the clock by truth.at(m), and each
// synchronization is counted (the timer must wait for the device on both sides of a pass).
struct FakeDevice {
  PassCost truth;
  double now = 100.0;  // not 0: the timer must subtract its first reading
  int syncs = 0;
  PassTimer timer() {
    return PassTimer([this] { return now; }, [this] { ++syncs; });
  }
  void pass(int64_t m) { now += truth.at(m); }
};

// What auto does after its first two probes, timed on `dev`: a warm pass at each, the line through them,
// and choose_search over [lo, hi] of a batch of `batch` with `predicted` the largest size that fits.
trainer::SearchChoice choose_on(FakeDevice& dev, int64_t lo, int64_t second, int64_t hi, int64_t predicted,
                                int64_t batch, double budget = trainer::kAutoSearchBudgetS) {
  const PassTimer t = dev.timer();
  const double s1 = t.time([&] { dev.pass(lo); });
  const double s2 = t.time([&] { dev.pass(second); });
  return trainer::choose_search(PassCost::through(lo, s1, second, s2), lo, second, true, hi, predicted, batch, budget);
}

// The probes doubling and bisection run from 8 in [8, 256] when 99 is the largest that fits (by hand:
// 16, 32, 64 fit, 128 fails; bisecting 64..128: 96 fits, 112, 104, 100 fail, 98 and 99 fit). Every one
// is below half the batch of 256 or at it, so each probe is two passes of its size.
const V kProbesTo99 = {16, 32, 64, 128, 96, 112, 104, 100, 98, 99};

double two_passes_each(const PassCost& c, const V& sizes) {
  double s = 0;
  for (int64_t m : sizes) s += 2 * (c.fixed_s + c.per_sample_s * static_cast<double>(m));
  return s;
}

}  // namespace

TEST(AutoSearchTimer, TimesThePassBetweenTwoSynchronizations) {
  FakeDevice dev{{0.5, 0.25}};
  const PassTimer t = dev.timer();
  EXPECT_DOUBLE_EQ(t.time([&] { dev.pass(6); }), 2.0);  // 0.5 + 0.25 x 6
  EXPECT_EQ(dev.syncs, 2);
  EXPECT_DOUBLE_EQ(dev.now, 102.0);
  // Without a synchronization (the CPU) the clock alone.
  double now = 7;
  EXPECT_DOUBLE_EQ(PassTimer([&] { return now; }).time([&] { now += 0.125; }), 0.125);
  EXPECT_NE(testutil::error_text([] { PassTimer t2{PassTimer::Clock{}}; }).find("a clock is required"), std::string::npos);
}

// A speed figure is the fastest of passes repeated until they add up to kSpeedMinTimedS (0.1 s), five at
// most: the passes below take 30, 20, 40, 50 ms (0.14 s after four).
TEST(AutoSearchTimer, ASpeedIsTheFastestOfRepeatedPasses) {
  double now = 0;
  std::vector<double> costs = {0.03, 0.02, 0.04, 0.05, 0.01, 0.01};
  size_t ran = 0;
  const PassTimer t([&] { return now; });
  EXPECT_NEAR(t.fastest([&] { now += costs[ran++]; }), 0.02, 1e-12);
  EXPECT_EQ(ran, 4u);
  ran = 0;
  costs = {0.001, 0.002, 0.001, 0.0005, 0.001, 0.0001};
  EXPECT_NEAR(t.fastest([&] { now += costs[ran++]; }), 0.0005, 1e-12);
  EXPECT_EQ(ran, 5u) << "five passes at most";
  ran = 0;
  costs = {0.25, 0.01};
  EXPECT_NEAR(t.fastest([&] { now += costs[ran++]; }), 0.25, 1e-12);
  EXPECT_EQ(ran, 1u) << "one pass long enough is enough";
}

TEST(AutoSearchCost, TheLineThroughTwoWarmPasses) {
  // GPU-like: 12 ms + 0.2 ms a sample, from passes at 1 (12.2 ms) and 8 (13.6 ms).
  PassCost c = PassCost::through(1, 0.0122, 8, 0.0136);
  EXPECT_NEAR(c.per_sample_s, 0.0002, 1e-12);
  EXPECT_NEAR(c.fixed_s, 0.012, 1e-12);
  EXPECT_NEAR(c.at(100), 0.032, 1e-12);
  // The same points in the other order.
  c = PassCost::through(8, 0.0136, 1, 0.0122);
  EXPECT_NEAR(c.per_sample_s, 0.0002, 1e-12);
  // Noise: the larger pass faster. No slope; the larger pass's time is the fixed cost.
  c = PassCost::through(1, 0.013, 8, 0.012);
  EXPECT_EQ(c.per_sample_s, 0.0);
  EXPECT_DOUBLE_EQ(c.fixed_s, 0.012);
  // A line that would cross below zero (1: 0.1 s, 8: 3.2 s; slope 3.1 / 7): all per sample through 8.
  c = PassCost::through(1, 0.1, 8, 3.2);
  EXPECT_EQ(c.fixed_s, 0.0);
  EXPECT_DOUBLE_EQ(c.per_sample_s, 0.4);
  EXPECT_NE(testutil::error_text([] { PassCost::through(4, 1, 4, 2); }).find("two distinct sizes"), std::string::npos);
  EXPECT_NE(testutil::error_text([] { PassCost::through(0, 1, 4, 2); }).find("two distinct sizes"), std::string::npos);
}

TEST(AutoSearchCost, ProbePassesAndTheProjectionOfDoubling) {
  EXPECT_EQ(trainer::probe_pass_sizes(8, 256), V({8, 8}));
  EXPECT_EQ(trainer::probe_pass_sizes(128, 256), V({128, 128}));
  EXPECT_EQ(trainer::probe_pass_sizes(200, 256), V({200, 56}));
  EXPECT_EQ(trainer::probe_pass_sizes(256, 256), V({256}));
  // One second a pass: two passes for each of the ten probes after the first.
  EXPECT_DOUBLE_EQ(trainer::projected_doubling_s({1.0, 0.0}, 8, 256, 99, 256), 20.0);
  const PassCost c{0.012, 0.00015};
  EXPECT_NEAR(trainer::projected_doubling_s(c, 8, 256, 99, 256), two_passes_each(c, kProbesTo99), 1e-12);
  // Everything fits: 16, 32, 64, 128 (two passes each), 256 (the whole batch: one pass).
  EXPECT_DOUBLE_EQ(trainer::projected_doubling_s({0.0, 1.0}, 8, 256, 256, 256), 2.0 * (16 + 32 + 64 + 128) + 256);
  // Nothing above the first: 16 fails, and bisecting 8..16 tries 12, 10, 9.
  EXPECT_DOUBLE_EQ(trainer::projected_doubling_s({0.0, 1.0}, 8, 256, 8, 256), 2.0 * (16 + 12 + 10 + 9));
  EXPECT_NE(testutil::error_text([] { trainer::projected_doubling_s({}, 8, 300, 99, 256); }).find("lo <= hi <= batch"),
            std::string::npos);
}

// The GPU of the issue (ResNet-50 on an H200: a pass is milliseconds) takes doubling; a CPU whose pass
// costs 0.4 s a sample takes the curve. The projections are the hand sums of kProbesTo99.
TEST(AutoSearchChoice, CheapProbesDoubleAndDearOnesTakeTheCurve) {
  FakeDevice gpu{{0.012, 0.00015}};
  const trainer::SearchChoice g = choose_on(gpu, 1, 8, 256, 99, 256);
  EXPECT_EQ(g.method, trainer::AutoSearch::kDoubling) << g.reason;
  EXPECT_TRUE(g.timed);
  EXPECT_NEAR(g.cost.fixed_s, 0.012, 1e-12);
  EXPECT_NEAR(g.cost.per_sample_s, 0.00015, 1e-12);
  EXPECT_NEAR(g.projected_s, two_passes_each(gpu.truth, kProbesTo99), 1e-9);  // 2 x (10 x 12 ms + 849 x 0.15 ms)
  EXPECT_EQ(g.predicted, 99);
  EXPECT_EQ(gpu.syncs, 4);
  EXPECT_EQ(g.reason.rfind("doubling: a pass costs 12.0 ms + 150.0 µs a sample (warm passes at 1 and 8), so doubling "
                           "and bisection from 8 to the predicted 99 would take 494.7 ms, within the 8.00 s budget",
                           0),
            0u)
      << g.reason;

  FakeDevice cpu{{0.0, 0.4}};
  const trainer::SearchChoice c = choose_on(cpu, 1, 8, 256, 99, 256);
  EXPECT_EQ(c.method, trainer::AutoSearch::kCurve) << c.reason;
  EXPECT_NEAR(c.projected_s, two_passes_each(cpu.truth, kProbesTo99), 1e-9);  // 0.8 x 849 = 679.2 s
  EXPECT_NE(c.reason.find("over the 8.00 s budget"), std::string::npos) << c.reason;
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j["method"], "curve");
  EXPECT_EQ(j["predicted"], 99);
  EXPECT_DOUBLE_EQ(j["budget_s"].get<double>(), 8.0);
  EXPECT_NEAR(j["cost"]["per_sample_s"].get<double>(), 0.4, 1e-12);
}

// The boundary: a projection equal to the budget doubles, a hair over it takes the curve. Half a second a
// pass (exact in binary) and twenty passes: 10 s.
TEST(AutoSearchChoice, AProjectionAtTheBudgetDoubles) {
  FakeDevice dev{{0.5, 0.0}};
  EXPECT_EQ(choose_on(dev, 1, 8, 256, 99, 256, 10.0).method, trainer::AutoSearch::kDoubling);
  EXPECT_DOUBLE_EQ(choose_on(dev, 1, 8, 256, 99, 256, 10.0).projected_s, 10.0);
  EXPECT_EQ(choose_on(dev, 1, 8, 256, 99, 256, 9.999).method, trainer::AutoSearch::kCurve);
  // At the default budget of 8 s: 0.4 s a pass is 8 s (within floating-point rounding: 0.4 is not exact).
  FakeDevice near{{0.399, 0.0}}, over{{0.401, 0.0}};
  EXPECT_EQ(choose_on(near, 1, 8, 256, 99, 256).method, trainer::AutoSearch::kDoubling);
  EXPECT_EQ(choose_on(over, 1, 8, 256, 99, 256).method, trainer::AutoSearch::kCurve);
}

TEST(AutoSearchChoice, ASecondProbeThatFailedSearchesBelowItAndPredictionsAreClamped) {
  // 8 did not fit: doubling searches [1, 7] from the floor; one second a pass, largest 5: 2 (fits), 4
  // (fits), 7 (fails), bisect 4..7: 5 (fits), 6 (fails): five probes of two passes.
  const trainer::SearchChoice c = trainer::choose_search({1.0, 0.0}, 1, 8, false, 256, 5, 256, 100.0);
  EXPECT_EQ(c.method, trainer::AutoSearch::kDoubling);
  EXPECT_DOUBLE_EQ(c.projected_s, 10.0);
  EXPECT_EQ(c.predicted, 5);
  // A prediction outside what the probes allow is clamped into it.
  EXPECT_EQ(trainer::choose_search({1.0, 0.0}, 1, 8, false, 256, 300, 256).predicted, 7);
  EXPECT_EQ(trainer::choose_search({1.0, 0.0}, 1, 8, true, 256, 2, 256).predicted, 8);
  EXPECT_NE(testutil::error_text([] { trainer::choose_search({}, 8, 8, true, 256, 99, 256); }).find("lo < second"),
            std::string::npos);
  const trainer::SearchChoice u = trainer::untimed_search_choice();
  EXPECT_EQ(u.method, trainer::AutoSearch::kCurve);
  EXPECT_FALSE(u.timed);
  EXPECT_NE(u.reason.find("carry no timing"), std::string::npos);
}

TEST(AutoSearchSpeed, CandidatesAreTheLargestAndItsHalvingsWithinTheBudget) {
  EXPECT_EQ(trainer::speed_candidates(99, 1), V({99, 50, 25, 13}));
  EXPECT_EQ(trainer::speed_candidates(2698, 1), V({2698, 1349, 675, 338}));
  EXPECT_EQ(trainer::speed_candidates(6, 4), V({6}));
  EXPECT_EQ(trainer::speed_candidates(2, 1), V({2, 1}));
  EXPECT_EQ(trainer::speed_candidates(1, 1), V({1}));
  // 10 ms a sample: 99 ran already (one pass, 0.99 s); 50, 25, 13 did not (two passes: 1.0, 0.5, 0.26 s).
  const PassCost c{0.0, 0.01};
  EXPECT_EQ(trainer::speed_sizes_within(c, {99, 50, 25, 13}, {99}, 2.0), V({99, 50}));
  EXPECT_EQ(trainer::speed_sizes_within(c, {99, 50, 25, 13}, {99}, 2.8), V({99, 50, 25, 13}));
  EXPECT_EQ(trainer::speed_sizes_within(c, {99, 50, 25, 13}, {}, 1.9), V());
}

// The H200 figures of the issue: 2,698 ran at 4,424-4,750 samples/s, 1,024 at 5,655-5,831.
TEST(AutoSearchSpeed, TheFastestWinsOnlyByTheMargin) {
  auto pick = [](const std::vector<SpeedPoint>& t, int64_t largest) { return trainer::choose_fastest(t, largest); };
  const auto h200 = pick({{2698, true, 4587}, {1349, true, 5743}, {675, true, 5500}}, 2698);
  EXPECT_EQ(h200.micro_batch, 1349);
  EXPECT_EQ(h200.largest, 2698);
  EXPECT_NE(h200.reason.find("the fastest, 5743.0 samples/s against 4587.0 at 2698"), std::string::npos) << h200.reason;
  // 3.9% faster is noise: the largest. 4.1% faster wins.
  EXPECT_EQ(pick({{100, true, 1000}, {50, true, 1039}}, 100).micro_batch, 100);
  EXPECT_EQ(pick({{100, true, 1000}, {50, true, 1041}}, 100).micro_batch, 50);
  // A tie goes to the largest, in whatever order the table comes.
  EXPECT_EQ(pick({{50, true, 1000}, {100, true, 1000}}, 100).micro_batch, 100);
  // The largest within the margin of the fastest: 50 is 2.9% slower than 25, 100 is 8% slower.
  const auto mid = pick({{100, true, 1000}, {50, true, 1050}, {25, true, 1080}}, 100);
  EXPECT_EQ(mid.micro_batch, 50);
  EXPECT_NE(mid.reason.find("within 4% of the fastest (1080.0 samples/s at 25)"), std::string::npos) << mid.reason;
  const auto largest = pick({{100, true, 1000}, {50, true, 900}}, 100);
  EXPECT_EQ(largest.micro_batch, 100);
  EXPECT_NE(largest.reason.find("the largest that fits"), std::string::npos);
}

TEST(AutoSearchSpeed, ASizeThatDidNotFitIsNeverChosen) {
  // A size whose timed pass ran out of memory carries no figure that counts, however it is filled in.
  const auto c = trainer::choose_fastest({{100, false, 5000}, {50, true, 1000}, {25, true, 900}}, 100);
  EXPECT_EQ(c.micro_batch, 50);
  EXPECT_EQ(c.table.size(), 3u);
  EXPECT_NE(c.reason.find("100, the largest that fits, out of memory in its timed pass"), std::string::npos) << c.reason;
  // Nothing measured, or nothing that fitted: the largest, as the memory search found it.
  EXPECT_EQ(trainer::choose_fastest({}, 64).micro_batch, 64);
  const auto none = trainer::choose_fastest({{64, false, 0}, {32, false, 0}}, 64);
  EXPECT_EQ(none.micro_batch, 64);
  EXPECT_NE(none.reason.find("no speed was measured"), std::string::npos);
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j["micro_batch"], 50);
  EXPECT_EQ(j["largest"], 100);
  EXPECT_DOUBLE_EQ(j["margin"].get<double>(), trainer::kSpeedMargin);
  ASSERT_EQ(j["table"].size(), 3u);
  EXPECT_EQ(j["table"][0], nlohmann::json({{"micro_batch", 100}, {"fits", false}, {"samples_per_s", 5000.0}}));
}

}  // namespace test_auto_search
