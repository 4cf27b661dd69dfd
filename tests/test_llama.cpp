// The Llama family (models/llama.h): the attention backends against each other, the key-value cache against
// the full forward, grouped-query attention against multi-head attention with repeated weights, the rotary
// frequencies and RMSNorm against their formulas, activation checkpointing against none, transformers'
// parameter names, FLOPs by hand, the option checks and the registry entries; then, where the reference
// Python has transformers (the 2.11 leg), logits and greedy decoding against LlamaForCausalLM,
// Qwen2ForCausalLM and MistralForCausalLM on random weights (tests/ref/llama_ref.py).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models/llama.h"
#include "models/registry.h"
#include "test_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/numerics/generate.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_llama {

namespace {

using models::LlamaOptions;
using models::RopeScaling;
namespace fs = std::filesystem;

// 2 layers, 32 wide, 4 query heads over 2 key/value heads (head size 8), SwiGLU 48, vocabulary 61.
LlamaOptions small_options() {
  return LlamaOptions().vocab_size(61).context(32).n_layer(2).n_head(4).n_kv_head(2).n_embd(32).intermediate_size(48);
}

std::shared_ptr<models::LlamaImpl> make(const LlamaOptions& o, uint64_t seed = 5) {
  torch::manual_seed(seed);
  return std::make_shared<models::LlamaImpl>(o);
}

// max |a - b| / max |b|: the relative difference of two logit tensors.
double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() /
         b.to(torch::kDouble).abs().max().item<double>();
}

std::vector<models::AttentionBackend> backends() {
  std::vector<models::AttentionBackend> b = {models::AttentionBackend::plain};
  if (models::fused_attention_available()) b.push_back(models::AttentionBackend::fused);
  return b;
}

std::map<std::string, torch::Tensor> parameters_of(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

}  // namespace

// ---- the model against itself ----------------------------------------------------------------------------

