// Tests of models/: every registered model trains one step; the ImageNet ResNets match torchvision
// (state_dict names and shapes, parameter counts, FLOPs, and eval-mode outputs with the same weights);
// the CIFAR ResNets match hand-computed counts and FLOPs; zero_init_residual, channels_last, the
// registry's error text and the summary table.
#include "models/language_model.h"
#include "models/registry.h"
#include "models/resnet.h"
#include "models/summary.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_models {

namespace {

using models::ModelOptions;

// Every parameter and buffer by its state_dict name.
std::map<std::string, torch::Tensor> state_of(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> state;
  for (const auto& p : m.named_parameters()) state[p.key()] = p.value();
  for (const auto& b : m.named_buffers()) state[b.key()] = b.value();
  return state;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string ref_script() { return testutil::source_dir() + "/tests/ref/torchvision_models.py"; }

const std::vector<std::string> kImageNetResNets = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"};

// ---------------------------------------------------------------------------------------------------------
// One parameterized test over every registered model: output shape, backward, gradients.

struct TestInput {
  ModelOptions options;
  std::vector<int64_t> batch_shape;  // (B, C, H, W), or (B, T) for a language model
  bool tokens = false;               // language model: int64 tokens in [0, 256), logits (B, T, V) out
};

// Small inputs so the whole sweep takes seconds. A newly registered model needs a line here.
bool test_input(const std::string& name, TestInput* in) {
  if (name == "resnet20" || name == "resnet32" || name == "resnet56") {
    *in = {ModelOptions().num_classes(10).in_channels(1), {2, 1, 28, 28}};  // Fashion-MNIST-like
    return true;
  }
  if (name == "plain_cnn") {
    *in = {ModelOptions().num_classes(10).in_channels(1), {2, 1, 28, 28}};
    return true;
  }
  for (const auto& n : kImageNetResNets) {
    if (name == n) {
      *in = {ModelOptions().num_classes(7), {2, 3, 32, 32}};
      return true;
    }
  }
  if (name == "vit_tiny") {
    *in = {ModelOptions().num_classes(10).in_channels(1), {2, 1, 28, 28}};
    return true;
  }
  if (name == "gpt_tiny" || name == "gpt2") {
    // gpt2 with 1 of its 12 layers and 8 tokens keeps the sweep fast (its 50257 x 768 output projection
    // dominates); the full model is checked in test_transformer.cpp.
    if (name == "gpt2") *in = {ModelOptions().n_layer(1), {1, 8}, true};
    else *in = {ModelOptions(), {2, 16}, true};
    return true;
  }
  // The Llama family: llama_tiny whole; the published shapes with 1 layer, vocabulary 256 and a narrow MLP
  // (their heads, head size, biases and rope kept); `llama` from options as a config.json would give them.
  if (name == "llama_tiny") {
    *in = {ModelOptions(), {2, 16}, true};
    return true;
  }
  if (name == "smollm2_135m" || name == "llama3_2_1b" || name == "qwen2_5_0_5b") {
    *in = {ModelOptions().n_layer(1).vocab_size(256).intermediate_size(64).context(16), {1, 8}, true};
    return true;
  }
  if (name == "llama") {
    *in = {ModelOptions().llama(models::llama_tiny().n_layer(1)), {2, 16}, true};
    return true;
  }
  return false;
}

class ModelsEveryRegistered : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelsEveryRegistered, ForwardBackwardGradients) {
  const std::string name = GetParam();
  TestInput in;
  ASSERT_TRUE(test_input(name, &in)) << "no test input for model '" << name
                                     << "': add one to test_input() in tests/test_models.cpp";
  torch::manual_seed(0);
  auto model = models::create_model(name, in.options);
  model->train();
  auto x = in.tokens ? torch::randint(256, in.batch_shape, torch::kLong) : torch::randn(in.batch_shape);
  auto y = model->forward(x);
  ASSERT_TRUE(torch::isfinite(y).all().item<bool>()) << name << " produced non-finite logits";
  if (in.tokens) {
    ASSERT_EQ(y.dim(), 3);
    ASSERT_EQ(y.sizes().slice(0, 2), c10::IntArrayRef(in.batch_shape));
    y = y.reshape({-1, y.size(2)});  // (B*T, V): one prediction per position
  } else {
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{in.batch_shape[0], in.options.num_classes()}));
  }
  auto target = torch::randint(y.size(1), {y.size(0)}, torch::kLong);
  torch::nn::functional::cross_entropy(y, target).backward();
  int64_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto& g = p.value().grad();
    ASSERT_TRUE(g.defined()) << name << ": no gradient for " << p.key();
    EXPECT_EQ(g.sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << name << ": non-finite gradient in " << p.key();
    EXPECT_GT(g.abs().max().item<double>(), 0.0) << name << ": all-zero gradient in " << p.key();
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // Blocks are what activation checkpointing wraps: the mask must have exactly num_blocks() entries.
  EXPECT_GT(model->num_blocks(), 0);
  model->set_checkpointed_blocks(std::vector<bool>(model->num_blocks(), false));
  EXPECT_THROW(model->set_checkpointed_blocks(std::vector<bool>(model->num_blocks() + 1)), c10::Error);
}

