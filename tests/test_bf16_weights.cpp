// bfloat16 weights (model.param_dtype) updated by AdamW in float32 and rounded back, to nearest or
// stochastically (optim.stochastic_rounding): against torchao 0.18's _AdamW and AdamW8bit on bfloat16
// parameters (tests/ref/optim8_ref.py, the 2.11 leg); an update below bfloat16's resolution, lost to nearest
// and kept on average stochastically; the run through the executable (it trains, resumes bitwise after a
// SIGKILL, exports); memory.state auto moving to bfloat16 weights; the bad inputs.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include <signal.h>

#include "optim_ref.h"
#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/numerics/forward.h"
#include "trainer/numerics/optim.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_bf16_weights {

using testutil::TempDir;
using trainer::OptimConfig;
using trainer::StateDtype;

namespace {

using optimref::Param;

// Tensors with and without weight decay, quantized (>= 4,096 values) and not.
std::vector<Param> model_params() {
  torch::manual_seed(3);
  return {{"w1", torch::randn({64, 128}) * 0.05, true},
          {"ln", 1 + 0.1 * torch::randn({4096}), false},
          {"w2", torch::randn({32, 8}) * 0.2, true}};
}

OptimConfig adamw(StateDtype dtype, bool stochastic) {
  OptimConfig c;
  c.name = trainer::OptimKind::kAdamW;
  c.weight_decay = 0.1;
  c.beta2 = 0.99;
  c.state_dtype = dtype;
  c.stochastic_rounding = stochastic;
  return c;
}

using optimref::gradients;

double rate(int step) { return 1e-2 * (step + 1) / 20; }

// Our AdamW on the parameters in `dtype` (rounded to nearest from float32), the gradients too: the
// parameters after `steps`, as float32.
torch::Tensor run_ours(const std::vector<Param>& ps, const OptimConfig& c, const std::vector<torch::Tensor>& grads,
                       int steps, torch::ScalarType dtype, uint64_t seed = 0) {
  std::vector<trainer::ParamSlot> slots;
  for (const auto& p : ps) slots.push_back({p.name, p.value.to(dtype).clone().requires_grad_(true), p.decay});
  trainer::Optimizer opt(slots, c);
  opt.set_rounding_seed(seed);
  for (int s = 0; s < steps; ++s) {
    // A copy: the float32 update writes its denominator into the gradient (optim.h).
    for (size_t i = 0; i < ps.size(); ++i) slots[i].param.mutable_grad() = grads[s * ps.size() + i].to(dtype).clone();
    opt.step(rate(s));
  }
  std::vector<torch::Tensor> f;
  for (const auto& s : slots) f.push_back(s.param.detach().to(torch::kFloat).reshape(-1));
  return torch::cat(f);
}

// torchao's run on the same bfloat16 weights and gradients.
torch::Tensor run_torchao(const std::vector<Param>& ps, const OptimConfig& c, const std::vector<torch::Tensor>& grads,
                          int steps) {
  std::vector<double> lr;
  for (int s = 0; s < steps; ++s) lr.push_back(rate(s));
  return optimref::run_torchao(ps, c, grads, lr, "bfloat16");
}

}  // namespace

// Rounded to nearest, twenty steps on bfloat16 weights are torchao's (_AdamW on bfloat16 parameters, whose
// moments are bfloat16; AdamW8bit with int8 moments, run eagerly with IEEE's square root: optim8_ref.py) bit
// for bit, once torchao keeps the moments it does not quantize in float32 as the trainer does. As shipped,
// torchao keeps them in the parameters' dtype (zeros_like(p): bfloat16 here), and only those tensors differ.
TEST(BFloat16Weights, RoundedToNearestTheyAreTorchaos) {
  SKIP_WITHOUT_TORCHAO();
  const auto ps = model_params();
  const int steps = 20;
  const auto grads = gradients(ps, steps);
  std::vector<double> lr;
  for (int s = 0; s < steps; ++s) lr.push_back(rate(s));
  std::vector<torch::Tensor> init;
  for (const auto& p : ps) init.push_back(p.value.to(torch::kBFloat16).to(torch::kFloat).reshape(-1));
  for (StateDtype dtype : {StateDtype::kBfloat16, StateDtype::kInt8}) {
    const OptimConfig c = adamw(dtype, false);
    const torch::Tensor ours = run_ours(ps, c, grads, steps, torch::kBFloat16);
    const torch::Tensor theirs = optimref::run_torchao(ps, c, grads, lr, "bfloat16", "float32");
    ASSERT_TRUE(theirs.defined());
    ASSERT_EQ(ours.numel(), theirs.numel());
    EXPECT_EQ((ours != theirs).sum().item<int64_t>(), 0) << trainer::mode_name(dtype) << ": "
                                                         << (ours - theirs).abs().max().item<double>() << " at most";
    EXPECT_GT((ours - torch::cat(init)).abs().max().item<double>(), 1e-3) << "the parameters moved";
  }
  // torchao as shipped, with int8 moments: the two tensors of 4,096 values and more (quantized on both
  // sides) are ours bit for bit; w2's 256 values, with bfloat16 moments there and float32 ones here, differ
  // in a few places by about one bfloat16 step of the weight.
  const OptimConfig c = adamw(StateDtype::kInt8, false);
  const torch::Tensor ours = run_ours(ps, c, grads, steps, torch::kBFloat16);
  const torch::Tensor theirs = optimref::run_torchao(ps, c, grads, lr, "bfloat16");
  ASSERT_TRUE(theirs.defined());
  const int64_t quantized = ps[0].value.numel() + ps[1].value.numel();
  EXPECT_EQ((ours.slice(0, 0, quantized) != theirs.slice(0, 0, quantized)).sum().item<int64_t>(), 0);
  const torch::Tensor a = ours.slice(0, quantized), b = theirs.slice(0, quantized);
  EXPECT_GT((a != b).sum().item<int64_t>(), 0) << "bfloat16 moments round differently from float32 ones";
  EXPECT_LE(((a - b).abs() / (torch::max(a.abs(), b.abs()) / 128 + 0.1 * rate(steps - 1))).max().item<double>(), 1.0);
}

