// LoRA (models/lora.h). LoraPure, everywhere: the refusals of add_lora and their text, the trainable
// parameter count by hand, a zero B computing the base model bit for bit, merged_state against
// W + B A * scaling and against the adapted model's logits, the default targets. Lora, where the reference
// Python has peft (the 2.11 leg): a Llama (plain and rsLoRA) and a GPT-2 (peft's Conv1D path) on random
// weights with random adapters give peft's logits, peft's adapter gradients (and no gradient to the frozen
// weights), and after 20 AdamW steps of trainer::Optimizer peft's adapters (tests/ref/lora_ref.py).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "models/llama.h"
#include "models/lora.h"
#include "test_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/config/config.h"
#include "trainer/numerics/optim.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_lora {

namespace {

using models::LoraOptions;
namespace fs = std::filesystem;

const std::vector<std::string> kLlamaLinears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"};

LoraOptions lora(int64_t rank, std::vector<std::string> targets, double alpha = 8) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.targets = std::move(targets);
  return o;
}

std::shared_ptr<models::LlamaImpl> llama(const models::LlamaOptions& o, uint64_t seed = 5) {
  torch::manual_seed(seed);
  return std::make_shared<models::LlamaImpl>(o);
}

std::shared_ptr<models::GPTImpl> gpt(const models::GPTOptions& o, uint64_t seed = 5) {
  torch::manual_seed(seed);
  return std::make_shared<models::GPTImpl>(o);
}

// What add_lora threw: its text when it was a models::LoraError, else a line saying what happened instead.
std::string lora_refusal(torch::nn::Module& model, const LoraOptions& o) {
  try {
    models::add_lora(model, o);
  } catch (const models::LoraError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not a LoraError) ") + e.what();
  }
  return "(no exception)";
}

bool everything_trainable(const torch::nn::Module& model) {
  const auto ps = model.parameters();
  return std::all_of(ps.begin(), ps.end(), [](const torch::Tensor& p) { return p.requires_grad(); });
}

std::map<std::string, torch::Tensor> by_name(const std::vector<std::pair<std::string, torch::Tensor>>& v) {
  return std::map<std::string, torch::Tensor>(v.begin(), v.end());
}

}  // namespace

// ---- C++ only --------------------------------------------------------------------------------------------

// Each refusal is one line naming the setting, and leaves the model as it was (nothing frozen, no adapter).
// llama_tiny ties its output projection (no lm_head at all); an untied Llama's lm_head is a plain nn::Linear
// (the output projection is not LoRA-able): both are refused with the list of the Linear layers there are.
TEST(LoraPure, RefusalsAreOneLineLoraErrors) {
  const std::string not_linear = "' is not a Linear layer of this model (its Linear layers: q_proj, k_proj, v_proj, "
                                 "o_proj, gate_proj, up_proj, down_proj)";
  auto bad_dropout = lora(4, {"q_proj"});
  bad_dropout.dropout = 1.0;
  const std::vector<std::pair<LoraOptions, std::string>> cases = {
      {lora(4, {"input_layernorm"}), "model.lora.targets: 'input_layernorm" + not_linear},
      {lora(4, {"q_proj", "embed_tokens"}), "model.lora.targets: 'embed_tokens" + not_linear},
      {lora(4, {"lm_head"}), "model.lora.targets: 'lm_head" + not_linear},
      {lora(4, {}), "model.lora.targets: names no layer"},
      {lora(0, {"q_proj"}), "model.lora.rank: must be at least 1, got 0"},
      // k_proj of llama_tiny is 128 -> 64 (2 key/value heads of 32): r may be 64 at most.
      {lora(65, {"q_proj", "k_proj"}),
       "model.lora.rank: 65 is larger than model.layers.0.self_attn.k_proj (128 -> 64): at most 64"},
      {bad_dropout, "model.lora.dropout: must be in [0, 1), got 1.000000"},
      {lora(4, {"q_proj"}, 0), "model.lora.alpha: must be positive, got 0.000000"},
  };
  for (const auto& untied : {false, true}) {
    auto model = llama(models::llama_tiny().tie_embeddings(!untied));
    for (const auto& [options, want] : cases) {
      SCOPED_TRACE(want);
      const auto text = lora_refusal(*model, options);
      EXPECT_EQ(text, want);
      EXPECT_EQ(text.find('\n'), std::string::npos);
      EXPECT_FALSE(models::has_lora(*model));
      EXPECT_TRUE(everything_trainable(*model));
    }
  }
  // The largest rank k_proj allows is taken; a second add_lora is refused.
  auto model = llama(models::llama_tiny());
  EXPECT_EQ(models::add_lora(*model, lora(64, {"k_proj"})).size(), 4u);
  EXPECT_EQ(lora_refusal(*model, lora(4, {"q_proj"})), "model.lora: the model already has adapters");
  // GPT's Linear layers are its own names.
  auto g = gpt(models::gpt_tiny());
  EXPECT_EQ(lora_refusal(*g, lora(4, {"q_proj"})),
            "model.lora.targets: 'q_proj' is not a Linear layer of this model (its Linear layers: c_attn, c_proj, "
            "c_fc)");
}

