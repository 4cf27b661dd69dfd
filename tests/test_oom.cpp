// The micro-batch controller's rules, checked against hand-worked sequences and a simulated device with
// a known capacity (sizes <= capacity fit). The real allocator under a real cap is in test_memory.cpp.
#include "trainer/memory/oom.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "test_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_oom {

using trainer::MicroBatchController;
using trainer::MicroBatchOptions;
using trainer::OomAction;
using trainer::OomEventKind;
using trainer::ProbeKind;

namespace {

using testutil::kMiB;

std::vector<OomEventKind> kinds(const std::vector<trainer::OomEvent>& events) {
  std::vector<OomEventKind> out;
  for (const auto& e : events) out.push_back(e.kind);
  return out;
}

using testutil::error_text;

}  // namespace

TEST(OomSplit, SizesAreFullMicroBatchesThenTheRest) {
  EXPECT_EQ(trainer::split_batch(10, 4), (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(trainer::split_batch(10, 10), (std::vector<int64_t>{10}));
  EXPECT_EQ(trainer::split_batch(7, 3), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(trainer::split_batch(3, 1), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(trainer::accum_steps_for(10, 3), 4);
  EXPECT_EQ(trainer::accum_steps_for(64, 8), 8);
}

TEST(OomSplit, EverySplitSumsToTheGlobalBatch) {
  for (int64_t g = 1; g <= 60; ++g) {
    for (int64_t m = 1; m <= g; ++m) {
      const auto s = trainer::split_batch(g, m);
      ASSERT_EQ(std::accumulate(s.begin(), s.end(), int64_t(0)), g) << g << "/" << m;
      ASSERT_EQ(static_cast<int64_t>(s.size()), (g + m - 1) / m);
      for (size_t i = 0; i + 1 < s.size(); ++i) ASSERT_EQ(s[i], m);
      ASSERT_GE(s.back(), 1);
      ASSERT_LE(s.back(), m);
    }
  }
}

TEST(OomSplit, RejectsSizesOutsideTheGlobalBatch) {
  EXPECT_THROW(trainer::split_batch(10, 0), std::invalid_argument);
  EXPECT_NE(error_text([] { trainer::split_batch(10, 11); }).find("micro-batch 11 must be in [1, global batch 10]"),
            std::string::npos);
}

TEST(OomController, OptionsAreValidatedWithTheFieldName) {
  MicroBatchOptions o;
  o.global_batch = 32;
  o.min_micro_batch = 64;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("min_micro_batch must be in [1, global_batch = 32]"),
            std::string::npos);
  o.min_micro_batch = 8;
  o.micro_batch = 4;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("micro_batch must be in [min_micro_batch = 8"),
            std::string::npos);
  o.micro_batch = 0;  // = global batch
  o.headroom = 1.0;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("headroom must be in [0, 1)"), std::string::npos);
  o.headroom = 0.2;
  o.grow_after = 0;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("grow_after must be >= 1"), std::string::npos);
  o.grow_after = 1;
  MicroBatchController c(o);
  EXPECT_EQ(c.micro_batch(), 32);
  EXPECT_EQ(c.accum_steps(), 1);
}

TEST(OomController, LadderHalvesToTheFloorThenCheckpointsThenGivesUp) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.min_micro_batch = 8;
  MicroBatchController c(o);
  const int64_t limit = 512 * kMiB;

  OomAction a = c.on_oom(limit);
  EXPECT_EQ(a.kind, OomAction::Kind::kHalve);
  EXPECT_EQ(a.micro_batch, 32);
  EXPECT_EQ(a.accum_steps, 2);
  EXPECT_FALSE(a.checkpointing);
  EXPECT_EQ(a.event.old_micro_batch, 64);
  EXPECT_EQ(a.event.new_micro_batch, 32);
  EXPECT_EQ(a.event.old_accum_steps, 1);
  EXPECT_EQ(a.event.new_accum_steps, 2);
  EXPECT_EQ(a.event.limit_bytes, limit);

  a = c.on_oom(limit);
  EXPECT_EQ(a.kind, OomAction::Kind::kHalve);
  EXPECT_EQ(a.micro_batch, 16);
  EXPECT_EQ(a.accum_steps, 4);
  a = c.on_oom(limit);
  EXPECT_EQ(a.kind, OomAction::Kind::kHalve);
  EXPECT_EQ(a.micro_batch, 8);
  EXPECT_EQ(a.accum_steps, 8);

  a = c.on_oom(limit);
  EXPECT_EQ(a.kind, OomAction::Kind::kEnableCheckpointing);
  EXPECT_EQ(a.micro_batch, 8);  // kept at the floor, not reset
  EXPECT_TRUE(a.checkpointing);
  EXPECT_TRUE(c.checkpointing());
  EXPECT_TRUE(c.checkpointing_by_ladder());
  EXPECT_FALSE(a.event.old_checkpointing);
  EXPECT_TRUE(a.event.new_checkpointing);

  a = c.on_oom(limit);
  EXPECT_EQ(a.kind, OomAction::Kind::kGiveUp);
  EXPECT_EQ(a.micro_batch, 8);
  EXPECT_NE(a.event.reason.find("out of memory at the smallest micro-batch 8 with activation checkpointing on "
                                "under a memory limit of 512.0 MiB"),
            std::string::npos)
      << a.event.reason;
  EXPECT_NE(a.event.reason.find("raise the memory limit"), std::string::npos);

  // The global batch never changed, and every transition was recorded, in order.
  EXPECT_EQ(c.global_batch(), 64);
  const auto events = c.take_events();
  EXPECT_EQ(kinds(events), (std::vector<OomEventKind>{OomEventKind::kLimitChanged, OomEventKind::kBackoff,
                                                      OomEventKind::kBackoff, OomEventKind::kBackoff,
                                                      OomEventKind::kCheckpointingOn, OomEventKind::kGiveUp}));
  EXPECT_TRUE(c.take_events().empty());
  EXPECT_EQ(events[0].reason, "memory limit set to 512.0 MiB (was none): keeping the current micro-batch until an OOM");
}

