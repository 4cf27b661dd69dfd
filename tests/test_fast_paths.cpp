// The faster paths of the step, each against the path it replaces (docs/BENCHMARKS.md, "Profiling a step"):
//   - optim.implementation: fused (at::_fused_sgd_, at::_fused_adamw_) against the multi-tensor update,
//     to a stated tolerance: both are PyTorch's update rule, rounded differently;
//   - model.vocab_multiple: a GPT whose vocabulary is padded (its matmul aligned) computes the loss and the
//     gradients of the unpadded one, and its padding rows get exactly zero gradient and stay zero;
//   - model.fused_bias: a GPT whose Linear layers add their bias inside the matmul (torch::linear) computes
//     what nn::Linear's matmul-then-add computes, to float32 rounding;
//   - train.snapshot: batched puts back exactly the buffers the per-buffer snapshot puts back;
//   - train.fused_loss: the fused cross-entropy kernels give PyTorch's loss and gradient (float64 as the
//     reference) for every logits type and layout, a GPT step's loss and gradients, and hold less memory;
//     off CUDA the key changes nothing, bit for bit.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <limits>

#include "common/compat.h"
#include "models/gpt.h"
#include "models/registry.h"
#include "test_util.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/numerics/forward.h"
#include "trainer/numerics/loss.h"
#include "trainer/numerics/optim.h"
#include "trainer/step/step.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_fast_paths {

using nlohmann::json;
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

// The fused update against the multi-tensor one on `device`, from the same weights with the same
// gradients for 5 steps (one parameter without a gradient: neither may touch it). The tolerance: the
// fused kernels compute AdamW's bias corrections in float32 (ours in double) and its weight decay as
// p - lr*wd*p (ours p * (1 - lr*wd)); after 5 steps the parameters and states agree to 1e-6 + 1e-5 |x|,
// while an update rule off by one term (no decay, no Nesterov, no bias correction) is off by more than
// 1e-4 here.
void fused_matches_foreach(const torch::Device& device) {
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
    trainer::Optimizer multi(trainer::param_slots(*a, false), c, /*foreach=*/true);
    trainer::OptimConfig cf = c;
    cf.implementation = trainer::OptimImpl::kFused;
    trainer::Optimizer fused(trainer::param_slots(*b, false), cf);
    ASSERT_EQ(fused.implementation(), "fused");
    const auto bias_before = b->fc2->bias.detach().clone();
    std::vector<torch::Tensor> start;
    for (const auto& t : a->parameters()) start.push_back(t.detach().clone());
    for (int step = 0; step < 5; ++step) {
      auto x = torch::randn({4, 6}).to(device);
      multi.zero_grad();
      fused.zero_grad();
      a->forward(x).pow(2).sum().backward();
      a->fc2->bias.mutable_grad() = torch::Tensor();
      {
        torch::NoGradGuard ng;
        auto pa = a->parameters(), pb = b->parameters();
        for (size_t i = 0; i < pa.size(); ++i)
          if (pa[i].grad().defined()) pb[i].mutable_grad() = pa[i].grad().clone();
      }
      multi.step(c.lr);
      fused.step(c.lr);
    }
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6))
          << name << ": parameter " << i << " differs by " << (pa[i] - pb[i]).abs().max().item<double>();
      if (pa[i].is_same(a->fc2->bias)) continue;
      EXPECT_FALSE(torch::allclose(pa[i], start[i], 1e-3, 1e-4)) << name << ": parameter " << i << " did not move";
    }
    const auto sa = multi.state(), sb = fused.state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].first, sb[i].first);
      EXPECT_TRUE(torch::allclose(sa[i].second, sb[i].second, 1e-5, 1e-6)) << name << ": " << sa[i].first;
    }
    EXPECT_TRUE(torch::equal(b->fc2->bias, bias_before)) << name << ": a parameter without a gradient moved";
  }
}

}  // namespace

TEST(TrainOptimizer, FusedMatchesTheMultiTensorUpdate) {
  if (!trainer::compat::kHasFusedOptimizers)
    GTEST_SKIP() << "LibTorch " << trainer::compat::torch_version() << " has no fused SGD/AdamW kernels (2.4+)";
  fused_matches_foreach(torch::kCPU);
}

TEST(TrainOptimizer, FusedMatchesTheMultiTensorUpdateOnCuda) {
  if (!trainer::compat::kHasFusedOptimizers) GTEST_SKIP() << "no fused kernels in this LibTorch (2.4+)";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (the fused CUDA kernels)";
  fused_matches_foreach(torch::kCUDA);
}

