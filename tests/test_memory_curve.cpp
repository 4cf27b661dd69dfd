// The memory curve: the least-squares fit, its prediction and the choice of the checkpointing setting
// against hand-computed values; the file `memory.curve` reads; `micro_batch: auto` started at the
// prediction, run as users do, against the same search started from the floor (the same pick, its probes
// counted); and `activation_checkpointing: auto` choosing the setting before the first step under a real
// cap, against the ladder finding it out in the first step.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <map>

#include "test_util.h"
#include "train_util.h"
#include "trainer/memory/curve.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_memory_curve {

using nlohmann::json;
using testutil::TempDir;

namespace {

using testutil::error_text;

std::vector<trainer::CurvePoint> points(const std::vector<std::pair<int64_t, int64_t>>& xy) {
  std::vector<trainer::CurvePoint> out;
  for (const auto& [m, b] : xy) out.push_back({m, b});
  return out;
}

}  // namespace

TEST(MemoryCurveFit, ExactLineHasZeroResiduals) {
  const auto f = trainer::fit_memory_curve(points({{1, 110}, {2, 130}, {4, 170}, {8, 250}}));
  EXPECT_NEAR(f.fixed_bytes, 90.0, 1e-9);
  EXPECT_NEAR(f.per_sample_bytes, 20.0, 1e-9);
  ASSERT_EQ(f.residuals_bytes.size(), 4u);
  for (double r : f.residuals_bytes) EXPECT_NEAR(r, 0.0, 1e-9);
  EXPECT_NEAR(f.max_abs_residual_bytes, 0.0, 1e-9);
  // Byte counts as large as a GPU's: 3 GB fixed, 12.3 MB per sample, 1..256; no digits lost.
  std::vector<std::pair<int64_t, int64_t>> big;
  for (int64_t m = 1; m <= 256; m *= 2) big.push_back({m, 3000000000LL + 12345678LL * m});
  const auto g = trainer::fit_memory_curve(points(big));
  EXPECT_NEAR(g.fixed_bytes, 3e9, 1e-3);
  EXPECT_NEAR(g.per_sample_bytes, 12345678.0, 1e-6);
  EXPECT_LT(g.max_abs_residual_bytes, 1e-3);
}

TEST(MemoryCurveFit, LeastSquaresByHand) {
  // x = 1, 2, 3; y = 10, 20, 40: mean x 2, mean y 70/3, Sxx 2, Sxy 30 -> slope 15, intercept -20/3;
  // residuals 5/3, -10/3, 5/3.
  const auto f = trainer::fit_memory_curve(points({{1, 10}, {2, 20}, {3, 40}}));
  EXPECT_NEAR(f.per_sample_bytes, 15.0, 1e-12);
  EXPECT_NEAR(f.fixed_bytes, -20.0 / 3, 1e-12);
  ASSERT_EQ(f.residuals_bytes.size(), 3u);
  EXPECT_NEAR(f.residuals_bytes[0], 5.0 / 3, 1e-12);
  EXPECT_NEAR(f.residuals_bytes[1], -10.0 / 3, 1e-12);
  EXPECT_NEAR(f.residuals_bytes[2], 5.0 / 3, 1e-12);
  EXPECT_NEAR(f.max_abs_residual_bytes, 10.0 / 3, 1e-12);
  EXPECT_NEAR(f.rms_residual_bytes, std::sqrt(50.0 / 9), 1e-12);
  const json j = f.to_json();
  EXPECT_DOUBLE_EQ(j["per_sample_bytes"].get<double>(), f.per_sample_bytes);
  EXPECT_EQ(j["residuals_bytes"].size(), 3u);

  EXPECT_NE(error_text([] { trainer::fit_memory_curve(points({{4, 10}, {4, 12}})); })
                .find("need points at two or more micro-batches, got 1"),
            std::string::npos);
}

