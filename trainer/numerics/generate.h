// Text generation from a language model, GPT or Llama (nanoGPT's `generate` in `model.py`), shared by `trainer sample` and the
// run's samples (train.sample_every).
//
//   each new token    the logits of the last position, divided by the temperature; with top_k only the
//                     k largest stay (the rest -inf); softmax; one draw from a generator of its own, seeded
//                     by `seed`, on the CPU (the same tokens on every device, and the process's generators,
//                     which training and dropout draw from, are never touched). Temperature 0 is greedy:
//                     the argmax, lowest id first among equal logits (transformers' generate(do_sample=False)).
//   the key-value     on (the default): the prompt is run once, then each token costs one position
//   cache             (LanguageModelImpl::forward_cached). Off: every token runs the whole window again, as nanoGPT.
//   past the context  the window slides as nanoGPT's: the last `context` tokens, positions 0 .. context - 1.
//                     With the cache this recomputes the window for every token once the sequence is longer
//                     than the context (same tokens as without it).
//   stop              after `stop_token` (e.g. `<|endoftext|>`) is drawn, which is kept in the tokens; -1 never.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "models/language_model.h"

namespace trainer {

struct GenerateOptions {
  int64_t max_new_tokens = 256;  ///< tokens drawn after the prompt (fewer if stop_token comes first)
  double temperature = 0.8;      ///< > 0 divides the logits; 0 = greedy
  int64_t top_k = 200;           ///< keep the k most likely tokens (0 = all of them)
  uint64_t seed = 1337;          ///< the sampling generator's seed (unused when greedy)
  bool kv_cache = true;          ///< one position per token (false: the whole window each time)
  int64_t stop_token = -1;       ///< stop after drawing this id; -1 = never
};

/// What one generate() call made.
struct Generated {
  std::vector<std::vector<int64_t>> samples;  ///< the new tokens of each sample (the prompt not repeated)
  int64_t new_tokens = 0;                     ///< all samples' tokens together
  double seconds = 0;                         ///< wall time of the forward passes and draws (prompt included)
  /// new_tokens / seconds.
  double tokens_per_s() const { return seconds > 0 ? static_cast<double>(new_tokens) / seconds : 0.0; }
};

/// `num_samples` continuations of `prompt` (at least one id, each in [0, vocab_size)), one after the
/// other with one generator seeded once (two calls with the same arguments give the same tokens). The
/// model runs on its own device in whatever mode it is in: call it in eval mode (the caller's job, so the
/// run can switch back). Runs under NoGradGuard. Throws c10::Error for an empty prompt or an id outside
/// the vocabulary.
Generated generate(models::LanguageModelImpl& model, const std::vector<int64_t>& prompt, int64_t num_samples,
                   const GenerateOptions& options);

/// The next token from the logits (V) of the last position (any dtype, any device): greedy at temperature
/// 0, else temperature, top-k and one draw from `generator` (a CPU generator), as generate() does.
int64_t next_token(const torch::Tensor& logits, const GenerateOptions& options, at::Generator& generator);

}  // namespace trainer
