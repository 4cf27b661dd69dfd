// safetensors in and out (trainer/checkpoint/safetensors.h, weights.h, trainer export): the format's round
// trips and hostile files (no Python needed, both toolchains), the layouts of transformers' GPT-2 and of
// timm's and torchvision's ResNet and ViT mapped onto ours, model.init_skip, and, where the reference
// Python has safetensors, transformers and timm (the 2.11 leg: scripts/install-torch.sh), files saved by
// those libraries loaded here with the same outputs, and our exports loaded by them with no code of ours.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <map>

#include "models/registry.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/config/config.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_safetensors {

namespace {

using trainer::NamedTensors;
using testutil::TempDir;

// A one-step job on synthetic data, no evaluation (the model and its data shape are added).
const std::string kOneStep = " --set data.kind=synthetic --set data.synthetic_size=8 --set train.global_batch=4 "
                             "--set train.epochs=0 --set train.steps=1 --set data.test= ";

std::string ref_script() { return testutil::source_dir() + "/tests/ref/safetensors_ref.py"; }

// "" when the reference Python imports safetensors, transformers and timm, else the first one it lacks.
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_LIBRARIES()                                                                              \
  if (!missing_module().empty())                                                                              \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()     \
               << " (scripts/install-torch.sh installs safetensors, transformers and timm into the 2.11 venv)"

std::string bytes_of(const torch::Tensor& t) {
  const auto c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes()));
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && bytes_of(a) == bytes_of(b);
}

std::map<std::string, torch::Tensor> by_name(const NamedTensors& t) {
  std::map<std::string, torch::Tensor> m;
  for (const auto& [k, v] : t) m[k] = v;
  return m;
}

using testutil::write_file;

// A file from its header text and data, as another (or a hostile) writer would make it.
std::string raw_file(const std::string& header, const std::string& data, uint64_t claimed = 0) {
  const uint64_t n = claimed ? claimed : header.size();
  std::string b;
  for (int k = 0; k < 8; ++k) b.push_back(static_cast<char>(n >> (8 * k)));
  return b + header + data;
}

NamedTensors every_dtype() {
  torch::manual_seed(0);
  return {{"f64", torch::randn({3, 2}, torch::kDouble)},
          {"f32", torch::tensor({1.5f, -0.0f, INFINITY, NAN})},
          {"f16", torch::randn({5}).to(torch::kHalf)},
          {"bf16", torch::randn({2, 2, 2}).to(torch::kBFloat16)},
          {"i64", torch::tensor({INT64_MIN, INT64_MAX, int64_t{0}})},
          {"i32", torch::tensor({INT32_MIN, INT32_MAX}, torch::kInt)},
          {"i16", torch::tensor({-32768, 32767}, torch::kShort)},
          {"i8", torch::tensor({-128, 127}, torch::kChar)},
          {"u8", torch::tensor({0, 255}, torch::kByte)},
          {"bool", torch::tensor({true, false, true})},
          {"scalar", torch::tensor(3.25)},
          {"empty", torch::zeros({0, 3})},
          {"transposed_view", torch::arange(6, torch::kFloat).reshape({2, 3}).t()}};
}

}  // namespace

// ---- the format ----------------------------------------------------------------------------------------

TEST(Safetensors, EveryDtypeRoundTripsBitForBitThroughTheMapping) {
  TempDir dir;
  const auto in = every_dtype();
  const std::string path = (dir / "all.safetensors").string();
  trainer::write_safetensors(path, in, {{"format", "pt"}, {"note", "every dtype"}});
  EXPECT_FALSE(testutil::fs::exists(path + ".tmp"));
  const std::string file = testutil::read_file(path);
  EXPECT_EQ(file, trainer::safetensors_bytes(in, {{"format", "pt"}, {"note", "every dtype"}}));

  const auto back = trainer::read_safetensors(path);
  EXPECT_EQ(back.metadata, (trainer::SafetensorsMetadata{{"format", "pt"}, {"note", "every dtype"}}));
  ASSERT_EQ(back.tensors.size(), in.size());
  auto got = by_name(back.tensors);
  for (const auto& [k, t] : in) {
    ASSERT_TRUE(got.count(k)) << k;
    EXPECT_TRUE(same_bits(got[k], t)) << k << ": " << got[k].scalar_type() << " " << got[k].sizes();
  }
  // The layout: the header padded to 8 bytes, every tensor aligned to its element size, largest first.
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = file.substr(8, n);
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  // No copy: the tensors alias one mapping, laid out as the file is (each data pointer is the first
  // tensor's plus the offset difference in the file), and each is aligned to its element size.
  const char* first = nullptr;
  int64_t first_offset = 0, offset = 0;
  for (const auto& [k, t] : back.tensors) {
    if (t.numel() > 0) {
      const char* p = static_cast<const char*>(t.data_ptr());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % t.element_size(), 0u) << k;
      if (!first) first = p, first_offset = offset;
      EXPECT_EQ(p - first, offset - first_offset) << k;
    }
    offset += static_cast<int64_t>(t.nbytes());
  }
  EXPECT_EQ(offset, static_cast<int64_t>(file.size() - 8 - n));
  // Writing to a tensor read from the file changes only this process's copy of the page.
  got["f64"].fill_(7.0);
  EXPECT_EQ(testutil::read_file(path), file);
}

