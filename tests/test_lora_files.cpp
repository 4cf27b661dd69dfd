// peft's LoRA adapter folders in and out (trainer/hf/peft.h): an adapter written here reads back as itself;
// other methods, variants this trainer does not compute, an adapter that does not fit the model and broken
// files are each one line naming the file (LoraFilesRefused: no Python, both toolchains); and against peft
// 0.21 itself where the reference Python has it (the 2.11 leg), for a tiny Llama and a tiny GPT-2: an
// adapter peft saved gives peft's logits here, and one written here gives our logits in
// PeftModel.from_pretrained.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "models/lora.h"
#include "models/registry.h"
#include "test_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/hf/families.h"
#include "trainer/hf/peft.h"

namespace test_lora_files {

using testutil::TempDir;
namespace fs = std::filesystem;
namespace hf = trainer::hf;

// The shape of the brief's tiny Llama: hidden 64, 2 layers, 4 heads over 2 key/value heads.
models::LlamaOptions tiny_llama() {
  return models::LlamaOptions().vocab_size(128).n_embd(64).n_layer(2).n_head(4).n_kv_head(2).intermediate_size(128)
      .context(32);
}

models::LoraOptions lora(int64_t rank, std::vector<std::string> targets) {
  models::LoraOptions o;
  o.rank = rank;
  o.alpha = 16;
  o.targets = std::move(targets);
  return o;
}

models::Model llama_with_lora(const models::LoraOptions& o, const models::LlamaOptions& shape = tiny_llama()) {
  auto model = models::create_model("llama", models::ModelOptions().llama(shape));
  models::add_lora(*model, o);
  return model;
}

// Every lora_B drawn from N(0, 0.1^2): peft's zeros would make a wrong copy of B go unseen.
void randomize_b(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : models::lora_state(model))
    if (name.find(".lora_B.") != std::string::npos) t.normal_(0.0, 0.1);
}

// An adapter folder written here for a tiny Llama (q_proj, v_proj, rank 4), to spoil in the tests below.
std::string good_adapter(const TempDir& dir) {
  torch::manual_seed(1);
  auto model = llama_with_lora(lora(4, {"q_proj", "v_proj"}));
  randomize_b(*model);
  const auto path = (dir / "adapter").string();
  hf::write_peft_adapter(models::lora_state(*model), lora(4, {"q_proj", "v_proj"}), path, "tiny/llama", false);
  return path;
}

void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const auto path = dir + "/adapter_config.json";
  auto c = nlohmann::json::parse(testutil::read_file(path));
  edit(c);
  testutil::write_file(path, c.dump(2));
}

std::string read_error(const std::string& dir) {
  return testutil::error_text([&] { hf::read_peft_adapter(dir); });
}

// ---- no Python ------------------------------------------------------------------------------------------

