// What a retried attempt of a step starts from again (StepSnapshot), taken at the start of each step and
// put back when an attempt runs out of memory; the micro-batch search and the cuDNN pretuning put it back
// too, so that their probes do not count as training.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "common/rng.h"

namespace trainer {

/// What a failed attempt may have changed that the retry must start from again: the model's buffers
/// (BatchNorm running statistics, updated by every forward) and every random generator the step draws
/// from (the CPU generator, and the device's CUDA generator: dropout). The samples are the same batch
/// tensors; parameters and optimizer state are only changed once an attempt has succeeded.
///
/// `batched` (train.snapshot: batched) copies the buffers of each (device, dtype) with one multi-tensor
/// copy into tensors it keeps: retake() at the start of each step copies into the same tensors again, so
/// that a step pays one or two launches and no allocation for its snapshot (ResNet-50: 161 buffers, which
/// per buffer are 161 clones at the start of every step while the device waits). `per_buffer` clones each
/// buffer at every take. Either way restore() writes back the same values.
class StepSnapshot {
 public:
  StepSnapshot(torch::nn::Module& model, const c10::Device& device, bool batched = true);
  /// Takes the snapshot again, of `model` as it is now (the model of the construction; buffers replaced
  /// since, or of another shape or type, get new copies).
  void retake(torch::nn::Module& model);
  /// Puts the buffers and generators back as they were at the last take.
  void restore() const;

 private:
  void take(torch::nn::Module& model);
  /// Live buffers and their saved copies, one group per (device, dtype) (batched) or per buffer.
  struct Group {
    std::vector<torch::Tensor> live;
    std::vector<torch::Tensor> saved;
  };
  std::vector<Group> groups_;
  std::vector<const c10::TensorImpl*> order_;  // batched: the buffers at the last take, in the model's order
  c10::Device device_;
  bool batched_;
  GeneratorStates generators_;
};
}  // namespace trainer
