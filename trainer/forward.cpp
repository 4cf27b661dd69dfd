#include "trainer/forward.h"

#include "trainer/amp.h"

namespace trainer {

Logits forward_logits(models::ModelImpl& model, const torch::Tensor& inputs, const torch::Tensor& labels,
                      const ForwardOptions& o) {
  auto x = inputs.to(o.device, /*non_blocking=*/true);
  if (o.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  auto y = labels.to(o.device, /*non_blocking=*/true).reshape({-1});  // (N) classes or (N*T) next tokens
  torch::Tensor logits;
  {
    AutocastGuard autocast(o.device.type(), o.amp_dtype, o.amp);
    logits = model.forward(x);
  }
  return {logits.to(torch::kFloat).reshape({y.size(0), -1}), y};
}

}  // namespace trainer