TEST(Safetensors, AnotherWritersMisalignedTensorIsReadThroughOneCopy) {
  // A U8 then an F32 at data offset 1: no padding, as a writer that does not align would lay it out.
  const std::string header = R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  std::string data = "\x07";
  const float f[2] = {1.0f, -2.5f};
  data.append(reinterpret_cast<const char*>(f), 8);
  std::string file = raw_file(header, data);
  const auto c = trainer::safetensors_from_bytes(file, "misaligned");
  auto m = by_name(c.tensors);
  EXPECT_TRUE(m.at("f").equal(torch::tensor({1.0f, -2.5f})));
  EXPECT_EQ(m.at("u").item<uint8_t>(), 7);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.at("f").data_ptr()) % 4, 0u);
  EXPECT_TRUE(c.metadata.empty());
}

TEST(Safetensors, WriterRefusesWhatTheFormatCannotHold) {
  EXPECT_EQ(testutil::error_text([] { trainer::safetensors_bytes({{"c", torch::ones({2}, torch::kComplexFloat)}}); }),
            "write_safetensors: tensor 'c' has dtype ComplexFloat, which is not written (written: F64, F32, F16, BF16, "
            "I64, I32, I16, I8, U8, BOOL)");
  EXPECT_EQ(testutil::error_text([] { trainer::safetensors_bytes({{"a", torch::ones({1})}, {"a", torch::ones({1})}}); }),
            "write_safetensors: duplicate name 'a'");
  TempDir dir;
  const std::string bad = (dir / "no" / "such" / "folder" / "w.safetensors").string();
  EXPECT_NE(testutil::error_text([&] { trainer::write_safetensors(bad, {{"a", torch::ones({1})}}); })
                .find(bad + ": cannot write the safetensors file: No such file or directory"),
            std::string::npos);
}

// Every hostile case, with the line the user sees. The files are those of fuzz/make_corpus.cpp.
TEST(Safetensors, HostileFilesAreRefusedWithOneLineNamingTheRule) {
  const std::string f32 = R"("dtype":"F32","shape":[2],"data_offsets":)";
  const std::string z8(8, '\0');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "it has 0 bytes, fewer than the 8-byte header length"},
      {std::string("\x02\0\0\0", 4), "it has 4 bytes, fewer than the 8-byte header length"},
      {raw_file("{}", "", 1000), "the header length 1000 runs past the end of the file (10 bytes)"},
      {raw_file("{}", "", 200000000), "the header length 200000000 is over the limit of 100000000 bytes"},
      {raw_file("{\"a\":{" + f32 + "[0,8]},\"b\":{" + f32 + "[4,12]}}", std::string(12, '\0')),
       "the data of tensors 'a' and 'b' overlap"},
      {raw_file("{\"a\":{" + f32 + "[0,8]},\"b\":{" + f32 + "[12,20]}}", std::string(20, '\0')),
       "a gap of 4 bytes before the data of tensor 'b'"},
      {raw_file("{\"a\":{" + f32 + "[0,8]}}", std::string(4, '\0')),
       "tensor 'a' runs past the end of the file: its data_offsets end at 8, the data has 4 bytes"},
      {raw_file("{\"a\":{" + f32 + "[0,8]}}", std::string(12, '\0')),
       "the tensors' data ends at byte 8 of 12 (bytes after the last tensor)"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""),
       "tensor 'a' has the shape [4294967296, 4294967296], whose element count overflows 64 bits"},
      {raw_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", ""),
       "tensor 'a' has the shape [4611686018427387904], whose byte size overflows 64 bits"},
      {raw_file(R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "abcd"),
       "tensor 'a' has an unknown dtype 'F33' (read: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)"},
      {raw_file(R"({"a":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})", "abcd"),
       "tensor 'a' has dtype U16, which the trainer does not read (read: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)"},
      {raw_file("{\"a\":{" + f32 + "[0,8]},\"a\":{" + f32 + "[8,16]}}", std::string(16, '\0')),
       "the name 'a' appears twice in the header"},
      {raw_file("[1, 2, 3]", ""), "the header is a list, not a JSON object"},
      {raw_file("\"text\"", ""), "the header is a string, not a JSON object"},
      {raw_file("{,}", ""), "the header is not valid JSON: parse error at line 1, column 2: syntax error while parsing "
                            "object key - unexpected ','; expected string literal"},
      {raw_file("{} x", ""), "the header is not valid JSON: parse error at line 1, column 4: syntax error while parsing "
                             "value - invalid literal; last read: '{} x'; expected end of input"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"),
       "tensor 'a' has data_offsets [0, 4] spanning 4 bytes, but F32 [2] takes 8"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,0]}})", ""), "tensor 'a': shape holds the negative number -2"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,0]}})", ""),
       "tensor 'a': shape holds 2.5, not an integer from 0 to 2^64-1"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", "abcd"), "tensor 'a': shape holds a list, not an integer"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1]}})", ""), "tensor 'a' lacks data_offsets"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", "abcd"),
       "tensor 'a' has an unknown field 'x' (fields: dtype, shape, data_offsets)"},
      {raw_file(R"({"a":[1]})", ""), "the entry 'a' is a list, not an object with dtype, shape and data_offsets"},
      {raw_file(R"({"__metadata__":{"k":1}})", ""), "__metadata__'s value for 'k' is a number, not a string"},
      {raw_file(R"({"t":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x02", 2)),
       "the BOOL tensor 't' holds a byte other than 0 or 1"},
      {raw_file("{\"a\\nb\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}", ""),
       "tensor 'a\\x0ab' has an unknown dtype 'X' (read: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)"},
  };
  TempDir dir;
  int i = 0;
  for (const auto& [bytes, why] : cases) {
    SCOPED_TRACE(why);
    EXPECT_EQ(testutil::error_text([&] { trainer::safetensors_from_bytes(bytes, "w"); }), "w: not a valid safetensors file: " + why);
    // The same from a file, through the memory mapping.
    const std::string path = (dir / ("h" + std::to_string(i++) + ".safetensors")).string();
    write_file(path, bytes);
    EXPECT_EQ(testutil::error_text([&] { trainer::read_safetensors(path); }), path + ": not a valid safetensors file: " + why);
  }
  // Deep nesting stops at the first level the format does not have (no recursion, no huge allocation).
  EXPECT_EQ(testutil::error_text([&] { trainer::safetensors_from_bytes(raw_file("{\"a\":{\"shape\":" + std::string(100000, '['), ""), "w"); }),
            "w: not a valid safetensors file: tensor 'a': shape holds a list, not an integer");
  EXPECT_EQ(testutil::error_text([&] { trainer::read_safetensors((dir / "none.safetensors").string()); }),
            (dir / "none.safetensors").string() + ": cannot open the safetensors file: No such file or directory");
  EXPECT_EQ(testutil::error_text([&] { trainer::read_safetensors(dir.str()); }), dir.str() + ": is a directory, not a regular file");
}

