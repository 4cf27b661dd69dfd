// Models by name: the one table of every model the trainer can build, and the model-level options a
// config sets. Adding a model is one line in registry.cpp's table.
#pragma once

#include "models/llama.h"
#include "models/model.h"

#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

namespace models {

/// What the task asks of a model; the architecture itself comes from its name.
struct ModelOptions {
  /// Output classes (logits per sample) of image classifiers.
  TORCH_ARG(int64_t, num_classes) = 1000;
  /// Channels of input images: 3 for RGB, 1 for Fashion-MNIST.
  TORCH_ARG(int64_t, in_channels) = 3;
  /// ResNets: zero the last BatchNorm weight of every residual branch, so each block starts as the
  /// identity (torchvision's `zero_init_residual`).
  TORCH_ARG(bool, zero_init_residual) = false;

  // Transformers (models/gpt.h, models/vit.h). An integer left at 0 keeps the registered architecture's
  // value (e.g. gpt2's vocab_size 50257, vit_tiny's patch_size 4); ResNets ignore these fields.
  /// Language models: token ids are in [0, vocab_size).
  TORCH_ARG(int64_t, vocab_size) = 0;
  /// Language models: the token embedding's rows rounded up to a multiple of this (GPTOptions::vocab_multiple);
  /// 1 = none.
  TORCH_ARG(int64_t, vocab_multiple) = 1;
  /// GPT: every Linear layer adds its bias inside its matmul (TransformerBlockOptions::fused_bias).
  TORCH_ARG(bool, fused_bias) = true;
  /// Language models: longest sequence (block size), the rows of the position embedding.
  TORCH_ARG(int64_t, context) = 0;
  /// Transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 0;
  /// Attention heads per block.
  TORCH_ARG(int64_t, n_head) = 0;
  /// Width of the residual stream; a multiple of n_head.
  TORCH_ARG(int64_t, n_embd) = 0;
  /// Transformers: dropout after the embeddings, on attention probabilities and on residual branches.
  TORCH_ARG(double, dropout) = 0.0;
  /// Llama family: key/value heads (0 = the registered architecture's).
  TORCH_ARG(int64_t, n_kv_head) = 0;
  /// Llama family: the SwiGLU MLP's hidden width (0 = the registered architecture's).
  TORCH_ARG(int64_t, intermediate_size) = 0;
  /// Llama family: the whole architecture (read from a transformers config.json). Set, it replaces the
  /// registered one, and vocab_size, context, n_layer, n_head, n_embd, n_kv_head and intermediate_size
  /// above are ignored (dropout still applies). `llama` (the name that has no shape of its own) needs it.
  TORCH_ARG(std::optional<LlamaOptions>, llama) = std::nullopt;
  /// ViT: side of a square patch.
  TORCH_ARG(int64_t, patch_size) = 0;
  /// ViT: height and width of the (square) input images.
  TORCH_ARG(int64_t, image_size) = 0;
};

/// Builds the model registered as `name` on the CPU in float32, freshly initialized (draws from torch's
/// global generator, so seed it first for reproducible weights). Throws std::invalid_argument
/// "unknown model 'X'; known models: a, b, ..." for an unknown name.
Model create_model(const std::string& name, const ModelOptions& options = {});

/// What a registered model takes and gives, which the config's checks and the run ask instead of its name
/// (as timm's pretrained_cfg carries a model's input size and classes).
enum class Task {
  kImageClassification,  ///< (B, C, H, W) images in, (B, classes) logits out
  kLanguageModel,        ///< (B, T) token ids in, (B, T, vocabulary) logits out
};

struct ModelTraits {
  Task task = Task::kImageClassification;
  /// Language models: the registered vocabulary (gpt2 50257, gpt_tiny 256; `llama`'s is a default that its
  /// config.json replaces); 0 for image models.
  int64_t vocab_size = 0;
  /// model.vocab_multiple may pad the token embedding's rows (GPT); the other language models take their
  /// vocabulary as it is.
  bool pads_vocab = false;
  /// The shape comes from a transformers config.json (model.init_from a Hub folder, or model.hf_config):
  /// `llama`, which has none of its own.
  bool shape_from_hub = false;
  /// The input's size is part of the architecture (ViT: a position embedding per patch): evaluation images
  /// must have the training images' size.
  bool fixed_input_size = false;

  bool language_model() const { return task == Task::kLanguageModel; }
};

/// The traits of the model registered as `name`. Throws as create_model for an unknown name.
const ModelTraits& model_traits(const std::string& name);

/// A language model's registered vocabulary (model_traits(name).vocab_size); 0 for image models. Throws as
/// create_model for an unknown name.
int64_t registered_vocab_size(const std::string& name);

/// Every registered name, in registration order: resnet18, resnet34, resnet50, resnet101, resnet152
/// (ImageNet, torchvision names), resnet20, resnet32, resnet56 (CIFAR, He et al. 2016 section 4.2),
/// gpt2, gpt_tiny, llama, llama_tiny, smollm2_135m, llama3_2_1b, qwen2_5_0_5b (language models: tokens in,
/// logits per position out), vit_tiny.
std::vector<std::string> model_names();

/// Converts every 4-D parameter and buffer of `module` (recursively) to channels_last (NHWC) memory
/// format in place, keeping values, dtype, device and the parameters' identity (optimizers created
/// before stay valid). Module::to has no memory-format argument in LibTorch. Feed the model
/// channels_last inputs too (x.contiguous(torch::MemoryFormat::ChannelsLast)).
void to_channels_last(torch::nn::Module& module);

}  // namespace models
