// The backoff path with the cuDNN policy, driven in-process through trainer::Step under a real cap (the
// capped CPU allocator; on a GPU the caching allocator's fraction): which size runs with which cuDNN
// benchmark flag and when timing happens, the rerun of a timing that ran out of memory, pretuning, the
// recovery time and the grow-back probe each step reports, and `micro_batch: auto`'s curve search
// against the exhaustive answer. The CUDA-only tests (suite BackoffCuda, skipped without a GPU) time a
// backoff against the steady step and time cuDNN under a cap.
#include <gtest/gtest.h>

#include <ATen/Context.h>
#include <c10/core/Allocator.h>

#include <algorithm>
#include <chrono>

#include "models/registry.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/report.h"
#include "trainer/numerics/forward.h"
#include "trainer/run/from_config.h"
#include "trainer/step/search.h"
#include "trainer/step/step.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_backoff {

using nlohmann::json;
using testutil::TempDir;
namespace fs = std::filesystem;
using V = std::vector<int64_t>;

namespace {

// An image classifier driven step by step: the parts a TrainingRun builds, from a Config.
struct Rig {
  TempDir dir{"trainer_backoff"};
  trainer::Config cfg;
  torch::Device device;
  std::vector<int64_t> shape;
  models::Model model;
  std::unique_ptr<trainer::Optimizer> optimizer;
  std::unique_ptr<trainer::GradScaler> scaler;
  std::unique_ptr<trainer::MemoryBackend> memory;
  std::unique_ptr<trainer::MemoryReporter> reporter;
  trainer::MetricsLog metrics;
  std::unique_ptr<trainer::Step> step;

  // `retry`: the step reruns a timing that ran out of memory (what CUDA devices get).
  Rig(const trainer::Config& c, std::vector<int64_t> sample_shape, torch::Device dev = torch::Device(torch::kCPU),
      std::optional<bool> retry = std::nullopt)
      : cfg(c), device(dev), shape(std::move(sample_shape)) {
    if (device.is_cpu()) at::set_num_threads(1);
    // The cap's backend first: the weights and the optimizer state count.
    memory = std::make_unique<trainer::PhasePeakBackend>(trainer::make_memory_backend(device));
    torch::manual_seed(5);
    model = trainer::build_model(cfg, shape, 0);
    model->to(device);
    if (cfg.model.channels_last) models::to_channels_last(*model);
    model->train();
    optimizer = std::make_unique<trainer::Optimizer>(trainer::param_slots(*model, false), cfg.optim);
    scaler = std::make_unique<trainer::GradScaler>(
        trainer::GradScalerOptions().enabled(cfg.amp.enabled && cfg.amp.dtype == trainer::AmpDtype::kFp16));
    reporter = std::make_unique<trainer::MemoryReporter>(dir.str());
    metrics.open((dir / "metrics.jsonl").string());
    trainer::StepParts parts;
    parts.model = model;
    parts.optimizer = optimizer.get();
    parts.scaler = scaler.get();
    parts.memory = memory.get();
    parts.reporter = reporter.get();
    parts.metrics = &metrics;
    trainer::StepOptions o = trainer::step_options(cfg, device);
    if (retry) o.cudnn.retry_tuning_oom = *retry;
    step = std::make_unique<trainer::Step>(
        parts, o, trainer::make_controller(trainer::micro_batch_options(cfg, cfg.train.global_batch), 0));
  }

  // The samples of step `seed` (their own generator: the global one belongs to the model).
  data::Batch batch(int64_t seed) const {
    auto gen = at::detail::createCPUGenerator(100 + seed);
    std::vector<int64_t> full = {cfg.train.global_batch};
    full.insert(full.end(), shape.begin(), shape.end());
    data::Batch b;
    b.images = torch::randn(full, gen).to(device);
    b.labels = torch::randint(cfg.model.num_classes, {cfg.train.global_batch}, gen, torch::kLong).to(device);
    for (int64_t i = 0; i < cfg.train.global_batch; ++i) b.indices.push_back(seed * 1000 + i);
    b.global_size = cfg.train.global_batch;
    return b;
  }

  // The CPU cap is the process's: a test that fails must not leave it on for the next one. (The cap is
  // absolute bytes, so the rigs of one comparison live one after the other, never side by side.)
  ~Rig() { memory->set_limit(0); }

  // Step `s` under `cap` (0: none), as the loop runs it; `seconds`: the step's own wall time.
  trainer::StepResult run(int64_t s, int64_t cap, double* seconds = nullptr) {
    memory->set_limit(cap);
    auto b = batch(s);
    const auto t = std::chrono::steady_clock::now();
    auto r = step->run(b, s, 0.05, cap);  // ends in a host sync (the loss)
    if (seconds) *seconds = testutil::seconds_since(t);
    return r;
  }

  std::vector<json> events(const std::string& kind) const {
    std::vector<json> out;
    for (const auto& l : testutil::read_jsonl((dir / "metrics.jsonl").string()))
      if (l.value("event", "") == kind) out.push_back(l);
    return out;
  }

