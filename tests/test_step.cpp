// The optimizer step driven in-process (trainer/step/step.h), without the executable: backoff under a real
// cap of the capped CPU allocator, the retried step against a clean run at the size it backed off to,
// grow-back when the cap rises, giving up, and the snapshot of every generator the step draws from.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include "common/compat.h"
#include "models/registry.h"
#include "test_util.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/run/from_config.h"
#include "trainer/step/step.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_step {

using testutil::TempDir;

namespace {

constexpr int64_t kBatch = 8, kContext = 64, kVocab = 32;

// A tiny GPT with dropout on the CPU: its dropout masks come from the CPU generator, so a retried
// attempt that did not put the generator back would draw other masks than a clean run.
struct Rig {
  TempDir dir{"trainer_step"};
  models::Model model;
  std::unique_ptr<trainer::Optimizer> optimizer;
  std::unique_ptr<trainer::GradScaler> scaler;
  std::unique_ptr<trainer::MemoryBackend> memory;
  std::unique_ptr<trainer::MemoryReporter> reporter;
  trainer::MetricsLog metrics;
  std::unique_ptr<trainer::Step> step;

  // micro_batch: the first size; grow_after: clean steps before a probe; allow_checkpointing: the
  // ladder's rung after the smallest size.
  // scaling: the GradScaler (off by default).
  // implementation: optim.implementation; skip_on_device: StepOptions::skip_on_device; device: where it
  // trains (a CUDA device's memory backend is the caching allocator's); cuda_graph: train.cuda_graph (off
  // unless a test asks: the others hook gradients, which a captured graph would keep).
  explicit Rig(int64_t micro_batch, int64_t grow_after = 1000, bool allow_checkpointing = true, int64_t min_micro = 1,
               trainer::GradScalerOptions scaling = trainer::GradScalerOptions().enabled(false),
               trainer::OptimImpl implementation = trainer::OptimImpl::kAuto, bool skip_on_device = true,
               torch::Device device = torch::Device(torch::kCPU), trainer::Switch cuda_graph = trainer::Switch::kOff) {
    at::set_num_threads(1);
    // The capped allocator first, so that the weights and the optimizer state count against the cap.
    memory = std::make_unique<trainer::PhasePeakBackend>(device.is_cuda() ? trainer::make_memory_backend(device)
                                                                          : std::unique_ptr<trainer::MemoryBackend>(
                                                                                std::make_unique<trainer::CpuMemoryBackend>()));
    torch::manual_seed(11);
    model = models::create_model("gpt_tiny",
                                 models::ModelOptions().vocab_size(kVocab).context(kContext).dropout(0.2));
    model->to(device);
    trainer::Config cfg;
    cfg.optim.name = trainer::OptimKind::kAdamW;
    cfg.optim.lr = 1e-2;
    cfg.optim.weight_decay = 0;
    cfg.optim.implementation = implementation;
    optimizer = std::make_unique<trainer::Optimizer>(trainer::param_slots(*model, false), cfg.optim);
    scaler = std::make_unique<trainer::GradScaler>(scaling);
    reporter = std::make_unique<trainer::MemoryReporter>(dir.str());
    metrics.open((dir / "metrics.jsonl").string());
    cfg.train.global_batch = kBatch;
    cfg.train.micro_batch = micro_batch;
    cfg.memory.grow_after = grow_after;
    cfg.memory.headroom = 0.0;
    cfg.memory.ladder_checkpointing = allow_checkpointing;
    cfg.memory.min_micro_batch = min_micro;
    trainer::StepParts parts;
    parts.model = model;
    parts.optimizer = optimizer.get();
    parts.scaler = scaler.get();
    parts.memory = memory.get();
    parts.reporter = reporter.get();
    parts.metrics = &metrics;
    auto options = trainer::step_options(cfg, device);
    options.skip_on_device = skip_on_device;
    options.cuda_graph = cuda_graph;
    step = std::make_unique<trainer::Step>(parts, options,
                                           trainer::make_controller(trainer::micro_batch_options(cfg, kBatch), 0));
    torch::manual_seed(12);  // the dropout stream, the same in every rig
    if (device.is_cuda()) torch::cuda::manual_seed_all(12);
  }