// llama_tiny: C 128, 4 query heads of 32 over 2 key/value heads, SwiGLU 352, 4 layers. An adapted layer
// in -> out has r * in (A) + out * r (B) parameters:
//   q_proj 128 -> 128: 256 r   k_proj, v_proj 128 -> 64: 192 r each   o_proj 128 -> 128: 256 r
//   gate_proj, up_proj 128 -> 352: 480 r each                            down_proj 352 -> 128: 480 r
// All seven at r = 4: 4 layers x 4 x 2336 = 37376. The default targets (q_proj, v_proj) at r = 8: 4 x 8 x 448
// = 14336. gpt_tiny (C 128, 4 layers), c_attn 128 -> 384 at r = 4: 4 x 4 x 512 = 8192.
TEST(LoraPure, TrainableParametersByHand) {
  auto all = llama(models::llama_tiny());
  const auto names = models::add_lora(*all, lora(4, kLlamaLinears));
  ASSERT_EQ(names.size(), 28u);
  EXPECT_EQ(names.front(), "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(names.back(), "model.layers.3.mlp.down_proj");
  EXPECT_EQ(models::trainable_parameters(*all), 37376);

  auto defaults = llama(models::llama_tiny());
  models::add_lora(*defaults, lora(8, models::default_lora_targets("llama_tiny")));
  EXPECT_EQ(models::trainable_parameters(*defaults), 14336);

  auto g = gpt(models::gpt_tiny());
  EXPECT_EQ(models::add_lora(*g, lora(4, models::default_lora_targets("gpt_tiny"))).size(), 4u);
  EXPECT_EQ(models::trainable_parameters(*g), 8192);

  // The optimizer's slots are the adapters, nothing frozen, each with weight decay (2-d), in lora_state's order.
  const auto slots = trainer::param_slots(*all, /*decay_norm_and_bias=*/false);
  const auto state = models::lora_state(*all);
  ASSERT_EQ(slots.size(), state.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_EQ(slots[i].name, state[i].first);
    EXPECT_TRUE(slots[i].param.is_same(state[i].second)) << slots[i].name;
    EXPECT_TRUE(slots[i].decay) << slots[i].name;
  }
  EXPECT_EQ(state.front().first, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(state.front().second.sizes(), (std::vector<int64_t>{4, 128}));  // A: (r, in)
  const auto down_B = by_name(state).at("model.layers.2.mlp.down_proj.lora_B.weight");
  EXPECT_EQ(down_B.sizes(), (std::vector<int64_t>{128, 4}));  // B: (out, r)
}

// peft's initialization, B = 0, makes the adapted model the base model: the same logits bit for bit (y + 0
// is y), for the Llama's projections and for GPT's fused-bias path, in eval and training mode.
TEST(LoraPure, ZeroBIsTheBaseModelBitwise) {
  const auto tokens = torch::randint(256, {2, 24}, torch::kLong);
  using Model = std::shared_ptr<models::LanguageModelImpl>;
  std::vector<std::pair<Model, Model>> pairs = {{llama(models::llama_tiny()), llama(models::llama_tiny())},
                                                {gpt(models::gpt_tiny()), gpt(models::gpt_tiny())}};
  for (auto& [base, adapted] : pairs) {
    const auto targets = models::lora_target_names(*adapted);  // every Linear layer
    models::add_lora(*adapted, lora(4, targets));
    for (const auto& [name, t] : models::lora_state(*adapted)) {
      if (name.find("lora_B") != std::string::npos) EXPECT_TRUE(torch::equal(t, torch::zeros_like(t))) << name;
      else EXPECT_GT(t.abs().max().item<double>(), 0.0) << name;
    }
    torch::NoGradGuard ng;
    for (bool training : {false, true}) {
      base->train(training);
      adapted->train(training);
      EXPECT_TRUE(torch::equal(adapted->forward(tokens), base->forward(tokens))) << (training ? "train" : "eval");
    }
  }
}

// merged_state: the base model's names (no adapter entries), each adapted weight W + (B A) * alpha / r, the
// rest as it was; loaded into a model without adapters it computes the adapted model's logits.
TEST(LoraPure, MergedStateIsWeightPlusScaledBA) {
  auto model = llama(models::llama_tiny());
  const auto base_names = model->named_parameters().keys();
  const auto before = by_name(models::merged_state(*model));  // no adapters yet: the parameters themselves
  models::add_lora(*model, lora(4, {"q_proj", "down_proj"}, 6));
  {
    torch::NoGradGuard ng;
    for (auto& [name, t] : models::lora_state(*model)) t.normal_(0.0, 0.1);  // B too: a nonzero delta
  }
  const auto merged = models::merged_state(*model);
  std::vector<std::string> names;
  for (const auto& [name, t] : merged) names.push_back(name);
  EXPECT_EQ(names, base_names);
  for (const auto& [name, t] : merged) {
    EXPECT_EQ(name.find("lora"), std::string::npos) << name;
    EXPECT_FALSE(t.requires_grad()) << name;
  }
  const auto layers = models::lora_layers(*model);
  std::set<std::string> adapted;
  for (const auto& [name, layer] : layers) {
    adapted.insert(name + ".weight");
    const auto A = layer->lora_A->weight.to(torch::kDouble), B = layer->lora_B->weight.to(torch::kDouble);
    const auto want = before.at(name + ".weight").to(torch::kDouble) + torch::matmul(B, A) * (6.0 / 4.0);  // (out, in)
    const double diff = (by_name(merged).at(name + ".weight").to(torch::kDouble) - want).abs().max().item<double>();
    EXPECT_LT(diff, 1e-6) << name;
  }
  EXPECT_EQ(adapted.size(), 8u);
  for (const auto& [name, t] : merged)
    if (!adapted.count(name)) EXPECT_TRUE(torch::equal(t, before.at(name))) << name;

  auto plain = llama(models::llama_tiny(), 9);
  {
    torch::NoGradGuard ng;
    const auto m = by_name(merged);
    for (auto& p : plain->named_parameters()) p.value().copy_(m.at(p.key()));
  }
  model->eval();
  plain->eval();
  torch::NoGradGuard ng;
  const auto tokens = torch::randint(256, {2, 24}, torch::kLong);
  const auto want = model->forward(tokens);
  EXPECT_LT((plain->forward(tokens) - want).abs().max().item<double>() / want.abs().max().item<double>(), 1e-5);
}

// peft's defaults per family, the LoRA-able names per model, and the two scalings.
TEST(LoraPure, DefaultTargetsNamesAndScaling) {
  const std::vector<std::string> qv = {"q_proj", "v_proj"}, c_attn = {"c_attn"};
  EXPECT_EQ(models::default_lora_targets("llama_tiny"), qv);
  EXPECT_EQ(models::default_lora_targets("llama3_2_1b"), qv);
  EXPECT_EQ(models::default_lora_targets("gpt_tiny"), c_attn);
  EXPECT_EQ(models::default_lora_targets("gpt2"), c_attn);
  EXPECT_TRUE(models::default_lora_targets("resnet18").empty());
  EXPECT_EQ(models::lora_target_names(*llama(models::llama_tiny())), kLlamaLinears);
  EXPECT_EQ(models::lora_target_names(*gpt(models::gpt_tiny())), (std::vector<std::string>{"c_attn", "c_proj", "c_fc"}));
  auto o = lora(16, {"q_proj"}, 8);
  EXPECT_DOUBLE_EQ(o.scaling(), 0.5);
  o.use_rslora = true;
  EXPECT_DOUBLE_EQ(o.scaling(), 2.0);
}

// ---- against peft ------------------------------------------------------------------------------------------

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/lora_ref.py"; }

// "" when the reference Python has safetensors, transformers and peft, else the first one it lacks.
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_LORA_REFERENCE()                                                                    \
  if (!missing_module().empty())                                                                         \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module() \
               << " (scripts/install-torch.sh installs safetensors, transformers and peft into the 2.11 venv)"

// lora_ref.py's CASES, from the same numbers.
struct Case {
  std::string name;
  std::function<std::shared_ptr<models::LanguageModelImpl>()> make;
  LoraOptions options;
};

std::vector<Case> cases() {
  const auto llama_options = models::LlamaOptions().vocab_size(128).context(64).n_layer(2).n_head(4).n_kv_head(2)
      .n_embd(64).intermediate_size(128).rms_norm_eps(1e-5).rope_theta(10000.0);
  const auto make_llama = [llama_options] { return std::shared_ptr<models::LanguageModelImpl>(llama(llama_options)); };
  auto rslora = lora(4, kLlamaLinears);
  rslora.use_rslora = true;
  const auto gpt_options = models::GPTOptions().vocab_size(96).context(32).n_layer(2).n_head(4).n_embd(32);
  return {{"llama", make_llama, lora(4, kLlamaLinears)},
          {"llama_rslora", make_llama, rslora},
          {"gpt2", [gpt_options] { return std::shared_ptr<models::LanguageModelImpl>(gpt(gpt_options)); },
           lora(4, {"c_attn"})}};
}

std::map<std::string, torch::Tensor> expected_of(const fs::path& dir) {
  return by_name(trainer::read_safetensors((dir / "expected.safetensors").string()).tensors);
}

// The case's model with peft's base weights (transformers' folder, through model.init_from's loader: GPT-2's
// Conv1D weights transposed), then adapters with the case's options holding peft's initial values.
std::shared_ptr<models::LanguageModelImpl> adapted_model(const Case& c, const fs::path& dir,
                                                         const std::map<std::string, torch::Tensor>& expected) {
  auto model = c.make();
  trainer::load_weights(*model, (dir / "base").string());
  models::add_lora(*model, c.options);
  const auto state = models::lora_state(*model);
  size_t in_file = 0;
  for (const auto& [name, t] : expected) in_file += name.rfind("init.", 0) == 0;
  EXPECT_EQ(state.size(), in_file) << "adapters here and in peft's model";
  torch::NoGradGuard ng;
  for (const auto& [name, t] : state) {
    const auto it = expected.find("init." + name);
    if (it == expected.end()) {
      ADD_FAILURE() << name << " is not among peft's adapters";
      continue;
    }
    EXPECT_EQ(t.sizes(), it->second.sizes()) << name;
    t.copy_(it->second);
  }
  return model;
}

// The loss lora_ref.py computes: cross entropy, mean over B (T - 1) positions, of each position's logits
// against the next token.
torch::Tensor causal_loss(models::LanguageModelImpl& model, const torch::Tensor& tokens) {
  const auto logits = model.forward(tokens);  // (B, T, V)
  const int64_t T = tokens.size(1), V = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.narrow(1, 0, T - 1).reshape({-1, V}),
                                              tokens.narrow(1, 1, T - 1).reshape({-1}));
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace

// One run of lora_ref.py writes every case's folder (importing transformers and peft is most of its time).
class Lora : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!missing_module().empty()) return;
    dir_ = new testutil::TempDir("trainer_lora");
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
testutil::TempDir* Lora::dir_ = nullptr;
bool Lora::ok_ = false;
std::string Lora::output_;

// The base model's logits equal peft's with its adapters disabled (the weights arrived), and the adapted
// model's equal peft's with them (which differ from the base's by units: the adapters matter). Logits of a
// few units agree to 1e-5 absolute; the measured figures are printed.
TEST_F(Lora, LogitsEqualPeft) {
  SKIP_WITHOUT_LORA_REFERENCE();
  ASSERT_TRUE(ok_) << output_;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto dir = dir_->path / c.name;
    const auto expected = expected_of(dir);
    const auto tokens = expected.at("tokens");
    torch::NoGradGuard ng;
    auto base = c.make();
    trainer::load_weights(*base, (dir / "base").string());
    base->eval();
    const double base_diff = max_abs_diff(base->forward(tokens), expected.at("base_logits"));
    auto model = adapted_model(c, dir, expected);
    model->eval();
    const auto logits = model->forward(tokens);
    ASSERT_EQ(logits.sizes(), expected.at("logits").sizes());
    const double diff = max_abs_diff(logits, expected.at("logits"));
    std::cout << "[ lora ] " << c.name << ": logits max |ours - peft| = " << diff << " (base model: " << base_diff
              << ", scale " << expected.at("logits").abs().max().item<double>() << ")\n";
    EXPECT_LT(base_diff, 1e-5);
    EXPECT_LT(diff, 1e-5);
    EXPECT_GT(max_abs_diff(expected.at("logits"), expected.at("base_logits")), 0.1);
  }
}