// The registry's traits say what the model built under the name takes and gives: the config's checks ask
// them instead of the name.
TEST_P(ModelsEveryRegistered, TraitsSayWhatTheModelTakes) {
  const std::string name = GetParam();
  TestInput in;
  ASSERT_TRUE(test_input(name, &in));
  const models::ModelTraits& t = models::model_traits(name);
  EXPECT_EQ(t.language_model(), in.tokens) << name << ": the traits' task and the input the model takes disagree";
  EXPECT_EQ(models::registered_vocab_size(name), t.vocab_size);
  auto model = models::create_model(name, in.options);
  auto* lm = dynamic_cast<models::LanguageModelImpl*>(model.get());
  EXPECT_EQ(lm != nullptr, t.language_model()) << name;
  if (!t.language_model()) {
    EXPECT_EQ(t.vocab_size, 0) << name;
    EXPECT_FALSE(t.pads_vocab || t.shape_from_hub) << name << ": a language model's traits on an image model";
    return;
  }
  EXPECT_GT(t.vocab_size, 0) << name;
  // Built with the options' vocabulary where the input sets one, else the registered one.
  if (in.options.vocab_size() == 0 && !in.options.llama()) EXPECT_EQ(lm->vocab_size(), t.vocab_size) << name;
  // `llama` alone has no shape: it asks for a config.json, and its traits say so.
  EXPECT_EQ(t.shape_from_hub, name == "llama") << name;
  if (t.shape_from_hub) EXPECT_THROW(models::create_model(name, ModelOptions()), std::invalid_argument);
  // model.vocab_multiple: padded by the models whose traits say so, refused by the others.
  if (t.pads_vocab) {
    ModelOptions padded = in.options;
    EXPECT_NO_THROW(models::create_model(name, padded.vocab_multiple(64))) << name;
  } else {
    ModelOptions padded = in.options;
    EXPECT_THROW(models::create_model(name, padded.vocab_multiple(64)), std::invalid_argument) << name;
  }
}

// fixed_input_size: the image models whose traits say so refuse images of another size than they were
// built for; the others take them.
TEST_P(ModelsEveryRegistered, FixedInputSizeIsWhatTheModelRefuses) {
  const std::string name = GetParam();
  TestInput in;
  ASSERT_TRUE(test_input(name, &in));
  if (in.tokens) return;  // the image models' trait
  torch::manual_seed(0);
  auto model = models::create_model(name, in.options);
  model->eval();
  torch::NoGradGuard no_grad;
  auto shape = in.batch_shape;
  shape[2] += 4, shape[3] += 4;  // still a whole number of ViT patches at every size the tests use
  const auto x = torch::randn(shape);
  if (models::model_traits(name).fixed_input_size) EXPECT_ANY_THROW(model->forward(x)) << name;
  else EXPECT_NO_THROW(model->forward(x)) << name;
}

