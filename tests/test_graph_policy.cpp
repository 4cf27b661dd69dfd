// The CUDA graph policy (trainer/step/graph_policy.h) as pure logic: which jobs can capture, when a
// layout is captured (after its warmup), what makes a held graph stale (the micro-batches, checkpointing,
// the batch's shape, a cut limit), what an OOM and a failed capture do, and the records. Hand-worked
// sequences, no model and no GPU; the step's use of it on a GPU is in test_step.cpp
// (StepInProcess.ACudaGraphRunGivesTheLossesAndWeightsOfTheEagerRun), and the key's refusal on the CPU in
// test_hostile.cpp.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainer/config/config.h"
#include "trainer/step/graph_policy.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_graph_policy {

using trainer::GraphAction;
using trainer::GraphJob;
using trainer::GraphKey;
using trainer::Switch;
using trainer::GraphPolicy;
using trainer::GraphPolicyOptions;

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

GraphJob cuda_job() {
  GraphJob j;
  j.cuda = true;
  return j;
}

GraphPolicy policy(Switch mode = Switch::kAuto, int64_t warmup = 2, GraphJob job = cuda_job()) {
  GraphPolicyOptions o;
  o.mode = mode;
  o.warmup_steps = warmup;
  return GraphPolicy(o, job);
}

GraphKey key(std::vector<int64_t> sizes, int64_t limit = 8 * kGiB, bool checkpointing = false) {
  GraphKey k;
  k.sizes = std::move(sizes);
  k.checkpointing = checkpointing;
  k.input_shape = {256, 3, 224, 224};
  k.limit = limit;
  return k;
}

// One step as Step::run carries it out: the decision, then what the step reports back. Returns the action.
GraphAction step(GraphPolicy& p, const GraphKey& k) {
  const GraphAction a = p.decide(k);
  if (a == GraphAction::kCapture) p.on_captured(3 * kGiB, 0.25);
  else if (a == GraphAction::kEager) p.on_clean_step(k);
  return a;
}

std::vector<std::string> kinds(GraphPolicy& p) {
  std::vector<std::string> out;
  for (const auto& e : p.take_events()) out.push_back(e.kind);
  return out;
}

}  // namespace

TEST(GraphPolicy, TheKeyNamesItsModesAndRefusesAnUnknownOne) {
  for (Switch m : {Switch::kAuto, Switch::kOn, Switch::kOff})
    EXPECT_EQ(trainer::load_config("", {"train.cuda_graph=" + trainer::mode_name(m)}).train.cuda_graph, m);
  EXPECT_EQ(testutil::error_text([] { trainer::load_config("", {"train.cuda_graph=maybe"}); }),
            "--set train.cuda_graph=maybe: key 'train.cuda_graph': 'maybe' is not one of: auto, on, off");
}

