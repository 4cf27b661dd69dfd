// A decoder-only Transformer language model in GPT-2's structure (Radford et al. 2019, "Language Models
// are Unsupervised Multitask Learners"; names and layout as Karpathy's nanoGPT `model.py`): token and
// learned position embeddings, n_layer pre-LayerNorm blocks with causal multi-head attention and a 4x
// GELU (tanh) MLP, a final LayerNorm, and an output projection tied to the token embedding.
//
// Parameter names are GPT-2's as nanoGPT spells them: transformer.wte, transformer.wpe,
// transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, transformer.ln_f. The
// output projection is transformer.wte.weight itself (one parameter): PyTorch's state_dict also lists it
// as `lm_head.weight`, an alias this model has no separate entry for.
//
// With vocab_multiple > 1 the vocabulary is padded as nanoGPT pads GPT-2's 50257 to 50304: wte has
// padded_vocab() rows, of which the last padded_vocab() - vocab_size are zero; the output matmul then
// has an aligned width, and its padding columns are cut off before the logits leave the model. The
// model computes the same function as the unpadded one (the padding rows are never looked up, their
// logits never reach the loss, and their gradients are exactly zero, so they stay zero under SGD and
// AdamW); only wte's shape in a state dict differs: (padded_vocab, n_embd).
#pragma once

#include "models/attention.h"
#include "models/language_model.h"  // LanguageModelImpl, KVCache

#include <torch/torch.h>

#include <vector>

namespace models {

/// The architecture of a GPT. Defaults are GPT-2 small (124M).
struct GPTOptions {
  /// Token ids are in [0, vocab_size).
  TORCH_ARG(int64_t, vocab_size) = 50257;
  /// Longest sequence (block size): rows of the position embedding.
  TORCH_ARG(int64_t, context) = 1024;
  /// Transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 12;
  /// Attention heads per block.
  TORCH_ARG(int64_t, n_head) = 12;
  /// Width of the residual stream; a multiple of n_head.
  TORCH_ARG(int64_t, n_embd) = 768;
  /// Dropout after the embeddings, on the attention probabilities and on every residual branch.
  TORCH_ARG(double, dropout) = 0.0;
  /// The token embedding's rows (the output matmul's columns) are vocab_size rounded up to a multiple of
  /// this; 1 = no padding. The logits keep vocab_size columns.
  TORCH_ARG(int64_t, vocab_multiple) = 1;
  /// TransformerBlockOptions::fused_bias of every block.
  TORCH_ARG(bool, fused_bias) = true;
};

// The variants, one line each.
/// GPT-2 small: 124,439,808 parameters (tied embeddings, position embedding included).
inline GPTOptions gpt2() { return GPTOptions(); }
/// A byte-level model for tests and CPU training: 4 x 128 wide, context 128, vocabulary 256 (~0.84M).
inline GPTOptions gpt_tiny() { return GPTOptions().vocab_size(256).context(128).n_layer(4).n_head(4).n_embd(128); }

/// The `transformer` child of GPT: embeddings, blocks, final LayerNorm. Children in order: wte, wpe,
/// drop, h (ModuleList of TransformerBlock, named "0", "1", ...), ln_f.
class GPTTransformerImpl : public torch::nn::Module {
 public:
  explicit GPTTransformerImpl(const GPTOptions& options);

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(GPTTransformer);

/// The language model. forward: tokens (B, T) int64, T <= context, each in [0, vocab_size) -> logits
/// (B, T, vocab_size) float, where position t sees tokens 0..t only.
///
/// Initialization (GPT-2 / nanoGPT): embeddings and Linear weights N(0, 0.02), Linear biases 0, the
/// c_proj weights N(0, 0.02 / sqrt(2 n_layer)), LayerNorm weight 1, bias 0. wte's first vocab_size rows
/// draw the numbers the unpadded model's wte draws; its padding rows are zero.
class GPTImpl : public LanguageModelImpl {
 public:
  explicit GPTImpl(const GPTOptions& options);

  torch::Tensor forward(const torch::Tensor& tokens) override;
  /// (B, T, padded V) and vocab_size: the logits with their padding columns (ModelImpl::forward_padded).
  Padded forward_padded(const torch::Tensor& tokens) override;
  /// n_layer.
  int64_t num_blocks() const override { return options.n_layer(); }

  /// options.vocab_size (the logits' width; wte may have more rows, see padded_vocab).
  int64_t vocab_size() const override { return options.vocab_size(); }
  /// options.context.
  int64_t context() const override { return options.context(); }

  /// An empty key-value cache for this model (capacity: the context).
  KVCache make_cache() const override;
  /// The logits of T new positions: tokens (B, T) int64 follow the cache's length() positions (their
  /// position embeddings are length() .. length() + T - 1) -> logits (B, T, vocab_size); the new keys
  /// and values are appended to `cache`. length() + T must not exceed the context. Feeding a sequence
  /// in pieces gives forward(whole sequence)'s logits at each piece's positions (up to rounding). For
  /// inference: call it under NoGradGuard, in eval mode; activation checkpointing and the block check
  /// do not apply. The plain forward (no cache) is unchanged beside it.
  torch::Tensor forward_cached(const torch::Tensor& tokens, KVCache& cache) override;
  /// Forward FLOPs for one sequence of shape {T} (multiply-add = 2; PaLM appendix B / nanoGPT's MFU
  /// convention): every Linear, the tied output projection included, 2 * T * (12 n_layer C^2 + C V),
  /// plus attention q k^T and att v, 2 * 2 * n_layer * T^2 * C, the causal half not subtracted.
  /// Embedding lookups, LayerNorm, GELU, softmax and biases are not counted.
  double forward_flops(const std::vector<int64_t>& sample_shape) const override;

  /// Sets the attention implementation of every block (between forward calls).
  void set_attention_backend(AttentionBackend backend) override;

  /// Rows of wte: vocab_size rounded up to a multiple of vocab_multiple.
  int64_t padded_vocab() const;

  /// Block i (0 .. n_layer-1).
  TransformerBlock block(int64_t i) const { return blocks_.at(i); }

  GPTOptions options;
  GPTTransformer transformer{nullptr};

 protected:
  /// Runs block i on x (B, T, C); forward sends every block through here (activation checkpointing
  /// plugs in here, through block_checkpointed(i)).
  torch::Tensor run_block(int64_t i, const torch::Tensor& x);

 private:
  std::vector<TransformerBlock> blocks_;
};
TORCH_MODULE(GPT);

}  // namespace models
