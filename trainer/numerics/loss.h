// The training loss: cross-entropy (or, for the image recipes that use it, binary cross-entropy) summed over the rows of logits, the same in the step, the micro-batch
// search's probes, the cuDNN pretuning and evaluation, so that each of them measures the memory the others
// use.
//
//   plain   PyTorch's cross_entropy on the logits cast to float32 (every device, every version)
//   fused   one CUDA kernel each way over the logits as the model computed them (bfloat16 under AMP):
//           trainer/kernels/cross_entropy.h. The same float32 arithmetic; no float32 copy of the logits and
//           no log-probabilities kept for the backward pass. CUDA builds, CUDA tensors only; elsewhere
//           `fused` falls back to plain.
//
// Targets come two ways: class ids (int64), or soft targets, one float32 row of class weights per sample
// (what Mixup and CutMix make, trainer/mix/mixing.h, with train.label_smoothing already folded in):
//
//   cross_entropy, class ids   PyTorch's cross_entropy(label_smoothing = s, reduction sum), as above
//   cross_entropy, soft        sum_i sum_j -t_ij log_softmax(x_i)_j        (timm's SoftTargetCrossEntropy,
//                                                                          times the rows)
//   bce                        sum_i sum_j BCEWithLogits(x_ij, t_ij) / C   (timm's BinaryCrossEntropy:
//                              the mean over rows and classes, times the rows; with bce_sum_classes,
//                              sum_i sum_j: its sum_classes), where class ids become smooth(y) =
//                              (1 - s) one_hot(y) + s / C, and with bce_target_threshold > 0,
//                              t <- (t > threshold) (RSB's binarized targets)
//
// Cross-entropy over soft targets runs the fused kernel where it runs (fused_loss_runs: trainer/kernels/
// cross_entropy.h, its soft-target pass), else the plain computation above; BCE always runs the plain one.
#pragma once

#include <torch/torch.h>

#include "trainer/config/config.h"

namespace trainer {

struct LossOptions {
  double label_smoothing = 0;  ///< train.label_smoothing
  bool fused = true;           ///< train.fused_loss: the fused kernel where it can run (fused_loss_runs)
  LossKind kind = LossKind::kCrossEntropy;  ///< train.loss: cross_entropy | bce
  double bce_target_threshold = 0;     ///< train.bce_target_threshold: binarize targets above it (0 = off)
  bool bce_sum_classes = false;        ///< train.bce_sum_classes: sum over classes instead of the mean
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

/// smooth(y) of each class id: (N, classes) float32 on the labels' device, (1 - s) one_hot(y) + s / classes
/// with timm's arithmetic (off = s / C, on = 1 - s + off, in double, stored as float32). A row whose id is
/// outside [0, classes) (an undecodable sample's -100) is all zeros: it adds nothing to a loss.
torch::Tensor smoothed_one_hot(const torch::Tensor& labels, int64_t classes, double label_smoothing);

/// The training loss of `options.kind` summed over the rows (see the table above): `targets` are class
/// ids (int64, N) or soft targets (float32, (N, columns)). Cross-entropy over class ids is
/// summed_cross_entropy; over soft targets the fused soft-target kernel where it runs; both plain elsewhere,
/// and BCE always the plain float32 computation.
torch::Tensor summed_loss(const torch::Tensor& logits, const torch::Tensor& targets, const LossOptions& options,
                          int64_t columns = -1);

}  // namespace trainer