// The automatic backend (fused where LibTorch has it, plain on 1.13) computes the plain backend's logits.
TEST(LlamaModel, PlainAndAutomaticBackendsGiveTheSameLogits) {
  auto model = make(small_options().qkv_bias(true));
  model->eval();
  torch::NoGradGuard ng;
  const auto x = torch::randint(61, {2, 24}, torch::kLong);
  model->set_attention_backend(models::AttentionBackend::plain);
  const auto plain = model->forward(x);  // (B, T, V)
  model->set_attention_backend(models::AttentionBackend::automatic);
  const auto automatic = model->forward(x);
  ASSERT_EQ(plain.sizes(), (std::vector<int64_t>{2, 24, 61}));
  EXPECT_LT(relative_difference(automatic, plain), 1e-5);
  // The causal mask: a changed last token changes no earlier position's logits.
  auto y = x.clone();
  y.index_put_({torch::indexing::Slice(), 23}, (x.index({torch::indexing::Slice(), 23}) + 1) % 61);
  const auto changed = model->forward(y);
  EXPECT_TRUE(torch::allclose(changed.narrow(1, 0, 23), automatic.narrow(1, 0, 23), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(changed.narrow(1, 23, 1), automatic.narrow(1, 23, 1), 1e-3, 1e-3));
}

// The prompt at once, then one token at a time, then three at a time (a mask offset by the cache), on a
// grouped-query model: each piece's logits are the full forward's, and the cache holds the 2 key/value heads.
TEST(LlamaModel, CachedPiecesEqualTheFullForward) {
  for (auto backend : backends()) {
    SCOPED_TRACE(models::to_string(backend));
    auto model = make(small_options().qkv_bias(true).rope_theta(500.0));
    model->eval();
    model->set_attention_backend(backend);
    torch::NoGradGuard ng;
    torch::manual_seed(6);
    const auto x = torch::randint(61, {2, 20}, torch::kLong);  // (B, T)
    const auto full = model->forward(x);                       // (B, T, V)
    auto cache = model->make_cache();
    EXPECT_EQ(cache.capacity(), 32);
    std::vector<int64_t> pieces = {7, 1, 1, 1, 1, 3, 3, 3};
    int64_t at = 0;
    for (int64_t n : pieces) {
      const auto logits = model->forward_cached(x.narrow(1, at, n), cache);  // (B, n, V)
      EXPECT_LT(relative_difference(logits, full.narrow(1, at, n)), 1e-5) << "positions " << at << ".." << at + n - 1;
      at += n;
      EXPECT_EQ(cache.length(), at);
    }
    ASSERT_EQ(cache.layers.size(), 2u);
    EXPECT_EQ(cache.layers[0].k.sizes(), (std::vector<int64_t>{2, 2, 32, 8}));  // (B, n_kv_head, context, hd)
    EXPECT_THROW(model->forward_cached(x.narrow(1, 0, 13), cache), c10::Error);  // 20 + 13 > context 32
    auto wrong = models::KVCache();
    EXPECT_THROW(model->forward_cached(x.narrow(1, 0, 1), wrong), c10::Error);   // not made by make_cache
  }
}

// Grouped-query attention with n_kv_head = n_head / 2 is multi-head attention whose key and value heads
// are the grouped ones repeated for each query head of their group (q/k/v biases included).
TEST(LlamaModel, GroupedQueryEqualsMultiHeadWithRepeatedKeyValueHeads) {
  const auto gqa_options = small_options().qkv_bias(true);
  auto gqa = make(gqa_options);
  auto mha = make(LlamaOptions(gqa_options).n_kv_head(4), 9);
  const int64_t rep = 2, hd = 8, C = 32;
  {
    torch::NoGradGuard ng;
    auto source = parameters_of(*gqa);
    for (auto& p : gqa->named_parameters()) {
      if (p.key().find("bias") != std::string::npos) p.value().normal_(0.0, 0.1);  // biases start at 0
    }
    for (auto& p : mha->named_parameters()) {
      const auto& from = source.at(p.key());
      const bool kv = p.key().find("k_proj") != std::string::npos || p.key().find("v_proj") != std::string::npos;
      if (!kv) {
        p.value().copy_(from);
      } else if (from.dim() == 2) {
        p.value().copy_(from.view({2, hd, C}).repeat_interleave(rep, 0).reshape({4 * hd, C}));  // (nh * hd, C)
      } else {
        p.value().copy_(from.view({2, hd}).repeat_interleave(rep, 0).reshape({4 * hd}));  // (nh * hd)
      }
    }
  }
  gqa->eval();
  mha->eval();
  gqa->set_attention_backend(models::AttentionBackend::plain);
  mha->set_attention_backend(models::AttentionBackend::plain);
  torch::NoGradGuard ng;
  const auto x = torch::randint(61, {2, 17}, torch::kLong);
  const auto want = mha->forward(x);
  EXPECT_LT(relative_difference(gqa->forward(x), want), 1e-6);
  EXPECT_NE(parameters_of(*gqa).at("model.layers.0.self_attn.k_proj.weight").size(0),
            parameters_of(*mha).at("model.layers.0.self_attn.k_proj.weight").size(0));
}

// Every block checkpointed: the same loss and the same gradients as none, with attention dropout on (the
// recomputation draws the same masks); the block check runs once per block each way.
TEST(LlamaModel, CheckpointingAllBlocksGivesTheSameLossAndGradients) {
  for (auto backend : backends()) {
    SCOPED_TRACE(models::to_string(backend));
    // The fused kernel's dropout draws differently from the plain one; on the plain backend it is on.
    const double dropout = backend == models::AttentionBackend::plain ? 0.1 : 0.0;
    auto run = [&](bool checkpointed, int* boundaries) {
      auto model = make(small_options().qkv_bias(true).dropout(dropout));
      model->train();
      model->set_attention_backend(backend);
      if (checkpointed) model->set_checkpointed_blocks({true, true});
      model->set_block_check([boundaries](int64_t, bool) { ++*boundaries; });
      torch::manual_seed(11);
      const auto x = torch::randint(61, {2, 16}, torch::kLong);
      const auto target = torch::randint(61, {2 * 16}, torch::kLong);
      auto loss = torch::nn::functional::cross_entropy(model->forward(x).reshape({-1, 61}), target);
      loss.backward();
      std::map<std::string, torch::Tensor> grads;
      for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().clone();
      return std::make_pair(loss.item<double>(), grads);
    };
    int plain_boundaries = 0, checkpointed_boundaries = 0;
    const auto [loss, grads] = run(false, &plain_boundaries);
    const auto [loss_ckpt, grads_ckpt] = run(true, &checkpointed_boundaries);
    EXPECT_DOUBLE_EQ(loss_ckpt, loss);
    ASSERT_EQ(grads.size(), grads_ckpt.size());
    for (const auto& [name, g] : grads) {
      ASSERT_TRUE(grads_ckpt.at(name).defined()) << name;
      EXPECT_TRUE(torch::allclose(grads_ckpt.at(name), g, 1e-5, 1e-7)) << name;
      EXPECT_GT(g.abs().max().item<double>(), 0.0) << name;
    }
    EXPECT_EQ(plain_boundaries, 4);  // 2 blocks, forward and backward
    EXPECT_EQ(checkpointed_boundaries, 4);
  }
}

// ---- against formulas and hand-computed numbers -----------------------------------------------------------

namespace {

// The rotary inverse frequencies in double: 1 / theta^(2i / hd), then Llama 3.1's scaling.
std::vector<double> reference_frequencies(const LlamaOptions& o, int* bands = nullptr) {
  const int64_t hd = o.head_size();
  const auto& s = o.rope_scaling();
  std::vector<double> out;
  for (int64_t i = 0; i < hd / 2; ++i) {
    double f = 1.0 / std::pow(o.rope_theta(), 2.0 * static_cast<double>(i) / static_cast<double>(hd));
    if (s.type() == "llama3") {
      const double wavelen = 2 * M_PI / f, old = static_cast<double>(s.original_context());
      int band = 0;
      if (wavelen > old / s.low_freq_factor()) {
        f /= s.factor();
        band = 1;
      } else if (wavelen >= old / s.high_freq_factor()) {
        const double smooth = (old / wavelen - s.low_freq_factor()) / (s.high_freq_factor() - s.low_freq_factor());
        f = (1 - smooth) * f / s.factor() + smooth * f;
        band = 2;
      }
      if (bands != nullptr) bands[band]++;
    }
    out.push_back(f);
  }
  return out;
}

}  // namespace

// Default frequencies for three head sizes and thetas; Llama 3.2-1B's llama3 scaling, whose 32 frequencies
// fall in all three bands (kept, divided by the factor, blended).
TEST(LlamaRope, InverseFrequenciesEqualTheFormula) {
  const std::vector<LlamaOptions> cases = {
      models::smollm2_135m(), models::qwen2_5_0_5b(), small_options().n_embd(48).head_dim(12), models::llama3_2_1b(),
      models::llama3_2_1b().rope_scaling(RopeScaling().type("llama3").factor(8.0).original_context(32))};
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE("case " + std::to_string(c));
    int bands[3] = {0, 0, 0};
    const auto want = reference_frequencies(cases[c], bands);
    const auto got = models::rope_inverse_frequencies(cases[c]);
    ASSERT_EQ(got.scalar_type(), torch::kFloat);
    ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[static_cast<int64_t>(i)].item<double>(), want[i], want[i] * 1e-5) << "frequency " << i;
    }
    if (cases[c].rope_scaling().type() == "llama3") {
      EXPECT_GT(bands[0], 0);
      EXPECT_GT(bands[1], 0);
      EXPECT_GT(bands[2], 0);
    }
  }
  // Llama 3.2-1B's by hand: the first is 1 (kept), the last 500000^(-62/64) / 32 (divided by the factor).
  const auto f = models::rope_inverse_frequencies(models::llama3_2_1b());
  EXPECT_FLOAT_EQ(f[0].item<float>(), 1.0f);
  EXPECT_NEAR(f[31].item<double>(), std::pow(500000.0, -62.0 / 64.0) / 32.0, 1e-12);
}

