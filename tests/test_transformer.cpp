// Tests of the Transformers (models/attention.h, models/gpt.h, models/vit.h): GPT-2's parameter names,
// shapes and count and the FLOPs convention against tests/ref/gpt_ref.py (plain PyTorch); eval-mode
// logits equal PyTorch's with the same weights; causality; the fused and plain attention paths (or, on
// LibTorch 1.13, the plain path against explicit loops); gradients; the ViT; the registry options; and a
// short learning run of the tiny GPT on the fortunes text.
#include "data/files/idx.h"
#include "data/files/image_h5.h"
#include "data/samples/loader.h"
#include "data/files/token_h5.h"
#include "models/attention.h"
#include "models/gpt.h"
#include "models/registry.h"
#include "models/summary.h"
#include "models/vit.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_transformer {

namespace {

using models::AttentionBackend;
using models::ModelOptions;

std::string ref_script() { return testutil::source_dir() + "/tests/ref/gpt_ref.py"; }

std::map<std::string, torch::Tensor> load_tensor_dict(const torch::IValue& v) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : v.toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

torch::IValue load_pickle(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes);
}

std::shared_ptr<models::GPTImpl> tiny_gpt(const ModelOptions& o = ModelOptions()) {
  return std::dynamic_pointer_cast<models::GPTImpl>(models::create_model("gpt_tiny", o));
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Attention written as loops over scalars in double: the definition, with nothing shared with either
// backend. q (B, nh, T, hs), k, v (B, nh, S, hs) -> (B, nh, T, hs); the queries are the last T of the S
// positions (S > T: a cache's new positions).
torch::Tensor loop_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal) {
  auto qa = q.to(torch::kDouble).contiguous(), ka = k.to(torch::kDouble).contiguous(), va = v.to(torch::kDouble).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
  auto out = torch::zeros({B, H, T, D}, torch::kDouble);
  auto Q = qa.accessor<double, 4>(), K = ka.accessor<double, 4>(), V = va.accessor<double, 4>();
  auto O = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t last = causal ? S - T + t : S - 1;
        std::vector<double> s(last + 1);
        double m = -1e300, z = 0;
        for (int64_t u = 0; u <= last; ++u) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += Q[b][h][t][d] * K[b][h][u][d];
          s[u] = dot / std::sqrt(static_cast<double>(D));
          m = std::max(m, s[u]);
        }
        for (auto& x : s) z += (x = std::exp(x - m));
        for (int64_t u = 0; u <= last; ++u)
          for (int64_t d = 0; d < D; ++d) O[b][h][t][d] += s[u] / z * V[b][h][u][d];
      }
  return out.to(torch::kFloat);
}

// ---------------------------------------------------------------------------------------------------------
// GPT against the Python reference.

TEST(TransformerGPT, NamesShapesCountsAndFlopsMatchPython) {
  testutil::TempDir dir("gpt_ref");
  const auto json_path = dir / "gpt.json";
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " --json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = nlohmann::json::parse(testutil::read_file(json_path));

  for (const std::string name : {"gpt_tiny", "gpt2"}) {
    SCOPED_TRACE(name);
    auto model = std::dynamic_pointer_cast<models::GPTImpl>(models::create_model(name));
    ASSERT_TRUE(model);
    const auto& py = ref.at(name);
    // PyTorch lists the tied output projection twice (transformer.wte.weight and lm_head.weight); here it
    // is one parameter, so lm_head.weight is the only key Python has that C++ does not.
    std::map<std::string, std::vector<int64_t>> expected = py.at("state").get<std::map<std::string, std::vector<int64_t>>>();
    ASSERT_EQ(expected.count("lm_head.weight"), 1u);
    EXPECT_EQ(expected.at("lm_head.weight"), expected.at("transformer.wte.weight"));
    expected.erase("lm_head.weight");
    std::map<std::string, std::vector<int64_t>> actual;
    for (const auto& p : model->named_parameters()) actual[p.key()] = p.value().sizes().vec();
    for (const auto& b : model->named_buffers()) actual[b.key()] = b.value().sizes().vec();
    EXPECT_EQ(actual, expected);

    EXPECT_EQ(models::count_parameters(*model), py.at("num_parameters").get<int64_t>());
    const int64_t T = model->options.context();
    EXPECT_EQ(model->forward_flops({T}), 2.0 * py.at("macs").at(std::to_string(T)).get<double>());
    EXPECT_EQ(model->num_blocks(), model->options.n_layer());
  }
  // GPT-2 small, as published (124M with the tied embedding counted once and wpe included).
  EXPECT_EQ(ref.at("gpt2").at("num_parameters").get<int64_t>(), 124439808);
}

