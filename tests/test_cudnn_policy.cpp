// The cuDNN policy (trainer/step/cudnn_policy.h) as pure logic: for every mode, which attempt runs with
// cuDNN's benchmark flag on, which sizes are first used and which timed, the rerun of a timing that ran
// out of memory, pretune's sizes, and the records. Hand-worked sequences, no model and no GPU; the step's
// use of it under a real cap is in test_backoff.cpp.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainer/config/config.h"
#include "trainer/step/cudnn_policy.h"
#include "trainer/run/from_config.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_cudnn_policy {

using trainer::CudnnAttempt;
using trainer::CudnnMode;
using trainer::CudnnPolicy;
using trainer::CudnnPolicyOptions;
using V = std::vector<int64_t>;

namespace {

CudnnPolicy policy(CudnnMode mode, bool retry = false, int64_t settle = 3) {
  CudnnPolicyOptions o;
  o.mode = mode;
  o.retry_tuning_oom = retry;
  o.settle_steps = settle;
  return CudnnPolicy(o);
}

// One training run's sizes as the ladder takes them: start at 8, back off to 4 (two micro-batches of 4),
// grow back to 8, a grow-back probe at 6 ({6, 2}), and 8 again.
const std::vector<V> kRun = {{8}, {8}, {4, 4}, {4, 4}, {8}, {6, 2}, {8}};

std::vector<bool> flags(CudnnPolicy& p, const std::vector<V>& steps) {
  std::vector<bool> out;
  for (const auto& s : steps) {
    out.push_back(p.decide(CudnnAttempt::kStep, s).benchmark);
    p.on_clean_step(s);
  }
  return out;
}

}  // namespace

TEST(CudnnPolicy, StartTimesOnlyTheSizesTheRunStartsAt) {
  auto p = policy(CudnnMode::kStart);
  const auto d1 = p.decide(CudnnAttempt::kStep, {8});
  EXPECT_TRUE(d1.benchmark);
  EXPECT_EQ(d1.sizes, V({8}));
  EXPECT_EQ(d1.new_sizes, V({8}));
  EXPECT_EQ(d1.tuned_sizes(), V({8}));
  EXPECT_EQ(flags(p, {kRun.begin() + 1, kRun.end()}), std::vector<bool>({false, false, false, false, false, false}));
  // The backoff's and the probe's sizes took the heuristics; the grow-back to 8 finds 8 timed.
  EXPECT_TRUE(p.tuned(8));
  EXPECT_FALSE(p.tuned(4));
  EXPECT_FALSE(p.tuned(6));
  EXPECT_FALSE(p.tuned(2));
  EXPECT_TRUE(p.used(6) && p.used(2) && p.used(4));
  EXPECT_EQ(p.tuned_sizes(), V({8}));
}

TEST(CudnnPolicy, StartTimesTheSearchsConfirmProbesAndNotItsCalibration) {
  auto p = policy(CudnnMode::kStart);
  // micro_batch auto over a batch of 64: the floor and the second point measure, the prediction is
  // confirmed (timed: the run will likely start there), a failed prediction's fallback is confirmed too.
  EXPECT_FALSE(p.decide(CudnnAttempt::kCalibrationProbe, {1, 1}).benchmark);
  EXPECT_FALSE(p.decide(CudnnAttempt::kCalibrationProbe, {8, 8}).benchmark);
  EXPECT_TRUE(p.decide(CudnnAttempt::kConfirmProbe, {40, 24}).benchmark);
  EXPECT_FALSE(p.decide(CudnnAttempt::kConfirmProbe, {40, 24}).benchmark) << "nothing new: nothing to time";
  // The first step at the pick, {40, 24}: both used; at a pick whose rest is new ({36, 28} after a
  // confirm at 36 alone), the first step times the rest.
  EXPECT_FALSE(p.decide(CudnnAttempt::kStep, {40, 24}).benchmark);
  EXPECT_TRUE(p.tuned(40) && p.tuned(24));
  EXPECT_FALSE(p.tuned(8));

  auto q = policy(CudnnMode::kStart);
  q.decide(CudnnAttempt::kConfirmProbe, {36, 36});
  const auto first = q.decide(CudnnAttempt::kStep, {36, 28});
  EXPECT_TRUE(first.benchmark);
  EXPECT_EQ(first.new_sizes, V({28}));
  EXPECT_FALSE(q.decide(CudnnAttempt::kStep, {18, 18, 18, 10}).benchmark) << "after the first step: heuristics";
}