// RMSNorm: x / sqrt(mean(x^2) + eps) * weight, in float32; a bf16 input is normalized in float32, rounded
// back to bf16, then multiplied by the weight (transformers' order).
TEST(LlamaRmsNorm, EqualsThePlainFormulaInFloat32AndBf16) {
  models::RMSNorm norm(16, 1e-5);
  torch::manual_seed(3);
  {
    torch::NoGradGuard ng;
    norm->weight.uniform_(0.5, 1.5);
  }
  const auto x = torch::randn({3, 5, 16}) * 4;
  const auto xd = x.to(torch::kDouble);
  const auto want = xd / torch::sqrt(xd.pow(2).mean(-1, true) + 1e-5) * norm->weight.to(torch::kDouble);
  const auto got = norm->forward(x);
  EXPECT_EQ(got.scalar_type(), torch::kFloat);
  EXPECT_LT(relative_difference(got, want), 1e-6);

  // bf16 in: normalized in float32 (the formula in float32 here), rounded to bf16, then times the float32
  // weight; within bf16's rounding of the double formula.
  const auto xb = x.to(torch::kBFloat16);
  const auto xf = xb.to(torch::kFloat);
  const auto normed = (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(torch::kBFloat16);
  const auto got_b = norm->forward(xb);
  EXPECT_EQ(got_b.scalar_type(), torch::kFloat);  // a float32 weight times bf16: float32, as in transformers
  EXPECT_TRUE(torch::equal(got_b, norm->weight * normed.to(torch::kFloat)));
  const auto xbd = xb.to(torch::kDouble);
  EXPECT_LT(relative_difference(got_b, xbd / torch::sqrt(xbd.pow(2).mean(-1, true) + 1e-5) *
                                           norm->weight.to(torch::kDouble)),
            8e-3);
  {
    torch::NoGradGuard ng;
    norm->to(torch::kBFloat16);  // a model converted to bf16 keeps bf16
  }
  EXPECT_EQ(norm->forward(xb).scalar_type(), torch::kBFloat16);
}

// 2 blocks, C 8, 2 query heads over 1 key/value head, SwiGLU 12, V 10, T 5, default head size 4:
// per block 2*5*(8*8 + 2*8*4 + 8*8 + 3*8*12) = 4800 linear + 2*2*25*8 = 800 attention; output 2*5*8*10 = 800.
// With head_dim 6: 2*5*(8*12 + 2*8*6 + 12*8 + 288) = 5760 + 2*2*25*12 = 1200.
TEST(LlamaModel, ForwardFlopsByHand) {
  const auto o = LlamaOptions().vocab_size(10).context(8).n_layer(2).n_head(2).n_kv_head(1).n_embd(8).intermediate_size(12);
  EXPECT_DOUBLE_EQ(make(o)->forward_flops({5}), 2 * (4800.0 + 800.0) + 800.0);
  EXPECT_DOUBLE_EQ(make(LlamaOptions(o).head_dim(6))->forward_flops({5}), 2 * (5760.0 + 1200.0) + 800.0);
  EXPECT_DOUBLE_EQ(make(LlamaOptions(o).tie_embeddings(true))->forward_flops({5}), 2 * (4800.0 + 800.0) + 800.0);
  EXPECT_THROW(make(o)->forward_flops({9}), c10::Error);  // past the context
}

// ---- names, options and the registry -----------------------------------------------------------------------

// The names and shapes listed in llama.h (transformers' own); no buffers (the rotary tables are computed);
// lm_head only when untied; q/k/v biases only with qkv_bias.
TEST(LlamaModel, ParameterNamesAndShapesAreTransformers) {
  const auto o = small_options().head_dim(12);  // C 32, q width 48, k/v width 24, I 48, V 61
  for (bool tied : {false, true}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(tied ? "tied" : "untied") + (bias ? ", qkv_bias" : ""));
      auto model = make(LlamaOptions(o).tie_embeddings(tied).qkv_bias(bias));
      std::map<std::string, std::vector<int64_t>> want = {{"model.embed_tokens.weight", {61, 32}},
                                                          {"model.norm.weight", {32}}};
      if (!tied) want["lm_head.weight"] = {61, 32};
      for (int i = 0; i < 2; ++i) {
        const std::string l = "model.layers." + std::to_string(i) + ".";
        want[l + "input_layernorm.weight"] = {32};
        want[l + "self_attn.q_proj.weight"] = {48, 32};
        want[l + "self_attn.k_proj.weight"] = {24, 32};
        want[l + "self_attn.v_proj.weight"] = {24, 32};
        want[l + "self_attn.o_proj.weight"] = {32, 48};
        if (bias) {
          want[l + "self_attn.q_proj.bias"] = {48};
          want[l + "self_attn.k_proj.bias"] = {24};
          want[l + "self_attn.v_proj.bias"] = {24};
        }
        want[l + "post_attention_layernorm.weight"] = {32};
        want[l + "mlp.gate_proj.weight"] = {48, 32};
        want[l + "mlp.up_proj.weight"] = {48, 32};
        want[l + "mlp.down_proj.weight"] = {32, 48};
      }
      std::map<std::string, std::vector<int64_t>> got;
      for (const auto& p : model->named_parameters()) got[p.key()] = p.value().sizes().vec();
      EXPECT_EQ(got, want);
      EXPECT_TRUE(model->named_buffers().is_empty());
      EXPECT_EQ(static_cast<bool>(model->lm_head), !tied);
      // Initialization: N(0, 0.02) weights, zero biases, unit norms.
      const auto params = parameters_of(*model);
      EXPECT_NEAR(params.at("model.embed_tokens.weight").std().item<double>(), 0.02, 0.003);
      EXPECT_TRUE(torch::equal(params.at("model.norm.weight"), torch::ones({32})));
      if (bias) EXPECT_TRUE(torch::equal(params.at("model.layers.1.self_attn.k_proj.bias"), torch::zeros({24})));
    }
  }
}