// Rounded stochastically, our bits and torchao's differ (each draws its own), but both are unbiased: about
// the float32 weights' trajectory, the mean error of either is a small part of its spread, and the spreads
// agree (the same rounding rule).
TEST(BFloat16Weights, StochasticRoundingIsUnbiasedAsTorchaos) {
  SKIP_WITHOUT_TORCHAO();
  const auto ps = model_params();
  const int steps = 20;
  const auto grads = gradients(ps, steps);
  const torch::Tensor exact = run_ours(ps, adamw(StateDtype::kFloat32, false), grads, steps, torch::kFloat);
  const torch::Tensor ours = run_ours(ps, adamw(StateDtype::kBfloat16, true), grads, steps, torch::kBFloat16, 7);
  const torch::Tensor theirs = run_torchao(ps, adamw(StateDtype::kBfloat16, true), grads, steps);
  ASSERT_TRUE(theirs.defined());
  const auto stats = [&](const torch::Tensor& t) {
    const torch::Tensor e = t.to(torch::kDouble) - exact.to(torch::kDouble);
    return std::make_pair(e.mean().item<double>(), e.pow(2).mean().sqrt().item<double>());
  };
  const auto [ours_mean, ours_rms] = stats(ours);
  const auto [theirs_mean, theirs_rms] = stats(theirs);
  EXPECT_GT(ours_rms, 0);
  EXPECT_LT(std::abs(ours_mean), ours_rms / 10) << "ours: mean " << ours_mean << ", rms " << ours_rms;
  EXPECT_LT(std::abs(theirs_mean), theirs_rms / 10) << "torchao: mean " << theirs_mean << ", rms " << theirs_rms;
  EXPECT_NEAR(ours_rms / theirs_rms, 1.0, 0.2) << ours_rms << " vs " << theirs_rms;
}

// 4,096 weights at 1.0 and a constant gradient: AdamW's update is the rate, 1e-3, under half of bfloat16's
// step below 1.0 (2^-9). Rounded to nearest, every step is lost; stochastically, the weights reach
// 1 - 100 x 1e-3 on average. The bits depend on the seed alone.
TEST(BFloat16Weights, AnUpdateBelowTheResolutionSurvivesOnlyStochastically) {
  const int steps = 100;
  const auto run = [&](bool stochastic, uint64_t seed) {
    std::vector<trainer::ParamSlot> slots = {{"w", torch::ones({4096}, torch::kBFloat16).requires_grad_(true), false}};
    OptimConfig c = adamw(StateDtype::kFloat32, stochastic);
    c.weight_decay = 0;
    trainer::Optimizer opt(slots, c);
    opt.set_rounding_seed(seed);
    for (int s = 0; s < steps; ++s) {
      slots[0].param.mutable_grad() = torch::ones({4096}, torch::kBFloat16);
      opt.step(1e-3);
    }
    return slots[0].param.detach().to(torch::kFloat);
  };
  const torch::Tensor nearest = run(false, 1);
  EXPECT_TRUE(nearest.eq(1.0f).all().item<bool>()) << "to nearest, each update of 1e-3 is lost";
  const torch::Tensor stochastic = run(true, 1);
  EXPECT_NEAR(stochastic.mean().item<double>(), 1.0 - steps * 1e-3, 1e-3);
  EXPECT_TRUE(stochastic.equal(run(true, 1))) << "the same seed, the same bits";
  EXPECT_FALSE(stochastic.equal(run(true, 2))) << "another seed, other bits";
}

