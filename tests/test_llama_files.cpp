// Hub folders of the Llama family in and out (trainer/hf/families.h, trainer/checkpoint/weights.h,
// `trainer sample`, `trainer export --layout hf`): config.json in transformers 4.x's and 5.x's forms,
// written and read back, sharded safetensors, and the bad files a user may bring, each one line and exit 2
// (no Python needed, both toolchains); and against transformers itself where the reference Python has it
// (the 2.11 leg): greedy `trainer sample` from a sharded Hub folder equals generate(do_sample=False), and a
// fine-tuned export loads with from_pretrained, with no key missing or left over, and gives our logits.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>

#include "data/files/token_h5.h"
#include "data/samples/token_loader.h"
#include "models/llama.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/config/config.h"
#include "trainer/hf/families.h"
#include "trainer/run/from_config.h"

namespace test_llama_files {

using testutil::TempDir;
namespace fs = std::filesystem;
namespace hf = trainer::hf;

// ---- config.json --------------------------------------------------------------------------------------

// Llama 3.2 1B's config.json as transformers 4.x writes it (rope_theta and rope_scaling at the top).
const char* kLlama32V4 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
  "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
  "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": true,
  "vocab_size": 128256})";

// The same model as transformers 5.x writes it (rope_parameters).
const char* kLlama32V5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
  "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
  "original_max_position_embeddings": 8192, "rope_type": "llama3", "rope_theta": 500000.0},
  "tie_word_embeddings": true, "dtype": "bfloat16", "transformers_version": "5.0.0", "vocab_size": 128256})";

void expect_same(const models::LlamaOptions& a, const models::LlamaOptions& b) {
  EXPECT_EQ(a.vocab_size(), b.vocab_size());
  EXPECT_EQ(a.context(), b.context());
  EXPECT_EQ(a.n_layer(), b.n_layer());
  EXPECT_EQ(a.n_head(), b.n_head());
  EXPECT_EQ(a.kv_heads(), b.kv_heads());
  EXPECT_EQ(a.n_embd(), b.n_embd());
  EXPECT_EQ(a.head_size(), b.head_size());
  EXPECT_EQ(a.intermediate_size(), b.intermediate_size());
  EXPECT_EQ(a.rms_norm_eps(), b.rms_norm_eps());
  EXPECT_EQ(a.rope_theta(), b.rope_theta());
  EXPECT_EQ(a.rope_scaling().type(), b.rope_scaling().type());
  EXPECT_EQ(a.rope_scaling().factor(), b.rope_scaling().factor());
  EXPECT_EQ(a.rope_scaling().low_freq_factor(), b.rope_scaling().low_freq_factor());
  EXPECT_EQ(a.rope_scaling().high_freq_factor(), b.rope_scaling().high_freq_factor());
  EXPECT_EQ(a.rope_scaling().original_context(), b.rope_scaling().original_context());
  EXPECT_EQ(a.qkv_bias(), b.qkv_bias());
  EXPECT_EQ(a.tie_embeddings(), b.tie_embeddings());
}

// Both forms of Llama 3.2 1B's config.json read as its registered shape (models/llama.h llama3_2_1b).
TEST(HfConfig, BothFormsOfLlama32ReadAsItsPublishedShape) {
  const auto v4 = hf::llama_from_json(nlohmann::json::parse(kLlama32V4), "v4/config.json");
  const auto v5 = hf::llama_from_json(nlohmann::json::parse(kLlama32V5), "v5/config.json");
  EXPECT_EQ(v4.model_type, "llama");
  expect_same(v4.options, models::llama3_2_1b());
  expect_same(v5.options, models::llama3_2_1b());
  EXPECT_TRUE(v4.notes.empty());
}

// What we write reads back as the same options, for each registered shape.
TEST(HfConfig, WrittenConfigReadsBackAsTheSameShape) {
  for (const auto& o : {models::llama_tiny(), models::smollm2_135m(), models::llama3_2_1b(), models::qwen2_5_0_5b()}) {
    const nlohmann::json j = hf::llama_to_json(o, 1, 2);
    EXPECT_EQ(j["model_type"], o.qkv_bias() ? "qwen2" : "llama");
    EXPECT_EQ(j["bos_token_id"], 1);
    expect_same(hf::llama_from_json(j, "config.json").options, o);
  }
}