// check() names the field that is wrong; the model's constructor checks too.
TEST(LlamaChecks, CheckNamesTheWrongField) {
  struct Case {
    LlamaOptions options;
    std::string field;
  };
  const auto o = small_options();
  const std::vector<Case> cases = {
      {LlamaOptions(o).n_kv_head(3), "n_head (4) must be a multiple of n_kv_head (3)"},
      {LlamaOptions(o).n_embd(12), "head_dim must be even"},  // 12 / 4 = 3
      {LlamaOptions(o).head_dim(5), "head_dim must be even"},
      {LlamaOptions(o).n_embd(30), "n_embd (30) must be a multiple of n_head (4)"},
      {LlamaOptions(o).rope_scaling(RopeScaling().type("yarn")), "rope_scaling.type must be \"default\" or \"llama3\""},
      {LlamaOptions(o).rope_scaling(RopeScaling().type("llama3").factor(0.5)), "rope_scaling.factor"},
      {LlamaOptions(o).rope_scaling(RopeScaling().type("llama3").high_freq_factor(1.0)), "rope_scaling.high_freq_factor"},
      {LlamaOptions(o).vocab_size(0), "vocab_size must be positive"},
      {LlamaOptions(o).intermediate_size(-1), "intermediate_size must be positive"},
      {LlamaOptions(o).rms_norm_eps(0), "rms_norm_eps must be positive"},
      {LlamaOptions(o).rope_theta(-1), "rope_theta must be positive"},
      {LlamaOptions(o).dropout(1.0), "dropout must be in [0, 1)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.field);
    EXPECT_THROW(models::check(c.options), c10::Error);
    const auto text = testutil::error_text([&] { models::check(c.options); });
    EXPECT_NE(text.find("Llama: " + c.field), std::string::npos) << text;
    EXPECT_NE(testutil::error_text([&] { models::LlamaImpl m(c.options); }).find(c.field), std::string::npos);
  }
  for (const auto& good : {models::llama_tiny(), models::smollm2_135m(), models::llama3_2_1b(), models::qwen2_5_0_5b(),
                           LlamaOptions()}) {
    EXPECT_NO_THROW(models::check(good));
  }
}

// `llama` takes its shape from ModelOptions::llama() only; the named ones take the size overrides; dropout
// reaches the attention; vocab_multiple is GPT's.
TEST(LlamaRegistry, EntriesOptionsAndErrors) {
  const auto names = models::model_names();
  const auto at = std::find(names.begin(), names.end(), "gpt_tiny");
  ASSERT_NE(at, names.end());
  EXPECT_EQ(std::vector<std::string>(at + 1, at + 6),
            (std::vector<std::string>{"llama", "llama_tiny", "smollm2_135m", "llama3_2_1b", "qwen2_5_0_5b"}));
  EXPECT_EQ(models::registered_vocab_size("llama"), 32000);
  EXPECT_EQ(models::registered_vocab_size("llama3_2_1b"), 128256);
  EXPECT_EQ(testutil::error_text([] { models::create_model("llama"); }),
            "model 'llama' takes its shape from a transformers config.json (model.init_from a folder with "
            "config.json, or model.hf_config)");
  EXPECT_THROW(models::create_model("llama"), std::invalid_argument);
  auto from_config = models::create_model("llama", models::ModelOptions().llama(small_options()).dropout(0.1).n_layer(7));
  auto* llama = dynamic_cast<models::LlamaImpl*>(from_config.get());
  ASSERT_NE(llama, nullptr);
  EXPECT_EQ(llama->options.n_layer(), 2);  // the config's, whole
  EXPECT_DOUBLE_EQ(llama->options.dropout(), 0.1);
  EXPECT_DOUBLE_EQ(llama->block(1)->self_attn->options.dropout(), 0.1);
  EXPECT_NE(dynamic_cast<models::LanguageModelImpl*>(from_config.get()), nullptr);

  auto tiny = models::create_model(
      "llama_tiny", models::ModelOptions().n_layer(1).n_kv_head(1).intermediate_size(64).vocab_size(40).context(16));
  auto* t = dynamic_cast<models::LlamaImpl*>(tiny.get());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->options.n_layer(), 1);
  EXPECT_EQ(t->options.kv_heads(), 1);
  EXPECT_EQ(t->options.intermediate_size(), 64);
  EXPECT_EQ(t->vocab_size(), 40);
  EXPECT_EQ(t->context(), 16);
  EXPECT_EQ(t->options.n_embd(), 128);  // llama_tiny's
  EXPECT_TRUE(t->options.tie_embeddings());

  const auto text = testutil::error_text([] { models::create_model("llama_tiny", models::ModelOptions().vocab_multiple(64)); });
  EXPECT_NE(text.find("model.vocab_multiple is for gpt models"), std::string::npos) << text;
}

