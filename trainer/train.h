// The training run: train() sequences setup, resume, steps, evaluation, checkpoints and logging;
// the step itself (micro-batches, OOM retries, the optimizer update) lives in trainer/step.cpp.
#pragma once

#include <string>

#include "trainer/config.h"

namespace trainer {

struct RunOptions {
  std::string run_dir;      ///< where config, logs, metrics and checkpoints go
  std::string resume_from;  ///< --resume PATH: this checkpoint (no fallback)
  bool no_resume = false;   ///< --no-resume: start fresh; refuse a run folder that has checkpoints
  std::string config_file;  ///< the --config file ("" = the built-in job): named in the run folder's lock file
  /// --wait-for-run-dir: when another process holds the run folder (common/run_lock.h), wait up to this
  /// many seconds for it to let go, then resume from what it saved; 0 refuses at once (exit 2).
  double wait_for_run_dir_s = 0;
};

/// Trains `cfg` into `opts.run_dir`. Returns the process exit code (see trainer/signals.h).
/// Throws std::runtime_error (or ConfigError) with a one-line message for bad input.
int train(const Config& cfg, const RunOptions& opts);

}  // namespace trainer
