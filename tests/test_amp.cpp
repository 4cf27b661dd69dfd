// Mixed precision: the autocast guard, the loss scaler and the amp config checks. References are the
// same computation in fp32, hand-computed values, and (where the fused kernels run) ATen's kernels.
#include "common/compat.h"
#include "trainer/numerics/amp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_amp {

namespace {

using trainer::AutocastGuard;
using trainer::GradScaler;
using trainer::GradScalerOptions;
using trainer::GradScalerState;
namespace compat = trainer::compat;

constexpr auto kCPU = c10::DeviceType::CPU;
constexpr auto kCUDA = c10::DeviceType::CUDA;
constexpr auto kBf16 = trainer::AmpDtype::kBf16;  // an unknown dtype is refused as the config is read
constexpr auto kFp16 = trainer::AmpDtype::kFp16;

// Expects `statement` to throw `exc` whose what() contains `text`.
#define EXPECT_THROW_WITH(statement, exc, text)                                     \
  do {                                                                              \
    try {                                                                           \
      statement;                                                                    \
      ADD_FAILURE() << "expected " #exc " from: " #statement;                       \
    } catch (const exc& e) {                                                        \
      EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr(text)) << #statement; \
    }                                                                               \
  } while (0)

// Puts the autocast state of both devices back after each test, whatever the test did.
class AmpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu_on_ = compat::autocast_enabled(kCPU);
    cpu_dtype_ = compat::autocast_dtype(kCPU);
    cuda_on_ = compat::autocast_enabled(kCUDA);
    cuda_dtype_ = compat::autocast_dtype(kCUDA);
  }
  void TearDown() override {
    compat::set_autocast_enabled(kCPU, cpu_on_);
    compat::set_autocast_dtype(kCPU, cpu_dtype_);
    compat::set_autocast_enabled(kCUDA, cuda_on_);
    compat::set_autocast_dtype(kCUDA, cuda_dtype_);
  }
  bool cpu_on_, cuda_on_;
  at::ScalarType cpu_dtype_, cuda_dtype_;
};

// ---- AutocastGuard -------------------------------------------------------------------------------

using AmpAutocastGuard = AmpTest;

TEST_F(AmpAutocastGuard, SetsAndRestoresFlagAndDtype) {
  compat::set_autocast_enabled(kCUDA, false);
  compat::set_autocast_dtype(kCUDA, at::kHalf);
  {
    AutocastGuard guard(kCUDA, at::kBFloat16, true);
    EXPECT_TRUE(compat::autocast_enabled(kCUDA));
    EXPECT_EQ(compat::autocast_dtype(kCUDA), at::kBFloat16);
    EXPECT_FALSE(compat::autocast_enabled(kCPU)) << "a CUDA guard must not touch CPU autocast";
  }
  EXPECT_FALSE(compat::autocast_enabled(kCUDA));
  EXPECT_EQ(compat::autocast_dtype(kCUDA), at::kHalf);
}