// ---- against transformers ------------------------------------------------------------------------------

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/llama_ref.py"; }

// "" when the reference Python imports safetensors and transformers, else the first one it lacks.
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_TRANSFORMERS()                                                                           \
  if (!missing_module().empty())                                                                              \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()     \
               << " (scripts/install-torch.sh installs safetensors and transformers into the 2.11 venv)"

// The shapes llama_ref.py's CONFIGS gives transformers, from the same numbers.
std::map<std::string, LlamaOptions> reference_options() {
  const auto base = LlamaOptions().context(64).n_layer(2).rms_norm_eps(1e-5).rope_theta(10000.0);
  return {
      {"llama_gqa", LlamaOptions(base).vocab_size(96).n_embd(64).intermediate_size(96).n_head(8).n_kv_head(2)},
      {"llama3_scaled", LlamaOptions(base).vocab_size(80).n_embd(48).intermediate_size(64).n_head(4).n_kv_head(2)
                            .tie_embeddings(true)
                            .rope_scaling(RopeScaling().type("llama3").factor(8.0).low_freq_factor(1.0)
                                              .high_freq_factor(4.0).original_context(32))},
      {"qwen2_bias", LlamaOptions(base).vocab_size(72).n_embd(32).intermediate_size(80).n_head(4).n_kv_head(2)
                         .rms_norm_eps(1e-6).rope_theta(1000000.0).tie_embeddings(true).qkv_bias(true)},
      {"mistral_head_dim", LlamaOptions(base).vocab_size(64).n_embd(32).intermediate_size(48).n_head(4).n_kv_head(1)
                               .head_dim(16)},
  };
}