TEST(OomController, OddSizesHalveRoundingUpAndStillSumToTheGlobalBatch) {
  MicroBatchOptions o;
  o.global_batch = 10;
  o.allow_checkpointing = false;
  MicroBatchController c(o);
  std::vector<int64_t> seen;
  for (;;) {
    const OomAction a = c.on_oom(0);
    if (a.kind == OomAction::Kind::kGiveUp) {
      EXPECT_NE(a.event.reason.find("checkpointing off (not allowed to turn it on)"), std::string::npos);
      EXPECT_NE(a.event.reason.find("allow activation checkpointing"), std::string::npos);
      break;
    }
    ASSERT_EQ(a.kind, OomAction::Kind::kHalve);
    seen.push_back(a.micro_batch);
    const auto sizes = c.micro_batch_sizes();
    EXPECT_EQ(std::accumulate(sizes.begin(), sizes.end(), int64_t(0)), 10);
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{5, 3, 2, 1}));
  EXPECT_EQ(trainer::split_batch(10, 3), (std::vector<int64_t>{3, 3, 3, 1}));
}

TEST(OomController, CheckpointingFromTheConfigIsNeverProbedOff) {
  MicroBatchOptions o;
  o.global_batch = 8;
  o.min_micro_batch = 4;
  o.checkpointing = true;
  o.grow_after = 1;
  MicroBatchController c(o);
  EXPECT_EQ(c.on_oom(100).kind, OomAction::Kind::kHalve);
  EXPECT_EQ(c.on_oom(100).kind, OomAction::Kind::kGiveUp);  // checkpointing already on
  // The limit rises: the probe grows the micro-batch; it never turns the config's checkpointing off.
  auto p = c.maybe_grow(1000, 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 8);
  EXPECT_EQ(c.probe(), ProbeKind::kGrow);
  EXPECT_TRUE(c.checkpointing());
}

// A simulated device: a step at micro-batch m under the current capacity OOMs iff m > capacity.
struct SimulatedRun {
  MicroBatchController c;
  int64_t limit;
  int64_t capacity;
  int64_t ooms = 0;
  std::vector<std::pair<int64_t, int64_t>> probes;  // (probe size, failed size known when it started)

  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      if (c.micro_batch() > capacity) {
        const OomAction a = c.on_oom(limit);
        ASSERT_NE(a.kind, OomAction::Kind::kGiveUp);
        ++ooms;
        continue;
      }
      const int64_t failed_before = c.failed_micro_batch();
      const auto p = c.maybe_grow(limit, limit / 4);  // plenty of headroom
      if (p) probes.emplace_back(*p, failed_before);
    }
  }
};

