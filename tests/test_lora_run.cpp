// LoRA through the command line (trainer/run/lora.h, trainer/commands/export.h, `trainer sample --lora`):
// a LoRA run on a Hub folder's Llama, its checkpoint (the adapters and the base's fingerprint), a resume
// that is bitwise and one on another base that is refused, peft's folder out and back, the merged model,
// and greedy tokens from a peft adapter equal to peft's own generate. The references are peft 0.21 and
// transformers 5 (tests/ref/lora_run_ref.py; the 2.11 leg): where they are missing the suite is skipped,
// but for the refusals, which need no reference.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <sstream>

#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/weights.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_lora_run {

namespace {

using testutil::TempDir;
namespace fs = std::filesystem;

std::string ref_script() { return testutil::source_dir() + "/tests/ref/lora_run_ref.py"; }
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_PEFT_RUN()                                                                                   \
  if (!missing_module().empty())                                                                              \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()     \
               << " (scripts/install-torch.sh installs peft, transformers and safetensors into the 2.11 venv)"

double number_after(const std::string& output, const std::string& key) {
  const auto at = output.find(key + " ");
  return at == std::string::npos ? -1 : std::stod(output.substr(at + key.size() + 1));
}

// A LoRA job on the Hub folder `base` (byte tokens of `data`/train.h5), saving every 2 steps.
std::string job(const std::string& base, const std::string& data, int64_t steps, const std::string& extra = "") {
  return "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --set model.name=llama"
         " --set model.init_from=" + base + " --set model.context=32 --set data.train=" + data +
         "/train.h5 --set data.test= --set train.global_batch=4 --set train.steps=" + std::to_string(steps) +
         " --set train.threads=1 --set train.deterministic=true --set checkpoint.every_steps=2"
         " --set checkpoint.every_seconds=0 --set schedule.warmup_steps=0 --set schedule.name=constant"
         " --set optim.lr=1e-2 --set log.every=1000 --set model.lora.rank=4 --set model.lora.alpha=8"
         " --set 'model.lora.targets=[q_proj,v_proj]' " + extra;
}

class LoraRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("trainer_lora_run");
    if (!missing_module().empty()) return;
    auto r = testutil::run(testutil::python() + " " + ref_script() + " base " + dir_->str());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::string s;
    for (int i = 0; i < 200; ++i) s += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ".\n";
    testutil::write_file(*dir_ / "text.txt", s);
    r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (*dir_ / "text.txt").string() + " --out " +
                      data());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = testutil::run(testutil::trainer_cmd(run(), job(base(), data(), 4)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string base() { return (*dir_ / "hf").string(); }
  static std::string data() { return (*dir_ / "tokens").string(); }
  static std::string run() { return (*dir_ / "run").string(); }

  static TempDir* dir_;
};
TempDir* LoraRun::dir_ = nullptr;

}  // namespace