TEST_F(AmpAutocastGuard, NestedDisabledGuardTurnsAutocastOffAndBackOn) {
  compat::set_autocast_enabled(kCPU, false);
  {
    AutocastGuard outer(kCPU, at::kBFloat16, true);
    EXPECT_TRUE(compat::autocast_enabled(kCPU));
    {
      AutocastGuard inner(kCPU, at::kBFloat16, false);
      EXPECT_FALSE(compat::autocast_enabled(kCPU));
      auto a = torch::randn({4, 8});
      EXPECT_EQ(torch::matmul(a, a.t()).scalar_type(), at::kFloat);
    }
    EXPECT_TRUE(compat::autocast_enabled(kCPU));
    auto a = torch::randn({4, 8});
    EXPECT_EQ(torch::matmul(a, a.t()).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(compat::autocast_enabled(kCPU));
}

TEST_F(AmpAutocastGuard, CountsNesting) {
  // increment_nesting returns the new depth: one guard open means the next increment yields 2.
  {
    AutocastGuard outer(kCPU, at::kBFloat16, true);
    {
      AutocastGuard inner(kCPU, at::kBFloat16, false);
      EXPECT_EQ(at::autocast::increment_nesting(), 3);
      EXPECT_EQ(at::autocast::decrement_nesting(), 2);
    }
    EXPECT_EQ(at::autocast::increment_nesting(), 2);
    EXPECT_EQ(at::autocast::decrement_nesting(), 1);
  }
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

TEST_F(AmpAutocastGuard, ClearsCastCacheOnlyWhenOutermostGuardEnds) {
  // Autocast caches the low-precision copy of a leaf weight; the same copy comes back while the cache
  // lives, a new one after it was cleared.
  auto w = torch::randn({8, 8}, torch::requires_grad());
  torch::Tensor first;  // held past the guard so its address cannot be reused by a new cast
  {
    AutocastGuard outer(kCPU, at::kBFloat16, true);
    auto c1 = at::autocast::cached_cast(at::kBFloat16, w, kCPU);
    ASSERT_EQ(c1.scalar_type(), at::kBFloat16);
    auto c2 = at::autocast::cached_cast(at::kBFloat16, w, kCPU);
    ASSERT_EQ(c1.unsafeGetTensorImpl(), c2.unsafeGetTensorImpl()) << "the cast cache is not active on CPU";
    first = c1;
    { AutocastGuard inner(kCPU, at::kBFloat16, true); }
    auto c3 = at::autocast::cached_cast(at::kBFloat16, w, kCPU);
    EXPECT_EQ(c3.unsafeGetTensorImpl(), first.unsafeGetTensorImpl()) << "an inner guard must not clear the cache";
  }
  AutocastGuard again(kCPU, at::kBFloat16, true);
  auto c4 = at::autocast::cached_cast(at::kBFloat16, w, kCPU);
  EXPECT_NE(c4.unsafeGetTensorImpl(), first.unsafeGetTensorImpl()) << "the outermost guard must clear the cache";
}

TEST_F(AmpAutocastGuard, RejectsOtherDevices) {
  EXPECT_THROW_WITH(AutocastGuard(c10::DeviceType::Meta, at::kBFloat16, true), std::invalid_argument,
                    "autocast supports cpu and cuda");
}

// ---- bf16 autocast on CPU against fp32 -------------------------------------------------------------

// A small conv net: conv-bn-relu, conv-relu, global average pool, linear.
struct SmallConvNetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{torch::nn::Conv2dOptions(3, 8, 3).padding(1).bias(false)};
  torch::nn::BatchNorm2d bn1{8};
  torch::nn::Conv2d conv2{torch::nn::Conv2dOptions(8, 16, 3).padding(1)};
  torch::nn::Linear fc{16, 10};
  SmallConvNetImpl() {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("fc", fc);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::relu(conv2(h));
    h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);  // (B, 16)
    return fc(h);
  }
};
TORCH_MODULE(SmallConvNet);

// A pre-norm Transformer layer (no dropout): attention written with matmuls + softmax, GELU MLP.
struct SmallTransformerLayerImpl : torch::nn::Module {
  int64_t n_head;
  torch::nn::LayerNorm ln_1{torch::nn::LayerNormOptions({32})};
  torch::nn::Linear c_attn{32, 96};
  torch::nn::Linear attn_proj{32, 32};
  torch::nn::LayerNorm ln_2{torch::nn::LayerNormOptions({32})};
  torch::nn::Linear c_fc{32, 128};
  torch::nn::Linear mlp_proj{128, 32};
  explicit SmallTransformerLayerImpl(int64_t heads = 4) : n_head(heads) {
    register_module("ln_1", ln_1);
    register_module("c_attn", c_attn);
    register_module("attn_proj", attn_proj);
    register_module("ln_2", ln_2);
    register_module("c_fc", c_fc);
    register_module("mlp_proj", mlp_proj);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hs = C / n_head;
    auto qkv = c_attn(ln_1(x)).split(C, 2);                          // 3 x (B, T, C)
    auto q = qkv[0].view({B, T, n_head, hs}).transpose(1, 2);        // (B, nh, T, hs)
    auto k = qkv[1].view({B, T, n_head, hs}).transpose(1, 2);        // (B, nh, T, hs)
    auto v = qkv[2].view({B, T, n_head, hs}).transpose(1, 2);        // (B, nh, T, hs)
    auto att = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hs)), -1);  // (B, nh, T, T)
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});  // (B, T, C)
    auto h = x + attn_proj(y);
    return h + mlp_proj(torch::gelu(c_fc(ln_2(h))));
  }
};
TORCH_MODULE(SmallTransformerLayer);