TEST(CudnnPolicy, AlwaysAndOff) {
  auto a = policy(CudnnMode::kAlways);
  EXPECT_EQ(flags(a, kRun), std::vector<bool>(kRun.size(), true));
  EXPECT_EQ(a.tuned_sizes(), V({2, 4, 6, 8}));
  EXPECT_TRUE(a.decide(CudnnAttempt::kCalibrationProbe, {3}).benchmark);
  EXPECT_TRUE(a.evaluation_benchmark());

  auto o = policy(CudnnMode::kOff);
  EXPECT_EQ(flags(o, kRun), std::vector<bool>(kRun.size(), false));
  EXPECT_FALSE(o.decide(CudnnAttempt::kConfirmProbe, {3}).benchmark);
  EXPECT_FALSE(o.decide(CudnnAttempt::kPretune, {5}).benchmark);
  EXPECT_TRUE(o.tuned_sizes().empty());
  EXPECT_TRUE(o.used(8) && o.used(5));
  EXPECT_FALSE(o.evaluation_benchmark());
  EXPECT_FALSE(policy(CudnnMode::kStart).evaluation_benchmark());
}

TEST(CudnnPolicy, SettleBenchmarksOnceAfterASizeHeldItsSteps) {
  auto p = policy(CudnnMode::kSettle, false, /*settle=*/2);
  // 8 new (heuristics), held 1, held 2 -> the third step at 8 has the flag on, once; 4 new, held 1 and 2,
  // then the flag again for 4; back at 8: already settled.
  const std::vector<V> steps = {{8}, {8}, {8}, {8}, {4, 4}, {4, 4}, {4, 4}, {4, 4}, {8}, {8}, {8}};
  EXPECT_EQ(flags(p, steps), std::vector<bool>({false, false, true, false, false, false, true, false, false, false,
                                                false}));
  // Neither was timed at its first use, which is what LibTorch's plan cache keeps (see the header).
  EXPECT_TRUE(p.tuned_sizes().empty());
  // A step at other sizes starts the count again: 8, 4, 8, 4 never holds 2 steps.
  auto q = policy(CudnnMode::kSettle, false, 2);
  EXPECT_EQ(flags(q, {{8}, {4}, {8}, {4}, {8}}), std::vector<bool>(5, false));
  EXPECT_FALSE(q.decide(CudnnAttempt::kCalibrationProbe, {8}).benchmark);
}

TEST(CudnnPolicy, ATimingThatRanOutOfMemoryIsRunAgainWithTheHeuristicsOnce) {
  auto p = policy(CudnnMode::kStart, /*retry=*/true);
  EXPECT_FALSE(p.on_oom()) << "nothing decided yet";
  const auto first = p.decide(CudnnAttempt::kStep, {8});
  ASSERT_TRUE(first.benchmark);
  EXPECT_TRUE(p.on_oom());
  const auto again = p.decide(CudnnAttempt::kStep, {8});
  EXPECT_TRUE(again.retry);
  EXPECT_FALSE(again.benchmark);
  EXPECT_TRUE(again.new_sizes.empty());
  EXPECT_NE(again.reason.find("the attempt that timed micro-batch 8 ran out of memory"), std::string::npos)
      << again.reason;
  EXPECT_FALSE(p.on_oom()) << "a rerun that fails goes to the ladder";
  // The ladder's next size takes the heuristics; its OOM is not a timing's.
  EXPECT_FALSE(p.decide(CudnnAttempt::kStep, {4, 4}).benchmark);
  EXPECT_FALSE(p.on_oom());
  // A confirm probe that timed and failed is run again too.
  EXPECT_TRUE(p.decide(CudnnAttempt::kConfirmProbe, {6}).benchmark);
  EXPECT_TRUE(p.on_oom());
  EXPECT_TRUE(p.decide(CudnnAttempt::kConfirmProbe, {6}).retry);

  // Not without the option (a device where nothing is timed), and never in `always`.
  auto q = policy(CudnnMode::kStart, false);
  q.decide(CudnnAttempt::kStep, {8});
  EXPECT_FALSE(q.on_oom());
  auto a = policy(CudnnMode::kAlways, true);
  a.decide(CudnnAttempt::kStep, {8});
  EXPECT_FALSE(a.on_oom());
}