// Qwen2 has q/k/v biases whatever its config says; Mistral's sliding window bounds the context.
TEST(HfConfig, Qwen2BiasesAndMistralsWindow) {
  const auto qwen = hf::llama_from_json(
      {{"model_type", "qwen2"}, {"vocab_size", 100}, {"hidden_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
       {"num_key_value_heads", 2}, {"intermediate_size", 64}, {"rope_theta", 1e6}, {"tie_word_embeddings", true}},
      "q");
  EXPECT_TRUE(qwen.options.qkv_bias());
  EXPECT_TRUE(qwen.options.tie_embeddings());
  EXPECT_EQ(qwen.options.rope_theta(), 1e6);
  const auto mistral = hf::llama_from_json(
      {{"model_type", "mistral"}, {"vocab_size", 100}, {"hidden_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
       {"num_key_value_heads", 2}, {"intermediate_size", 64}, {"max_position_embeddings", 32768}, {"sliding_window", 4096}},
      "m");
  EXPECT_EQ(mistral.options.context(), 4096);
  ASSERT_EQ(mistral.notes.size(), 1u);
  EXPECT_FALSE(mistral.options.qkv_bias());
}

std::string error_of(const nlohmann::json& j) {
  try {
    hf::llama_from_json(j, "x/config.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// Sizes past the bounds, and what is not computed here, are one line naming the file and the key.
TEST(HfConfig, AbsurdOrUnsupportedConfigsAreOneLine) {
  const auto base = nlohmann::json::parse(kLlama32V4);
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    auto j = base;
    j[key] = value;
    return j;
  };
  EXPECT_EQ(error_of(with("hidden_size", 192000000)),
            "x/config.json: hidden_size 192000000 is outside [1, 65536] (past any published model: a corrupt or hostile file?)");
  EXPECT_EQ(error_of(with("vocab_size", -3)), "x/config.json: vocab_size -3 is outside [1, 16777216]");
  EXPECT_EQ(error_of(with("num_hidden_layers", "16")), "x/config.json: num_hidden_layers is \"16\", not an integer");
  EXPECT_EQ(error_of(with("hidden_act", "gelu")), "x/config.json: hidden_act 'gelu' is not computed here (the Llama family's is silu)");
  EXPECT_EQ(error_of(with("attention_bias", true)),
            "x/config.json: attention_bias: true (a bias on o_proj too) is not computed here; Qwen2's q/k/v biases are");
  EXPECT_EQ(error_of(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}})),
            "x/config.json: rope_scaling.rope_type 'yarn' is not computed here (default and llama3 are)");
  EXPECT_EQ(error_of(with("model_type", "bert")), "x/config.json: model_type \"bert\" is not of the Llama family (llama, qwen2, mistral)");
  EXPECT_NE(error_of(with("num_key_value_heads", 5)).find("x/config.json: "), std::string::npos);
  EXPECT_EQ(error_of(with("num_key_value_heads", 5)).find('\n'), std::string::npos);
}

// transformers 5.23 (PreTrainedConfig.convert_rope_params_to_dict) reads a 4.x rope_scaling written beside
// 5.x's rope_parameters instead of it, with rope_theta from rope_scaling, else the top level, else 10000:
// Llama 3.2's rope_parameters with a llama3 rope_scaling of factor 8 and no rope_theta is a model of theta
// 10000 and factor 8 there (AutoConfig.from_pretrained prints rope_parameters {'rope_type': 'llama3',
// 'factor': 8.0, ..., 'rope_theta': 10000.0}), and a yarn rope_scaling is not computed here.
TEST(HfConfig, ARopeScalingBesideRopeParametersIsReadAsTransformers5ReadsIt) {
  auto j = nlohmann::json::parse(kLlama32V5);
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 2.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 4096}};
  const auto mixed = hf::llama_from_json(j, "x/config.json");
  EXPECT_EQ(mixed.options.rope_theta(), 10000.0);
  EXPECT_EQ(mixed.options.rope_scaling().type(), "llama3");
  EXPECT_EQ(mixed.options.rope_scaling().factor(), 8.0);
  EXPECT_EQ(mixed.options.rope_scaling().low_freq_factor(), 2.0);
  EXPECT_EQ(mixed.options.rope_scaling().original_context(), 4096);
  ASSERT_EQ(mixed.notes.size(), 1u);
  EXPECT_NE(mixed.notes[0].find("rope_scaling is read"), std::string::npos) << mixed.notes[0];
  j["rope_theta"] = 250000.0;  // the top level's rope_theta, where rope_scaling has none
  EXPECT_EQ(hf::llama_from_json(j, "x/config.json").options.rope_theta(), 250000.0);
  j["rope_scaling"]["rope_theta"] = 7.0;  // rope_scaling's own first
  EXPECT_EQ(hf::llama_from_json(j, "x/config.json").options.rope_theta(), 7.0);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_EQ(error_of(j), "x/config.json: rope_scaling.rope_type 'yarn' is not computed here (default and llama3 are); "
                         "transformers 5 reads rope_scaling over rope_parameters");
  // An empty or null rope_scaling leaves rope_parameters read, and our own files (both forms, the same) read
  // without a note.
  for (const nlohmann::json& none : {nlohmann::json::object(), nlohmann::json(nullptr)}) {
    j["rope_scaling"] = none;
    const auto v5 = hf::llama_from_json(j, "x/config.json");
    expect_same(v5.options, models::llama3_2_1b());
    EXPECT_TRUE(v5.notes.empty());
  }
  EXPECT_TRUE(hf::llama_from_json(hf::llama_to_json(models::llama3_2_1b()), "x").notes.empty());
}