// Relative difference |a - b| / |b| of two scalar losses.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double x = a.item<double>(), y = b.item<double>();
  return std::abs(x - y) / std::abs(y);
}

// One forward (under autocast when `bf16`), backward outside the guard, SGD step, and a second forward;
// returns both losses in fp32.
template <class Model>
std::pair<torch::Tensor, torch::Tensor> two_losses(Model& model, const torch::Tensor& x,
                                                   const std::function<torch::Tensor(const torch::Tensor&)>& loss_of,
                                                   bool bf16) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  torch::Tensor first;
  {
    AutocastGuard guard(kCPU, at::kBFloat16, bf16);
    first = loss_of(model->forward(x)).to(at::kFloat);
  }
  opt.zero_grad();
  first.backward();
  opt.step();
  torch::Tensor second;
  {
    AutocastGuard guard(kCPU, at::kBFloat16, bf16);
    second = loss_of(model->forward(x)).to(at::kFloat);
  }
  return {first.detach(), second.detach()};
}

// bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per op); over a few layers the loss
// stays within 2e-2 of fp32. The losses must also differ, or the run was not in bf16.
constexpr double kBf16LossTol = 2e-2;

using AmpBf16Cpu = AmpTest;

TEST_F(AmpBf16Cpu, MatmulLinearConvRunInBf16InsideGuard) {
  auto a = torch::randn({4, 8});
  torch::nn::Linear lin(8, 3);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 4, 3));
  auto img = torch::randn({1, 3, 8, 8});
  {
    AutocastGuard guard(kCPU, at::kBFloat16, true);
    EXPECT_EQ(torch::matmul(a, a.t()).scalar_type(), at::kBFloat16);
    EXPECT_EQ(lin(a).scalar_type(), at::kBFloat16);
    EXPECT_EQ(conv(img).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(torch::matmul(a, a.t()).scalar_type(), at::kFloat);
  EXPECT_EQ(lin(a).scalar_type(), at::kFloat);
}

TEST_F(AmpBf16Cpu, ConvNetStepLossWithinToleranceOfFp32) {
  torch::manual_seed(0);
  SmallConvNet fp32_net;
  SmallConvNet bf16_net;
  {
    torch::NoGradGuard no_grad;
    auto src = fp32_net->parameters();
    auto dst = bf16_net->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  auto x = torch::randn({8, 3, 16, 16});
  auto target = torch::randint(0, 10, {8}, torch::kLong);
  auto loss_of = [&](const torch::Tensor& logits) { return torch::cross_entropy_loss(logits, target); };
  auto [f1, f2] = two_losses(fp32_net, x, loss_of, false);
  auto [b1, b2] = two_losses(bf16_net, x, loss_of, true);
  EXPECT_LT(rel_diff(b1, f1), kBf16LossTol) << "bf16 " << b1.item<double>() << " fp32 " << f1.item<double>();
  EXPECT_LT(rel_diff(b2, f2), kBf16LossTol) << "bf16 " << b2.item<double>() << " fp32 " << f2.item<double>();
  EXPECT_NE(b1.item<double>(), f1.item<double>()) << "identical losses: autocast did not run in bf16";
  EXPECT_LT(f2.item<double>(), f1.item<double>()) << "the fp32 step did not lower the loss";
  EXPECT_LT(b2.item<double>(), b1.item<double>()) << "the bf16 step did not lower the loss";
  for (const auto& p : bf16_net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "weights stay fp32";
}

TEST_F(AmpBf16Cpu, TransformerLayerStepLossWithinToleranceOfFp32) {
  torch::manual_seed(1);
  SmallTransformerLayer fp32_layer;
  SmallTransformerLayer bf16_layer;
  {
    torch::NoGradGuard no_grad;
    auto src = fp32_layer->parameters();
    auto dst = bf16_layer->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  auto x = torch::randn({2, 16, 32});
  auto target = torch::randn({2, 16, 32});
  auto loss_of = [&](const torch::Tensor& y) { return torch::mse_loss(y.to(at::kFloat), target); };
  auto [f1, f2] = two_losses(fp32_layer, x, loss_of, false);
  auto [b1, b2] = two_losses(bf16_layer, x, loss_of, true);
  EXPECT_LT(rel_diff(b1, f1), kBf16LossTol) << "bf16 " << b1.item<double>() << " fp32 " << f1.item<double>();
  EXPECT_LT(rel_diff(b2, f2), kBf16LossTol) << "bf16 " << b2.item<double>() << " fp32 " << f2.item<double>();
  EXPECT_NE(b1.item<double>(), f1.item<double>()) << "identical losses: autocast did not run in bf16";
  EXPECT_LT(f2.item<double>(), f1.item<double>());
  EXPECT_LT(b2.item<double>(), b1.item<double>());
}

// ---- validate_amp -------------------------------------------------------------------------------

TEST(AmpValidate, AcceptsSupportedCombinations) {
  EXPECT_NO_THROW(trainer::validate_amp(true, kBf16, false, kCPU));
  EXPECT_NO_THROW(trainer::validate_amp(true, kBf16, false, kCUDA));
  EXPECT_NO_THROW(trainer::validate_amp(true, kFp16, true, kCUDA));
  EXPECT_NO_THROW(trainer::validate_amp(false, kFp16, true, kCPU)) << "disabled amp ignores the rest";
  EXPECT_EQ(trainer::amp_scalar_type(kBf16), at::kBFloat16);
  EXPECT_EQ(trainer::amp_scalar_type(kFp16), at::kHalf);
}

TEST(AmpValidate, ErrorTextsNameKeyAndFix) {
  EXPECT_THROW_WITH(trainer::validate_amp(true, kFp16, false, kCUDA), std::invalid_argument,
                    "amp.dtype: fp16 needs the loss scaler");
  EXPECT_THROW_WITH(trainer::validate_amp(true, kFp16, false, kCUDA), std::invalid_argument,
                    "set amp.scaler.enabled: true or use amp.dtype: bf16");
  EXPECT_THROW_WITH(trainer::validate_amp(true, kBf16, true, kCUDA), std::invalid_argument,
                    "amp.scaler.enabled: the loss scaler is for fp16 only");
  EXPECT_THROW_WITH(trainer::validate_amp(true, kFp16, true, kCPU), std::invalid_argument,
                    "amp.dtype: fp16 is not supported on CPU");
  EXPECT_THROW_WITH(trainer::validate_amp(true, kBf16, false, c10::DeviceType::Meta), std::invalid_argument,
                    "amp.enabled: autocast supports cpu and cuda");
}

// ---- GradScaler -----------------------------------------------------------------------------------

// A tiny regression model and batch; the loss is deterministic for a given seed.
struct Problem {
  torch::nn::Sequential model{torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2)};
  torch::Tensor x, y;
  explicit Problem(uint64_t seed) {
    torch::manual_seed(seed);
    model = torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
    x = torch::randn({16, 6});
    y = torch::randn({16, 2});
  }
  torch::Tensor loss() { return torch::mse_loss(model->forward(x), y); }
  std::vector<torch::Tensor> params() { return model->parameters(); }
};

std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts, bool grads = false) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back((grads ? t.grad() : t).detach().clone());
  return out;
}

TEST(GradScaler, ScalesLossByInitScale) {
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  auto loss = torch::tensor(0.75f);
  EXPECT_EQ(scaler.scale(loss).item<float>(), 768.0f);
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

TEST(GradScaler, PlantedInfSkipsStepKeepsParamsBitIdenticalAndHalvesScale) {
  Problem prob(3);
  torch::optim::Adam opt(prob.params(), torch::optim::AdamOptions(1e-2));
  GradScaler scaler;
  const auto before = clone_all(prob.params());
  opt.zero_grad();
  scaler.scale(prob.loss()).backward();
  {
    torch::NoGradGuard no_grad;
    prob.params()[2].grad().view(-1)[3].fill_(std::numeric_limits<float>::infinity());
  }
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(scaler.found_inf());
  const auto after = clone_all(prob.params());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "param " << i;
  EXPECT_TRUE(opt.state().empty()) << "Adam must not have counted a skipped step";
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  EXPECT_EQ(scaler.state().growth_tracker, 0);

  // A NaN backs off as well; then a clean step steps.
  opt.zero_grad();
  scaler.scale(prob.loss()).backward();
  {
    torch::NoGradGuard no_grad;
    prob.params()[0].grad().view(-1)[0].fill_(std::numeric_limits<float>::quiet_NaN());
  }
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 16384.0);

  opt.zero_grad();
  scaler.scale(prob.loss()).backward();
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_FALSE(scaler.found_inf());
  scaler.update();
  EXPECT_FALSE(torch::equal(before[0], prob.params()[0])) << "a clean step must change the parameters";
  EXPECT_EQ(scaler.get_scale(), 16384.0);
  EXPECT_EQ(scaler.state().growth_tracker, 1);
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanSteps) {
  Problem prob(4);
  torch::optim::SGD opt(prob.params(), torch::optim::SGDOptions(1e-3));
  GradScaler scaler(GradScalerOptions().init_scale(256.0).growth_interval(3));
  const std::vector<double> expected_scale = {256, 256, 512, 512, 512, 1024};
  const std::vector<int64_t> expected_tracker = {1, 2, 0, 1, 2, 0};
  for (size_t i = 0; i < expected_scale.size(); ++i) {
    opt.zero_grad();
    scaler.scale(prob.loss()).backward();
    ASSERT_TRUE(scaler.step(opt)) << "step " << i;
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), expected_scale[i]) << "after step " << i;
    EXPECT_EQ(scaler.state().growth_tracker, expected_tracker[i]) << "after step " << i;
  }
}

