#include "models/resnet.h"

#include "models/activation_checkpoint.h"

#include <string>

namespace models {
namespace {

namespace nn = torch::nn;

// Every conv in a ResNet is bias-free (a BatchNorm follows) with "same" padding k/2; conv_flops relies on
// that padding, because reading Conv2dOptions::padding() means visiting a variant whose type differs
// between LibTorch 1.13 and 2.x.
nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// FLOPs of `c` on one sample whose input is h x w; h, w become the output size.
double conv_flops(const nn::Conv2d& c, int64_t& h, int64_t& w) {
  const auto& o = c->options;
  const int64_t kh = (*o.kernel_size())[0], kw = (*o.kernel_size())[1];
  h = (h + 2 * (kh / 2) - kh) / (*o.stride())[0] + 1;
  w = (w + 2 * (kw / 2) - kw) / (*o.stride())[1] + 1;
  return 2.0 * o.out_channels() * h * w * (o.in_channels() / o.groups()) * kh * kw;
}

// Option B shortcut: torchvision's `downsample` = Sequential(conv 1x1 with stride, BatchNorm), whose
// children "0" and "1" give the reference names downsample.0 / downsample.1.
nn::Sequential projection(int64_t in, int64_t out, int64_t stride) {
  return nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out));
}

// Option A shortcut (He et al. 2016, section 3.3): identity with stride-s subsampling, and the extra
// output channels are zeros, so it adds no parameters.
torch::Tensor zero_pad(const torch::Tensor& x, int64_t stride, int64_t out_channels) {
  auto y = stride > 1 ? x.slice(2, 0, x.size(2), stride).slice(3, 0, x.size(3), stride) : x;
  // Pad spec runs from the last dim: (W left, W right, H top, H bottom, C front, C back).
  return torch::constant_pad_nd(y, {0, 0, 0, 0, 0, out_channels - x.size(1)});
}

// The shortcut of a block with the given options and output width: nullptr-Sequential when no
// projection is needed.
nn::Sequential make_downsample(const ResidualBlockOptions& o, int64_t out_channels) {
  const bool reshapes = o.stride() != 1 || o.in_channels() != out_channels;
  if (!reshapes || o.shortcut() != ShortcutKind::projection) return nn::Sequential(nullptr);
  return projection(o.in_channels(), out_channels, o.stride());
}

torch::Tensor shortcut(const ResidualBlockOptions& o, nn::Sequential& downsample, int64_t out_channels,
                       const torch::Tensor& x) {
  if (downsample) return downsample->forward(x);
  if (o.stride() != 1 || o.in_channels() != out_channels) return zero_pad(x, o.stride(), out_channels);
  return x;
}

double downsample_flops(const nn::Sequential& downsample, int64_t h, int64_t w) {
  return downsample ? conv_flops(nn::Conv2d(downsample->ptr<nn::Conv2dImpl>(0)), h, w) : 0.0;
}