  std::map<std::string, torch::Tensor> weights() const {
    std::map<std::string, torch::Tensor> m;
    for (const auto& p : model->named_parameters()) m[p.key()] = p.value().detach().to(torch::kCPU).clone();
    for (const auto& b : model->named_buffers()) m[b.key()] = b.value().detach().to(torch::kCPU).clone();
    return m;
  }
};

// ResNet-20 on 3x12x12 images, global batch 16, SGD with momentum, on the CPU; `policy` the cuDNN mode.
trainer::Config small_job(const std::string& policy, int64_t global = 16) {
  trainer::Config c;
  c.model.name = "resnet20";
  c.model.num_classes = 10;
  c.optim.name = trainer::OptimKind::kSgd;
  c.optim.lr = 0.05;
  c.train.global_batch = global;
  c.train.micro_batch = 0;
  c.memory.grow_after = 1000;
  c.memory.headroom = 0;
  c.memory.cudnn_policy = trainer::mode_from_name<trainer::CudnnMode>(policy);
  return c;
}
const std::vector<int64_t> kSmall = {3, 12, 12};

// The largest step peak of an uncapped rig at `micro` over steps 1..steps (step 1 carries no optimizer
// state: steps >= 2 for the steady peak).
int64_t peak_at(const trainer::Config& base, int64_t micro, int64_t steps) {
  trainer::Config c = base;
  c.train.micro_batch = micro;
  Rig r(c, kSmall);
  int64_t peak = 0;
  for (int64_t s = 1; s <= steps; ++s) peak = std::max(peak, r.run(s, 0).mem_peak_bytes);
  return peak;
}

}  // namespace

// `start`: step 1 times 16; under a cap between the steady peaks at 8 and 16, step 2 backs off to 8 with
// the heuristics (no timing in the recovery); the grow-back probe to 16 when the cap goes finds 16 timed.
// `always` on the same steps times 8 inside the recovery. The flag the step sets is cuDNN's global flag.
TEST(CudnnStep, EachAttemptRunsWithThePolicysFlagAndTheRecordSaysSo) {
  const int64_t p16 = peak_at(small_job("start"), 16, 2), p8 = peak_at(small_job("start"), 8, 2);
  ASSERT_GT(p16, p8);
  const int64_t cap = (p8 + p16) / 2;
  for (const std::string policy : {"start", "always"}) {
    SCOPED_TRACE(policy);
    Rig r(small_job(policy), kSmall);
    const auto s1 = r.run(1, 0);
    EXPECT_TRUE(s1.cudnn_benchmark);
    EXPECT_TRUE(at::globalContext().benchmarkCuDNN()) << "the step sets cuDNN's own flag";
    EXPECT_EQ(s1.new_sizes, V({16}));
    EXPECT_EQ(s1.tuned_sizes, V({16}));
    EXPECT_EQ(s1.recovery_s, 0);

    double wall = 0;
    const auto s2 = r.run(2, cap, &wall);
    ASSERT_EQ(s2.oom_retries, 1);
    EXPECT_EQ(s2.micro_batch, 8);
    EXPECT_EQ(s2.new_sizes, V({8}));
    EXPECT_GT(s2.recovery_s, 0);
    EXPECT_LT(s2.recovery_s, wall) << "from the OOM, inside the step";
    if (policy == "start") {
      EXPECT_FALSE(s2.cudnn_benchmark) << "nothing in the recovery waits for timing";
      EXPECT_TRUE(s2.tuned_sizes.empty());
      EXPECT_FALSE(at::globalContext().benchmarkCuDNN());
    } else {
      EXPECT_TRUE(s2.cudnn_benchmark);
      EXPECT_EQ(s2.tuned_sizes, V({8})) << "always: the backoff's size is timed at its first use";
    }
    const auto s3 = r.run(3, cap);
    EXPECT_EQ(s3.oom_retries, 0);
    EXPECT_TRUE(s3.new_sizes.empty());

    // The cap goes: after the next clean step the ladder probes 16 again, a size used before: nothing
    // new to choose.
    r.step->on_limit_changed(0, 3);
    const auto s4 = r.run(4, 0);
    EXPECT_EQ(s4.probe, "");
    EXPECT_EQ(s4.micro_batch, 8);
    const auto s5 = r.run(5, 0);
    EXPECT_EQ(s5.probe, "grow");
    EXPECT_EQ(s5.micro_batch, 16);
    EXPECT_TRUE(s5.new_sizes.empty());
    EXPECT_TRUE(r.step->cudnn().tuned(16));
    EXPECT_EQ(r.step->cudnn().tuned(8), policy == "always");

    // The record: one cudnn event per first use, written with the step, after the step's OOM event.
    const auto ev = r.events("cudnn");
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0]["step"], 1);
    EXPECT_EQ(ev[0]["attempt"], "step");
    EXPECT_EQ(ev[0]["tuned_sizes"], json({16}));
    EXPECT_EQ(ev[1]["step"], 2);
    EXPECT_EQ(ev[1]["new_sizes"], json({8}));
    EXPECT_EQ(ev[1]["benchmark"], policy == "always");
    const auto lines = testutil::read_jsonl((r.dir / "metrics.jsonl").string());
    size_t oom_at = 0, cudnn8_at = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].value("event", "") == "oom") oom_at = i;
      if (lines[i].value("event", "") == "cudnn" && lines[i]["step"] == 2) cudnn8_at = i;
    }
    EXPECT_LT(oom_at, cudnn8_at);
  }
}