TEST(OomController, NeverProbesAtOrAboveAFailedSizeAtTheSameLimit) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.grow_after = 3;
  SimulatedRun run{MicroBatchController(o), 256 * kMiB, 36};
  run.steps(300);

  // It settles on the capacity exactly: backed off from 64, then probed up by bisection towards the
  // smallest failed size.
  EXPECT_EQ(run.c.micro_batch(), 36);
  EXPECT_EQ(run.c.failed_micro_batch(), 37);
  for (const auto& [size, failed] : run.probes) {
    if (failed != 0) EXPECT_LT(size, failed) << "probed " << size << " with " << failed << " known to fail";
  }
  // The probe sequence from 32: 48 (fails), 40 (fails), 36, 38 (fails), 37 (fails); then nothing is left.
  std::vector<int64_t> sizes;
  for (const auto& pr : run.probes) sizes.push_back(pr.first);
  EXPECT_EQ(sizes, (std::vector<int64_t>{48, 40, 36, 38, 37}));
  EXPECT_EQ(run.ooms, 1 + 4);  // the first backoff and four failed probes, no more
  run.c.take_events();
  run.steps(100);
  EXPECT_EQ(run.ooms, 5);
  EXPECT_TRUE(run.c.take_events().empty());
}

// memory.ladder_sizes: halvings. The same device as above (capacity 36 of 64): backed off to 32, the
// ladder's next size is 64, which failed, so no probe at all: 32 for good at this limit (4 samples of
// memory left unused, and no size cuDNN has not met). When the limit rises it climbs the ladder again.
// A run that starts at 48 of 64 also climbs the halvings of 64.
TEST(OomController, HalvingsOnlyClimbsTheLadderItBacksOffOn) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(trainer::halving_ladder(256, 96, 1), V({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256}));
  EXPECT_EQ(trainer::halving_ladder(10, 10, 2), V({2, 3, 5, 10}));
  EXPECT_EQ(error_text([] { trainer::halving_ladder(8, 16, 1); }),
            "halving_ladder: need 1 <= floor <= micro_batch <= global_batch, got 1, 16, 8");

  MicroBatchOptions o;
  o.global_batch = 64;
  o.grow_after = 3;
  o.halvings_only = true;
  SimulatedRun run{MicroBatchController(o), 256 * kMiB, 36};
  run.steps(300);
  EXPECT_EQ(run.c.micro_batch(), 32);
  EXPECT_EQ(run.c.failed_micro_batch(), 64);
  EXPECT_TRUE(run.probes.empty());
  EXPECT_EQ(run.ooms, 1);

  run.capacity = 64;
  run.limit = 1024 * kMiB;
  run.steps(50);
  EXPECT_EQ(run.c.micro_batch(), 64);
  std::vector<int64_t> sizes;
  for (const auto& pr : run.probes) sizes.push_back(pr.first);
  EXPECT_EQ(sizes, V({64}));

  o.micro_batch = 48;
  SimulatedRun from48{MicroBatchController(o), 256 * kMiB, 40};
  from48.steps(300);
  sizes.clear();
  for (const auto& pr : from48.probes) sizes.push_back(pr.first);
  // 48 fails -> 24; probes 32 (on 64's ladder, fits); 48 failed: nothing between 32 and 48 is tried.
  EXPECT_EQ(sizes, V({32}));
  EXPECT_EQ(from48.c.micro_batch(), 32);
  // The option survives a checkpoint, and states written before it read as off.
  EXPECT_TRUE(MicroBatchController::from_json(from48.c.to_json()).to_json().at("halvings_only").get<bool>());
  auto old = from48.c.to_json();
  old.erase("halvings_only");
  EXPECT_FALSE(MicroBatchController::from_json(old).to_json().at("halvings_only").get<bool>());
}

// A device whose step peak is a line, fixed + per_sample x micro-batch, and which runs out of memory when
// that peak is over the limit: the controller sees the peaks a real cap would show it.
struct LinearRun {
  MicroBatchController c;
  int64_t limit;
  int64_t fixed = 100 * kMiB, per_sample = 10 * kMiB;
  int64_t ooms = 0;
  std::vector<int64_t> probes;
  std::vector<trainer::OomEvent> events, skips;

  int64_t peak(int64_t m) const { return fixed + per_sample * m; }
  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      if (peak(c.micro_batch()) > limit) {
        ASSERT_NE(c.on_oom(limit).kind, OomAction::Kind::kGiveUp);
        ++ooms;
        continue;
      }
      if (const auto p = c.maybe_grow(limit, peak(c.micro_batch()))) probes.push_back(*p);
      for (const auto& e : c.take_events()) {
        events.push_back(e);
        if (e.kind == OomEventKind::kProbeSkipped) skips.push_back(e);
      }
    }
  }
};

