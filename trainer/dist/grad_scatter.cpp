// GradientSync's sharded mode (dist.shard: gradients, dist.h): the buckets reduce-scattered through a small
// pool of staging buffers, each rank keeping the sums of its slices.
//
// A bucket takes a staging buffer when its first gradient arrives and gives it back once its reduce-scatter
// has come back and its part was added to the rank's slice. Buckets are sent in index order on every rank
// (collectives must be issued alike everywhere), so a bucket that completes early keeps its buffer until
// the ones before it are sent; when every buffer is held that way, the pool grows by one.
#include <algorithm>
#include <stdexcept>

#include "trainer/dist/dist.h"
#include "trainer/dist/shard.h"

namespace trainer {

torch::Tensor GradientSync::staging_of(size_t bucket) const {
  return pool_[static_cast<size_t>(staging_[bucket])].buffer.narrow(0, 0, world_ * slices_[bucket].numel());
}

void GradientSync::complete_oldest() {
  const size_t i = in_flight_.front();
  in_flight_.erase(in_flight_.begin());
  std::function<void()> wait = std::move(buckets_[i]->wait);
  buckets_[i]->wait = nullptr;
  const auto s = static_cast<size_t>(staging_[i]);
  staging_[i] = -1;
  free_.push_back(s);  // back in the pool whatever the wait says: the collective is over either way
  wait();
  if (!into_out_[i]) return;  // the sums went straight into the slice
  torch::NoGradGuard ng;
  slices_[i].add_(pool_[s].out.narrow(0, 0, slices_[i].numel()));
}

void GradientSync::drain_in_flight() {
  std::exception_ptr first;
  while (!in_flight_.empty()) {
    try {
      complete_oldest();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void GradientSync::acquire(size_t bucket, bool may_allocate) {
  if (staging_[bucket] >= 0) return;
  const int64_t need = slices_[bucket].numel();
  // The smallest free buffer that fits, waiting for the buckets on the wire while none does.
  for (;;) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (pool_[*it].slice >= need && (best == free_.end() || pool_[*it].slice < pool_[*best].slice)) best = it;
    if (best != free_.end()) {
      staging_[bucket] = static_cast<int64_t>(*best);
      free_.erase(best);
      return;
    }
    if (in_flight_.empty()) break;
    complete_oldest();
  }
  if (may_allocate) {
    // Every buffer that fits is held by a bucket still filling (backward completes them out of order).
    pool_.push_back({need, torch::zeros({world_ * need}, slices_[bucket].options()), torch::Tensor()});
    staging_[bucket] = static_cast<int64_t>(pool_.size() - 1);
    return;
  }
  // abandon(): no allocation; a later unsent bucket's buffer will do (its contents no longer matter). The
  // largest buffer exists from the start, and is free or held by such a bucket.
  for (size_t j = buckets_.size(); j-- > bucket + 1;)
    if (staging_[j] >= 0 && !buckets_[j]->wait && pool_[static_cast<size_t>(staging_[j])].slice >= need) {
      staging_[bucket] = staging_[j];
      staging_[j] = -1;
      return;
    }
  throw std::logic_error("GradientSync: no staging buffer to send bucket " + std::to_string(bucket) + " with");
}

void GradientSync::finish_scatter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) throw std::logic_error("GradientSync::finish without arm");
  torch::NoGradGuard ng;
  // Parameters backward did not reach (unused in this step) count as zeros, as in DDP's static graph.
  for (size_t k = 0; k < params_.size(); ++k) {
    if (ready_[k]) continue;
    acquire(bucket_of_[k]);
    auto slot = shaped_like(staging_of(bucket_of_[k]).narrow(0, offset_in_bucket_[k], params_[k].numel()), params_[k]);
    if (params_[k].grad().defined()) slot.copy_(params_[k].grad());
    else slot.zero_();
    ready_[k] = 1;
    --buckets_[bucket_of_[k]]->pending;
    params_[k].mutable_grad() = torch::Tensor();
    send_ready_buckets();
  }
  send_ready_buckets();
  armed_ = false;
  drain_in_flight();
}

void GradientSync::abandon_scatter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  // Every bucket not yet sent is sent as it is (the other ranks are sending theirs; the agreement after
  // this micro-batch discards the sums on every rank), through the buffers already held: nothing allocated.
  armed_ = false;  // send() puts the sums into the slices: the step is redone, they are not read
  while (next_to_send_ < buckets_.size()) {
    acquire(next_to_send_, /*may_allocate=*/false);
    send(next_to_send_++);
  }
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  drain_in_flight();
}

}  // namespace trainer
