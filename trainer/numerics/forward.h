// The forward pass that training and evaluation share: the batch to the device (channels_last for
// images when asked), the model under autocast, and the logits as rows next to their targets.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <string>

#include "models/model.h"

namespace trainer {

struct ForwardOptions {
  torch::Device device{torch::kCPU};
  bool channels_last = false;               ///< NHWC inputs (4-d inputs only)
  bool amp = false;                         ///< autocast the model's forward
  at::ScalarType amp_dtype = at::kBFloat16;
  /// The weights' dtype (model.param_dtype): float inputs (images) are cast to it on the device.
  at::ScalarType param_dtype = at::kFloat;
  /// uint8 image inputs (decoded datasets, NHWC): x = (pixel / 255 - mean[c]) / std[c] on the device, with
  /// these (1, C, 1, 1) float tensors on the device; undefined: pixel / 255. Float inputs are used as they are.
  torch::Tensor input_mean, input_std;
};

/// One row of logits per target: images (N, classes) against N labels; language models (N*T, vocab)
/// against N*T next tokens.
struct Logits {
  /// (N, columns) on the device, as the model computed them: bfloat16 or float16 under AMP
  /// (summed_cross_entropy casts them for the plain loss; the fused one reads them as they are). With a
  /// padded output (GPT's vocab_multiple) the rows are (N, padded V), of which the first `columns` are real:
  /// real() is what a score or a plain loss reads.
  torch::Tensor logits;
  torch::Tensor targets;  ///< int64 class ids (N), or float32 soft targets (N, columns); on the device
  int64_t columns = -1;   ///< the real columns (the classes, the vocabulary); -1: all of them

  torch::Tensor real() const {
    return columns < 0 || columns == logits.size(1) ? logits : logits.narrow(1, 0, columns);
  }
};

/// uint8 images (on the device) to the model's float32 input: x / 255, then (x - mean[c]) / std[c] when
/// `options.input_mean` is defined, in the batch's memory format. On CUDA, for bytes laid out NHWC (the
/// loader's layout), one kernel of the trainer's own (trainer/kernels/images.h) with the same bits as
/// PyTorch's four element-wise ops; elsewhere those ops.
torch::Tensor images_to_float(const torch::Tensor& x, const ForwardOptions& options);
/// Whether images_to_float runs its one kernel for `x` (a CUDA build, a CUDA uint8 NHWC batch, float32
/// statistics on its device).
bool images_in_one_kernel(const torch::Tensor& x, const ForwardOptions& options);

/// The model's input for `inputs`: on the device, uint8 images converted and normalized there
/// (images_to_float), in the memory format the model takes (channels_last for 4-d inputs when asked).
torch::Tensor model_input(const torch::Tensor& inputs, const ForwardOptions& options);

/// Runs `model` on `x` (as model_input made it) against `targets` on the device: class ids (rows of
/// N or N*T, reshaped to one per row of logits) or soft targets (N, classes).
Logits logits_of(models::ModelImpl& model, const torch::Tensor& x, const torch::Tensor& targets,
                 const ForwardOptions& options);

/// When `e` says that LibTorch has no bfloat16 kernel for an op (its "\"op\" not implemented for
/// 'BFloat16'"), the line that tells a user of model.param_dtype bfloat16 so; "" for any other error.
std::string missing_bfloat16_kernel(const std::exception& e);

/// Runs `model` on `inputs` with `labels` as targets. uint8 inputs are copied to the device as uint8 (a
/// quarter of float32's bytes) and converted and normalized there (ForwardOptions::input_mean).
Logits forward_logits(models::ModelImpl& model, const torch::Tensor& inputs, const torch::Tensor& labels,
                      const ForwardOptions& options);

}  // namespace trainer