TEST(CudnnPolicy, PretuneSizesAreTheLaddersNextHalvings) {
  auto p = policy(CudnnMode::kPretune);
  EXPECT_EQ(p.pretune_sizes(256, 256, 1), V({128, 64, 32}));
  // Halvings of 10 round up (5, 3, 2) and a step at 3 is {3, 3, 3, 1}: its rest is a size of its own.
  EXPECT_EQ(p.pretune_sizes(10, 10, 1), V({5, 3, 2, 1}));
  // Not below the floor (16: the halvings of 40 are 20, then 16), nothing the start's own step runs
  // ({40, 24} at 40 of 64), nothing used already; a step at 20 is {20, 20, 20, 4}: 4 is a shape too.
  EXPECT_EQ(p.pretune_sizes(64, 40, 16), V({20, 16, 4}));
  p.decide(CudnnAttempt::kCalibrationProbe, {64});
  p.decide(CudnnAttempt::kCalibrationProbe, {128});
  EXPECT_EQ(p.pretune_sizes(256, 256, 1), V({32}));
  // The passes are timed, and the first step still times the start.
  EXPECT_TRUE(p.decide(CudnnAttempt::kPretune, {32}).benchmark);
  EXPECT_TRUE(p.decide(CudnnAttempt::kStep, {256}).benchmark);
  EXPECT_EQ(policy(CudnnMode::kStart).pretune_sizes(256, 256, 1), V());
  EXPECT_NE(testutil::error_text([&] { p.pretune_sizes(8, 16, 1); }).find("pretune needs 1 <= floor <= start <= global"),
            std::string::npos);
}

TEST(CudnnPolicy, RecordsFirstUsesTimingsAndReruns) {
  auto p = policy(CudnnMode::kStart, true);
  p.decide(CudnnAttempt::kStep, {8});     // recorded: a first use, timed
  p.decide(CudnnAttempt::kStep, {8});     // not: nothing new, flag off
  p.decide(CudnnAttempt::kStep, {4, 4});  // recorded: a first use
  auto recs = p.take_decisions();
  ASSERT_EQ(recs.size(), 2u);
  const auto j = recs[0].to_json();
  EXPECT_EQ(j.at("event"), "cudnn");
  EXPECT_EQ(j.at("attempt"), "step");
  EXPECT_EQ(j.at("sizes"), nlohmann::json({8}));
  EXPECT_EQ(j.at("new_sizes"), nlohmann::json({8}));
  EXPECT_EQ(j.at("tuned_sizes"), nlohmann::json({8}));
  EXPECT_EQ(j.at("benchmark"), true);
  EXPECT_EQ(j.at("retry"), false);
  EXPECT_EQ(j.at("reason"), "the run starts at micro-batch 8: timing it");
  EXPECT_EQ(recs[1].to_json().at("tuned_sizes"), nlohmann::json::array());
  EXPECT_TRUE(p.take_decisions().empty());
  // In `always` the flag is on for every attempt: only first uses are recorded.
  auto a = policy(CudnnMode::kAlways);
  a.decide(CudnnAttempt::kStep, {8});
  a.decide(CudnnAttempt::kStep, {8});
  EXPECT_EQ(a.take_decisions().size(), 1u);
}

TEST(CudnnPolicy, NamesAndBadOptions) {
  for (const char* n : {"always", "off", "start", "pretune", "settle"})
    EXPECT_EQ(trainer::mode_name(trainer::mode_from_name<CudnnMode>(n)), n);
  EXPECT_EQ(testutil::error_text([] { trainer::mode_from_name<CudnnMode>("fast"); }),
            "'fast' is not one of: always, off, start, pretune, settle");
  CudnnPolicyOptions o;
  o.settle_steps = 0;
  EXPECT_EQ(testutil::error_text([&] { CudnnPolicy p(o); }), "cuDNN policy: settle_steps must be >= 1, got 0");
  auto p = policy(CudnnMode::kStart);
  EXPECT_NE(testutil::error_text([&] { p.decide(CudnnAttempt::kStep, {0}); }).find("must be >= 1, got 0"),
            std::string::npos);
  EXPECT_EQ(trainer::distinct_sizes({4, 8, 4, 2}), V({8, 4, 2}));
}