TEST(TrainOptimizer, ImplementationKeyIsCheckedWhereLibTorchLacksTheKernels) {
  Net net;
  trainer::OptimConfig c;
  EXPECT_EQ(trainer::Optimizer(trainer::param_slots(net, false), c).implementation(), "plain") << "auto on the CPU";
  trainer::Optimizer plain(trainer::param_slots(net, false), c);
  EXPECT_FALSE(plain.skips_on_device());
  EXPECT_THROW(plain.step_unless(0.1, torch::zeros({1})), std::logic_error) << "only the fused kernels read a skip";
  c.implementation = trainer::OptimImpl::kForeach;
  EXPECT_EQ(trainer::Optimizer(trainer::param_slots(net, false), c).implementation(), "foreach");
  c.implementation = trainer::OptimImpl::kFused;
  const std::string err = testutil::error_text([&] { trainer::Optimizer(trainer::param_slots(net, false), c); });
  const std::string cfg_err = testutil::error_text([] { trainer::load_config("", {"optim.implementation=fused"}); });
  if (trainer::compat::kHasFusedOptimizers) {
    EXPECT_EQ(err, "(no exception)") << "fused exists in LibTorch " << trainer::compat::torch_version();
    EXPECT_EQ(cfg_err, "(no exception)");
  } else {
    EXPECT_EQ(err, "optim.implementation: fused needs LibTorch 2.4 or later (this is " +
                       trainer::compat::torch_version() + "); use auto, plain or foreach");
    EXPECT_EQ(cfg_err, "config: key 'optim.implementation': fused needs LibTorch 2.4 or later (this is " +
                           trainer::compat::torch_version() + "); use auto, plain or foreach");
  }
  EXPECT_NE(testutil::error_text([] { trainer::load_config("", {"optim.implementation=fast"}); })
                .find("key 'optim.implementation'"),
            std::string::npos);
}

// ---- the padded vocabulary ------------------------------------------------------------------------

namespace {

models::Model tiny_gpt(int64_t vocab_multiple) {
  torch::manual_seed(5);
  return models::create_model("gpt_tiny",
                              models::ModelOptions().vocab_size(300).context(16).vocab_multiple(vocab_multiple));
}

// The step's loss: cross entropy summed over the targets, divided by their count (trainer/step/step.cpp).
torch::Tensor loss_of(models::ModelImpl& m, const torch::Tensor& x, const torch::Tensor& y) {
  auto logits = m.forward(x);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         static_cast<double>(y.numel());
}

}  // namespace

TEST(GptVocabPadding, SameLossAndGradientsAsTheUnpaddedModel) {
  auto plain = tiny_gpt(1), padded = tiny_gpt(64);
  auto* p = dynamic_cast<models::GPTImpl*>(padded.get());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->padded_vocab(), 320);
  const auto pp = plain->named_parameters(), qp = padded->named_parameters();
  ASSERT_EQ(pp.keys(), qp.keys()) << "the parameter names do not change";
  const auto& w = qp["transformer.wte.weight"];
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{320, 128}));
  // The same initial numbers (the padding rows come after every draw), zero padding rows.
  for (const auto& k : pp.keys()) {
    if (k == "transformer.wte.weight") continue;
    EXPECT_TRUE(pp[k].equal(qp[k])) << k;
  }
  EXPECT_TRUE(w.narrow(0, 0, 300).equal(pp["transformer.wte.weight"]));
  EXPECT_EQ(w.narrow(0, 300, 20).abs().max().item<float>(), 0.0f);

  auto x = torch::randint(300, {3, 16}, torch::kLong), y = torch::randint(300, {3, 16}, torch::kLong);
  auto logits = padded->forward(x);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 16, 300})) << "the padding columns never leave the model";
  // Tolerance: the same sums over the same numbers in a matmul of another width; float32 rounding at most.
  EXPECT_TRUE(torch::allclose(logits, plain->forward(x), 1e-5, 1e-6));
  auto la = loss_of(*plain, x, y), lb = loss_of(*padded, x, y);
  EXPECT_NEAR(la.item<double>(), lb.item<double>(), 1e-6 * la.item<double>());
  la.backward();
  lb.backward();
  for (const auto& k : pp.keys()) {
    auto ga = pp[k].grad(), gb = qp[k].grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << k;
    if (k == "transformer.wte.weight") {
      EXPECT_TRUE(torch::allclose(gb.narrow(0, 0, 300), ga, 1e-4, 1e-7)) << k;
      EXPECT_EQ(gb.narrow(0, 300, 20).abs().max().item<float>(), 0.0f) << "the padding rows' gradient";
    } else {
      EXPECT_TRUE(torch::allclose(gb, ga, 1e-4, 1e-7)) << k << " differs by " << (gb - ga).abs().max().item<double>();
    }
  }
  // Whatever the padding rows hold, the output does not change: they are never looked up, and their
  // logits are cut off.
  {
    torch::NoGradGuard ng;
    w.narrow(0, 300, 20).normal_(0.0, 5.0);
  }
  EXPECT_TRUE(padded->forward(x).equal(logits));
}

