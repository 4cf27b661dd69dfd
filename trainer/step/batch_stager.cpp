#include "trainer/step/batch_stager.h"

#include "common/log.h"
#include "trainer/memory/backend.h"

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace trainer {

#ifdef TRAINER_WITH_CUDA
struct BatchStager::Cuda {
  explicit Cuda(const c10::Device& d)
      : device(d), copy(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d.index())) {}
  c10::Device device;
  c10::cuda::CUDAStream copy;  // the side stream every staged copy is queued on
  at::cuda::CUDAEvent copied;  // recorded after the last staged copy
  bool pending = false;        // a staged copy that ready() has not made the compute stream wait for
};
#else
struct BatchStager::Cuda {};
#endif

BatchStager::BatchStager(const c10::Device& device, bool enabled) {
#ifdef TRAINER_WITH_CUDA
  if (enabled && device.is_cuda()) cuda_ = std::make_unique<Cuda>(device);
#else
  (void)device, (void)enabled;
#endif
}

BatchStager::~BatchStager() = default;

bool BatchStager::active() const { return cuda_ != nullptr; }

data::Batch BatchStager::stage(data::Batch batch) {
#ifdef TRAINER_WITH_CUDA
  if (!cuda_ || !batch.images.defined() || batch.images.is_cuda()) return batch;
  Cuda& c = *cuda_;
  torch::Tensor images, labels, erase;
  try {
    const c10::cuda::CUDAGuard guard(c.device);
    // Allocated on the copy stream: its blocks are the copy stream's until ready() records the compute
    // stream's use. to() keeps the memory format (NHWC uint8 images stay NHWC).
    const c10::cuda::CUDAStreamGuard on_copy(c.copy);
    images = batch.images.to(c.device, /*non_blocking=*/true);
    labels = batch.labels.to(c.device, /*non_blocking=*/true);
    if (batch.erase.defined()) erase = batch.erase.to(c.device, /*non_blocking=*/true);
    c.copied.record(c.copy);
  } catch (const std::exception& e) {
    // The batch is as large on the device inside the step: what does not fit now may fit one micro-batch
    // at a time, and the ladder answers what still does not.
    if (!is_oom_error(e)) throw;
    ++fallbacks_;
    last_fallback_ = error_message(e);
    return batch;
  }
  batch.images = std::move(images);
  batch.labels = std::move(labels);
  if (erase.defined()) batch.erase = std::move(erase);
  c.pending = true;
#endif
  return batch;
}

void BatchStager::ready(const data::Batch& batch) {
#ifdef TRAINER_WITH_CUDA
  if (!cuda_ || !cuda_->pending) return;
  Cuda& c = *cuda_;
  const c10::cuda::CUDAGuard guard(c.device);
  const auto current = c10::cuda::getCurrentCUDAStream(c.device.index());
  c.copied.block(current);
  // Freed after the step, a block is then reused only once the compute stream is past its last use.
  for (const torch::Tensor* t : {&batch.images, &batch.labels, &batch.erase})
    if (t->defined() && t->is_cuda()) t->record_stream(current);
  c.pending = false;
#else
  (void)batch;
#endif
}

}  // namespace trainer
