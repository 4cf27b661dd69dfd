// Config: precedence (defaults < YAML < --set), types, unknown keys, validation and the YAML dump.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainer/config/config.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_config {

using trainer::Config;
using trainer::ConfigError;

namespace {

// Expects `fn` to throw ConfigError whose message contains every fragment.
template <typename Fn>
void expect_config_error(Fn fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

// Defaults < overrides, then validate (no file: the built-in job would add its own keys).
Config from_sets(const std::vector<std::string>& sets) {
  Config c;
  for (const auto& s : sets) trainer::apply_override(c, s);
  trainer::validate(c);
  return c;
}

}  // namespace

TEST(Config, PrecedenceDefaultsYamlSet) {
  testutil::TempDir dir;
  auto path = (dir / "c.yaml").string();
  testutil::write_file(path, "train:\n  global_batch: 64\n  steps: 10\noptim:\n  lr: 0.05\nseed: 7\n");
  Config c = trainer::load_config(path, {"train.global_batch=256", "model.name=resnet50"});
  EXPECT_EQ(c.train.global_batch, 256);          // --set beats YAML
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.05);            // YAML beats default
  EXPECT_EQ(c.model.name, "resnet50");           // --set beats default
  EXPECT_EQ(c.seed, 7u);
  EXPECT_DOUBLE_EQ(c.optim.momentum, Config{}.optim.momentum);  // untouched default
}

TEST(Config, MicroBatchAuto) {
  Config c;
  trainer::apply_override(c, "train.micro_batch=auto");
  EXPECT_EQ(c.train.micro_batch, -1);
  trainer::apply_override(c, "train.micro_batch=32");
  EXPECT_EQ(c.train.micro_batch, 32);
  expect_config_error([&] { trainer::apply_override(c, "train.steps=auto"); }, {"train.steps", "integer"});
}

TEST(Config, ListsAndStrings) {
  Config c;
  trainer::apply_yaml_text(c, "data: {shape: [1, 28, 28], kind: synthetic}\nschedule: {milestones: [10, 20]}", "t");
  EXPECT_EQ(c.data.shape, (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(c.schedule.milestones, (std::vector<int64_t>{10, 20}));
  expect_config_error([&] { trainer::apply_yaml_text(c, "data: {shape: 3}", "t.yaml"); }, {"t.yaml", "data.shape", "list"});
}

TEST(Config, UnknownKeyNamesKeyAndFile) {
  Config c;
  expect_config_error([&] { trainer::apply_yaml_text(c, "train:\n  global_bach: 3\n", "my.yaml"); },
                      {"my.yaml", "train.global_bach", "unknown key", "global_batch"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "trian: {steps: 3}\n", "my.yaml"); },
                      {"my.yaml", "trian", "unknown key"});
  expect_config_error([&] { trainer::apply_override(c, "optim.learning_rate=0.1"); },
                      {"--set optim.learning_rate=0.1", "unknown key"});
  expect_config_error([&] { trainer::apply_override(c, "optim.lr"); }, {"key=value"});
}

TEST(Config, WrongTypeNamesKeyAndFile) {
  Config c;
  expect_config_error([&] { trainer::apply_yaml_text(c, "train: {global_batch: many}", "f.yaml"); },
                      {"f.yaml", "train.global_batch", "expected an integer", "'many'"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "train: {global_batch: 12abc}", "f.yaml"); },
                      {"train.global_batch", "'12abc'"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "optim: {lr: fast}", "f.yaml"); }, {"optim.lr", "number"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "amp: {enabled: maybe}", "f.yaml"); },
                      {"amp.enabled", "true or false"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "train: 5", "f.yaml"); }, {"train", "mapping"});
  expect_config_error([&] { trainer::apply_yaml_text(c, "train: {steps: [1", "f.yaml"); }, {"f.yaml", "malformed YAML"});
}

TEST(Config, MissingFile) {
  expect_config_error([] { trainer::load_config("/nonexistent/x.yaml", {}); }, {"/nonexistent/x.yaml", "cannot read"});
}

TEST(Config, Validation) {
  auto invalid = [](std::vector<std::string> sets, std::initializer_list<std::string> fragments) {
    expect_config_error([&] { from_sets(sets); }, fragments);
  };
  invalid({"train.steps=10", "train.global_batch=0"}, {"train.global_batch", "at least 1"});
  invalid({"train.steps=0", "train.epochs=0"}, {"train.steps", "train.epochs"});
  invalid({"train.steps=10", "train.epochs=1"}, {"train.epochs", "not both"});
  invalid({"train.steps=10", "train.global_batch=8", "train.micro_batch=16"}, {"train.micro_batch"});
  invalid({"train.steps=10", "optim.name=adam"}, {"optim.name", "'adam'", "sgd, adamw"});
  invalid({"train.steps=10", "amp.enabled=true", "amp.dtype=fp16", "amp.scaler=false"}, {"amp.scaler", "fp16"});
  invalid({"train.steps=10", "amp.enabled=true", "amp.dtype=bf16", "amp.scaler=true"}, {"amp.scaler", "bf16"});
  invalid({"train.steps=10", "memory.activation_checkpointing=some"}, {"memory.activation_checkpointing"});
  invalid({"train.steps=10", "schedule.name=step"}, {"schedule.milestones"});
  invalid({"train.steps=10", "train.device=tpu"}, {"train.device", "'tpu'"});
  EXPECT_NO_THROW(from_sets({"train.steps=10"}));
}

TEST(Config, DumpRoundTripsExactly) {
  Config c = from_sets({"train.steps=10", "optim.lr=0.1", "optim.weight_decay=5e-5",
                                       "train.micro_batch=auto", "data.shape=[3, 64, 64]", "seed=123",
                                       "model.init_from=a b.pt"});
  std::string y = trainer::to_yaml(c);
  EXPECT_NE(y.find("lr: 0.1\n"), std::string::npos) << y;  // shortest text, not 0.1000000000000000055
  Config back;
  trainer::apply_yaml_text(back, y, "dump");
  EXPECT_EQ(trainer::to_yaml(back), y);
  EXPECT_EQ(back.train.micro_batch, -1);
  EXPECT_EQ(back.optim.weight_decay, 5e-5);
  EXPECT_EQ(back.data.shape, (std::vector<int64_t>{3, 64, 64}));
  EXPECT_EQ(back.model.init_from, "a b.pt");
  EXPECT_EQ(back.seed, 123u);
  // Every declared key appears in the dump.
  for (const auto& k : trainer::config_keys()) {
    std::string leaf = k.substr(k.rfind('.') + 1);
    EXPECT_NE(y.find(leaf + ":"), std::string::npos) << k;
  }
}

TEST(Config, BuiltInJobIsTheFashionMnistConfig) {
  Config builtin = trainer::load_config("", {});
  Config file = trainer::load_config(testutil::source_dir() + "/configs/resnet20_fmnist.yaml", {});
  EXPECT_EQ(trainer::to_yaml(builtin), trainer::to_yaml(file));
  EXPECT_EQ(builtin.model.name, "resnet20");
}

TEST(Config, ShippedConfigsAreValid) {
  namespace fs = std::filesystem;
  int n = 0;
  for (const auto& e : fs::directory_iterator(testutil::source_dir() + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(trainer::load_config(e.path().string(), {})) << e.path();
    ++n;
  }
  EXPECT_GE(n, 2);
}

}  // namespace test_config