TEST(GptVocabPadding, PaddingRowsStayZeroUnderAdamWWithWeightDecay) {
  for (const char* impl : {"plain", "foreach"}) {
    auto m = tiny_gpt(64);
    trainer::OptimConfig c;
    c.name = trainer::OptimKind::kAdamW;
    c.lr = 1e-2;
    c.weight_decay = 0.1;
    c.implementation = trainer::mode_from_name<trainer::OptimImpl>(impl);
    trainer::Optimizer opt(trainer::param_slots(*m, false), c);
    auto w = m->named_parameters()["transformer.wte.weight"];
    const auto real_before = w.narrow(0, 0, 300).detach().clone();
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      loss_of(*m, torch::randint(300, {2, 16}, torch::kLong), torch::randint(300, {2, 16}, torch::kLong)).backward();
      opt.step(c.lr);
    }
    EXPECT_EQ(w.narrow(0, 300, 20).abs().max().item<float>(), 0.0f) << impl;
    EXPECT_FALSE(w.narrow(0, 0, 300).equal(real_before)) << impl << ": the real rows trained";
  }
}

// Through the executable: the same job with and without padding trains to the same losses (to float32
// rounding of the wider matmul), and the padding shows only in wte's shape. A 4-sample batch of the
// synthetic tokens, vocabulary 300 padded to 384.
TEST(GptVocabPadding, TrainerTrainsTheSameLossesPaddedAndNot) {
  TempDir dir;
  std::vector<std::vector<double>> losses;
  for (const char* multiple : {"1", "128"}) {
    const std::string run = (dir / (std::string("run") + multiple)).string();
    auto r = testutil::run(testutil::trainer_bin() +
                           " --set model.name=gpt_tiny --set model.context=32 --set model.vocab_size=300 --set "
                           "data.kind=synthetic --set data.synthetic_size=16 --set data.test= --set optim.name=adamw "
                           "--set optim.lr=0.01 --set train.global_batch=4 --set train.steps=4 --set train.device=cpu "
                           "--set train.epochs=0 --set train.threads=1 --set model.vocab_multiple=" + multiple +
                           " --run-dir " + run);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(run + "/metrics.jsonl");
    std::string line;
    losses.emplace_back();
    while (std::getline(in, line)) {
      const json l = json::parse(line);
      if (!l.contains("event")) losses.back().push_back(l["loss"].get<double>());
    }
  }
  ASSERT_EQ(losses[0].size(), 4u);
  ASSERT_EQ(losses[1].size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(losses[0][i], losses[1][i], 1e-5 * losses[0][i]) << "step " << i + 1;
  EXPECT_NE(losses[0][0], losses[0][3]) << "the losses moved";
}

// ---- the bias inside the matmul ---------------------------------------------------------------------

TEST(GptFusedBias, SameLossAndGradientsAsNnLinear) {
  auto make = [](bool fused) {
    torch::manual_seed(6);
    return models::create_model("gpt_tiny", models::ModelOptions().vocab_size(300).context(16).fused_bias(fused));
  };
  auto a = make(false), b = make(true);
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& k : pa.keys()) ASSERT_TRUE(pa[k].equal(pb[k])) << k << ": the switch does not change the init";
  // Random biases: the initial ones are zero, which would hide a bias added twice or not at all.
  {
    torch::NoGradGuard ng;
    for (const auto& k : pa.keys())
      if (k.find(".bias") != std::string::npos && k.find("ln_") == std::string::npos) {
        pa[k].normal_(0.0, 0.1);
        pb[k].copy_(pa[k]);
      }
  }
  auto x = torch::randint(300, {3, 16}, torch::kLong), y = torch::randint(300, {3, 16}, torch::kLong);
  // Tolerance: float32 rounding of the bias added inside the GEMM's sums rather than after them.
  EXPECT_TRUE(torch::allclose(a->forward(x), b->forward(x), 1e-5, 1e-6));
  auto la = loss_of(*a, x, y), lb = loss_of(*b, x, y);
  EXPECT_NEAR(la.item<double>(), lb.item<double>(), 1e-6 * la.item<double>());
  la.backward();
  lb.backward();
  for (const auto& k : pa.keys())
    EXPECT_TRUE(torch::allclose(pa[k].grad(), pb[k].grad(), 1e-4, 1e-7))
        << k << " differs by " << (pa[k].grad() - pb[k].grad()).abs().max().item<double>();
}

