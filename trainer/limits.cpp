// What the run re-reads between steps: the memory cap (control.yaml, the container's limit under
// `memory.limit: auto`) and the CPUs it may use.
#include <spdlog/spdlog.h>

#include "trainer/from_config.h"
#include "trainer/memory/heap.h"
#include "trainer/run.h"

namespace trainer {

void TrainingRun::poll(bool batch_failed) {
  poll_memory_limit(batch_failed);
  if (step_ % 50 == 0) poll_threads();
}

void TrainingRun::poll_memory_limit(bool batch_failed) {
  // control.yaml is how an operator (or a container resize hook) changes the cap of a running job.
  ControlPoll poll = control_->poll();
  if (!poll.warning.empty()) spdlog::warn("{}", poll.warning);
  bool changed = false;
  if (poll.update && poll.update->memory_limit && *poll.update->memory_limit != limit_spec_) {
    spdlog::info("control.yaml: memory.limit {} -> {}", limit_spec_, *poll.update->memory_limit);
    limit_spec_ = *poll.update->memory_limit;
    changed = true;
  }
  // With `auto` on the CPU, the container's limit is re-read: a `docker update --memory` or a Kubernetes
  // in-place resize reaches the trainer this way. The cap is also resolved again when the memory that is
  // not tensors has grown by more than 2% of the container since it was set: the first steps page in
  // libraries and caches (35 MB of ResNet-20's first steps with the 2.11 wheel), which the margin alone
  // need not cover.
  if (limit_spec_ == "auto" && !device_.is_cuda()) {
    if (read_cgroup_memory(container_root()).limit_bytes != cgroup_limit_) {
      changed = true;
    } else if (cgroup_limit_ > 0) {
      const int64_t nontensor = host_rss_bytes() - memory_->current_bytes();
      if (nontensor - nontensor_at_limit_ > std::max<int64_t>(4 << 20, cgroup_limit_ / 50)) {
        spdlog::info("memory.limit auto: memory that is not tensors grew from {} to {} since the cap was set; "
                     "resolving it again", format_bytes(nontensor_at_limit_), format_bytes(nontensor));
        changed = true;
      }
    }
  }
  if (changed) {
    int64_t limit = resolve_limit();
    if (limit != limit_bytes_) {
      spdlog::info("memory: limit {} -> {} ({})", limit_bytes_ ? format_bytes(limit_bytes_) : "none",
                   limit ? format_bytes(limit) : "none", limit_spec_);
      limit_bytes_ = limit;
      memory_->set_limit(limit);
    }
  }
  // Every step, on every rank (a collective in a data-parallel job): one rank's resize moves all.
  const int64_t before = agreed_limit_;
  if (agree_on_limit(batch_failed)) {
    const int64_t live = memory_->current_bytes();
    throw OomGaveUp("out of memory loading the batch of step " + std::to_string(step_ + 1) + " under the memory limit " +
                    (limit_bytes_ ? format_bytes(limit_bytes_) : std::string("none")) + " (live tensors " +
                    format_bytes(live) + ")" + (batch_oom_.empty() ? " on another rank" : ": " + batch_oom_) +
                    "; the weights, the optimizer state and one batch do not fit: raise the memory limit");
  }
  if (agreed_limit_ != before) step_runner_->on_limit_changed(agreed_limit_, step_);
}

int64_t TrainingRun::resolve_limit() {
  const AutoLimitOptions o = auto_limit_options(cfg_, device_.is_cuda());
  cgroup_limit_ = read_cgroup_memory(o.cgroup_root).limit_bytes;
  const bool container = limit_spec_ == "auto" && cgroup_limit_ > 0 && !device_.is_cuda();
  // What is not tensors, measured as poll_memory_limit measures it: before the heap is trimmed.
  nontensor_at_limit_ = host_rss_bytes() - memory_->current_bytes();
  // The container counts the heap's kept pages; a cap on live tensors alone does not bound them.
  if (container) return_freed_memory();
  const int64_t limit = resolve_memory_limit(limit_spec_, *memory_, o);
  rss_at_limit_ = host_rss_bytes();
  if (container)
    spdlog::info("memory.limit auto: container limit {}, resident {} ({} in tensors), reserve {}, margin {:.0f}% -> "
                 "tensor cap {}", format_bytes(cgroup_limit_), format_bytes(rss_at_limit_),
                 format_bytes(memory_->current_bytes()), format_bytes(o.reserve_bytes), 100 * o.margin,
                 format_bytes(limit));
  return limit;
}

bool TrainingRun::agree_on_limit(bool batch_failed) {
  // Every rank's ladder must take the same decisions, so it sees the same inputs: the lowest cap of all
  // ranks (each rank's allocator still enforces its own). The same collective says whether any rank's
  // batch did not fit.
  agreed_limit_ = limit_bytes_;
  if (!dist_) return batch_failed;
  auto a = dist_->all_max({limit_bytes_ > 0 ? -static_cast<double>(limit_bytes_) : -1e300, batch_failed ? 1.0 : 0.0},
                          "the memory limit agreement");
  agreed_limit_ = a[0] <= -1e299 ? 0 : static_cast<int64_t>(-a[0]);
  return a[1] > 0;
}

void TrainingRun::poll_threads() {
  // The same rule as at setup: the processes of one node share its CPUs.
  const int threads = cpu_threads(cfg_, env_.local_world_size);
  if (threads != at::get_num_threads()) {
    spdlog::info("cpu: {} -> {} threads (affinity / quota changed)", at::get_num_threads(), threads);
    apply_cpu_threads(threads);
  }
}

}  // namespace trainer
