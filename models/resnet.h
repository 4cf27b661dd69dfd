// Residual networks: the ImageNet ResNets of He et al. 2015 ("Deep Residual Learning for Image
// Recognition", Table 1) in torchvision's structure (v1.5: a Bottleneck's stride is on its 3x3 conv), and
// the CIFAR ResNets of the same paper, section 4.2 (3x3 stem, 16/32/64 channels, option A shortcuts).
//
// Parameter and buffer names and shapes are exactly torchvision's (conv1, bn1, layer1.0.conv1,
// layer1.0.downsample.0, ..., fc; BatchNorm buffers running_mean, running_var, num_batches_tracked), so a
// state_dict moves between this project and PyTorch by name.
#pragma once

#include "models/model.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace models {

/// Which residual block a ResNet stacks.
enum class BlockKind {
  basic,       ///< two 3x3 convs; expansion 1 (ResNet-18/34 and the CIFAR ResNets)
  bottleneck,  ///< 1x1 reduce, 3x3 (carries the stride), 1x1 expand x4 (ResNet-50/101/152)
};

/// How a block's shortcut matches shapes when the block changes stride or channels.
enum class ShortcutKind {
  projection,  ///< option B: 1x1 conv with the block's stride + BatchNorm, registered as `downsample.0/1`
  zero_pad,    ///< option A: parameter-free; subsample x[:, :, ::2, ::2] and append zero channels
};

/// The stem before the residual stages.
enum class StemKind {
  imagenet,  ///< 7x7 conv stride 2 (64 channels), BatchNorm, ReLU, 3x3 max pool stride 2: H/4 x W/4
  cifar,     ///< 3x3 conv stride 1 (widths[0] channels), BatchNorm, ReLU: full resolution
};

/// Options of one residual block.
struct ResidualBlockOptions {
  ResidualBlockOptions(int64_t in_channels, int64_t planes) : in_channels_(in_channels), planes_(planes) {}
  /// Channels of the block's input.
  TORCH_ARG(int64_t, in_channels);
  /// Width of the block's 3x3 conv(s); the output has planes * expansion channels.
  TORCH_ARG(int64_t, planes);
  /// Stride of the block (on the 3x3 conv, and on the shortcut).
  TORCH_ARG(int64_t, stride) = 1;
  /// Shortcut used when the output shape differs from the input shape (identity otherwise).
  TORCH_ARG(ShortcutKind, shortcut) = ShortcutKind::projection;
};

/// A residual block: relu(branch(x) + shortcut(x)). Input (B, in_channels, H, W) -> output
/// (B, planes * expansion, ceil(H / stride), ceil(W / stride)).
class ResidualBlockImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  /// Conv FLOPs (multiply-add = 2) of one sample whose block input is h x w; sets h, w to the output size.
  virtual double flops(int64_t& h, int64_t& w) const = 0;
  /// The BatchNorm that ends the residual branch (its weight is zeroed by zero_init_residual).
  virtual torch::nn::BatchNorm2d last_bn() const = 0;
};

/// torchvision's BasicBlock: conv1 3x3 (stride) - bn1 - relu - conv2 3x3 - bn2, plus shortcut, relu.
/// Children: conv1, bn1, conv2, bn2 and, for a projection shortcut, downsample (0: conv 1x1, 1: bn).
class BasicBlockImpl : public ResidualBlockImpl {
 public:
  static constexpr int64_t expansion = 1;
  explicit BasicBlockImpl(const ResidualBlockOptions& options);
  torch::Tensor forward(const torch::Tensor& x) override;
  double flops(int64_t& h, int64_t& w) const override;
  torch::nn::BatchNorm2d last_bn() const override { return bn2; }

  ResidualBlockOptions options;
  // Declared (so constructed and registered) in torchvision's order.
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Conv2d conv2{nullptr};
  torch::nn::BatchNorm2d bn2{nullptr};
  /// Empty unless the shortcut is a projection and the shape changes.
  torch::nn::Sequential downsample{nullptr};
};

/// torchvision's Bottleneck (v1.5): conv1 1x1 - bn1 - relu - conv2 3x3 (stride) - bn2 - relu -
/// conv3 1x1 (x4) - bn3, plus shortcut, relu. Children: conv1..3, bn1..3, downsample (0: conv, 1: bn).
class BottleneckImpl : public ResidualBlockImpl {
 public:
  static constexpr int64_t expansion = 4;
  explicit BottleneckImpl(const ResidualBlockOptions& options);
  torch::Tensor forward(const torch::Tensor& x) override;
  double flops(int64_t& h, int64_t& w) const override;
  torch::nn::BatchNorm2d last_bn() const override { return bn3; }

