// Decoder-only Transformers of the Llama family (Touvron et al. 2023, "LLaMA"; Llama 3, Qwen2, SmolLM2,
// Mistral), computing what transformers' LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM compute:
//
//   tokens -> embed_tokens -> n_layer x [ x + attn(rms(x)), then + mlp(rms(x)) ] -> norm -> lm_head
//
//   RMSNorm        x * rsqrt(mean(x^2) + eps) * weight, in float32 whatever the input's dtype (as
//                  transformers' LlamaRMSNorm), no bias, no mean subtraction (Zhang & Sennrich 2019).
//   attention      grouped-query (Ainslie et al. 2023): n_head query heads share n_kv_head key/value heads
//                  (n_head a multiple of n_kv_head; n_kv_head = n_head is multi-head attention); rotary
//                  position embeddings on q and k (Su et al. 2021, in transformers' "rotate half" layout);
//                  optional biases on q, k and v (Qwen2), none on o_proj.
//   MLP            SwiGLU (Shazeer 2020): down_proj(silu(gate_proj(x)) * up_proj(x)), no biases.
//   lm_head        its own weight, or embed_tokens' (tie_embeddings).
//
// Parameter names are transformers' own, so a Hub checkpoint loads by name with nothing renamed:
//   model.embed_tokens.weight                                (V, C)
//   model.layers.N.input_layernorm.weight                    (C)
//   model.layers.N.self_attn.q_proj.{weight,bias}            (n_head * hd, C), bias with qkv_bias
//   model.layers.N.self_attn.k_proj.{weight,bias}            (n_kv_head * hd, C)
//   model.layers.N.self_attn.v_proj.{weight,bias}            (n_kv_head * hd, C)
//   model.layers.N.self_attn.o_proj.weight                   (C, n_head * hd)
//   model.layers.N.post_attention_layernorm.weight           (C)
//   model.layers.N.mlp.{gate_proj,up_proj}.weight            (intermediate_size, C)
//   model.layers.N.mlp.down_proj.weight                      (C, intermediate_size)
//   model.norm.weight                                        (C)
//   lm_head.weight                                           (V, C); absent when tie_embeddings
// (hd = head_dim.) The rotary tables are computed, never stored: they are not in a state dict.
#pragma once

#include "models/attention.h"
#include "models/language_model.h"
#include "models/lora.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace models {

/// How the rotary frequencies are scaled for contexts past the pretraining length (transformers'
/// `rope_scaling` / `rope_parameters`). "default": none. "llama3": Llama 3.1's scaling (frequencies
/// whose wavelength exceeds original_context / low_freq_factor are divided by factor; those below
/// original_context / high_freq_factor are kept; those between are interpolated smoothly).
struct RopeScaling {
  TORCH_ARG(std::string, type) = "default";
  TORCH_ARG(double, factor) = 1.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  /// The pretraining context the scaling starts from (original_max_position_embeddings).
  TORCH_ARG(int64_t, original_context) = 8192;
};

/// The architecture of a Llama-family model. The defaults are transformers' LlamaConfig defaults (Llama 2
/// 7B's shape): what a config.json that leaves a field out means.
struct LlamaOptions {
  /// Token ids are in [0, vocab_size).
  TORCH_ARG(int64_t, vocab_size) = 32000;
  /// The longest sequence (max_position_embeddings). Rotary embeddings have no table of this size: it
  /// only bounds forward and the key-value cache.
  TORCH_ARG(int64_t, context) = 4096;
  /// Decoder layers (num_hidden_layers).
  TORCH_ARG(int64_t, n_layer) = 32;
  /// Query heads (num_attention_heads).
  TORCH_ARG(int64_t, n_head) = 32;
  /// Key/value heads (num_key_value_heads); n_head must be a multiple of it. 0 = n_head.
  TORCH_ARG(int64_t, n_kv_head) = 0;
  /// Width of the residual stream (hidden_size).
  TORCH_ARG(int64_t, n_embd) = 4096;
  /// Width of one head (head_dim); 0 = n_embd / n_head (which must then divide evenly). Even.
  TORCH_ARG(int64_t, head_dim) = 0;
  /// The MLP's hidden width (intermediate_size).
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  /// RMSNorm's epsilon (rms_norm_eps).
  TORCH_ARG(double, rms_norm_eps) = 1e-5;
  /// The rotary base (rope_theta).
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(RopeScaling, rope_scaling) = RopeScaling();
  /// Biases on q_proj, k_proj and v_proj (Qwen2's attention_bias), initialized to 0.
  TORCH_ARG(bool, qkv_bias) = false;
  /// The output projection is embed_tokens' weight (tie_word_embeddings): no lm_head parameter.
  TORCH_ARG(bool, tie_embeddings) = false;
  /// Dropout on the attention probabilities (attention_dropout); 0 in every published model.
  TORCH_ARG(double, dropout) = 0.0;

