// train.sample_every: a short sample of text every N steps on rank 0, as llm.c prints one while it trains
// (trainer/numerics/generate.h), to train.log, metrics.jsonl and TensorBoard. One part of TrainingRun
// (run.h): the tokenizer that decodes the samples and the prompt's ids.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/log.h"
#include "data/samples/source.h"
#include "models/model.h"
#include "trainer/config/config.h"
#include "trainer/observe/telemetry.h"

namespace data {
class Tokenizer;  // data/text/tokenizer.h
}  // namespace data

namespace trainer {

class TextSampler {
 public:
  explicit TextSampler(const Config& cfg) : cfg_(cfg) {}

  /// After the model is built: the tokenizer (the one `source`'s token file records, else bytes for a
  /// vocabulary of at most 256) and the prompt, on the main rank with sample_every > 0. A ConfigError
  /// when the model is not a language model or the samples cannot be decoded.
  void setup(const models::Model& model, const data::TrainingSource& source, int64_t vocab, bool main_rank);
  /// Every train.sample_every steps (`step` completed): a sample of `model` in eval mode; a failure is a
  /// warning and training goes on.
  void maybe_sample(int64_t step, models::Model& model, MetricsLog& metrics, Telemetry& telemetry);

 private:
  const Config& cfg_;
  std::shared_ptr<const data::Tokenizer> sample_tokenizer_;  // train.sample_every: decodes the samples
  std::vector<int64_t> sample_prompt_;                         // its ids
};

}  // namespace trainer