// ---- the snapshot -----------------------------------------------------------------------------------

namespace {

// BatchNorm buffers (float and the int64 num_batches_tracked, 0-dim) and a 4-d buffer in channels_last.
struct Buffers : torch::nn::Module {
  torch::nn::BatchNorm2d bn{nullptr};
  torch::Tensor img;
  Buffers() {
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    img = register_buffer("img", torch::randn({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast));
  }
};

}  // namespace

TEST(StepSnapshot, BatchedPutsBackWhatThePerBufferSnapshotPutsBack) {
  for (bool batched : {false, true}) {
    torch::manual_seed(4);
    Buffers m;
    m.train();
    m.bn->forward(torch::randn({8, 3, 4, 4}));  // running statistics away from their start
    std::vector<torch::Tensor> before;
    for (const auto& b : m.buffers()) before.push_back(b.clone());
    const trainer::StepSnapshot snap(m, torch::kCPU, batched);
    m.bn->forward(torch::randn({8, 3, 4, 4}) * 3);
    {
      torch::NoGradGuard ng;
      m.img.mul_(-2);
    }
    bool moved = false;
    for (size_t i = 0; i < before.size(); ++i) moved = moved || !m.buffers()[i].equal(before[i]);
    ASSERT_TRUE(moved);
    snap.restore();
    const auto after = m.buffers();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(after[i].equal(before[i])) << (batched ? "batched" : "per buffer") << ": buffer " << i;
      EXPECT_EQ(after[i].scalar_type(), before[i].scalar_type());
    }
    EXPECT_TRUE(m.img.is_contiguous(at::MemoryFormat::ChannelsLast)) << "restore writes into the live buffer";
  }
}

TEST(StepSnapshot, SnapshotKeyIsChecked) {
  EXPECT_EQ(trainer::load_config("", {}).train.snapshot, trainer::SnapshotMode::kBatched);
  EXPECT_EQ(trainer::load_config("", {"train.snapshot=per_buffer"}).train.snapshot, trainer::SnapshotMode::kPerBuffer);
  EXPECT_NE(testutil::error_text([] { trainer::load_config("", {"train.snapshot=lazy"}); })
                .find("key 'train.snapshot'"),
            std::string::npos);
}

// The Python reference pads its GPT as the trainer does: the same state shapes and parameter count (the
// padding rows included), and the same FLOPs (which count the real vocabulary only).
// ---- train.fused_loss -----------------------------------------------------------------------------------
namespace {

namespace F = torch::nn::functional;

// PyTorch's summed cross-entropy and its gradient, in float64, on the logits as they are (already rounded
// to their type): the reference both losses are held to.
std::pair<torch::Tensor, torch::Tensor> reference_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                                                       double smoothing, double scale) {
  auto x = logits.detach().to(torch::kDouble).contiguous().requires_grad_(true);
  auto l = F::cross_entropy(x, targets, F::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(smoothing));
  (l * scale).backward();
  return {l.detach(), x.grad()};
}

// Targets in [0, V), every fifth one PyTorch's ignore_index.
torch::Tensor targets_for(int64_t rows, int64_t vocab, const torch::Device& device) {
  auto t = torch::randint(vocab, {rows}, torch::kLong);
  t.index_put_({torch::arange(0, rows, 5)}, -100);
  return t.to(device);
}

// Mixed soft targets as Mixup makes them: smoothed one-hot rows of two permutations, lam and 1 - lam, with a
// row of zeros (an undecodable sample) in the middle.
torch::Tensor soft_targets_for(int64_t rows, int64_t vocab, const torch::Device& device) {
  auto a = trainer::smoothed_one_hot(torch::randint(vocab, {rows}, torch::kLong), vocab, 0.1);
  auto b = trainer::smoothed_one_hot(torch::randint(vocab, {rows}, torch::kLong), vocab, 0.1);
  auto t = a * 0.7 + b * 0.3;
  t[rows / 2].zero_();
  return t.to(device);
}

// -sum t log_softmax(x) and its gradient in float64 on the logits as they are (timm's SoftTargetCrossEntropy,
// summed over the rows; a weight of 0 adds nothing, also beside a masked logit).
std::pair<torch::Tensor, torch::Tensor> reference_soft_loss(const torch::Tensor& logits, const torch::Tensor& soft,
                                                            double scale) {
  auto x = logits.detach().to(torch::kDouble).contiguous().requires_grad_(true);
  auto t = soft.to(torch::kDouble);
  auto l = torch::where(t.eq(0), torch::zeros_like(x), -t * torch::log_softmax(x, -1)).sum();  // 0 * -inf: 0
  (l * scale).backward();
  return {l.detach(), x.grad()};
}