  std::map<std::string, torch::Tensor> weights() const {
    std::map<std::string, torch::Tensor> m;
    for (const auto& p : model->named_parameters()) m[p.key()] = p.value().detach().cpu().clone();
    return m;
  }
  // The weights and the optimizer's state (its moments and step count).
  std::map<std::string, torch::Tensor> state() const {
    auto m = weights();
    for (const auto& [k, t] : optimizer->state()) m["optim." + k] = t.detach().cpu().clone();
    return m;
  }
};

// The samples of step `seed`, from a generator of their own (the global one is the dropout stream).
data::Batch batch(int64_t seed) {
  auto stream = torch::randint(kVocab, {kBatch, kContext + 1}, at::detail::createCPUGenerator(1000 + seed), torch::kLong);
  data::Batch b;
  b.images = stream.narrow(1, 0, kContext).contiguous();
  b.labels = stream.narrow(1, 1, kContext).contiguous();
  for (int64_t i = 0; i < kBatch; ++i) b.indices.push_back(seed * kBatch + i);
  b.global_size = kBatch;
  return b;
}

bool bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a)
    if (!b.count(k) || !t.equal(b.at(k))) return false;
  return true;
}

// The peak tensor bytes of a step at `micro_batch` in the steady state, uncapped. The first step is
// lighter: the gradients and the optimizer state do not exist yet while its activations are live.
int64_t steady_peak(int64_t micro_batch) {
  Rig r(micro_batch);
  int64_t peak = 0;
  for (int64_t s = 1; s <= 2; ++s) {
    auto b = batch(s);
    peak = std::max(peak, r.step->run(b, s, 1e-2, 0).mem_peak_bytes);
  }
  return peak;
}

// Step 1 at micro-batch 8, uncapped; the steps after it under `cap` (0 = none).
std::vector<trainer::StepResult> run_steps(Rig& rig, int64_t first, int64_t last, int64_t cap) {
  std::vector<trainer::StepResult> out;
  trainer::ScopedCpuCap scoped(cap);
  for (int64_t s = first; s <= last; ++s) {
    auto b = batch(s);
    out.push_back(rig.step->run(b, s, 1e-2, cap));
  }
  return out;
}

}  // namespace

TEST(StepInProcess, BacksOffUnderARealCapAndEqualsACleanRunAtTheSmallerSize) {
  // A cap between the peaks of micro-batch 4 and 8: the next attempt at 8 runs out of memory for real.
  const int64_t p8 = steady_peak(8), p4 = steady_peak(4);
  ASSERT_GT(p8, p4);
  const int64_t cap = (p8 + p4) / 2;

  Rig capped(8);
  run_steps(capped, 1, 1, 0);
  const auto results = run_steps(capped, 2, 4, cap);
  EXPECT_EQ(results[0].oom_retries, 1);
  EXPECT_EQ(results[0].micro_batch, 4);
  EXPECT_EQ(results[0].accum_steps, 2);
  EXPECT_LE(results[0].mem_peak_bytes, cap);
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_EQ(results[i].oom_retries, 0) << "step " << i + 2 << " tried a size that failed at this cap";
    EXPECT_EQ(results[i].micro_batch, 4);
  }
  EXPECT_EQ(capped.step->controller().micro_batch(), 4);
  // The failed attempt left a memory report naming the step.
  EXPECT_TRUE(std::filesystem::exists(capped.dir / "memory_report_2.json"));

  // The same steps run cleanly at 4: same samples, same dropout masks (the snapshot put the generator
  // back after the failed attempt), so the same losses and weights, bit for bit.
  Rig clean(8);
  run_steps(clean, 1, 1, 0);
  trainer::Config cfg;
  cfg.train.micro_batch = 4;
  clean.step->set_controller(trainer::make_controller(trainer::micro_batch_options(cfg, kBatch), 0));
  const auto reference = run_steps(clean, 2, 4, 0);
  for (size_t i = 0; i < results.size(); ++i) EXPECT_EQ(results[i].loss, reference[i].loss) << "step " << i + 2;
  EXPECT_TRUE(bitwise_equal(capped.weights(), clean.weights()));
}

