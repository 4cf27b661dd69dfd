#include "models/llama.h"

#include "models/activation_checkpoint.h"

#include <cmath>

namespace models {
namespace {

namespace nn = torch::nn;

void check_positive(const char* field, double value) {
  TORCH_CHECK(value > 0, "Llama: ", field, " must be positive, got ", value);
}

void check_rope_scaling(const RopeScaling& s) {
  TORCH_CHECK(s.type() == "default" || s.type() == "llama3",
              "Llama: rope_scaling.type must be \"default\" or \"llama3\", got \"", s.type(), "\"");
  if (s.type() != "llama3") return;
  TORCH_CHECK(s.factor() >= 1, "Llama: rope_scaling.factor must be at least 1 for llama3 scaling, got ", s.factor());
  check_positive("rope_scaling.low_freq_factor", s.low_freq_factor());
  TORCH_CHECK(s.high_freq_factor() > s.low_freq_factor(), "Llama: rope_scaling.high_freq_factor (",
              s.high_freq_factor(), ") must exceed rope_scaling.low_freq_factor (", s.low_freq_factor(), ")");
  check_positive("rope_scaling.original_context", static_cast<double>(s.original_context()));
}

const LlamaOptions& llama_checked(const LlamaOptions& o) {
  check(o);
  return o;
}

// (..., hd) -> (..., hd): the halves [x1, x2] become [-x2, x1] (transformers' rotate_half: the pairs rotated
// together are i and i + hd/2, not neighbours as in the paper's interleaved layout).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x (B, nh, T, hd) rotated by the angles of its positions: cos, sin (T, hd) broadcast over B and nh.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

}  // namespace

void check(const LlamaOptions& o) {
  check_positive("vocab_size", static_cast<double>(o.vocab_size()));
  check_positive("context", static_cast<double>(o.context()));
  check_positive("n_layer", static_cast<double>(o.n_layer()));
  check_positive("n_head", static_cast<double>(o.n_head()));
  check_positive("n_embd", static_cast<double>(o.n_embd()));
  check_positive("intermediate_size", static_cast<double>(o.intermediate_size()));
  TORCH_CHECK(o.n_kv_head() >= 0, "Llama: n_kv_head must be positive (or 0 for n_head), got ", o.n_kv_head());
  TORCH_CHECK(o.n_head() % o.kv_heads() == 0, "Llama: n_head (", o.n_head(), ") must be a multiple of n_kv_head (",
              o.kv_heads(), ")");
  TORCH_CHECK(o.head_dim() >= 0, "Llama: head_dim must be positive (or 0 for n_embd / n_head), got ", o.head_dim());
  TORCH_CHECK(o.head_dim() > 0 || o.n_embd() % o.n_head() == 0, "Llama: n_embd (", o.n_embd(),
              ") must be a multiple of n_head (", o.n_head(), ") when head_dim is 0");
  TORCH_CHECK(o.head_size() % 2 == 0, "Llama: head_dim must be even (rotary embeddings turn pairs of numbers), got ",
              o.head_size(), o.head_dim() > 0 ? "" : " (n_embd / n_head)");
  check_positive("rms_norm_eps", o.rms_norm_eps());
  check_positive("rope_theta", o.rope_theta());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "Llama: dropout must be in [0, 1), got ", o.dropout());
  check_rope_scaling(o.rope_scaling());
}

torch::Tensor rope_inverse_frequencies(const LlamaOptions& o) {
  check(o);
  const int64_t hd = o.head_size();
  // Operation for operation as transformers, float32 throughout, so the rounding is the same:
  // 1.0 / (base ** (arange(0, hd, 2, int64).float() / hd)), where Python's `a / t` is t.reciprocal() * a.
  auto exponent = torch::arange(0, hd, 2, torch::kLong).to(torch::kFloat) / hd;  // (hd/2)
  auto inv_freq = torch::pow(o.rope_theta(), exponent).reciprocal();            // (hd/2)
  const auto& s = o.rope_scaling();
  if (s.type() != "llama3") return inv_freq;
  // _compute_llama3_parameters: long wavelengths slowed by `factor`, short ones kept, those between blended.
  const double old_context = static_cast<double>(s.original_context());
  const double low_freq_wavelen = old_context / s.low_freq_factor();
  const double high_freq_wavelen = old_context / s.high_freq_factor();
  auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor(), inv_freq);
  auto smooth = (wavelen.reciprocal() * old_context - s.low_freq_factor()) / (s.high_freq_factor() - s.low_freq_factor());
  auto smoothed = (1 - smooth) * scaled / s.factor() + smooth * scaled;
  auto medium = (wavelen < high_freq_wavelen).logical_not().logical_and((wavelen > low_freq_wavelen).logical_not());
  return torch::where(medium, smoothed, scaled);
}

