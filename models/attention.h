// The pieces GPT (models/gpt.h) and ViT (models/vit.h) share: scaled dot-product attention with two
// interchangeable implementations, multi-head self-attention, the MLP and the pre-LayerNorm Transformer
// block. Submodule names are GPT-2's (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj), and
// c_attn / c_fc / c_proj are Linear layers as in nanoGPT (GPT-2's original checkpoints store them as
// transposed Conv1D weights).
#pragma once

#include "models/lora.h"

#include <torch/torch.h>

#include <string>

namespace models {

/// Which implementation computes softmax(q k^T / sqrt(hs) + mask) v.
enum class AttentionBackend {
  automatic,  ///< fused where LibTorch has it (2.0+: flash / memory-efficient kernels on CUDA), else plain
  fused,      ///< at::scaled_dot_product_attention; an error on LibTorch 1.13, which lacks it
  plain,      ///< matmul, -inf causal mask, softmax, dropout, matmul: every LibTorch version
};

/// "automatic", "fused" or "plain".
std::string to_string(AttentionBackend backend);

/// True where the fused kernel exists (LibTorch 2.0+): trainer::compat::kHasFusedAttention.
bool fused_attention_available();

/// (B, n_kv_head, S, hd) -> (B, n_kv_head * rep, S, hd): each key/value head repeated for the `rep` query
/// heads of its group, next to each other (transformers' repeat_kv; query head h reads kv head h / rep).
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t rep);

/// Scaled dot-product attention of q (B, nh, T, hs) over k, v (B, nkv, S, hs) -> (B, nh, T, hs), scale
/// 1/sqrt(hs); S = T except with a key-value cache (S >= T). nkv = nh, or a divisor of it (grouped-query
/// attention: query head h reads key/value head h / (nh / nkv)): the fused kernel reads the groups where
/// LibTorch can (compat::kHasGroupedAttention, as transformers' sdpa path does), else the keys and values
/// are repeated first (repeat_kv). `causal` masks key positions after the query
/// position, the queries being the last T of the S positions (query i is position S - T + i: a cache's
/// new positions). `dropout_p` drops attention probabilities (applied as given: pass 0 in eval mode).
/// Both backends compute the same function; they differ in rounding and in how dropout draws its random
/// numbers. The fused kernel aligns a causal mask to the top left when T != S, so there one query runs
/// unmasked (it sees every key) and several run the plain way. Throws c10::Error for `fused` where
/// fused_attention_available() is false, naming the version and the way out (`plain`).
torch::Tensor scaled_dot_product_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, bool causal, double dropout_p,
                                           AttentionBackend backend);

/// One attention layer's keys and values of the positions seen so far, for generation one token at a
/// time (GPTImpl::forward_cached): each new position then costs one query against the cached keys
/// instead of the whole sequence again. The buffers are allocated at the first call, (B, nh, capacity,
/// hs) in the dtype and on the device of the layer's keys (nh: the layer's key/value heads, n_kv_head in a
/// grouped-query LlamaAttention); positions [0, length) are filled.
struct AttentionCache {
  torch::Tensor k, v;     ///< (B, nh, capacity, hs), or undefined before the first call
  int64_t length = 0;     ///< positions cached
  int64_t capacity = 0;   ///< the most positions it holds (the model's context)
};

/// Appends the keys and values of T new positions, k and v (B, h, T, hs), to `cache` (allocating its
/// buffers, (B, h, capacity, hs), at the first call) and returns the views of every position cached,
/// (B, h, length + T, hs) each. Written in place, so a step copies its own T positions, not the ones before
/// them (as a cat would). Throws c10::Error naming `who` when the positions do not fit or B changes.
std::pair<torch::Tensor, torch::Tensor> append_to_cache(AttentionCache& cache, const torch::Tensor& k,
                                                        const torch::Tensor& v, const char* who);

