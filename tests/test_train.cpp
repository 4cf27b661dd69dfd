// The optimizer step: our SGD/AdamW against LibTorch's, an OOM inside the optimizer step leaves every
// parameter untouched, the schedule, and (through the executable) micro-batches and activation
// checkpointing against one plain batch.
#include <gtest/gtest.h>

#include "common/compat.h"
#include "train_util.h"
#include "trainer/memory/backend.h"
#include "trainer/numerics/optim.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_train {

using testutil::TempDir;

namespace {

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({5})));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(ln(fc1(x)))); }
};

// Runs `steps` updates on two copies of the same net: ours and LibTorch's optimizer (the reference),
// with the same gradients, and returns the largest parameter difference.
double compare_with_libtorch(const trainer::OptimConfig& cfg, int steps) {
  torch::manual_seed(1);
  auto a = std::make_shared<Net>();
  auto b = std::make_shared<Net>();
  {
    torch::NoGradGuard ng;
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  trainer::Optimizer ours(trainer::param_slots(*a, cfg.decay_norm_and_bias), cfg);
  // The reference: two parameter groups, weight decay only on matrices, as param_slots decides.
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : b->parameters()) (p.dim() >= 2 || cfg.decay_norm_and_bias ? decay : no_decay).push_back(p);
  std::unique_ptr<torch::optim::Optimizer> ref;
  if (cfg.name == trainer::OptimKind::kSgd) {
    auto o = torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).nesterov(cfg.nesterov);
    auto od = o;
    od.weight_decay(cfg.weight_decay);
    auto on = o;
    on.weight_decay(0);
    ref = std::make_unique<torch::optim::SGD>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(decay, std::make_unique<torch::optim::SGDOptions>(od)),
            torch::optim::OptimizerParamGroup(no_decay, std::make_unique<torch::optim::SGDOptions>(on))},
        o);
  } else {
    auto o = torch::optim::AdamWOptions(cfg.lr).betas({cfg.beta1, cfg.beta2}).eps(cfg.eps);
    auto od = o;
    od.weight_decay(cfg.weight_decay);
    auto on = o;
    on.weight_decay(0);
    ref = std::make_unique<torch::optim::AdamW>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(decay, std::make_unique<torch::optim::AdamWOptions>(od)),
            torch::optim::OptimizerParamGroup(no_decay, std::make_unique<torch::optim::AdamWOptions>(on))},
        o);
  }
  for (int s = 0; s < steps; ++s) {
    auto x = torch::randn({4, 6});
    ours.zero_grad();
    ref->zero_grad();
    a->forward(x).pow(2).sum().backward();
    b->forward(x).pow(2).sum().backward();
    ours.step(cfg.lr);
    ref->step();
  }
  double worst = 0;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST(TrainOptimizer, SgdNesterovMatchesLibTorch) {
  trainer::OptimConfig c;
  c.name = trainer::OptimKind::kSgd;
  c.lr = 0.05;
  c.momentum = 0.9;
  c.nesterov = true;
  c.weight_decay = 0.01;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
  c.nesterov = false;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
  c.momentum = 0;
  c.nesterov = false;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
}

TEST(TrainOptimizer, AdamWMatchesLibTorch) {
  trainer::OptimConfig c;
  c.name = trainer::OptimKind::kAdamW;
  c.lr = 0.01;
  c.weight_decay = 0.1;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
  c.decay_norm_and_bias = true;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
}