const ResidualBlockOptions& checked(const ResidualBlockOptions& o, const char* what) {
  TORCH_CHECK(o.in_channels() > 0 && o.planes() > 0 && o.stride() > 0, what,
              ": in_channels, planes and stride must be positive, got ", o.in_channels(), ", ", o.planes(),
              ", ", o.stride());
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
BasicBlockImpl::BasicBlockImpl(const ResidualBlockOptions& o)
    : options(checked(o, "BasicBlock")),
      conv1(register_module("conv1", conv(o.in_channels(), o.planes(), 3, o.stride()))),
      bn1(register_module("bn1", nn::BatchNorm2d(o.planes()))),
      conv2(register_module("conv2", conv(o.planes(), o.planes(), 3, 1))),
      bn2(register_module("bn2", nn::BatchNorm2d(o.planes()))) {
  downsample = make_downsample(o, o.planes() * expansion);
  if (downsample) register_module("downsample", downsample);
}

torch::Tensor BasicBlockImpl::forward(const torch::Tensor& x) {
  auto out = torch::relu(bn1(conv1(x)));
  out = bn2(conv2(out));
  return torch::relu(out + shortcut(options, downsample, options.planes() * expansion, x));
}

double BasicBlockImpl::flops(int64_t& h, int64_t& w) const {
  const double shortcut_flops = downsample_flops(downsample, h, w);
  return conv_flops(conv1, h, w) + conv_flops(conv2, h, w) + shortcut_flops;
}

// ---------------------------------------------------------------------------------------------------------
BottleneckImpl::BottleneckImpl(const ResidualBlockOptions& o)
    : options(checked(o, "Bottleneck")),
      conv1(register_module("conv1", conv(o.in_channels(), o.planes(), 1, 1))),
      bn1(register_module("bn1", nn::BatchNorm2d(o.planes()))),
      // torchvision v1.5: the stride sits on the 3x3 conv, not on the first 1x1 as in the paper.
      conv2(register_module("conv2", conv(o.planes(), o.planes(), 3, o.stride()))),
      bn2(register_module("bn2", nn::BatchNorm2d(o.planes()))),
      conv3(register_module("conv3", conv(o.planes(), o.planes() * expansion, 1, 1))),
      bn3(register_module("bn3", nn::BatchNorm2d(o.planes() * expansion))) {
  downsample = make_downsample(o, o.planes() * expansion);
  if (downsample) register_module("downsample", downsample);
}

torch::Tensor BottleneckImpl::forward(const torch::Tensor& x) {
  auto out = torch::relu(bn1(conv1(x)));
  out = torch::relu(bn2(conv2(out)));
  out = bn3(conv3(out));
  return torch::relu(out + shortcut(options, downsample, options.planes() * expansion, x));
}

double BottleneckImpl::flops(int64_t& h, int64_t& w) const {
  const double shortcut_flops = downsample_flops(downsample, h, w);
  return conv_flops(conv1, h, w) + conv_flops(conv2, h, w) + conv_flops(conv3, h, w) + shortcut_flops;
}

// ---------------------------------------------------------------------------------------------------------
ResNetImpl::ResNetImpl(const ResNetOptions& o) : options(o) {
  TORCH_CHECK(!o.layers().empty() && o.layers().size() == o.widths().size(),
              "ResNet: layers and widths must have the same non-zero length, got ", o.layers().size(), " and ",
              o.widths().size());
  for (int64_t n : o.layers()) TORCH_CHECK(n > 0, "ResNet: every stage needs at least one block, got ", n);
  TORCH_CHECK(o.num_classes() > 0, "ResNet: num_classes must be positive, got ", o.num_classes());
  TORCH_CHECK(o.in_channels() > 0, "ResNet: in_channels must be positive, got ", o.in_channels());

  // The stem width is the first stage's width: 64 for the ImageNet ResNets, 16 for the CIFAR ones.
  const bool imagenet = o.stem() == StemKind::imagenet;
  int64_t channels = o.widths()[0];
  conv1 = register_module("conv1", conv(o.in_channels(), channels, imagenet ? 7 : 3, imagenet ? 2 : 1));
  bn1 = register_module("bn1", nn::BatchNorm2d(channels));

  for (size_t s = 0; s < o.layers().size(); ++s) {
    nn::ModuleList stage;
    for (int64_t b = 0; b < o.layers()[s]; ++b) {
      auto bo = ResidualBlockOptions(channels, o.widths()[s]).stride(s > 0 && b == 0 ? 2 : 1).shortcut(o.shortcut());
      std::shared_ptr<ResidualBlockImpl> block;
      if (o.block() == BlockKind::basic) {
        block = std::make_shared<BasicBlockImpl>(bo);
        channels = o.widths()[s] * BasicBlockImpl::expansion;
      } else {
        block = std::make_shared<BottleneckImpl>(bo);
        channels = o.widths()[s] * BottleneckImpl::expansion;
      }
      stage->push_back(block);  // registered as "0", "1", ...
      blocks_.push_back(block);
    }
    layers.push_back(register_module("layer" + std::to_string(s + 1), stage));
  }
  fc = register_module("fc", nn::Linear(channels, o.num_classes()));

  // torchvision's init; fc keeps nn::Linear's default, which is torch.nn.Linear's.
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
      nn::init::ones_(bn->weight);
      nn::init::zeros_(bn->bias);
    }
  }
  if (o.zero_init_residual()) {
    for (auto& block : blocks_) nn::init::zeros_(block->last_bn()->weight);
  }
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == options.in_channels(), "ResNet: expected input (B, ",
              options.in_channels(), ", H, W), got ", x.sizes());
  auto h = torch::relu(bn1(conv1(x)));
  if (options.stem() == StemKind::imagenet) h = torch::max_pool2d(h, 3, 2, 1);
  for (int64_t i = 0; i < num_blocks(); ++i) h = run_block(i, block_boundary(i, h));
  h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);  // (B, C)
  return fc(h);                                          // (B, num_classes)
}

torch::Tensor ResNetImpl::run_block(int64_t i, const torch::Tensor& x) {
  auto& block = blocks_[i];
  if (!block_checkpointed(i)) return block->forward(x);
  // Recompute this block's activations in backward instead of keeping them.
  return checkpoint(*block, [&block](const torch::Tensor& t) { return block->forward(t); }, x);
}

double ResNetImpl::forward_flops(const std::vector<int64_t>& sample_shape) const {
  TORCH_CHECK(sample_shape.size() == 3 && sample_shape[0] == options.in_channels() && sample_shape[1] > 0 &&
                  sample_shape[2] > 0,
              "ResNet: expected a sample shape (", options.in_channels(), ", H, W), got ",
              c10::IntArrayRef(sample_shape));
  int64_t h = sample_shape[1], w = sample_shape[2];
  double flops = conv_flops(conv1, h, w);
  if (options.stem() == StemKind::imagenet) {  // max pool 3x3, stride 2, padding 1
    h = (h - 1) / 2 + 1;
    w = (w - 1) / 2 + 1;
  }
  for (const auto& block : blocks_) flops += block->flops(h, w);
  return flops + 2.0 * fc->options.in_features() * fc->options.out_features();
}

}  // namespace models