// Where timing can run out of memory in its own workspaces (a CUDA device), the attempt that timed the
// start size and failed runs once more at the same size with the heuristics, and only then does the
// ladder back off. Here the cap (between the first step's peaks at 8 and 16) fails both for real, so the
// sequence is: timed attempt at 16, OOM, rerun at 16, OOM, backoff to 8. Without the rerun (the CPU's
// setting) the ladder moves at once.
TEST(CudnnStep, ATimingThatRanOutOfMemoryIsRunAgainBeforeTheLadderMoves) {
  const int64_t p16 = peak_at(small_job("start"), 16, 1), p8 = peak_at(small_job("start"), 8, 1);
  ASSERT_GT(p16, p8);
  const int64_t cap = (p8 + p16) / 2;
  {
    Rig r(small_job("start"), kSmall, torch::Device(torch::kCPU), /*retry=*/true);
    const auto s1 = r.run(1, cap);
    EXPECT_EQ(s1.oom_retries, 2);
    EXPECT_EQ(s1.micro_batch, 8);
    EXPECT_EQ(s1.new_sizes, V({16, 8}));
    EXPECT_EQ(s1.tuned_sizes, V({16}));
    EXPECT_FALSE(s1.cudnn_benchmark);
    std::vector<std::string> order;
    for (const auto& l : testutil::read_jsonl((r.dir / "metrics.jsonl").string())) {
      const std::string ev = l.value("event", "");
      if (ev == "cudnn") order.push_back(l["retry"].get<bool>() ? "rerun" : "cudnn " + l["sizes"].dump());
      if (ev == "oom") order.push_back("oom " + l.value("kind", ""));
    }
    EXPECT_EQ(order, std::vector<std::string>({"cudnn [16]", "oom timing_rerun", "rerun", "oom backoff", "cudnn [8]"}));
  }
  Rig plain(small_job("start"), kSmall);
  const auto p1 = plain.run(1, cap);
  EXPECT_EQ(p1.oom_retries, 1);
  EXPECT_EQ(p1.micro_batch, 8);
}

// pretune: before the first step, one forward and backward at each of the ladder's next halvings (8, 4,
// 2 below 16) with the flag on; nothing trains (the same losses and weights as a run without it, bit for
// bit), and a backoff to 8 later finds it timed.
TEST(CudnnStep, PretuneTimesTheLaddersSizesAndTrainsNothing) {
  const int64_t cap = (peak_at(small_job("start"), 8, 2) + peak_at(small_job("start"), 16, 2)) / 2;
  // The reference first: the same two steps without pretuning.
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> reference;
  {
    Rig plain(small_job("start"), kSmall);
    EXPECT_TRUE(trainer::MicroBatchSearcher(*plain.step).pretune(plain.batch(1), 0).tuned.empty()) << "only in pretune mode";
    for (int64_t s = 1; s <= 2; ++s) losses.push_back(plain.run(s, 0).loss);
    reference = plain.weights();
  }
  Rig tuned(small_job("pretune"), kSmall);
  auto before = tuned.weights();
  const trainer::Pretune p = trainer::MicroBatchSearcher(*tuned.step).pretune(tuned.batch(1), 0);
  EXPECT_EQ(p.tuned, V({8, 4, 2}));
  EXPECT_TRUE(p.skipped.empty());
  EXPECT_TRUE(testutil::bitwise_equal(before, tuned.weights())) << "pretune changed the weights or BN statistics";
  for (int64_t s = 1; s <= 2; ++s) EXPECT_EQ(tuned.run(s, 0).loss, losses[s - 1]) << s;
  EXPECT_TRUE(testutil::bitwise_equal(tuned.weights(), reference));
  const auto ev = tuned.events("cudnn_pretune");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["tuned"], json({8, 4, 2}));
  for (int64_t s : {8, 4, 2}) EXPECT_TRUE(tuned.step->cudnn().tuned(s)) << s;
  EXPECT_TRUE(tuned.step->cudnn().tuned(16)) << "the first step times the start";
  // A backoff to 8 meets no new size. (The copies of the weights go first: the cap counts every tensor.)
  before.clear();
  reference.clear();
  const auto s3 = tuned.run(3, cap);
  EXPECT_EQ(s3.micro_batch, 8);
  EXPECT_TRUE(s3.new_sizes.empty());
}