TEST(MemoryCurveFit, PredictionByHand) {
  const auto f = trainer::fit_memory_curve(points({{1, 110}, {2, 130}, {4, 170}, {8, 250}}));  // 90 + 20 m
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 250, 64), 8);
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 249, 64), 7);
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 110, 64), 1);
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 109, 64), 0);  // not even one sample
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 50, 64), 0);   // below the fixed bytes
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 1000000, 16), 16);
  EXPECT_EQ(trainer::predict_max_micro_batch(f, 0, 16), 16);   // no limit
  trainer::MemoryFit flat;
  flat.fixed_bytes = 100;
  EXPECT_EQ(trainer::predict_max_micro_batch(flat, 200, 16), 16);
}

// none: 90 + 20 m bytes, all: 80 + 10 m; samples/s measured at 1, 2, 4, 8 (16).
trainer::MemoryCurve hand_curve() {
  trainer::MemoryCurve c;
  c.points["none"] = {{1, 110, 100}, {2, 130, 180}, {4, 170, 300}, {8, 250, 400}};
  c.points["all"] = {{1, 90, 60}, {2, 100, 110}, {4, 120, 200}, {8, 160, 260}, {16, 240, 300}};
  for (const auto& [setting, pts] : c.points) c.fits[setting] = trainer::fit_memory_curve(pts);
  return c;
}

TEST(MemoryCurveChoice, SamplesPerSecondBetweenThePointsByHand) {
  const auto pts = hand_curve().points.at("none");
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s(pts, 1), 100);
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s(pts, 3), 240);    // 180 + (3 - 2) / 2 * 120
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s(pts, 7), 375);    // 300 + 3 / 4 * 100
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s(pts, 16), 400);   // past the last point: its value
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s(pts, 0), 100);    // before the first: its value
  EXPECT_DOUBLE_EQ(trainer::interpolate_samples_per_s({}, 4), 0);
}

TEST(MemoryCurveChoice, TheFasterSettingUnderTheLimitByHand) {
  const auto c = hand_curve();
  auto expect = [&](int64_t limit, const std::string& setting, int64_t m, double sps) {
    const auto got = trainer::choose_setting(c, limit, 16);
    EXPECT_EQ(got.setting, setting) << "limit " << limit;
    EXPECT_EQ(got.micro_batch, m) << "limit " << limit;
    EXPECT_DOUBLE_EQ(got.samples_per_s, sps) << "limit " << limit;
  };
  expect(250, "none", 8, 400);  // none 8 (400/s) against all 16 (300/s)
  expect(150, "all", 7, 245);   // none 3 (240/s) against all 7 (200 + 3 / 4 * 60)
  expect(105, "all", 2, 110);   // none does not fit at 1 (110 bytes)
  expect(85, "neither", 0, 0);  // all needs 90 at 1
  auto tie = c;
  tie.points["all"] = tie.points["none"];
  tie.fits["all"] = tie.fits["none"];
  EXPECT_EQ(trainer::choose_setting(tie, 250, 16).setting, "none") << "a tie recomputes nothing";
  auto unmeasured = c;  // a curve without speeds (an older file) predicts no choice
  for (auto& [setting, pts] : unmeasured.points)
    for (auto& p : pts) p.samples_per_s = 0;
  EXPECT_EQ(trainer::choose_setting(unmeasured, 250, 16).setting, "neither");
}