 public:  // TORCH_ARG leaves the section private
  /// head_dim, or n_embd / n_head when it is 0.
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : n_embd_ / n_head_; }
  /// n_kv_head, or n_head when it is 0.
  int64_t kv_heads() const { return n_kv_head_ > 0 ? n_kv_head_ : n_head_; }
};

// The variants, one line each (published config.json values; weights are never fetched here).
/// A byte-level model for tests and CPU training: 4 layers, 128 wide, 4 query heads over 2 key/value heads,
/// SwiGLU 352, context 128, vocabulary 256, tied, rope_theta 10000 (~0.77M parameters).
inline LlamaOptions llama_tiny() {
  return LlamaOptions().vocab_size(256).context(128).n_layer(4).n_head(4).n_kv_head(2).n_embd(128)
      .intermediate_size(352).tie_embeddings(true);
}
/// HuggingFaceTB/SmolLM2-135M: 30 x 576, 9 heads over 3, SwiGLU 1536, vocabulary 49152, tied, theta 1e5.
inline LlamaOptions smollm2_135m() {
  return LlamaOptions().vocab_size(49152).context(8192).n_layer(30).n_head(9).n_kv_head(3).n_embd(576)
      .intermediate_size(1536).rms_norm_eps(1e-5).rope_theta(100000.0).tie_embeddings(true);
}
/// meta-llama/Llama-3.2-1B: 16 x 2048, 32 heads over 8, SwiGLU 8192, vocabulary 128256, tied, theta 5e5,
/// llama3 rope scaling (factor 32, low 1, high 4, original 8192), context 131072.
inline LlamaOptions llama3_2_1b() {
  return LlamaOptions().vocab_size(128256).context(131072).n_layer(16).n_head(32).n_kv_head(8).n_embd(2048)
      .head_dim(64).intermediate_size(8192).rms_norm_eps(1e-5).rope_theta(500000.0).tie_embeddings(true)
      .rope_scaling(RopeScaling().type("llama3").factor(32.0).low_freq_factor(1.0).high_freq_factor(4.0)
                        .original_context(8192));
}
/// Qwen/Qwen2.5-0.5B: 24 x 896, 14 heads over 2, SwiGLU 4864, vocabulary 151936, q/k/v biases, tied,
/// eps 1e-6, theta 1e6, context 32768.
inline LlamaOptions qwen2_5_0_5b() {
  return LlamaOptions().vocab_size(151936).context(32768).n_layer(24).n_head(14).n_kv_head(2).n_embd(896)
      .intermediate_size(4864).rms_norm_eps(1e-6).rope_theta(1000000.0).qkv_bias(true).tie_embeddings(true);
}

/// Checks the options; throws c10::Error naming the first field that is wrong (sizes not positive,
/// n_head not a multiple of n_kv_head, n_embd not divisible by n_head with head_dim 0, an odd head size,
/// eps or theta not positive, dropout outside [0, 1), an unknown rope_scaling type, llama3 scaling with a
/// factor below 1 or high_freq_factor <= low_freq_factor).
void check(const LlamaOptions& options);

/// The rotary inverse frequencies, (head_size / 2) float32, as transformers computes them:
/// 1 / theta^(2i / hd), then the scaling of options.rope_scaling().
torch::Tensor rope_inverse_frequencies(const LlamaOptions& options);

