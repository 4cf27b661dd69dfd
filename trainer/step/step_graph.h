// The training step as one CUDA graph: captured once per micro-batch layout, then replayed for each step
// with no host work between its kernels. When to capture, replay or release is GraphPolicy's
// (trainer/step/graph_policy.h); this holds the graph, its memory pool and its static tensors.
//
// What a capture records is the step's own code (Step::queue_update, trainer/step/step.cpp) run on static
// device copies of a batch: every micro-batch's forward and backward, the gradient accumulation, the
// unscale and finite check, the clip, the fused optimizer step with its skip flag, the scaler's update, and
// the step's values packed for the host. What changes from step to step lives in tensors the graph reads:
// the inputs (copied into the static batch before each replay), the learning rate and AdamW's step count
// (Optimizer::set_device_scalars), the loss scale, the generators' offsets (LibTorch's graph-safe
// philox state: dropout draws what it would draw eagerly). Every tensor the graph allocates comes from its
// private pool, which the caching allocator reserves under the same memory fraction as everything else:
// the pool counts against the cap.
//
// In a build without CUDA the class exists and capture() throws std::logic_error; GraphPolicy never asks
// for a capture there (no CUDA device).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

#include "data/samples/batch.h"

namespace trainer {

/// LibTorch's CUDA graph, with what a failed capture must clean up (step_graph.cpp).
struct CapturedGraph;

class StepGraph {
 public:
  StepGraph();
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  /// Copies `batch`'s inputs and labels to static tensors on `device`, then records `body` run on that
  /// static batch, on a side stream, with autocast's weight cache off (a cached cast would be an address
  /// the graph keeps while the cache forgets it). Nothing runs during a capture: replay() then runs the
  /// step. Returns what `body` returned, the tensor every replay rewrites (the step's values). On any
  /// exception the capture is ended and the graph and its pool released before it propagates.
  torch::Tensor capture(const data::Batch& batch, const c10::Device& device,
                        const std::function<torch::Tensor(const data::Batch&)>& body);
  /// Copies `batch` (same shapes and types as at the capture) into the static batch and launches the graph
  /// on the current stream; returns the static values.
  torch::Tensor replay(const data::Batch& batch);
  /// Drops the graph, its pool and the static tensors (no-op when none is held).
  void release();
  bool held() const { return graph_ != nullptr; }

 private:
  std::unique_ptr<CapturedGraph> graph_;
  data::Batch static_;     // images and labels on the device, the shapes of the capture
  torch::Tensor values_;   // the body's result
};

}  // namespace trainer
