// A Vision Transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words"): the image is cut into
// non-overlapping patch x patch squares, each projected to a token by a conv with stride = patch size; a
// learned class token is prepended, learned position embeddings added, and the same pre-LayerNorm
// Transformer blocks as GPT (models/attention.h) run without a causal mask; a final LayerNorm and a
// linear head read the class token.
//
// Parameter names: patch_embed (Conv2d), cls_token (1, 1, C), pos_embed (1, 1 + N, C),
// blocks.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj} (GPT-2's block names, not
// timm's norm1/attn.qkv/attn.proj/norm2/mlp.fc1/mlp.fc2), ln_f, head.
#pragma once

#include "models/attention.h"
#include "models/model.h"

#include <torch/torch.h>

#include <vector>

namespace models {

/// The architecture and the task of a ViT.
struct ViTOptions {
  /// Height and width of the (square) input images; a multiple of patch_size.
  TORCH_ARG(int64_t, image_size) = 28;
  /// Side of a square patch; N = (image_size / patch_size)^2 patches.
  TORCH_ARG(int64_t, patch_size) = 4;
  /// Channels of the input images.
  TORCH_ARG(int64_t, in_channels) = 1;
  /// Output logits.
  TORCH_ARG(int64_t, num_classes) = 10;
  /// Transformer blocks.
  TORCH_ARG(int64_t, n_layer) = 6;
  /// Attention heads per block.
  TORCH_ARG(int64_t, n_head) = 4;
  /// Token width; a multiple of n_head.
  TORCH_ARG(int64_t, n_embd) = 128;
  /// Dropout after the position embedding, on the attention probabilities and on every residual branch.
  TORCH_ARG(double, dropout) = 0.0;
};

/// For Fashion-MNIST (1 x 28 x 28, 10 classes): 4 x 4 patches (49 + 1 tokens), 6 blocks, 4 heads,
/// 128 wide: 1,199,882 parameters.
inline ViTOptions vit_tiny() { return ViTOptions(); }

/// The ViT. forward: images (B, in_channels, image_size, image_size) float -> logits (B, num_classes).
/// Initialization: Linear weights, cls_token and pos_embed N(0, 0.02), Linear biases 0, the blocks'
/// c_proj weights N(0, 0.02 / sqrt(2 n_layer)) as in GPT-2, patch_embed torch.nn.Conv2d's default.
class ViTImpl : public ModelImpl {
 public:
  explicit ViTImpl(const ViTOptions& options);

  torch::Tensor forward(const torch::Tensor& images) override;
  /// n_layer.
  int64_t num_blocks() const override { return options.n_layer(); }
  /// Forward FLOPs for one image of shape {C, H, W} = {in_channels, image_size, image_size}
  /// (multiply-add = 2): the patch conv 2 N C (in_channels p^2), the blocks at T = N + 1 tokens (as
  /// TransformerBlockImpl::flops: linears plus q k^T and att v), and the head 2 C num_classes.
  double forward_flops(const std::vector<int64_t>& sample_shape) const override;

  /// Sets the attention implementation of every block (between forward calls).
  void set_attention_backend(AttentionBackend backend);

  /// Patches per image, N.
  int64_t num_patches() const;

  ViTOptions options;
  torch::nn::Conv2d patch_embed{nullptr};
  torch::Tensor cls_token;
  torch::Tensor pos_embed;
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};

 protected:
  /// Runs block i on x (B, 1 + N, C); forward sends every block through here (activation
  /// checkpointing plugs in here, through block_checkpointed(i)).
  torch::Tensor run_block(int64_t i, const torch::Tensor& x);

 private:
  std::vector<TransformerBlock> blocks_;
};
TORCH_MODULE(ViT);

}  // namespace models
