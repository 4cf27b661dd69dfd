// Generation (models/gpt.h's key-value cache, trainer/numerics/generate.h, `trainer sample`): the cached logits
// against the full forward, cached tokens against uncached ones, greedy decoding against transformers'
// generate(do_sample=False) (where the reference Python has transformers: the 2.11 leg), seeded sampling,
// the command's bad input, and train.sample_every (train.log, TensorBoard, a bitwise resume).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>

#include "models/gpt.h"
#include "models/registry.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/numerics/generate.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_sample {

namespace {

using testutil::TempDir;
namespace fs = std::filesystem;

std::shared_ptr<models::GPTImpl> small_gpt(int64_t vocab_multiple = 1, int64_t context = 32) {
  torch::manual_seed(5);
  auto m = std::make_shared<models::GPTImpl>(
      models::GPTOptions().vocab_size(61).context(context).n_layer(2).n_head(4).n_embd(32).vocab_multiple(vocab_multiple));
  m->eval();
  return m;
}

std::vector<models::AttentionBackend> backends() {
  std::vector<models::AttentionBackend> b = {models::AttentionBackend::plain};
  if (models::fused_attention_available()) b.push_back(models::AttentionBackend::fused);
  return b;
}

}  // namespace

// ---- the key-value cache -------------------------------------------------------------------------------

// The prompt at once, then one token at a time, then three at a time (a mask offset by the cache): each
// piece's logits are the full forward's at those positions.
TEST(SampleKvCache, CachedLogitsEqualTheFullForward) {
  for (int64_t multiple : {1, 64}) {
    for (auto backend : backends()) {
      SCOPED_TRACE("vocab_multiple " + std::to_string(multiple) + ", " + models::to_string(backend));
      auto model = small_gpt(multiple);
      model->set_attention_backend(backend);
      torch::NoGradGuard ng;
      torch::manual_seed(6);
      const auto x = torch::randint(61, {2, 20}, torch::kLong);  // (B, T)
      const auto full = model->forward(x);                       // (B, T, V)
      auto cache = model->make_cache();
      EXPECT_EQ(cache.length(), 0);
      EXPECT_EQ(cache.capacity(), 32);
      std::vector<torch::Tensor> pieces;
      pieces.push_back(model->forward_cached(x.narrow(1, 0, 7), cache));
      for (int64_t t = 7; t < 14; ++t) pieces.push_back(model->forward_cached(x.narrow(1, t, 1), cache));
      pieces.push_back(model->forward_cached(x.narrow(1, 14, 3), cache));
      pieces.push_back(model->forward_cached(x.narrow(1, 17, 3), cache));
      EXPECT_EQ(cache.length(), 20);
      const auto cached = torch::cat(pieces, 1);  // (B, T, V)
      ASSERT_EQ(cached.sizes(), full.sizes());
      EXPECT_TRUE(torch::allclose(cached, full, /*rtol=*/1e-5, /*atol=*/1e-5))
          << "max diff " << (cached - full).abs().max().item<double>();
      // The last position's logits, the ones generation reads.
      EXPECT_LT((cached.select(1, 19) - full.select(1, 19)).abs().max().item<double>(), 1e-5);
    }
  }
}

TEST(SampleKvCache, AFullCacheIsRefusedNamingTheContext) {
  auto model = small_gpt(1, 8);
  torch::NoGradGuard ng;
  auto cache = model->make_cache();
  model->forward_cached(torch::zeros({1, 6}, torch::kLong), cache);
  const std::string e = testutil::error_text([&] { model->forward_cached(torch::zeros({1, 3}, torch::kLong), cache); });
  EXPECT_NE(e.find("3 new positions after 6 cached are outside [1, context = 8]"), std::string::npos) << e;
}

// ---- generate ------------------------------------------------------------------------------------------

// With and without the cache the same tokens come out, greedy and sampled, also past the context where
// the window slides (context 16, prompt 5, 30 new tokens).
TEST(SampleGenerate, TheCacheChangesNoToken) {
  auto model = small_gpt(1, 16);
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5};
  for (double temperature : {0.0, 1.0}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    trainer::GenerateOptions o;
    o.max_new_tokens = 30;
    o.temperature = temperature;
    o.top_k = 10;
    o.seed = 7;
    const auto cached = trainer::generate(*model, prompt, 2, o);
    o.kv_cache = false;
    const auto plain = trainer::generate(*model, prompt, 2, o);
    ASSERT_EQ(cached.samples.size(), 2u);
    EXPECT_EQ(cached.samples, plain.samples);
    EXPECT_EQ(cached.samples[0].size(), 30u);
    EXPECT_EQ(cached.new_tokens, 60);
  }
}