// Step::run's while_device_runs (the run's fetch-ahead of the next batch): called exactly once per
// completed step, after the step's work is queued (the fused path: after the update; the read-first path:
// before the values are read and the update runs), also when an attempt ran out of memory first and the
// step was retried; never by the search. The results are those of the same steps without it.
TEST(StepInProcess, TheNextBatchIsFetchedOnceAStepWhileTheDeviceRuns) {
  const int64_t cap = (steady_peak(8) + steady_peak(4)) / 2;
  struct Outcome {
    std::vector<trainer::StepResult> results;
    std::vector<int> calls;
    std::vector<bool> updated_when_called;
    std::vector<float> state;  // every weight and moment, outside the capped allocator (it counts every live tensor)
  };
  // One rig at a time: the cap counts every live tensor of the process.
  const auto run = [&](bool fused_skip, bool with_hook) {
    Outcome o;
    Rig rig(8, 1000, true, 1, trainer::GradScalerOptions().enabled(false), fused_skip ? trainer::OptimImpl::kFused : trainer::OptimImpl::kAuto, fused_skip);
    // The first value of every parameter, read in place: the hook allocates nothing under the cap (an
    // allocation there that failed would be the step's OOM).
    const auto firsts = [&] {
      std::vector<float> v;
      for (const auto& p : rig.model->parameters()) v.push_back(p.data_ptr<float>()[0]);
      return v;
    };
    std::vector<float> before;
    int calls = 0;
    bool updated = false;
    const std::function<void()> hook = [&] {
      ++calls;
      updated = firsts() != before;
    };
    for (int64_t s = 1; s <= 3; ++s) {
      const int64_t limit = s == 1 ? 0 : cap;  // step 2 runs out of memory at 8 and is retried at 4
      auto b = batch(s);
      before = firsts();
      calls = 0;
      trainer::ScopedCpuCap scoped(limit);
      o.results.push_back(with_hook ? rig.step->run(b, s, 1e-2, limit, hook) : rig.step->run(b, s, 1e-2, limit));
      o.calls.push_back(calls);
      o.updated_when_called.push_back(updated);
    }
    for (const auto& [k, t] : rig.state()) {
      const auto f = t.to(torch::kFloat).contiguous();
      o.state.insert(o.state.end(), f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
    }
    return o;
  };
  for (const bool fused_skip : {true, false}) {
    if (fused_skip && !trainer::compat::kHasFusedOptimizers) continue;  // LibTorch 1.13: the read-first path only
    SCOPED_TRACE(fused_skip ? "the update queued with its skip flag" : "the values read before the update");
    const Outcome with = run(fused_skip, true), without = run(fused_skip, false);
    for (size_t i = 0; i < with.results.size(); ++i) {
      EXPECT_EQ(with.calls[i], 1) << "step " << i + 1;
      EXPECT_EQ(with.updated_when_called[i], fused_skip) << "step " << i + 1;
      EXPECT_EQ(with.results[i].oom_retries, i == 1 ? 1 : 0) << "step " << i + 1;
      EXPECT_EQ(with.results[i].loss, without.results[i].loss) << "step " << i + 1;
    }
    ASSERT_EQ(with.state.size(), without.state.size());
    EXPECT_EQ(std::memcmp(with.state.data(), without.state.data(), with.state.size() * sizeof(float)), 0);
  }
}

// What the host reads of a step comes back in one copy (Step::read_step_values): the loss, the norm,
// whether the scaler saw inf/NaN and its scale. A power-of-two scale changes no bit of the arithmetic,
// so a scaled step equals an unscaled one in loss, norm and weights; a step whose gradients are not
// finite is skipped, leaves the weights alone and halves the scale that the next step reports.
TEST(StepInProcess, AScaledStepReadsItsLossNormAndScaleAndSkipsANonFiniteGradient) {
  std::vector<trainer::StepResult> p, s;
  std::map<std::string, torch::Tensor> plain_weights;
  {
    Rig plain(8);  // one rig at a time: each seeds the global generator, its dropout stream
    p = run_steps(plain, 1, 3, 0);
    plain_weights = plain.weights();
  }
  Rig scaled(8, 1000, true, 1, trainer::GradScalerOptions().init_scale(1024.0).growth_interval(1).growth_factor(2.0));
  s = run_steps(scaled, 1, 3, 0);
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(p[i].loss_scale, 0.0) << "no scaler, no scale";
    EXPECT_EQ(s[i].loss_scale, 1024.0 * (1 << i)) << "step " << i + 1 << ": the scale its loss was multiplied by";
    EXPECT_EQ(s[i].loss, p[i].loss) << "step " << i + 1;
    EXPECT_EQ(s[i].grad_norm, p[i].grad_norm) << "step " << i + 1;
    EXPECT_TRUE(s[i].updated);
  }
  EXPECT_TRUE(bitwise_equal(scaled.weights(), plain_weights));

  // Step 4's gradient of one weight made infinite by a hook: skipped; step 5 runs at half the scale.
  auto w = scaled.model->parameters().front();
  const auto hook = w.register_hook([](torch::Tensor g) { return g * std::numeric_limits<float>::infinity(); });
  const auto before = scaled.weights();
  const auto o = run_steps(scaled, 4, 4, 0);
  w.remove_hook(hook);
  EXPECT_FALSE(o[0].updated);
  EXPECT_TRUE(std::isfinite(o[0].loss)) << "the loss is read unscaled";
  EXPECT_EQ(o[0].loss_scale, 8192.0);
  EXPECT_TRUE(bitwise_equal(scaled.weights(), before)) << "a skipped step changes no weight";
  const auto next = run_steps(scaled, 5, 5, 0);
  EXPECT_TRUE(next[0].updated);
  EXPECT_EQ(next[0].loss_scale, 4096.0) << "backed off after the non-finite gradient";
  EXPECT_FALSE(bitwise_equal(scaled.weights(), before));
}