TEST(ModelsRegistry, TraitsOfAnUnknownNameListTheKnownModels) {
  try {
    models::model_traits("resnet9000");
    FAIL() << "model_traits accepted an unknown name";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "unknown model 'resnet9000'; known models: " + join(models::model_names()));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelsEveryRegistered, ::testing::ValuesIn(models::model_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---------------------------------------------------------------------------------------------------------
// Registry.

TEST(ModelsRegistry, NamesAreUniqueAndIncludeTheResNets) {
  const auto names = models::model_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size()) << join(names);
  for (const std::string n : {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet20", "resnet32",
                              "resnet56"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n << " is not registered";
  }
}

TEST(ModelsRegistry, UnknownNameErrorListsKnownModels) {
  try {
    models::create_model("resnet9000", ModelOptions());
    FAIL() << "create_model accepted an unknown name";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "unknown model 'resnet9000'; known models: " + join(models::model_names()));
    EXPECT_NE(std::string(e.what()).find("known models: resnet18, resnet34, resnet50, resnet101, resnet152"),
              std::string::npos)
        << e.what();
  }
}

TEST(ModelsRegistry, OptionsReachTheModel) {
  auto model = models::create_model("resnet18", ModelOptions().num_classes(5).in_channels(1));
  auto state = state_of(*model);
  EXPECT_EQ(state.at("conv1.weight").sizes(), (std::vector<int64_t>{64, 1, 7, 7}));
  EXPECT_EQ(state.at("fc.weight").sizes(), (std::vector<int64_t>{5, 512}));
  EXPECT_EQ(state.at("fc.bias").sizes(), (std::vector<int64_t>{5}));
}

// ---------------------------------------------------------------------------------------------------------
// ImageNet ResNets against torchvision.

TEST(ModelsTorchvision, NamesShapesCountsAndFlops) {
  testutil::TempDir dir("models_tv");
  const auto json_path = dir / "torchvision.json";
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " --json " + json_path.string() +
                               " --sizes 45x37,resnet50:224x224");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = nlohmann::json::parse(testutil::read_file(json_path));

  for (const auto& name : kImageNetResNets) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(ref.contains(name));
    const auto& tv = ref.at(name);
    auto model = models::create_model(name, ModelOptions());
    const auto ours = state_of(*model);

    std::vector<std::string> missing, extra;
    for (const auto& [key, shape] : tv.at("state").items()) {
      auto it = ours.find(key);
      if (it == ours.end()) {
        missing.push_back(key);
        continue;
      }
      EXPECT_EQ(it->second.sizes().vec(), shape.get<std::vector<int64_t>>()) << key;
    }
    for (const auto& [key, t] : ours) {
      if (!tv.at("state").contains(key)) extra.push_back(key);
    }
    EXPECT_TRUE(missing.empty()) << "torchvision keys we lack: " << join(missing);
    EXPECT_TRUE(extra.empty()) << "keys torchvision lacks: " << join(extra);

    EXPECT_EQ(models::count_parameters(*model), tv.at("num_parameters").get<int64_t>());
    EXPECT_FALSE(tv.at("macs").empty());
    for (const auto& [size, macs] : tv.at("macs").items()) {
      const auto x = size.find('x');
      const int64_t h = std::stoll(size.substr(0, x)), w = std::stoll(size.substr(x + 1));
      const double want = 2.0 * macs.get<double>();
      EXPECT_NEAR(model->forward_flops({3, h, w}), want, 1e-3 * want) << "at " << size;
    }
  }
  // 45x37 (odd, non-square, odd again after the stem) exercises the size rounding; 224x224 runs for
  // resnet50 only, to keep the reference fast. The figures everyone quotes (torchvision's documentation)
  // check the reference itself.
  EXPECT_TRUE(ref.at("resnet50").at("macs").contains("224x224"));
  EXPECT_EQ(ref.at("resnet18").at("num_parameters").get<int64_t>(), 11689512);
  EXPECT_EQ(ref.at("resnet50").at("num_parameters").get<int64_t>(), 25557032);
  EXPECT_NEAR(ref.at("resnet50").at("macs").at("224x224").get<double>(), 4.09e9, 0.01e9);
}

// Loads a state_dict saved by tests/ref/torchvision_models.py (torch.save of a plain dict) by name.
void load_state(torch::nn::Module& model, const c10::Dict<c10::IValue, c10::IValue>& state) {
  torch::NoGradGuard no_grad;
  auto ours = state_of(model);
  std::set<std::string> seen;
  for (const auto& item : state) {
    const std::string key = item.key().toStringRef();
    auto it = ours.find(key);
    ASSERT_NE(it, ours.end()) << "torchvision key " << key << " has no counterpart";
    const auto t = item.value().toTensor();
    ASSERT_EQ(it->second.sizes(), t.sizes()) << key;
    it->second.copy_(t);
    seen.insert(key);
  }
  EXPECT_EQ(seen.size(), ours.size()) << "some of our parameters or buffers were not in torchvision's state";
}

