// What the run re-reads between steps: the memory cap (control.yaml, the container's limit under
// `memory.limit: auto`) and the CPUs it may use.
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "trainer/memory/heap.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"

namespace trainer {

void TrainingRun::poll(bool batch_failed) {
  RECORD_USER_SCOPE("trainer.poll");
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
  // With `auto` on the CPU, the container's limit and the machine's memory are read again: a `docker
  // update --memory` or a Kubernetes in-place resize reaches the trainer this way, and so does another
  // process on the machine that grows (the cap falls before the kernel's OOM killer acts) or ends (the cap
  // rises and the micro-batch can grow back). A fall of 2% of the bound is acted on, a rise only past 5%,
  // so that a neighbour's small swings do not move the cap every step. The cap is also resolved again when
  // the memory that is not tensors has grown by more than 2% of the bound since it was set: the first
  // steps page in libraries and caches (35 MB of ResNet-20's first steps with the 2.11 wheel), which the
  // margin alone need not cover.
  if (limit_spec_ == "auto" && !device_.is_cuda()) {
    const MemoryBounds now = read_memory_bounds(container_root());
    const int64_t was = bounds_.host_bytes, is = now.host_bytes;  // 0: /proc/meminfo unreadable, no news
    if (now.container_bytes != bounds_.container_bytes) {
      changed = true;
    } else if (was > 0 && is > 0 && is < was - std::max<int64_t>(4 << 20, was / 50)) {
      spdlog::info("memory.limit auto: the machine's memory for this process fell from {} to {}; resolving the cap "
                   "again", format_bytes(was), format_bytes(is));
      changed = true;
    } else if (was > 0 && limit_source_ == "host" && is > was + std::max<int64_t>(4 << 20, was / 20)) {
      spdlog::info("memory.limit auto: the machine's memory for this process rose from {} to {}; resolving the cap "
                   "again", format_bytes(was), format_bytes(is));
      changed = true;
    } else if (limit_bytes_ > 0) {
      const int64_t bound = limit_source_ == "container" ? bounds_.container_bytes : bounds_.host_bytes;
      const int64_t nontensor = host_rss_bytes() - memory_->current_bytes();
      if (nontensor - nontensor_at_limit_ > std::max<int64_t>(4 << 20, bound / 50)) {
        spdlog::info("memory.limit auto: memory that is not tensors grew from {} to {} since the cap was set; "
                     "resolving it again", format_bytes(nontensor_at_limit_), format_bytes(nontensor));
        changed = true;
      }
    }
  }
  // With `auto` on a GPU, the device's memory is read again: another job that starts on the same GPU
  // lowers the cap (a cap below what this job holds empties its cache, and the next step backs off if it
  // needs more), one that ends raises it once the rise has lasted (the micro-batch can grow back).
  if (limit_spec_ == "auto" && device_.is_cuda()) {
    const int64_t was = gpu_follower_.was(), is = memory_->free_bytes() + memory_->reserved_bytes();
    if (gpu_follower_.moved(is, memory_->total_bytes(), seconds_since(start_time_))) {
      spdlog::info("memory.limit auto: the GPU memory this process may hold (free + its own) {} from {} to {}; "
                   "resolving the cap again", is < was ? "fell" : "rose", format_bytes(was), format_bytes(is));
      changed = true;
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
                    format_bytes(live) + ")" +
                    (input_.batch_oom().empty() ? " on another rank" : ": " + input_.batch_oom()) +
                    "; the weights, the optimizer state and one batch do not fit: raise the memory limit");
  }
  if (agreed_limit_ != before) step_runner_->on_limit_changed(agreed_limit_, step_);
}

int64_t TrainingRun::resolve_limit() {
  const AutoLimitOptions o = auto_limit_options(cfg_, device_.is_cuda());
  // What is not tensors, measured as poll_memory_limit measures it: before the heap is trimmed.
  nontensor_at_limit_ = host_rss_bytes() - memory_->current_bytes();
  bounds_ = MemoryBounds{};
  int64_t limit = 0;
  if (limit_spec_ == "auto" && !device_.is_cuda()) {
    // The container and the machine count the heap's kept pages; a cap on live tensors alone does not
    // bound them.
    return_freed_memory();
    const AutoCpuLimit a = resolve_auto_cpu_limit(*memory_, o);
    bounds_ = a.bounds;
    limit_source_ = a.source;
    limit = a.cap;
  } else {
    limit = resolve_memory_limit(limit_spec_, *memory_, o);
    limit_source_ = limit == 0 ? "none" : limit_spec_ == "auto" ? "gpu" : "config";
    if (limit_source_ == "gpu") gpu_follower_.reset(memory_->free_bytes() + memory_->reserved_bytes());
  }
  rss_at_limit_ = host_rss_bytes();
  if (limit_spec_ == "auto" && !device_.is_cuda()) {
    if (limit > 0)
      spdlog::info("memory.limit auto: container limit {}, machine {} (available + held), the {} binds; resident {} "
                   "({} in tensors), reserve {}, margin {:.0f}% -> tensor cap {}",
                   bounds_.container_bytes ? format_bytes(bounds_.container_bytes) : "none",
                   bounds_.host_bytes ? format_bytes(bounds_.host_bytes) : "unknown", limit_source_,
                   format_bytes(rss_at_limit_), format_bytes(memory_->current_bytes()), format_bytes(o.reserve_bytes),
                   100 * o.margin, format_bytes(limit));
    else
      spdlog::warn("memory.limit auto: no container limit, and /proc/meminfo unreadable: nothing caps this run");
  }
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
