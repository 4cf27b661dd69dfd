#include "trainer/forward.h"

#include "trainer/amp.h"

namespace trainer {

Logits forward_logits(models::ModelImpl& model, const torch::Tensor& inputs, const torch::Tensor& labels,
                      const ForwardOptions& o) {
  auto x = inputs.to(o.device, /*non_blocking=*/true);
  if (x.scalar_type() == torch::kUInt8) {
    // The element-wise ops keep the batch's memory format (NHWC from the loader).
    x = x.to(torch::kFloat).div_(255.0f);
    if (o.input_mean.defined()) x = x.sub_(o.input_mean).div_(o.input_std);
  }
  if (o.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  else if (x.dim() == 4) x = x.contiguous();  // NHWC batches of uint8 images, for a model that is not
  auto y = labels.to(o.device, /*non_blocking=*/true).reshape({-1});  // (N) classes or (N*T) next tokens
  models::ModelImpl::Padded out;
  {
    AutocastGuard autocast(o.device.type(), o.amp_dtype, o.amp);
    out = model.forward_padded(x);
  }
  return {out.logits.reshape({y.size(0), -1}), y, out.columns};
}

}  // namespace trainer