// micro_batch: auto under a real cap, three caps: the curve search's pick against the exhaustive answer
// (the same probe run at every size, the plain way: the first micro-batch's forward and backward, then
// the second's with the gradients alive, with the optimizer state and the snapshot held as the search
// holds them) and against the doubling search. The curve search's probes are counted.
TEST(AutoSearch, TheCurveFindsNinetyPercentOfTheExhaustiveAnswerInFewProbes) {
  const int64_t G = 40;
  trainer::Config cfg = small_job("off", G);
  Rig r(cfg, kSmall);
  const data::Batch b = r.batch(1);
  r.optimizer->allocate_state();
  const int64_t base = r.memory->current_bytes();
  // Each size's probe peak, uncapped, the plain way.
  std::vector<int64_t> need(G + 1, 0);
  {
    const trainer::StepSnapshot snap(*r.model, r.device);
    const auto fo = trainer::step_options(cfg, r.device).forward;
    for (int64_t m = 1; m <= G; ++m) {
      r.memory->reset_peak();
      for (int64_t at = 0; at < std::min<int64_t>(2 * m, G); at += m) {
        const int64_t n = std::min<int64_t>(m, G - at);
        auto out = trainer::forward_logits(*r.model, b.images.narrow(0, at, n), b.labels.narrow(0, at, n), fo);
        trainer::summed_cross_entropy(out.logits, out.targets, {}, out.columns).backward();  // the probe's loss
      }
      need[m] = r.memory->peak_bytes();
      r.optimizer->zero_grad();
      snap.restore();
    }
  }
  ASSERT_EQ(r.memory->current_bytes(), base);
  for (int64_t target : {6, 17, 33}) {
    SCOPED_TRACE(target);
    // A cap just above the probe's need at `target`: the exhaustive answer is the largest size whose need
    // is under it (the needs are not monotone at G: the whole batch runs one pass, no gradients alive).
    const int64_t cap = need[target] + 1;
    int64_t exhaustive = 0;
    for (int64_t m = 1; m <= G; ++m)
      if (need[m] <= cap) exhaustive = m;
    ASSERT_GE(exhaustive, target);
    r.memory->set_limit(cap);
    auto search = [&](const std::string& how) {
      trainer::Config c = cfg;
      c.memory.auto_search = trainer::mode_from_name<trainer::AutoSearch>(how);
      trainer::StepParts parts;
      parts.model = r.model;
      parts.optimizer = r.optimizer.get();
      parts.scaler = r.scaler.get();
      parts.memory = r.memory.get();
      parts.reporter = r.reporter.get();
      trainer::Step s(parts, trainer::step_options(c, r.device),
                      trainer::make_controller(trainer::micro_batch_options(c, G), cap));
      return trainer::MicroBatchSearcher(s).find(b, 1, cap);
    };
    const trainer::MicroBatchSearch curve = search("curve"), doubling = search("doubling");
    EXPECT_EQ(curve.method, "curve");
    EXPECT_EQ(doubling.method, "doubling");
    EXPECT_LE(curve.micro_batch, exhaustive);
    EXPECT_GE(static_cast<double>(curve.micro_batch), 0.9 * static_cast<double>(exhaustive)) << curve.trace.dump();
    EXPECT_LE(curve.probes, 5) << curve.trace.dump();
    EXPECT_LT(curve.probes, doubling.probes);
    EXPECT_EQ(static_cast<int64_t>(curve.trace.size()), curve.probes);
    // Every probe's peak is what the plain way measured at its size, and every probe, failed or not,
    // leaves the memory as it found it (a backward that ran out of memory left its graph's remaining
    // autograd tasks, and their saved activations, held until the next backward).
    for (const auto& t : curve.trace)
      if (t["fits"].get<bool>()) EXPECT_EQ(t["peak_bytes"].get<int64_t>(), need[t["micro_batch"].get<int64_t>()]) << t;
    for (const auto* s : {&curve, &doubling})
      for (const auto& t : s->trace)
        EXPECT_EQ(t["held_after_bytes"], s->trace[0]["held_after_bytes"]) << s->method << " " << t;
    RecordProperty("target" + std::to_string(target),
                   "curve " + std::to_string(curve.micro_batch) + " in " + std::to_string(curve.probes) +
                       " probes, doubling " + std::to_string(doubling.micro_batch) + " in " +
                       std::to_string(doubling.probes) + ", exhaustive " + std::to_string(exhaustive));
    r.memory->set_limit(0);
  }
}