TEST(ModelsTorchvision, EvalOutputsMatchWithTheSameWeights) {
  testutil::TempDir dir("models_tv_weights");
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " --weights " + dir.str() +
                               " --models resnet18,resnet50");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string name : {"resnet18", "resnet50"}) {
    SCOPED_TRACE(name);
    const std::string bytes = testutil::read_file(dir / (name + ".pt"));
    ASSERT_FALSE(bytes.empty());
    const auto saved = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
    const auto x = saved.at("x").toTensor();
    const auto y_ref = saved.at("y").toTensor();

    auto model = models::create_model(name, ModelOptions());
    load_state(*model, saved.at("state").toGenericDict());
    // Loading copies num_batches_tracked too: the two training-mode forwards in the script count 2.
    EXPECT_EQ(state_of(*model).at("bn1.num_batches_tracked").item<int64_t>(), 2);
    model->eval();
    torch::NoGradGuard no_grad;
    const auto y = model->forward(x);
    ASSERT_EQ(y.sizes(), y_ref.sizes());
    const double scale = y_ref.abs().max().item<double>();
    EXPECT_GT(scale, 0.0);
    EXPECT_TRUE(torch::allclose(y, y_ref, 1e-4, 1e-4 * scale))
        << "max |diff| " << (y - y_ref).abs().max().item<double>() << " at output scale " << scale;
  }
}

// ---------------------------------------------------------------------------------------------------------
// CIFAR ResNets (He et al. 2016, section 4.2) against hand computations.

// Parameters of the depth-(6n+2) CIFAR ResNet with 3 input channels and 10 classes:
//   conv1 3*16*9 = 432, bn1 2*16 = 32                                          -> 464
//   stage 1, every block: 2 convs 16*16*9 = 2304 each, 2 BNs of 32              -> 4672 per block
//   stage 2, first block: conv 16*32*9 = 4608, conv 32*32*9 = 9216, BNs 128     -> 13952
//            other blocks: 2 * 9216 + 128                                       -> 18560
//   stage 3, first block: conv 32*64*9 = 18432, conv 64*64*9 = 36864, BNs 256   -> 55552
//            other blocks: 2 * 36864 + 256                                      -> 73984
//   fc 64*10 + 10 = 650 (option A shortcuts have no parameters)
//   total = 464 + 4672 n + 13952 + 18560 (n-1) + 55552 + 73984 (n-1) + 650 = 97216 n - 21926
// n = 3, 5, 9: 269,722 / 464,154 / 853,018, the paper's 0.27M / 0.46M / 0.85M.
TEST(ModelsCifarResNet, ParameterCountsByHand) {
  const std::map<std::string, int64_t> want = {{"resnet20", 269722}, {"resnet32", 464154}, {"resnet56", 853018}};
  for (const auto& [name, count] : want) {
    auto model = models::create_model(name, ModelOptions().num_classes(10).in_channels(3));
    EXPECT_EQ(models::count_parameters(*model), count) << name;
  }
  // Fashion-MNIST's single channel removes 2 * 16 * 9 weights from conv1.
  EXPECT_EQ(models::count_parameters(*models::create_model("resnet20", ModelOptions().num_classes(10).in_channels(1))),
            269722 - 288);
}

// Multiply-adds per 3x32x32 sample:
//   conv1: 16*32*32 outputs * 27                                              = 442,368
//   stage 1 block: 2 convs of 16*32*32 outputs * 144                          = 4,718,592
//   stage 2 first block: 32*16*16 * 144 + 32*16*16 * 288                      = 3,538,944; others 4,718,592
//   stage 3 first block: 64*8*8 * 288 + 64*8*8 * 576                          = 3,538,944; others 4,718,592
//   fc: 64*10                                                                 = 640
//   total = 442368 + 640 + 2 * 3538944 + (3n - 2) * 4718592 = 14,155,776 n - 1,916,288
// n = 3: 40.55M MACs (81.1 MFLOPs); n = 9: 125.5M MACs.
TEST(ModelsCifarResNet, FlopsByHand) {
  const std::map<std::string, int64_t> depth_n = {{"resnet20", 3}, {"resnet32", 5}, {"resnet56", 9}};
  for (const auto& [name, n] : depth_n) {
    auto model = models::create_model(name, ModelOptions().num_classes(10));
    EXPECT_EQ(model->forward_flops({3, 32, 32}), 2.0 * (14155776.0 * n - 1916288.0)) << name;
  }
  // 1x28x28 (Fashion-MNIST): stages at 28, 14, 7. conv1 16*784*9; stage 1 blocks 2 * 16*784*144;
  // stage 2: 32*196*144 + 32*196*288, others 2 * 32*196*288; stage 3: 64*49*288 + 64*49*576, others
  // 2 * 64*49*576; fc 640.
  const double macs20 = 16 * 784 * 9 + 3 * 2 * 16 * 784 * 144 + (32 * 196 * 144 + 32 * 196 * 288) +
                        2 * 2 * 32 * 196 * 288 + (64 * 49 * 288 + 64 * 49 * 576) + 2 * 2 * 64 * 49 * 576 + 640;
  EXPECT_EQ(models::create_model("resnet20", ModelOptions().num_classes(10).in_channels(1))->forward_flops({1, 28, 28}),
            2.0 * macs20);
}

