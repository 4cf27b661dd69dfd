// The optimizer step: our SGD/AdamW against LibTorch's, an OOM inside the optimizer step leaves every
// parameter untouched, the schedule, and (through the executable) micro-batches and activation
// checkpointing against one plain batch.
#include <gtest/gtest.h>

#include "train_util.h"
#include "trainer/memory/backend.h"
#include "trainer/optim.h"

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
  if (cfg.name == "sgd") {
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
  c.name = "sgd";
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
  c.name = "adamw";
  c.lr = 0.01;
  c.weight_decay = 0.1;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
  c.decay_norm_and_bias = true;
  EXPECT_LT(compare_with_libtorch(c, 6), 1e-6);
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
  c.name = "adamw";
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
  s.name = "cosine";
  s.min_lr = 0.0;
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 0, 110, 10), 0.1);    // warmup: (0+1)/10
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 9, 110, 10), 1.0);
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 10, 110, 10), 1.0);   // cosine starts at the peak
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 60, 110, 10), 0.5, 1e-12);  // half way
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 110, 110, 10), 0.0, 1e-12);
  s.name = "step";
  s.milestones = {5, 8};
  s.gamma = 0.1;
  EXPECT_DOUBLE_EQ(trainer::learning_rate(s, 1.0, 4, 10, 0), 1.0);
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 5, 10, 0), 0.1, 1e-15);
  EXPECT_NEAR(trainer::learning_rate(s, 1.0, 9, 10, 0), 0.01, 1e-15);
}

// ---- through the executable ---------------------------------------------------------------------------

namespace {

// plain_cnn (no batch statistics) on synthetic 1x16x16, 3 steps of 12 samples, no augmentation.
std::string exact_job(const std::string& extra) {
  return "--set model.name=plain_cnn --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=120 --set data.test= --set data.crop_padding=0 --set data.hflip=false"
         " --set train.global_batch=12 --set train.epochs=0 --set train.steps=3 --set optim.lr=0.05"
         " --set schedule.warmup_steps=0 --set schedule.name=constant"
         " --set checkpoint.every_seconds=0 --set seed=3"
         " --set train.threads=1 --set data.workers=1 " +
         extra;
}

std::map<std::string, torch::Tensor> run_and_export(const TempDir& dir, const std::string& name, const std::string& args) {
  auto run_dir = (dir / name).string();
  auto r = testutil::run(testutil::trainer_cmd(run_dir, args));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return testutil::final_weights(run_dir);
}

}  // namespace

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
