// The run's counters (trainer/run/progress.h) against hand-computed values: how many steps epochs make and
// their rounding, a counter overflow as a config error, each step's advance (samples, where the next batch
// starts, the sample-index hash), the progress line's window averages, the non-finite steps in a row, and
// state.json's loop position written and read back.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>

#include "trainer/run/progress.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_progress {

using trainer::Config;
using trainer::Progress;

namespace {

// A run of `epochs` epochs of `steps_per_epoch` steps, warmed up over `warmup_epochs`.
Progress planned(double epochs, double warmup_epochs, int64_t steps_per_epoch) {
  Config cfg;
  cfg.train.steps = 0;
  cfg.train.epochs = epochs;
  cfg.schedule.warmup_steps = 0;
  cfg.schedule.warmup_epochs = warmup_epochs;
  Progress p;
  p.plan(cfg, steps_per_epoch);
  return p;
}

data::LoaderState at(int64_t epoch, int64_t position) {
  data::LoaderState s;
  s.epoch = epoch;
  s.position = position;
  return s;
}

}  // namespace

TEST(RunProgress, EpochsBecomeStepsRoundedToTheNearest) {
  // 2.5 epochs of 3 steps: 7.5 steps, rounded half away from zero to 8; 0.5 warmup epochs: 1.5 -> 2.
  Progress p = planned(2.5, 0.5, 3);
  EXPECT_EQ(p.steps_per_epoch(), 3);
  EXPECT_EQ(p.total_steps(), 8);
  EXPECT_EQ(p.warmup_steps(), 2);
  // 0.4 epochs of 3 steps: 1.2 -> 1; 0.1 warmup epochs: 0.3 -> 0.
  p = planned(0.4, 0.1, 3);
  EXPECT_EQ(p.total_steps(), 1);
  EXPECT_EQ(p.warmup_steps(), 0);
  // Epochs too short for one step still train one.
  EXPECT_EQ(planned(0.1, 0, 3).total_steps(), 1);
  EXPECT_EQ(planned(0.1, 0, 3).steps_of_epochs(0.1, "train.epochs"), 0);
}

TEST(RunProgress, StepsInTheConfigWinOverEpochs) {
  Config cfg;
  cfg.train.steps = 5;
  cfg.train.epochs = 100;
  cfg.schedule.warmup_steps = 4;
  cfg.schedule.warmup_epochs = 50;
  Progress p;
  p.plan(cfg, 7);
  EXPECT_EQ(p.total_steps(), 5);
  EXPECT_EQ(p.warmup_steps(), 4);
  EXPECT_EQ(p.steps_per_epoch(), 7);
}

TEST(RunProgress, EpochsPastAStepCounterAreAConfigErrorNamingTheKey) {
  Config cfg;
  cfg.train.steps = 0;
  cfg.train.epochs = 1e300;
  Progress p;
  try {
    p.plan(cfg, 3);
    FAIL() << "1e300 epochs were planned";
  } catch (const trainer::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "train.epochs: 1e+300 epochs of 3 steps do not fit in a step counter (2^62); ask for fewer");
  }
  cfg.train.epochs = 1;
  cfg.schedule.warmup_epochs = 2e18;  // 6e18 steps: past 4.6e18
  EXPECT_THROW(p.plan(cfg, 3), trainer::ConfigError);
}