// ---------------------------------------------------------------------------------------------------------
RMSNormImpl::RMSNormImpl(int64_t width, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({width}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // In float32 whatever x's dtype (bf16's 8 bits of mantissa would round the mean of squares), then back.
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);  // (..., C) * (..., 1)
  return weight * h.to(x.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------
LlamaAttentionImpl::LlamaAttentionImpl(const LlamaOptions& o) : options(llama_checked(o)) {
  const int64_t C = o.n_embd(), hd = o.head_size();
  q_proj = register_module("q_proj", Linear(nn::LinearOptions(C, o.n_head() * hd).bias(o.qkv_bias())));
  k_proj = register_module("k_proj", Linear(nn::LinearOptions(C, o.kv_heads() * hd).bias(o.qkv_bias())));
  v_proj = register_module("v_proj", Linear(nn::LinearOptions(C, o.kv_heads() * hd).bias(o.qkv_bias())));
  o_proj = register_module("o_proj", Linear(nn::LinearOptions(o.n_head() * hd, C).bias(false)));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), nh = options.n_head(), nkv = options.kv_heads(), hd = options.head_size();
  auto q = q_proj(x).view({B, T, nh, hd}).transpose(1, 2);   // (B, nh, T, hd)
  auto k = k_proj(x).view({B, T, nkv, hd}).transpose(1, 2);  // (B, nkv, T, hd)
  auto v = v_proj(x).view({B, T, nkv, hd}).transpose(1, 2);  // (B, nkv, T, hd)
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  const double p = is_training() ? options.dropout() : 0.0;
  // Grouped-query: each key/value head serves nh / nkv query heads (scaled_dot_product_attention repeats
  // them only where the kernel cannot read the groups itself).
  auto y = scaled_dot_product_attention(q, k, v, /*causal=*/true, p, backend);  // (B, nh, T, hd)
  y = y.transpose(1, 2).contiguous().view({B, T, nh * hd});  // (B, T, nh * hd): heads side by side
  return o_proj(y);                                          // (B, T, C)
}

torch::Tensor LlamaAttentionImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos,
                                                 const torch::Tensor& sin, AttentionCache& cache) {
  const int64_t B = x.size(0), T = x.size(1), nh = options.n_head(), nkv = options.kv_heads(), hd = options.head_size();
  auto q = apply_rotary(q_proj(x).view({B, T, nh, hd}).transpose(1, 2), cos, sin);    // (B, nh, T, hd)
  auto k = apply_rotary(k_proj(x).view({B, T, nkv, hd}).transpose(1, 2), cos, sin);  // (B, nkv, T, hd)
  auto v = v_proj(x).view({B, T, nkv, hd}).transpose(1, 2);                          // (B, nkv, T, hd)
  // The cache holds the n_kv_head heads, not the repeated ones: grouped-query attention's smaller cache.
  auto [keys, values] = append_to_cache(cache, k, v, "LlamaAttention");  // (B, nkv, L + T, hd) each
  const double p = is_training() ? options.dropout() : 0.0;
  auto y = scaled_dot_product_attention(q, keys, values, /*causal=*/true, p, backend);  // (B, nh, T, hd)
  y = y.transpose(1, 2).contiguous().view({B, T, nh * hd});                            // (B, T, nh * hd)
  return o_proj(y);                                                                    // (B, T, C)
}