// A rope factor below 1 (transformers only warns) is one line, in either form and for either type.
TEST(HfConfig, ARopeFactorBelowOneIsOneLine) {
  for (const char* form : {"rope_scaling", "rope_parameters"})
    for (const char* type : {"llama3", "default"})
      for (const double factor : {0.0, 0.5}) {
        auto j = nlohmann::json::parse(form == std::string("rope_scaling") ? kLlama32V4 : kLlama32V5);
        j[form]["rope_type"] = type;
        j[form]["factor"] = factor;
        EXPECT_EQ(error_of(j), std::string("x/config.json: ") + form + ".factor " + nlohmann::json(factor).dump() +
                                   " is below 1 (a rope scaling's factor is at least 1)");
      }
}

// ---- sharded safetensors --------------------------------------------------------------------------------

// Two shards and their index, as save_pretrained writes them: read as one set of tensors, from the folder or
// the index; a shard name with a path in it, or a tensor not where the index says, is one line.
TEST(HfShards, AFolderOfShardsReadsAsOneFile) {
  TempDir dir;
  const auto a = torch::arange(6, torch::kFloat).reshape({2, 3}), b = torch::ones({4});
  trainer::write_safetensors((dir / "model-00001-of-00002.safetensors").string(), {{"a", a}}, {{"format", "pt"}});
  trainer::write_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"b", b}}, {{"format", "pt"}});
  nlohmann::json index = {{"metadata", {{"total_size", 40}}},
                          {"weight_map", {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}};
  testutil::write_file(dir / "model.safetensors.index.json", index.dump());
  for (const std::string& path : {dir.str(), (dir / "model.safetensors.index.json").string()}) {
    const auto w = trainer::read_weights(path);
    ASSERT_EQ(w.tensors.size(), 2u);
    for (const auto& [k, t] : w.tensors) EXPECT_TRUE(torch::equal(t, k == "a" ? a : b)) << k;
  }
  index["weight_map"]["b"] = "../model-00002-of-00002.safetensors";
  testutil::write_file(dir / "model.safetensors.index.json", index.dump());
  EXPECT_EQ(testutil::error_text([&] { trainer::read_weights(dir.str()); }),
            (dir / "model.safetensors.index.json").string() +
                ": weight_map[b] is \"../model-00002-of-00002.safetensors\", not a file name beside the index");
  index["weight_map"]["b"] = "model-00001-of-00002.safetensors";
  testutil::write_file(dir / "model.safetensors.index.json", index.dump());
  EXPECT_EQ(testutil::error_text([&] { trainer::read_weights(dir.str()); }),
            (dir / "model.safetensors.index.json").string() + ": b is not in " + dir.str() +
                "/model-00001-of-00002.safetensors, where the index puts it");
  testutil::write_file(dir / "model.safetensors.index.json", "[1, 2");
  EXPECT_EQ(testutil::error_text([&] { trainer::read_weights(dir.str()); }),
            (dir / "model.safetensors.index.json").string() + ": not a safetensors index (a JSON object with a weight_map)");
}