TEST(Safetensors, HostileInitFromFileIsOneErrorLineAndExit2) {
  TempDir dir;
  const std::string bad = (dir / "overlap.safetensors").string();
  const std::string f32 = R"("dtype":"F32","shape":[2],"data_offsets":)";
  write_file(bad, raw_file("{\"a\":{" + f32 + "[0,8]},\"b\":{" + f32 + "[4,12]}}", std::string(12, '\0')));
  const std::string job = "--set model.name=plain_cnn --set data.shape=[1,8,8]" + kOneStep + "--set model.init_from=" + bad;
  auto r = testutil::run(testutil::trainer_cmd((dir / "run").string(), job));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string line = "error: " + bad + ": not a valid safetensors file: the data of tensors 'a' and 'b' overlap\n";
  ASSERT_GE(r.output.size(), line.size()) << r.output;
  EXPECT_EQ(r.output.substr(r.output.size() - line.size()), line) << r.output;
  EXPECT_EQ(r.output.find("terminate"), std::string::npos) << r.output;
}

TEST(Safetensors, ReadWeightsTellsTheFormatsApartByTheirBytes) {
  TempDir dir;
  const NamedTensors t = {{"w", torch::arange(4, torch::kFloat)}};
  const std::string st = (dir / "weights.bin").string(), pt = (dir / "weights.safetensors").string();
  trainer::write_safetensors(st, t);  // names that lie about the format
  write_file(pt, trainer::tensors_to_bytes(t));
  auto a = trainer::read_weights(st), b = trainer::read_weights(pt);
  EXPECT_EQ(a.format, "safetensors");
  EXPECT_EQ(b.format, "torch.save");
  EXPECT_TRUE(a.tensors.at(0).second.equal(b.tensors.at(0).second));
  const std::string text = (dir / "notes.txt").string();
  testutil::write_file(text, "hello");
  EXPECT_EQ(testutil::error_text([&] { trainer::read_weights(text); }),
            text + " is neither a safetensors file nor a torch.save archive (its first bytes are neither a header "
                   "length and '{' nor 'PK')");
}

// ---- layouts, in-process ---------------------------------------------------------------------------------

namespace {

models::Model small_gpt() {
  torch::manual_seed(3);
  return models::create_model("gpt_tiny", models::ModelOptions().vocab_size(64).context(16).n_layer(2).n_head(4).n_embd(32));
}

models::Model small_vit() {
  torch::manual_seed(4);
  return models::create_model("vit_tiny", models::ModelOptions().in_channels(3).image_size(32).patch_size(8).n_layer(2)
                                              .n_head(2).n_embd(32).num_classes(5));
}

}  // namespace