TEST(GradScaler, GrowthThatWouldOverflowFp32IsSkipped) {
  GradScaler scaler(GradScalerOptions().init_scale(3e38).growth_interval(1));
  auto w = torch::ones({2}, torch::requires_grad());
  scaler.scale(w.sum()).backward();
  scaler.unscale_({w});
  scaler.update();
  EXPECT_FLOAT_EQ(static_cast<float>(scaler.get_scale()), 3e38f);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
}

TEST(GradScaler, UnscaleThenClipEqualsClippingTrueGradients) {
  Problem plain(5);
  plain.loss().backward();
  const double plain_norm = torch::nn::utils::clip_grad_norm_(plain.params(), 0.05);
  const auto true_clipped = clone_all(plain.params(), true);

  Problem scaled(5);
  GradScaler scaler;
  scaler.scale(scaled.loss()).backward();
  EXPECT_GT(scaled.params()[0].grad().abs().max().item<float>(), 1000.0f) << "gradients were not scaled";
  scaler.unscale_(scaled.params());
  scaler.unscale_(scaled.params());  // idempotent within a step
  const double scaled_norm = torch::nn::utils::clip_grad_norm_(scaled.params(), 0.05);
  EXPECT_NEAR(scaled_norm, plain_norm, 1e-6 * plain_norm);
  ASSERT_GT(plain_norm, 0.05) << "the clip threshold must bite for this test to mean something";
  const auto got = clone_all(scaled.params(), true);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], true_clipped[i], 1e-6, 1e-9)) << "param " << i;
  }
}