TEST(MemoryCurveFile, ReadsTheBenchResultAndNamesTheFileOnErrors) {
  TempDir dir;
  const auto path = (dir / "curve.json").string();
  json j = {{"mode", "memory_curve"}, {"model", "resnet50"}, {"sample_shape", {3, 64, 64}}, {"precision", "fp32"},
            {"curves",
             {{"none",
               {{"points", {{{"micro_batch", 2}, {"peak_bytes", 200000000}, {"samples_per_s", 30.5}},
                            {{"micro_batch", 1}, {"peak_bytes", 175000000}, {"samples_per_s", 20.0}}}},
                {"fit", {{"fixed_bytes", 1.5e8}, {"per_sample_bytes", 2.5e7}}}}},
              {"all", {{"points", {{{"micro_batch", 1}, {"peak_bytes", 160000000}}}}, {"fit", nullptr}}}}}};
  testutil::write_file(path, j.dump());
  const auto c = trainer::read_memory_curve(path);
  EXPECT_EQ(c.model, "resnet50");
  EXPECT_EQ(c.sample_shape, (std::vector<int64_t>{3, 64, 64}));
  EXPECT_EQ(c.precision, "fp32");
  ASSERT_EQ(c.fits.size(), 1u) << "a curve with too few points has no fit";
  EXPECT_DOUBLE_EQ(c.fits.at("none").fixed_bytes, 1.5e8);
  EXPECT_DOUBLE_EQ(c.fits.at("none").per_sample_bytes, 2.5e7);
  ASSERT_EQ(c.points.at("none").size(), 2u);
  EXPECT_EQ(c.points.at("none")[0].micro_batch, 1) << "sorted by micro-batch";
  EXPECT_EQ(c.points.at("none")[0].peak_bytes, 175000000);
  EXPECT_DOUBLE_EQ(c.points.at("none")[1].samples_per_s, 30.5);
  ASSERT_EQ(c.points.at("all").size(), 1u) << "the points of a setting without a fit are read too";
  EXPECT_DOUBLE_EQ(c.points.at("all")[0].samples_per_s, 0) << "a point without a speed";

  EXPECT_NE(error_text([&] { trainer::read_memory_curve((dir / "missing.json").string()); })
                .find("missing.json: cannot read the memory curve"),
            std::string::npos);
  j["mode"] = "oom";
  testutil::write_file(path, j.dump());
  EXPECT_NE(error_text([&] { trainer::read_memory_curve(path); })
                .find(path + ": not a trainer bench --memory-curve result (its mode is not memory_curve)"),
            std::string::npos);
  testutil::write_file(path, "{");
  EXPECT_NE(error_text([&] { trainer::read_memory_curve(path); }).find("not a trainer bench --memory-curve result"),
            std::string::npos);
}

// The tiny plain CNN of the OOM benchmark's test: its curve, then `micro_batch: auto` under a cap between
// two measured points, from the floor and from the curve's prediction: the same pick; the start is the
// prediction; and a curve of another job is refused with the key named.
TEST(MemoryCurveAuto, StartsAtThePredictionAndPicksTheSameSize) {
  TempDir dir;
  const std::string cfg = testutil::source_dir() + "/configs/bench_oom_tiny.yaml";
  const auto curve = (dir / "curve.json").string();
  auto r = testutil::run(testutil::trainer_bin() + " bench --memory-curve --config " + cfg + " --out " + curve);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json c = json::parse(testutil::read_file(curve));
  const auto& pts = c["curves"]["none"]["points"];
  ASSERT_EQ(pts.size(), 5u);  // 1, 2, 4, 8, 16
  const int64_t cap = (pts[2]["peak_bytes"].get<int64_t>() + pts[3]["peak_bytes"].get<int64_t>()) / 2;
  const auto fit = trainer::read_memory_curve(curve).fits.at("none");
  const int64_t predicted = trainer::predict_max_micro_batch(fit, cap, 16);

  auto auto_run = [&](const std::string& name, const std::string& extra) {
    const auto run_dir = (dir / name).string();
    auto rr = testutil::run(testutil::trainer_cmd(run_dir, "--config " + cfg + " --set train.micro_batch=auto "
                                                  "--set train.steps=1 --set memory.limit=" + std::to_string(cap) + extra));
    EXPECT_EQ(rr.exit_code, 0) << rr.output;
    auto ev = testutil::events(run_dir, "auto_micro_batch");
    EXPECT_EQ(ev.size(), 1u);
    return ev.empty() ? json() : ev[0];
  };
  // Doubling from the floor and galloping from the curve file's prediction are both exact: the same
  // pick. The search from the probes' own curve (the default) lands within 90% of it.
  const json plain = auto_run("plain", " --set memory.auto_search=doubling");
  const json started = auto_run("started", " --set memory.curve=" + curve);
  const json probed = auto_run("probed", " --set memory.auto_search=curve");
  EXPECT_EQ(plain["start"], 0);
  EXPECT_EQ(plain["method"], "doubling");
  EXPECT_EQ(started["method"], "start");
  EXPECT_EQ(probed["method"], "curve");
  EXPECT_EQ(started["start"].get<int64_t>(), std::max<int64_t>(1, predicted));
  EXPECT_EQ(started["micro_batch"], plain["micro_batch"]);
  EXPECT_GE(plain["micro_batch"].get<int64_t>(), 4);
  EXPECT_GE(probed["micro_batch"].get<double>(), 0.9 * plain["micro_batch"].get<double>()) << probed.dump();
  EXPECT_GT(started["probes"].get<int64_t>(), 0);
  EXPECT_GT(plain["probes"].get<int64_t>(), 0);
  EXPECT_GE(started["search_s"].get<double>(), 0.0);

  const auto other = (dir / "other").string();
  r = testutil::run(testutil::trainer_cmd(other, "--config " + cfg + " --set model.name=resnet20 --set "
                                          "train.micro_batch=auto --set train.steps=1 --set memory.curve=" + curve));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("memory.curve: " + curve + " was measured for plain_cnn on 1x28x28 in fp32, and this job "
                          "is resnet20 on 1x28x28 in fp32; measure this job with trainer bench --memory-curve"),
            std::string::npos)
      << r.output;
}

