// The next step's batch on its way to the device while the device still runs this step.
//
// Without it, a step's samples cross to the GPU inside the step, on the compute stream, one micro-batch
// at a time: the device waits for every copy (ResNet-50 at batch 256 in float32: about 3 ms a step on
// an H200). With it, the run fetches step n+1's batch while the device finishes step n (TrainingRun's
// fetch-ahead, data.fetch_ahead), and stage() queues its copy to the device on a side stream:
//
//   compute stream:  [ step n ...................... ] wait(copied n+1) [ step n+1 ...
//   copy stream:          [ H2D n+1 ] record(copied n+1)
//
// The loader's batches are in page-locked memory on a CUDA job (the caching host allocator keeps a block
// until the copies that read it are done), so the copy is asynchronous. The device tensors are allocated
// on the copy stream and marked as used by the compute stream once it waits for them (ready()), so the
// caching allocator gives their blocks to nothing else until the step that reads them is done.
//
// On the CPU, or where staging is off, stage() and ready() return the batch as it is: model_input()
// copies each micro-batch to the device inside the step, as before.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

#include "data/samples/batch.h"

namespace trainer {

class BatchStager {
 public:
  /// `device`: the compute device; staging happens only when `enabled` and it is CUDA (in a CUDA build).
  BatchStager(const c10::Device& device, bool enabled);
  ~BatchStager();
  BatchStager(const BatchStager&) = delete;
  BatchStager& operator=(const BatchStager&) = delete;

  /// True if stage() moves batches to the device (a CUDA device in a CUDA build).
  bool active() const;

  /// Queues the copy of `batch`'s tensors (images, labels, erase boxes) to the device on the side stream
  /// and returns the batch with the device tensors in their place (the rest as it was). A copy that does not
  /// fit on the device (an OOM under the cap) leaves the batch on the host: the step then copies it as
  /// before, and `last_fallback()` says why. Not active: `batch` as it is.
  data::Batch stage(data::Batch batch);

  /// Before the compute stream first uses a batch stage() returned: the current stream waits for its copy,
  /// and its tensors are recorded as used by that stream. Idempotent; nothing when nothing is staged.
  void ready(const data::Batch& batch);

  /// Batches stage() left on the host because the device had no room, and the last reason.
  int64_t fallbacks() const { return fallbacks_; }
  const std::string& last_fallback() const { return last_fallback_; }

 private:
  struct Cuda;  // the side stream and the copy's event (batch_stager.cpp; CUDA builds only)
  std::unique_ptr<Cuda> cuda_;
  int64_t fallbacks_ = 0;
  std::string last_fallback_;
};

}  // namespace trainer