// The whole run: the auto_micro_batch event says how the search went (method, probes with their roles),
// the calibration probes ran with the heuristics and the confirm probe timed, and a step that backed off
// reports its recovery and the sizes it met first; `doubling` is the search before the curve.
TEST(AutoSearch, TheRunRecordsTheSearchTheProbesFlagsAndTheRecovery) {
  TempDir dir;
  const std::string cfg = "--config " + testutil::source_dir() + "/configs/bench_oom_tiny.yaml";
  auto peak = [&](int64_t m) {
    const auto run_dir = (dir / ("p" + std::to_string(m))).string();
    auto r = testutil::run(testutil::trainer_cmd(run_dir, cfg + " --set train.steps=2 --set train.micro_batch=" +
                                                              std::to_string(m)));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    int64_t p = 0;
    for (const auto& l : testutil::step_lines(run_dir)) p = std::max(p, l["mem_peak_bytes"].get<int64_t>());
    return p;
  };
  const int64_t p4 = peak(4), p8 = peak(8), p16 = peak(16);
  const std::string capped = cfg + " --set memory.limit=" + std::to_string((p4 + p8) / 2) + " --set train.steps=2";
  const auto curve_dir = (dir / "curve").string();
  auto r = testutil::run(testutil::trainer_cmd(
      curve_dir, capped + " --set train.micro_batch=auto --set memory.auto_search=curve --set memory.cudnn_policy=start"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ev = testutil::events(curve_dir, "auto_micro_batch");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["method"], "curve");
  EXPECT_LE(ev[0]["probes"].get<int64_t>(), 5) << ev[0].dump();
  ASSERT_EQ(ev[0]["trace"].size(), ev[0]["probes"].get<size_t>());
  EXPECT_EQ(ev[0]["trace"][0]["role"], "calibrate");
  EXPECT_EQ(ev[0]["trace"][0]["micro_batch"], 1);
  EXPECT_EQ(ev[0]["trace"][1]["micro_batch"], 8);
  const auto start = testutil::events(curve_dir, "start");
  ASSERT_EQ(start.size(), 1u);
  EXPECT_EQ(start[0]["cudnn_policy"], "start");
  for (const auto& c : testutil::events(curve_dir, "cudnn"))
    if (c["attempt"] == "calibration_probe") EXPECT_EQ(c["benchmark"], false) << c;
    else if (c["attempt"] == "confirm_probe") EXPECT_EQ(c["benchmark"], !c["new_sizes"].empty()) << c;

  const auto dbl_dir = (dir / "doubling").string();
  r = testutil::run(testutil::trainer_cmd(dbl_dir, capped + " --set train.micro_batch=auto --set memory.auto_search=doubling"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto dbl = testutil::events(dbl_dir, "auto_micro_batch");
  ASSERT_EQ(dbl.size(), 1u);
  EXPECT_EQ(dbl[0]["method"], "doubling");
  EXPECT_GE(ev[0]["micro_batch"].get<double>(), 0.9 * dbl[0]["micro_batch"].get<double>());

  // Started at the whole batch under a cap between the peaks at 8 and 16: step 1 backs off to 8, and its
  // line says how long from the OOM and what it met first.
  const auto cut_dir = (dir / "cut").string();
  r = testutil::run(testutil::trainer_cmd(cut_dir, cfg + " --set memory.limit=" + std::to_string((p8 + p16) / 2) +
                                                       " --set train.steps=2 --set train.micro_batch=0 --set memory.cudnn_policy=start"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto s = testutil::step_lines(cut_dir);
  ASSERT_EQ(s.size(), 2u);
  ASSERT_GE(s[0]["oom_retries"].get<int64_t>(), 1);
  EXPECT_GT(s[0]["recovery_s"].get<double>(), 0.0);
  EXPECT_LE(s[0]["recovery_s"].get<double>(), s[0]["step_time_s"].get<double>());
  EXPECT_EQ(s[0]["micro_batch"], 8);
  EXPECT_EQ(s[0]["new_sizes"], json({16, 8}));
  EXPECT_EQ(s[0]["tuned_sizes"], json({16}));
  EXPECT_FALSE(s[1].contains("recovery_s"));
  EXPECT_FALSE(s[1].contains("new_sizes"));
}

// ---- a stop during the search ------------------------------------------------------------------------

// A stop during the search (the run passes its SIGTERM flag): asked before each probe and at every block
// boundary inside one, it ends the probe in progress within one block, puts back what the probes
// changed, and leaves the probes that ran to their end with the caller; a search given those as known
// answers reaches the uninterrupted search's size, probing only what was left. The checks are counted by
// hand: ResNet-20 has 9 blocks, a probe of m < G is two passes (two micro-batches), each with 9 checks
// in forward and 9 in backward, after the one before the probe. So probe 1 (m = 1) asks 1 + 2 x 18 = 37
// times; probe 2 (m = 8) asks before itself (38), in the first pass's forward (39-47), and in its
// backward, which meets block 9's input first (48), block 8's (49), block 7's (50).
TEST(AutoSearch, AStopEndsTheProbeAtABlockAndItsFindingsResumeTheSearch) {
  const int64_t G = 40;
  trainer::Config cfg = small_job("off", G);
  cfg.memory.auto_search = trainer::AutoSearch::kCurve;  // a function of the outcomes alone (auto's choice is timed)
  Rig r(cfg, kSmall);
  ASSERT_EQ(r.model->num_blocks(), 9);
  const data::Batch b = r.batch(1);
  r.optimizer->allocate_state();
  // A cap just above the probe's need at 17, measured the plain way (as the curve test above does).
  int64_t need17 = 0;
  {
    const trainer::StepSnapshot snap(*r.model, r.device);
    const auto fo = trainer::step_options(cfg, r.device).forward;
    r.memory->reset_peak();
    for (int64_t at = 0; at < G; at += 17) {
      const int64_t n = std::min<int64_t>(17, G - at);
      if (at >= 34) break;  // the probe's two passes
      auto out = trainer::forward_logits(*r.model, b.images.narrow(0, at, n), b.labels.narrow(0, at, n), fo);
      trainer::summed_cross_entropy(out.logits, out.targets, {}, out.columns).backward();  // the probe's loss
    }
    need17 = r.memory->peak_bytes();
    r.optimizer->zero_grad();
    snap.restore();
  }
  const int64_t cap = need17 + 1;
  r.memory->set_limit(cap);
  auto search = [&](const trainer::SearchControl& control) {
    trainer::StepParts parts;
    parts.model = r.model;
    parts.optimizer = r.optimizer.get();
    parts.scaler = r.scaler.get();
    parts.memory = r.memory.get();
    parts.reporter = r.reporter.get();
    trainer::Step s(parts, trainer::step_options(cfg, r.device),
                    trainer::make_controller(trainer::micro_batch_options(cfg, G), cap));
    return trainer::MicroBatchSearcher(s).find(b, 1, cap, 0, control);
  };
  auto sizes_of = [](const json& trace) {
    V v;
    for (const auto& t : trace) v.push_back(t["micro_batch"].get<int64_t>());
    return v;
  };
  int64_t asked = 0;
  auto stop_at = [&](int64_t n) { return [&asked, n] { return ++asked == n; }; };

  trainer::SearchControl plain;
  plain.stop = stop_at(-1);  // asked, never stops
  search(plain);  // the first search leaves the gradients allocated: every later one starts from the same
  const auto before = r.weights();  // (its copies count against the cap from here on, in every search)
  const int64_t base = r.memory->current_bytes();
  const trainer::MicroBatchSearch whole = search(plain);
  ASSERT_EQ(r.memory->current_bytes(), base);

  ASSERT_FALSE(whole.stopped);
  ASSERT_GE(whole.probes, 3) << whole.trace.dump();
  EXPECT_EQ(sizes_of(whole.trace)[0], 1);
  EXPECT_EQ(sizes_of(whole.trace)[1], 8);

  // Stopped in probe 2's backward.
  asked = 0;
  std::map<int64_t, trainer::ProbeOutcome> kept;
  trainer::SearchControl control;
  control.stop = stop_at(50);
  control.on_probe = [&](int64_t m, const trainer::ProbeOutcome& o) { kept[m] = o; };
  const trainer::MicroBatchSearch stopped = search(control);
  EXPECT_TRUE(stopped.stopped);
  EXPECT_EQ(stopped.stopped_at, "in backward at block 7 of 9 of probe 2 (micro-batch 8)");
  EXPECT_EQ(asked, 50);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_TRUE(kept.at(1).fits);
  EXPECT_EQ(kept.at(1).peak_bytes, whole.trace[0]["peak_bytes"].get<int64_t>());
  // Nothing of the stopped probe is left: not its memory, not its changes to the buffers, not the check.
  EXPECT_EQ(r.memory->current_bytes(), base);
  {
    const auto after = r.weights();  // (gone before the next search: its copies would count)
    for (const auto& [name, t] : before) EXPECT_TRUE(torch::equal(t, after.at(name))) << name;
  }
  {
    const auto fo = trainer::step_options(cfg, r.device).forward;
    trainer::forward_logits(*r.model, b.images.narrow(0, 0, 2), b.labels.narrow(0, 0, 2), fo).logits.sum().backward();
    r.optimizer->zero_grad();
    EXPECT_EQ(asked, 50) << "the block check outlived the search";
  }

  // Stopped before the first probe: nothing ran.
  asked = 0;
  kept.clear();
  control.stop = stop_at(1);
  const trainer::MicroBatchSearch at_once = search(control);
  EXPECT_TRUE(at_once.stopped);
  EXPECT_EQ(at_once.stopped_at, "before probe 1 (micro-batch 1)");
  EXPECT_TRUE(kept.empty());

  // The restart: probe 1 answered from the findings, the rest probed, the same answer as the whole search.
  trainer::SearchControl resume;
  resume.known = {{1, whole.trace[0]["fits"].get<bool>() ? trainer::ProbeOutcome{true, whole.trace[0]["peak_bytes"].get<int64_t>()}
                                                          : trainer::ProbeOutcome{}}};
  const trainer::MicroBatchSearch resumed = search(resume);
  EXPECT_FALSE(resumed.stopped);
  EXPECT_EQ(resumed.micro_batch, whole.micro_batch);
  EXPECT_EQ(sizes_of(resumed.trace), sizes_of(whole.trace)) << resumed.trace.dump();
  EXPECT_EQ(resumed.reused, 1);
  EXPECT_EQ(resumed.probes, whole.probes);
  EXPECT_TRUE(resumed.trace[0].value("reused", false));
  EXPECT_FALSE(resumed.trace[1].value("reused", false));
}

// The same through the executable, with a probe slow enough to be in progress when SIGTERM comes
// (ResNet-50 at 96x96, micro-batch 8 on one thread: seconds on a CPU): exit 143 before any step, the stop
// event and the log say where, auto_search.json holds probe 1; the restart takes probe 1 from it, probes
// the rest and starts at the size an uninterrupted run finds.
TEST(AutoSearch, SigtermDuringAProbeExits143AndTheRestartResumesTheSearch) {
  TempDir dir;
  const std::string job = "--config " + testutil::source_dir() +
                          "/configs/bench_oom_tiny.yaml --set model.name=resnet50 --set 'data.shape=[3,96,96]' "
                          "--set train.micro_batch=auto --set memory.auto_search=curve --set train.steps=1 "
                          "--set memory.limit=16GiB "
                          "--set log.level=info";
  const auto whole = (dir / "whole").string(), stopped = (dir / "stopped").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = testutil::events(whole, "auto_micro_batch");
  ASSERT_EQ(ref.size(), 1u);
  ASSERT_EQ(ref[0]["trace"].size(), 3u) << ref[0].dump();  // 1, 8 and the whole batch, under no real limit
  // Probe 2's time in the uninterrupted run: one that long is surely in progress when SIGTERM comes.
  const double probe2_s = ref[0]["trace"][1]["s"].get<double>();

  const std::string log = (dir / "stopped.log").string();
  const pid_t pid = testutil::spawn(testutil::trainer_cmd(stopped, job), log);
  const auto t0 = std::chrono::steady_clock::now();
  while (testutil::read_file(log).find("probe 1:") == std::string::npos && testutil::seconds_since(t0) < 120)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  kill(pid, SIGTERM);
  const int code = testutil::wait_exit(pid);
  const std::string out = testutil::read_file(log);
  ASSERT_EQ(code, 143) << out;
  const auto stops = testutil::events(stopped, "stop");
  ASSERT_EQ(stops.size(), 1u) << out;
  EXPECT_EQ(stops[0]["during"], "auto_search");
  EXPECT_EQ(stops[0]["step"], 0);
  const std::string at = stops[0]["at"].get<std::string>();
  if (probe2_s > 2.0)  // (a quicker probe 2 may end before the signal lands: then before probe 3)
    EXPECT_NE(at.find("of probe 2 (micro-batch 8)"), std::string::npos) << at << "; probe 2 takes " << probe2_s << " s";
  else
    EXPECT_TRUE(at.find("of probe 2 (micro-batch 8)") != std::string::npos || at == "before probe 3 (micro-batch 16)") << at;
  EXPECT_TRUE(testutil::step_lines(stopped).empty());
  EXPECT_NE(out.find("stop requested by SIGTERM during micro_batch auto's search, in "), std::string::npos) << out;
  const json kept = json::parse(testutil::read_file(fs::path(stopped) / "auto_search.json"));
  ASSERT_EQ(kept["searches"].size(), 1u) << kept;
  ASSERT_EQ(kept["searches"][0]["probes"].size(), 1u) << kept;
  EXPECT_EQ(kept["searches"][0]["probes"][0]["micro_batch"], 1);
  EXPECT_EQ(kept["searches"][0]["probes"][0]["peak_bytes"], ref[0]["trace"][0]["peak_bytes"]);

  r = testutil::run(testutil::trainer_cmd(stopped, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 probe(s) of an earlier process under the same conditions are taken from"), std::string::npos)
      << r.output;
  const auto ev = testutil::events(stopped, "auto_micro_batch");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["micro_batch"], ref[0]["micro_batch"]);
  EXPECT_EQ(ev[0]["reused_probes"], 1);
  ASSERT_EQ(ev[0]["trace"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ev[0]["trace"][i]["micro_batch"], ref[0]["trace"][i]["micro_batch"]) << i;
    EXPECT_EQ(ev[0]["trace"][i].value("reused", false), i == 0) << i;
  }
  EXPECT_EQ(testutil::step_lines(stopped).size(), 1u);

  // Findings under other conditions (another limit) are not taken: that search starts afresh, and the
  // file then holds its probes only.
  const auto other = dir / "other";
  fs::create_directories(other);
  fs::copy_file(fs::path(stopped) / "auto_search.json", other / "auto_search.json");
  r = testutil::run(testutil::trainer_cmd(other.string(), job + " --set memory.limit=15GiB"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testutil::events(other.string(), "auto_micro_batch")[0]["reused_probes"], 0);
  const json rewritten = json::parse(testutil::read_file(other / "auto_search.json"));
  ASSERT_EQ(rewritten["searches"].size(), 1u);
  EXPECT_EQ(rewritten["searches"][0]["probes"].size(), 3u);
  EXPECT_EQ(rewritten["searches"][0]["conditions"]["limit"], int64_t{15} << 30);
}

// ---- on a GPU ------------------------------------------------------------------------------------------
// ResNet-50 at the GPU job's shape (fp16 autocast, channels_last). cuDNN's plans are cached per process:
// each test uses image sizes of its own so that no test finds another's plans.

namespace {

trainer::Config gpu_job(int64_t global, const std::string& policy) {
  trainer::Config c;
  c.model.name = "resnet50";
  c.model.num_classes = 1000;
  c.model.channels_last = true;
  c.amp.enabled = true;
  c.amp.dtype = trainer::AmpDtype::kFp16;
  c.optim.name = trainer::OptimKind::kSgd;
  c.optim.lr = 0.1;
  c.train.global_batch = global;
  c.train.micro_batch = 0;
  c.memory.grow_after = 1000;
  c.memory.headroom = 0;
  c.memory.cudnn_policy = trainer::mode_from_name<trainer::CudnnMode>(policy);
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

// The recovery in `start` mode: steady steps at 256, then a cap between the peaks at 128 and 256 (placed
// from the steady peak, so that 128 stays a size never used): the step that runs out of memory completes
// at 128 within 20 steady steps of its OOM (the 1 s at 0.05 s a step), and the step after it,
// at 128, within 2 steady steps. A timing of 128's algorithms would take seconds.
TEST(BackoffCuda, ABackoffRecoversWithin20SteadyStepsAndTheNextStepWithin2) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: a backoff on a GPU cannot be timed here";
  Rig r(gpu_job(256, "start"), {3, 224, 224}, torch::Device(torch::kCUDA, 0));
  std::vector<double> steady;
  int64_t peak = 0, start = 0;
  for (int64_t s = 1; s <= 5; ++s) {
    double secs = 0;
    const auto res = r.run(s, 0, &secs);
    if (s >= 2) {
      steady.push_back(secs);
      peak = std::max(peak, res.mem_peak_bytes);
      start = res.mem_start_bytes;
    }
  }
  const double t256 = median(steady);
  const int64_t cap = start + (peak - start) * 3 / 4;
  double cut_wall = 0, next_wall = 0;
  const auto cut = r.run(6, cap, &cut_wall);
  const auto next = r.run(7, cap, &next_wall);
  RecordProperty("steady_step_s", std::to_string(t256));
  RecordProperty("recovery_s", std::to_string(cut.recovery_s));
  RecordProperty("oom_step_s", std::to_string(cut_wall));
  RecordProperty("next_step_s", std::to_string(next_wall));
  ASSERT_GE(cut.oom_retries, 1) << "the cap " << cap << " did not bind (peak " << peak << ")";
  EXPECT_LE(cut.micro_batch, 128);
  EXPECT_TRUE(cut.tuned_sizes.empty());
  EXPECT_LT(cut.recovery_s, 20 * t256) << "steady step " << t256 << " s";
  EXPECT_EQ(next.oom_retries, 0);
  EXPECT_EQ(next.micro_batch, cut.micro_batch);
  EXPECT_LT(next_wall, 2 * t256) << "steady step " << t256 << " s";
  r.memory->set_limit(0);
  r.memory->empty_cache();
}

// Timing allocates workspaces of its own. Under a cap at which 64 ran its steady steps, a smaller size
// met for the first time (60, split {60, 4}) is timed (policy `always`) and completes with no OOM at all
// (no rerun, no backoff), its peak under the cap.
TEST(BackoffCuda, TimingUnderACapDoesNotTurnAFittingSizeIntoAnOom) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: cuDNN timing cannot run here";
  Rig r(gpu_job(64, "always"), {3, 160, 160}, torch::Device(torch::kCUDA, 0));
  int64_t peak = 0;
  for (int64_t s = 1; s <= 3; ++s) {
    const auto res = r.run(s, 0);
    if (s >= 2) peak = std::max(peak, res.mem_peak_bytes);
  }
  const int64_t cap = peak + peak / 50;  // 2% over the steady peak at 64
  trainer::Config c = r.cfg;
  c.train.micro_batch = 60;
  r.step->set_controller(trainer::make_controller(trainer::micro_batch_options(c, 64), cap));
  const auto res = r.run(4, cap);
  RecordProperty("cap_bytes", std::to_string(cap));
  RecordProperty("peak_bytes", std::to_string(res.mem_peak_bytes));
  EXPECT_EQ(res.tuned_sizes, V({60, 4})) << "the sizes were new and timed";
  EXPECT_EQ(res.oom_retries, 0) << "timing under the cap ran out of memory";
  EXPECT_EQ(res.micro_batch, 60);
  EXPECT_LE(res.mem_peak_bytes, cap);
  r.memory->set_limit(0);
  r.memory->empty_cache();
}

// An out-of-memory error inside backward: the failed graph's remaining autograd tasks stay in the ready
// queue of the thread that ran it, each holding its node and, through it, saved activations, until the
// next backward on that thread pops them. Under a cap between the bytes held after the forward and the
// peak (so the OOM comes in backward), a failed probe must leave nothing held: the search returns with
// the memory as it found it (Step::drop_failed_attempt, which a failed step attempt goes through too).
// ResNet-50 (its downsample branches leave tasks queued; ResNet-20's option-A shortcuts did not), on
// 3x12x12 images so that it takes seconds. Before the queue was drained after an OOM, the failed probe
// left 5.5 MB held (and the previous rig's tensors with it).
TEST(AutoSearch, AnOomInBackwardLeavesNothingHeldForTheNextAttempt) {
  const int64_t G = 16;
  auto small_job = [](const std::string& p, int64_t g) {
    auto c = test_backoff::small_job(p, g);
    c.model.name = "resnet50";
    return c;
  };
  int64_t after_forward = 0, peak = 0, base = 0;
  {
    Rig r(small_job("off", G), kSmall);
    r.run(1, 0);  // the optimizer state exists from here on
    r.optimizer->zero_grad();  // as every attempt and probe starts
    base = r.memory->current_bytes();
    const data::Batch b = r.batch(2);
    r.memory->reset_peak();
    auto out = trainer::forward_logits(*r.model, b.images, b.labels, trainer::step_options(r.cfg, r.device).forward);
    auto loss = torch::nn::functional::cross_entropy(out.logits, out.targets);
    after_forward = r.memory->current_bytes();
    loss.backward();
    peak = r.memory->peak_bytes();
  }
  ASSERT_LT(after_forward + (64 << 10), peak) << "the backward must need more than the forward left";
  const int64_t cap = (after_forward + peak) / 2;
  {
    Rig r(small_job("off", G), kSmall);
    r.run(1, 0);
    r.optimizer->zero_grad();
    ASSERT_EQ(r.memory->current_bytes(), base);
    r.memory->set_limit(cap);
    const data::Batch b = r.batch(2);
    const auto held = r.memory->current_bytes();
    const auto found = trainer::MicroBatchSearcher(*r.step).find(b, G, cap);  // the floor is the whole batch: one probe
    ASSERT_EQ(found.trace.size(), 1u);
    EXPECT_FALSE(found.trace[0]["fits"].get<bool>());
    EXPECT_EQ(r.memory->current_bytes(), held) << "the failed probe left tensors held";
  }
}

}  // namespace test_backoff
