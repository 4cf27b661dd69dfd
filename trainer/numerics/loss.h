// The training loss: cross-entropy summed over the rows of logits, the same in the step, the micro-batch
// search's probes, the cuDNN pretuning and evaluation, so that each of them measures the memory the others
// use.
//
//   plain   PyTorch's cross_entropy on the logits cast to float32 (every device, every version)
//   fused   one CUDA kernel each way over the logits as the model computed them (bfloat16 under AMP):
//           trainer/kernels/cross_entropy.h. The same float32 arithmetic; no float32 copy of the logits and
//           no log-probabilities kept for the backward pass. CUDA builds, CUDA tensors only; elsewhere
//           `fused` falls back to plain.
#pragma once

#include <torch/torch.h>

namespace trainer {

struct LossOptions {
  double label_smoothing = 0;  ///< train.label_smoothing
  bool fused = true;           ///< train.fused_loss: the fused kernel where it can run (fused_loss_runs)
};

/// Whether the fused kernel is built into this binary (a CUDA build).
bool fused_loss_built();

/// Whether `options.fused` takes effect for logits like these: built, on a CUDA device, float32, float16
/// or bfloat16, two dimensions.
bool fused_loss_runs(const torch::Tensor& logits, const LossOptions& options);

/// sum_i CE(logits[i, :columns], targets[i]) as a float32 scalar, with PyTorch's label smoothing and its
/// ignore_index (-100). logits: (N, W) in any floating type, of which the first `columns` are real (-1: all;
/// fewer: a padded output, Logits::columns): the plain loss slices them off first, the fused one reads the
/// real columns in place and gives the padding columns a zero gradient. targets: (N) int64 class ids.
torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   const LossOptions& options, int64_t columns = -1);

}  // namespace trainer