// What write_peft_adapter writes is peft's layout (names behind base_model.model., float32, {"format": "pt"},
// the config's keys) and reads back as the same options and tensors, which load into a fresh model.
TEST(LoraFilesRefused, WrittenAdapterReadsBackAndLoads) {
  TempDir dir;
  torch::manual_seed(1);
  auto model = llama_with_lora(lora(4, {"v_proj", "q_proj"}));
  randomize_b(*model);
  const auto path = (dir / "adapter").string();
  hf::write_peft_adapter(models::lora_state(*model), lora(4, {"v_proj", "q_proj"}), path, "tiny/llama", false);

  const auto file = trainer::read_safetensors(path + "/adapter_model.safetensors");
  EXPECT_EQ(file.metadata.at("format"), "pt");
  ASSERT_EQ(file.tensors.size(), 8u);  // 2 layers x (q_proj, v_proj) x (A, B)
  EXPECT_EQ(file.tensors[0].first.rfind("base_model.model.model.layers.", 0), 0u) << file.tensors[0].first;
  const auto c = nlohmann::json::parse(testutil::read_file(path + "/adapter_config.json"));
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["task_type"], "CAUSAL_LM");
  EXPECT_EQ(c["r"], 4);
  EXPECT_TRUE(c["lora_alpha"].is_number_integer());
  EXPECT_EQ(c["target_modules"], nlohmann::json({"q_proj", "v_proj"}));
  EXPECT_EQ(c["base_model_name_or_path"], "tiny/llama");
  EXPECT_EQ(c["fan_in_fan_out"], false);
  EXPECT_TRUE(c["modules_to_save"].is_null());

  const auto back = hf::read_peft_adapter(path);
  EXPECT_EQ(back.options.rank, 4);
  EXPECT_EQ(back.options.alpha, 16);
  EXPECT_EQ(back.options.targets, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(back.base_model, "tiny/llama");
  const auto own = models::lora_state(*model);
  ASSERT_EQ(back.tensors.size(), own.size());
  torch::manual_seed(2);
  auto fresh = llama_with_lora(lora(4, {"q_proj", "v_proj"}));
  hf::load_peft_adapter(*fresh, back, lora(4, {"q_proj", "v_proj"}), "model.lora_init_from adapter");
  const auto loaded = models::lora_state(*fresh);
  for (size_t i = 0; i < own.size(); ++i) {
    EXPECT_EQ(loaded[i].first, own[i].first);
    EXPECT_TRUE(torch::equal(loaded[i].second, own[i].second)) << own[i].first;
  }

  // peft's older torch.save form, adapter_model.bin, reads as the same tensors.
  testutil::write_file(path + "/adapter_model.bin", trainer::tensors_to_bytes(file.tensors));
  fs::remove(path + "/adapter_model.safetensors");
  const auto bin = hf::read_peft_adapter(path);
  ASSERT_EQ(bin.tensors.size(), back.tensors.size());
  for (size_t i = 0; i < bin.tensors.size(); ++i) {
    EXPECT_EQ(bin.tensors[i].first, back.tensors[i].first);
    EXPECT_TRUE(torch::equal(bin.tensors[i].second, back.tensors[i].second)) << bin.tensors[i].first;
  }
}

// Another method, a variant not computed here, and what changes which layers carry adapters: one line each,
// naming the config file. A plain layer name as a string (not a pattern) is read.
TEST(LoraFilesRefused, OtherMethodsAndVariantsAreOneLine) {
  TempDir dir;
  const auto path = good_adapter(dir);
  const auto config = path + "/adapter_config.json";
  auto error_with = [&](const std::string& key, const nlohmann::json& value) {
    edit_config(path, [&](nlohmann::json& c) { c[key] = value; });
    const auto e = read_error(path);
    good_adapter(dir);
    return e;
  };
  EXPECT_EQ(error_with("peft_type", "LOHA"), config + ": peft_type LOHA: a LOHA adapter; only LoRA is read");
  EXPECT_EQ(error_with("use_dora", true), config + ": use_dora is true: DoRA is not computed here; only plain LoRA is read");
  EXPECT_EQ(error_with("rank_pattern", {{"q_proj", 8}}),
            config + ": rank_pattern is {\"q_proj\":8}: per-layer ranks are not read here (one r for every layer); "
                     "only plain LoRA is read");
  EXPECT_EQ(error_with("lora_bias", true),
            config + ": lora_bias is true: a bias on lora_B is not computed here; only plain LoRA is read");
  EXPECT_EQ(error_with("layers_to_transform", 0),
            config + ": layers_to_transform is 0: adapters on some layers only are not read here; only plain LoRA is read");
  EXPECT_EQ(error_with("modules_to_save", {"lm_head"}),
            config + ": modules_to_save is [\"lm_head\"]: fully trained modules beside the adapters are not read here; "
                     "only plain LoRA is read");
  EXPECT_EQ(error_with("bias", "all"), config + ": bias is \"all\": trained biases are not read here (only bias \"none\")");
  EXPECT_EQ(error_with("target_modules", ".*\\.(q|v)_proj"),
            config + ": target_modules is the pattern \".*\\\\.(q|v)_proj\": a regular expression is not read here; list the "
                     "layer names instead (e.g. [\"q_proj\", \"v_proj\"])");
  // What only decides how A and B started is no difference to the product.
  for (const auto& [key, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"init_lora_weights", "pissa"}, {"init_lora_weights", "eva"}, {"fan_in_fan_out", true}, {"use_dora", false},
           {"rank_pattern", nlohmann::json::object()}, {"loftq_config", nlohmann::json::object()}}) {
    EXPECT_EQ(error_with(key, value), "(no exception)") << key << " " << value.dump();
  }
  edit_config(path, [](nlohmann::json& c) { c["target_modules"] = "q_proj"; });
  EXPECT_EQ(hf::read_peft_adapter(path).options.targets, std::vector<std::string>{"q_proj"});
}