// The checkpoint holds the adapters alone (2 layers x q, v x A, B), and state.json the base's fingerprint; a
// run stopped at step 2 and resumed ends with the same adapters, bit for bit, as the one that ran through.
TEST_F(LoraRun, TheCheckpointHoldsTheAdaptersAndAResumeIsBitwise) {
  SKIP_WITHOUT_PEFT_RUN();
  const fs::path last = fs::path(run()) / "checkpoints/step-00000004";
  const auto adapters = trainer::read_tensors((last / "model.pt").string());
  ASSERT_EQ(adapters.size(), 8u);
  EXPECT_EQ(adapters[0].first, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(adapters[0].second.sizes(), torch::IntArrayRef({4, 64}));
  EXPECT_EQ(adapters[1].first, "model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_GT(adapters[1].second.abs().max().item<float>(), 0) << "B never moved from zero: nothing was trained";
  const auto state = nlohmann::json::parse(testutil::read_file(last / "state.json"));
  ASSERT_TRUE(state.contains("lora_base")) << state.dump();
  EXPECT_EQ(state["lora_base"]["files"], nlohmann::json::array({"model.safetensors"}));
  EXPECT_EQ(state["lora_base"]["crc32"].get<std::string>().size(), 8u);

  const std::string resumed = (*dir_ / "resumed").string();
  auto r = testutil::run(testutil::trainer_cmd(resumed, job(base(), data(), 2)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(resumed, job(base(), data(), 4)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const auto again = trainer::read_tensors(resumed + "/checkpoints/step-00000004/model.pt");
  ASSERT_EQ(again.size(), adapters.size());
  for (size_t i = 0; i < again.size(); ++i) EXPECT_TRUE(again[i].second.equal(adapters[i].second)) << again[i].first;
}

// `trainer eval` and `trainer sample` on the run build its base, add its adapters and load the latest
// checkpoint's: the scored loss is the adapted model's, not the base's (the adapters trained at lr 1e-2
// moved it), and sampling runs.
TEST_F(LoraRun, EvalAndSampleUseTheRunsBaseAndAdapters) {
  SKIP_WITHOUT_PEFT_RUN();
  const std::string split = data() + "/train.h5";
  auto r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run() + " --split " + split + " --out " +
                         (*dir_ / "eval.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lora: rank 4"), std::string::npos) << r.output;
  const double adapted = nlohmann::json::parse(testutil::read_file(*dir_ / "eval.json"))["loss"].get<double>();
  // The base alone: the same run's config without LoRA, from the Hub folder's weights.
  r = testutil::run(testutil::trainer_bin() + " eval --config " + run() + "/resolved_config.yaml --split " + split +
                    " --out " + (*dir_ / "eval_base.json").string() + " --set model.lora.rank=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double base_loss = nlohmann::json::parse(testutil::read_file(*dir_ / "eval_base.json"))["loss"].get<double>();
  EXPECT_TRUE(std::isfinite(adapted));
  EXPECT_GT(std::abs(adapted - base_loss), 1e-4) << "the adapters changed nothing: " << adapted << " " << base_loss;
  r = testutil::run(testutil::trainer_bin() + " sample --run-dir " + run() + " --prompt 'The ' --tokens 8 --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lora: rank 4"), std::string::npos) << r.output;
}

// The same run folder resumed on another base (other weights under the same names) is refused in one line.
TEST_F(LoraRun, AResumeOnAnotherBaseIsRefused) {
  SKIP_WITHOUT_PEFT_RUN();
  const std::string copy = (*dir_ / "copy").string();
  fs::copy(run(), copy, fs::copy_options::recursive);
  const auto r = testutil::run(testutil::trainer_cmd(copy, job((*dir_ / "other").string(), data(), 6)));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("trained on another base"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

// export --layout peft and --merge of one checkpoint: peft's PeftModel on the base with the exported folder
// computes the logits transformers computes from the merged model.
TEST_F(LoraRun, PeftLoadsTheExportedAdapterAndTheMergedModelAgrees) {
  SKIP_WITHOUT_PEFT_RUN();
  const std::string peft_dir = (*dir_ / "peft_out").string(), merged = (*dir_ / "merged").string();
  auto r = testutil::run(testutil::trainer_bin() + " export --run-dir " + run() + " --layout peft --out " + peft_dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::create_directories(merged);
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + run() + " --merge --layout hf --out " + merged +
                    "/model.safetensors");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::python() + " " + ref_script() + " merged " + dir_->str() + " " + peft_dir + " " + merged);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(number_after(r.output, "max_diff"), 1e-4) << r.output;
  EXPECT_GT(number_after(r.output, "adapter_diff"), 1e-3) << "the adapter changes nothing: the comparison is empty";
  // Without --merge the adapters are not a model: refused, naming what to do.
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + run() + " --layout hf --out " + merged + "/x.safetensors");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--layout peft"), std::string::npos) << r.output;
}

// A peft adapter (random B) on the Hub folder: `trainer sample --lora` draws peft's greedy tokens, and
// model.lora_init_from starts a run from the same adapter (its first checkpoint's A is peft's A).
TEST_F(LoraRun, SampleWithAPeftAdapterEqualsPeftGenerate) {
  SKIP_WITHOUT_PEFT_RUN();
  auto w = testutil::run(testutil::python() + " " + ref_script() + " adapter " + dir_->str() + " 48,49,50,51 12");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const auto want = testutil::ids_after(w.output, "tokens");
  ASSERT_EQ(want.size(), 12u) << w.output;
  EXPECT_GT(number_after(w.output, "gap"), 1e-3) << "near-tie in the reference's greedy path";
  const auto json = *dir_ / "sample.json";
  const std::string adapter = (*dir_ / "adapter").string();
  auto r = testutil::run(testutil::trainer_bin() + " sample --init-from " + base() + " --lora " + adapter +
                         " --prompt 0123 --tokens 12 --temperature 0 --device cpu --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(testutil::read_file(json))["samples"][0]["tokens"].get<std::vector<int64_t>>(), want);

  const std::string from = (*dir_ / "from_adapter").string();
  r = testutil::run(testutil::trainer_cmd(from, job(base(), data(), 2, "--set model.lora_init_from=" + adapter +
                                                                       " --set optim.lr=1e-30 --set schedule.min_lr=0")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ours = trainer::read_tensors(from + "/checkpoints/step-00000002/model.pt");
  const trainer::WeightsFile file = trainer::read_weights(adapter + "/adapter_model.safetensors");
  const auto& theirs = file.tensors;
  ASSERT_EQ(ours.size(), theirs.size());
  for (const auto& [name, t] : theirs) {
    const std::string our_name = name.substr(std::string("base_model.model.").size());
    bool found = false;
    for (const auto& [n, o] : ours) {
      if (n != our_name) continue;
      found = true;
      EXPECT_TRUE(o.equal(t)) << name << ": lr 1e-30 moves no float32 value: the adapter stays as peft saved it";
    }
    EXPECT_TRUE(found) << our_name;
  }
}

// The runner's rungs hold with LoRA (llama_tiny on synthetic tokens, no reference needed): the same job
// (a) as one micro-batch, (b) in micro-batches of 2 with every block recomputed, (c) backing off under a
// 40 MiB cap from micro-batch 16, (d) under bf16 autocast, and (e) with an EMA. (b) and (c) train what (a)
// trains, up to the order of the sums; (d) keeps float32 adapters; (e) averages the adapters alone. The base is never touched: the last checkpoint's state.json
// records the fingerprint the run started with.
TEST(LoraRungs, AccumulationRecomputationTheLadderAutocastAndEmaTrainTheSameAdapters) {
  TempDir dir("trainer_lora_rungs");
  const std::string job = "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --set data.kind=synthetic"
                          " --set data.test= --set model.context=64 --set train.global_batch=16 --set train.steps=3"
                          " --set train.threads=1 --set train.deterministic=true --set log.every=1000"
                          " --set schedule.warmup_steps=0 --set schedule.name=constant --set checkpoint.every_seconds=0"
                          " --set model.lora.rank=4 --set 'model.lora.targets=[q_proj,k_proj,v_proj,o_proj,down_proj]' ";
  struct Arm {
    std::string name, set;
  };
  const std::vector<Arm> arms = {{"whole", "--set train.micro_batch=16"},
                                 {"recomputed", "--set train.micro_batch=2 --set memory.activation_checkpointing=all"},
                                 {"ladder", "--set train.micro_batch=16 --set memory.limit=40MiB"},
                                 {"autocast", "--set amp.enabled=true --set amp.dtype=bf16"},
                                 {"ema", "--set train.micro_batch=16 --set train.ema_decay=0.9"}};
  std::map<std::string, trainer::NamedTensors> adapters;
  for (const auto& arm : arms) {
    SCOPED_TRACE(arm.name);
    const std::string run_dir = (dir / arm.name).string();
    const auto r = testutil::run(testutil::trainer_cmd(run_dir, job + arm.set));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    adapters[arm.name] = trainer::read_tensors(run_dir + "/checkpoints/step-00000003/model.pt");
    ASSERT_EQ(adapters[arm.name].size(), 4u * 5u * 2u) << "4 blocks x 5 targets x (A, B)";
    if (arm.name == "ladder") EXPECT_NE(r.output.find("halving to 8"), std::string::npos) << r.output;
    if (arm.name == "ema") {  // the average is of the adapters alone, under model.pt's names
      const auto ema = trainer::read_tensors(run_dir + "/checkpoints/step-00000003/ema.pt");
      ASSERT_EQ(ema.size(), adapters[arm.name].size());
      for (size_t i = 0; i < ema.size(); ++i) EXPECT_EQ(ema[i].first, adapters[arm.name][i].first);
    }
  }
  for (const char* name : {"recomputed", "ladder", "autocast", "ema"}) {
    SCOPED_TRACE(name);
    const auto& a = adapters["whole"];
    const auto& b = adapters[name];
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].first, b[i].first);
      EXPECT_EQ(b[i].second.scalar_type(), torch::kFloat) << b[i].first;
      const double tol = std::string(name) == "autocast" ? 2e-2 : 1e-5;
      EXPECT_LT((a[i].second - b[i].second).abs().max().item<double>(), tol) << a[i].first;
    }
  }
  EXPECT_GT(adapters["whole"][1].second.abs().max().item<double>(), 0) << "B never moved: nothing was trained";
}

// Bad LoRA settings: one line each, exit 2, before any step.
TEST_F(LoraRun, BadSettingsAreOneLineAndExit2) {
  const std::string cfg = "--config " + testutil::source_dir() + "/configs/llama_tiny_fortunes.yaml --set data.kind=synthetic"
                          " --set data.test= --set train.steps=1 --set model.lora.rank=4 ";
  struct Case {
    std::string set, says;
  };
  const std::vector<Case> cases = {
      {"--set 'model.lora.targets=[input_layernorm]'", "'input_layernorm' is not a Linear layer of this model (its Linear "
                                                      "layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"},
      {"--set model.lora.rank=0 --set model.lora_init_from=/nonexistent", "model.lora.rank is 0"},
      {"--set model.lora.rank=200", "is larger than model.layers.0.self_attn.q_proj"},
      {"--set model.lora.dropout=1", "model.lora.dropout"},
      {"--set model.lora_init_from=/nonexistent/adapter", "/nonexistent/adapter"},
      {"--set model.name=resnet20 --set data.shape=[3,32,32]", "LoRA adapts the Llama family and GPT models"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.set);
    TempDir run_dir("trainer_lora_bad");
    const auto r = testutil::run(testutil::trainer_cmd(run_dir.str(), cfg + c.set));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }
}

#undef SKIP_WITHOUT_PEFT_RUN

}  // namespace test_lora_run