// Under a limit of 405 MiB the line (100 MiB + 10 MiB a sample) allows 30 samples; at 655 MiB, 55. The
// peaks at 64 (before the cut) and 16 (after two backoffs) give the controller that line, so no probe
// fails: 24, 28, 30, then 31 is skipped (the line puts it at 410 MiB). After the rise, 2 x 30 = 60 is
// lowered to the 55 the line allows, and 64 is skipped. Without the line, 31 and then 64, 60 and 57
// would have run out of memory.
TEST(OomController, ProbesNoSizeTheLineThroughItsPeaksPutsOverTheLimit) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.grow_after = 3;
  o.headroom = 0.0;
  LinearRun run{MicroBatchController(o), 1000 * kMiB};
  run.steps(5);
  EXPECT_EQ(run.c.largest_predicted_to_fit(), 64);  // one size seen: no line yet
  run.limit = 405 * kMiB;
  run.steps(100);
  EXPECT_EQ(run.ooms, 2);  // 64 -> 32 -> 16: the backoffs, and nothing else
  EXPECT_EQ(run.probes, (std::vector<int64_t>{24, 28, 30}));
  EXPECT_EQ(run.c.micro_batch(), 30);
  EXPECT_EQ(run.c.largest_predicted_to_fit(), 30);
  ASSERT_EQ(run.skips.size(), 1u);  // once, not at every clean step after
  EXPECT_EQ(run.skips[0].reason,
            "not probing micro-batch 31: the line through the peaks at micro-batch 16 to 64 (5 sizes) puts "
            "micro-batch 31 at 410.0 MiB, over the limit 405.0 MiB; keeping 30 until the limit rises");
  EXPECT_EQ(run.skips[0].peak_bytes, run.peak(30));
  EXPECT_EQ(run.c.skipped_micro_batch(), 31);
  EXPECT_EQ(run.c.peaks(false).at(16), run.peak(16));
  EXPECT_TRUE(run.c.peaks(true).empty());

  run.limit = 655 * kMiB;
  run.events.clear();
  run.steps(1);  // the limit rose: the next clean step probes, lowered to what the line allows
  ASSERT_EQ(run.probes.size(), 4u);
  EXPECT_EQ(run.probes.back(), 55);
  const auto ev = run.events;
  ASSERT_EQ(kinds(ev), (std::vector<OomEventKind>{OomEventKind::kLimitChanged, OomEventKind::kProbe}));
  EXPECT_EQ(ev[1].reason,
            "probing micro-batch 55 after the memory limit rose to 655.0 MiB (not 60: the line through the peaks "
            "at micro-batch 16 to 64 (5 sizes) puts micro-batch 60 at 700.0 MiB, over the limit 655.0 MiB)");
  run.steps(100);
  EXPECT_EQ(run.ooms, 2);
  EXPECT_EQ(run.probes.size(), 4u);
  EXPECT_EQ(run.c.micro_batch(), 55);
  ASSERT_EQ(run.skips.size(), 2u);
  EXPECT_NE(run.skips[1].reason.find("not probing micro-batch 64: "), std::string::npos) << run.skips[1].reason;

  // A checkpoint keeps the line and the skip: the resumed controller decides as this one does.
  MicroBatchController r = MicroBatchController::from_json(nlohmann::json::parse(run.c.to_json().dump()));
  EXPECT_EQ(r.to_json(), run.c.to_json());
  EXPECT_EQ(r.largest_predicted_to_fit(), 55);
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(r.maybe_grow(run.limit, run.peak(55)).has_value());
  EXPECT_TRUE(r.take_events().empty());
  // States written before the controller kept peaks read with none; hostile peaks are refused by name.
  nlohmann::json old = run.c.to_json();
  old.erase("peaks");
  old.erase("skipped_micro_batch");
  EXPECT_TRUE(MicroBatchController::from_json(old).peaks(false).empty());
  nlohmann::json bad = run.c.to_json();
  bad["peaks"]["without_checkpointing"] = nlohmann::json::array({nlohmann::json::array({65, 1000})});
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("peaks out of range"), std::string::npos);
  bad["peaks"]["without_checkpointing"] = "many";
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("wrong type"), std::string::npos);
}