TEST(SafetensorsLayouts, GptInHuggingFaceLayoutComesBackAsOurs) {
  auto model = small_gpt();
  const NamedTensors ours = trainer::named_state(*model);
  const NamedTensors hf = trainer::from_our_layout(ours, trainer::Layout::hf);
  auto h = by_name(hf);
  EXPECT_EQ(h.at("transformer.h.0.attn.c_attn.weight").sizes(), (std::vector<int64_t>{32, 96}));  // Conv1D: in x out
  EXPECT_EQ(h.at("transformer.h.1.mlp.c_fc.weight").sizes(), (std::vector<int64_t>{32, 128}));
  EXPECT_TRUE(h.at("transformer.h.0.attn.c_proj.weight").equal(by_name(ours).at("transformer.h.0.attn.c_proj.weight").t()));
  EXPECT_FALSE(h.count("lm_head.weight"));

  // The Hub's GPT2Model file: no "transformer.", the mask buffers, a tied head written out.
  NamedTensors hub;
  for (const auto& [k, t] : hf) hub.emplace_back(k.substr(std::string("transformer.").size()), t.clone());
  hub.emplace_back("h.0.attn.bias", torch::ones({1, 1, 16, 16}).tril());
  hub.emplace_back("h.0.attn.masked_bias", torch::tensor(-1e4));
  hub.emplace_back("lm_head.weight", h.at("transformer.wte.weight").clone());
  for (const NamedTensors* file : std::vector<const NamedTensors*>{&hf, &hub}) {
    const auto t = trainer::to_our_layout(*file, ours, "f");
    EXPECT_NE(t.layout.find("Conv1D weights transposed"), std::string::npos) << t.layout;
    auto other = small_gpt();
    torch::NoGradGuard ng;
    for (auto& p : other->parameters()) p.zero_();
    trainer::load_state_dict(*other, t.tensors, /*strict=*/true, "f");
    for (const auto& [k, v] : trainer::named_state(*other)) EXPECT_TRUE(v.equal(by_name(ours).at(k))) << k;
  }
  EXPECT_EQ(trainer::to_our_layout(hub, ours, "f").layout,
            "Hugging Face GPT2Model (names without transformer.), Conv1D weights transposed");
  EXPECT_EQ(trainer::to_our_layout(ours, ours, "f").layout, "ours (nn.Linear weights)");

  // A head that is not tied cannot be loaded into a model that ties it.
  hub.back().second = hub.back().second + 1;
  EXPECT_EQ(testutil::error_text([&] { trainer::to_our_layout(hub, ours, "gpt.safetensors"); }),
            "gpt.safetensors: lm_head.weight differs from transformer.wte.weight; this GPT ties its output projection "
            "to the token embedding, and the file's model does not (tie_word_embeddings: false); it cannot be loaded here");
  EXPECT_EQ(testutil::error_text([&] { trainer::from_our_layout(ours, trainer::Layout::timm); }),
            "layout timm is for ResNets and ViTs; for a GPT use hf (transformers) or ours");
}

