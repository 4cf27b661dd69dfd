// Activation checkpointing: gradients, buffers and the RNG stream with checkpointing must equal those
// of the same computation done the plain way.
#include "models/activation_checkpoint.h"
#include "trainer/numerics/amp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_activation_checkpoint {

namespace {

// ---- blocks written for the tests -----------------------------------------------------------------

// ResNet basic block: conv-bn-relu-conv-bn + identity, relu.
struct BasicBlockImpl : torch::nn::Module {
  torch::nn::Conv2d conv1, conv2;
  torch::nn::BatchNorm2d bn1, bn2;
  explicit BasicBlockImpl(int64_t c)
      : conv1(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)),
        conv2(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)),
        bn1(c),
        bn2(c) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    return torch::relu(out + x);
  }
};
TORCH_MODULE(BasicBlock);

// Pre-norm Transformer layer (GPT-2 names): multi-head self-attention written with matmuls + softmax,
// dropout 0.1 on the attention weights and after each projection, GELU MLP.
struct TransformerLayerImpl : torch::nn::Module {
  int64_t n_head;
  double p_drop;
  torch::nn::LayerNorm ln_1, ln_2;
  torch::nn::Linear c_attn, attn_proj, c_fc, mlp_proj;
  TransformerLayerImpl(int64_t d, int64_t heads, double dropout = 0.1)
      : n_head(heads),
        p_drop(dropout),
        ln_1(torch::nn::LayerNormOptions({d})),
        ln_2(torch::nn::LayerNormOptions({d})),
        c_attn(d, 3 * d),
        attn_proj(d, d),
        c_fc(d, 4 * d),
        mlp_proj(4 * d, d) {
    register_module("ln_1", ln_1);
    register_module("c_attn", c_attn);
    register_module("attn_proj", attn_proj);
    register_module("ln_2", ln_2);
    register_module("c_fc", c_fc);
    register_module("mlp_proj", mlp_proj);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hs = C / n_head;
    auto qkv = c_attn(ln_1(x)).split(C, 2);                    // 3 x (B, T, C)
    auto q = qkv[0].view({B, T, n_head, hs}).transpose(1, 2);  // (B, nh, T, hs)
    auto k = qkv[1].view({B, T, n_head, hs}).transpose(1, 2);  // (B, nh, T, hs)
    auto v = qkv[2].view({B, T, n_head, hs}).transpose(1, 2);  // (B, nh, T, hs)
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hs));  // (B, nh, T, T)
    att = torch::dropout(torch::softmax(att, -1), p_drop, is_training());
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});  // (B, T, C)
    auto h = x + torch::dropout(attn_proj(y), p_drop, is_training());
    auto m = mlp_proj(torch::gelu(c_fc(ln_2(h))));
    return h + torch::dropout(m, p_drop, is_training());
  }
};
TORCH_MODULE(TransformerLayer);

// ---- running plain and checkpointed ---------------------------------------------------------------

// Everything a step leaves behind that checkpointing must not change.
struct StepResult {
  torch::Tensor output;
  torch::Tensor input_grad;
  std::vector<torch::Tensor> param_grads;
  std::vector<torch::Tensor> buffers;
  torch::Tensor rng_after;  // the next draws of the global CPU generator after backward
};