// The line needs sizes a factor of two apart: between 16 and 24 the slope would be the allocator's
// rounding. A size that ran under the limit is never ruled out. With memory.ladder_sizes: halvings a
// size the line rules out is skipped, not lowered.
TEST(OomController, TheLineNeedsAFactorOfTwoAndHalvingsSkipWhatItRulesOut) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.grow_after = 1;
  o.headroom = 0.0;
  MicroBatchController c(o);
  c.on_oom(400 * kMiB);  // 64 -> 32
  c.on_oom(400 * kMiB);  // 32 -> 16
  ASSERT_EQ(c.maybe_grow(400 * kMiB, 260 * kMiB), 24);  // peak at 16; probes halfway to the failed 32
  EXPECT_FALSE(c.maybe_grow(400 * kMiB, 340 * kMiB).has_value());  // peak at 24: the probe is kept
  EXPECT_EQ(c.peaks(false).size(), 2u);
  EXPECT_EQ(c.largest_predicted_to_fit(), 64);

  // Peaks that curve: the least-squares line puts 64 at 707.5 MiB, but 64 ran at 705 MiB, so under a
  // limit of 705 MiB it is not ruled out; under 704 MiB the line's 63 stands.
  MicroBatchController curved(o);
  curved.add_peak(16, false, 260 * kMiB);
  curved.add_peak(32, false, 420 * kMiB);
  curved.add_peak(64, false, 705 * kMiB);
  EXPECT_THROW(curved.add_peak(65, false, 1), std::invalid_argument);
  curved.on_limit_changed(705 * kMiB);
  EXPECT_EQ(curved.largest_predicted_to_fit(), 64);
  curved.on_limit_changed(704 * kMiB);
  EXPECT_EQ(curved.largest_predicted_to_fit(), 63);

  o.halvings_only = true;
  LinearRun run{MicroBatchController(o), 1000 * kMiB};
  run.steps(3);
  run.limit = 400 * kMiB;
  run.steps(20);  // 64 -> 32 -> 16; 32 failed, so the ladder has nothing to probe
  EXPECT_EQ(run.c.micro_batch(), 16);
  run.limit = 655 * kMiB;  // 32 fits, 64 does not (740 MiB)
  run.steps(50);
  EXPECT_EQ(run.probes, (std::vector<int64_t>{32}));
  EXPECT_EQ(run.ooms, 2);
  ASSERT_EQ(run.skips.size(), 1u);
  EXPECT_NE(run.skips[0].reason.find("not probing micro-batch 64: "), std::string::npos) << run.skips[0].reason;
}

TEST(OomController, ProbesAgainWhenTheLimitRises) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.grow_after = 3;
  SimulatedRun run{MicroBatchController(o), 256 * kMiB, 20};
  run.steps(200);
  EXPECT_EQ(run.c.micro_batch(), 20);
  EXPECT_EQ(run.c.failed_micro_batch(), 21);

  // The limit falls: failures are kept, nothing probes early.
  run.limit = 128 * kMiB;
  run.c.take_events();
  run.steps(2);
  auto ev = run.c.take_events();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0].kind, OomEventKind::kLimitChanged);
  EXPECT_NE(ev[0].reason.find("fell from 256.0 MiB to 128.0 MiB"), std::string::npos) << ev[0].reason;
  EXPECT_EQ(run.c.failed_micro_batch(), 21);

  // The limit rises above the old one: the failure is forgotten and the very next clean step probes.
  run.limit = 1024 * kMiB;
  run.capacity = 64;
  const auto p = run.c.maybe_grow(run.limit, run.limit / 2);  // no headroom needed after a rise
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 40);  // doubles: no failure is known any more
  EXPECT_EQ(run.c.failed_micro_batch(), 0);
  ev = run.c.take_events();
  ASSERT_EQ(kinds(ev), (std::vector<OomEventKind>{OomEventKind::kLimitChanged, OomEventKind::kProbe}));
  EXPECT_NE(ev[0].reason.find("rose from 128.0 MiB to 1024.0 MiB"), std::string::npos);
  EXPECT_NE(ev[1].reason.find("after the memory limit rose"), std::string::npos);
  run.steps(200);
  EXPECT_EQ(run.c.micro_batch(), 64);
  EXPECT_EQ(run.c.accum_steps(), 1);
}

// memory.auto_search: auto chose 24 of 64 because it ran faster (max_micro_batch 24): grow-back never
// probes past it on its own, a rise of the limit included; after a backoff it grows back to 24, not beyond.
TEST(OomController, GrowBackStopsAtTheSizeAutoChoseForSpeed) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.micro_batch = 24;
  o.max_micro_batch = 24;
  o.grow_after = 3;
  SimulatedRun run{MicroBatchController(o), 256 * kMiB, 64};  // everything fits
  EXPECT_EQ(run.c.max_micro_batch(), 24);
  run.steps(100);
  EXPECT_EQ(run.c.micro_batch(), 24);
  EXPECT_TRUE(run.probes.empty()) << "probed " << run.probes.front().first;

  // The limit falls: the step backs off from 24 to 12 and bisects back to the new capacity, 20.
  run.limit = 128 * kMiB;
  run.capacity = 20;
  run.steps(200);
  EXPECT_EQ(run.c.micro_batch(), 20);
  // The limit rises again: the failures are forgotten and the next clean step probes, up to 24 only.
  run.limit = 1024 * kMiB;
  run.capacity = 64;
  run.probes.clear();
  run.steps(300);
  EXPECT_EQ(run.c.micro_batch(), 24);
  ASSERT_FALSE(run.probes.empty());
  EXPECT_EQ(run.probes.front().first, 24) << "doubling 20 would be 40: clamped to the chosen size";
  for (const auto& [size, failed] : run.probes) EXPECT_LE(size, 24);

  // The same with memory.ladder_sizes: halvings (the ladder of 64 and 24: ..., 12, 16, 24, 32, 64): from
  // 12 it climbs to 16 and 24, never to 32.
  o.halvings_only = true;
  SimulatedRun ladder{MicroBatchController(o), 256 * kMiB, 64};
  ladder.capacity = 12;
  ladder.steps(50);
  EXPECT_EQ(ladder.c.micro_batch(), 12);
  ladder.limit = 1024 * kMiB;
  ladder.capacity = 64;
  ladder.probes.clear();
  ladder.steps(300);
  EXPECT_EQ(ladder.c.micro_batch(), 24);
  std::vector<int64_t> sizes;
  for (const auto& pr : ladder.probes) sizes.push_back(pr.first);
  EXPECT_EQ(sizes, (std::vector<int64_t>{16, 24}));

  // Without the option (0) the same run grows to the whole batch, as before.
  o.halvings_only = false;
  o.max_micro_batch = 0;
  SimulatedRun free{MicroBatchController(o), 256 * kMiB, 64};
  EXPECT_EQ(free.c.max_micro_batch(), 64);
  free.steps(100);
  EXPECT_EQ(free.c.micro_batch(), 64);
}