// gpt_tiny (checkpointing saves a third of the step's peak at micro-batch 1) on synthetic tokens, global
// batch 4: under a cap a quarter of the way from the checkpointed step's peak at micro-batch 1 to the
// plain one's, only checkpointing fits. `activation_checkpointing: auto` with `micro_batch: auto` finds
// that before the first step, by its probes or from the curve, and the step runs without an OOM; with
// `none` the ladder finds it out in the first step (an OOM, then checkpointing on). Without a cap, auto
// keeps checkpointing off. The bench's --check measures the same choice against the exhaustive search.
TEST(MemoryCurveAuto, CheckpointingAutoPicksTheSettingBeforeTheFirstStep) {
  TempDir dir;
  const auto cfg = (dir / "gpt_tiny.yaml").string();
  testutil::write_file(cfg, R"(model: {name: gpt_tiny, context: 64, dropout: 0.0, vocab_size: 256}
data: {kind: synthetic, synthetic_size: 256, test: "", workers: 1}
optim: {name: adamw, lr: 1.0e-3}
train: {global_batch: 4, steps: 2, device: cpu, threads: 1}
memory: {limit: none}
checkpoint: {every_steps: 0, every_seconds: 0}
log: {every: 1000, level: warn}
seed: 0
)");
  const auto curve = (dir / "curve.json").string();
  auto r = testutil::run(testutil::trainer_bin() + " bench --memory-curve --config " + cfg + " --out " + curve);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json c = json::parse(testutil::read_file(curve));
  const int64_t none1 = c["curves"]["none"]["points"][0]["peak_bytes"].get<int64_t>();
  const int64_t all1 = c["curves"]["all"]["points"][0]["peak_bytes"].get<int64_t>();
  ASSERT_LT(all1, none1) << "checkpointing must save memory at micro-batch 1 for this test";
  const int64_t cap = all1 + (none1 - all1) / 4;

  // The bench's check of the joint prediction under that cap: the curve chooses checkpointing, the
  // exhaustive search agrees, and a run with both autos takes it with no OOM in its step.
  const auto checked = (dir / "checked.json").string();
  r = testutil::run(testutil::trainer_bin() + " bench --memory-curve --config " + cfg + " --limit " +
                    std::to_string(cap) + " --check --rounds 1 --out " + checked);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json pred = json::parse(testutil::read_file(checked))["predictions"][0];
  EXPECT_EQ(pred["choice"], "all") << pred.dump(1);
  EXPECT_EQ(pred["none"]["micro_batch"], 0) << pred.dump(1);
  EXPECT_EQ(pred["check"]["best"], "all") << pred.dump(1);
  EXPECT_EQ(pred["check"]["none"]["micro_batch"], 0) << pred.dump(1);
  const json& joint = pred["check"]["joint"];
  EXPECT_EQ(joint["setting"], "all") << joint;
  EXPECT_EQ(joint["setting_agrees"], true) << joint;
  EXPECT_EQ(joint["checkpointing_from"], "curve") << joint;
  EXPECT_EQ(joint["ooms_in_the_step"], 0) << joint;
  EXPECT_GE(joint["micro_batch"].get<int64_t>(), 1) << joint;
  EXPECT_NE(r.output.find("a run with activation_checkpointing: auto took all at"), std::string::npos) << r.output;

  struct Run {
    json pick;
    std::vector<json> ooms;
  };
  auto run = [&](const std::string& name, const std::string& extra) {
    const auto run_dir = (dir / name).string();
    auto rr = testutil::run(testutil::trainer_cmd(run_dir, "--config " + cfg + " --set train.micro_batch=auto " + extra));
    EXPECT_EQ(rr.exit_code, 0) << rr.output;
    auto ev = testutil::events(run_dir, "auto_micro_batch");
    EXPECT_EQ(ev.size(), 1u) << rr.output;
    return Run{ev.empty() ? json() : ev[0], testutil::events(run_dir, "oom")};
  };
  const std::string capped = "--set memory.limit=" + std::to_string(cap);
  const Run probed = run("probed", capped + " --set memory.activation_checkpointing=auto --set memory.auto_search=curve");
  EXPECT_EQ(probed.pick["checkpointing"], true) << probed.pick;
  EXPECT_EQ(probed.pick["checkpointing_from"], "floor_does_not_fit");
  EXPECT_EQ(probed.pick["floor_fits"], true) << "with checkpointing on, the floor fits";
  EXPECT_TRUE(probed.ooms.empty()) << probed.ooms.front();

  const Run curved = run("curved", capped + " --set memory.activation_checkpointing=auto --set memory.curve=" + curve);
  EXPECT_EQ(curved.pick["checkpointing"], true) << curved.pick;
  EXPECT_EQ(curved.pick["checkpointing_from"], "curve");
  EXPECT_EQ(curved.pick["micro_batch"], probed.pick["micro_batch"]);
  EXPECT_LT(curved.pick["probes"].get<int64_t>(), probed.pick["probes"].get<int64_t>())
      << "the curve spares the search without checkpointing";
  EXPECT_TRUE(curved.ooms.empty()) << curved.ooms.front();

  const Run ladder = run("ladder", capped + " --set memory.activation_checkpointing=none");
  EXPECT_EQ(ladder.pick["checkpointing"], false);
  EXPECT_EQ(ladder.pick["checkpointing_from"], "config");
  ASSERT_EQ(ladder.ooms.size(), 1u) << "the ladder learns it in the first step";
  EXPECT_EQ(ladder.ooms[0]["kind"], "checkpointing_on");
  EXPECT_EQ(ladder.ooms[0]["step"], 1);

  const Run free = run("free", "--set memory.activation_checkpointing=auto --set memory.auto_search=curve");
  EXPECT_EQ(free.pick["checkpointing"], false);
  EXPECT_EQ(free.pick["checkpointing_from"], "floor_fits");
  EXPECT_EQ(free.pick["micro_batch"], 4);
  EXPECT_TRUE(free.ooms.empty());
}