// With the fused optimizer the step's skip is decided on the device and its values are read once, after
// the update is queued (Step::update_then_read); the reference is the same fused update decided on the
// host first (skip_on_device false): equal in every bit, clean steps and skipped ones alike. A skipped
// step leaves the weights, the moments and AdamW's step count as they were.
void expect_the_device_skips_as_the_host_does(torch::Device device) {
  if (!trainer::compat::kHasFusedOptimizers) GTEST_SKIP() << "LibTorch " << trainer::compat::torch_version() << " has no fused optimizer kernels";
  const auto scaling = trainer::GradScalerOptions().init_scale(1024.0).growth_interval(1).growth_factor(2.0);
  const auto run = [&](bool on_device, bool scaled) {
    Rig rig(8, 1000, true, 1, scaled ? scaling : trainer::GradScalerOptions().enabled(false), trainer::OptimImpl::kFused, on_device, device);
    std::vector<trainer::StepResult> res = run_steps(rig, 1, 2, 0);
    const auto before = rig.state();
    // Step 3's gradient of one weight made infinite (with a scaler: its inf; without: the norm's).
    auto w = rig.model->parameters().front();
    const auto hook = w.register_hook([](torch::Tensor g) { return g * std::numeric_limits<float>::infinity(); });
    res.push_back(run_steps(rig, 3, 3, 0)[0]);
    w.remove_hook(hook);
    EXPECT_FALSE(res.back().updated);
    EXPECT_TRUE(bitwise_equal(rig.state(), before)) << "a skipped step changed the weights or the optimizer state";
    EXPECT_EQ(rig.optimizer->steps(), 2);
    for (const auto& r : run_steps(rig, 4, 5, 0)) res.push_back(r);
    return std::make_pair(res, rig.state());
  };
  for (bool scaled : {true, false}) {
    const auto [dev, dev_state] = run(true, scaled);
    const auto [host, host_state] = run(false, scaled);
    ASSERT_EQ(dev.size(), host.size());
    for (size_t i = 0; i < dev.size(); ++i) {
      EXPECT_EQ(dev[i].updated, host[i].updated) << "step " << i + 1;
      EXPECT_EQ(dev[i].updated, i != 2) << "step " << i + 1;
      EXPECT_EQ(dev[i].loss, host[i].loss) << "step " << i + 1;
      EXPECT_EQ(dev[i].loss_scale, host[i].loss_scale) << "step " << i + 1;
      if (i != 2) EXPECT_EQ(dev[i].grad_norm, host[i].grad_norm) << "step " << i + 1;
      else EXPECT_FALSE(std::isfinite(dev[i].grad_norm)) << "the norm of an infinite gradient";
    }
    if (scaled) EXPECT_EQ(dev[3].loss_scale, dev[2].loss_scale / 2) << "backed off after the skipped step";
    EXPECT_TRUE(bitwise_equal(dev_state, host_state)) << (scaled ? "scaled" : "unscaled");
  }
}