// An adapter that does not fit the model: one line naming the source and the first difference; nothing is
// copied then.
TEST(LoraFilesRefused, AdapterThatDoesNotFitTheModelIsOneLine) {
  TempDir dir;
  const auto adapter = hf::read_peft_adapter(good_adapter(dir));
  const std::string source = "model.lora_init_from DIR";
  auto error_loading = [&](const models::LoraOptions& o, const models::LlamaOptions& shape = tiny_llama()) {
    auto model = llama_with_lora(o, shape);
    return testutil::error_text([&] { hf::load_peft_adapter(*model, adapter, o, source); });
  };
  EXPECT_EQ(error_loading(lora(16, {"q_proj", "v_proj"})), source + ": rank 4, but model.lora.rank is 16");
  EXPECT_EQ(error_loading(lora(4, {"q_proj", "k_proj", "v_proj"})),
            source + ": target_modules q_proj, v_proj, but model.lora.targets is k_proj, q_proj, v_proj");
  EXPECT_EQ(error_loading(lora(4, {"q_proj", "v_proj"}), tiny_llama().n_layer(3)),
            source + ": the adapter has no model.layers.2.self_attn.q_proj.lora_A.weight (the model adapts "
                     "model.layers.2.self_attn.q_proj)");
  EXPECT_EQ(error_loading(lora(4, {"q_proj", "v_proj"}), tiny_llama().n_layer(1)),
            source + ": model.layers.1.self_attn.q_proj.lora_A.weight is in the adapter, but the model has no such adapter");
  EXPECT_EQ(error_loading(lora(4, {"q_proj", "v_proj"}), tiny_llama().n_embd(32).n_head(2).n_kv_head(1)),
            source + ": model.layers.0.self_attn.q_proj.lora_A.weight is [4, 64] in the adapter, but [4, 32] in the model");
  auto plain = models::create_model("llama", models::ModelOptions().llama(tiny_llama()));
  EXPECT_EQ(testutil::error_text([&] { hf::load_peft_adapter(*plain, adapter, lora(4, {"q_proj"}), source); }),
            source + ": the model has no LoRA adapters to load into (model.lora.rank is 0)");

  // A refused load leaves the adapters as they were.
  auto model = llama_with_lora(lora(4, {"q_proj", "v_proj"}), tiny_llama().n_layer(1));
  const auto before = models::lora_state(*model).front().second.clone();
  EXPECT_THROW(hf::load_peft_adapter(*model, adapter, lora(4, {"q_proj", "v_proj"}), source), std::runtime_error);
  EXPECT_TRUE(torch::equal(models::lora_state(*model).front().second, before));
}