TEST(GradScaler, StepUnscalesWhenNotDoneAndMatchesUnscaledSgd) {
  Problem plain(6);
  torch::optim::SGD plain_opt(plain.params(), torch::optim::SGDOptions(0.1));
  plain.loss().backward();
  plain_opt.step();

  Problem scaled(6);
  torch::optim::SGD opt(scaled.params(), torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  scaler.scale(scaled.loss()).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  for (size_t i = 0; i < plain.params().size(); ++i) {
    EXPECT_TRUE(torch::allclose(scaled.params()[i], plain.params()[i], 1e-6, 1e-9)) << "param " << i;
  }
}

TEST(GradScaler, AbandonedStepIsUnscaledAgainWhenRedone) {
  // An OOM retry: the first attempt was unscaled, then thrown away; the redone step's scaled gradients
  // must be unscaled again, or the optimizer would step with gradients 65536 times too large.
  Problem plain(12);
  torch::optim::SGD plain_opt(plain.params(), torch::optim::SGDOptions(0.1));
  plain.loss().backward();
  plain_opt.step();

  Problem scaled(12);
  torch::optim::SGD opt(scaled.params(), torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  scaler.scale(scaled.loss()).backward();
  scaler.unscale_(scaled.params());
  scaler.abandon_step();
  opt.zero_grad();
  scaler.scale(scaled.loss()).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  for (size_t i = 0; i < plain.params().size(); ++i) {
    EXPECT_TRUE(torch::allclose(scaled.params()[i], plain.params()[i], 1e-6, 1e-9)) << "param " << i;
  }
}

TEST(GradScaler, DisabledIsPassThrough) {
  Problem prob(7);
  torch::optim::SGD opt(prob.params(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(GradScalerOptions().enabled(false));
  auto loss = prob.loss();
  auto scaled = scaler.scale(loss);
  EXPECT_TRUE(scaled.is_same(loss));
  scaled.backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.found_inf());
}

TEST(GradScaler, MisuseAndBadOptionsHaveClearErrors) {
  Problem prob(8);
  torch::optim::SGD opt(prob.params(), torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  EXPECT_THROW_WITH(scaler.update(), std::runtime_error, "call scaler.step(optimizer) before scaler.update()");
  scaler.scale(prob.loss()).backward();
  scaler.step(opt);
  EXPECT_THROW_WITH(scaler.step(opt), std::runtime_error, "called twice in one step");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().init_scale(0)), std::invalid_argument,
                    "amp.scaler.init_scale must be finite and > 0");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().growth_factor(1.0)), std::invalid_argument,
                    "amp.scaler.growth_factor must be > 1");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().backoff_factor(1.0)), std::invalid_argument,
                    "amp.scaler.backoff_factor must be in (0, 1)");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().growth_interval(0)), std::invalid_argument,
                    "amp.scaler.growth_interval must be >= 1");
}