TEST(TransformerGPT, EvalLogitsMatchPythonWithTheSameWeights) {
  testutil::TempDir dir("gpt_weights");
  const auto pt = (dir / "gpt_tiny.pt").string();
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " --weights " + pt);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto file = load_pickle(pt).toGenericDict();
  const auto top = load_tensor_dict(file.at("state"));
  const auto x = file.at("x").toTensor(), expected = file.at("logits").toTensor();

  auto model = tiny_gpt();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      ASSERT_EQ(top.count(p.key()), 1u) << p.key() << " missing from the Python state";
      p.value().copy_(top.at(p.key()));
    }
  }
  EXPECT_TRUE(torch::equal(top.at("lm_head.weight"), top.at("transformer.wte.weight")));
  model->eval();
  torch::NoGradGuard no_grad;
  model->set_attention_backend(AttentionBackend::plain);
  const auto plain = model->forward(x);
  ASSERT_EQ(plain.sizes(), expected.sizes());
  EXPECT_TRUE(torch::allclose(plain, expected, 1e-5, 1e-5)) << "max |diff| " << max_abs_diff(plain, expected)
                                                            << " at logit scale " << expected.abs().max().item<double>();
  if (models::fused_attention_available()) {
    model->set_attention_backend(AttentionBackend::fused);
    const auto fused = model->forward(x);
    EXPECT_TRUE(torch::allclose(fused, expected, 1e-5, 1e-5)) << "fused: max |diff| " << max_abs_diff(fused, expected);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Attention paths.

TEST(TransformerAttention, PlainMatchesExplicitLoops) {
  torch::manual_seed(3);
  auto q = torch::randn({2, 3, 7, 5}), k = torch::randn({2, 3, 7, 5}), v = torch::randn({2, 3, 7, 5});
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const auto got = models::scaled_dot_product_attention(q, k, v, causal, 0.0, AttentionBackend::plain);
    const auto want = loop_attention(q, k, v, causal);
    EXPECT_LT(max_abs_diff(got, want), 1e-5);
  }
  // By hand: one head, T = 2, hs = 1, q = k = (1, 1), v = (0, 1). Causal: row 0 sees only itself -> 0;
  // row 1 weighs both keys equally (scores 1, 1) -> 0.5.
  auto one = torch::ones({1, 1, 2, 1}), vals = torch::tensor({0.0f, 1.0f}).view({1, 1, 2, 1});  // (B, nh, T, hs)
  const auto y = models::scaled_dot_product_attention(one, one, vals, true, 0.0, AttentionBackend::plain);
  EXPECT_FLOAT_EQ(y[0][0][0][0].item<float>(), 0.0f);
  EXPECT_FLOAT_EQ(y[0][0][1][0].item<float>(), 0.5f);
}

