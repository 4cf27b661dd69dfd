// What the run re-reads between steps: the memory cap (control.yaml; under `memory.limit: auto` what
// LimitFollower follows; RunMemory, run_memory.h), agreed over ranks, and the CPUs it may use.
#include <ATen/record_function.h>
#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"

namespace trainer {

void TrainingRun::poll(bool batch_failed) {
  RECORD_USER_SCOPE("trainer.poll");
  poll_memory_limit(batch_failed);
  if (progress_.step() % 50 == 0) poll_threads();
}

void TrainingRun::poll_memory_limit(bool batch_failed) {
  memory_.poll_limit(progress_.seconds());
  // Every step, on every rank (a collective in a data-parallel job): one rank's resize moves all.
  const int64_t before = memory_.agreed_limit();
  if (memory_.agree_on_limit(batch_failed, ranks_.dist())) {
    const int64_t live = memory_.backend().current_bytes(), limit = memory_.limit().bytes();
    throw OomGaveUp("out of memory loading the batch of step " + std::to_string(progress_.step() + 1) +
                    " under the memory limit " +
                    (limit ? format_bytes(limit) : std::string("none")) + " (live tensors " +
                    format_bytes(live) + ")" +
                    (input_.batch_oom().empty() ? " on another rank" : ": " + input_.batch_oom()) +
                    "; the weights, the optimizer state and one batch do not fit: raise the memory limit");
  }
  if (memory_.agreed_limit() != before) step_runner_->on_limit_changed(memory_.agreed_limit(), progress_.step());
}

void TrainingRun::poll_threads() {
  // The same rule as at setup: the processes of one node share its CPUs.
  const int threads = cpu_threads(cfg_, ranks_.env().local_world_size);
  if (threads != at::get_num_threads()) {
    spdlog::info("cpu: {} -> {} threads (affinity / quota changed)", at::get_num_threads(), threads);
    apply_cpu_threads(threads);
  }
}

}  // namespace trainer