TEST(SafetensorsLayouts, VitInTimmNamesComesBackAsOurs) {
  auto model = small_vit();
  const NamedTensors ours = trainer::named_state(*model);
  const NamedTensors timm = trainer::from_our_layout(ours, trainer::Layout::timm);
  std::vector<std::string> names;
  for (const auto& [k, t] : timm) names.push_back(k);
  const std::vector<std::string> expected_start = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias",
                                                   "blocks.0.norm1.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.weight",
                                                   "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
                                                   "blocks.0.norm2.weight", "blocks.0.norm2.bias", "blocks.0.mlp.fc1.weight",
                                                   "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight", "blocks.0.mlp.fc2.bias"};
  for (const auto& n : expected_start) EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_NE(std::find(names.begin(), names.end(), "norm.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "head.bias"), names.end());
  const auto t = trainer::to_our_layout(timm, ours, "f");
  EXPECT_EQ(t.layout, "timm VisionTransformer");
  auto back = by_name(t.tensors);
  for (const auto& [k, v] : ours) EXPECT_TRUE(back.count(k) && back.at(k).equal(v)) << k;
  EXPECT_EQ(back.size(), ours.size());

  // What timm has and this ViT has not is named as an unexpected key.
  NamedTensors extra = timm;
  extra.emplace_back("blocks.0.ls1.gamma", torch::ones({32}));
  auto other = small_vit();
  EXPECT_NE(testutil::error_text([&] {
              trainer::load_state_dict(*other, trainer::to_our_layout(extra, ours, "f").tensors, true, "vit.safetensors");
            }).find("unexpected keys (in the file, not in the module): blocks.0.ls1.gamma;"),
            std::string::npos);
}

TEST(SafetensorsLayouts, InitSkipKeepsTheHeadAndNamesWhatDoesNotFit) {
  TempDir dir;
  torch::manual_seed(5);
  auto ten = models::create_model("resnet18", models::ModelOptions().num_classes(10));
  const std::string path = (dir / "r18.safetensors").string();
  // torchvision's published files have no num_batches_tracked: filled with 0.
  NamedTensors file;
  for (const auto& [k, t] : trainer::named_state(*ten))
    if (k.find("num_batches_tracked") == std::string::npos) file.emplace_back(k, t);
  trainer::write_safetensors(path, file);

  torch::manual_seed(6);
  auto seven = models::create_model("resnet18", models::ModelOptions().num_classes(7));
  const auto fc_before = seven->named_parameters()["fc.weight"].clone();
  const std::string err = testutil::error_text([&] { trainer::load_weights(*seven, path); });
  EXPECT_EQ(err, "load_state_dict: " + path + " does not match the module: wrong shapes: fc.weight (module [7, 512], file "
                 "[10, 512]), fc.bias (module [7], file [10]); check that the file was saved from the same architecture "
                 "(safetensors, read as the torchvision / timm (the same names) layout)");
  EXPECT_TRUE(seven->named_parameters()["fc.weight"].equal(fc_before));  // nothing copied on error

  const auto loaded = trainer::load_weights(*seven, path, {"fc.*"});
  EXPECT_EQ(loaded.skipped_keys, (std::vector<std::string>{"fc.weight", "fc.bias"}));
  EXPECT_EQ(loaded.notes, (std::vector<std::string>{"20 BatchNorm num_batches_tracked counters not in the file, set to 0"}));
  EXPECT_TRUE(seven->named_parameters()["fc.weight"].equal(fc_before));
  EXPECT_TRUE(seven->named_parameters()["layer4.1.conv2.weight"].equal(ten->named_parameters()["layer4.1.conv2.weight"]));

  EXPECT_EQ(testutil::error_text([&] { trainer::load_weights(*seven, path, {"fcc.*"}); }),
            "load_state_dict: the skip pattern 'fcc.*' matches no key of the module (loading " + path +
                "); the module's keys look like conv1.weight, fc.bias (safetensors, read as the torchvision / timm (the "
                "same names) layout)");
  // An unknown key is named.
  file.emplace_back("fc_norm.weight", torch::ones({512}));
  trainer::write_safetensors(path, file);
  EXPECT_NE(testutil::error_text([&] { trainer::load_weights(*ten, path); })
                .find("unexpected keys (in the file, not in the module): fc_norm.weight;"),
            std::string::npos);
}

TEST(SafetensorsLayouts, InitSkipIsAConfigListOfPatterns) {
  auto cfg = trainer::load_config("", {"model.init_from=w.safetensors", "model.init_skip=[fc.*, 'layer4.*']"});
  EXPECT_EQ(cfg.model.init_skip, (std::vector<std::string>{"fc.*", "layer4.*"}));
  const std::string y = trainer::to_yaml(cfg);
  EXPECT_NE(y.find("init_skip: [\"fc.*\", \"layer4.*\"]"), std::string::npos) << y;
  trainer::Config back;
  trainer::apply_yaml_text(back, y, "dump");
  EXPECT_EQ(back.model.init_skip, cfg.model.init_skip);
  EXPECT_EQ(testutil::error_text([] { trainer::load_config("", {"model.init_skip=[fc.*]"}); }),
            "config: key 'model.init_skip': names keys to leave out of model.init_from, which is not set");
  EXPECT_EQ(testutil::error_text([] { trainer::load_config("", {"model.init_skip=fc.*"}); }),
            "--set model.init_skip=fc.*: key 'model.init_skip': expected a list of strings, got 'fc.*'");
  EXPECT_EQ(testutil::error_text([] { trainer::load_config("", {"model.init_from=w", "model.init_skip=['']"}); }),
            "config: key 'model.init_skip': holds an empty pattern");
}

// ---- against the libraries (the reference Python with safetensors, transformers, timm) --------------------

TEST(SafetensorsLibraries, EveryDtypeBetweenPythonsSafetensorsAndOurs) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " dtypes-write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const auto theirs = trainer::read_safetensors((dir / "dtypes.safetensors").string());
  auto want = by_name(trainer::read_tensors((dir / "dtypes.pt").string()));
  ASSERT_EQ(theirs.tensors.size(), want.size());
  for (const auto& [k, t] : theirs.tensors) EXPECT_TRUE(same_bits(t, want.at(k))) << k;
  trainer::write_safetensors((dir / "ours_dtypes.safetensors").string(), theirs.tensors);
  auto c = testutil::run(testutil::python() + " " + ref_script() + " dtypes-check " + dir.str());
  EXPECT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("same"), std::string::npos) << c.output;
}