TEST(TransformerAttention, GroupedKeysAndValuesEqualTheRepeatedOnesOnEveryBackend) {
  // 6 query heads over 2 key/value heads (query head h reads kv head h / 3): every backend, with the
  // training shape (T = S), a cache's new positions (T < S) and one query, against the plain attention of
  // the repeated heads. The fused kernel reads the groups itself where LibTorch has enable_gqa (2.5+).
  torch::manual_seed(6);
  auto k = torch::randn({2, 2, 11, 8}), v = torch::randn({2, 2, 11, 8});
  const auto rk = models::repeat_kv(k, 3), rv = models::repeat_kv(v, 3);  // (2, 6, 11, 8)
  ASSERT_EQ(rk.sizes(), torch::IntArrayRef({2, 6, 11, 8}));
  EXPECT_TRUE(torch::equal(rk.select(1, 4), k.select(1, 1)));
  std::vector<AttentionBackend> backends = {AttentionBackend::plain, AttentionBackend::automatic};
  if (models::fused_attention_available()) backends.push_back(AttentionBackend::fused);
  for (int64_t T : {11, 4, 1}) {
    auto q = torch::randn({2, 6, T, 8});
    const auto want = loop_attention(q, rk, rv, /*causal=*/true);
    for (auto backend : backends) {
      SCOPED_TRACE("T = " + std::to_string(T) + ", " + models::to_string(backend));
      const auto got = models::scaled_dot_product_attention(q, k, v, /*causal=*/true, 0.0, backend);
      EXPECT_LT(max_abs_diff(got, want), 1e-5);
    }
  }
  EXPECT_THROW(models::scaled_dot_product_attention(torch::randn({2, 6, 11, 8}), torch::randn({2, 4, 11, 8}),
                                                    torch::randn({2, 4, 11, 8}), true, 0.0, AttentionBackend::plain),
               c10::Error);
}

TEST(TransformerAttention, FusedAgreesWithPlainWherePresent) {
  torch::manual_seed(4);
  auto q = torch::randn({2, 4, 17, 8}), k = torch::randn({2, 4, 17, 8}), v = torch::randn({2, 4, 17, 8});
  if (!models::fused_attention_available()) {
    // LibTorch 1.13: only the plain path exists. It is checked against explicit loops here and against
    // PyTorch (tests/ref/gpt_ref.py) in TransformerGPT.EvalLogitsMatchPythonWithTheSameWeights.
    std::cout << "[   NOTE   ] this LibTorch has no fused attention: checking the plain path against explicit loops "
                 "instead of the fused kernel\n";
    RecordProperty("fused_attention", "absent: plain path checked against explicit loops");
    for (bool causal : {true, false}) {
      const auto plain = models::scaled_dot_product_attention(q, k, v, causal, 0.0, AttentionBackend::plain);
      EXPECT_LT(max_abs_diff(plain, loop_attention(q, k, v, causal)), 1e-5);
      // automatic falls back to plain, bit for bit.
      EXPECT_TRUE(torch::equal(plain, models::scaled_dot_product_attention(q, k, v, causal, 0.0, AttentionBackend::automatic)));
    }
    return;
  }
  RecordProperty("fused_attention", "present: fused checked against plain");
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const auto plain = models::scaled_dot_product_attention(q, k, v, causal, 0.0, AttentionBackend::plain);
    const auto fused = models::scaled_dot_product_attention(q, k, v, causal, 0.0, AttentionBackend::fused);
    EXPECT_LT(max_abs_diff(plain, fused), 1e-5);
  }
  // The same through a whole model, gradients included.
  torch::manual_seed(5);
  auto model = tiny_gpt();
  auto x = torch::randint(256, {2, 40}, torch::kLong);
  std::vector<torch::Tensor> grads[2];
  torch::Tensor logits[2];
  for (int i = 0; i < 2; ++i) {
    model->zero_grad();
    model->set_attention_backend(i == 0 ? AttentionBackend::plain : AttentionBackend::fused);
    logits[i] = model->forward(x);
    logits[i].square().mean().backward();
    for (auto& p : model->parameters()) grads[i].push_back(p.grad().clone());
  }
  EXPECT_LT(max_abs_diff(logits[0], logits[1]), 1e-4);
  for (size_t j = 0; j < grads[0].size(); ++j) EXPECT_TRUE(torch::allclose(grads[0][j], grads[1][j], 1e-3, 1e-5)) << j;
}

TEST(TransformerAttention, FusedBackendErrorWhereAbsent) {
  if (models::fused_attention_available()) GTEST_SKIP() << "this LibTorch has fused attention";
  auto q = torch::randn({1, 1, 2, 4});
  try {
    models::scaled_dot_product_attention(q, q, q, true, 0.0, AttentionBackend::fused);
    FAIL() << "the fused backend ran without a fused kernel";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fused attention needs LibTorch 2.0 or later, this is 1."), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("; use the plain attention backend"), std::string::npos) << e.what();
  }
  EXPECT_EQ(models::to_string(AttentionBackend::plain), "plain");
}