// ---- the commands, with bad files -----------------------------------------------------------------------

// A Hub folder of a llama_tiny-shaped model written by us (export --layout hf is tested against transformers
// below; here only the files matter): config.json + model.safetensors.
void write_folder(const fs::path& dir, const models::LlamaOptions& o) {
  fs::create_directories(dir);
  torch::manual_seed(0);
  models::LlamaImpl model(o);
  trainer::NamedTensors tensors;
  for (const auto& item : model.named_parameters()) tensors.emplace_back(item.key(), item.value().detach());
  trainer::write_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
  testutil::write_file(dir / "config.json", hf::llama_to_json(o).dump(2));
}

models::LlamaOptions small() {
  return models::LlamaOptions().vocab_size(256).context(64).n_layer(2).n_head(4).n_kv_head(2).n_embd(32).intermediate_size(48);
}

std::string train_cmd(const fs::path& run, const std::string& extra) {
  return testutil::trainer_cmd(run.string(), "--set model.name=llama --set data.kind=synthetic --set model.context=16"
                                             " --set train.global_batch=4 --set train.epochs=0 --set train.steps=2 --set train.threads=1"
                                             " --set data.synthetic_size=16 --set log.every=1 " + extra);
}

// A config.json that contradicts its weights, asks for an absurd size, or is not there: one line, exit 2,
// before any allocation; `model.name: llama` with nothing to read its shape from is a config error.
TEST(HfCommands, BadHubFoldersAreOneLineAndExit2) {
  TempDir dir;
  write_folder(dir / "hf", small());
  auto j = nlohmann::json::parse(testutil::read_file(dir / "hf/config.json"));
  j["num_hidden_layers"] = 3;
  testutil::write_file(dir / "hf/config.json", j.dump());
  auto r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf").string() + " --prompt a --tokens 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: " + (dir / "hf/config.json").string() +
                          ": config.json says num_hidden_layers 3, but the weights have no model.layers.2\n");
  r = testutil::run(train_cmd(dir / "run", "--set model.init_from=" + (dir / "hf").string()));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("error: " + (dir / "hf/config.json").string() + ": config.json says num_hidden_layers 3"),
            std::string::npos) << r.output;
  j["num_hidden_layers"] = 2;
  j["hidden_size"] = 192000000;
  testutil::write_file(dir / "hf/config.json", j.dump());
  r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf").string() + " --prompt a --tokens 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: " + (dir / "hf/config.json").string() +
                          ": hidden_size 192000000 is outside [1, 65536] (past any published model: a corrupt or hostile file?)\n");
  // GPT-2's config.json is held to the same bounds.
  testutil::write_file(dir / "hf/config.json", R"({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64,
      "n_embd": 192000000, "n_layer": 2, "n_head": 4})");
  r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf").string() + " --prompt a --tokens 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: " + (dir / "hf/config.json").string() +
                          ": n_embd 192000000 is outside [1, 65536] (past any published model: a corrupt or hostile file?)\n");
  r = testutil::run(train_cmd(dir / "run2", ""));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("'model.name': llama takes its shape from a transformers config.json"), std::string::npos)
      << r.output;
  // A rope factor below 1, and a rope_scaling beside rope_parameters of a type not computed here.
  j = hf::llama_to_json(small());
  j["rope_parameters"]["factor"] = 0.5;
  testutil::write_file(dir / "hf/config.json", j.dump());
  r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf").string() + " --prompt a --tokens 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: " + (dir / "hf/config.json").string() +
                          ": rope_parameters.factor 0.5 is below 1 (a rope scaling's factor is at least 1)\n");
  j = hf::llama_to_json(small());
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  testutil::write_file(dir / "hf/config.json", j.dump());
  r = testutil::run(train_cmd(dir / "run3", "--set model.init_from=" + (dir / "hf").string()));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("error: " + (dir / "hf/config.json").string() + ": rope_scaling.rope_type 'yarn' is not "
                          "computed here (default and llama3 are); transformers 5 reads rope_scaling over rope_parameters"),
            std::string::npos) << r.output;
}

