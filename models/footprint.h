// What a model holds and what its training step keeps, from its shape alone: the element count of every
// parameter, and per sample the activations autograd keeps from the forward pass for the backward pass.
// Nothing is allocated and no model is built, so `trainer plan` can answer for a model larger than the
// machine. The counts follow the forward passes of gpt.cpp, llama.cpp, attention.cpp, resnet.cpp, vit.cpp
// and plain_cnn.cpp tensor by tensor: what each operation saves for its backward (a convolution its input,
// BatchNorm its input, ReLU its result, a matmul its inputs, softmax and log_softmax their results) and
// what is freed as soon as the next operation has read it. docs/MEMORY.md "The memory plan" shows them
// against measured peaks.
#pragma once

#include "models/gpt.h"
#include "models/llama.h"
#include "models/plain_cnn.h"
#include "models/registry.h"
#include "models/resnet.h"
#include "models/vit.h"

#include <cstdint>
#include <string>
#include <vector>

namespace models {

/// Elements, not bytes: the plan multiplies by the precision it is asked about.
struct Footprint {
  /// The element count of each parameter (the multiset of model.parameters()' numels, in no fixed order).
  std::vector<int64_t> parameters;
  /// Elements of the buffers (BatchNorm's running statistics and counters).
  int64_t buffers = 0;
  /// Elements of a parameter used twice in the forward pass (tied embeddings: the token embedding is also the
  /// output projection): its backward makes two gradients of that size before they are summed. 0: none.
  int64_t tied = 0;
  /// Per sample: the activations kept from the forward pass for the backward pass, nothing recomputed.
  double saved = 0;
  /// Per sample, every block recomputed in backward: the blocks' inputs and what is outside the blocks
  /// (stem, embeddings, the head), plus the largest block's own activations while it is recomputed.
  double saved_checkpointed = 0;
  /// Per sample: what the backward pass holds beside the saved activations at its peak (the gradient of the
  /// logits and of the loss for a language model; the gradients of the largest feature map for a CNN).
  double transient = 0;
  /// Of `saved`, the elements that stay float32 under autocast (log-softmax of the loss, norm statistics).
  double saved_float32 = 0;
  /// The Linear layers a LoRA adapter can target (models/lora.h), one entry per layer: the last part of its
  /// name (q_proj, c_attn), its input and output widths. Empty for the models LoRA does not adapt.
  struct Linear {
    std::string name;
    int64_t in = 0, out = 0;
  };
  std::vector<Linear> linears;

  int64_t parameter_count() const;
  int64_t largest_parameter() const;
};

/// The footprint of the model registered as `name`, built with `options` for samples of `sample_shape`
/// ((C, H, W) or (T)), as create_model(name, options) would build it. `fused_attention`: the attention runs
/// the fused kernel (models::fused_attention_available()), which keeps its output and one log-sum-exp per
/// head instead of the attention matrix. Throws as create_model for an unknown name or bad options.
Footprint model_footprint(const std::string& name, const ModelOptions& options,
                          const std::vector<int64_t>& sample_shape, bool fused_attention);

// Per family, for options already resolved as the registry resolves them (registry.cpp).
Footprint resnet_footprint(const ResNetOptions& o, const std::vector<int64_t>& sample_shape);
Footprint plain_cnn_footprint(const PlainCnnOptions& o, const std::vector<int64_t>& sample_shape);
Footprint gpt_footprint(const GPTOptions& o, const std::vector<int64_t>& sample_shape, bool fused_attention);
Footprint llama_footprint(const LlamaOptions& o, const std::vector<int64_t>& sample_shape, bool fused_attention);
Footprint vit_footprint(const ViTOptions& o, const std::vector<int64_t>& sample_shape, bool fused_attention);

}  // namespace models