TEST(GraphPolicy, AutoRunsEagerlyWhereTheJobCannotCaptureAndOnRefusesIt) {
  GraphJob cpu;  // cuda false
  GraphJob ddp = cuda_job();
  ddp.single_process = false;
  GraphJob plain = cuda_job();
  plain.fused_optimizer = false;
  GraphJob mixed = cuda_job();
  mixed.host_draws = true;
  EXPECT_EQ(trainer::graph_ineligible_reason(cuda_job()), "");
  for (const auto& [job, fragment] : std::vector<std::pair<GraphJob, std::string>>{
           {cpu, "CUDA device"}, {ddp, "data parallel"}, {plain, "fused optimizer"}, {mixed, "Mixup and CutMix"}}) {
    EXPECT_NE(trainer::graph_ineligible_reason(job).find(fragment), std::string::npos);
    GraphPolicy a = policy(Switch::kAuto, 1, job);
    EXPECT_FALSE(a.enabled());
    EXPECT_NE(a.disabled_reason().find(fragment), std::string::npos);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(step(a, key({64})), GraphAction::kEager);
    EXPECT_TRUE(a.take_events().empty()) << "auto off a GPU is silent";
    try {
      policy(Switch::kOn, 1, job);
      FAIL() << "on accepted for " << fragment;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("train.cuda_graph: on, but ", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
  GraphPolicy off = policy(Switch::kOff);
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.disabled_reason(), "train.cuda_graph is off");
  for (int i = 0; i < 5; ++i) EXPECT_EQ(step(off, key({64})), GraphAction::kEager);
  EXPECT_THROW(policy(Switch::kAuto, 0), std::invalid_argument);
}

TEST(GraphPolicy, CapturesAfterTheWarmupThenReplays) {
  GraphPolicy p = policy(Switch::kOn, 2);
  EXPECT_TRUE(p.enabled());
  const std::vector<GraphAction> want = {GraphAction::kEager, GraphAction::kEager, GraphAction::kCapture,
                                         GraphAction::kReplay, GraphAction::kReplay};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(step(p, key({128, 128})), want[i]) << "step " << i + 1;
  EXPECT_TRUE(p.holds_graph());
  EXPECT_EQ(p.held_peak_bytes(), 3 * kGiB);
  EXPECT_EQ(p.captures(), 1);
  EXPECT_DOUBLE_EQ(p.capture_seconds(), 0.25);
  const auto events = p.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, "capture");
  EXPECT_EQ(events[0].sizes, (std::vector<int64_t>{128, 128}));
  EXPECT_NE(events[0].reason.find("micro-batches 128+128 captured in 250 ms after 2 eager steps"), std::string::npos)
      << events[0].reason;
  const auto j = events[0].to_json();
  EXPECT_EQ(j.at("event"), "cuda_graph");
  EXPECT_EQ(j.at("kind"), "capture");
}

TEST(GraphPolicy, TheWarmupCountsCleanStepsOfOneLayoutOnly) {
  GraphPolicy p = policy(Switch::kAuto, 3);
  EXPECT_EQ(step(p, key({64})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({64})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager) << "another layout starts the count again";
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kCapture) << "three clean steps at 32+32";
  // A raised limit neither restarts a warmup nor stales a graph.
  EXPECT_EQ(step(p, key({32, 32}, 9 * kGiB)), GraphAction::kReplay);
  EXPECT_EQ(p.held_key().limit, 9 * kGiB) << "a later cut is judged from the raised limit";
}

TEST(GraphPolicy, ANewLayoutACutLimitCheckpointingOrAnotherShapeReleasesTheGraph) {
  struct Case {
    const char* what;
    GraphKey next;
    std::string reason;
  };
  GraphKey shape = key({64});
  shape.input_shape = {37, 3, 224, 224};
  const std::vector<Case> cases = {
      {"a backoff", key({32, 32}), "the micro-batches changed from 64 to 32+32"},
      {"a grow-back probe", key({96}), "the micro-batches changed from 64 to 96"},
      {"a cut limit", key({64}, 6 * kGiB), "the limit fell from 8.00 GiB to 6.00 GiB"},
      {"checkpointing", key({64}, 8 * kGiB, true), "activation checkpointing turned on"},
      {"a short last batch", shape, "the batch's shape changed"},
  };
  for (const auto& c : cases) {
    GraphPolicy p = policy(Switch::kAuto, 1);
    EXPECT_EQ(step(p, key({64})), GraphAction::kEager);
    EXPECT_EQ(step(p, key({64})), GraphAction::kCapture);
    p.take_events();
    EXPECT_EQ(p.decide(c.next), GraphAction::kEager) << c.what;
    EXPECT_FALSE(p.holds_graph()) << c.what;
    const auto events = p.take_events();
    ASSERT_EQ(events.size(), 1u) << c.what;
    EXPECT_EQ(events[0].kind, "release");
    EXPECT_NE(events[0].reason.find(c.reason), std::string::npos) << c.what << ": " << events[0].reason;
    EXPECT_EQ(events[0].sizes, (std::vector<int64_t>{64}));
  }
}

TEST(GraphPolicy, CheckpointedStepsStayEagerAndTheLayoutAfterThemIsCapturedAgain) {
  GraphPolicy p = policy(Switch::kAuto, 1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(step(p, key({16}, 8 * kGiB, true)), GraphAction::kEager);
  EXPECT_EQ(p.captures(), 0);
  EXPECT_EQ(step(p, key({16})), GraphAction::kEager) << "the first step without recomputation warms up";
  EXPECT_EQ(step(p, key({16})), GraphAction::kCapture);
}

TEST(GraphPolicy, AnOomReleasesTheGraphAndTheLaddersRungWarmsUpBeforeItsCapture) {
  GraphPolicy p = policy(Switch::kAuto, 2);
  step(p, key({64}));
  step(p, key({64}));
  ASSERT_EQ(p.decide(key({64})), GraphAction::kCapture);
  p.on_oom();  // the capture ran out of memory: no graph, the warmup starts again
  EXPECT_FALSE(p.holds_graph());
  EXPECT_TRUE(p.take_events().empty()) << "nothing was held: nothing to release";
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager) << "the rung the ladder took";
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kCapture);
  p.take_events();
  p.on_oom();  // an OOM while a graph is held (a backoff's eager step under a cut cap): released, said once
  EXPECT_EQ(kinds(p), (std::vector<std::string>{"release"}));
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kEager);
  EXPECT_EQ(step(p, key({32, 32})), GraphAction::kCapture);
  p.on_oom();
  EXPECT_EQ(kinds(p), (std::vector<std::string>{"capture", "release"}));
}

TEST(GraphPolicy, ACutLimitRestartsTheWarmup) {
  GraphPolicy p = policy(Switch::kAuto, 2);
  step(p, key({64}, 8 * kGiB));
  EXPECT_EQ(step(p, key({64}, 6 * kGiB)), GraphAction::kEager) << "one clean step under the new cap so far";
  EXPECT_EQ(step(p, key({64}, 6 * kGiB)), GraphAction::kEager);
  EXPECT_EQ(step(p, key({64}, 6 * kGiB)), GraphAction::kCapture);
}

TEST(GraphPolicy, AFailedCaptureTurnsGraphsOffForTheRunWithOneEvent) {
  GraphPolicy p = policy(Switch::kOn, 1);
  step(p, key({64}));
  ASSERT_EQ(p.decide(key({64})), GraphAction::kCapture);
  p.on_capture_failed("operation not permitted when stream is capturing");
  EXPECT_FALSE(p.enabled());
  EXPECT_EQ(p.disabled_reason(), "a capture failed: operation not permitted when stream is capturing");
  const auto events = p.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, "disabled");
  EXPECT_NE(events[0].reason.find("the rest of the run is eager"), std::string::npos);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(step(p, key({64})), GraphAction::kEager);
  EXPECT_TRUE(p.take_events().empty());
}

}  // namespace test_graph_policy