namespace {

// The multi-tensor path (the default on CUDA) against the plain loop, op for op the same arithmetic, so
// the results must be bitwise equal; one parameter is left without a gradient (skipped by both), and the
// gradients are clipped first, as the step does (the norms agree to rounding: another summation order).
void foreach_matches_plain(const torch::Device& device) {
  for (const std::string name : {"sgd", "sgd_nesterov", "sgd_no_momentum", "adamw"}) {
    trainer::OptimConfig c;
    c.name = name == "adamw" ? trainer::OptimKind::kAdamW : trainer::OptimKind::kSgd;
    c.lr = name == "adamw" ? 0.01 : 0.05;
    c.momentum = name == "sgd_no_momentum" ? 0.0 : 0.9;
    c.nesterov = name == "sgd_nesterov";
    c.weight_decay = 0.05;
    torch::manual_seed(3);
    auto a = std::make_shared<Net>(), b = std::make_shared<Net>();
    a->to(device);
    b->to(device);
    {
      torch::NoGradGuard ng;
      auto pa = a->parameters(), pb = b->parameters();
      for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
    }
    trainer::Optimizer plain(trainer::param_slots(*a, false), c, /*foreach=*/false);
    trainer::Optimizer multi(trainer::param_slots(*b, false), c, /*foreach=*/true);
    ASSERT_FALSE(plain.foreach());
    ASSERT_TRUE(multi.foreach());
    for (int step = 0; step < 4; ++step) {
      auto x = torch::randn({4, 6}).to(device);
      plain.zero_grad();
      multi.zero_grad();
      a->forward(x).pow(2).sum().backward();
      b->forward(x).pow(2).sum().backward();
      a->fc2->bias.mutable_grad() = torch::Tensor();  // no gradient: neither path may touch it
      b->fc2->bias.mutable_grad() = torch::Tensor();
      const auto na = trainer::clip_grad_norm(plain.params(), 0.5, /*foreach=*/false);
      const auto nb = trainer::clip_grad_norm(multi.params(), 0.5, /*foreach=*/true);
      EXPECT_TRUE(torch::allclose(na, nb, 1e-6, 0)) << name << " step " << step << ": " << na.item<double>()
                                                    << " vs " << nb.item<double>();
      // The same gradients from here on, so that the update alone is compared bit for bit.
      {
        torch::NoGradGuard ng;
        auto pa = a->parameters(), pb = b->parameters();
        for (size_t i = 0; i < pa.size(); ++i)
          if (pa[i].grad().defined()) pb[i].mutable_grad().copy_(pa[i].grad());
      }
      plain.step(c.lr);
      multi.step(c.lr);
    }
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].equal(pb[i])) << name << ": parameter " << i;
    const auto sa = plain.state(), sb = multi.state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << name << ": " << sa[i].first;
    EXPECT_TRUE(torch::equal(a->fc2->bias, b->fc2->bias));
  }
}

}  // namespace

TEST(TrainOptimizer, ForeachMatchesThePlainUpdate) { foreach_matches_plain(torch::kCPU); }

TEST(TrainOptimizer, ForeachMatchesThePlainUpdateOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (the multi-tensor CUDA kernels)";
  foreach_matches_plain(torch::kCUDA);
  // The default there is the fused kernels where LibTorch has them (2.4+), else the multi-tensor path.
  Net net;
  net.to(torch::kCUDA);
  trainer::OptimConfig c;
  EXPECT_EQ(trainer::Optimizer(trainer::param_slots(net, false), c).implementation(),
            trainer::compat::kHasFusedOptimizers ? "fused" : "foreach");
}

TEST(TrainOptimizer, NoDecayOnBiasAndNormWeights) {
  Net net;
  auto slots = trainer::param_slots(net, /*decay_norm_and_bias=*/false);
  for (const auto& s : slots) EXPECT_EQ(s.decay, s.param.dim() >= 2) << s.name;
  EXPECT_EQ(slots.size(), 6u);
}

TEST(TrainOptimizer, OomInStepLeavesParametersUntouched) {
  // A real cap: the first step's state (momentum buffers, the size of the parameters) does not fit.
  trainer::cpu_allocator::install();
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  trainer::OptimConfig c;  // sgd, momentum 0.9
  trainer::Optimizer opt(trainer::param_slots(*net, false), c);
  net->forward(torch::randn({4, 6})).sum().backward();
  std::vector<torch::Tensor> before;
  for (auto& p : net->parameters()) before.push_back(p.detach().clone());
  {
    trainer::ScopedCpuCap cap(trainer::cpu_allocator::live_bytes() + 64);
    EXPECT_THROW(opt.step(0.1), c10::OutOfMemoryError);
  }
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i])) << "parameter " << i << " changed";
  EXPECT_EQ(opt.steps(), 0);
  // Without the cap the same step now runs, and the gradients it used were not consumed by the failed one.
  auto reference = before[0] - 0.1 * (params[0].grad() + c.weight_decay * before[0]) * (1 + c.momentum);
  opt.step(0.1);
  EXPECT_TRUE(torch::allclose(params[0], reference, 1e-6, 1e-7));
}