// ---------------------------------------------------------------------------------------------------------
LlamaMLPImpl::LlamaMLPImpl(const LlamaOptions& o) {
  const int64_t C = o.n_embd(), I = o.intermediate_size();
  gate_proj = register_module("gate_proj", Linear(nn::LinearOptions(C, I).bias(false)));
  up_proj = register_module("up_proj", Linear(nn::LinearOptions(C, I).bias(false)));
  down_proj = register_module("down_proj", Linear(nn::LinearOptions(I, C).bias(false)));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));  // (B, T, I) -> (B, T, C)
}

// ---------------------------------------------------------------------------------------------------------
LlamaBlockImpl::LlamaBlockImpl(const LlamaOptions& o)
    : input_layernorm(register_module("input_layernorm", RMSNorm(o.n_embd(), o.rms_norm_eps()))),
      self_attn(register_module("self_attn", LlamaAttention(o))),
      post_attention_layernorm(register_module("post_attention_layernorm", RMSNorm(o.n_embd(), o.rms_norm_eps()))),
      mlp(register_module("mlp", LlamaMLP(o))) {}

torch::Tensor LlamaBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto h = x + self_attn(input_layernorm(x), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

torch::Tensor LlamaBlockImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin, AttentionCache& cache) {
  auto h = x + self_attn->forward_cached(input_layernorm(x), cos, sin, cache);
  return h + mlp(post_attention_layernorm(h));
}

double LlamaBlockImpl::flops(int64_t T) const {
  const auto& o = self_attn->options;
  const double t = static_cast<double>(T), C = static_cast<double>(o.n_embd());
  const double q = static_cast<double>(o.n_head() * o.head_size());     // query width nh * hd
  const double kv = static_cast<double>(o.kv_heads() * o.head_size());  // key (and value) width nkv * hd
  const double I = static_cast<double>(o.intermediate_size());
  const double linear = 2.0 * t * (C * q + 2.0 * C * kv + q * C + 3.0 * C * I);
  const double attention = 2.0 * 2.0 * t * t * q;  // q k^T and att v over the query heads
  return linear + attention;
}

// ---------------------------------------------------------------------------------------------------------
LlamaBodyImpl::LlamaBodyImpl(const LlamaOptions& o)
    : embed_tokens(register_module("embed_tokens", nn::Embedding(o.vocab_size(), o.n_embd()))),
      layers(register_module("layers", nn::ModuleList())),
      norm(register_module("norm", RMSNorm(o.n_embd(), o.rms_norm_eps()))) {
  for (int64_t i = 0; i < o.n_layer(); ++i) layers->push_back(LlamaBlock(o));
}

LlamaImpl::LlamaImpl(const LlamaOptions& o)
    : options(llama_checked(o)), model(register_module("model", LlamaBody(o))),
      inv_freq_(rope_inverse_frequencies(o)) {
  if (!o.tie_embeddings())
    lm_head = register_module("lm_head", nn::Linear(nn::LinearOptions(o.n_embd(), o.vocab_size()).bias(false)));
  for (int64_t i = 0; i < o.n_layer(); ++i) blocks_.emplace_back(model->layers->ptr<LlamaBlockImpl>(i));
  torch::NoGradGuard no_grad;
  nn::init::normal_(model->embed_tokens->weight, 0.0, 0.02);
  for (auto& b : blocks_) {
    for (auto* linear : {b->self_attn->q_proj.get(), b->self_attn->k_proj.get(), b->self_attn->v_proj.get(),
                         b->self_attn->o_proj.get(), b->mlp->gate_proj.get(), b->mlp->up_proj.get(),
                         b->mlp->down_proj.get()}) {
      nn::init::normal_(linear->weight, 0.0, 0.02);
      if (linear->bias.defined()) nn::init::zeros_(linear->bias);
    }
  }
  if (lm_head) nn::init::normal_(lm_head->weight, 0.0, 0.02);
}