// Each config.json field the options stand for equals what the options say (the two tables stay in step).
void expect_config_matches(const fs::path& config_json, const LlamaOptions& o) {
  const auto j = nlohmann::json::parse(testutil::read_file(config_json));
  EXPECT_EQ(j.at("vocab_size").get<int64_t>(), o.vocab_size());
  EXPECT_EQ(j.at("max_position_embeddings").get<int64_t>(), o.context());
  EXPECT_EQ(j.at("num_hidden_layers").get<int64_t>(), o.n_layer());
  EXPECT_EQ(j.at("num_attention_heads").get<int64_t>(), o.n_head());
  EXPECT_EQ(j.at("num_key_value_heads").get<int64_t>(), o.kv_heads());
  EXPECT_EQ(j.at("hidden_size").get<int64_t>(), o.n_embd());
  // Qwen2's config.json has no head_dim (hidden_size / num_attention_heads).
  EXPECT_EQ(j.value("head_dim", j.at("hidden_size").get<int64_t>() / j.at("num_attention_heads").get<int64_t>()),
            o.head_size());
  EXPECT_EQ(j.at("intermediate_size").get<int64_t>(), o.intermediate_size());
  EXPECT_DOUBLE_EQ(j.at("rms_norm_eps").get<double>(), o.rms_norm_eps());
  EXPECT_EQ(j.at("tie_word_embeddings").get<bool>(), o.tie_embeddings());
  const auto& rope = j.at("rope_parameters");
  EXPECT_DOUBLE_EQ(rope.at("rope_theta").get<double>(), o.rope_theta());
  EXPECT_EQ(rope.at("rope_type").get<std::string>(), o.rope_scaling().type());
  if (o.rope_scaling().type() == "llama3") {
    EXPECT_DOUBLE_EQ(rope.at("factor").get<double>(), o.rope_scaling().factor());
    EXPECT_DOUBLE_EQ(rope.at("low_freq_factor").get<double>(), o.rope_scaling().low_freq_factor());
    EXPECT_DOUBLE_EQ(rope.at("high_freq_factor").get<double>(), o.rope_scaling().high_freq_factor());
    EXPECT_EQ(rope.at("original_max_position_embeddings").get<int64_t>(), o.rope_scaling().original_context());
  }
}