// ---------------------------------------------------------------------------------------------------------
// GPT behaviour.

TEST(TransformerGPT, ChangingAFutureTokenNeverChangesEarlierLogits) {
  torch::manual_seed(6);
  auto model = tiny_gpt();
  model->eval();
  torch::NoGradGuard no_grad;
  std::vector<AttentionBackend> backends = {AttentionBackend::plain};
  if (models::fused_attention_available()) backends.push_back(AttentionBackend::fused);
  for (auto backend : backends) {
    SCOPED_TRACE(models::to_string(backend));
    model->set_attention_backend(backend);
    auto x = torch::randint(256, {2, 50}, torch::kLong);
    for (int64_t t0 : {0, 1, 25, 49}) {
      auto x2 = x.clone();
      x2.index_put_({torch::indexing::Slice(), t0}, (x.index({torch::indexing::Slice(), t0}) + 1) % 256);
      const auto a = model->forward(x), b = model->forward(x2);
      if (t0 > 0) {
        EXPECT_LT(max_abs_diff(a.slice(1, 0, t0), b.slice(1, 0, t0)), 1e-6) << "t0 " << t0;
      }
      // The changed position and the later ones do see it (so the check above can fail).
      EXPECT_GT(max_abs_diff(a.slice(1, t0), b.slice(1, t0)), 1e-4) << "t0 " << t0;
    }
  }
}

TEST(TransformerGPT, EveryParameterGetsAFiniteGradientUnderTheStepsLoss) {
  torch::manual_seed(7);
  auto model = tiny_gpt(ModelOptions().dropout(0.1));
  model->train();
  auto x = torch::randint(256, {3, 33}, torch::kLong), y = torch::randint(256, {3, 33}, torch::kLong);
  const auto logits = model->forward(x);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{3, 33, 256}));
  // The trainer's convention: summed cross-entropy over the micro-batch / target tokens in the whole step.
  const auto loss = torch::nn::functional::cross_entropy(
                        logits.reshape({-1, 256}), y.reshape({-1}),
                        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                    static_cast<double>(y.numel());
  EXPECT_NEAR(loss.item<double>(), std::log(256.0), 0.2);  // near-uniform predictions at initialization
  loss.backward();
  int64_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto& g = p.value().grad();
    ASSERT_TRUE(g.defined()) << "no gradient for " << p.key();
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << "non-finite gradient in " << p.key();
    EXPECT_GT(g.abs().max().item<double>(), 0.0) << "all-zero gradient in " << p.key();
    ++checked;
  }
  EXPECT_EQ(checked, 2 + 4 * 12 + 2);  // wte, wpe, 12 tensors per block, ln_f
  model->set_checkpointed_blocks(std::vector<bool>(4, true));
  EXPECT_THROW(model->set_checkpointed_blocks(std::vector<bool>(5)), c10::Error);
}

TEST(TransformerGPT, DropoutActsInTrainingOnly) {
  torch::manual_seed(8);
  auto model = tiny_gpt(ModelOptions().dropout(0.1));
  auto x = torch::randint(256, {2, 20}, torch::kLong);
  torch::NoGradGuard no_grad;
  model->train();
  EXPECT_GT(max_abs_diff(model->forward(x), model->forward(x)), 1e-4);
  model->eval();
  EXPECT_TRUE(torch::equal(model->forward(x), model->forward(x)));
}

TEST(TransformerGPT, InitializationIsGpt2s) {
  torch::manual_seed(9);
  auto model = models::create_model("gpt_tiny", ModelOptions().n_layer(8).n_embd(256));
  const double proj = 0.02 / std::sqrt(2.0 * 8);
  for (const auto& p : model->named_parameters()) {
    const auto& k = p.key();
    const auto& v = p.value();
    const bool is_bias = k.size() > 5 && k.compare(k.size() - 5, 5, ".bias") == 0;
    if (k.find("ln_") != std::string::npos) {
      EXPECT_TRUE(torch::equal(v, is_bias ? torch::zeros_like(v) : torch::ones_like(v))) << k;
    } else if (is_bias) {
      EXPECT_TRUE(torch::equal(v, torch::zeros_like(v))) << k;
    } else {
      const double want = k.find("c_proj.weight") != std::string::npos ? proj : 0.02;
      EXPECT_NEAR(v.std().item<double>(), want, 0.05 * want) << k;
      EXPECT_NEAR(v.mean().item<double>(), 0.0, 0.1 * want) << k;
    }
  }
}