// The keys of the policy and of the search in the config: defaults, values taken, and bad values named
// with the key (exit 2 through the command line, as every config error).
TEST(CudnnPolicyConfig, KeysAreReadAndBadValuesNamed) {
  const trainer::Config d = trainer::load_config("", {"train.steps=1", "train.epochs=0"});
  EXPECT_EQ(d.memory.cudnn_policy, CudnnMode::kOff) << "timing cost an H200 4.6-13.1 s before the first step, for nothing after";
  EXPECT_EQ(trainer::step_options(d, torch::Device(torch::kCPU)).cudnn.mode, CudnnMode::kOff);
  EXPECT_EQ(CudnnPolicyOptions().mode, CudnnMode::kOff) << "the policy's own default is the config's";
  EXPECT_EQ(d.memory.auto_search, trainer::AutoSearch::kAuto);
  EXPECT_EQ(trainer::step_options(d, torch::Device(torch::kCPU)).auto_search, trainer::AutoSearch::kAuto);
  EXPECT_EQ(trainer::load_config("", {"train.steps=1", "train.epochs=0", "memory.auto_search=curve"}).memory.auto_search,
            trainer::AutoSearch::kCurve);
  EXPECT_EQ(trainer::load_config("", {"train.steps=1", "train.epochs=0", "memory.cudnn_policy=start"}).memory.cudnn_policy,
            CudnnMode::kStart);
  EXPECT_EQ(d.memory.ladder_sizes, trainer::LadderSizes::kAny);
  EXPECT_EQ(d.memory.cudnn_benchmark_limit, 0);
  EXPECT_TRUE(d.memory.cudnn_empty_cache);
  const trainer::Config c = trainer::load_config(
      "", {"train.steps=1", "train.epochs=0", "memory.cudnn_policy=pretune", "memory.auto_search=doubling", "memory.ladder_sizes=halvings",
           "memory.cudnn_benchmark_limit=3", "memory.cudnn_empty_cache=false"});
  EXPECT_EQ(c.memory.cudnn_policy, CudnnMode::kPretune);
  EXPECT_EQ(c.memory.cudnn_benchmark_limit, 3);
  EXPECT_FALSE(c.memory.cudnn_empty_cache);
  const auto o = trainer::step_options(c, torch::Device(torch::kCPU));
  EXPECT_EQ(o.cudnn.mode, CudnnMode::kPretune);
  EXPECT_FALSE(o.cudnn.retry_tuning_oom) << "no timing on the CPU";
  EXPECT_EQ(o.auto_search, trainer::AutoSearch::kDoubling);
  EXPECT_TRUE(trainer::micro_batch_options(c, 8).halvings_only);
  // A deterministic run never times (timing may choose other algorithms from run to run).
  EXPECT_EQ(trainer::step_options(trainer::load_config("", {"train.steps=1", "train.epochs=0", "train.deterministic=true"}),
                                  torch::Device(torch::kCPU))
                .cudnn.mode,
            CudnnMode::kOff);
  auto error = [](const std::string& set) {
    return testutil::error_text([&] { trainer::load_config("", {"train.steps=1", "train.epochs=0", set}); });
  };
  EXPECT_EQ(error("memory.cudnn_policy=fast"), "--set memory.cudnn_policy=fast: key 'memory.cudnn_policy': 'fast' is "
                                               "not one of: always, off, start, pretune, settle");
  EXPECT_EQ(error("memory.auto_search=bisect"),
            "--set memory.auto_search=bisect: key 'memory.auto_search': 'bisect' is not one of: auto, curve, doubling");
  EXPECT_EQ(error("memory.ladder_sizes=powers"),
            "--set memory.ladder_sizes=powers: key 'memory.ladder_sizes': 'powers' is not one of: any, halvings");
  EXPECT_EQ(error("memory.cudnn_benchmark_limit=-1"),
            "config: key 'memory.cudnn_benchmark_limit': must be in [0, 10000] (0 = LibTorch's default, 10)");
}

}  // namespace test_cudnn_policy
