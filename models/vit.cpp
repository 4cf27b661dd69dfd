#include "models/vit.h"

#include "models/activation_checkpoint.h"

#include <cmath>

namespace models {
namespace {

namespace nn = torch::nn;

const ViTOptions& checked(const ViTOptions& o) {
  TORCH_CHECK(o.patch_size() > 0 && o.image_size() > 0 && o.image_size() % o.patch_size() == 0,
              "ViT: image_size must be a positive multiple of patch_size, got image_size ", o.image_size(),
              ", patch_size ", o.patch_size());
  TORCH_CHECK(o.in_channels() > 0 && o.num_classes() > 0 && o.n_layer() > 0,
              "ViT: in_channels, num_classes and n_layer must be positive, got ", o.in_channels(), ", ",
              o.num_classes(), ", ", o.n_layer());
  TORCH_CHECK(o.n_head() > 0 && o.n_embd() > 0 && o.n_embd() % o.n_head() == 0,
              "ViT: n_embd must be a positive multiple of n_head, got n_embd ", o.n_embd(), ", n_head ",
              o.n_head());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, "ViT: dropout must be in [0, 1), got ", o.dropout());
  return o;
}

}  // namespace

ViTImpl::ViTImpl(const ViTOptions& o) : options(checked(o)) {
  const int64_t C = o.n_embd();
  patch_embed = register_module(
      "patch_embed", nn::Conv2d(nn::Conv2dOptions(o.in_channels(), C, o.patch_size()).stride(o.patch_size())));
  cls_token = register_parameter("cls_token", torch::zeros({1, 1, C}));
  pos_embed = register_parameter("pos_embed", torch::zeros({1, 1 + num_patches(), C}));
  drop = register_module("drop", nn::Dropout(o.dropout()));
  blocks = register_module("blocks", nn::ModuleList());
  const auto bo = TransformerBlockOptions(C, o.n_head()).dropout(o.dropout()).causal(false);
  for (int64_t i = 0; i < o.n_layer(); ++i) {
    blocks_.emplace_back(bo);
    blocks->push_back(blocks_.back());
  }
  ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({C})));
  head = register_module("head", nn::Linear(C, o.num_classes()));

  torch::NoGradGuard no_grad;
  nn::init::normal_(cls_token, 0.0, 0.02);
  nn::init::normal_(pos_embed, 0.0, 0.02);
  for (auto& b : blocks_) gpt2_init_block(*b, o.n_layer());
  nn::init::normal_(head->weight, 0.0, 0.02);
  nn::init::zeros_(head->bias);
}

int64_t ViTImpl::num_patches() const {
  const int64_t side = options.image_size() / options.patch_size();
  return side * side;
}

torch::Tensor ViTImpl::forward(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == options.in_channels() &&
                  images.size(2) == options.image_size() && images.size(3) == options.image_size(),
              "ViT: expected images (B, ", options.in_channels(), ", ", options.image_size(), ", ",
              options.image_size(), "), got ", images.sizes());
  const int64_t B = images.size(0);
  auto x = patch_embed(images);                      // (B, C, H/p, W/p)
  x = x.flatten(2).transpose(1, 2);                  // (B, N, C): patches in row-major order
  x = torch::cat({cls_token.expand({B, 1, -1}), x}, 1);  // (B, 1 + N, C)
  x = drop(x + pos_embed);
  for (int64_t i = 0; i < num_blocks(); ++i) x = run_block(i, block_boundary(i, x));
  x = ln_f(x);
  return head(x.select(1, 0));  // (B, num_classes): the class token
}

torch::Tensor ViTImpl::run_block(int64_t i, const torch::Tensor& x) {
  auto& block = blocks_[i];
  if (!block_checkpointed(i)) return block->forward(x);
  // Recompute this layer in backward; checkpoint() restores the RNG so dropout draws the same masks.
  return checkpoint(*block, [&block](const torch::Tensor& t) { return block->forward(t); }, x);
}

double ViTImpl::forward_flops(const std::vector<int64_t>& sample_shape) const {
  TORCH_CHECK(sample_shape.size() == 3 && sample_shape[0] == options.in_channels() &&
                  sample_shape[1] == options.image_size() && sample_shape[2] == options.image_size(),
              "ViT: expected a sample shape (", options.in_channels(), ", ", options.image_size(),
              ", ", options.image_size(), "), got ", c10::IntArrayRef(sample_shape));
  const double C = static_cast<double>(options.n_embd()), N = static_cast<double>(num_patches());
  const double p = static_cast<double>(options.patch_size());
  double flops = 2.0 * N * C * options.in_channels() * p * p;
  for (const auto& b : blocks_) flops += b->flops(num_patches() + 1);
  return flops + 2.0 * C * options.num_classes();
}

void ViTImpl::set_attention_backend(AttentionBackend backend) {
  for (auto& b : blocks_) b->attn->backend = backend;
}

}  // namespace models