// LibTorch's error for an op without a bfloat16 kernel (linalg's Cholesky on the CPU has none) becomes the
// one line that names the setting; other errors pass through.
TEST(BFloat16Weights, AMissingKernelNamesTheSetting) {
  const auto x = torch::eye(4).to(torch::kBFloat16);
  try {
    (void)at::linalg_cholesky(x);
    GTEST_SKIP() << "this LibTorch has a bfloat16 Cholesky on the CPU";
  } catch (const std::exception& e) {
    const std::string line = trainer::missing_bfloat16_kernel(e);
    EXPECT_NE(line.find("model.param_dtype: bfloat16 needs a kernel"), std::string::npos) << line << "\n" << e.what();
    EXPECT_NE(line.find("cholesky"), std::string::npos) << line;
    EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  }
  EXPECT_EQ(trainer::missing_bfloat16_kernel(std::runtime_error("out of memory")), "");
}

// The warning that bfloat16 matmuls are emulated reads the CPU's flags: avx512_bf16 or amx_bf16.
TEST(BFloat16Weights, CpuFlagsSayWhetherBfloat16IsNative) {
  TempDir dir;
  const auto cpuinfo = [&](const std::string& flags) {
    testutil::fs::create_directories(dir / "proc");
    testutil::write_file(dir / "proc" / "cpuinfo", "processor\t: 0\nmodel name\t: x\nflags\t\t: " + flags + "\n\n");
    return trainer::cpu_has_bfloat16(dir.str());
  };
  EXPECT_FALSE(cpuinfo("fpu sse2 avx2 fma"));
  EXPECT_TRUE(cpuinfo("fpu avx2 avx512f avx512_bf16 avx512_vnni"));
  EXPECT_TRUE(cpuinfo("fpu avx2 amx_bf16 amx_tile"));
  EXPECT_FALSE(trainer::cpu_has_bfloat16((dir / "nothing").string())) << "no cpuinfo: not known to have it";
}