/// RMSNorm (transformers' LlamaRMSNorm): in float32, then weight * normed.to(input dtype). Child: weight.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t width, double eps);
  torch::Tensor forward(const torch::Tensor& x);

  double eps;
  torch::Tensor weight;  ///< (width), initialized to 1
};
TORCH_MODULE(RMSNorm);

/// Grouped-query self-attention with rotary embeddings. Input (B, T, C) and the rotary cos/sin tables of
/// its positions, (T, hd) each -> (B, T, C). Children: q_proj, k_proj, v_proj, o_proj.
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  /// forward for T new positions after the cache's `length` (cos/sin are those of the new positions); the
  /// new keys and values (n_kv_head heads, after the rotation) are appended to `cache`.
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               AttentionCache& cache);

  LlamaOptions options;
  AttentionBackend backend = AttentionBackend::automatic;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(LlamaAttention);

/// The SwiGLU MLP. Children: gate_proj, up_proj, down_proj (no biases).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

/// One decoder layer: x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).
/// Children in order: input_layernorm, self_attn, post_attention_layernorm, mlp.
class LlamaBlockImpl : public torch::nn::Module {
 public:
  explicit LlamaBlockImpl(const LlamaOptions& options);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               AttentionCache& cache);
  /// Linear-layer and attention-matmul FLOPs of one sample of T tokens (multiply-add = 2):
  /// 2 T (C (n_head hd) + 2 C (n_kv_head hd) + (n_head hd) C + 3 C I) + 2 * 2 T^2 (n_head hd).
  double flops(int64_t T) const;

  RMSNorm input_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  LlamaMLP mlp{nullptr};
};
TORCH_MODULE(LlamaBlock);

/// The `model` child: embed_tokens, layers (ModuleList of LlamaBlock, named "0", "1", ...), norm.
class LlamaBodyImpl : public torch::nn::Module {
 public:
  explicit LlamaBodyImpl(const LlamaOptions& options);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

/// The language model. forward: tokens (B, T) int64, T <= context, each in [0, vocab_size) -> logits
/// (B, T, vocab_size) float, where position t sees tokens 0..t only.
///
/// Initialization (transformers' LlamaPreTrainedModel with initializer_range 0.02): embeddings and Linear
/// weights N(0, 0.02), biases 0, RMSNorm weights 1.
class LlamaImpl : public LanguageModelImpl {
 public:
  explicit LlamaImpl(const LlamaOptions& options);

  torch::Tensor forward(const torch::Tensor& tokens) override;
  int64_t num_blocks() const override { return options.n_layer(); }
  /// Forward FLOPs for one sequence of shape {T}: the blocks' LlamaBlockImpl::flops plus the output
  /// projection 2 T C V. Embedding lookups, norms, rotations, SiLU and softmax are not counted.
  double forward_flops(const std::vector<int64_t>& sample_shape) const override;

  int64_t vocab_size() const override { return options.vocab_size(); }
  int64_t context() const override { return options.context(); }
  KVCache make_cache() const override;
  torch::Tensor forward_cached(const torch::Tensor& tokens, KVCache& cache) override;
  void set_attention_backend(AttentionBackend backend) override;

  /// Block i (0 .. n_layer-1).
  LlamaBlock block(int64_t i) const { return blocks_.at(i); }

  LlamaOptions options;
  LlamaBody model{nullptr};
  torch::nn::Linear lm_head{nullptr};  ///< null when tie_embeddings

 private:
  /// cos and sin (T, hd) in `dtype` on `device` for positions start .. start + T - 1.
  std::pair<torch::Tensor, torch::Tensor> rotary(int64_t start, int64_t T, torch::Dtype dtype,
                                                 const torch::Device& device) const;
  torch::Tensor run_block(int64_t i, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::Tensor logits(const torch::Tensor& hidden);

  std::vector<LlamaBlock> blocks_;
  torch::Tensor inv_freq_;  ///< rope_inverse_frequencies(options), float32 on the CPU; not registered
  mutable torch::Tensor inv_freq_on_device_;  ///< inv_freq_ on the device of the last forward
};
TORCH_MODULE(Llama);

}  // namespace models
