// A step's few values (loss, gradient norm, the scaler's flag and scale) on their way to the host, read in
// one copy that the host waits for only after it has queued the update.
#pragma once

#include <torch/torch.h>
#include <c10/core/Event.h>

#include <optional>

namespace trainer {

/// A few values of a step on their way to the host. On CUDA: a copy into page-locked memory queued on the
/// current stream, and an event after it, so that the host can queue more work (the update) before it
/// waits for the values; elsewhere the values as they are (a CPU tensor) or copied at once.
class HostReadback {
 public:
  /// Queues the copy of `values` (a 1-D float32 tensor).
  void start(const torch::Tensor& values);
  /// Waits for the copy start() queued; the values on the host (valid until the next start()).
  torch::Tensor wait();

 private:
  torch::Tensor host_;                // page-locked, reused from step to step
  torch::Tensor pending_;             // what wait() returns: a part of host_, or the values
  std::optional<c10::Event> copied_;  // recorded after the copy (CUDA)
  bool queued_ = false;               // a copy is queued that wait() has not waited for
};
}  // namespace trainer
