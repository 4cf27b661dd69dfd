#include "models/attention.h"

#include "common/compat.h"

#include <cmath>
#include <limits>

namespace models {
namespace {

namespace nn = torch::nn;

// The reference formula, kept step by step so it reads like the paper and runs on every version.
torch::Tensor plain_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                              double dropout_p) {
  const int64_t T = q.size(-2), S = k.size(-2);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));  // (B, nh, T, S)
  if (causal) {
    // Built per call rather than stored as a buffer, so it never shows up in a state_dict; (T, S) bools.
    // Query i is position S - T + i (the last T of S: a key-value cache's new positions); it sees keys
    // 0 .. S - T + i. S = T: the usual triu(1).
    auto future = torch::ones({T, S}, q.options().dtype(torch::kBool)).triu(S - T + 1);
    att = att.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  att = torch::softmax(att, -1);
  if (dropout_p > 0) att = torch::dropout(att, dropout_p, /*train=*/true);
  return torch::matmul(att, v);  // (B, nh, T, hs)
}

// A Linear layer applied to x: with the bias fused into the matmul (at::linear), or nn::Linear's forward;
// then its LoRA adapter's term, if it has one.
torch::Tensor run_linear(Linear& layer, const torch::Tensor& x, bool fused_bias) {
  return layer->add_lora(x, fused_bias ? torch::linear(x, layer->weight, layer->bias) : layer->nn::LinearImpl::forward(x));
}

}  // namespace

std::string to_string(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::automatic: return "automatic";
    case AttentionBackend::fused: return "fused";
    case AttentionBackend::plain: return "plain";
  }
  return "?";
}

bool fused_attention_available() { return trainer::compat::kHasFusedAttention; }

torch::Tensor scaled_dot_product_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, bool causal, double dropout_p,
                                           AttentionBackend backend) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "scaled_dot_product_attention: expected q, k, v of shape (B, nh, T, hs), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t T = q.size(-2), S = k.size(-2), nh = q.size(1), nkv = k.size(1);
  TORCH_CHECK(S >= T, "scaled_dot_product_attention: ", S, " keys for ", T, " queries; expected at least as many");
  TORCH_CHECK(nkv > 0 && nh % nkv == 0 && v.size(1) == nkv, "scaled_dot_product_attention: ", nh,
              " query heads over ", nkv, " key and ", v.size(1), " value heads; expected a divisor of ", nh);
  const bool fused = backend == AttentionBackend::fused ||
                     (backend == AttentionBackend::automatic && fused_attention_available());
  // The fused kernel's causal mask is aligned to the top left: right for S = T, and a single query (the
  // last position) sees every key anyway; several new queries after a cache need the plain mask.
  const bool fused_mask_fits = T == 1 || T == S || !causal;
  if (fused && fused_mask_fits && (nkv == nh || trainer::compat::kHasGroupedAttention))
    return trainer::compat::fused_attention(q, k, v, dropout_p, causal && T > 1);
  const auto keys = repeat_kv(k, nh / nkv), values = repeat_kv(v, nh / nkv);  // (B, nh, S, hs) each
  if (fused && fused_mask_fits) return trainer::compat::fused_attention(q, keys, values, dropout_p, causal && T > 1);
  return plain_attention(q, keys, values, causal, dropout_p);
}

torch::Tensor repeat_kv(const torch::Tensor& x, int64_t rep) {
  if (rep == 1) return x;
  const int64_t B = x.size(0), nkv = x.size(1), S = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, nkv, rep, S, hd}).reshape({B, nkv * rep, S, hd});  // (B, nkv * rep, S, hd)
}

std::pair<torch::Tensor, torch::Tensor> append_to_cache(AttentionCache& cache, const torch::Tensor& k,
                                                        const torch::Tensor& v, const char* who) {
  const int64_t B = k.size(0), h = k.size(1), T = k.size(2), hs = k.size(3), L = cache.length;
  TORCH_CHECK(L + T <= cache.capacity, who, ": ", T, " new positions after ", L, " cached do not fit the cache's ",
              cache.capacity);
  if (!cache.k.defined()) {
    cache.k = torch::empty({B, h, cache.capacity, hs}, k.options());  // (B, h, capacity, hs)
    cache.v = torch::empty({B, h, cache.capacity, hs}, v.options());
  }
  TORCH_CHECK(cache.k.size(0) == B, who, ": the cache holds batches of ", cache.k.size(0), ", got ", B);
  cache.k.narrow(2, L, T).copy_(k);
  cache.v.narrow(2, L, T).copy_(v);
  cache.length = L + T;
  return {cache.k.narrow(2, 0, L + T), cache.v.narrow(2, 0, L + T)};  // (B, h, L + T, hs) each, views
}