  ResidualBlockOptions options;
  // Declared (so constructed and registered) in torchvision's order.
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Conv2d conv2{nullptr};
  torch::nn::BatchNorm2d bn2{nullptr};
  torch::nn::Conv2d conv3{nullptr};
  torch::nn::BatchNorm2d bn3{nullptr};
  /// Empty unless the shortcut is a projection and the shape changes.
  torch::nn::Sequential downsample{nullptr};
};

/// Options of a ResNet: the architecture (a row of the paper's table) and the task (classes, channels).
struct ResNetOptions {
  ResNetOptions(BlockKind block, std::vector<int64_t> layers) : block_(block), layers_(std::move(layers)) {}
  /// The residual block of every stage.
  TORCH_ARG(BlockKind, block);
  /// Number of blocks per stage; stage i is child `layer{i+1}`. Stages after the first start with stride 2.
  TORCH_ARG(std::vector<int64_t>, layers);
  /// Width (planes) of each stage; same length as layers.
  TORCH_ARG(std::vector<int64_t>, widths) = std::vector<int64_t>{64, 128, 256, 512};
  /// The stem.
  TORCH_ARG(StemKind, stem) = StemKind::imagenet;
  /// Shortcut of the blocks that change shape (the others use the identity).
  TORCH_ARG(ShortcutKind, shortcut) = ShortcutKind::projection;
  /// Output logits.
  TORCH_ARG(int64_t, num_classes) = 1000;
  /// Channels of the input images (3 for RGB, 1 for Fashion-MNIST).
  TORCH_ARG(int64_t, in_channels) = 3;
  /// Zero the weight of the last BatchNorm of every residual branch, so each block starts as the identity
  /// (Goyal et al. 2017); torchvision's `zero_init_residual`.
  TORCH_ARG(bool, zero_init_residual) = false;
};

// The paper's tables, one line per variant. ImageNet: He et al. 2015, Table 1.
inline ResNetOptions resnet18() { return ResNetOptions(BlockKind::basic, {2, 2, 2, 2}); }
inline ResNetOptions resnet34() { return ResNetOptions(BlockKind::basic, {3, 4, 6, 3}); }
inline ResNetOptions resnet50() { return ResNetOptions(BlockKind::bottleneck, {3, 4, 6, 3}); }
inline ResNetOptions resnet101() { return ResNetOptions(BlockKind::bottleneck, {3, 4, 23, 3}); }
inline ResNetOptions resnet152() { return ResNetOptions(BlockKind::bottleneck, {3, 8, 36, 3}); }
/// CIFAR (section 4.2): depth 6n + 2, three stages of n BasicBlocks at 16/32/64 channels, option A.
inline ResNetOptions cifar_resnet(int64_t n) {
  return ResNetOptions(BlockKind::basic, {n, n, n})
      .widths({16, 32, 64})
      .stem(StemKind::cifar)
      .shortcut(ShortcutKind::zero_pad);
}
inline ResNetOptions resnet20() { return cifar_resnet(3); }
inline ResNetOptions resnet32() { return cifar_resnet(5); }
inline ResNetOptions resnet56() { return cifar_resnet(9); }

/// A ResNet. Input (B, in_channels, H, W) float -> logits (B, num_classes). Children, in order: conv1,
/// bn1, layer1 .. layerN (ModuleLists of blocks, named "0", "1", ...), fc. Initialized as torchvision:
/// convs kaiming_normal_(fan_out, relu), BatchNorm weight 1 bias 0, fc as torch.nn.Linear's default.
class ResNetImpl : public ModelImpl {
 public:
  explicit ResNetImpl(const ResNetOptions& options);

  torch::Tensor forward(const torch::Tensor& x) override;
  /// Total residual blocks over all stages (e.g. 8 for ResNet-18, 16 for ResNet-50, 9 for ResNet-20).
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  /// Conv + fc FLOPs per sample of shape (C, H, W), C == in_channels; multiply-add = 2, biases,
  /// BatchNorm, ReLU, pooling and shortcut additions not counted.
  double forward_flops(const std::vector<int64_t>& sample_shape) const override;

  /// Residual block i in forward order (0 .. num_blocks()-1).
  std::shared_ptr<ResidualBlockImpl> block(int64_t i) const { return blocks_.at(i); }

  ResNetOptions options;
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  /// layer1 .. layerN.
  std::vector<torch::nn::ModuleList> layers;
  torch::nn::Linear fc{nullptr};

 protected:
  /// Runs residual block i on x; forward sends every block through here.
  torch::Tensor run_block(int64_t i, const torch::Tensor& x);

 private:
  std::vector<std::shared_ptr<ResidualBlockImpl>> blocks_;
};
TORCH_MODULE(ResNet);

}  // namespace models