// The plot of a memory curve: a PNG from the JSON the bench writes; bad input named; and without
// matplotlib (python3 -S: no site-packages, where Debian puts it) a message and no file, exit code 0.
TEST(MemoryCurvePlot, WritesAPngAndSkipsWithoutMatplotlib) {
  TempDir dir;
  const auto path = (dir / "curve.json").string();
  auto point = [](int64_t m, int64_t bytes) {
    return json{{"micro_batch", m}, {"peak_bytes", bytes}, {"step_time_s", 0.01 * m}, {"samples_per_s", 100.0}};
  };
  const json fit = {{"fixed_bytes", 1.0e6}, {"per_sample_bytes", 2.0e5}, {"residuals_bytes", {0, 0, 0}}};
  const json j = {
      {"mode", "memory_curve"}, {"model", "plain_cnn"}, {"sample_shape", {1, 28, 28}}, {"precision", "fp32"},
      {"device", "cpu"}, {"global_batch", 4},
      {"curves", {{"none", {{"points", {point(1, 1200000), point(2, 1400000), point(4, 1800000)}}, {"fit", fit}}},
                  {"all", {{"points", {point(1, 1100000)}}, {"fit", nullptr}}}}},
      {"predictions", {{{"limit_bytes", 1500000}, {"none", {{"micro_batch", 2}}}, {"all", nullptr},
                        {"choice", "none"}}}}};
  testutil::write_file(path, j.dump());
  const std::string script = testutil::source_dir() + "/scripts/plot_memory_curve.py ";
  const auto png = (dir / "curve.png").string();
  auto r = testutil::run(testutil::python() + " " + script + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string bytes = testutil::read_file(png);
  ASSERT_GT(bytes.size(), 10000u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));

  r = testutil::run(testutil::python() + " " + script + (dir / "nothing.json").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("nothing.json: no such file"), std::string::npos) << r.output;

  const auto skipped = (dir / "skipped.png").string();
  r = testutil::run(testutil::python() + " -S " + script + path + " --out " + skipped);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped: matplotlib is not installed"), std::string::npos) << r.output;
  EXPECT_FALSE(testutil::fs::exists(skipped));
}