// A run of model.name llama from a Hub folder: trains, and its export in the hf layout is the folder's
// config.json again (the same shape) with weights that load back by name.
TEST(HfCommands, FineTuneFromAFolderAndExportItAgain) {
  TempDir dir;
  const auto o = small().tie_embeddings(true).rope_theta(500000.0).rope_scaling(
      models::RopeScaling().type("llama3").factor(4.0).original_context(16));
  write_folder(dir / "hf", o);
  auto r = testutil::run(train_cmd(dir / "run", "--set model.init_from=" + (dir / "hf").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Hugging Face Llama family"), std::string::npos) << r.output;
  fs::create_directories(dir / "out");
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + (dir / "run").string() + " --layout hf --format "
                    "safetensors --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("transformers.LlamaForCausalLM.from_pretrained('" + (dir / "out").string() + "')"), std::string::npos)
      << r.output;
  const auto back = hf::llama_from_json(hf::read_config_json((dir / "out/config.json").string()), "out");
  expect_same(back.options, o);
  models::LlamaImpl model(back.options);
  EXPECT_NO_THROW(trainer::load_weights(model, (dir / "out").string()));

  // `trainer sample --run-dir` builds the run's model from the folder's config.json, as eval and export do:
  // greedy, it draws the tokens of the same weights exported (`sample --init-from`, checked against
  // transformers below), and --run-dir with --init-from keeps the run's shape.
  std::vector<std::vector<int64_t>> drawn;
  for (const std::string from : {"--run-dir " + (dir / "run").string(), "--init-from " + (dir / "out").string(),
                                 "--run-dir " + (dir / "run").string() + " --init-from " + (dir / "out/model.safetensors").string()}) {
    SCOPED_TRACE(from);
    const auto json = dir / "sample.json";
    r = testutil::run(testutil::trainer_bin() + " sample " + from + " --prompt ab --tokens 8 --temperature 0 --device cpu"
                      " --json " + json.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    drawn.push_back(nlohmann::json::parse(testutil::read_file(json))["samples"][0]["tokens"].get<std::vector<int64_t>>());
    EXPECT_EQ(drawn.back().size(), 8u);
  }
  EXPECT_EQ(drawn[0], drawn[1]);
  EXPECT_EQ(drawn[2], drawn[1]);
}

// ---- against transformers ------------------------------------------------------------------------------

std::string ref_script() { return testutil::source_dir() + "/tests/ref/llama_files_ref.py"; }
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_TRANSFORMERS()                                                                           \
  if (!missing_module().empty())                                                                              \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()     \
               << " (scripts/install-torch.sh installs safetensors and transformers into the 2.11 venv)"

std::vector<double> numbers_after(const std::string& output, const std::string& key) {
  const auto at = output.find(key + " ");
  if (at == std::string::npos) return {};
  std::stringstream ss(output.substr(at + key.size() + 1, output.find('\n', at) - at - key.size() - 1));
  std::vector<double> v;
  for (std::string item; std::getline(ss, item, ',');) v.push_back(std::stod(item));
  return v;
}

// Our Llama built from `folder`'s config.json and weights, in eval mode: its logits (as doubles) at the last
// of `tokens` (comma-separated ids), to compare with the reference's.
torch::Tensor our_last_logits(const fs::path& folder, const std::string& tokens) {
  const auto arch = hf::llama_from_json(hf::read_config_json((folder / "config.json").string()),
                                        folder.filename().string());
  models::LlamaImpl model(arch.options);
  trainer::load_weights(model, folder.string());
  model.eval();
  torch::NoGradGuard no_grad;
  std::vector<int64_t> ids;
  for (double v : numbers_after("t " + tokens, "t")) ids.push_back(static_cast<int64_t>(v));
  const int64_t last = static_cast<int64_t>(ids.size()) - 1;
  return model.forward(torch::tensor(ids).unsqueeze(0)).select(1, last).squeeze(0).to(torch::kDouble);
}

// A random LlamaForCausalLM (GQA, untied, Llama 3's rope scaling past its original context) and a
// Qwen2ForCausalLM (q/k/v biases, tied), each saved by transformers in 4 shards: `trainer sample
// --temperature 0` from the folder draws generate(do_sample=False)'s tokens, with the cache and without.
TEST(HfLibraries, GreedySampleFromAShardedFolderEqualsTransformers) {
  SKIP_WITHOUT_TRANSFORMERS();
  for (const std::string kind : {"llama", "qwen2"}) {
    SCOPED_TRACE(kind);
    TempDir dir;
    auto w = testutil::run(testutil::python() + " " + ref_script() + " write " + dir.str() + " " + kind + " 48,49,50,51 24");
    ASSERT_EQ(w.exit_code, 0) << w.output;
    std::vector<int64_t> want;
    for (double v : numbers_after(w.output, "tokens")) want.push_back(static_cast<int64_t>(v));
    ASSERT_EQ(want.size(), 24u) << w.output;
    EXPECT_GT(numbers_after(w.output, "gap").at(0), 1e-3) << "a near-tie in the reference's greedy path";
    EXPECT_TRUE(fs::exists(dir / "hf/model.safetensors.index.json"));
    for (const char* cache : {"", " --no-kv-cache"}) {
      SCOPED_TRACE(cache);
      const auto json = dir / "out.json";
      auto r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf").string() +
                             " --prompt 0123 --tokens 24 --temperature 0 --device cpu --json " + json.string() + cache);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const auto j = nlohmann::json::parse(testutil::read_file(json));
      EXPECT_EQ(j["samples"][0]["tokens"].get<std::vector<int64_t>>(), want);
      EXPECT_EQ(j["n_kv_head"], 2);
    }
  }
}

// Fine-tuned from transformers' folder and exported: from_pretrained finds every key and no other, and its
// logits equal ours on the exported weights (fp32, 1e-5 of the largest).
TEST(HfLibraries, FineTunedExportLoadsInTransformersWithOurLogits) {
  SKIP_WITHOUT_TRANSFORMERS();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " write " + dir.str() + " llama 1,2 1");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  auto r = testutil::run(train_cmd(dir / "run", "--set model.init_from=" + (dir / "hf").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::create_directories(dir / "out");
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + (dir / "run").string() + " --layout hf --format "
                    "safetensors --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string tokens = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3,2,3,8,4,6,2,6,4,3,3,8,3,2,7,9,5,0,2,8,8,4,1,9,7";  // 40 > 16
  auto l = testutil::run(testutil::python() + " " + ref_script() + " load " + (dir / "out").string() + " " + tokens);
  ASSERT_EQ(l.exit_code, 0) << l.output;
  EXPECT_NE(l.output.find("missing 0\nunexpected 0\nclass LlamaForCausalLM\n"), std::string::npos) << l.output;
  const auto theirs = torch::tensor(numbers_after(l.output, "logits"), torch::kDouble);

  const auto ours = our_last_logits(dir / "out", tokens);
  ASSERT_EQ(ours.size(0), theirs.size(0));
  EXPECT_LT((ours - theirs).abs().max().item<double>(), 1e-5 * theirs.abs().max().item<double>());

  // `trainer sample --run-dir` on the fine-tuned run (its shape from the Hub folder's config.json): greedy,
  // generate(do_sample=False)'s tokens on the exported weights. The prompt "0123" is byte ids 48..51.
  auto g = testutil::run(testutil::python() + " " + ref_script() + " generate " + (dir / "out").string() + " 48,49,50,51 12");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  std::vector<int64_t> want;
  for (double v : numbers_after(g.output, "tokens")) want.push_back(static_cast<int64_t>(v));
  ASSERT_EQ(want.size(), 12u) << g.output;
  EXPECT_GT(numbers_after(g.output, "gap").at(0), 1e-4) << "a near-tie in the reference's greedy path";
  const auto json = dir / "sample.json";
  r = testutil::run(testutil::trainer_bin() + " sample --run-dir " + (dir / "run").string() +
                    " --prompt 0123 --tokens 12 --temperature 0 --device cpu --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(testutil::read_file(json))["samples"][0]["tokens"].get<std::vector<int64_t>>(), want);
}

// A config.json of 5.x's rope_parameters (default, theta 500000) with a 4.x rope_scaling beside it (llama3,
// factor 4 from an original context of 16) and no top-level rope_theta: transformers 5 computes theta 10000
// with the llama3 scaling, and so do we: its logits for 40 tokens (past the original context) equal ours.
TEST(HfLibraries, BothRopeFormsGiveTransformersLogits) {
  SKIP_WITHOUT_TRANSFORMERS();
  TempDir dir;
  write_folder(dir / "hf", small());
  auto j = hf::llama_to_json(small());
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 4.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 16}};
  testutil::write_file(dir / "hf/config.json", j.dump(2));
  const std::string tokens = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3,2,3,8,4,6,2,6,4,3,3,8,3,2,7,9,5,0,2,8,8,4,1,9,7";
  auto l = testutil::run(testutil::python() + " " + ref_script() + " load " + (dir / "hf").string() + " " + tokens);
  ASSERT_EQ(l.exit_code, 0) << l.output;
  EXPECT_NE(l.output.find("missing 0\nunexpected 0\n"), std::string::npos) << l.output;
  const auto theirs = torch::tensor(numbers_after(l.output, "logits"), torch::kDouble);

  const auto arch = hf::llama_from_json(hf::read_config_json((dir / "hf/config.json").string()), "hf");
  EXPECT_EQ(arch.options.rope_theta(), 10000.0);
  const auto ours = our_last_logits(dir / "hf", tokens);
  ASSERT_EQ(ours.size(0), theirs.size(0));
  EXPECT_LT((ours - theirs).abs().max().item<double>(), 1e-5 * theirs.abs().max().item<double>());
}

// 20 AdamW steps of a run from transformers' folder give, step by step, the losses of a plain PyTorch loop
// over transformers' own model from the same folder on the same batches (the run's own, from its loader),
// to 1e-4.
TEST(HfLibraries, TwentyAdamWStepsGiveTheLossesOfAPlainLoopOverTransformers) {
  SKIP_WITHOUT_TRANSFORMERS();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " write " + dir.str() + " llama_init 1,2 1");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const std::vector<std::string> sets = {
      "model.name=llama", "model.init_from=" + (dir / "hf").string(), "model.context=16", "data.kind=synthetic",
      "data.synthetic_size=24", "data.test=", "train.global_batch=4", "train.epochs=0", "train.steps=20", "seed=3",
      "optim.name=adamw", "optim.lr=1e-3", "optim.beta1=0.9", "optim.beta2=0.95", "optim.eps=1e-8",
      "optim.weight_decay=0", "optim.grad_clip=0", "schedule.name=constant", "schedule.warmup_steps=0",
      "train.threads=1", "log.every=1000"};
  std::string args;
  for (const auto& s : sets) args += " --set " + s;
  auto r = testutil::run(testutil::trainer_cmd((dir / "run").string(), args));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = testutil::step_lines((dir / "run").string());
  ASSERT_EQ(steps.size(), 20u);

  // The run's 20 batches, from the loader it used.
  const trainer::Config cfg = trainer::load_config("", sets);
  data::TokenLoaderOptions o;
  o.global_batch = cfg.train.global_batch;
  o.context = cfg.model.context;
  o.seed = cfg.seed;
  data::TokenLoader loader(trainer::synthetic_tokens(cfg), o);
  trainer::NamedTensors batches;
  for (int i = 0; i < 20; ++i) {
    const auto b = loader.next();
    batches.emplace_back("x" + std::to_string(i), b.images);
    batches.emplace_back("y" + std::to_string(i), b.labels);
  }
  trainer::write_safetensors((dir / "batches.safetensors").string(), batches);
  auto p = testutil::run(testutil::python() + " " + ref_script() + " train " + (dir / "hf").string() + " " +
                         (dir / "batches.safetensors").string() + " 1e-3");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const auto theirs = numbers_after(p.output, "losses");
  ASSERT_EQ(theirs.size(), 20u) << p.output;
  double worst = 0;
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_NEAR(steps[i]["loss"].get<double>(), theirs[i], 1e-4) << "step " << i + 1;
    worst = std::max(worst, std::abs(steps[i]["loss"].get<double>() - theirs[i]));
  }
  std::cout << "largest |loss difference| over the 20 steps: " << worst << "\n";
  EXPECT_LT(theirs.back(), theirs.front()) << "the loop learns";
}

