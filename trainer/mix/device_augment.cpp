// Random erasing and the micro-batch's mixing on the device (device_augment.h).
#include "trainer/mix/device_augment.h"

namespace trainer {

torch::Tensor erase_boxes(torch::Tensor x, const torch::Tensor& boxes) {
  const int64_t H = x.size(2), W = x.size(3);
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(x.device());
  const auto ys = torch::arange(H, opts).view({1, H, 1}), xs = torch::arange(W, opts).view({1, 1, W});
  auto col = [&](int64_t k) { return boxes.select(1, k).view({-1, 1, 1}); };  // (B, 1, 1)
  const auto inside = (ys >= col(0)) & (ys < col(0) + col(2)) & (xs >= col(1)) & (xs < col(1) + col(3));  // (B, H, W)
  return x.masked_fill_(inside.unsqueeze(1), 0.0);
}

torch::Tensor augmented_input(const data::Batch& batch, int64_t offset, int64_t n, const ForwardOptions& forward) {
  auto images = batch.images.narrow(0, offset, n);
  if (!batch.erase.defined()) return model_input(images, forward);
  // Random erasing follows normalization (torchvision's order): the uint8 images are converted here,
  // erased, and reach the model as float.
  const auto& dev = forward.device;
  auto x = erase_boxes(images_to_float(images.to(dev, /*non_blocking=*/true), forward),
                       batch.erase.narrow(0, offset, n).to(dev, /*non_blocking=*/true));
  return model_input(x, forward);
}

Logits augmented_logits(models::ModelImpl& model, const data::Batch& batch, int64_t offset, int64_t n,
                        const MixDraw& mix, const ForwardOptions& forward, double label_smoothing) {
  auto labels = batch.labels.narrow(0, offset, n);
  if (!mix.any() && !batch.erase.defined())
    return forward_logits(model, batch.images.narrow(0, offset, n), labels, forward);
  if (!mix.any())
    return logits_of(model, augmented_input(batch, offset, n, forward),
                     labels.to(forward.device, /*non_blocking=*/true), forward);
  // Rows [offset, offset + n) are mixed with their partners B - 1 - k: the mirrored slice, reversed. Each
  // side is erased first (timm erases in its loader, before Mixup).
  const int64_t mirror = batch.size() - offset - n;
  auto partner = augmented_input(batch, mirror, n, forward).flip(0);
  auto partner_labels = batch.labels.narrow(0, mirror, n).to(forward.device, /*non_blocking=*/true).flip(0);
  auto x = mix_images(augmented_input(batch, offset, n, forward), partner, mix, offset);
  if (forward.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  Logits out = logits_of(model, x, labels.to(forward.device, /*non_blocking=*/true), forward);
  const int64_t classes = out.columns < 0 ? out.logits.size(1) : out.columns;
  out.targets = mix_targets(out.targets, partner_labels, mix, offset, classes, label_smoothing);
  return out;
}

}  // namespace trainer