namespace {

torch::Tensor logits_of(models::Model& m, const torch::Tensor& x) {
  torch::NoGradGuard ng;
  m->eval();
  return m->forward(x);
}

// Largest |a - b|, also printed with the scale of b: the figures docs/MODELS.md cites.
double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  std::cout << "measured: maxdiff " << d << " scale " << b.abs().max().item<double>() << "\n";
  return d;
}

}  // namespace

// Tolerances: fp32 files give fp32 logits that agree to 1e-4 absolute (measured ~1e-6 at a logit scale of
// about 1.2). A bf16 file loads its exact values (widened to fp32): the same 1e-4 against transformers'
// model on the same bf16 weights in fp32; against transformers computing in bf16 itself, 2e-2 (bf16 keeps
// 8 significant bits; measured 6.5e-3).
TEST(SafetensorsLibraries, TransformersGpt2LoadsWithItsLogits) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " gpt-write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;
  auto io = by_name(trainer::read_safetensors((dir / "io.safetensors").string()).tensors);
  const auto x = io.at("x");
  for (const char* file : {"hf/model.safetensors", "hub.safetensors"}) {
    SCOPED_TRACE(file);
    auto model = small_gpt();
    const auto r = trainer::load_weights(*model, (dir / file).string());
    EXPECT_EQ(r.format, "safetensors");
    EXPECT_NE(r.layout.find("Hugging Face"), std::string::npos) << r.layout;
    EXPECT_LT(max_diff(logits_of(model, x), io.at("logits")), 1e-4);
  }
  auto model = small_gpt();
  trainer::load_weights(*model, (dir / "hf_bf16/model.safetensors").string());
  const auto y = logits_of(model, x);
  EXPECT_LT(max_diff(y, io.at("logits_bf16_weights")), 1e-4);
  EXPECT_LT(max_diff(y, io.at("logits_bf16")), 2e-2);
  EXPECT_GT(max_diff(y, io.at("logits")), 0.0);  // the bf16 file really held other values
}

TEST(SafetensorsLibraries, TimmAndTorchvisionResnet18LoadWithTheirLogits) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " resnet-write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;
  auto io = by_name(trainer::read_safetensors((dir / "io.safetensors").string()).tensors);
  for (const char* file : {"timm/model.safetensors", "tv.safetensors"}) {
    SCOPED_TRACE(file);
    auto model = models::create_model("resnet18", models::ModelOptions().num_classes(10));
    trainer::load_weights(*model, (dir / file).string());
    EXPECT_LT(max_diff(logits_of(model, io.at("x")), io.at("y")), 1e-4);
  }
}

TEST(SafetensorsLibraries, TimmVitInOurStructureLoadsWithItsLogits) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " vit-write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;
  auto io = by_name(trainer::read_safetensors((dir / "io.safetensors").string()).tensors);
  auto model = small_vit();
  EXPECT_EQ(trainer::load_weights(*model, (dir / "timm.safetensors").string()).layout, "timm VisionTransformer");
  const auto y = logits_of(model, io.at("x"));
  EXPECT_LT(max_diff(y, io.at("y")), 1e-5);
  // timm's own numerics (exact GELU, LayerNorm eps 1e-6) are a different function: the names load, the
  // logits differ (docs/MODELS.md); on these small random weights by more than the fp32 tolerance.
  EXPECT_GT(max_diff(y, io.at("y_default")), 1e-6);
}

namespace {

// A one-step run of `model_args` from scratch; its exported weights and, for `layout`, the export.
struct Exported {
  std::string run_dir, file, how_to_load, output;
};

Exported train_and_export(const TempDir& dir, const std::string& name, const std::string& model_args,
                          const std::string& export_args) {
  Exported e;
  e.run_dir = (dir / name).string();
  const std::string job = model_args + kOneStep + "--set optim.lr=0.01";
  auto r = testutil::run(testutil::trainer_cmd(e.run_dir, job));
  if (r.exit_code != 0) throw std::runtime_error("training failed: " + r.output);
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + e.run_dir + " " + export_args);
  e.output = r.output;
  if (r.exit_code != 0) throw std::runtime_error("export failed: " + r.output);
  const auto at = r.output.find("load it in Python with: ");
  if (at == std::string::npos) throw std::runtime_error("no load line: " + r.output);
  e.how_to_load = r.output.substr(at + 24, r.output.find('\n', at) - at - 24);
  return e;
}

// Our model with a run's weights (its own model.pt, no layout involved), run on x; written with x for Python.
void write_ours(const TempDir& dir, models::Model model, const std::string& run_dir, const torch::Tensor& x) {
  trainer::load_state_dict(*model, (run_dir + "/exported.pt"), true);
  trainer::write_safetensors((dir / "ours.safetensors").string(), {{"x", x}, {"y", logits_of(model, x)}});
}