TEST(TrainOptimizer, StateRoundTrip) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  trainer::OptimConfig c;
  c.name = trainer::OptimKind::kAdamW;
  trainer::Optimizer opt(trainer::param_slots(*net, false), c);
  net->forward(torch::randn({4, 6})).sum().backward();
  opt.step(0.01);
  std::map<std::string, torch::Tensor> state;
  for (auto& [k, v] : opt.state()) state[k] = v.clone();
  trainer::Optimizer other(trainer::param_slots(*net, false), c);
  other.load_state(state);
  EXPECT_EQ(other.steps(), 1);
  for (auto& [k, v] : other.state()) EXPECT_TRUE(v.equal(state.at(k))) << k;
  state.erase("exp_avg.fc1.weight");
  EXPECT_THROW(
      {
        try {
          other.load_state(state);
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find("exp_avg.fc1.weight"), std::string::npos);
          throw;
        }
      },
      std::runtime_error);
}

TEST(TrainSchedule, WarmupCosineAndStepByHand) {
  trainer::ScheduleConfig s;
  s.name = trainer::ScheduleKind::kCosine;
  s.min_lr = 0.0;
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 0, 110, 10), 0.1);    // warmup: (0+1)/10
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 9, 110, 10), 1.0);
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 10, 110, 10), 1.0);   // cosine starts at the peak
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 60, 110, 10), 0.5, 1e-12);  // half way
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 110, 110, 10), 0.0, 1e-12);
  s.name = trainer::ScheduleKind::kStep;
  s.milestones = {5, 8};
  s.gamma = 0.1;
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 4, 10, 0), 1.0);
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 5, 10, 0), 0.1, 1e-15);
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 9, 10, 0), 0.01, 1e-15);
}

// ---- through the executable ---------------------------------------------------------------------------

using testutil::exact_job;
using testutil::run_and_export;

TEST(TrainStep, MicroBatchesEqualOneBatch) {
  TempDir dir;
  auto one = run_and_export(dir, "one", exact_job("--set train.micro_batch=12"));
  auto uneven = run_and_export(dir, "uneven", exact_job("--set train.micro_batch=5"));  // 5 + 5 + 2
  auto four = run_and_export(dir, "four", exact_job("--set train.micro_batch=3"));
  EXPECT_LT(testutil::max_abs_diff(one, uneven), 1e-5);
  EXPECT_LT(testutil::max_abs_diff(one, four), 1e-5);
  // And the runs did train: the weights moved from their initialization.
  auto init = run_and_export(dir, "zero", exact_job("--set train.micro_batch=12 --set optim.lr=1e-30"));
  EXPECT_GT(testutil::max_abs_diff(one, init), 1e-3);
}

TEST(TrainStep, ActivationCheckpointingEqualsPlain) {
  TempDir dir;
  auto plain = run_and_export(dir, "plain", exact_job(""));
  auto ckpt = run_and_export(dir, "ckpt", exact_job("--set memory.activation_checkpointing=all"));
  EXPECT_LT(testutil::max_abs_diff(plain, ckpt), 1e-6);
  // A ResNet (BatchNorm, running statistics updated once per forward even when recomputed).
  std::string resnet = " --set model.name=resnet20 --set train.global_batch=8";
  auto rp = run_and_export(dir, "rplain", exact_job(resnet));
  auto rc = run_and_export(dir, "rckpt", exact_job(resnet + " --set memory.activation_checkpointing=all"));
  EXPECT_LT(testutil::max_abs_diff(rp, rc), 1e-6);
  EXPECT_TRUE(rp.at("bn1.num_batches_tracked").equal(rc.at("bn1.num_batches_tracked")));
}

}  // namespace test_train