TEST(GradScaler, StateRoundTripsThroughJsonAndResumesIdentically) {
  Problem prob(9);
  torch::optim::SGD opt(prob.params(), torch::optim::SGDOptions(1e-3));
  const auto options = GradScalerOptions().init_scale(4096.0).growth_interval(4);
  GradScaler scaler(options);
  // One backoff, then two clean steps: scale 2048, tracker 2.
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    scaler.scale(prob.loss()).backward();
    if (i == 0) {
      torch::NoGradGuard no_grad;
      prob.params()[1].grad().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
    }
    scaler.step(opt);
    scaler.update();
  }
  const GradScalerState s = scaler.state();
  EXPECT_EQ(s.scale, 2048.0);
  EXPECT_EQ(s.growth_tracker, 2);

  const nlohmann::json j = s;
  const std::string text = j.dump();
  EXPECT_EQ(text, R"({"growth_tracker":2,"scale":2048.0})");
  const auto back = nlohmann::json::parse(text).get<GradScalerState>();
  GradScaler resumed(options);
  resumed.load_state(back);
  EXPECT_EQ(resumed.get_scale(), 2048.0);
  EXPECT_EQ(resumed.state().growth_tracker, 2);
  // Both grow at the same step: two more clean steps reach the interval of 4.
  for (int i = 0; i < 2; ++i) {
    for (GradScaler* sc : {&scaler, &resumed}) {
      opt.zero_grad();
      sc->scale(prob.loss()).backward();
      sc->step(opt);
      sc->update();
    }
    EXPECT_EQ(resumed.get_scale(), scaler.get_scale()) << "after resumed step " << i;
  }
  EXPECT_EQ(resumed.get_scale(), 4096.0);
}