TEST(OomController, TheChosenSizeCeilingIsValidatedAndSaved) {
  MicroBatchOptions o;
  o.global_batch = 64;
  o.micro_batch = 24;
  o.max_micro_batch = 16;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("max_micro_batch must be 0 or in [micro_batch = 24, "
                                                                 "global_batch = 64], got 16"),
            std::string::npos);
  o.max_micro_batch = 65;
  EXPECT_NE(error_text([&] { MicroBatchController c(o); }).find("got 65"), std::string::npos);
  o.max_micro_batch = 24;
  MicroBatchController c(o);
  c.on_oom(1000);  // 24 -> 12
  const nlohmann::json j = c.to_json();
  EXPECT_EQ(j["max_micro_batch"], 24);
  const MicroBatchController r = MicroBatchController::from_json(j);
  EXPECT_EQ(r.max_micro_batch(), 24);
  EXPECT_EQ(r.to_json(), j);
  // A state written before the option resumes without a ceiling.
  nlohmann::json old = j;
  old.erase("max_micro_batch");
  EXPECT_EQ(MicroBatchController::from_json(old).max_micro_batch(), 64);
}

TEST(OomController, ProbesOnlyAfterGrowAfterStepsWithHeadroom) {
  MicroBatchOptions o;
  o.global_batch = 32;
  o.grow_after = 4;
  o.headroom = 0.25;
  MicroBatchController c(o);
  const int64_t limit = 1000;
  c.on_oom(limit);  // 32 -> 16, 32 failed
  c.take_events();
  // Peak at 75% of the limit: no headroom (needs < 750), no probe however long it runs.
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(c.maybe_grow(limit, 750).has_value());
  EXPECT_EQ(c.clean_steps(), 20);
  // With headroom, the counter already passed grow_after: the next clean step probes.
  auto p = c.maybe_grow(limit, 749);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 24);  // halfway to the failed 32
  // The probe step is clean: kept, and the counter starts over.
  EXPECT_FALSE(c.maybe_grow(limit, 500).has_value());
  EXPECT_EQ(c.micro_batch(), 24);
  EXPECT_EQ(c.probe(), ProbeKind::kNone);
  EXPECT_EQ(c.clean_steps(), 0);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(c.maybe_grow(limit, 500).has_value()) << i;
  p = c.maybe_grow(limit, 500);  // the 4th clean step after the success
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 28);
  const auto ev = c.take_events();
  EXPECT_EQ(kinds(ev), (std::vector<OomEventKind>{OomEventKind::kProbe, OomEventKind::kProbeSucceeded,
                                                  OomEventKind::kProbe}));
  EXPECT_EQ(ev[0].peak_bytes, 749);
  EXPECT_EQ(ev[0].old_micro_batch, 16);
  EXPECT_EQ(ev[0].new_micro_batch, 24);
  EXPECT_EQ(ev[0].old_accum_steps, 2);
  EXPECT_EQ(ev[0].new_accum_steps, 2);
}