TEST(TransformerGPT, FlopsByHandAndShapeErrors) {
  auto model = tiny_gpt();
  // Per token: 24 n_layer C^2 (c_attn 3, attn.c_proj 1, c_fc 4, mlp.c_proj 4: 12 C^2 MACs) + 2 C V, plus
  // 4 n_layer T C for q k^T and att v.
  const double L = 4, C = 128, V = 256, T = 100;
  EXPECT_EQ(model->forward_flops({100}), T * (24 * L * C * C + 2 * C * V) + 4 * L * T * T * C);
  try {
    model->forward(torch::zeros({1, 129}, torch::kLong));
    FAIL() << "a sequence longer than the context ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPT: sequence length 129 is outside [1, context = 128]"), std::string::npos)
        << e.what();
  }
  try {
    model->forward(torch::zeros({1, 10}));
    FAIL() << "float tokens ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPT: expected int64 tokens of shape (B, T), got Float [1, 10]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(model->forward_flops({129}), c10::Error);
  EXPECT_THROW(models::create_model("gpt_tiny", ModelOptions().n_head(3)), c10::Error);
}

// ---------------------------------------------------------------------------------------------------------
// ViT.

TEST(TransformerViT, ShapeGradientsCountAndFlops) {
  torch::manual_seed(10);
  auto model = std::dynamic_pointer_cast<models::ViTImpl>(
      models::create_model("vit_tiny", ModelOptions().num_classes(10).in_channels(1).dropout(0.1)));
  ASSERT_TRUE(model);
  model->train();
  auto x = torch::randn({4, 1, 28, 28});
  const auto y = model->forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{4, 10}));
  torch::nn::functional::cross_entropy(y, torch::tensor({0, 3, 7, 9})).backward();
  for (const auto& p : model->named_parameters()) {
    const auto& g = p.value().grad();
    ASSERT_TRUE(g.defined()) << "no gradient for " << p.key();
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << p.key();
    EXPECT_GT(g.abs().max().item<double>(), 0.0) << "all-zero gradient in " << p.key();
  }
  // By hand: C = 128, 49 patches of 4x4x1, 6 blocks of 12 C^2 + 13 C (weights and biases of the four
  // Linears: 3C, C, 4C, C biases; two LayerNorms: 4C), pos_embed 50 C, cls_token C, ln_f 2C, head.
  const int64_t C = 128, block = 12 * C * C + 9 * C + 4 * C;
  EXPECT_EQ(models::count_parameters(*model), (16 * C + C) + C + 50 * C + 6 * block + 2 * C + (C * 10 + 10));
  EXPECT_EQ(models::count_parameters(*model), 1199882);
  const double T = 50;
  EXPECT_EQ(model->forward_flops({1, 28, 28}),
            2.0 * 49 * C * 16 + 6 * (2 * T * 12 * C * C + 4 * T * T * C) + 2.0 * C * 10);
  EXPECT_EQ(model->num_blocks(), 6);
  EXPECT_EQ(model->num_patches(), 49);
  try {
    model->forward(torch::randn({1, 1, 32, 32}));
    FAIL() << "a 32x32 image ran through a 28x28 ViT";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ViT: expected images (B, 1, 28, 28), got [1, 1, 32, 32]"), std::string::npos)
        << e.what();
  }
}

TEST(TransformerViT, AttentionIsNotCausal) {
  // The class token comes first; it reads the last patch only if attention is bidirectional.
  torch::manual_seed(11);
  auto model = models::create_model("vit_tiny", ModelOptions().num_classes(10).in_channels(1));
  model->eval();
  torch::NoGradGuard no_grad;
  auto x = torch::randn({1, 1, 28, 28});
  auto x2 = x.clone();
  x2.index_put_({0, 0, torch::indexing::Slice(24, 28), torch::indexing::Slice(24, 28)}, 3.0);  // the last patch
  EXPECT_GT(max_abs_diff(model->forward(x), model->forward(x2)), 1e-4);
}