// A Hub folder as the Hub has them (config.json, model.safetensors and a Llama 3-kind tokenizer.json whose
// post-processor puts <|begin_of_text|> first), made by transformers and tokenizers: `trainer sample` from
// the folder with its tokenizer gives transformers' tokenizer(prompt) ids and generate(do_sample=False)'s
// tokens; convert-text with that tokenizer begins each document with <|begin_of_text|> and ends it with
// <|end_of_text|>, and a run from the folder on those tokens samples while it trains.
TEST(HfLibraries, AHubFolderWithItsTokenizerFromTextToSamples) {
  SKIP_WITHOUT_TRANSFORMERS();
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ". DON'T PANIC!\n";
  fs::create_directories(dir / "docs");
  testutil::write_file(dir / "docs/a.txt", text);
  testutil::write_file(dir / "docs/b.txt", "Second document.\n");
  auto w = testutil::run(testutil::python() + " " + ref_script() + " hub " + dir.str() + " " + (dir / "docs/a.txt").string() +
                         " 'The quick fox' 16");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  EXPECT_GT(numbers_after(w.output, "gap").at(0), 1e-3) << "a near-tie in the reference's greedy path";
  std::vector<int64_t> prompt, want;
  for (double v : numbers_after(w.output, "prompt")) prompt.push_back(static_cast<int64_t>(v));
  for (double v : numbers_after(w.output, "tokens")) want.push_back(static_cast<int64_t>(v));
  ASSERT_EQ(want.size(), 16u) << w.output;
  const std::string hub = (dir / "hub").string(), tokenizer = hub + "/tokenizer.json";
  const auto json = dir / "sample.json";
  auto r = testutil::run(testutil::trainer_bin() + " sample --init-from " + hub + " --tokenizer " + tokenizer +
                         " --prompt 'The quick fox' --tokens 16 --temperature 0 --device cpu --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(testutil::read_file(json));
  EXPECT_EQ(j["prompt_tokens"].get<std::vector<int64_t>>(), prompt);
  EXPECT_EQ(j["samples"][0]["tokens"].get<std::vector<int64_t>>(), want);
  EXPECT_EQ(j["samples"][0]["text"].get<std::string>().rfind("The quick fox", 0), 0u) << "no <|begin_of_text|> shown";

  r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (dir / "docs").string() + " --tokenizer " + tokenizer +
                    " --val-fraction 0 --out " + (dir / "tokens").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const data::TokenDataset tokens((dir / "tokens/train.h5").string(), /*in_memory=*/true);
  std::vector<int64_t> ids(static_cast<size_t>(tokens.size()));
  tokens.read(0, tokens.size(), ids.data());
  const int64_t bos = prompt.at(0);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), bos), 2) << "one <|begin_of_text|> per document";
  EXPECT_EQ(ids.front(), bos);
  EXPECT_EQ(ids.back(), bos + 1) << "<|end_of_text|> ends the last document";
  EXPECT_EQ(tokens.vocab_size(), bos + 5) << "the vocabulary, then the five special tokens";

  r = testutil::run(train_cmd(dir / "run", "--set model.init_from=" + hub + " --set data.kind=tokens --set data.train=" +
                                           (dir / "tokens/train.h5").string() + " --set data.test= --set train.sample_every=2"
                                           " --set train.sample_tokens=4 --set 'train.sample_prompt=The quick'"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto samples = testutil::events((dir / "run").string(), "sample");
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0]["text"].get<std::string>().rfind("The quick", 0), 0u) << samples[0];
}

}  // namespace test_llama_files