TEST(OomController, CheckpointingTurnedOnByTheLadderIsProbedOffFirst) {
  MicroBatchOptions o;
  o.global_batch = 16;
  o.min_micro_batch = 8;
  o.grow_after = 2;
  MicroBatchController c(o);
  c.on_oom(100);                                                          // 16 -> 8
  EXPECT_EQ(c.on_oom(100).kind, OomAction::Kind::kEnableCheckpointing);  // at the floor
  c.take_events();

  // Limit rises: the first probe drops checkpointing at the same size.
  auto p = c.maybe_grow(200, 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 8);
  EXPECT_EQ(c.probe(), ProbeKind::kCheckpointingOff);
  EXPECT_FALSE(c.checkpointing());
  // It OOMs: checkpointing comes back and is not probed off again at this limit.
  OomAction a = c.on_oom(200);
  EXPECT_EQ(a.kind, OomAction::Kind::kRevertProbe);
  EXPECT_TRUE(a.checkpointing);
  EXPECT_EQ(a.micro_batch, 8);
  EXPECT_EQ(a.event.kind, OomEventKind::kProbeFailed);
  // Later probes grow the micro-batch with checkpointing on instead.
  EXPECT_FALSE(c.maybe_grow(200, 10).has_value());
  p = c.maybe_grow(200, 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(*p, 16);
  EXPECT_EQ(c.probe(), ProbeKind::kGrow);
  EXPECT_TRUE(c.checkpointing());
  a = c.on_oom(200);
  EXPECT_EQ(a.kind, OomAction::Kind::kRevertProbe);
  EXPECT_EQ(a.micro_batch, 8);
  EXPECT_EQ(c.failed_micro_batch(), 16);

  // The limit rises again: checkpointing off is tried again, succeeds and stays off.
  p = c.maybe_grow(400, 10);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(c.probe(), ProbeKind::kCheckpointingOff);
  EXPECT_FALSE(c.maybe_grow(400, 10).has_value());  // clean: accepted
  EXPECT_FALSE(c.checkpointing());
  EXPECT_FALSE(c.checkpointing_by_ladder());
  const auto ev = c.take_events();
  EXPECT_EQ(kinds(ev), (std::vector<OomEventKind>{OomEventKind::kLimitChanged, OomEventKind::kProbe,
                                                  OomEventKind::kProbeFailed, OomEventKind::kProbe,
                                                  OomEventKind::kProbeFailed, OomEventKind::kLimitChanged,
                                                  OomEventKind::kProbe, OomEventKind::kProbeSucceeded}));
}

TEST(OomController, ExplicitProbeCallsNeedAProbe) {
  MicroBatchOptions o;
  o.global_batch = 4;
  MicroBatchController c(o);
  EXPECT_THROW(c.on_probe_failed(), std::logic_error);
  EXPECT_THROW(c.on_probe_succeeded(), std::logic_error);
  c.on_oom(0);  // 4 -> 2
  c.on_limit_changed(0);
  EXPECT_FALSE(c.on_limit_changed(0).has_value());  // unchanged: no event
  o.grow_after = 1;
  MicroBatchController d(o);
  d.on_oom(0);
  ASSERT_TRUE(d.maybe_grow(0, 0).has_value());  // no limit: no headroom check; probes 3 (halfway to 4)
  EXPECT_EQ(d.micro_batch(), 3);
  const auto e = d.on_probe_failed();
  EXPECT_EQ(e.kind, OomEventKind::kProbeFailed);
  EXPECT_EQ(e.old_micro_batch, 3);
  EXPECT_EQ(e.new_micro_batch, 2);
  EXPECT_EQ(d.failed_micro_batch(), 3);
}

TEST(OomController, JsonRoundTripKeepsTheStateAndTheBehaviour) {
  MicroBatchOptions o;
  o.global_batch = 48;
  o.min_micro_batch = 3;
  o.grow_after = 2;
  o.headroom = 0.1;
  MicroBatchController c(o);
  c.on_oom(1000);  // 48 -> 24
  c.maybe_grow(1000, 10);
  ASSERT_TRUE(c.maybe_grow(1000, 10).has_value());  // probe 36 in progress
  ASSERT_EQ(c.probe(), ProbeKind::kGrow);

  const std::string text = c.to_json().dump();
  MicroBatchController r = MicroBatchController::from_json(nlohmann::json::parse(text));
  EXPECT_EQ(r.to_json(), c.to_json());
  EXPECT_EQ(r.micro_batch(), 36);
  EXPECT_EQ(r.failed_micro_batch(), 48);
  EXPECT_EQ(r.limit(), 1000);

  // Both fail the probe and continue identically.
  for (MicroBatchController* m : {&c, &r}) {
    const OomAction a = m->on_oom(1000);
    EXPECT_EQ(a.kind, OomAction::Kind::kRevertProbe);
    EXPECT_EQ(a.micro_batch, 24);
    m->maybe_grow(1000, 10);
  }
  EXPECT_EQ(r.maybe_grow(1000, 10), c.maybe_grow(1000, 10));
  EXPECT_EQ(r.micro_batch(), 30);
  EXPECT_EQ(r.to_json(), c.to_json());

  nlohmann::json bad = c.to_json();
  bad.erase("failed_micro_batch");
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("missing key 'failed_micro_batch'"),
            std::string::npos);
  bad = c.to_json();
  bad["version"] = 2;
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("version 2 is not 1"), std::string::npos);
  bad = c.to_json();
  bad["probe"] = "sideways";
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("probe 'sideways'"), std::string::npos);
  bad = c.to_json();
  bad["micro_batch"] = "many";
  EXPECT_NE(error_text([&] { MicroBatchController::from_json(bad); }).find("wrong type"), std::string::npos);
}

