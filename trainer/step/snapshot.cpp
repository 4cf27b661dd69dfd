// The snapshot a retried attempt starts from: the model's buffers and the random generators.
#include "trainer/step/snapshot.h"

#include <algorithm>
#include <utility>

#include "common/compat.h"

namespace trainer {

StepSnapshot::StepSnapshot(torch::nn::Module& model, const c10::Device& device, bool batched)
    : device_(device), batched_(batched), generators_(GeneratorStates::capture(device)) {
  take(model);
}

void StepSnapshot::take(torch::nn::Module& model) {
  torch::NoGradGuard ng;
  groups_.clear();
  order_.clear();
  if (!batched_) {
    for (auto& b : model.buffers()) groups_.push_back({{b}, {b.clone()}});
    return;
  }
  // Per (device, dtype) (the multi-tensor copy takes one of each): the buffers and their copies.
  std::vector<std::pair<c10::Device, at::ScalarType>> keys;
  for (auto& b : model.buffers()) {
    const std::pair<c10::Device, at::ScalarType> key{b.device(), b.scalar_type()};
    const auto it = std::find(keys.begin(), keys.end(), key);
    const size_t g = static_cast<size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(key);
      groups_.emplace_back();
    }
    groups_[g].live.push_back(b);
    groups_[g].saved.push_back(torch::empty_like(b, at::MemoryFormat::Preserve));
    order_.push_back(b.unsafeGetTensorImpl());
  }
  for (auto& group : groups_) compat::foreach_copy_(group.saved, group.live);
}

void StepSnapshot::retake(torch::nn::Module& model) {
  generators_ = GeneratorStates::capture(device_);
  if (!batched_) return take(model);
  // The same buffers as at the last take (the same tensors in the same order, each of the shape, type and
  // device of its copy): one copy per group into the copies already held. Anything else: taken anew.
  const auto buffers = model.buffers();
  bool same = buffers.size() == order_.size();
  for (size_t i = 0; same && i < buffers.size(); ++i) same = buffers[i].unsafeGetTensorImpl() == order_[i];
  for (const auto& group : groups_)
    for (size_t k = 0; same && k < group.live.size(); ++k)
      same = group.saved[k].sizes() == group.live[k].sizes() && group.saved[k].dtype() == group.live[k].dtype() &&
             group.saved[k].device() == group.live[k].device();
  if (!same) return take(model);
  torch::NoGradGuard ng;
  for (auto& group : groups_) compat::foreach_copy_(group.saved, group.live);
}

void StepSnapshot::restore() const {
  {
    torch::NoGradGuard ng;
    for (const auto& group : groups_) compat::foreach_copy_(group.live, group.saved);
  }
  generators_.restore();
}

}  // namespace trainer