// ---- the auto search from its own probes' curve (find_max_micro_batch_by_curve) --------------------------

namespace {

// A job whose step peak at micro-batch m is peak(m) bytes: a probe fits iff peak(m) <= limit. Counts the
// probes, remembers what fitted, and checks every probe is inside [lo, hi] and asked once.
struct Synthetic {
  std::function<double(int64_t)> peak;
  int64_t limit = 0, lo = 1, hi = 1;
  std::map<int64_t, bool> asked;

  trainer::ProbeOutcome operator()(int64_t m, trainer::ProbeRole) {
    EXPECT_GE(m, lo);
    EXPECT_LE(m, hi);
    EXPECT_EQ(asked.count(m), 0u) << "probed twice: " << m;
    const bool fits = limit == 0 || peak(m) <= static_cast<double>(limit);
    asked[m] = fits;
    return {fits, fits ? static_cast<int64_t>(peak(m)) : 0};
  }
  int64_t exhaustive() const {
    int64_t best = 0;
    for (int64_t m = lo; m <= hi; ++m)
      if (limit == 0 || peak(m) <= static_cast<double>(limit)) best = m;
    return best;
  }
};

struct Shape {
  const char* name;
  std::function<double(int64_t)> peak;
  int64_t max_probes;  // what the search should need on it, whatever the limit
};

}  // namespace

