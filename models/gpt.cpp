#include "models/gpt.h"

#include "models/activation_checkpoint.h"

namespace models {
namespace {

namespace nn = torch::nn;

const GPTOptions& checked(const GPTOptions& o) {
  TORCH_CHECK(o.vocab_size() > 0 && o.context() > 0 && o.n_layer() > 0,
              "GPT: vocab_size, context and n_layer must be positive, got ", o.vocab_size(), ", ", o.context(),
              ", ", o.n_layer());
  TORCH_CHECK(o.n_head() > 0 && o.n_embd() > 0 && o.n_embd() % o.n_head() == 0,
              "GPT: n_embd must be a positive multiple of n_head, got n_embd ", o.n_embd(), ", n_head ",
              o.n_head());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "GPT: dropout must be in [0, 1), got ", o.dropout());
  TORCH_CHECK(o.vocab_multiple() >= 1, "GPT: vocab_multiple must be at least 1, got ", o.vocab_multiple());
  return o;
}

int64_t padded(const GPTOptions& o) {
  const int64_t m = o.vocab_multiple();
  return (o.vocab_size() + m - 1) / m * m;
}

}  // namespace

GPTTransformerImpl::GPTTransformerImpl(const GPTOptions& o)
    : wte(register_module("wte", nn::Embedding(o.vocab_size(), o.n_embd()))),
      wpe(register_module("wpe", nn::Embedding(o.context(), o.n_embd()))),
      drop(register_module("drop", nn::Dropout(o.dropout()))),
      h(register_module("h", nn::ModuleList())),
      ln_f(register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({o.n_embd()})))) {
  const auto block =
      TransformerBlockOptions(o.n_embd(), o.n_head()).dropout(o.dropout()).causal(true).fused_bias(o.fused_bias());
  for (int64_t i = 0; i < o.n_layer(); ++i) h->push_back(TransformerBlock(block));
}

GPTImpl::GPTImpl(const GPTOptions& o)
    : options(checked(o)), transformer(register_module("transformer", GPTTransformer(o))) {
  for (int64_t i = 0; i < o.n_layer(); ++i) blocks_.emplace_back(transformer->h->ptr<TransformerBlockImpl>(i));
  torch::NoGradGuard no_grad;
  nn::init::normal_(transformer->wte->weight, 0.0, 0.02);
  if (padded_vocab() != o.vocab_size()) {
    // Padded after every draw the unpadded model makes, so that both start from the same numbers.
    // set_data keeps the parameter's identity (the module's and any optimizer's references).
    auto& w = transformer->wte->weight;
    w.set_data(torch::cat({w, torch::zeros({padded_vocab() - o.vocab_size(), o.n_embd()}, w.options())}));
    transformer->wte->options.num_embeddings(padded_vocab());
  }
  nn::init::normal_(transformer->wpe->weight, 0.0, 0.02);
  for (auto& b : blocks_) gpt2_init_block(*b, o.n_layer());
}

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens) {
  auto [logits, columns] = forward_padded(tokens);  // (B, T, padded V)
  // The padding columns go before anything sees them: (B, T, V), a view whose rows keep the padded stride.
  return columns == logits.size(-1) ? logits : logits.narrow(-1, 0, columns);
}

models::ModelImpl::Padded GPTImpl::forward_padded(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
              "GPT: expected int64 tokens of shape (B, T), got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T >= 1 && T <= options.context(), "GPT: sequence length ", T, " is outside [1, context = ",
              options.context(), "]");
  auto pos = torch::arange(T, tokens.options());                          // (T)
  auto x = transformer->drop(transformer->wte(tokens) + transformer->wpe(pos));  // (B, T, C) + (T, C)
  for (int64_t i = 0; i < num_blocks(); ++i) x = run_block(i, block_boundary(i, x));
  x = transformer->ln_f(x);
  // Weight tying (Press & Wolf 2017): the output projection is the token embedding matrix.
  return {torch::linear(x, transformer->wte->weight), options.vocab_size()};  // (B, T, padded V), V
}

KVCache GPTImpl::make_cache() const {
  KVCache cache;
  cache.layers.resize(static_cast<size_t>(options.n_layer()));
  for (auto& layer : cache.layers) layer.capacity = options.context();
  return cache;
}

torch::Tensor GPTImpl::forward_cached(const torch::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
              "GPT: expected int64 tokens of shape (B, T), got ", tokens.scalar_type(), " ", tokens.sizes());
  TORCH_CHECK(static_cast<int64_t>(cache.layers.size()) == num_blocks(), "GPT: the cache has ", cache.layers.size(),
              " layers, the model ", num_blocks(), " (make it with make_cache)");
  const int64_t L = cache.length(), T = tokens.size(1);
  TORCH_CHECK(T >= 1 && L + T <= options.context(), "GPT: ", T, " new positions after ", L,
              " cached are outside [1, context = ", options.context(), "]");
  auto pos = torch::arange(L, L + T, tokens.options());                           // (T): after the cached ones
  auto x = transformer->drop(transformer->wte(tokens) + transformer->wpe(pos));  // (B, T, C) + (T, C)
  for (int64_t i = 0; i < num_blocks(); ++i) x = blocks_[i]->forward_cached(x, cache.layers[i]);
  x = transformer->ln_f(x);
  auto logits = torch::linear(x, transformer->wte->weight);  // (B, T, padded V)
  return padded_vocab() == options.vocab_size() ? logits : logits.narrow(-1, 0, options.vocab_size());  // (B, T, V)
}

torch::Tensor GPTImpl::run_block(int64_t i, const torch::Tensor& x) {
  auto& block = blocks_[i];
  if (!block_checkpointed(i)) return block->forward(x);
  // Recompute this layer in backward; checkpoint() restores the RNG so dropout draws the same masks.
  return checkpoint(*block, [&block](const torch::Tensor& t) { return block->forward(t); }, x);
}

double GPTImpl::forward_flops(const std::vector<int64_t>& sample_shape) const {
  TORCH_CHECK(sample_shape.size() == 1 && sample_shape[0] > 0 && sample_shape[0] <= options.context(),
              "GPT: expected a sample shape (T) with 1 <= T <= context = ", options.context(),
              ", got ", c10::IntArrayRef(sample_shape));
  const int64_t T = sample_shape[0];
  double flops = 0;
  for (const auto& b : blocks_) flops += b->flops(T);
  return flops + 2.0 * T * options.n_embd() * options.vocab_size();  // the tied output projection
}

int64_t GPTImpl::padded_vocab() const { return padded(options); }

void GPTImpl::set_attention_backend(AttentionBackend backend) {
  for (auto& b : blocks_) b->attn->backend = backend;
}

}  // namespace models