// Each bad combination: one line naming the key, and what applies instead.
TEST(BFloat16Weights, BadValuesNameTheKey) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> bad = {
      {{"optim.name=adamw", "optim.stochastic_rounding=true"}, {"optim.stochastic_rounding", "model.param_dtype: bfloat16"}},
      {{"optim.name=sgd", "model.param_dtype=bfloat16"}, {"model.param_dtype", "sgd has no such update"}},
      {{"optim.name=lamb", "model.param_dtype=bfloat16"}, {"model.param_dtype", "lamb has no such update"}},
      {{"optim.name=adamw", "model.param_dtype=float16"}, {"model.param_dtype", "float32, bfloat16"}},
      {{"optim.name=adamw", "model.param_dtype=bfloat16", "train.device=cuda"}, {"model.param_dtype", "CPU only"}},
      {{"optim.name=adamw", "model.param_dtype=bfloat16", "amp.enabled=true"}, {"amp.enabled", "bfloat16 already"}},
      {{"optim.name=adamw", "model.param_dtype=bfloat16", "train.ema_decay=0.999"}, {"train.ema_decay", "resolution"}},
      {{"optim.name=adamw", "model.param_dtype=bfloat16", "optim.implementation=foreach"},
       {"optim.implementation", "auto or plain"}}};
  for (const auto& [sets, fragments] : bad) {
    std::vector<std::string> all = {"train.steps=10"};
    all.insert(all.end(), sets.begin(), sets.end());
    const std::string msg = testutil::error_text([&] { testutil::config_from_sets(all); });
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << sets.back() << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(testutil::config_from_sets(
      {"train.steps=10", "optim.name=adamw", "model.param_dtype=bfloat16", "optim.stochastic_rounding=true"}));
  // Through the executable: exit 2 and the one line.
  TempDir dir;
  const auto r = testutil::run(testutil::trainer_cmd(dir.str() + "/run", "--set train.steps=1 --set optim.stochastic_rounding=true"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optim.stochastic_rounding"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

namespace {

// llama_tiny on a small byte stream (testutil::fox_tokens: a text it can learn).
std::string llama_job(const std::string& data, int64_t steps) {
  return "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --set data.train=" + data +
         "/train.h5 --set data.test= --set model.context=16 --set train.global_batch=4"
         " --set train.epochs=0 --set train.steps=" + std::to_string(steps) +
         " --set optim.name=adamw --set optim.lr=0.003 --set schedule.warmup_steps=0 --set train.deterministic=true"
         " --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0 --set checkpoint.keep_last=30"
         " --set log.every=1 --set seed=11 --set train.threads=1 --set data.workers=1 --set model.param_dtype=bfloat16"
         " --set optim.stochastic_rounding=true --set optim.state_dtype=int8";
}

}  // namespace

// Through the executable: llama_tiny with bfloat16 weights, stochastic rounding and int8 moments trains
// (its loss falls), keeps its weights in bfloat16 in the checkpoint, and a run killed (SIGKILL) and started
// again ends bitwise where the uninterrupted run ends: the rounding's bits come from the step, not from a
// generator. A float32 checkpoint resumed with bfloat16 weights converts, with one warning.
TEST(BFloat16Weights, TrainsAndResumesBitwiseAfterASigkill) {
  TempDir dir;
  const auto data = testutil::fox_tokens(dir);
  const int64_t steps = 30;
  const auto whole = (dir / "whole").string(), killed = (dir / "killed").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, llama_job(data, steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = testutil::step_lines(whole);
  ASSERT_EQ(lines.size(), static_cast<size_t>(steps));
  double first = 0, last = 0;
  for (size_t i = 0; i < 3; ++i) first += lines[i]["loss"].get<double>(), last += lines[lines.size() - 1 - i]["loss"].get<double>();
  EXPECT_LT(last, first * 0.9) << "the loss falls";
  const auto weights = testutil::final_weights(whole);
  for (const auto& [name, t] : weights) EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << name;

  const pid_t pid = testutil::spawn(testutil::trainer_cmd(killed, llama_job(data, steps)), (dir / "killed.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(killed, [](auto& l) { return testutil::last_step(l) >= 8; }));
  kill(pid, SIGKILL);
  ASSERT_EQ(testutil::wait_exit(pid), 128 + SIGKILL) << "the run finished before the kill; make it longer";
  r = testutil::run(testutil::trainer_cmd(killed, llama_job(data, steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(testutil::events(killed, "resume").size(), 1u) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(weights, testutil::final_weights(killed)));

  const auto f32 = (dir / "f32").string(), converted = (dir / "converted").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(f32, llama_job(data, 4) + " --set model.param_dtype=float32"
                                                " --set optim.stochastic_rounding=false")).exit_code, 0);
  r = testutil::run(testutil::trainer_cmd(converted, llama_job(data, 6) + " --resume " + f32 + "/checkpoints/step-00000004"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("holds float32 weights and model.param_dtype is bfloat16: they are converted"), std::string::npos)
      << r.output;
}

// memory.state auto, under a cap where even int8 moments do not fit but bfloat16 weights with them do: the
// plan moves the weights to bfloat16 (with int8 moments and stochastic rounding) before the model is built,
// records each change, and the run trains under the cap. With fixed, the give-up names that setting.
TEST(BFloat16Weights, MemoryStateAutoReachesThem) {
  TempDir dir("bf16_state");
  const std::string job = testutil::trainer_bin() + " --config " + testutil::source_dir() +
                          "/configs/llama_tiny_fortunes.yaml --set data.kind=synthetic --set data.test="
                          " --set model.context=16 --set train.global_batch=1 --set optim.name=adamw --set train.steps=3"
                          " --set train.epochs=0 --set checkpoint.final=false --set memory.limit=6MiB";
  const auto fixed = testutil::run(job + " --run-dir " + (dir / "fixed").string());
  EXPECT_EQ(fixed.exit_code, 3) << fixed.output;
  EXPECT_NE(fixed.output.find("model.param_dtype: bfloat16 (optim.state_dtype: int8, optim.stochastic_rounding: true) (peak"),
            std::string::npos) << fixed.output;
  const auto autom = testutil::run(job + " --set memory.state=auto --run-dir " + (dir / "auto").string());
  ASSERT_EQ(autom.exit_code, 0) << autom.output;
  const std::string resolved = testutil::read_file(dir / "auto" / "resolved_config.yaml");
  EXPECT_NE(resolved.find("param_dtype: \"bfloat16\""), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("stochastic_rounding: true"), std::string::npos) << resolved;
  std::map<std::string, std::string> changed;
  for (const auto& e : testutil::events((dir / "auto").string(), "memory_state"))
    changed[e["setting"].get<std::string>()] = e["to"].get<std::string>();
  EXPECT_EQ(changed, (std::map<std::string, std::string>{{"model.param_dtype", "bfloat16"},
                                                         {"optim.state_dtype", "int8"},
                                                         {"optim.stochastic_rounding", "true"}}));
  const auto lines = testutil::step_lines((dir / "auto").string());
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& l : lines) EXPECT_LE(l["mem_peak_bytes"].get<int64_t>(), trainer::parse_bytes("6MiB"));
}

}  // namespace test_bf16_weights