// Broken folders: no weights, no config, malformed JSON, a tensor that is not an adapter's (DoRA's magnitude,
// a module saved whole), a lone lora_A. One line each, naming the file.
TEST(LoraFilesRefused, BrokenFoldersAreOneLine) {
  TempDir dir;
  const auto path = good_adapter(dir);
  const auto weights = path + "/adapter_model.safetensors";
  EXPECT_EQ(read_error((dir / "none").string()), (dir / "none").string() +
            ": no such folder (a peft adapter folder: adapter_config.json and adapter_model.safetensors)");
  fs::remove(weights);
  EXPECT_EQ(read_error(path), path + ": no adapter_model.safetensors or adapter_model.bin (not a peft adapter folder?)");
  testutil::write_file(path + "/adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": ");
  EXPECT_EQ(read_error(path), path + "/adapter_config.json: not valid JSON");
  fs::remove(path + "/adapter_config.json");
  EXPECT_EQ(read_error(path), path + "/adapter_config.json: no such file (not a peft adapter folder?)");

  auto with_tensors = [&](const trainer::NamedTensors& tensors) {
    good_adapter(dir);
    trainer::write_safetensors(weights, tensors);
    return read_error(path);
  };
  const std::string layer = "base_model.model.model.layers.0.self_attn.q_proj";
  const auto a = torch::zeros({4, 64}), b = torch::zeros({64, 4});
  EXPECT_EQ(with_tensors({{layer + ".lora_A.weight", a},
                          {layer + ".lora_B.weight", b},
                          {layer + ".lora_magnitude_vector", torch::ones({64})}}),
            weights + ": " + layer + ".lora_magnitude_vector is DoRA's magnitude vector: DoRA is not computed here");
  EXPECT_EQ(with_tensors({{"base_model.model.lm_head.weight", torch::zeros({128, 64})}}),
            weights + ": base_model.model.lm_head.weight is not a LoRA adapter's tensor (only *.lora_A.weight and "
                      "*.lora_B.weight are read)");
  EXPECT_EQ(with_tensors({{layer + ".lora_A.weight", a}}),
            weights + ": model.layers.0.self_attn.q_proj has lora_A but no lora_B");
  EXPECT_EQ(with_tensors({{layer + ".lora_A.weight", torch::zeros({8, 64})}, {layer + ".lora_B.weight", b}}),
            weights + ": " + layer + ".lora_A.weight is [8, 64], but r is 4");
  EXPECT_EQ(with_tensors({{"model.layers.0.self_attn.q_proj.lora_A.weight", a}}),
            weights + ": model.layers.0.self_attn.q_proj.lora_A.weight is not under base_model.model. (not a peft adapter file?)");
}

// ---- against peft ---------------------------------------------------------------------------------------

std::string ref_script() { return testutil::source_dir() + "/tests/ref/peft_ref.py"; }
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_PEFT()                                                                                  \
  if (!missing_module().empty())                                                                             \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()    \
               << " (scripts/install-torch.sh installs safetensors, transformers and peft into the 2.11 venv)"

// Our model for a base folder that transformers saved: the Llama family's or GPT-2's config.json, the
// weights as model.init_from loads them.
models::Model model_from_folder(const fs::path& folder, bool gpt2) {
  const auto config = hf::read_config_json((folder / "config.json").string());
  models::Model model;
  if (gpt2) {
    const auto g = hf::gpt2_from_json(config, folder.string());
    model = models::create_model("gpt2", models::ModelOptions().vocab_size(g.vocab_size()).context(g.context())
                                             .n_layer(g.n_layer()).n_head(g.n_head()).n_embd(g.n_embd()));
  } else {
    const auto shape = hf::llama_from_json(config, folder.string()).options;
    model = models::create_model("llama", models::ModelOptions().llama(shape));
  }
  trainer::load_weights(*model, folder.string());
  return model;
}

torch::Tensor logits_of(models::Model& model, const torch::Tensor& x) {
  model->eval();
  torch::NoGradGuard no_grad;
  return model->forward(x);  // (B, T, V)
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// peft's own folders (r 4, alpha 16, dropout 0.05, random B) for a Llama on q/k/v/o_proj and a GPT-2 on its
// Conv1D c_attn: read, loaded into our model of the base folder, they give PeftModel's logits.
TEST(LoraFiles, PeftsAdaptersGivePeftsLogits) {
  SKIP_WITHOUT_PEFT();
  TempDir dir;
  const auto w = testutil::run(testutil::python() + " " + ref_script() + " write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;
  for (const std::string kind : {"llama", "gpt2"}) {
    SCOPED_TRACE(kind);
    const auto adapter = hf::read_peft_adapter((dir / kind / "adapter").string());
    EXPECT_EQ(adapter.options.rank, 4);
    EXPECT_EQ(adapter.options.alpha, 16);
    EXPECT_DOUBLE_EQ(adapter.options.dropout, 0.05);
    auto model = model_from_folder(dir / kind / "base", kind == "gpt2");
    models::add_lora(*model, adapter.options);
    const auto ref = trainer::read_safetensors((dir / kind / "ref.safetensors").string()).tensors;
    const auto& x = ref[0].first == "x" ? ref[0].second : ref[1].second;
    const auto& want = ref[0].first == "logits" ? ref[0].second : ref[1].second;
    const auto base = logits_of(model, x);
    hf::load_peft_adapter(*model, adapter, adapter.options, (dir / kind / "adapter").string());
    const auto got = logits_of(model, x);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LT(max_difference(got, want), 1e-5);
    EXPECT_GT(max_difference(base, want), 1e-2);  // the adapter matters
  }
}

// A random base model of ours in `folder`/base as `trainer export --layout hf` writes it (config.json and
// transformers' names), then adapters (rank 4, alpha 16, rsLoRA, random B) in `folder`/adapter and a token
// batch in `folder`/tokens.safetensors. Returns our logits for the batch.
torch::Tensor write_ours(const fs::path& folder, bool gpt2) {
  fs::create_directories(folder / "base");
  torch::manual_seed(gpt2 ? 5 : 4);
  const auto gpt_shape = models::GPTOptions().vocab_size(128).context(32).n_layer(2).n_head(4).n_embd(64);
  const auto shape = models::ModelOptions().vocab_size(128).context(32).n_layer(2).n_head(4).n_embd(64);
  auto model = gpt2 ? models::create_model("gpt2", shape) : models::create_model("llama", models::ModelOptions().llama(tiny_llama()));
  const auto state = trainer::named_state(*model);
  trainer::write_safetensors((folder / "base/model.safetensors").string(),
                             gpt2 ? trainer::from_our_layout(state, trainer::Layout::hf) : state, {{"format", "pt"}});
  const auto config = gpt2 ? hf::gpt2_to_json(gpt_shape) : hf::llama_to_json(tiny_llama());
  testutil::write_file(folder / "base/config.json", config.dump(2));

  auto o = gpt2 ? lora(4, {"c_attn"}) : lora(4, {"q_proj", "k_proj", "v_proj", "o_proj"});
  o.use_rslora = true;
  const auto x = torch::randint(0, 128, {2, 12}, torch::kLong);
  const auto base = logits_of(model, x);
  models::add_lora(*model, o);
  randomize_b(*model);
  hf::write_peft_adapter(models::lora_state(*model), o, (folder / "adapter").string(), "", gpt2);
  trainer::write_safetensors((folder / "tokens.safetensors").string(), {{"x", x}});
  const auto ours = logits_of(model, x);
  EXPECT_GT(max_difference(base, ours), 1e-2);  // the adapter matters
  return ours;
}

// Our adapters for our Llama (q/k/v/o_proj) and GPT-2 (c_attn), written here: peft's from_pretrained reads
// their config as written, finds every key and no other, and computes our logits.
TEST(LoraFiles, AdaptersWrittenHereGiveOurLogitsInPeft) {
  SKIP_WITHOUT_PEFT();
  TempDir dir;
  std::map<std::string, torch::Tensor> ours;
  for (const std::string kind : {"llama", "gpt2"}) ours[kind] = write_ours(dir / kind, kind == "gpt2");
  const auto l = testutil::run(testutil::python() + " " + ref_script() + " load " + dir.str());
  ASSERT_EQ(l.exit_code, 0) << l.output;
  EXPECT_NE(l.output.find("llama config 4 16 True False k_proj,o_proj,q_proj,v_proj\n"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("gpt2 config 4 16 True True c_attn\n"), std::string::npos) << l.output;
  for (const std::string kind : {"llama", "gpt2"}) {
    SCOPED_TRACE(kind);
    EXPECT_NE(l.output.find(kind + " warnings 0\n"), std::string::npos) << l.output;
    const auto out = trainer::read_safetensors((dir / kind / "out.safetensors").string()).tensors;
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0].second.sizes(), ours[kind].sizes());
    EXPECT_LT(max_difference(out[0].second, ours[kind]), 1e-5);
  }
}

}  // namespace test_lora_files