// Against the exhaustive answer on every limit from "only the floor fits" to "everything fits", for peaks
// that are a line (3 probes where the answer is above the second point), convex (the line from small
// sizes underestimates large ones: the prediction overshoots), and a line with a workspace that jumps at
// 32 (a cuDNN algorithm change): always a size that fitted in a probe, at least 90% of the largest.
TEST(MemoryCurveSearch, WithinNinetyPercentOfTheExhaustiveAnswerInAFewProbes) {
  const double fixed = 4.0e8, per = 3.0e7;
  const std::vector<Shape> shapes = {
      {"line", [&](int64_t m) { return fixed + per * m; }, 5},
      {"convex", [&](int64_t m) { return fixed + per * m + 2.0e5 * m * m; }, 9},
      {"workspace", [&](int64_t m) { return fixed + per * m + (m >= 32 ? 4.0e8 : 0.0); }, 9},
  };
  for (const auto& shape : shapes) {
    for (int64_t hi : {16, 100, 256}) {
      int worst_probes = 0;
      for (int64_t target = 1; target <= hi + 2; target += target < 20 ? 1 : 7) {
        Synthetic job{shape.peak, static_cast<int64_t>(shape.peak(target)) + 1, 1, hi};
        const int64_t best = job.exhaustive();
        const auto s = trainer::find_max_micro_batch_by_curve(std::ref(job), 1, hi, job.limit);
        const std::string where = std::string(shape.name) + " hi " + std::to_string(hi) + " target " +
                                  std::to_string(target) + ": " + s.to_json().dump();
        ASSERT_GE(best, 1) << where;
        ASSERT_TRUE(job.asked.count(s.micro_batch) && job.asked.at(s.micro_batch)) << "not a probed fit: " << where;
        EXPECT_LE(s.micro_batch, best) << where;
        EXPECT_GE(static_cast<double>(s.micro_batch), 0.9 * static_cast<double>(best)) << where;
        EXPECT_EQ(static_cast<int64_t>(s.probes.size()), static_cast<int64_t>(job.asked.size())) << where;
        EXPECT_LE(static_cast<int64_t>(s.probes.size()), shape.max_probes) << where;
        worst_probes = std::max(worst_probes, static_cast<int>(s.probes.size()));
        if (std::string(shape.name) == "line" && best >= 9 && best < hi)
          EXPECT_EQ(s.probes.size(), 3u) << "a line is found by the floor, the second point and one confirm: " << where;
      }
      RecordProperty(std::string(shape.name) + "_hi" + std::to_string(hi) + "_worst_probes", worst_probes);
    }
  }
}

TEST(MemoryCurveSearch, TheFloorTheWholeRangeNoLimitAndBadArguments) {
  auto line = [](int64_t m) { return 1000.0 + 100.0 * m; };
  Synthetic none{line, 1050, 1, 64};  // not even the floor
  auto s = trainer::find_max_micro_batch_by_curve(std::ref(none), 1, 64, none.limit);
  EXPECT_EQ(s.micro_batch, 0);
  EXPECT_EQ(s.ended, "floor");
  EXPECT_EQ(s.probes.size(), 1u);
  EXPECT_EQ(s.probes[0].role, trainer::ProbeRole::kCalibrate);

  Synthetic all{line, 1000000, 1, 64};
  s = trainer::find_max_micro_batch_by_curve(std::ref(all), 1, 64, all.limit);
  EXPECT_EQ(s.micro_batch, 64);
  EXPECT_EQ(s.ended, "whole");
  ASSERT_EQ(s.probes.size(), 3u);
  EXPECT_EQ(s.probes[1].micro_batch, 8);
  EXPECT_EQ(s.probes[2].role, trainer::ProbeRole::kConfirm);
  EXPECT_EQ(s.to_json()["probes"][2]["role"], "confirm");

  Synthetic unlimited{line, 0, 3, 40};  // no cap: the prediction is the whole range
  s = trainer::find_max_micro_batch_by_curve(std::ref(unlimited), 3, 40, 0);
  EXPECT_EQ(s.micro_batch, 40);
  EXPECT_EQ(s.probes.size(), 3u);
  EXPECT_EQ(s.probes[1].micro_batch, 24) << "the second point is 8 x the floor";

  Synthetic one{line, 1000000, 5, 5};
  s = trainer::find_max_micro_batch_by_curve(std::ref(one), 5, 5, one.limit);
  EXPECT_EQ(s.micro_batch, 5);
  EXPECT_EQ(s.probes.size(), 1u);

  auto probe = [](int64_t, trainer::ProbeRole) { return trainer::ProbeOutcome{true, 1}; };
  EXPECT_EQ(error_text([&] { trainer::find_max_micro_batch_by_curve(probe, 0, 4, 10); }),
            "find_max_micro_batch_by_curve: need 1 <= lo <= hi, got lo = 0, hi = 4");
  EXPECT_EQ(error_text([&] { trainer::find_max_micro_batch_by_curve(probe, 1, 4, 10, 1.0); }),
            "find_max_micro_batch_by_curve: accept must be in (0, 1), got 1.000000");
}

}  // namespace test_memory_curve