// ---------------------------------------------------------------------------------------------------------
SelfAttentionImpl::SelfAttentionImpl(const TransformerBlockOptions& o) : options(o) {
  TORCH_CHECK(o.n_embd() > 0 && o.n_head() > 0 && o.n_embd() % o.n_head() == 0,
              "SelfAttention: n_embd must be a positive multiple of n_head, got n_embd ", o.n_embd(),
              ", n_head ", o.n_head());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "SelfAttention: dropout must be in [0, 1), got ", o.dropout());
  c_attn = register_module("c_attn", Linear(o.n_embd(), 3 * o.n_embd()));
  c_proj = register_module("c_proj", Linear(o.n_embd(), o.n_embd()));
  resid_dropout = register_module("resid_dropout", nn::Dropout(o.dropout()));
}

torch::Tensor SelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), nh = options.n_head(), hs = C / nh;
  auto qkv = run_linear(c_attn, x, options.fused_bias()).split(C, /*dim=*/2);  // 3 x (B, T, C)
  auto q = qkv[0].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  auto k = qkv[1].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  auto v = qkv[2].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  const double p = is_training() ? options.dropout() : 0.0;
  auto y = scaled_dot_product_attention(q, k, v, options.causal(), p, backend);  // (B, nh, T, hs)
  y = y.transpose(1, 2).contiguous().view({B, T, C});        // (B, T, C): heads side by side
  return resid_dropout(run_linear(c_proj, y, options.fused_bias()));
}

torch::Tensor SelfAttentionImpl::forward_cached(const torch::Tensor& x, AttentionCache& cache) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), nh = options.n_head(), hs = C / nh;
  auto qkv = run_linear(c_attn, x, options.fused_bias()).split(C, /*dim=*/2);  // 3 x (B, T, C)
  auto q = qkv[0].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  auto k = qkv[1].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  auto v = qkv[2].view({B, T, nh, hs}).transpose(1, 2);      // (B, nh, T, hs)
  auto [keys, values] = append_to_cache(cache, k, v, "SelfAttention");  // (B, nh, L + T, hs) each
  const double p = is_training() ? options.dropout() : 0.0;
  auto y = scaled_dot_product_attention(q, keys, values, options.causal(), p, backend);  // (B, nh, T, hs)
  y = y.transpose(1, 2).contiguous().view({B, T, C});        // (B, T, C): heads side by side
  return resid_dropout(run_linear(c_proj, y, options.fused_bias()));
}

// ---------------------------------------------------------------------------------------------------------
MLPImpl::MLPImpl(const TransformerBlockOptions& o) : fused_bias(o.fused_bias()) {
  TORCH_CHECK(o.mlp_ratio() > 0, "MLP: mlp_ratio must be positive, got ", o.mlp_ratio());
  c_fc = register_module("c_fc", Linear(o.n_embd(), o.mlp_ratio() * o.n_embd()));
  c_proj = register_module("c_proj", Linear(o.mlp_ratio() * o.n_embd(), o.n_embd()));
  dropout = register_module("dropout", nn::Dropout(o.dropout()));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // GPT-2 used the tanh approximation of GELU; keeping it makes GPT-2 weights give GPT-2's outputs.
  return dropout(run_linear(c_proj, torch::gelu(run_linear(c_fc, x, fused_bias), "tanh"), fused_bias));
}

// ---------------------------------------------------------------------------------------------------------
TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& o)
    : options(o),
      ln_1(register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({o.n_embd()})))),
      attn(register_module("attn", SelfAttention(o))),
      ln_2(register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({o.n_embd()})))),
      mlp(register_module("mlp", MLP(o))) {}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

torch::Tensor TransformerBlockImpl::forward_cached(const torch::Tensor& x, AttentionCache& cache) {
  auto h = x + attn->forward_cached(ln_1(x), cache);
  return h + mlp(ln_2(h));
}

double TransformerBlockImpl::flops(int64_t T) const {
  const double C = static_cast<double>(options.n_embd()), t = static_cast<double>(T);
  const double linear = 2.0 * t * (3 + 1 + 2 * options.mlp_ratio()) * C * C;
  const double attention = 2.0 * 2.0 * t * t * C;  // q k^T and att v, all heads together
  return linear + attention;
}

void gpt2_init_block(TransformerBlockImpl& block, int64_t n_layer) {
  torch::NoGradGuard no_grad;
  for (auto* linear : {block.attn->c_attn.get(), block.attn->c_proj.get(), block.mlp->c_fc.get(),
                       block.mlp->c_proj.get()}) {
    nn::init::normal_(linear->weight, 0.0, 0.02);
    nn::init::zeros_(linear->bias);
  }
  // Each residual branch adds to the stream once per layer and twice per block; scaling the projections
  // that write into it keeps the stream's variance from growing with depth (GPT-2 paper, section 2.3).
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
  nn::init::normal_(block.attn->c_proj->weight, 0.0, proj_std);
  nn::init::normal_(block.mlp->c_proj->weight, 0.0, proj_std);
}

}  // namespace models