TEST(SampleGenerate, SeededSamplingIsReproducibleAndTouchesNoGlobalGenerator) {
  auto model = small_gpt();
  const std::vector<int64_t> prompt = {1, 2, 3};
  trainer::GenerateOptions o;
  o.max_new_tokens = 20;
  o.temperature = 1.0;
  o.top_k = 0;
  o.seed = 11;
  torch::manual_seed(123);
  const auto before = torch::rand({4});
  torch::manual_seed(123);
  const auto a = trainer::generate(*model, prompt, 2, o);
  const auto after = torch::rand({4});
  EXPECT_TRUE(before.equal(after)) << "generate drew from the global CPU generator";
  const auto b = trainer::generate(*model, prompt, 2, o);
  EXPECT_EQ(a.samples, b.samples);
  EXPECT_NE(a.samples[0], a.samples[1]) << "the second sample continues the generator";
  o.seed = 12;
  EXPECT_NE(trainer::generate(*model, prompt, 2, o).samples, a.samples);
}

TEST(SampleGenerate, TopKAndGreedyPickFromTheRightTokens) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto logits = torch::tensor({0.0f, 5.0f, 4.9f, -1.0f, 4.8f});
  trainer::GenerateOptions o;
  o.temperature = 0;
  EXPECT_EQ(trainer::next_token(logits, o, gen), 1);
  o.temperature = 5.0;  // flat enough that every token would come up in 200 draws
  o.top_k = 2;
  std::set<int64_t> seen;
  for (int i = 0; i < 200; ++i) seen.insert(trainer::next_token(logits, o, gen));
  EXPECT_EQ(seen, (std::set<int64_t>{1, 2}));
  o.top_k = 0;
  seen.clear();
  for (int i = 0; i < 400; ++i) seen.insert(trainer::next_token(logits, o, gen));
  EXPECT_EQ(seen.size(), 5u);
}

// ---- against transformers ------------------------------------------------------------------------------

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/sample_ref.py"; }

// "" when the reference Python imports safetensors and transformers, else the first one it lacks.
std::string missing_module() { return testutil::missing_module_of(ref_script()); }

#define SKIP_WITHOUT_TRANSFORMERS()                                                                           \
  if (!missing_module().empty())                                                                              \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing_module()     \
               << " (scripts/install-torch.sh installs safetensors and transformers into the 2.11 venv)"

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(testutil::read_file(p)); }

}  // namespace

// A random GPT2LMHeadModel saved by transformers; `trainer sample --temperature 0` from its safetensors
// file (the shape from the config.json beside it, bytes as tokens: the prompt "0123" is ids 48..51) draws
// generate(do_sample=False)'s tokens, with the cache and without.
TEST(SampleLibraries, GreedyEqualsTransformersGenerate) {
  SKIP_WITHOUT_TRANSFORMERS();
  TempDir dir;
  auto w = testutil::run(testutil::python() + " " + ref_script() + " write " + dir.str() + " 48,49,50,51 24");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const auto want = testutil::ids_after(w.output, "tokens");
  ASSERT_EQ(want.size(), 24u) << w.output;
  const auto gap = w.output.substr(w.output.find("gap ") + 4);
  EXPECT_GT(std::stod(gap), 1e-3) << "near-tie in the reference's greedy path: the comparison would hang on rounding";
  for (const char* cache : {"", " --no-kv-cache"}) {
    SCOPED_TRACE(cache);
    const auto json = dir / "out.json";
    auto r = testutil::run(testutil::trainer_bin() + " sample --init-from " + (dir / "hf/model.safetensors").string() +
                           " --prompt 0123 --tokens 24 --temperature 0 --device cpu --json " + json.string() + cache);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = read_json(json);
    EXPECT_EQ(j["prompt_tokens"].get<std::vector<int64_t>>(), (std::vector<int64_t>{48, 49, 50, 51}));
    EXPECT_EQ(j["samples"][0]["tokens"].get<std::vector<int64_t>>(), want);
    EXPECT_EQ(j["n_layer"], 2);
    EXPECT_EQ(j["context"], 32);
    EXPECT_NE(r.output.find("(safetensors, Hugging Face GPT2LMHeadModel"), std::string::npos) << r.output;
    // stdout: the prompt and its continuation decoded as bytes, then the dashes.
    std::string text = "0123";
    for (int64_t id : want) text += static_cast<char>(id);
    EXPECT_EQ(j["samples"][0]["text"].get<std::string>(), text);
    EXPECT_NE(r.output.find(text + "\n---------------\n"), std::string::npos);
  }
}