// The loss `loss_of` computes from a copy of the logits, and the copy's gradient.
std::pair<torch::Tensor, torch::Tensor> loss_and_grad(const torch::Tensor& logits,
                                                      const std::function<torch::Tensor(const torch::Tensor&)>& loss_of) {
  auto x = logits.detach().clone().requires_grad_(true);
  auto l = loss_of(x);
  l.backward();
  return {l.detach(), x.grad()};
}

}  // namespace

TEST(FusedLoss, OffCudaTheKeyChangesNothingBitForBit) {
  torch::manual_seed(3);
  auto logits = torch::randn({12, 37}) * 3;
  auto targets = targets_for(12, 37, torch::kCPU);
  for (double smoothing : {0.0, 0.1}) {
    trainer::LossOptions fused{smoothing, true}, plain{smoothing, false};
    EXPECT_FALSE(trainer::fused_loss_runs(logits, fused)) << "a CPU tensor takes the plain loss";
    const auto [a, ga] = loss_and_grad(logits, [&](auto& x) { return trainer::summed_cross_entropy(x, targets, fused); });
    const auto [b, gb] = loss_and_grad(logits, [&](auto& x) { return trainer::summed_cross_entropy(x, targets, plain); });
    EXPECT_TRUE(a.equal(b)) << smoothing;
    EXPECT_TRUE(ga.equal(gb)) << smoothing;
    auto r = reference_loss(logits, targets, smoothing, 1.0);
    EXPECT_NEAR(a.item<double>(), r.first.item<double>(), 1e-5 * r.first.item<double>()) << "PyTorch's loss";
    // Padded rows with their real width: the plain loss slices them off first.
    auto padded = torch::cat({logits, torch::full({12, 5}, 50.0)}, 1);
    EXPECT_TRUE(trainer::summed_cross_entropy(padded, targets, fused, 37).equal(a)) << smoothing;
  }
  // Soft targets (Mixup's), through summed_loss: the same.
  auto soft = soft_targets_for(12, 37, torch::kCPU);
  const auto [a, ga] = loss_and_grad(logits, [&](auto& x) { return trainer::summed_loss(x, soft, {0.0, true}); });
  const auto [b, gb] = loss_and_grad(logits, [&](auto& x) { return trainer::summed_loss(x, soft, {0.0, false}); });
  EXPECT_TRUE(a.equal(b));
  EXPECT_TRUE(ga.equal(gb));
  EXPECT_NEAR(a.item<double>(), reference_soft_loss(logits, soft, 1.0).first.item<double>(), 1e-5 * a.item<double>());
}