TEST(RunProgress, EachStepAdvancesTheSamplesAndWhereTheNextBatchStarts) {
  Progress p = planned(2, 0, 3);  // 6 steps
  EXPECT_EQ(p.step(), 0);
  EXPECT_FALSE(p.done());
  p.advance({3, 1, 4}, at(0, 16), 16, 0.5);
  EXPECT_EQ(p.step(), 1);
  EXPECT_EQ(p.samples_seen(), 16);
  EXPECT_EQ(p.epoch(), 0);
  EXPECT_EQ(p.position(), 16);
  EXPECT_DOUBLE_EQ(p.epochs(), 1.0 / 3);
  EXPECT_FALSE(p.epoch_end());
  // FNV-1a over 3, 1, 4 (computed by hand from its offset basis and prime): the order counts.
  EXPECT_EQ(p.batch_hash(), 10325415080436252789ull);
  p.advance({4, 1, 3}, at(0, 32), 16, 0.5);
  EXPECT_EQ(p.batch_hash(), 14692657674352291613ull);
  p.advance({}, at(1, 0), 16, 0.5);  // the epoch's last batch: the next starts the next epoch
  EXPECT_EQ(p.step(), 3);
  EXPECT_EQ(p.samples_seen(), 48);
  EXPECT_EQ(p.epoch(), 1);
  EXPECT_EQ(p.position(), 0);
  EXPECT_TRUE(p.epoch_end());
  EXPECT_DOUBLE_EQ(p.epochs(), 1.0);
  EXPECT_EQ(p.batch_hash(), 1469598103934665603ull);  // no indices: the offset basis
  for (int i = 0; i < 3; ++i) p.advance({}, at(1, 16 * (i + 1)), 16, 0.5);
  EXPECT_EQ(p.step(), 6);
  EXPECT_TRUE(p.done());
  EXPECT_EQ(p.start_step(), 0);
}

TEST(RunProgress, TheWindowAveragesTheStepsSinceTheLastLine) {
  Progress p = planned(10, 0, 1);  // 10 steps
  p.advance({}, at(1, 0), 8, 0.5);
  p.advance({}, at(2, 0), 8, 1.5);
  // 2 steps of 8 samples in 2 s: 8 samples/s; 8 steps left at 1 s each.
  EXPECT_DOUBLE_EQ(p.window_samples_per_s(8), 8.0);
  EXPECT_DOUBLE_EQ(p.eta_s(), 8.0);
  p.reset_window();
  p.advance({}, at(3, 0), 8, 0.25);
  // The next window holds the one step since: 8 / 0.25 s; 7 steps left at 0.25 s.
  EXPECT_DOUBLE_EQ(p.window_samples_per_s(8), 32.0);
  EXPECT_DOUBLE_EQ(p.eta_s(), 1.75);
}

TEST(RunProgress, NonfiniteStepsAreCountedInARow) {
  Progress p;
  EXPECT_EQ(p.count_nonfinite(false), 1);
  EXPECT_EQ(p.count_nonfinite(false), 2);
  EXPECT_EQ(p.count_nonfinite(true), 0);
  EXPECT_EQ(p.count_nonfinite(false), 1);
}

TEST(RunProgress, TheLoopStateRoundTripsThroughStateJson) {
  Progress p = planned(2, 0, 3);
  p.advance({1}, at(0, 8), 8, 1);
  p.advance({2}, at(1, 0), 8, 1);
  p.count_nonfinite(false);
  p.count_nonfinite(false);
  nlohmann::json j;
  p.write_state(j);
  EXPECT_EQ(j, nlohmann::json({{"step", 2}, {"epoch", 1}, {"position", 0}, {"samples_seen", 16},
                               {"nonfinite_in_a_row", 2}}));

  Progress q = planned(2, 0, 3);
  q.restore(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(q.step(), 2);
  EXPECT_EQ(q.start_step(), 2);  // this process trains from the checkpoint's step
  EXPECT_EQ(q.epoch(), 1);
  EXPECT_EQ(q.position(), 0);
  EXPECT_EQ(q.samples_seen(), 16);
  EXPECT_EQ(q.count_nonfinite(false), 3);  // the run of non-finite steps goes on across the resume
  nlohmann::json k;
  q.write_state(k);
  k["nonfinite_in_a_row"] = 2;
  EXPECT_EQ(k, j);

  // A checkpoint of a build before nonfinite_in_a_row was saved: none in a row.
  nlohmann::json old = j;
  old.erase("nonfinite_in_a_row");
  Progress r;
  r.restore(old);
  EXPECT_EQ(r.count_nonfinite(false), 1);
  // What restore() needs is there or it throws (checkpoint_problem parses the same before anything is restored).
  old.erase("position");
  EXPECT_THROW(r.restore(old), nlohmann::json::exception);
}

}  // namespace test_progress