TEST(ModelsCifarResNet, OptionAShortcutPadsZeroChannelsAndSubsamples) {
  // A stride-2 block whose branch is zeroed (zero_init_residual) passes relu(shortcut(x)) through:
  // x[:, :, ::2, ::2] in the first 16 channels, zeros in the 16 new ones.
  auto block = std::make_shared<models::BasicBlockImpl>(
      models::ResidualBlockOptions(16, 32).stride(2).shortcut(models::ShortcutKind::zero_pad));
  {
    torch::NoGradGuard no_grad;
    block->bn2->weight.zero_();
    block->bn2->bias.zero_();
  }
  EXPECT_EQ(models::count_parameters(*block), 16 * 32 * 9 + 32 * 32 * 9 + 4 * 32);
  auto x = torch::rand({2, 16, 7, 9});  // positive, so the final relu keeps it
  auto y = block->forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 32, 4, 5}));
  auto want = torch::zeros({2, 32, 4, 5});
  want.slice(1, 0, 16).copy_(x.index({torch::indexing::Slice(), torch::indexing::Slice(),
                                      torch::indexing::Slice(0, torch::indexing::None, 2),
                                      torch::indexing::Slice(0, torch::indexing::None, 2)}));
  EXPECT_TRUE(torch::equal(y, want));
}

// ---------------------------------------------------------------------------------------------------------
// Options and helpers.

TEST(ModelsResNet, NumBlocksFollowsDepth) {
  // ImageNet: depth = 2 * blocks + 2 (BasicBlock) or 3 * blocks + 2 (Bottleneck); CIFAR: 6n + 2 = 2 * 3n + 2.
  const std::map<std::string, int64_t> want = {{"resnet18", 8},  {"resnet34", 16}, {"resnet50", 16},
                                               {"resnet101", 33}, {"resnet152", 50}, {"resnet20", 9},
                                               {"resnet32", 15}, {"resnet56", 27}};
  for (const auto& [name, blocks] : want) EXPECT_EQ(models::create_model(name)->num_blocks(), blocks) << name;
}

TEST(ModelsResNet, ZeroInitResidualZeroesExactlyTheLastBranchNorm) {
  // name -> the BatchNorm that ends each residual branch.
  const std::map<std::string, std::string> last_bn = {{"resnet18", "bn2"}, {"resnet50", "bn3"}, {"resnet20", "bn2"}};
  for (const auto& [name, bn] : last_bn) {
    SCOPED_TRACE(name);
    auto plain = models::create_model(name, ModelOptions().num_classes(10));
    auto zeroed = models::create_model(name, ModelOptions().num_classes(10).zero_init_residual(true));
    int64_t zero_count = 0;
    for (const auto& [key, t] : state_of(*zeroed)) {
      // keys like layer2.1.bn2.weight
      const bool is_bn_weight = key.find(".bn") != std::string::npos || key.rfind("bn1.", 0) == 0;
      if (!is_bn_weight || key.size() < 7 || key.compare(key.size() - 7, 7, ".weight") != 0) continue;
      const bool should_be_zero = key.rfind("layer", 0) == 0 && key.find("." + bn + ".weight") != std::string::npos;
      if (should_be_zero) {
        EXPECT_TRUE(torch::equal(t, torch::zeros_like(t))) << key;
        ++zero_count;
      } else {
        EXPECT_TRUE(torch::equal(t, torch::ones_like(t))) << key;
      }
      EXPECT_TRUE(torch::equal(state_of(*plain).at(key), torch::ones_like(t))) << "without the option: " << key;
    }
    EXPECT_EQ(zero_count, zeroed->num_blocks());
  }
}

