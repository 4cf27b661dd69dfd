#include "models/plain_cnn.h"

#include "models/activation_checkpoint.h"

namespace models {

namespace nn = torch::nn;

PlainCnnImpl::PlainCnnImpl(const PlainCnnOptions& o) : options(o) {
  TORCH_CHECK(o.in_channels() >= 1 && o.num_classes() >= 1 && o.width() >= 1 && o.depth() >= 0,
              "PlainCnn: in_channels, num_classes and width must be positive, depth non-negative");
  stem_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(o.in_channels(), o.width(), 3).padding(1)));
  int64_t c = o.width();
  for (int64_t i = 0; i < o.depth(); ++i) {
    blocks_.push_back(register_module("block" + std::to_string(i),
                                      nn::Conv2d(nn::Conv2dOptions(c, 2 * c, 3).stride(2).padding(1))));
    c *= 2;
  }
  fc_ = register_module("fc", nn::Linear(c, o.num_classes()));
}

torch::Tensor PlainCnnImpl::forward(const torch::Tensor& x) {
  auto h = torch::relu(stem_->forward(x));  // (B, width, H, W)
  for (int64_t i = 0; i < num_blocks(); ++i) {
    auto& conv = blocks_[i];
    auto fn = [&conv](const torch::Tensor& t) { return torch::relu(conv->forward(t)); };
    block_boundary(i, h);
    h = block_checkpointed(i) ? checkpoint(*conv, fn, h) : fn(h);  // (B, 2^(i+1) width, H/2^(i+1), W/2^(i+1))
  }
  h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);  // (B, C)
  return fc_->forward(h);                                // (B, num_classes)
}

double PlainCnnImpl::forward_flops(const std::vector<int64_t>& s) const {
  TORCH_CHECK(s.size() == 3 && s[0] == options.in_channels(), "PlainCnn: expected a sample shape (",
              options.in_channels(), ", H, W)");
  int64_t h = s[1], w = s[2], c = options.width();
  double flops = 2.0 * options.in_channels() * 9 * c * h * w;
  for (int64_t i = 0; i < options.depth(); ++i) {
    h = (h - 1) / 2 + 1;  // 3x3, stride 2, padding 1
    w = (w - 1) / 2 + 1;
    flops += 2.0 * c * 9 * (2 * c) * h * w;
    c *= 2;
  }
  return flops + 2.0 * c * options.num_classes();
}

}  // namespace models