// The model of `name` with transformers' weights, loaded by name: every parameter from the file and every
// tensor of the file used (a tied model's file has no lm_head.weight, and neither has the model).
std::shared_ptr<models::LlamaImpl> load_reference(const fs::path& dir, const LlamaOptions& o) {
  auto model = make(o);
  auto file = trainer::read_safetensors((dir / "model.safetensors").string());
  std::set<std::string> unused;
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& [name, t] : file.tensors) {
    tensors[name] = t;
    unused.insert(name);
  }
  torch::NoGradGuard ng;
  for (auto& p : model->named_parameters()) {
    auto it = tensors.find(p.key());
    if (it == tensors.end()) {
      ADD_FAILURE() << p.key() << " is not in " << dir / "model.safetensors";
      continue;
    }
    EXPECT_EQ(it->second.sizes(), p.value().sizes()) << p.key();
    p.value().copy_(it->second);
    unused.erase(p.key());
  }
  EXPECT_TRUE(unused.empty()) << "tensors of the file the model has no parameter for: " << *unused.begin();
  model->eval();
  return model;
}

std::map<std::string, torch::Tensor> expected_of(const fs::path& dir) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : trainer::read_safetensors((dir / "expected.safetensors").string()).tensors) out[name] = t;
  return out;
}

// Greedy decoding (argmax, the lowest id among equal logits, as torch.argmax and transformers): `n` new
// tokens after `prompt`, each from the whole sequence again or from the key-value cache.
std::vector<int64_t> greedy(models::LanguageModelImpl& model, const std::vector<int64_t>& prompt, int64_t n,
                            bool use_cache) {
  torch::NoGradGuard ng;
  std::vector<int64_t> seq = prompt, out;
  auto cache = model.make_cache();
  auto logits = use_cache ? model.forward_cached(torch::tensor(prompt).view({1, -1}), cache) : torch::Tensor();
  for (int64_t i = 0; i < n; ++i) {
    if (!use_cache) logits = model.forward(torch::tensor(seq).view({1, -1}));  // (1, T, V)
    const int64_t next = logits[0][-1].argmax().item<int64_t>();
    seq.push_back(next);
    out.push_back(next);
    if (use_cache && i + 1 < n) logits = model.forward_cached(torch::tensor({next}).view({1, 1}), cache);
  }
  return out;
}

