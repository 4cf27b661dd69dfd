// LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), computed as peft's
// `LoraConfig` computes it: a frozen Linear layer W gains two trainable matrices, A (r x in) and B
// (out x r), and computes
//
//   y = W x + b  +  B (A (dropout(x))) * scaling,   scaling = alpha / r   (rsLoRA: alpha / sqrt(r))
//
// A starts as peft's default (Kaiming-uniform with a = sqrt(5), nn.Linear's own initialization), B as
// zeros, so the adapted model starts as the base. Every other parameter of the model is frozen: no
// gradient, no optimizer state.
//
// Names are peft's without its `base_model.model.` prefix: the adapters of
// `model.layers.0.self_attn.q_proj` are `model.layers.0.self_attn.q_proj.lora_A.weight` and
// `...q_proj.lora_B.weight` (children lora_A and lora_B of the adapted Linear).
#pragma once

#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace models {

/// Bad LoRA settings for a model (a target that is no Linear layer, a rank out of range): one line.
struct LoraError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules, use_rslora.
struct LoraOptions {
  int64_t rank = 0;    ///< r; 0 = no LoRA
  double alpha = 8;    ///< lora_alpha (peft's default 8)
  double dropout = 0;  ///< lora_dropout, on the adapter's input only
  bool use_rslora = false;
  /// Last components of the Linear layers' names (q_proj, c_attn, ...); empty = default_lora_targets.
  std::vector<std::string> targets;

  /// alpha / rank, or alpha / sqrt(rank) with use_rslora.
  double scaling() const;
};

/// A Linear layer that may carry a LoRA adapter. Without one it is LibTorch's nn::Linear, computed the
/// same way; the models' projections are this type so that any of them can be adapted.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;

  /// nn::Linear's forward, then add_lora.
  torch::Tensor forward(const torch::Tensor& x);
  /// y (this layer's output for x) plus the adapter's B(A(dropout(x))) * scaling, as peft: x cast to the
  /// adapters' dtype, the sum cast back to y's. y itself when there is no adapter.
  torch::Tensor add_lora(const torch::Tensor& x, const torch::Tensor& y);

  /// Adds the adapter (A Kaiming-uniform from torch's global generator, B zeros) and freezes weight and
  /// bias. The adapters are float32 on the weight's device.
  void attach(const LoraOptions& options);
  bool has_lora() const { return !lora_A.is_empty(); }
  /// (B A) * scaling in float32: what merging adds to weight (peft's get_delta_weight).
  torch::Tensor delta_weight() const;

  torch::nn::Linear lora_A{nullptr};  ///< in -> r, no bias
  torch::nn::Linear lora_B{nullptr};  ///< r -> out, no bias
  double scaling = 0;
  double dropout = 0;
};
TORCH_MODULE(Linear);

/// peft's default target_modules of a model family: q_proj and v_proj for llama, c_attn for gpt. Empty
/// for a model peft has no default for.
std::vector<std::string> default_lora_targets(const std::string& model_name);

/// The distinct last name components of the LoRA-able Linear layers of `model`, in order of first
/// appearance (llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
std::vector<std::string> lora_target_names(const torch::nn::Module& model);

/// Freezes every parameter of `model` and attaches an adapter to each Linear layer whose last name
/// component is one of options.targets (which must be set). Returns the adapted layers' full names.
/// Throws LoraError (one line) for: a rank below 1 or above a targeted layer's smaller side, a
/// negative alpha, a dropout outside [0, 1), a target that names no LoRA-able Linear layer of the
/// model (naming the ones there are), a model that already has adapters.
std::vector<std::string> add_lora(torch::nn::Module& model, const LoraOptions& options);

/// True when `model` has at least one adapter.
bool has_lora(const torch::nn::Module& model);

/// The adapters' parameters by name (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`), in state-dict
/// order. The tensors alias the model's.
std::vector<std::pair<std::string, torch::Tensor>> lora_state(const torch::nn::Module& model);

/// The adapted layers by full name, in state-dict order.
std::vector<std::pair<std::string, LinearImpl*>> lora_layers(const torch::nn::Module& model);

/// The model's state dict with every adapter merged into its layer's weight (W + delta_weight, computed
/// in float32 and rounded to W's dtype as peft's merge_and_unload) and no adapter entries: the base
/// model's names, shapes and dtypes. New tensors; the model is not changed.
std::vector<std::pair<std::string, torch::Tensor>> merged_state(const torch::nn::Module& model);

/// Trainable parameters (requires_grad) of `model`.
int64_t trainable_parameters(const torch::nn::Module& model);

}  // namespace models