TEST(StepInProcess, TheFusedUpdateIsSkippedOnTheDeviceAsOnTheHost) {
  expect_the_device_skips_as_the_host_does(torch::Device(torch::kCPU));
}

TEST(StepInProcess, TheFusedUpdateIsSkippedOnTheCudaDeviceAsOnTheHost) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the readback's event and page-locked copy run there";
  expect_the_device_skips_as_the_host_does(torch::Device(torch::kCUDA, 0));
}

// train.cuda_graph on a GPU: the same fp16-scaled run of the tiny GPT with dropout, its steps captured as a
// graph after two eager ones and replayed, against the run with every step eager. The same kernels in the
// same order with the same generator offsets: every loss, norm and scale, the weights and the optimizer
// state are equal in every bit, so a checkpoint of either run is the other's too (resume either way). A
// cut limit releases the graph and the run captures again after its warmup; a backoff's layout runs eagerly.
TEST(StepInProcess, ACudaGraphRunGivesTheLossesAndWeightsOfTheEagerRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (the graph is captured and replayed there)";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto scaling = trainer::GradScalerOptions().init_scale(1024.0).growth_interval(3);
  const int64_t limit = int64_t{8} << 30;
  const auto run = [&](trainer::Switch mode) {
    Rig rig(4, 1000, true, 1, scaling, trainer::OptimImpl::kFused, true, cuda, mode);  // two micro-batches of 4
    std::vector<trainer::StepResult> res;
    for (int64_t s = 1; s <= 8; ++s) {
      auto b = batch(s);
      res.push_back(rig.step->run(b, s, 1e-2 * (1.0 + 0.1 * static_cast<double>(s)), s <= 5 ? limit : limit / 2));
    }
    return std::make_pair(res, rig.state());
  };
  const auto [eager, eager_state] = run(trainer::Switch::kOff);
  const auto [graph, graph_state] = run(trainer::Switch::kOn);
  const std::vector<std::string> how = {"eager", "eager", "capture", "replay", "replay",
                                        "eager", "eager", "capture"};  // step 6: the cut limit released it
  ASSERT_EQ(graph.size(), how.size());
  for (size_t i = 0; i < graph.size(); ++i) {
    EXPECT_EQ(eager[i].graph, "eager");
    EXPECT_EQ(graph[i].graph, how[i]) << "step " << i + 1;
    EXPECT_EQ(graph[i].loss, eager[i].loss) << "step " << i + 1;
    EXPECT_EQ(graph[i].grad_norm, eager[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(graph[i].loss_scale, eager[i].loss_scale) << "step " << i + 1;
    EXPECT_EQ(graph[i].updated, eager[i].updated) << "step " << i + 1;
    EXPECT_GT(graph[i].mem_peak_bytes, 0) << "a replay reports its capture's peak";
  }
  EXPECT_TRUE(bitwise_equal(graph_state, eager_state));
}

TEST(StepInProcess, GrowsBackWhenTheCapRises) {
  const int64_t cap = (steady_peak(8) + steady_peak(4)) / 2;
  Rig rig(8, /*grow_after=*/1);
  std::vector<int64_t> sizes;
  for (const auto& r : run_steps(rig, 1, 1, 0)) sizes.push_back(r.micro_batch);
  // Under the cap: 8 fails once and is never tried again at this cap; with headroom the ladder may
  // probe sizes between 4 and 8.
  int64_t retries = 0;
  for (const auto& r : run_steps(rig, 2, 6, cap)) {
    sizes.push_back(r.micro_batch);
    retries += r.oom_retries;
  }
  EXPECT_EQ(sizes[1], 4);
  for (size_t i = 1; i < sizes.size(); ++i) EXPECT_LT(sizes[i], 8) << testing::PrintToString(sizes);
  EXPECT_LE(retries, 2) << "the ladder kept running into the cap: " << testing::PrintToString(sizes);
  // The cap goes: the ladder forgets the failure and the next clean steps probe up to the whole batch.
  rig.step->on_limit_changed(0, 6);
  for (const auto& r : run_steps(rig, 7, 10, 0)) {
    EXPECT_EQ(r.oom_retries, 0);
    sizes.push_back(r.micro_batch);
  }
  EXPECT_EQ(sizes.back(), 8) << "did not grow back: " << testing::PrintToString(sizes);
  EXPECT_EQ(rig.step->controller().micro_batch(), 8);
}

TEST(StepInProcess, GivesUpWithTheWeightsUntouched) {
  // After a step, a cap barely above what is held (weights, gradients, optimizer state) and no
  // recomputation rung: no micro-batch down to the floor of 2 fits, the ladder runs out.
  Rig rig(8, 1000, /*allow_checkpointing=*/false, /*min_micro=*/2);
  run_steps(rig, 1, 1, 0);
  const auto before = rig.weights();
  const int64_t cap = rig.memory->current_bytes() + (64 << 10);
  EXPECT_THROW(run_steps(rig, 2, 2, cap), trainer::OomGaveUp);
  EXPECT_TRUE(bitwise_equal(before, rig.weights()));
}

TEST(StepSnapshot, PutsBackTheBuffersAndTheCpuGenerator) {
  torch::manual_seed(3);
  auto model = models::create_model("resnet20", models::ModelOptions().num_classes(10));
  const auto device = torch::Device(torch::kCPU);
  const trainer::StepSnapshot snap(*model, device);
  const auto mean_before = model->named_buffers()["bn1.running_mean"].clone();
  const auto draw = torch::rand({16});
  model->train();
  model->forward(torch::randn({4, 3, 32, 32}));  // moves the running statistics and the generator
  ASSERT_FALSE(model->named_buffers()["bn1.running_mean"].equal(mean_before));
  snap.restore();
  EXPECT_TRUE(model->named_buffers()["bn1.running_mean"].equal(mean_before));
  EXPECT_TRUE(torch::rand({16}).equal(draw));
}

// The step keeps its snapshot: retake() copies into the copies it holds, and a buffer replaced since
// (another tensor, another shape) is followed, not written through a stale copy.
TEST(StepSnapshot, ARetakePutsBackTheStateOfTheRetakeAndFollowsAReplacedBuffer) {
  for (bool batched : {true, false}) {
    torch::manual_seed(3);
    auto model = models::create_model("resnet20", models::ModelOptions().num_classes(10));
    model->train();
    trainer::StepSnapshot snap(*model, torch::kCPU, batched);
    model->forward(torch::randn({4, 3, 32, 32}));
    snap.retake(*model);
    const auto mean = model->named_buffers()["bn1.running_mean"].clone();
    const auto tracked = model->named_buffers()["bn1.num_batches_tracked"].clone();
    const auto draw = torch::rand({16});
    model->forward(torch::randn({4, 3, 32, 32}));
    ASSERT_FALSE(model->named_buffers()["bn1.running_mean"].equal(mean));
    snap.restore();
    EXPECT_TRUE(model->named_buffers()["bn1.running_mean"].equal(mean)) << "batched " << batched;
    EXPECT_TRUE(model->named_buffers()["bn1.num_batches_tracked"].equal(tracked)) << "batched " << batched;
    EXPECT_TRUE(torch::rand({16}).equal(draw)) << "the generator as of the retake";

    // A buffer given other data, of another shape, then the model moved to float64 (the same tensors,
    // another type): each next retake copies them anew, restore puts them back.
    auto buffer = [&] { return model->named_buffers()["bn1.running_mean"]; };
    buffer().set_data(torch::full({7}, 2.0f));
    snap.retake(*model);
    buffer().fill_(5.0);
    snap.restore();
    EXPECT_TRUE(buffer().equal(torch::full({7}, 2.0f))) << "batched " << batched;
    model->to(torch::kDouble);
    snap.retake(*model);
    buffer().fill_(5.0);
    snap.restore();
    EXPECT_TRUE(buffer().equal(torch::full({7}, 2.0, torch::kDouble))) << "batched " << batched;
  }
}

TEST(StepSnapshot, PutsBackTheCudaGeneratorOfTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the CUDA generator cannot be drawn from here";
  const auto device = torch::Device(torch::kCUDA, 0);
  auto model = torch::nn::Linear(4, 4);
  model->to(device);
  const trainer::StepSnapshot snap(*model, device);
  const auto mask = torch::dropout(torch::ones({4096}, device), 0.5, /*train=*/true);
  const auto cpu_draw = torch::rand({8});
  snap.restore();
  EXPECT_TRUE(torch::dropout(torch::ones({4096}, device), 0.5, true).equal(mask))
      << "a retried step on CUDA would draw other dropout masks";
  EXPECT_TRUE(torch::rand({8}).equal(cpu_draw));
}

TEST(StepInProcess, CpuThreadsAreSharedByTheRanksOfANode) {
  trainer::Config cfg;
  const int usable = trainer::usable_cpus();
  EXPECT_EQ(trainer::cpu_threads(cfg, 1), usable);
  EXPECT_EQ(trainer::cpu_threads(cfg, 2), std::max(1, usable / 2));
  EXPECT_EQ(trainer::cpu_threads(cfg, 64), 1);
  cfg.train.threads = 3;
  EXPECT_EQ(trainer::cpu_threads(cfg, 2), 3);
}

TEST(StepInProcess, CapBelowTheLiveBytesGivesUpAndChangesNothing) {
  // Every allocation of the step belongs inside its OOM handling, the snapshot's too: under a cap
  // below the bytes already live, the ladder runs out of rungs (OomGaveUp: the run saves and exits 3)
  // instead of an allocation error escaping the step (exit 1, nothing saved).
  Rig rig(8);
  auto b1 = batch(1);
  rig.step->run(b1, 1, 1e-2, 0);  // the optimizer state exists
  const auto before = rig.weights();
  auto b2 = batch(2);
  {
    trainer::ScopedCpuCap cap(1);
    EXPECT_THROW(rig.step->run(b2, 2, 1e-2, 1), trainer::OomGaveUp);
  }
  EXPECT_TRUE(bitwise_equal(rig.weights(), before)) << "a step that gave up changed the weights";
}

}  // namespace test_step