/// Options of one Transformer block (and of its attention and MLP).
struct TransformerBlockOptions {
  TransformerBlockOptions(int64_t n_embd, int64_t n_head) : n_embd_(n_embd), n_head_(n_head) {}
  /// Width C of the residual stream; must be divisible by n_head.
  TORCH_ARG(int64_t, n_embd);
  /// Attention heads nh; head size hs = n_embd / n_head.
  TORCH_ARG(int64_t, n_head);
  /// Dropout on the attention probabilities and on both residual branches (after each c_proj).
  TORCH_ARG(double, dropout) = 0.0;
  /// Mask future positions (GPT); false for ViT.
  TORCH_ARG(bool, causal) = true;
  /// Hidden width of the MLP = mlp_ratio * n_embd (4 in GPT-2 and ViT).
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  /// The Linear layers add their bias inside the matmul: torch::linear, one addmm for a contiguous
  /// (B, T, C) input, as PyTorch's nn.Linear. false: nn::Linear's own forward, which for inputs of more
  /// than 2 dimensions runs the matmul and then a separate add over the whole output (LibTorch's C++
  /// functional linear); kept to measure the difference (config model.fused_bias).
  TORCH_ARG(bool, fused_bias) = true;
};

/// Multi-head self-attention. Input (B, T, C) -> output (B, T, C). Children: c_attn (Linear C -> 3C,
/// q, k, v in that order along the output), c_proj (Linear C -> C), resid_dropout.
class SelfAttentionImpl : public torch::nn::Module {
 public:
  explicit SelfAttentionImpl(const TransformerBlockOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  /// forward for T new positions x (B, T, C) that follow the cache's `length` positions: their keys and
  /// values are appended to `cache` (which must have room), and each query attends over the cached keys
  /// and the new ones up to itself (causal). Equals forward over the whole sequence, at the new positions.
  /// For inference (under NoGradGuard); B must be the same at every call on one cache.
  torch::Tensor forward_cached(const torch::Tensor& x, AttentionCache& cache);

  TransformerBlockOptions options;
  /// Which implementation forward uses; changeable between calls.
  AttentionBackend backend = AttentionBackend::automatic;
  Linear c_attn{nullptr};
  Linear c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
};
TORCH_MODULE(SelfAttention);

/// The position-wise MLP: c_fc (C -> mlp_ratio*C), GELU with the tanh approximation (GPT-2's),
/// c_proj (mlp_ratio*C -> C), dropout. Input and output (B, T, C).
class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const TransformerBlockOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

  bool fused_bias = true;  ///< TransformerBlockOptions::fused_bias
  Linear c_fc{nullptr};
  Linear c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(MLP);

/// A pre-LayerNorm Transformer block (GPT-2): x + attn(ln_1(x)), then + mlp(ln_2(x)). Input and output
/// (B, T, C). Children in order: ln_1, attn, ln_2, mlp. LayerNorm eps 1e-5.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const TransformerBlockOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  /// forward for new positions with the attention's key-value cache (SelfAttentionImpl::forward_cached).
  torch::Tensor forward_cached(const torch::Tensor& x, AttentionCache& cache);

  /// Linear-layer and attention-matmul FLOPs of one sample of T tokens (multiply-add = 2):
  /// T * 2 * (3 + 1 + 2 * mlp_ratio) * C^2 for c_attn, attn.c_proj, c_fc and mlp.c_proj, plus
  /// 2 * 2 * T^2 * C for q k^T and att v over all heads (the causal half not subtracted).
  double flops(int64_t T) const;

  TransformerBlockOptions options;
  torch::nn::LayerNorm ln_1{nullptr};
  SelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(TransformerBlock);

/// GPT-2's initialization of a block (nanoGPT `_init_weights`): every Linear weight N(0, 0.02), every
/// Linear bias 0, and the two c_proj weights N(0, 0.02 / sqrt(2 * n_layer)) (the residual-branch
/// scaling of the GPT-2 paper). LayerNorms keep weight 1, bias 0.
void gpt2_init_block(TransformerBlockImpl& block, int64_t n_layer);

}  // namespace models