std::vector<int64_t> ids(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

// One run of llama_ref.py writes every configuration's folder (transformers' import is most of its time).
class LlamaLibraries : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!missing_module().empty()) return;
    dir_ = new testutil::TempDir("trainer_llama");
    const auto r = testutil::run(testutil::python() + " " + ref_script() + " write " + dir_->str());
    ok_ = r.exit_code == 0;
    output_ = r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static testutil::TempDir* dir_;
  static bool ok_;
  static std::string output_;
};
testutil::TempDir* LlamaLibraries::dir_ = nullptr;
bool LlamaLibraries::ok_ = false;
std::string LlamaLibraries::output_;

// fp32 logits of 2 x 40 tokens equal transformers' to 1e-5 (max abs difference over max abs), on every
// backend this LibTorch has; the measured figure is printed.
TEST_F(LlamaLibraries, LogitsEqualTransformers) {
  SKIP_WITHOUT_TRANSFORMERS();
  ASSERT_TRUE(ok_) << output_;
  for (const auto& [name, o] : reference_options()) {
    SCOPED_TRACE(name);
    const auto dir = dir_->path / name;
    expect_config_matches(dir / "config.json", o);
    auto model = load_reference(dir, o);
    const auto expected = expected_of(dir);
    torch::NoGradGuard ng;
    for (auto backend : backends()) {
      model->set_attention_backend(backend);
      const auto logits = model->forward(expected.at("tokens"));
      ASSERT_EQ(logits.sizes(), expected.at("logits").sizes());
      const double rel = relative_difference(logits, expected.at("logits"));
      std::cout << "[ llama ] " << name << " (" << models::to_string(backend)
                << "): max |ours - transformers| / max |transformers| = " << rel << "\n";
      EXPECT_LT(rel, 1e-5) << models::to_string(backend);
    }
  }
}

// Greedy decoding equals transformers' generate(do_sample=False, max_new_tokens=20), with the cache and
// without, token for token, by a loop over forward / forward_cached and by trainer::generate at temperature
// 0 (llama3_scaled's 36 positions run past its original context of 32).
TEST_F(LlamaLibraries, GreedyEqualsTransformersGenerate) {
  SKIP_WITHOUT_TRANSFORMERS();
  ASSERT_TRUE(ok_) << output_;
  // 320 forward calls of a tiny model: a second intra-op thread only adds its wake-ups, which on a loaded
  // machine took LibTorch 2.11 from 0.2 s to 45 s here. One thread while this test runs.
  struct OneThread {
    int before = torch::get_num_threads();
    OneThread() { torch::set_num_threads(1); }
    ~OneThread() { torch::set_num_threads(before); }
  } one_thread;
  for (const auto& [name, o] : reference_options()) {
    SCOPED_TRACE(name);
    const auto dir = dir_->path / name;
    auto model = load_reference(dir, o);
    const auto expected = expected_of(dir);
    EXPECT_GT(expected.at("gap").item<double>(), 1e-3) << "near-tie in the reference's greedy path";
    const auto want = ids(expected.at("generated"));
    ASSERT_EQ(want.size(), 20u);
    const auto prompt = ids(expected.at("prompt"));
    for (bool use_cache : {true, false}) {
      SCOPED_TRACE(use_cache ? "cache" : "no cache");
      EXPECT_EQ(greedy(*model, prompt, 20, use_cache), want);  // the model's own calls
      trainer::GenerateOptions g;                                // what `trainer sample` runs
      g.max_new_tokens = 20;
      g.temperature = 0;
      g.kv_cache = use_cache;
      const auto made = trainer::generate(*model, prompt, 1, g);
      ASSERT_EQ(made.samples.size(), 1u);
      EXPECT_EQ(made.samples[0], want);
    }
  }
}

}  // namespace test_llama