TEST(GradScaler, StateJsonErrorsNameTheKey) {
  EXPECT_THROW_WITH(nlohmann::json::parse(R"({"scale": 2.0})").get<GradScalerState>(), std::invalid_argument,
                    "missing key 'growth_tracker'");
  EXPECT_THROW_WITH(nlohmann::json::parse(R"({"scale": "big", "growth_tracker": 0})").get<GradScalerState>(),
                    std::invalid_argument, "'scale' must be a number");
  EXPECT_THROW_WITH(nlohmann::json::parse(R"({"scale": 2.0, "growth_tracker": 1.5})").get<GradScalerState>(),
                    std::invalid_argument, "'growth_tracker' must be an integer");
  GradScaler scaler;
  EXPECT_THROW_WITH(scaler.load_state({-1.0, 0}), std::invalid_argument, "scale must be finite and > 0");
  EXPECT_THROW_WITH(scaler.load_state({1.0, -3}), std::invalid_argument, "growth_tracker must be >= 0");
  GradScaler small(GradScalerOptions().growth_interval(5));
  small.load_state({8.0, 100});
  EXPECT_EQ(small.state().growth_tracker, 4) << "a tracker past the interval is capped";
}

// ---- the plain kernels against hand-computed values and the fused kernels ----------------------------

TEST(GradScalerKernels, PlainUnscaleMultipliesByFp32ReciprocalAndFlagsNonFinite) {
  auto g32 = torch::tensor({1024.0f, -3.0f, 0.5f});
  auto gbf = torch::tensor({1024.0f, 96.0f}).to(at::kBFloat16);
  auto found = torch::zeros({1});
  auto inv = torch::full({1}, 1.0f / 1024.0f);
  trainer::amp_unscale_plain_({g32, gbf}, found, inv);
  EXPECT_TRUE(torch::equal(g32, torch::tensor({1.0f, -3.0f / 1024.0f, 0.5f / 1024.0f})));
  EXPECT_TRUE(torch::equal(gbf, torch::tensor({1.0f, 0.09375f}).to(at::kBFloat16)));
  EXPECT_EQ(found.item<float>(), 0.0f);

  auto bad = torch::tensor({1.0f, std::numeric_limits<float>::infinity()});
  auto big = torch::full({4}, 3e38f);  // finite values whose sum overflows: not an inf
  auto found2 = torch::zeros({1});
  trainer::amp_unscale_plain_({big}, found2, torch::ones({1}));
  EXPECT_EQ(found2.item<float>(), 0.0f) << "large finite gradients are not inf";
  trainer::amp_unscale_plain_({bad}, found2, inv);
  EXPECT_EQ(found2.item<float>(), 1.0f);
}

