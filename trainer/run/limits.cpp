// What the run re-reads between steps: the memory cap (control.yaml; under `memory.limit: auto` what
// LimitFollower follows), agreed over ranks, and the CPUs it may use.
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"

namespace trainer {

void TrainingRun::poll(bool batch_failed) {
  RECORD_USER_SCOPE("trainer.poll");
  poll_memory_limit(batch_failed);
  if (step_ % 50 == 0) poll_threads();
}

void TrainingRun::poll_memory_limit(bool batch_failed) {
  // control.yaml is how an operator (or a container resize hook) changes the cap of a running job; under
  // `auto` the follower also reads again what bounds the cap (limit_follower.h).
  ControlPoll poll = control_->poll();
  if (!poll.warning.empty()) spdlog::warn("{}", poll.warning);
  std::optional<std::string> spec;
  if (poll.update && poll.update->memory_limit) spec = *poll.update->memory_limit;
  limit_->poll(spec, seconds_since(start_time_));
  // Every step, on every rank (a collective in a data-parallel job): one rank's resize moves all.
  const int64_t before = agreed_limit_;
  if (agree_on_limit(batch_failed)) {
    const int64_t live = memory_->current_bytes(), limit = limit_->bytes();
    throw OomGaveUp("out of memory loading the batch of step " + std::to_string(step_ + 1) + " under the memory limit " +
                    (limit ? format_bytes(limit) : std::string("none")) + " (live tensors " +
                    format_bytes(live) + ")" +
                    (input_.batch_oom().empty() ? " on another rank" : ": " + input_.batch_oom()) +
                    "; the weights, the optimizer state and one batch do not fit: raise the memory limit");
  }
  if (agreed_limit_ != before) step_runner_->on_limit_changed(agreed_limit_, step_);
}

bool TrainingRun::agree_on_limit(bool batch_failed) {
  // Every rank's ladder must take the same decisions, so it sees the same inputs: the lowest cap of all
  // ranks (each rank's allocator still enforces its own). The same collective says whether any rank's
  // batch did not fit.
  const int64_t limit = limit_->bytes();
  agreed_limit_ = limit;
  if (!dist_) return batch_failed;
  auto a = dist_->all_max({limit > 0 ? -static_cast<double>(limit) : -1e300, batch_failed ? 1.0 : 0.0},
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
