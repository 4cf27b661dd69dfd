// What every decoder-only language model (GPT, Llama) offers beyond ModelImpl: generation one token at a
// time through a key-value cache. trainer/numerics/generate.h, `trainer sample` and train.sample_every
// work through this interface, so they do not care which family they run.
#pragma once

#include "models/attention.h"
#include "models/model.h"

#include <torch/torch.h>

#include <vector>

namespace models {

/// The keys and values of every block for the positions a model has seen (forward_cached): generation
/// then costs one position per new token instead of the whole sequence. Made empty by make_cache; the
/// buffers are allocated at the first forward_cached.
struct KVCache {
  std::vector<AttentionCache> layers;  ///< one per block
  /// Positions cached (the next position's index).
  int64_t length() const { return layers.empty() ? 0 : layers.front().length; }
  /// The most positions it holds: the model's context.
  int64_t capacity() const { return layers.empty() ? 0 : layers.front().capacity; }
};

/// A decoder-only language model: forward takes tokens (B, T) int64 and gives logits (B, T, vocab_size()),
/// position t seeing tokens 0..t only.
class LanguageModelImpl : public ModelImpl {
 public:
  /// Token ids are in [0, vocab_size()): the logits' width.
  virtual int64_t vocab_size() const = 0;
  /// The longest sequence forward and a cache take.
  virtual int64_t context() const = 0;
  /// An empty key-value cache for this model (capacity: context()).
  virtual KVCache make_cache() const = 0;
  /// The logits of T new positions: tokens (B, T) int64 follow the cache's length() positions -> logits
  /// (B, T, vocab_size()); the new keys and values are appended to `cache`. length() + T must not exceed
  /// context(). Feeding a sequence in pieces gives forward(whole sequence)'s logits at each piece's
  /// positions (up to rounding). For inference: under NoGradGuard, in eval mode.
  virtual torch::Tensor forward_cached(const torch::Tensor& tokens, KVCache& cache) = 0;
  /// Sets the attention implementation of every block (between forward calls).
  virtual void set_attention_backend(AttentionBackend backend) = 0;
};

}  // namespace models