// ---------------------------------------------------------------------------------------------------------
// Registry options.

TEST(TransformerRegistry, OptionsReachTheModelsAndLeaveResNetsAlone) {
  auto gpt = tiny_gpt(ModelOptions().vocab_size(100).context(64).n_layer(2).n_head(2).n_embd(32));
  EXPECT_EQ(gpt->transformer->wte->weight.sizes(), (std::vector<int64_t>{100, 32}));
  EXPECT_EQ(gpt->transformer->wpe->weight.sizes(), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(gpt->num_blocks(), 2);
  EXPECT_EQ(gpt->forward(torch::zeros({1, 64}, torch::kLong)).sizes(), (std::vector<int64_t>{1, 64, 100}));
  auto vit = std::dynamic_pointer_cast<models::ViTImpl>(
      models::create_model("vit_tiny", ModelOptions().num_classes(5).in_channels(3).image_size(32).patch_size(8)));
  EXPECT_EQ(vit->pos_embed.sizes(), (std::vector<int64_t>{1, 17, 128}));
  EXPECT_EQ(vit->forward(torch::randn({2, 3, 32, 32})).sizes(), (std::vector<int64_t>{2, 5}));
  // The transformer fields default to "keep the architecture": a ResNet built with them is unchanged.
  EXPECT_EQ(models::count_parameters(*models::create_model("resnet20", ModelOptions().num_classes(10))), 269722);
  EXPECT_EQ(models::count_parameters(*models::create_model("gpt_tiny")), 842496);
}

// ---------------------------------------------------------------------------------------------------------
// Learning: the tiny GPT on real English text.

TEST(TransformerLearning, TinyGptBeatsTheUnigramEntropyOnFortunes) {
  const std::string fortunes = "/usr/share/games/fortunes";
  if (!std::filesystem::exists(fortunes)) GTEST_SKIP() << fortunes << " is missing (apt-get install fortunes)";
  testutil::TempDir dir("gpt_learn");
  data::convert_text({fortunes}, dir.str(), 0.1);
  auto train = std::make_shared<data::TokenDataset>((dir / "train.h5").string(), true);
  auto val = std::make_shared<data::TokenDataset>((dir / "val.h5").string(), true);

  // Unigram entropy of the training bytes, in nats: the loss of the best model that ignores context.
  auto counts = torch::bincount(train->slice(0, train->size()), {}, 256).to(torch::kDouble);
  auto p = counts / counts.sum();
  const double unigram = -(p * torch::log(p.clamp_min(1e-300))).sum().item<double>();

  // Sized for this machine: Debian's LibTorch calls the netlib reference BLAS, so a Linear runs at a few
  // GFLOP/s, and the 4 x 128 registered gpt_tiny took ~2.5 s a step at batch 16 x 64 tokens. A 2 x 64
  // model on 8 x 32 tokens takes ~50 ms a step; 300 steps reach ~2.7 nats (unigram: 3.3). The intra-op
  // thread count stays at its default (1 here): with 2 threads on the shared, oversubscribed cores every
  // op waited at OpenMP barriers and steps were ~5x slower.
  const int64_t T = 32, batch = 8, steps = 300, eval_batches = 8;
  const double lr = 3e-3;
  torch::manual_seed(0);
  auto model = tiny_gpt(ModelOptions().context(T).n_layer(2).n_embd(64));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).weight_decay(0.0));
  data::TokenLoaderOptions lo;
  lo.global_batch = batch;
  lo.context = T;
  data::TokenLoader loader(train, lo);
  namespace F = torch::nn::functional;
  const auto sum = F::CrossEntropyFuncOptions().reduction(torch::kSum);

  auto evaluate = [&] {
    torch::NoGradGuard no_grad;
    model->eval();
    data::TokenEvalOptions eo;
    eo.batch = 32;
    eo.context = T;
    data::TokenEvalLoader ev(val, eo);
    double total = 0;
    int64_t tokens = 0;
    for (int64_t i = 0; i < eval_batches; ++i) {
      auto b = ev.next();
      if (!b) break;
      total += F::cross_entropy(model->forward(b->images).reshape({-1, 256}), b->labels.reshape({-1}), sum).item<double>();
      tokens += b->labels.numel();
    }
    model->train();
    return total / static_cast<double>(tokens);
  };

  const double before = evaluate();
  const auto start = std::chrono::steady_clock::now();
  model->train();
  for (int64_t s = 0; s < steps; ++s) {
    auto b = loader.next();
    opt.zero_grad();
    auto loss = F::cross_entropy(model->forward(b.images).reshape({-1, 256}), b.labels.reshape({-1}), sum) /
                static_cast<double>(b.labels.numel());
    loss.backward();
    opt.step();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double after = evaluate();
  std::cout << "[   INFO   ] GPT 2 x 64 (T " << T << ", batch " << batch << ") on fortunes: val loss " << before << " -> " << after
            << " nats after " << steps << " AdamW steps in " << seconds << " s; unigram entropy " << unigram
            << " nats\n";
  RecordProperty("val_loss", std::to_string(after));
  EXPECT_NEAR(before, std::log(256.0), 0.2);
  EXPECT_LT(after, unigram - 0.4) << "the model did not learn more than byte frequencies";
}

