// Config: precedence (defaults < YAML < --set), types, unknown keys, validation and the YAML dump.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "test_util.h"
#include "train_util.h"
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
Config from_sets(const std::vector<std::string>& sets) { return testutil::config_from_sets(sets); }

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

// ---- modes: the keys with a fixed set of values, enums read by their names (config.h) -------------------

namespace {

// E's name table: one distinct name per value, each read back as its value; anything else refused with the
// names allowed.
template <class E>
void expect_names_round_trip(const std::string& what) {
  const std::vector<std::string>& names = trainer::mode_names<E>();
  ASSERT_EQ(names.size(), trainer::kModeCount<E>) << what;
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size()) << what << ": a name twice";
  for (size_t i = 0; i < trainer::kModeCount<E>; ++i) {
    const E value = static_cast<E>(i);
    EXPECT_EQ(trainer::mode_name(value), names[i]) << what;
    EXPECT_EQ(trainer::mode_from_name<E>(names[i]), value) << what << " " << names[i];
  }
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  EXPECT_EQ(testutil::error_text([] { trainer::mode_from_name<E>("no_such_mode"); }),
            "'no_such_mode' is not one of: " + list)
      << what;
}

}  // namespace

TEST(ConfigModes, EveryEnumsNamesRoundTrip) {
  expect_names_round_trip<trainer::Switch>("Switch");
  expect_names_round_trip<trainer::DataKind>("DataKind");
  expect_names_round_trip<trainer::AutoAugment>("AutoAugment");
  expect_names_round_trip<trainer::OptimKind>("OptimKind");
  expect_names_round_trip<trainer::OptimImpl>("OptimImpl");
  expect_names_round_trip<trainer::StateDtype>("StateDtype");
  expect_names_round_trip<trainer::ScheduleKind>("ScheduleKind");
  expect_names_round_trip<trainer::LossKind>("LossKind");
  expect_names_round_trip<trainer::MixMode>("MixMode");
  expect_names_round_trip<trainer::SnapshotMode>("SnapshotMode");
  expect_names_round_trip<trainer::AmpDtype>("AmpDtype");
  expect_names_round_trip<trainer::ScalerMode>("ScalerMode");
  expect_names_round_trip<trainer::Checkpointing>("Checkpointing");
  expect_names_round_trip<trainer::MemoryState>("MemoryState");
  expect_names_round_trip<trainer::LadderSizes>("LadderSizes");
  expect_names_round_trip<trainer::AutoSearch>("AutoSearch");
  expect_names_round_trip<trainer::CudnnMode>("CudnnMode");
  expect_names_round_trip<trainer::LogLevel>("LogLevel");
  expect_names_round_trip<trainer::DistBackend>("DistBackend");
  expect_names_round_trip<trainer::ShardMode>("ShardMode");
  // The names that are YAML's booleans stay strings: amp.scaler's true and false.
  EXPECT_EQ(trainer::mode_name(trainer::ScalerMode::kOn), "true");
  EXPECT_EQ(trainer::mode_name(trainer::ScalerMode::kOff), "false");
}

// Every mode key, every name it takes: read from --set and from YAML, dumped as the quoted name (as when
// modes were strings, so a resolved_config.yaml reads the same), and read back from the dump.
TEST(ConfigModes, EveryKeyTakesItsNamesAndDumpsThem) {
  size_t mode_keys = 0;
  for (const auto& key : trainer::config_keys()) {
    const std::vector<std::string> names = trainer::config_key_modes(key);
    if (names.empty()) continue;
    ++mode_keys;
    const std::string section = key.substr(0, key.find('.')), leaf = key.substr(key.find('.') + 1);
    for (const auto& name : names) {
      Config c;
      trainer::apply_override(c, key + "=" + name);
      const std::string y = trainer::to_yaml(c);
      EXPECT_NE(y.find("  " + leaf + ": \"" + name + "\"\n"), std::string::npos) << key << "=" << name << "\n" << y;
      Config from_yaml;
      trainer::apply_yaml_text(from_yaml, section + ":\n  " + leaf + ": " + name + "\n", "t.yaml");
      EXPECT_EQ(trainer::to_yaml(from_yaml), y) << key << "=" << name;
      Config back;
      trainer::apply_yaml_text(back, y, "dump");
      EXPECT_EQ(trainer::to_yaml(back), y) << key << "=" << name;
    }
  }
  EXPECT_EQ(mode_keys, 23u);
  EXPECT_TRUE(trainer::config_key_modes("train.device").empty()) << "cuda:N: an open set, a string";
  EXPECT_EQ(trainer::config_key_modes("memory.cudnn_policy"),
            (std::vector<std::string>{"always", "off", "start", "pretune", "settle"}));
}

// A misspelt mode is refused as it is read: one line naming the file (or the --set) and the key, and the
// names the key takes; the ConfigError exits 2 as every config error.
TEST(ConfigModes, AMisspeltModeIsRefusedNamingTheKeyAndTheNames) {
  Config c;
  EXPECT_EQ(testutil::error_text([&] { trainer::apply_yaml_text(c, "data:\n  kind: hdf55\n", "my.yaml"); }),
            "my.yaml: key 'data.kind': 'hdf55' is not one of: hdf5, packed_images, image_folder, synthetic, tokens");
  EXPECT_EQ(testutil::error_text([&] { trainer::apply_yaml_text(c, "optim: {name: adam}", "my.yaml"); }),
            "my.yaml: key 'optim.name': 'adam' is not one of: sgd, adamw, lamb");
  EXPECT_EQ(testutil::error_text([&] { trainer::apply_override(c, "amp.scaler=yes"); }),
            "--set amp.scaler=yes: key 'amp.scaler': 'yes' is not one of: auto, true, false");
  EXPECT_EQ(testutil::error_text([&] { trainer::apply_override(c, "log.level=INFO"); }),
            "--set log.level=INFO: key 'log.level': 'INFO' is not one of: trace, debug, info, warn, error")
      << "names are case-sensitive";
  EXPECT_EQ(testutil::error_text([&] { trainer::apply_override(c, "dist.backend="); }),
            "--set dist.backend=: key 'dist.backend': '' is not one of: auto, gloo, nccl");
  expect_config_error([&] { trainer::apply_yaml_text(c, "train: {cuda_graph: [on]}", "my.yaml"); },
                      {"my.yaml", "train.cuda_graph", "expected a string, got a list"});
  EXPECT_EQ(trainer::to_yaml(c), trainer::to_yaml(Config{})) << "a refused value changes nothing";
  // The command line: exit 2, the one line.
  const auto r = testutil::run(testutil::trainer_bin() + " --dry-run --set memory.auto_search=bisect");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: --set memory.auto_search=bisect: key 'memory.auto_search': 'bisect' is not one of: auto, "
                      "curve, doubling\n");
}

// --list-keys: a mode key with its names, from the same table.
TEST(ConfigModes, ListKeysShowsEachModesNames) {
  const auto r = testutil::run(testutil::trainer_bin() + " --list-keys");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\ndata.kind: hdf5 | packed_images | image_folder | synthetic | tokens\n"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\ntrain.device\n"), std::string::npos) << r.output;
  EXPECT_EQ(static_cast<size_t>(std::count(r.output.begin(), r.output.end(), '\n')), trainer::config_keys().size());
}

}  // namespace test_config