std::pair<torch::Tensor, torch::Tensor> LlamaImpl::rotary(int64_t start, int64_t T, torch::Dtype dtype,
                                                         const torch::Device& device) const {
  // As transformers' LlamaRotaryEmbedding: angles position * inv_freq in float32, cos and sin in float32,
  // then cast to the activations' dtype.
  auto positions = torch::arange(start, start + T, torch::TensorOptions(torch::kLong).device(device));  // (T)
  // The frequencies are copied to the device once, not at every forward: a copy from pageable host memory
  // each step would wait on the host, and is not allowed while a CUDA graph captures the step.
  if (!inv_freq_on_device_.defined() || inv_freq_on_device_.device() != device) inv_freq_on_device_ = inv_freq_.to(device);
  auto freqs = positions.to(torch::kFloat).unsqueeze(1) * inv_freq_on_device_.unsqueeze(0);  // (T, hd/2)
  auto angles = torch::cat({freqs, freqs}, -1);                                                // (T, hd)
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
              "Llama: expected int64 tokens of shape (B, T), got ", tokens.scalar_type(), " ", tokens.sizes());
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T >= 1 && T <= options.context(), "Llama: sequence length ", T, " is outside [1, context = ",
              options.context(), "]");
  auto x = model->embed_tokens(tokens);  // (B, T, C)
  auto [cos, sin] = rotary(0, T, x.scalar_type(), x.device());
  for (int64_t i = 0; i < num_blocks(); ++i) x = run_block(i, block_boundary(i, x), cos, sin);
  return logits(model->norm(x));  // (B, T, V)
}

torch::Tensor LlamaImpl::logits(const torch::Tensor& hidden) {
  // Tied (Press & Wolf 2017): the output projection is the token embedding matrix.
  return torch::linear(hidden, lm_head ? lm_head->weight : model->embed_tokens->weight);  // (B, T, V)
}

torch::Tensor LlamaImpl::run_block(int64_t i, const torch::Tensor& x, const torch::Tensor& cos,
                                   const torch::Tensor& sin) {
  auto& block = blocks_[i];
  if (!block_checkpointed(i)) return block->forward(x, cos, sin);
  // Recompute this layer in backward; checkpoint() restores the RNG so dropout draws the same masks. The
  // rotary tables are constants (no gradient), captured by value: backward runs after forward has returned.
  return checkpoint(*block, [&block, cos, sin](const torch::Tensor& t) { return block->forward(t, cos, sin); }, x);
}

KVCache LlamaImpl::make_cache() const {
  KVCache cache;
  cache.layers.resize(static_cast<size_t>(options.n_layer()));
  for (auto& layer : cache.layers) layer.capacity = options.context();
  return cache;
}

torch::Tensor LlamaImpl::forward_cached(const torch::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
              "Llama: expected int64 tokens of shape (B, T), got ", tokens.scalar_type(), " ", tokens.sizes());
  TORCH_CHECK(static_cast<int64_t>(cache.layers.size()) == num_blocks(), "Llama: the cache has ",
              cache.layers.size(), " layers, the model ", num_blocks(), " (make it with make_cache)");
  const int64_t L = cache.length(), T = tokens.size(1);
  TORCH_CHECK(T >= 1 && L + T <= options.context(), "Llama: ", T, " new positions after ", L,
              " cached are outside [1, context = ", options.context(), "]");
  auto x = model->embed_tokens(tokens);                         // (B, T, C)
  auto [cos, sin] = rotary(L, T, x.scalar_type(), x.device());  // positions L .. L + T - 1
  for (int64_t i = 0; i < num_blocks(); ++i) x = blocks_[i]->forward_cached(x, cos, sin, cache.layers[i]);
  return logits(model->norm(x));  // (B, T, V)
}

double LlamaImpl::forward_flops(const std::vector<int64_t>& sample_shape) const {
  TORCH_CHECK(sample_shape.size() == 1 && sample_shape[0] > 0 && sample_shape[0] <= options.context(),
              "Llama: expected a sample shape (T) with 1 <= T <= context = ", options.context(), ", got ",
              c10::IntArrayRef(sample_shape));
  const int64_t T = sample_shape[0];
  double flops = 0;
  for (const auto& b : blocks_) flops += b->flops(T);
  return flops + 2.0 * T * options.n_embd() * options.vocab_size();  // the output projection
}

void LlamaImpl::set_attention_backend(AttentionBackend backend) {
  for (auto& b : blocks_) b->self_attn->backend = backend;
}

}  // namespace models
