// The forward pass that training and evaluation share: the batch to the device (channels_last for
// images when asked), the model under autocast, and the logits as float32 rows next to their targets.
#pragma once

#include <torch/torch.h>

#include "models/model.h"

namespace trainer {

struct ForwardOptions {
  torch::Device device{torch::kCPU};
  bool channels_last = false;               ///< NHWC inputs (4-d inputs only)
  bool amp = false;                         ///< autocast the model's forward
  at::ScalarType amp_dtype = at::kBFloat16;
};

/// One row of logits per target: images (N, classes) against N labels; language models (N*T, vocab)
/// against N*T next tokens.
struct Logits {
  torch::Tensor logits;   ///< float32, on the device
  torch::Tensor targets;  ///< int64, on the device
};

/// Runs `model` on `inputs` with `labels` as targets.
Logits forward_logits(models::ModelImpl& model, const torch::Tensor& inputs, const torch::Tensor& labels,
                      const ForwardOptions& options);

}  // namespace trainer