// Every type, contiguous rows with and without 16-byte vectors, rows narrowed from a padded vocabulary (read
// in place; the padding columns get no gradient), label smoothing, ignored targets, and a gradient that is
// not 1 (the loss scaler's): loss and gradient against float64.
TEST(FusedLossCuda, LossAndGradientOfPyTorchForEveryTypeAndLayout) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!trainer::fused_loss_built()) GTEST_SKIP() << "not a CUDA build";
  const torch::Device cuda(torch::kCUDA);
  struct Layout { int64_t rows, vocab, stored; };  // stored > vocab: the rows are a narrowed view
  const std::vector<Layout> layouts{{33, 50257, 50257}, {16, 1024, 1024}, {24, 50257, 50304}, {5, 7, 7}, {1, 3, 8}};
  torch::manual_seed(11);
  for (auto type : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    // Tolerance of the gradient: one rounding to the type (half an ulp, taken as a whole one), and fp16's
    // subnormal spacing where a probability underflows.
    const double rtol = type == torch::kFloat ? 1e-5 : type == torch::kHalf ? 1.0 / 1024 : 1.0 / 128;
    const double atol = type == torch::kHalf ? 1e-7 : 1e-12;
    for (const auto& l : layouts) {
      for (double smoothing : {0.0, 0.1}) {
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(l.rows) + "x" +
                                 std::to_string(l.vocab) + " stored " + std::to_string(l.stored) +
                                 " smoothing " + std::to_string(smoothing);
        auto base = (torch::randn({l.rows, l.stored}) * 3).to(cuda, type).requires_grad_(true);
        auto logits = base.narrow(1, 0, l.vocab);
        auto targets = targets_for(l.rows, l.vocab, cuda);
        trainer::LossOptions o{smoothing, true};
        ASSERT_TRUE(trainer::fused_loss_runs(logits, o)) << what;
        // Padded rows either way: the real columns as a view, or the whole rows and their real width.
        const bool whole_rows = l.stored > l.vocab && smoothing > 0;
        auto loss = whole_rows ? trainer::summed_cross_entropy(base, targets, o, l.vocab)
                               : trainer::summed_cross_entropy(logits, targets, o);
        EXPECT_EQ(loss.scalar_type(), torch::kFloat) << what;
        (loss * 3.0).backward();
        const auto [ref_loss, ref_grad] = reference_loss(logits, targets, smoothing, 3.0);
        EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 2e-6 * std::abs(ref_loss.item<double>()) + 1e-6)
            << what;
        // Relative to the terms, not only to their difference: with smoothing, exp(x - lse) - e / V cancels
        // where a probability is near e / V, and exp's float32 error (lse's rounding, about 1e-6 of it)
        // stays the size of the terms.
        auto grad = base.grad().narrow(1, 0, l.vocab).to(torch::kDouble);
        const double terms = 3.0 * smoothing / static_cast<double>(l.vocab);
        const double worst = ((grad - ref_grad).abs() - rtol * (ref_grad.abs() + terms)).max().item<double>();
        EXPECT_LE(worst, atol) << what << ": the gradient differs from PyTorch's beyond one rounding";
        if (l.stored > l.vocab)
          EXPECT_EQ(base.grad().narrow(1, l.vocab, l.stored - l.vocab).abs().max().item<float>(), 0.0f) << what;
      }
    }
  }
  // A target outside the vocabulary makes the loss NaN (a non-finite loss skips the step) instead of
  // reading outside the row; PyTorch stops the process with a device-side assert.
  auto x = torch::randn({4, 10}, torch::dtype(torch::kBFloat16).device(cuda));
  auto bad = torch::tensor({1, 2, 10, 3}, torch::kLong).to(cuda);
  EXPECT_TRUE(std::isnan(trainer::summed_cross_entropy(x, bad, {}).item<double>()));
}

// The fused kernel's soft-target pass: every type, vectorized rows and not, rows narrowed from a padded
// output and whole padded rows with their real width, a row of zeros, a masked logit (-inf) of weight 0, and
// a gradient that is not 1: loss and gradient against float64.
TEST(FusedLossCuda, SoftTargetsGiveTimmsSoftTargetCrossEntropy) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!trainer::fused_loss_built()) GTEST_SKIP() << "not a CUDA build";
  const torch::Device cuda(torch::kCUDA);
  struct Layout { int64_t rows, vocab, stored; };
  const std::vector<Layout> layouts{{64, 1000, 1000}, {16, 1000, 1024}, {9, 10, 10}, {5, 7, 7}, {3, 10, 16}};
  torch::manual_seed(13);
  for (auto type : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    const double rtol = type == torch::kFloat ? 1e-5 : type == torch::kHalf ? 1.0 / 1024 : 1.0 / 128;
    const double atol = type == torch::kHalf ? 1e-7 : 1e-12;
    for (const auto& l : layouts) {
      for (bool whole_rows : {false, true}) {
        if (whole_rows && l.stored == l.vocab) continue;
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(l.rows) + "x" +
                                 std::to_string(l.vocab) + " stored " + std::to_string(l.stored) +
                                 (whole_rows ? " whole rows" : " a view");
        auto values = torch::randn({l.rows, l.stored}) * 3;
        auto soft = soft_targets_for(l.rows, l.vocab, cuda);
        values.index_put_({0, 1}, -std::numeric_limits<float>::infinity());  // masked, of weight 0
        soft.index_put_({0, 1}, 0.0);
        auto base = values.to(cuda, type).requires_grad_(true);
        auto logits = base.narrow(1, 0, l.vocab);
        trainer::LossOptions o{0.0, true};
        ASSERT_TRUE(trainer::fused_loss_runs(logits, o)) << what;
        auto loss = whole_rows ? trainer::summed_loss(base, soft, o, l.vocab) : trainer::summed_loss(logits, soft, o);
        EXPECT_EQ(loss.scalar_type(), torch::kFloat) << what;
        ASSERT_TRUE(std::isfinite(loss.item<double>())) << what;
        (loss * 3.0).backward();
        const auto [ref_loss, ref_grad] = reference_soft_loss(logits, soft, 3.0);
        EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 2e-6 * std::abs(ref_loss.item<double>()) + 1e-6)
            << what;
        // dx = g (p w - t): relative to both terms, which cancel where p w is near t.
        auto grad = base.grad().narrow(1, 0, l.vocab).to(torch::kDouble);
        auto terms = 3.0 * soft.to(torch::kDouble) + (ref_grad + 3.0 * soft.to(torch::kDouble)).abs();
        const double worst = ((grad - ref_grad).abs() - rtol * (ref_grad.abs() + terms)).max().item<double>();
        EXPECT_LE(worst, atol) << what << ": the gradient differs from the float64 one beyond one rounding";
        EXPECT_EQ(base.grad()[l.rows / 2].abs().max().item<float>(), 0.0f) << what << ": a row of zeros";
        if (l.stored > l.vocab)
          EXPECT_EQ(base.grad().narrow(1, l.vocab, l.stored - l.vocab).abs().max().item<float>(), 0.0f) << what;
      }
    }
  }
  auto x = torch::randn({4, 10}, torch::dtype(torch::kBFloat16).device(cuda));
  EXPECT_THROW(trainer::summed_loss(x, torch::zeros({4, 9}, torch::kFloat).to(cuda), {}), std::invalid_argument)
      << "targets of another width";
}