TEST(OomController, EventJsonHasEveryField) {
  MicroBatchOptions o;
  o.global_batch = 8;
  MicroBatchController c(o);
  const auto j = c.on_oom(2048).event.to_json();
  EXPECT_EQ(j.at("event"), "oom");
  EXPECT_EQ(j.at("kind"), "backoff");
  EXPECT_EQ(j.at("old_micro_batch"), 8);
  EXPECT_EQ(j.at("new_micro_batch"), 4);
  EXPECT_EQ(j.at("old_accum_steps"), 1);
  EXPECT_EQ(j.at("new_accum_steps"), 2);
  EXPECT_EQ(j.at("old_checkpointing"), false);
  EXPECT_EQ(j.at("new_checkpointing"), false);
  EXPECT_EQ(j.at("limit_bytes"), 2048);
  EXPECT_EQ(j.at("peak_bytes"), 0);
  EXPECT_EQ(j.at("reason"), "out of memory at micro-batch 8: halving to 4 (2 micro-batches per step, global "
                            "batch 8 unchanged)");
}

TEST(OomFindMax, MatchesExhaustiveSearchForEveryCapacity) {
  for (int64_t lo : {1, 3}) {
    for (int64_t hi : {1, 7, 64, 100}) {
      if (hi < lo) continue;
      for (int64_t cap = 0; cap <= hi + 2; ++cap) {
        int calls = 0;
        auto fits = [&](int64_t m) {
          ++calls;
          EXPECT_GE(m, lo);
          EXPECT_LE(m, hi);
          return m <= cap;
        };
        int64_t exhaustive = 0;
        for (int64_t m = lo; m <= hi; ++m)
          if (m <= cap) exhaustive = m;
        EXPECT_EQ(trainer::find_max_micro_batch(fits, lo, hi), exhaustive) << lo << " " << hi << " " << cap;
        const double bound = 2 * std::ceil(std::log2(static_cast<double>(hi) / lo)) + 2;
        EXPECT_LE(calls, bound) << lo << " " << hi << " " << cap;
      }
    }
  }
  EXPECT_THROW(trainer::find_max_micro_batch([](int64_t) { return true; }, 0, 4), std::invalid_argument);
  EXPECT_NE(error_text([] { trainer::find_max_micro_batch([](int64_t) { return true; }, 5, 4); })
                .find("need 1 <= lo <= hi, got lo = 5, hi = 4"),
            std::string::npos);
}

// From a predicted start (a memory curve's): the same answer as the exhaustive search from every start,
// inside the range or outside it, and a good prediction costs two calls: about 2*log2(|error| + 2).
TEST(OomFindMax, FromAnyStartMatchesExhaustiveSearch) {
  for (int64_t lo : {1, 3}) {
    for (int64_t hi : {1, 7, 64, 100}) {
      if (hi < lo) continue;
      for (int64_t cap = 0; cap <= hi + 2; ++cap) {
        int64_t exhaustive = 0;
        for (int64_t m = lo; m <= hi; ++m)
          if (m <= cap) exhaustive = m;
        for (int64_t start = 1; start <= hi + 3; ++start) {
          int calls = 0;
          auto fits = [&](int64_t m) {
            ++calls;
            EXPECT_GE(m, lo);
            EXPECT_LE(m, hi);
            return m <= cap;
          };
          EXPECT_EQ(trainer::find_max_micro_batch(fits, lo, hi, start), exhaustive)
              << lo << " " << hi << " " << cap << " " << start;
          const int64_t s = std::clamp(start, lo, hi);
          const int64_t error = std::abs(std::max(exhaustive, lo - 1) - s);
          const double bound = 2 * std::ceil(std::log2(static_cast<double>(error) + 2));
          EXPECT_LE(calls, bound) << lo << " " << hi << " " << cap << " " << start;
          if (s == exhaustive && s < hi) EXPECT_EQ(calls, 2) << "a right prediction: it fits, one more does not";
        }
      }
    }
  }
}

}  // namespace test_oom
