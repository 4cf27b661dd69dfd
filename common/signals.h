// Signals a training run answers, and the exit codes it ends with.
//
//   SIGTERM   (Kubernetes, SLURM, docker stop: "you are being rescheduled") stop after the current step,
//             save a checkpoint, exit kExitStoppedBySigterm.
//   SIGINT    (Ctrl-C) the same, exit kExitStoppedBySigint. A second SIGINT kills the process at once
//             (default action): the user can always force-quit.
//   SIGUSR1   save a checkpoint after the current step and go on training.
//   SIGUSR2   reserved: log a memory report after the current step.
//
// The handlers only store to lock-free atomics (async-signal-safe); the training loop polls them
// between steps, where saving is safe.
#pragma once

#include <csignal>

namespace trainer {

// ---- exit codes -----------------------------------------------------------------------------------
// A stopped run exits non-zero on purpose: it is not finished, so a scheduler (Kubernetes Job restart
// policy, SLURM --requeue, a shell loop) should start it again, and it resumes from its checkpoint.
// The signal codes follow the shell's 128 + signal number convention.

constexpr int kExitOk = 0;                 ///< training finished
constexpr int kExitError = 1;              ///< any other failure (I/O, a bug, non-finite loss, ...)
constexpr int kExitBadInput = 2;           ///< bad command line, config, or input file; fix it and rerun
constexpr int kExitOomGaveUp = 3;          ///< out of memory even at the smallest micro-batch with recomputation
constexpr int kExitCheckpointFailed = 4;   ///< a checkpoint could not be written (disk full, unwritable folder)
constexpr int kExitStoppedBySigint = 128 + SIGINT;    ///< 130: stopped by SIGINT after saving a checkpoint
constexpr int kExitStoppedBySigterm = 128 + SIGTERM;  ///< 143: stopped by SIGTERM after saving a checkpoint

/// The exit code for a run stopped by `signal` (SIGINT or SIGTERM): 128 + signal.
constexpr int exit_code_for_signal(int signal) { return 128 + signal; }

// ---- handlers -------------------------------------------------------------------------------------

/// Installs the handlers for SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (with SA_RESTART, so interrupted
/// system calls resume) and clears the flags. The previous actions are kept for
/// restore_signal_handlers(). Calling it again re-installs and clears the flags.
void install_signal_handlers();

/// Restores the actions that were in place before install_signal_handlers() and clears the flags.
void restore_signal_handlers();

/// True once SIGTERM or SIGINT arrived: stop after the current step, save, exit.
bool stop_requested();

/// The signal that asked to stop (SIGTERM or SIGINT; the first one that arrived), or 0.
int stop_signal();

/// True if SIGUSR1 arrived since the last call: save a checkpoint now. Clears the request.
bool take_checkpoint_request();

/// True if SIGUSR2 arrived since the last call (reserved for a memory report). Clears the request.
bool take_memory_report_request();

}  // namespace trainer