// Forward (under bf16 autocast if `autocast`), a weighted-sum loss so every output element gets its
// own gradient, backward (outside the autocast scope unless `backward_in_autocast`), then the state.
template <class Block>
StepResult run_step(Block& block, const torch::Tensor& x0, bool use_checkpoint, bool autocast = false,
                    bool backward_in_autocast = false, bool input_requires_grad = true) {
  torch::manual_seed(1234);  // same dropout masks for both runs
  auto x = x0.clone().requires_grad_(input_requires_grad);
  auto fn = [&](const torch::Tensor& t) { return block->forward(t); };
  torch::Tensor y, loss;
  {
    trainer::AutocastGuard guard(c10::DeviceType::CPU, at::kBFloat16, autocast);
    y = use_checkpoint ? models::checkpoint(*block, fn, x) : fn(x);
    auto weights = torch::linspace(-1.0, 1.0, y.numel(), x0.options()).view(y.sizes());
    loss = (y.to(at::kFloat) * weights).sum();
    if (backward_in_autocast) loss.backward();
  }
  if (!backward_in_autocast) loss.backward();
  StepResult r;
  r.output = y.detach().clone();
  if (input_requires_grad) r.input_grad = x.grad().clone();
  for (const auto& p : block->parameters()) {
    r.param_grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  for (const auto& b : block->buffers()) r.buffers.push_back(b.clone());
  r.rng_after = torch::rand({8}, x0.options());
  return r;
}

// Max |a - b| <= tol * max(1, max |b|): equal up to float rounding of the magnitudes involved.
::testing::AssertionResult all_close(const torch::Tensor& a, const torch::Tensor& b, double tol = 1e-6) {
  if (!a.defined() || !b.defined()) {
    if (a.defined() == b.defined()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "one tensor is undefined";
  }
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure() << "shape/dtype " << a.sizes() << " " << a.scalar_type() << " vs "
                                         << b.sizes() << " " << b.scalar_type();
  }
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  const double mag = std::max(1.0, b.to(at::kDouble).abs().max().item<double>());
  if (diff <= tol * mag) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs diff " << diff << " > " << tol * mag;
}

void expect_same_step(const StepResult& plain, const StepResult& ckpt, double tol = 1e-6) {
  EXPECT_TRUE(all_close(ckpt.output, plain.output, tol)) << "output";
  EXPECT_TRUE(all_close(ckpt.input_grad, plain.input_grad, tol)) << "input gradient";
  ASSERT_EQ(ckpt.param_grads.size(), plain.param_grads.size());
  for (size_t i = 0; i < plain.param_grads.size(); ++i) {
    ASSERT_TRUE(plain.param_grads[i].defined()) << "param " << i << " got no gradient without checkpointing";
    EXPECT_TRUE(all_close(ckpt.param_grads[i], plain.param_grads[i], tol)) << "param " << i;
  }
  ASSERT_EQ(ckpt.buffers.size(), plain.buffers.size());
  for (size_t i = 0; i < plain.buffers.size(); ++i) {
    EXPECT_TRUE(torch::equal(ckpt.buffers[i], plain.buffers[i])) << "buffer " << i;
  }
  EXPECT_TRUE(torch::equal(ckpt.rng_after, plain.rng_after)) << "global RNG state after backward";
}

void expect_num_batches_tracked(const torch::nn::Module& m, int64_t expected) {
  int found = 0;
  for (const auto& item : m.named_buffers()) {
    if (item.key().find("num_batches_tracked") == std::string::npos) continue;
    EXPECT_EQ(item.value().item<int64_t>(), expected) << item.key();
    ++found;
  }
  EXPECT_GT(found, 0) << "no BatchNorm counters found";
}

BasicBlock make_block() {
  torch::manual_seed(7);
  BasicBlock b(4);
  b->train();
  return b;
}

TransformerLayer make_layer(double dropout = 0.1) {
  torch::manual_seed(8);
  TransformerLayer l(32, 4, dropout);
  l->train();
  return l;
}

// ---- gradients --------------------------------------------------------------------------------------

TEST(ActivationCheckpoint, ResNetBasicBlockGradientsAndBatchNormStatsEqualPlain) {
  auto x = torch::randn({3, 4, 8, 8});
  auto plain_block = make_block(), ckpt_block = make_block();
  const auto plain = run_step(plain_block, x, false);
  const auto ckpt = run_step(ckpt_block, x, true);
  expect_same_step(plain, ckpt);
  // The plain step moved the running statistics once; checkpointing must not move them twice.
  EXPECT_FALSE(torch::equal(plain.buffers[0], torch::zeros_like(plain.buffers[0]))) << "running_mean moved";
  expect_num_batches_tracked(*ckpt_block, 1);
}

TEST(ActivationCheckpoint, TransformerLayerWithDropoutGradientsEqualPlain) {
  auto x = torch::randn({2, 16, 32});
  auto plain_layer = make_layer(), ckpt_layer = make_layer();
  const auto plain = run_step(plain_layer, x, false);
  const auto ckpt = run_step(ckpt_layer, x, true);
  expect_same_step(plain, ckpt);

  // Dropout really draws masks here, so a recomputation with another mask would have been seen.
  auto no_drop = make_layer(0.0);
  const auto without_dropout = run_step(no_drop, x, false);
  EXPECT_FALSE(all_close(plain.input_grad, without_dropout.input_grad, 1e-3)) << "dropout had no effect";
}

TEST(ActivationCheckpoint, ChainOfCheckpointedLayersEqualsPlainChain) {
  // Gradients flow from one checkpointed block into the previous one; the first block's input needs
  // no gradient (as for the output of an embedding of data), but its parameters do.
  struct Chain : torch::nn::Module {
    std::vector<TransformerLayer> layers;
    bool use_checkpoint = false;
    Chain() {
      torch::manual_seed(9);
      for (int i = 0; i < 3; ++i) layers.push_back(register_module("h" + std::to_string(i), TransformerLayer(32, 4)));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto h = x;
      for (auto& l : layers) {
        h = use_checkpoint ? models::checkpoint(*l, [&](const torch::Tensor& t) { return l->forward(t); }, h)
                           : l->forward(h);
      }
      return h;
    }
  };
  auto x = torch::randn({2, 8, 32});
  auto plain_chain = std::make_shared<Chain>();
  auto ckpt_chain = std::make_shared<Chain>();
  ckpt_chain->use_checkpoint = true;
  const auto plain = run_step(plain_chain, x, false, false, false, /*input_requires_grad=*/false);
  const auto ckpt = run_step(ckpt_chain, x, false, false, false, /*input_requires_grad=*/false);
  expect_same_step(plain, ckpt);
}

TEST(ActivationCheckpoint, InputWithoutGradStillGivesParameterGradients) {
  auto x = torch::randn({3, 4, 8, 8});
  auto plain_block = make_block(), ckpt_block = make_block();
  const auto plain = run_step(plain_block, x, false, false, false, /*input_requires_grad=*/false);
  const auto ckpt = run_step(ckpt_block, x, true, false, false, /*input_requires_grad=*/false);
  expect_same_step(plain, ckpt);
}

// ---- autocast ---------------------------------------------------------------------------------------

TEST(ActivationCheckpointAutocast, Bf16GradientsEqualPlainWhenBackwardRunsOutsideTheGuard) {
  auto x = torch::randn({2, 16, 32});
  auto plain_layer = make_layer(), ckpt_layer = make_layer();
  const auto plain = run_step(plain_layer, x, false, /*autocast=*/true);
  const auto ckpt = run_step(ckpt_layer, x, true, /*autocast=*/true);
  expect_same_step(plain, ckpt);

  // The bf16 gradients differ from fp32 ones by far more than the tolerance, so a recomputation in
  // fp32 (autocast state not restored) would have failed the comparison above.
  auto fp32_layer = make_layer();
  const auto fp32 = run_step(fp32_layer, x, false, /*autocast=*/false);
  EXPECT_FALSE(all_close(plain.param_grads[2], fp32.param_grads[2], 1e-4)) << "autocast had no effect";
}

TEST(ActivationCheckpointAutocast, Bf16GradientsEqualPlainWhenBackwardRunsInsideTheGuard) {
  // Inside the guard the autocast weight cache is live: the checkpoint must not leave a no-grad cast
  // of a weight in it, or the weight would lose its gradient.
  auto x = torch::randn({2, 16, 32});
  auto plain_layer = make_layer(), ckpt_layer = make_layer();
  const auto plain = run_step(plain_layer, x, false, true, /*backward_in_autocast=*/true);
  const auto ckpt = run_step(ckpt_layer, x, true, true, /*backward_in_autocast=*/true);
  expect_same_step(plain, ckpt);
}

TEST(ActivationCheckpointAutocast, ConvBlockBf16BackwardInsideTheGuardEqualsPlain) {
  // Convolutions pass their weight to autocast directly, so autocast caches its bf16 copy (the C++
  // Linear goes through weight.t(), a view, which is never cached). A copy cached by the no-grad
  // forward and reused by the recomputation would have no history: the weights would get no gradient.
  auto x = torch::randn({3, 4, 8, 8});
  auto plain_block = make_block(), ckpt_block = make_block();
  const auto plain = run_step(plain_block, x, false, true, /*backward_in_autocast=*/true);
  const auto ckpt = run_step(ckpt_block, x, true, true, /*backward_in_autocast=*/true);
  expect_same_step(plain, ckpt);
}

TEST(ActivationCheckpointAutocast, WeightUsedAgainOutsideTheCheckpointKeepsItsGradient) {
  // Tied weights: the same conv runs inside a checkpoint and then plainly, in one autocast scope. The
  // checkpoint's no-grad forward must not leave a history-less bf16 copy of the weight in the cache.
  auto x = torch::randn({2, 4, 8, 8});
  auto run = [&](bool use_checkpoint) {
    auto block = make_block();
    auto fn = [&](const torch::Tensor& t) { return block->forward(t); };
    torch::manual_seed(3);
    {
      trainer::AutocastGuard guard(c10::DeviceType::CPU, at::kBFloat16, true);
      auto h = use_checkpoint ? models::checkpoint(*block, fn, x) : fn(x);
      auto y = block->conv1(h);
      y.to(at::kFloat).pow(2).sum().backward();
    }
    return block->conv1->weight.grad();
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  ASSERT_TRUE(plain.defined());
  // Without checkpointing both uses share one cached bf16 copy, so their two gradients are summed in
  // bf16 before the cast back to fp32; with it they are summed in fp32. That differs by bf16 rounding
  // (2^-8 relative); a lost contribution would differ by far more.
  EXPECT_TRUE(all_close(ckpt, plain, 1e-2));
}

TEST(ActivationCheckpointAutocast, ResNetBlockBf16GradientsEqualPlain) {
  auto x = torch::randn({3, 4, 8, 8});
  auto plain_block = make_block(), ckpt_block = make_block();
  const auto plain = run_step(plain_block, x, false, true);
  const auto ckpt = run_step(ckpt_block, x, true, true);
  expect_same_step(plain, ckpt);
}

// ---- pass-through paths -------------------------------------------------------------------------------

TEST(ActivationCheckpoint, NoGradModeReturnsPlainOutputWithoutGraph) {
  auto layer = make_layer();
  auto x = torch::randn({2, 8, 32}, torch::requires_grad());
  auto fn = [&](const torch::Tensor& t) { return layer->forward(t); };
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  auto expected = fn(x);
  torch::manual_seed(5);
  auto got = models::checkpoint(*layer, fn, x);
  EXPECT_TRUE(torch::equal(got, expected));
  EXPECT_FALSE(got.requires_grad());
}

TEST(ActivationCheckpoint, FrozenBlockAndInputWithoutGradIsPlainCall) {
  auto block = make_block();
  for (auto& p : block->parameters()) p.requires_grad_(false);
  auto x = torch::randn({2, 4, 8, 8});
  auto y = models::checkpoint(*block, [&](const torch::Tensor& t) { return block->forward(t); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_FALSE(y.grad_fn());
  expect_num_batches_tracked(*block, 1);
}

// ---- what is kept between forward and backward ----------------------------------------------------

// An MLP block that records a weak reference to the storage of each intermediate activation, so the
// test can see which of them the autograd graph keeps alive after forward.
struct TracedMlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{64, 256}, fc2{256, 64};
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>* trace = nullptr;
  TracedMlpImpl() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc1(x);
    auto a = torch::gelu(h);
    if (trace) {
      trace->push_back(h.storage().getWeakStorageImpl());
      trace->push_back(a.storage().getWeakStorageImpl());
    }
    return x + fc2(a);
  }
};
TORCH_MODULE(TracedMlp);

// Number of traced intermediates whose storage is still alive after the forward of a chain of
// `n` blocks, and the chain's input gradient after backward.
std::pair<int, torch::Tensor> alive_after_forward(int n, bool use_checkpoint) {
  torch::manual_seed(12);
  std::vector<TracedMlp> blocks;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> trace;
  for (int i = 0; i < n; ++i) {
    blocks.emplace_back();
    blocks.back()->trace = &trace;
  }
  auto x = torch::randn({32, 64}, torch::requires_grad());
  auto h = x;
  for (auto& b : blocks) {
    h = use_checkpoint ? models::checkpoint(*b, [&](const torch::Tensor& t) { return b->forward(t); }, h)
                       : b->forward(h);
  }
  int alive = 0;
  for (const auto& w : trace) alive += w.expired() ? 0 : 1;
  for (auto& b : blocks) b->trace = nullptr;  // the recomputation in backward is not traced
  h.sum().backward();
  return {alive, x.grad().clone()};
}

TEST(ActivationCheckpointMemory, CheckpointedChainKeepsNoIntermediateActivations) {
  // Plain: each block's pre-activation h is kept for GELU's backward and its output a for fc2's weight
  // gradient, 2 per block. Checkpointed: only each block's input is kept, no intermediate.
  constexpr int kBlocks = 4;
  const auto [plain_alive, plain_grad] = alive_after_forward(kBlocks, false);
  const auto [ckpt_alive, ckpt_grad] = alive_after_forward(kBlocks, true);
  EXPECT_EQ(plain_alive, 2 * kBlocks);
  EXPECT_EQ(ckpt_alive, 0);
  EXPECT_TRUE(all_close(ckpt_grad, plain_grad));
}

// ---- CUDA (runs only where a GPU is present) ----------------------------------------------------------

TEST(ActivationCheckpointCuda, TransformerLayerWithDropoutGradientsEqualPlain) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto x = torch::randn({2, 16, 32}).to(torch::kCUDA);
  auto plain_layer = make_layer(), ckpt_layer = make_layer();
  plain_layer->to(torch::kCUDA);
  ckpt_layer->to(torch::kCUDA);
  // rng_after draws from the CUDA generator here (x0's options), so the CUDA stream is checked too.
  const auto plain = run_step(plain_layer, x, false);
  const auto ckpt = run_step(ckpt_layer, x, true);
  expect_same_step(plain, ckpt, 1e-5);
}

}  // namespace

}  // namespace test_activation_checkpoint