TEST(TransformerLearning, VitBeatsChanceOnFashionMnist) {
  const std::string src = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(src + "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << src << " has no Fashion-MNIST (apt-get install dataset-fashion-mnist)";
  testutil::TempDir dir("vit_learn");
  data::convert_idx(src, dir.str());
  auto train = std::make_shared<data::ImageH5Dataset>((dir / "train.h5").string(), true);
  auto test = std::make_shared<data::ImageH5Dataset>((dir / "test.h5").string(), true);

  // vit_tiny's structure made small enough for seconds on 2 cores: 7x7 patches (16 + the class token),
  // 2 blocks x 64 wide, 4 heads; AdamW, 300 steps of 64 normalized images through the trainer's loader
  // (no augmentation). The intra-op thread count stays at its default, as in the GPT test above.
  const int64_t steps = 300, batch = 64;
  torch::manual_seed(0);
  auto model = models::create_model(
      "vit_tiny", ModelOptions().num_classes(10).in_channels(1).patch_size(7).n_layer(2).n_embd(64).n_head(4));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(2e-3).weight_decay(0.0));
  data::LoaderOptions lo;
  lo.global_batch = batch;
  lo.seed = 0;
  lo.workers = 0;
  lo.prefetch = 0;
  data::Loader loader(train, lo);
  namespace F = torch::nn::functional;

  // Top-1 accuracy on all 10,000 test images (before training it must be near chance: 10 classes).
  auto accuracy = [&] {
    torch::NoGradGuard no_grad;
    model->eval();
    data::EvalOptions eo;
    eo.batch = 500;
    eo.workers = 0;
    eo.prefetch = 0;
    data::EvalLoader ev(test, eo);
    int64_t correct = 0, seen = 0;
    while (auto b = ev.next()) {
      correct += model->forward(b->images).argmax(1).eq(b->labels).sum().item<int64_t>();
      seen += b->labels.size(0);
    }
    model->train();
    return static_cast<double>(correct) / static_cast<double>(seen);
  };

  const double before = accuracy();
  const auto start = std::chrono::steady_clock::now();
  double last_loss = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto b = loader.next();
    opt.zero_grad();
    auto loss = F::cross_entropy(model->forward(b.images), b.labels);
    loss.backward();
    opt.step();
    last_loss = loss.item<double>();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double after = accuracy();
  std::cout << "[   INFO   ] ViT 2 x 64, 7x7 patches, on Fashion-MNIST: test accuracy " << before << " -> " << after
            << " after " << steps << " AdamW steps of " << batch << " images in " << seconds << " s (last loss "
            << last_loss << ")\n";
  RecordProperty("accuracy", std::to_string(after));
  EXPECT_NEAR(before, 0.1, 0.08) << "an untrained model should be near chance";
  EXPECT_GT(after, 0.5) << "the ViT did not learn: chance is 10%";
}

}  // namespace

}  // namespace test_transformer