TEST(GradScalerKernels, PlainUpdateFollowsTheFusedContract) {
  auto scale = torch::full({1}, 8.0f);
  auto tracker = torch::zeros({1}, torch::kInt);
  auto clean = torch::zeros({1}), inf = torch::ones({1});
  trainer::amp_update_scale_plain_(scale, tracker, clean, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 8.0f);
  EXPECT_EQ(tracker.item<int32_t>(), 1);
  trainer::amp_update_scale_plain_(scale, tracker, clean, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 16.0f);
  EXPECT_EQ(tracker.item<int32_t>(), 0);
  trainer::amp_update_scale_plain_(scale, tracker, clean, 2.0, 0.5, 2);
  trainer::amp_update_scale_plain_(scale, tracker, inf, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 8.0f);
  EXPECT_EQ(tracker.item<int32_t>(), 0);
}

// Runs the fused ATen kernels and the plain ones on the same inputs on `device`.
void compare_fused_with_plain(const c10::Device& device) {
  torch::manual_seed(10);
  auto opts = torch::TensorOptions().device(device);
  std::vector<torch::Tensor> a = {torch::randn({33}, opts) * 4096, torch::randn({5, 7}, opts) * 4096};
  std::vector<torch::Tensor> b = {a[0].clone(), a[1].clone()};
  auto inv = torch::full({1}, 1.0f / 4096.0f, opts);
  auto found_a = torch::zeros({1}, opts), found_b = torch::zeros({1}, opts);
  at::_amp_foreach_non_finite_check_and_unscale_(a, found_a, inv);
  trainer::amp_unscale_plain_(b, found_b, inv);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "grad " << i;
  EXPECT_TRUE(torch::equal(found_a, found_b));

  for (float f : {0.0f, 1.0f}) {
    for (int32_t t : {0, 2}) {
      auto sa = torch::full({1}, 1024.0f, opts), sb = sa.clone();
      auto ta = torch::full({1}, t, opts.dtype(torch::kInt)), tb = ta.clone();
      auto found = torch::full({1}, f, opts);
      at::_amp_update_scale_(sa, ta, found, 2.0, 0.5, 3);
      trainer::amp_update_scale_plain_(sb, tb, found, 2.0, 0.5, 3);
      EXPECT_TRUE(torch::equal(sa, sb)) << "found_inf " << f << " tracker " << t;
      EXPECT_TRUE(torch::equal(ta, tb)) << "found_inf " << f << " tracker " << t;
    }
  }
}

TEST(GradScalerKernels, FusedKernelsMatchPlainOnCpuWhereAvailable) {
  // LibTorch 1.13 has the fused kernels on CUDA only; newer releases have CPU kernels too.
  try {
    auto g = torch::ones({1});
    auto found = torch::zeros({1});
    at::_amp_foreach_non_finite_check_and_unscale_(g, found, torch::ones({1}));
  } catch (const c10::Error&) {
    GTEST_SKIP() << "no CPU kernel for _amp_foreach_non_finite_check_and_unscale_ in LibTorch "
                 << compat::torch_version();
  }
  compare_fused_with_plain(c10::Device(c10::DeviceType::CPU));
}

TEST(GradScalerKernels, FusedKernelsMatchPlainOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  compare_fused_with_plain(c10::Device(c10::DeviceType::CUDA, 0));
}

TEST(GradScaler, CudaStepWithPlantedInf) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(11);
  torch::nn::Linear lin(6, 3);
  lin->to(torch::kCUDA);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(GradScalerOptions().growth_interval(1));
  auto x = torch::randn({4, 6}, torch::kCUDA);
  const auto before = clone_all(lin->parameters());
  scaler.scale(lin(x).sum()).backward();
  {
    torch::NoGradGuard no_grad;
    lin->weight.grad().view(-1)[0].fill_(std::numeric_limits<float>::infinity());
  }
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], lin->parameters()[i]));
  opt.zero_grad();
  scaler.scale(lin(x).sum()).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

}  // namespace

}  // namespace test_amp