// One forward and backward of the causal-LM loss: the loss and every adapter's gradient equal peft's
// (max |ours - peft| / max |peft| per tensor below 1e-5); no frozen parameter requires or gets a gradient.
TEST_F(Lora, GradientsEqualPeftAndFrozenWeightsGetNone) {
  SKIP_WITHOUT_LORA_REFERENCE();
  ASSERT_TRUE(ok_) << output_;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto dir = dir_->path / c.name;
    const auto expected = expected_of(dir);
    auto model = adapted_model(c, dir, expected);
    model->train();  // no dropout anywhere: the same function as peft's eval mode
    const auto loss = causal_loss(*model, expected.at("tokens"));
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), expected.at("loss").item<double>(), 1e-5);
    double worst = 0;
    const auto state = models::lora_state(*model);
    for (const auto& [name, t] : state) {
      ASSERT_TRUE(t.grad().defined()) << name;
      const auto& want = expected.at("grad." + name);
      const double rel = max_abs_diff(t.grad(), want) / want.abs().max().item<double>();
      EXPECT_LT(rel, 1e-5) << name;
      worst = std::max(worst, rel);
    }
    std::cout << "[ lora ] " << c.name << ": gradients max |ours - peft| / max |peft| = " << worst << " over "
              << state.size() << " adapters\n";
    const auto adapters = by_name(state);
    int64_t frozen = 0;
    for (const auto& p : model->named_parameters()) {
      if (adapters.count(p.key())) continue;
      ++frozen;
      EXPECT_FALSE(p.value().requires_grad()) << p.key();
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
    }
    EXPECT_GT(frozen, 0);
  }
}