// ---- trainer sample on a run, and train.sample_every -------------------------------------------------------

namespace {

// A byte-level gpt_tiny with dropout on text from convert-text, sampling every 2 steps, TensorBoard on.
std::string job(const std::string& data_dir, int64_t steps, const std::string& extra = "") {
  return "--config " + testutil::source_dir() + "/configs/gpt_tiny_fortunes.yaml --set data.train=" + data_dir +
         "/train.h5 --set data.test= --set model.context=16 --set model.dropout=0.1 --set train.global_batch=4"
         " --set train.steps=" + std::to_string(steps) +
         " --set train.threads=1 --set train.deterministic=true --set checkpoint.every_steps=2"
         " --set checkpoint.every_seconds=0 --set schedule.warmup_steps=0 --set schedule.name=constant"
         " --set log.every=1000 --set log.tensorboard=true --set train.sample_every=2 --set train.sample_tokens=12"
         " --set 'train.sample_prompt=The ' " + extra;
}

class SampleRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("trainer_sample");
    const auto text = *dir_ / "text.txt";
    std::string s;
    for (int i = 0; i < 300; ++i) s += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ".\n";
    testutil::write_file(text, s);
    data_ = (*dir_ / "tokens").string();
    auto r = testutil::run(testutil::trainer_bin() + " convert-text --src " + text.string() + " --out " + data_);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    run_ = (*dir_ / "run").string();
    r = testutil::run(testutil::trainer_cmd(run_, job(data_, 4)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string sample(const std::string& args) { return testutil::trainer_bin() + " sample " + args; }

  static TempDir* dir_;
  static std::string data_, run_;
};
TempDir* SampleRun::dir_ = nullptr;
std::string SampleRun::data_, SampleRun::run_;

// The text between the start of `out` (after any log lines before it) and the dashes.
std::string first_sample(const std::string& out, const std::string& prompt) {
  const auto at = out.find(prompt);
  const auto end = out.find("\n---------------\n", at);
  return at == std::string::npos || end == std::string::npos ? "" : out.substr(at, end - at);
}

}  // namespace

TEST_F(SampleRun, SeededSamplingIsReproducibleAndAnotherSeedDiffers) {
  const std::string args = "--run-dir " + run_ + " --prompt 'The qu' --tokens 40 --temperature 1.5 --top-k 0 --num-samples 2";
  auto a = testutil::run(sample(args + " --seed 1"));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = testutil::run(sample(args + " --seed 1"));
  auto c = testutil::run(sample(args + " --seed 2"));
  const std::string sa = first_sample(a.output, "The qu"), sc = first_sample(c.output, "The qu");
  EXPECT_GT(sa.size(), std::string("The qu").size()) << a.output;
  EXPECT_EQ(sa, first_sample(b.output, "The qu"));
  EXPECT_NE(sa, sc);
  EXPECT_NE(a.output.find("sample: 80 tokens in"), std::string::npos) << a.output;  // two samples of 40, on stderr
  // Greedy from the latest checkpoint (step 4), with and without the cache: the same text.
  auto g1 = testutil::run(sample("--run-dir " + run_ + " --prompt 'The ' --tokens 30 --temperature 0"));
  auto g2 = testutil::run(sample("--run-dir " + run_ + " --prompt 'The ' --tokens 30 --temperature 0 --no-kv-cache"));
  ASSERT_EQ(g1.exit_code, 0) << g1.output;
  EXPECT_EQ(first_sample(g1.output, "The "), first_sample(g2.output, "The "));
  EXPECT_NE(g2.output.find("no cache"), std::string::npos) << g2.output;
  // A chosen checkpoint, and --json.
  const auto json = *dir_ / "s.json";
  auto r = testutil::run(sample("--checkpoint " + run_ + "/checkpoints/step-00000002 --prompt 'The ' --tokens 5 --json " +
                                json.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = read_json(json);
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["tokenizer"], "bytes");
  EXPECT_EQ(j["samples"][0]["tokens"].size(), 5u);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
}

TEST_F(SampleRun, BadInputIsOneLineAndExit2) {
  const std::string ok = "--run-dir " + run_ + " --prompt hi";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--prompt hi", "error: sample: nothing to sample from; give --run-dir DIR, --checkpoint DIR or --init-from FILE"},
      {"--run-dir " + run_, "error: sample: --prompt is required (see trainer sample --help)"},
      {"--run-dir " + dir_->str() + "/nope --prompt hi", "error: sample: run folder '" + dir_->str() + "/nope' does not exist"},
      {"--run-dir " + data_ + " --prompt hi", "error: sample: " + data_ + " has no checkpoint to sample from"},
      {ok + " --tokens 0", "error: sample: --tokens must be at least 1, got 0"},
      {ok + " --temperature -1", "error: sample: --temperature must be a number >= 0 (0 = greedy), got -1.000000"},
      {ok + " --top-k -2", "error: sample: --top-k must be >= 0 (0 = every token), got -2"},
      {ok + " --num-samples 0", "error: sample: --num-samples must be at least 1, got 0"},
      {ok + " --bogus", "error: sample: Option 'bogus' does not exist (see trainer sample --help)"},
      {"--run-dir " + run_ + " --prompt " + std::string(17, 'a'),
       "error: sample: the prompt is 17 tokens, longer than the model's context of 16; shorten it"},
      {"--run-dir " + run_ + " --prompt ''", "error: sample: the prompt is empty and the bytes tokenizer has no <|endoftext|> "
                                             "to start from; give --prompt TEXT"},
      {"--init-from " + dir_->str() + "/w.safetensors --prompt hi",
       "error: sample: --init-from " + dir_->str() + "/w.safetensors does not exist"},
  };
  for (const auto& [args, line] : cases) {
    SCOPED_TRACE(args);
    auto r = testutil::run(sample(args));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    if (line.find("Option 'bogus'") != std::string::npos)  // cxxopts 2.x and 3.x word it differently
      EXPECT_NE(out.find("bogus"), std::string::npos) << out;
    else
      EXPECT_EQ(out, line);
    EXPECT_EQ(out.find('\n'), std::string::npos) << "one line: " << out;
  }
  // A weights file without a config.json beside it: the shape cannot be known.
  fs::create_directories(*dir_ / "w");
  testutil::write_file(*dir_ / "w" / "x.safetensors", "x");
  auto r = testutil::run(sample("--init-from " + (*dir_ / "w" / "x.safetensors").string() + " --prompt hi"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  // sample_every on an image model is refused at config time.
  r = testutil::run(testutil::trainer_bin() + " --dry-run --set train.sample_every=10");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("train.sample_every"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model 'resnet20' is not a language model; only GPT models sample (set 0)"), std::string::npos)
      << r.output;
}

namespace {

// The text summaries of a TensorBoard event file, decoded by hand: (step, tag, plugin, dtype, text).
struct TextSummary {
  int64_t step = 0;
  std::string tag, plugin, text;
  uint64_t dtype = 0;
};

struct Reader {
  const std::string& b;
  size_t p, end;
  bool done() const { return p >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int s = 0; p < end; s += 7) {
      const uint8_t c = static_cast<uint8_t>(b[p++]);
      v |= static_cast<uint64_t>(c & 0x7F) << s;
      if (!(c & 0x80)) break;
    }
    return v;
  }
  // The next field: its number, wire type, and (wire type 2) its bytes' range; varints in `value`.
  bool next(int& field, int& wire, size_t& from, size_t& to, uint64_t& value) {
    if (done()) return false;
    const uint64_t k = varint();
    field = static_cast<int>(k >> 3);
    wire = static_cast<int>(k & 7);
    from = to = p;
    if (wire == 0) value = varint();
    else if (wire == 1) p += 8;
    else if (wire == 5) p += 4;
    else if (wire == 2) {
      const uint64_t n = varint();
      from = p;
      to = p + n;
      p = to;
    }
    return true;
  }
};

std::vector<TextSummary> text_summaries(const std::string& file) {
  std::vector<TextSummary> out;
  size_t at = 0;
  while (at + 12 <= file.size()) {
    uint64_t len = 0;
    std::memcpy(&len, file.data() + at, 8);
    const size_t data = at + 12;
    at = data + len + 4;
    Reader ev{file, data, data + len};
    int f, w;
    size_t a, z;
    uint64_t v;
    int64_t step = 0;
    std::vector<std::pair<size_t, size_t>> summaries;
    while (ev.next(f, w, a, z, v)) {
      if (f == 2 && w == 0) step = static_cast<int64_t>(v);
      if (f == 5 && w == 2) summaries.emplace_back(a, z);
    }
    for (auto [sa, sz] : summaries) {
      Reader sum{file, sa, sz};
      while (sum.next(f, w, a, z, v)) {
        if (f != 1) continue;
        TextSummary t;
        t.step = step;
        Reader val{file, a, z};
        size_t va, vz;
        while (val.next(f, w, va, vz, v)) {
          if (f == 1) t.tag = file.substr(va, vz - va);
          if (f == 9) {  // metadata -> plugin_data -> plugin_name
            Reader md{file, va, vz};
            size_t ma, mz;
            while (md.next(f, w, ma, mz, v))
              if (f == 1) {
                Reader pd{file, ma, mz};
                size_t pa, pz;
                while (pd.next(f, w, pa, pz, v))
                  if (f == 1) t.plugin = file.substr(pa, pz - pa);
              }
          }
          if (f == 8) {  // tensor
            Reader tp{file, va, vz};
            size_t ta, tz;
            while (tp.next(f, w, ta, tz, v)) {
              if (f == 1 && w == 0) t.dtype = v;
              if (f == 8) t.text = file.substr(ta, tz - ta);
            }
          }
        }
        if (!t.plugin.empty()) out.push_back(t);
      }
    }
  }
  return out;
}

std::string events_file(const std::string& run_dir) {
  for (const auto& e : fs::directory_iterator(run_dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) return testutil::read_file(e.path());
  return "";
}

}  // namespace

// Every 2 steps a sample from "The", in train.log, as a metrics event and as TensorBoard text; a run cut
// at step 2 and resumed ends bitwise where the whole run ends, with the same samples.
TEST_F(SampleRun, SampleEveryWritesTheLogMetricsAndTensorboardAndResumeStaysBitwise) {
  const auto samples = testutil::events(run_, "sample");
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0]["step"], 2);
  EXPECT_EQ(samples[1]["step"], 4);
  for (const auto& s : samples) {
    EXPECT_EQ(s["text"].get<std::string>().rfind("The", 0), 0u) << s;  // YAML drops the prompt's trailing space
    EXPECT_EQ(s["tokens"], 12);
  }
  const std::string log = testutil::read_file(fs::path(run_) / "train.log");
  EXPECT_NE(log.find("sample at step 2 (12 tokens"), std::string::npos) << log;
  EXPECT_NE(log.find(samples[1]["text"].get<std::string>()), std::string::npos) << log;

  const auto texts = text_summaries(events_file(run_));
  ASSERT_EQ(texts.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(texts[i].step, samples[i]["step"].get<int64_t>());
    EXPECT_EQ(texts[i].tag, "samples");
    EXPECT_EQ(texts[i].plugin, "text");
    EXPECT_EQ(texts[i].dtype, 7u) << "DT_STRING";
    EXPECT_EQ(texts[i].text, samples[i]["text"].get<std::string>());
  }

  const auto cut = (*dir_ / "cut").string();
  auto r = testutil::run(testutil::trainer_cmd(cut, job(data_, 2)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(cut, job(data_, 4)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(run_), testutil::final_weights(cut)));
  const auto again = testutil::events(cut, "sample");
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[1]["text"], samples[1]["text"]);
  // Without samples the run ends on the same weights: sampling draws nothing from the training's generators.
  const auto plain = (*dir_ / "plain").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(plain, job(data_, 4, "--set train.sample_every=0"))).exit_code, 0);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(run_), testutil::final_weights(plain)));
}

}  // namespace test_sample