double python_maxdiff(const TempDir& dir, const std::string& line) {
  auto c = testutil::run(testutil::python() + " " + ref_script() + " check-line " + dir.str() + " \"" + line + "\"");
  if (c.exit_code != 0 || c.output.find("maxdiff ") == std::string::npos) throw std::runtime_error("check failed: " + c.output);
  std::cout << "measured: " << c.output.substr(c.output.find("maxdiff "));  // the figure docs/MODELS.md cites
  return std::stod(c.output.substr(c.output.find("maxdiff ") + 8));
}

}  // namespace

TEST(SafetensorsLibraries, ExportedGptLoadsIntoTransformersAndBackThroughInitFrom) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  testutil::fs::create_directories(dir / "hf");
  const std::string model = "--set model.name=gpt_tiny --set model.context=32 --set model.vocab_size=96";
  auto e = train_and_export(dir, "run", model, "--format safetensors --layout hf --out " + (dir / "hf").string());
  EXPECT_TRUE(testutil::fs::exists(dir / "hf" / "model.safetensors"));
  EXPECT_TRUE(testutil::fs::exists(dir / "hf" / "config.json"));
  EXPECT_EQ(e.how_to_load, "transformers.GPT2LMHeadModel.from_pretrained('" + (dir / "hf").string() + "')");
  testutil::final_weights(e.run_dir);  // writes run/exported.pt
  torch::manual_seed(9);
  const auto x = torch::randint(96, {2, 32}, torch::kLong);
  write_ours(dir, models::create_model("gpt_tiny", models::ModelOptions().vocab_size(96).context(32)), e.run_dir, x);
  EXPECT_LT(python_maxdiff(dir, e.how_to_load), 1e-4);
  // transformers found every weight where it expected it.
  auto c = testutil::run(testutil::python() + " " + ref_script() + " gpt-check " + dir.str());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("loading missing=[] unexpected=[] mismatched=[]"), std::string::npos) << c.output;

  // Back: a new run starts from the exported file (init_from, the Hugging Face layout recognised); with a
  // learning rate of 1e-30 its one step leaves the weights those of the first run.
  const std::string run2 = (dir / "again").string();
  auto r = testutil::run(testutil::trainer_cmd(run2, model + kOneStep + "--set optim.lr=1e-30 --set model.init_from=" +
                                                         (dir / "hf" / "model.safetensors").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(safetensors, Hugging Face GPT2LMHeadModel, Conv1D weights transposed layout)"), std::string::npos)
      << r.output;
  // (1e-30 times a gradient is below half an ulp of every weight that is not exactly 0.)
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(run2), testutil::final_weights(e.run_dir)), 1e-20);
}

TEST(SafetensorsLibraries, ExportedResnetLoadsIntoTimmAndFineTunesWithAnotherHead) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  const std::string model = "--set model.name=resnet18 --set data.shape=[3,32,32]";
  const std::string file = (dir / "r18.safetensors").string();
  auto e = train_and_export(dir, "run", model, "--layout timm --out " + file);
  EXPECT_EQ(e.how_to_load, "timm.create_model('resnet18', num_classes=10, in_chans=3, checkpoint_path='" + file + "')");
  testutil::final_weights(e.run_dir);
  torch::manual_seed(9);
  write_ours(dir, models::create_model("resnet18", models::ModelOptions().num_classes(10)), e.run_dir, torch::randn({2, 3, 32, 32}));
  EXPECT_LT(python_maxdiff(dir, e.how_to_load), 1e-4);

  // Fine-tuning with 7 classes: the head of another size is refused by name, or kept with init_skip.
  const std::string job = model + " --set model.num_classes=7" + kOneStep + "--set model.init_from=" + file;
  auto r = testutil::run(testutil::trainer_cmd((dir / "seven").string(), job));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: load_state_dict: " + file + " does not match the module: wrong shapes: fc.weight (module "
                          "[7, 512], file [10, 512]), fc.bias (module [7], file [10]);"),
            std::string::npos)
      << r.output;
  r = testutil::run(testutil::trainer_cmd((dir / "seven_skip").string(), job + " --set 'model.init_skip=[fc.*]'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 keys keep their initialization (model.init_skip): fc.weight, fc.bias"), std::string::npos) << r.output;
}

TEST(SafetensorsLibraries, ExportedVitLoadsIntoTimm) {
  SKIP_WITHOUT_LIBRARIES();
  TempDir dir;
  const std::string file = (dir / "vit.safetensors").string();
  auto e = train_and_export(dir, "run", "--set model.name=vit_tiny --set data.shape=[1,28,28]", "--layout timm --out " + file);
  EXPECT_EQ(e.how_to_load,
            "timm.create_model('vit_tiny_patch16_224', img_size=28, patch_size=4, in_chans=1, embed_dim=128, depth=6, "
            "num_heads=4, num_classes=10, act_layer='gelu_tanh', norm_layer=functools.partial(torch.nn.LayerNorm, "
            "eps=1e-5), checkpoint_path='" + file + "')");
  testutil::final_weights(e.run_dir);
  torch::manual_seed(9);
  write_ours(dir, models::create_model("vit_tiny", models::ModelOptions().num_classes(10).in_channels(1)), e.run_dir,
             torch::randn({2, 1, 28, 28}));
  EXPECT_LT(python_maxdiff(dir, e.how_to_load), 1e-4);
}