// 20 steps of the project's AdamW (trainer::Optimizer over param_slots, as training builds it) against
// torch.optim.AdamW over peft's adapters, one fixed batch per step: the losses step by step, and the adapters
// after the last step to 1e-5 (max |ours - peft| / max |peft| per tensor). Measured: 2e-7; a weight decay
// left out (0.01 here) shows as 2e-4, so the bound is kept well under that.
TEST_F(Lora, AdamWStepsEqualPeft) {
  SKIP_WITHOUT_LORA_REFERENCE();
  ASSERT_TRUE(ok_) << output_;
  trainer::OptimConfig cfg;
  cfg.name = trainer::OptimKind::kAdamW;
  cfg.lr = 1e-3;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.999;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.01;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto dir = dir_->path / c.name;
    const auto expected = expected_of(dir);
    auto model = adapted_model(c, dir, expected);
    model->train();
    auto slots = trainer::param_slots(*model, cfg.decay_norm_and_bias);
    ASSERT_EQ(slots.size(), models::lora_state(*model).size());  // the frozen weights are not the optimizer's
    trainer::Optimizer optimizer(std::move(slots), cfg);
    const auto batches = expected.at("train_tokens");  // (S, B, T)
    const auto losses = expected.at("losses");
    ASSERT_EQ(batches.size(0), 20);
    double worst_loss = 0;
    for (int64_t s = 0; s < batches.size(0); ++s) {
      optimizer.zero_grad();
      const auto loss = causal_loss(*model, batches[s]);
      loss.backward();
      optimizer.step(cfg.lr);
      worst_loss = std::max(worst_loss, std::abs(loss.item<double>() - losses[s].item<double>()));
    }
    EXPECT_LT(worst_loss, 1e-5);
    double worst = 0, moved = 0;
    for (const auto& [name, t] : models::lora_state(*model)) {
      const auto& want = expected.at("trained." + name);
      const double rel = max_abs_diff(t, want) / want.abs().max().item<double>();
      EXPECT_LT(rel, 1e-5) << name;
      worst = std::max(worst, rel);
      moved = std::max(moved, max_abs_diff(want, expected.at("init." + name)));
    }
    EXPECT_GT(moved, 1e-3);  // the steps did move the adapters
    std::cout << "[ lora ] " << c.name << ": after 20 AdamW steps max |ours - peft| / max |peft| = " << worst
              << ", losses max |ours - peft| = " << worst_loss << "\n";
  }
}

// The unity build puts this file beside others that define their own skip macros.
#undef SKIP_WITHOUT_LORA_REFERENCE

}  // namespace test_lora
