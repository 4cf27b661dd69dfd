// TextSampler: train.sample_every's samples (text_sampler.h).
#include "trainer/run/text_sampler.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>

#include "data/files/token_h5.h"
#include "data/text/tokenizer.h"
#include "models/language_model.h"
#include "trainer/numerics/generate.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

// The tokenizer's end-of-text id (GPT-2's and Qwen2's <|endoftext|>, Llama 3's <|end_of_text|>), or -1.
int32_t end_of_text_id(const data::Tokenizer& tok) {
  const std::string name = data::end_of_text_of(tok);
  return name.empty() ? -1 : tok.special(name);
}

}  // namespace

void TextSampler::setup(const models::Model& model, const data::TrainingSource& source, int64_t vocab,
                        bool main_rank) {
  if (cfg_.train.sample_every == 0 || !main_rank) return;
  if (!std::dynamic_pointer_cast<models::LanguageModelImpl>(model))
    throw ConfigError("train.sample_every: model '" + cfg_.model.name + "' is not a language model; only language models sample (set 0)");
  // The tokenizer the token file records, else bytes.
  std::string path;
  if (const auto* train = dynamic_cast<const data::TokenTrainingSource*>(&source))
    if (const auto* file = dynamic_cast<const data::TokenDataset*>(&train->dataset())) path = file->tokenizer_path();
  if (!path.empty()) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      throw ConfigError("train.sample_every: " + cfg_.data.train + " records the tokenizer " + path +
                        ", which is not there; the samples cannot be decoded (set train.sample_every: 0)");
    sample_tokenizer_ = std::make_shared<const data::Tokenizer>(data::Tokenizer::load(path));
  } else if (vocab <= 256) {
    sample_tokenizer_ = std::make_shared<const data::Tokenizer>(data::Tokenizer::bytes());
  } else {
    throw ConfigError("train.sample_every: the model's vocabulary is " + std::to_string(vocab) +
                      " and the data records no tokenizer to decode samples with (byte tokens are 256); set 0");
  }
  const auto& tok = *sample_tokenizer_;
  // As transformers' tokenizer(prompt): the post-processor's first token (Llama 3's <|begin_of_text|>),
  // then the text with special tokens recognised. No prompt: that first token alone, else the end-of-text
  // token, else a newline.
  const std::string prompt = cfg_.train.sample_prompt;
  const int32_t eot = end_of_text_id(tok);
  if (tok.bos_id() >= 0) sample_prompt_.push_back(tok.bos_id());
  if (!prompt.empty()) {
    for (int32_t id : tok.encode_with_specials(prompt)) sample_prompt_.push_back(id);
  } else if (sample_prompt_.empty() && eot >= 0) {
    sample_prompt_.push_back(eot);
  } else if (sample_prompt_.empty()) {
    for (int32_t id : tok.encode("\n")) sample_prompt_.push_back(id);
  }
  if (sample_prompt_.empty() || static_cast<int64_t>(sample_prompt_.size()) > cfg_.model.context)
    throw ConfigError("train.sample_prompt: " + std::to_string(sample_prompt_.size()) + " tokens; it needs 1 to model.context = " +
                      std::to_string(cfg_.model.context));
  for (int64_t id : sample_prompt_)
    if (id >= vocab)
      throw ConfigError("train.sample_prompt: token " + std::to_string(id) + " is outside the model's vocabulary of " +
                        std::to_string(vocab));
}

void TextSampler::maybe_sample(int64_t step, models::Model& model, MetricsLog& metrics, Telemetry& telemetry) {
  if (!sample_tokenizer_ || step % cfg_.train.sample_every != 0) return;
  auto& lm = dynamic_cast<models::LanguageModelImpl&>(*model);
  GenerateOptions o;
  o.max_new_tokens = cfg_.train.sample_tokens;
  // The sample's own generator, seeded from the run's seed and the step: the same text again after a
  // resume, and the training's generators (dropout, data order) never drawn from.
  o.seed = cfg_.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(step));
  o.stop_token = end_of_text_id(*sample_tokenizer_);
  Generated g;
  telemetry.set_phase("sample");
  lm.eval();
  try {
    g = generate(lm, sample_prompt_, 1, o);
  } catch (const std::exception& e) {
    lm.train();
    // A sample is a view of the model, not its state: it failing (out of memory) must not stop the run.
    spdlog::warn("sample at step {} failed, training goes on: {}", step, error_message(e));
    metrics.event("sample_failed", {{"step", step}, {"message", error_message(e)}});
    return;
  }
  lm.train();
  std::vector<int32_t> ids;
  const int64_t eot = o.stop_token;
  // The text leaves out what the tokenizer put there itself: its first token, or the end-of-text a
  // prompt-less sample started from.
  const bool from_eot = sample_prompt_.size() == 1 && sample_prompt_[0] == eot;
  for (size_t i = 0; i < sample_prompt_.size(); ++i)
    if (!from_eot && !(i == 0 && sample_prompt_[0] == sample_tokenizer_->bos_id()))
      ids.push_back(static_cast<int32_t>(sample_prompt_[i]));
  for (int64_t id : g.samples[0])
    if (id != eot && id < sample_tokenizer_->vocab_size()) ids.push_back(static_cast<int32_t>(id));
  const std::string text = data::replace_invalid_utf8(sample_tokenizer_->decode(ids));
  spdlog::info("sample at step {} ({} tokens, {:.1f} tokens/s):\n{}", step, g.new_tokens, g.tokens_per_s(), text);
  metrics.event("sample", {{"step", step}, {"text", text}, {"tokens", g.new_tokens}, {"seconds", g.seconds}});
}

}  // namespace trainer
