// A small CNN without normalization layers: conv stem, then blocks of (3x3 conv, stride 2, ReLU), global
// average pooling and a linear classifier. With no batch statistics, k micro-batches give exactly the
// gradients of one batch, so this is the model the exactness tests (accumulation, OOM backoff, resume
// with another micro-batch) use. Fashion-MNIST's own benchmark table lists a 2-conv CNN at 91.6%.
#pragma once

#include "models/model.h"

namespace models {

struct PlainCnnOptions {
  /// Input channels.
  TORCH_ARG(int64_t, in_channels) = 3;
  /// Classifier outputs.
  TORCH_ARG(int64_t, num_classes) = 10;
  /// Channels of the stem; each block doubles them.
  TORCH_ARG(int64_t, width) = 16;
  /// Number of strided blocks after the stem.
  TORCH_ARG(int64_t, depth) = 3;
};

class PlainCnnImpl : public ModelImpl {
 public:
  explicit PlainCnnImpl(const PlainCnnOptions& options);
  torch::Tensor forward(const torch::Tensor& x) override;
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_.size()); }
  double forward_flops(const std::vector<int64_t>& sample_shape) const override;

  PlainCnnOptions options;

 private:
  torch::nn::Conv2d stem_{nullptr};
  std::vector<torch::nn::Conv2d> blocks_;
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(PlainCnn);

}  // namespace models