// A GPT step on CUDA under bf16 autocast, its vocabulary padded (the logits a narrowed view): the fused loss
// gives the plain loss's value and gradients. Both round the logits' gradient to bf16 once, from float32
// arithmetic that differs only in its order of summation.
TEST(FusedLossCuda, AGptStepGivesThePlainLossAndGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!trainer::fused_loss_built()) GTEST_SKIP() << "not a CUDA build";
  const torch::Device cuda(torch::kCUDA);
  auto m = tiny_gpt(64);
  m->to(cuda);
  trainer::ForwardOptions fo;
  fo.device = cuda;
  fo.amp = true;
  fo.amp_dtype = torch::kBFloat16;
  auto x = torch::randint(300, {4, 16}, torch::kLong), y = torch::randint(300, {4, 16}, torch::kLong);
  std::vector<torch::Tensor> losses;
  std::vector<std::vector<torch::Tensor>> grads;
  for (bool fused : {false, true}) {
    m->zero_grad();
    auto out = trainer::forward_logits(*m, x, y, fo);
    ASSERT_EQ(out.logits.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(out.logits.size(1), 320) << "the padded rows reach the loss";
    ASSERT_EQ(out.columns, 300);
    trainer::LossOptions o{0.0, fused};
    ASSERT_EQ(trainer::fused_loss_runs(out.logits, o), fused);
    auto loss = trainer::summed_cross_entropy(out.logits, out.targets, o, out.columns) / 64.0;
    loss.backward();
    losses.push_back(loss.detach());
    std::vector<torch::Tensor> g;
    for (const auto& p : m->parameters()) g.push_back(p.grad().detach().clone());
    grads.push_back(g);
  }
  EXPECT_NEAR(losses[1].item<double>(), losses[0].item<double>(), 1e-5 * losses[0].item<double>());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    const double norm = grads[0][i].norm().item<double>(), diff = (grads[1][i] - grads[0][i]).norm().item<double>();
    EXPECT_LE(diff, 1e-2 * norm + 1e-8) << "parameter " << i << ": " << diff << " against a norm of " << norm;
  }
}

// The plain loss keeps the float32 log-probabilities for its backward pass (twice the bf16 logits) and
// makes float32 copies on the way; the fused one keeps the logits themselves and two floats a row. Peaks of
// one forward and backward over 4096 rows of GPT-2's padded vocabulary (the rows as GPT hands them over,
// 50,304 wide, 50,257 real), allocated memory.
TEST(FusedLossCuda, HoldsLessMemoryThanThePlainLoss) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!trainer::fused_loss_built()) GTEST_SKIP() << "not a CUDA build";
  const torch::Device cuda(torch::kCUDA);
  auto memory = trainer::make_memory_backend(cuda);
  auto base = torch::randn({4096, 50304}, torch::dtype(torch::kBFloat16).device(cuda)).requires_grad_(true);
  auto targets = torch::randint(50257, {4096}, torch::kLong).to(cuda);
  std::map<bool, int64_t> peak;
  for (bool fused : {false, true}) {
    base.mutable_grad() = torch::Tensor();
    torch::cuda::synchronize();
    memory->reset_peak();
    const int64_t before = memory->current_bytes();
    trainer::summed_cross_entropy(base, targets, {0.0, fused}, 50257).backward();  // GPT's padded rows
    torch::cuda::synchronize();
    peak[fused] = memory->peak_bytes() - before;
  }
  const int64_t logits_bytes = base.numel() * 2;
  std::cout << "peak over the logits: plain " << peak[false] / 1048576.0 << " MiB, fused " << peak[true] / 1048576.0
            << " MiB (the bf16 logits: " << logits_bytes / 1048576.0 << " MiB)\n";
  EXPECT_LT(peak[true], peak[false]);
  // fused: the gradient alone, the logits' size, its padding columns written as zeros by the kernel (no
  // zero-filled copy from slicing's backward)
  EXPECT_LE(peak[true], logits_bytes + (64 << 20));
}