TEST(SafetensorsExport, LayoutsThatDoNotFitTheModelAreOneLine) {
  TempDir dir;
  const std::string job = "--set model.name=plain_cnn --set data.shape=[1,8,8]" + kOneStep;
  auto r = testutil::run(testutil::trainer_cmd((dir / "run").string(), job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ex = [&](const std::string& args) { return testutil::run(testutil::trainer_bin() + " export --run-dir " + (dir / "run").string() + " " + args); };
  r = ex("--layout hf --out " + (dir / "w.safetensors").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "error: export: model 'plain_cnn': layout hf (transformers' GPT2LMHeadModel, LlamaForCausalLM) is for "
                      "language models; for ResNets and ViTs use ours or timm\n");
  r = ex("--layout keras --out " + (dir / "w.safetensors").string());
  EXPECT_EQ(r.output, "error: layout 'keras' is not one of: ours, hf, timm\n");
  r = ex("--format pt --out " + (dir / "w.safetensors").string());
  EXPECT_EQ(r.output, "error: export: --format pt would write a torch.save archive into " + (dir / "w.safetensors").string() +
                          "; use --format safetensors, or another file name\n");
  // ours as safetensors and as pt: the same tensors.
  r = ex("--out " + (dir / "w.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = ex("--out " + (dir / "w.pt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("load it in Python with: torch.load('" + (dir / "w.pt").string() + "')"), std::string::npos) << r.output;
  auto a = by_name(trainer::read_safetensors((dir / "w.safetensors").string()).tensors);
  auto b = by_name(trainer::read_tensors((dir / "w.pt").string()));
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, t] : b) EXPECT_TRUE(same_bits(a.at(k), t)) << k;
  const auto meta = trainer::read_safetensors((dir / "w.safetensors").string()).metadata;
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("trainer.model"), "plain_cnn");
  EXPECT_EQ(meta.at("trainer.step"), "1");
}

// A GPT padded by model.vocab_multiple (96 tokens in 128 rows) leaves in the Hugging Face layout with its
// real 96 rows (transformers would otherwise score the padding rows as tokens), and a file of the real
// vocabulary fills a padded model with zero padding rows: our layout keeps them all.
TEST(SafetensorsExport, VocabularyPaddingLeavesAndReturnsAsZeroRows) {
  TempDir dir;
  testutil::fs::create_directories(dir / "hf");
  const std::string model = "--set model.name=gpt_tiny --set model.context=32 --set model.vocab_size=96 --set model.vocab_multiple=64";
  auto e = train_and_export(dir, "run", model, "--format safetensors --layout hf --out " + (dir / "hf").string());
  const auto hf = by_name(trainer::read_weights((dir / "hf" / "model.safetensors").string()).tensors);
  ASSERT_EQ(hf.at("transformer.wte.weight").size(0), 96);
  const auto config = nlohmann::json::parse(testutil::read_file(dir / "hf" / "config.json"));
  EXPECT_EQ(config["vocab_size"], 96);
  const auto trained = testutil::final_weights(e.run_dir);
  const auto& wte = trained.at("transformer.wte.weight");
  ASSERT_EQ(wte.size(0), 128);
  EXPECT_TRUE(same_bits(wte.narrow(0, 0, 96).contiguous(), hf.at("transformer.wte.weight")));

  // Back into a padded model: the padding rows are zeros, the rest is the file.
  const std::string run2 = (dir / "again").string();
  auto r = testutil::run(testutil::trainer_cmd(run2, model + kOneStep + "--set optim.lr=1e-30 --set model.init_from=" +
                                                         (dir / "hf" / "model.safetensors").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("transformer.wte.weight: 96 rows, padded with zero rows to 128 (model.vocab_multiple)"),
            std::string::npos) << r.output;
  const auto again = testutil::final_weights(run2).at("transformer.wte.weight");
  ASSERT_EQ(again.size(0), 128);
  EXPECT_EQ(again.narrow(0, 96, 32).count_nonzero().item<int64_t>(), 0);
  EXPECT_LT((again.narrow(0, 0, 96) - wte.narrow(0, 0, 96)).abs().max().item<double>(), 1e-20);
  // Unpadded into padded without the file being the real vocabulary is still a shape error that names it.
  r = testutil::run(testutil::trainer_cmd((dir / "other").string(),
                                          "--set model.name=gpt_tiny --set model.context=32 --set model.vocab_size=90 "
                                          "--set model.vocab_multiple=64" + kOneStep + "--set model.init_from=" +
                                              (dir / "hf" / "model.safetensors").string()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("transformer.wte.weight (module [128, "), std::string::npos) << r.output;
}

}  // namespace test_safetensors
