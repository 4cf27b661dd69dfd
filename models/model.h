// The interface every model the trainer runs implements. Models know nothing of configs, files or the
// training loop: they are built from a ModelOptions by name (models/registry.h) and trained by trainer/.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

namespace models {

/// Base of every registered model.
class ModelImpl : public torch::nn::Module {
 public:
  /// Images (B, C, H, W) -> logits (B, num_classes); language models: tokens (B, T) -> logits (B, T, V).
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;

  /// forward's logits before the model cuts off padding columns, and how many of the last dimension are
  /// real: a model whose output width is padded for speed (GPT's vocab_multiple) returns (..., padded V)
  /// and V, and forward(x) is its first V columns. A loss that reads the real columns in place then hands
  /// back a gradient of the padded shape, with no zero-filled copy made by slicing's backward. Default:
  /// forward(x), all columns real.
  struct Padded {
    torch::Tensor logits;
    int64_t columns;
  };
  virtual Padded forward_padded(const torch::Tensor& x) {
    auto y = forward(x);
    return {y, y.size(-1)};
  }

  /// Number of blocks that activation checkpointing can wrap: residual blocks for ResNets, layers for
  /// Transformers.
  virtual int64_t num_blocks() const = 0;

  /// Forward FLOPs for one sample of shape `sample_shape` ((C, H, W) for images, (T) for tokens),
  /// counting a multiply-add as 2 FLOPs. Convolutions and linear layers (and attention matmuls) only.
  virtual double forward_flops(const std::vector<int64_t>& sample_shape) const = 0;

  /// Marks which blocks recompute their activations in backward instead of keeping them
  /// (size num_blocks(), or empty for none). Takes effect at the next forward; safe between steps.
  void set_checkpointed_blocks(std::vector<bool> mask) {
    TORCH_CHECK(mask.empty() || static_cast<int64_t>(mask.size()) == num_blocks(),
                "set_checkpointed_blocks: mask has ", mask.size(), " entries, model has ", num_blocks(),
                " blocks");
    checkpointed_ = std::move(mask);
  }
  /// True if block `i` is checkpointed.
  bool block_checkpointed(int64_t i) const {
    return i < static_cast<int64_t>(checkpointed_.size()) && checkpointed_[i];
  }

  /// A check run at every block boundary: in forward before block i runs, and in backward when the
  /// gradient has come back through block i (backward = true). It may throw to abandon the pass; the
  /// exception leaves forward() or backward() as it was thrown. The trainer sets one while it probes
  /// micro-batch sizes, so that a stop is honoured within one block instead of one whole pass. Empty (the
  /// default): nothing runs and nothing is registered on the tensors.
  using BlockCheck = std::function<void(int64_t block, bool backward)>;
  void set_block_check(BlockCheck check) { block_check_ = std::move(check); }

 protected:
  /// Every model's forward sends the input of each block through here: runs the block check for block i
  /// and, when `x` takes part in backward, registers it for the way back. Returns `x`.
  const torch::Tensor& block_boundary(int64_t i, const torch::Tensor& x) {
    if (!block_check_) return x;
    block_check_(i, false);
    if (x.requires_grad())
      x.register_hook([check = block_check_, i](const torch::Tensor&) { check(i, true); });
    return x;
  }

  std::vector<bool> checkpointed_;
  BlockCheck block_check_;
};

using Model = std::shared_ptr<ModelImpl>;

}  // namespace models
