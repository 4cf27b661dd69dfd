#include "trainer/step/step_graph.h"

#include <ATen/autocast_mode.h>

#include <stdexcept>

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace trainer {

#ifdef TRAINER_WITH_CUDA
// What a failed capture leaves for its owner to clean up in LibTorch 2.11 (read in its CUDAGraph.h and
// CUDAGeneratorImpl.h): reset() releases the memory pool only after a capture that ended
// (capture_ended_), and a generator's capture mode (capturing_) ends only in a successful capture_end().
// A capture that threw half way would otherwise keep its pool's memory reserved for the rest of the run
// (under the cap: the next capture would find less room each time), and a dropout after it would find its
// generator still "capturing" and throw.
struct CapturedGraph : at::cuda::CUDAGraph {
  bool ended() const { return capture_ended_; }
  void end_generator_captures() {
    for (auto& [state, increment] : captured_generator_states_)
      state->capturing_ = false;  // what capture_epilogue() does to it (not exported from libtorch_cuda)
  }
};

namespace {

// Each call ignores the error of a step that has nothing to undo (the pool already ended, say).
template <typename F>
void quietly(F&& f) {
  try {
    f();
  } catch (...) {
  }
}

// After an exception inside the capture: end the stream's capture if it is still open, and give back the
// pool and the generators' state that 2.11's reset() would not.
void abandon_capture(CapturedGraph& graph, c10::DeviceIndex device, decltype(at::cuda::graph_pool_handle()) pool,
                     const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone)
    quietly([&] { graph.capture_end(); });
  (void)cudaGetLastError();  // the failed capture's error, consumed so that later checks do not see it
  graph.end_generator_captures();
  if (graph.ended()) return;  // a capture that ended releases its own pool in reset()
  quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); });
  quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
  quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(device, pool); });
  quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool); });
}

// A device tensor of `t`'s shape, strides and type, holding a copy of it (queued on the current stream).
torch::Tensor static_copy(const torch::Tensor& t, const c10::Device& device) {
  auto s = at::empty_strided(t.sizes(), t.strides(), t.options().device(device));
  s.copy_(t, /*non_blocking=*/true);
  return s;
}

}  // namespace
#else
struct CapturedGraph {};
#endif

StepGraph::StepGraph() = default;

StepGraph::~StepGraph() { release(); }

void StepGraph::release() {
  values_ = torch::Tensor();
  static_ = data::Batch();
  graph_.reset();  // the graph's destructor releases its pool: the allocator frees it at the next empty_cache
}

torch::Tensor StepGraph::capture(const data::Batch& batch, const c10::Device& device,
                                 const std::function<torch::Tensor(const data::Batch&)>& body) {
#ifdef TRAINER_WITH_CUDA
  release();
  const c10::cuda::CUDAGuard guard(device);
  static_ = batch;
  static_.images = static_copy(batch.images, device);
  static_.labels = static_copy(batch.labels, device);
  if (batch.erase.defined()) static_.erase = static_copy(batch.erase, device);
  // The capture runs on a side stream (never the default one) that first waits for what the current
  // stream has queued: the static copies and the step's scalars.
  const auto current = c10::cuda::getCurrentCUDAStream(device.index());
  const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  at::cuda::CUDAEvent queued;
  queued.record(current);
  queued.block(side);
  auto graph = std::make_unique<CapturedGraph>();
  // The default generator's offsets are the graph's to advance at each replay: dropout in a replay draws
  // what the same step draws eagerly.
  graph->register_generator_state(at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  const auto pool = at::cuda::graph_pool_handle();  // ours, so that a failed capture can give it back
  const bool autocast_cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    // Thread-local: the loader's threads may allocate page-locked memory meanwhile, which a global capture
    // would refuse them (and which has nothing to do with this stream).
    graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    values_ = body(static_);
    graph->capture_end();
  } catch (...) {
    at::autocast::set_autocast_cache_enabled(autocast_cache);
    values_ = torch::Tensor();
    static_ = data::Batch();
    abandon_capture(*graph, device.index(), pool, side);
    graph.reset();
    at::cuda::clearCublasWorkspaces();  // cuBLAS's workspaces of the side stream live in the pool
    throw;
  }
  at::autocast::set_autocast_cache_enabled(autocast_cache);
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(current);
  graph_ = std::move(graph);
  return values_;
#else
  (void)batch, (void)device, (void)body;
  throw std::logic_error("StepGraph::capture: this build has no CUDA");
#endif
}

torch::Tensor StepGraph::replay(const data::Batch& batch) {
  if (!graph_) throw std::logic_error("StepGraph::replay: no graph captured");
  static_.images.copy_(batch.images, /*non_blocking=*/true);
  static_.labels.copy_(batch.labels, /*non_blocking=*/true);
  if (static_.erase.defined()) static_.erase.copy_(batch.erase, /*non_blocking=*/true);
#ifdef TRAINER_WITH_CUDA
  graph_->replay();
#endif
  return values_;
}

}  // namespace trainer
