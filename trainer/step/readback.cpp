// The step's values read back to the host in one copy, after the update is queued (readback.h).
#include "trainer/step/readback.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include "common/compat.h"

namespace trainer {

void HostReadback::start(const torch::Tensor& values) {
  queued_ = false;
  if (!values.is_cuda()) {
    pending_ = values.cpu();
    return;
  }
  const int64_t n = values.numel();
  if (!host_.defined() || host_.numel() < n)
    host_ = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  pending_ = host_.narrow(0, 0, n);
  pending_.copy_(values, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(values.device().type());
  if (!copied_) copied_.emplace(values.device().type());  // one event, recorded again at every start
  copied_->record(guard.getStream(values.device()));
  queued_ = true;
}

torch::Tensor HostReadback::wait() {
  if (queued_) compat::wait_for(*copied_);
  queued_ = false;
  return pending_;
}

}  // namespace trainer