TEST(GptVocabPadding, ReferenceBuildsThePaddedGptOfTheTrainer) {
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() +
                         "/bench/reference.py --describe --set model.name=gpt2 --set data.kind=tokens "
                         "--set model.context=1024 --set model.vocab_multiple=64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json py = json::parse(r.output);
  auto model = models::create_model("gpt2", models::ModelOptions().context(1024).vocab_multiple(64));
  EXPECT_EQ(py["state"]["transformer.wte.weight"], json({50304, 768}));
  EXPECT_EQ(model->named_parameters()["transformer.wte.weight"].sizes(), (std::vector<int64_t>{50304, 768}));
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  EXPECT_EQ(py["num_parameters"].get<int64_t>(), n);
  EXPECT_EQ(n, 124439808 + 47 * 768);
  EXPECT_EQ(py["flops_per_sample_forward"].get<double>(), model->forward_flops({1024}));
  EXPECT_EQ(model->forward_flops({1024}), models::create_model("gpt2", models::ModelOptions().context(1024))
                                              ->forward_flops({1024}));
}

// uint8 images to the model's input (trainer/numerics/forward.h images_to_float). Off CUDA it is PyTorch's four
// element-wise ops; on CUDA one kernel of the trainer's own for NHWC bytes, which must give their bits:
// every layout the loader hands over (a whole batch, a micro-batch narrowed at any sample, sizes that are
// and are not a multiple of 4), with and without the statistics.
TEST(ImagesToFloat, OneKernelOnCudaGivesTheBitsOfTheFourOps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the kernel runs there";
  const torch::Device dev(torch::kCUDA, 0);
  torch::manual_seed(5);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{8, 3, 37, 29}, {5, 3, 5, 7}, {6, 1, 28, 28}, {4, 4, 9, 9}}) {
    const int64_t c = shape[1];
    const auto bytes = torch::randint(256, shape, torch::kUInt8).contiguous(at::MemoryFormat::ChannelsLast).to(dev);
    trainer::ForwardOptions with, without;
    with.device = without.device = dev;
    with.input_mean = (torch::rand({1, c, 1, 1}) * 0.5 + 0.25).to(dev);
    with.input_std = (torch::rand({1, c, 1, 1}) * 0.2 + 0.15).to(dev);
    for (const auto* o : {&with, &without}) {
      for (int64_t at : {int64_t{0}, int64_t{1}}) {
        const auto x = bytes.narrow(0, at, shape[0] - at);  // a micro-batch from sample `at` on
        ASSERT_TRUE(trainer::images_in_one_kernel(x, *o)) << testing::PrintToString(shape);
        auto expected = x.to(torch::kFloat).div_(255.0f);
        if (o->input_mean.defined()) expected = expected.sub_(o->input_mean).div_(o->input_std);
        const auto got = trainer::images_to_float(x, *o);
        EXPECT_TRUE(got.is_contiguous(at::MemoryFormat::ChannelsLast));
        EXPECT_TRUE(got.equal(expected)) << testing::PrintToString(shape) << " from " << at << ", statistics "
                                         << o->input_mean.defined() << ": off by "
                                         << (got - expected).abs().max().item<float>();
      }
    }
  }
  // NCHW bytes: the four ops, as before.
  const auto nchw = torch::randint(256, {2, 3, 4, 4}, torch::kUInt8).to(dev);
  EXPECT_FALSE(trainer::images_in_one_kernel(nchw, trainer::ForwardOptions{}));
}

TEST(ImagesToFloat, OffCudaTheFourOps) {
  const auto x = torch::randint(256, {2, 3, 5, 5}, torch::kUInt8).contiguous(at::MemoryFormat::ChannelsLast);
  trainer::ForwardOptions o;
  o.input_mean = torch::tensor({0.4f, 0.5f, 0.6f}).reshape({1, 3, 1, 1});
  o.input_std = torch::tensor({0.2f, 0.25f, 0.3f}).reshape({1, 3, 1, 1});
  EXPECT_FALSE(trainer::images_in_one_kernel(x, o));
  const auto got = trainer::images_to_float(x, o);
  EXPECT_TRUE(got.equal(x.to(torch::kFloat).div_(255.0f).sub_(o.input_mean).div_(o.input_std)));
  EXPECT_TRUE(got.is_contiguous(at::MemoryFormat::ChannelsLast)) << "the batch's memory format is kept";
}

}  // namespace test_fast_paths