TEST(ModelsResNet, ChannelsLastGivesTheSameOutputs) {
  for (const std::string name : {"resnet18", "resnet50", "resnet20"}) {
    SCOPED_TRACE(name);
    const int64_t c = name == "resnet20" ? 1 : 3;
    torch::manual_seed(1);
    auto model = models::create_model(name, ModelOptions().num_classes(10).in_channels(c));
    auto x = torch::randn({2, c, 32, 32});
    model->eval();
    torch::NoGradGuard no_grad;
    const auto y = model->forward(x);

    std::vector<const void*> impls;
    for (const auto& p : model->parameters()) impls.push_back(p.unsafeGetTensorImpl());
    models::to_channels_last(*model);
    size_t i = 0;
    for (const auto& p : model->named_parameters()) {
      EXPECT_EQ(p.value().unsafeGetTensorImpl(), impls[i++]) << "parameter object replaced: " << p.key();
      if (p.value().dim() == 4) {
        EXPECT_TRUE(p.value().is_contiguous(torch::MemoryFormat::ChannelsLast)) << p.key();
      }
    }
    // A 3x3 weight with several input channels is channels_last only after a real conversion (1x1
    // weights, and conv1 of a 1-channel model, are both at once).
    EXPECT_FALSE(state_of(*model).at("layer1.0.conv2.weight").is_contiguous()) << "weights were not converted";
    const auto y_cl = model->forward(x.contiguous(torch::MemoryFormat::ChannelsLast));
    const double scale = y.abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(y_cl, y, 1e-4, 1e-5 * scale))
        << "max |diff| " << (y_cl - y).abs().max().item<double>() << " at scale " << scale;
  }
}

TEST(ModelsResNet, ForwardFlopsRejectsAWrongSampleShape) {
  auto model = models::create_model("resnet18");
  try {
    model->forward_flops({1, 32, 32});
    FAIL() << "forward_flops accepted 1 channel for a 3-channel model";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ResNet: expected a sample shape (3, H, W), got [1, 32, 32]"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------------------
// Summary.

TEST(ModelsSummary, ResNet18Table) {
  auto model = models::create_model("resnet18");
  // Per-child counts by hand: conv1 64*3*49 = 9408; bn1 128; layer1 2 * (2 * 64*64*9 + 2 * 128) = 147968;
  // layer2 (128*64*9 + 128*128*9 + 512 + 64*128 + 256) + (2 * 128*128*9 + 512) = 525568; layer3 2099712;
  // layer4 8393728; fc 512*1000 + 1000 = 513000; total 11,689,512 (torchvision). Forward at 224x224:
  // 2 * 1,814,073,344 (torchvision's hook count) = 3.628 GFLOPs; training 3x = 10.884.
  const std::string want =
      "ResNet, 8 blocks, sample 3x224x224\n"
      "  child     type                        parameters\n"
      "  conv1     Conv2d                           9,408\n"
      "  bn1       BatchNorm2d                        128\n"
      "  layer1    2 x BasicBlock                 147,968\n"
      "  layer2    2 x BasicBlock                 525,568\n"
      "  layer3    2 x BasicBlock               2,099,712\n"
      "  layer4    2 x BasicBlock               8,393,728\n"
      "  fc        Linear                         513,000\n"
      "total parameters                        11,689,512\n"
      "trainable parameters                    11,689,512\n"
      "forward GFLOPs per sample                    3.628\n"
      "training GFLOPs per sample (3x)             10.884\n";
  EXPECT_EQ(models::summarize(*model, {3, 224, 224}), want);

  // Small models keep 4 significant digits: ResNet-20 on 1x28x28 is 2 * 30,821,248 FLOPs (the hand
  // count in ModelsCifarResNet.FlopsByHand).
  const auto small = models::summarize(
      *models::create_model("resnet20", ModelOptions().num_classes(10).in_channels(1)), {1, 28, 28});
  EXPECT_NE(small.find("forward GFLOPs per sample                  0.06164\n"), std::string::npos) << small;
  EXPECT_NE(small.find("training GFLOPs per sample (3x)             0.1849\n"), std::string::npos) << small;
  EXPECT_NE(small.find("  layer1    3 x BasicBlock                  14,016\n"), std::string::npos) << small;

  // Frozen parameters are counted in the total only.
  for (auto& p : model->named_parameters()) {
    if (p.key().rfind("fc.", 0) == 0) p.value().set_requires_grad(false);
  }
  EXPECT_NE(models::summarize(*model, {3, 224, 224}).find("trainable parameters                    11,176,512"),
            std::string::npos)
      << models::summarize(*model, {3, 224, 224});
}

}  // namespace

}  // namespace test_models
